"""The JVMs the broker and Kafka's tools run in: which ``java``, its flags, its log4j configuration."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from kvstream.broker.errors import BrokerError

_HERE = Path(__file__).resolve().parent
#: log4j configuration of the broker JVM (its log goes to ``<data_dir>/logs``).
BROKER_LOG4J = _HERE / "log4j2.properties"
#: log4j configuration of the tools' JVMs: only warnings and errors, on stderr.
TOOLS_LOG4J = _HERE / "tools-log4j2.properties"

#: Kafka's own G1 settings (kafka-run-class.sh) plus fail-fast on OOM.
JVM_FLAGS = [
    "-server",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-XX:MaxInlineLevel=15",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
]
#: Kafka's defaults for CLI tools (kafka-run-class.sh).
TOOL_JVM_FLAGS = ["-Xmx256m", "-Djava.awt.headless=true"]


def java_command(main_class: str, jvm_opts: list[str], log4j_config: Path, libs: Path) -> list[str]:
    """Command line running ``main_class`` with all jars of ``libs`` on the classpath."""
    return [java_executable(), *jvm_opts, f"-Dlog4j2.configurationFile={log4j_config}", "-cp", f"{libs}/*", main_class]


def java_executable() -> str:
    """``$JAVA_HOME/bin/java`` if it exists, else ``java`` on PATH; BrokerError if neither."""
    home_java = Path(os.environ.get("JAVA_HOME", "/nonexistent")) / "bin" / "java"
    java = str(home_java) if home_java.exists() else shutil.which("java")
    if java is None:
        raise BrokerError("Kafka needs Java 17 or newer, but there is no $JAVA_HOME/bin/java and no 'java' on PATH.")
    return java
