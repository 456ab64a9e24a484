"""Kafka's own command-line tools (topics, consumer groups, ...), run from the same jars as the broker."""

from __future__ import annotations

import subprocess
from typing import Literal, overload

from kvstream.broker.errors import BrokerError
from kvstream.broker.jars import ensure_jars
from kvstream.broker.java import TOOL_JVM_FLAGS, TOOLS_LOG4J, java_command

#: Short tool name -> main class in the Kafka jars (all verified for 4.1.2).
TOOLS = {
    "topics": "org.apache.kafka.tools.TopicCommand",
    "console-consumer": "org.apache.kafka.tools.consumer.ConsoleConsumer",
    "console-producer": "org.apache.kafka.tools.ConsoleProducer",
    "consumer-groups": "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
    "configs": "kafka.admin.ConfigCommand",  # still Scala, in kafka_2.13, in 4.1
    "get-offsets": "org.apache.kafka.tools.GetOffsetShell",
    "metadata-quorum": "org.apache.kafka.tools.MetadataQuorumCommand",
    "features": "org.apache.kafka.tools.FeatureCommand",
    "producer-perf-test": "org.apache.kafka.tools.ProducerPerformance",
    "consumer-perf-test": "org.apache.kafka.tools.ConsumerPerformance",
    "storage": "kafka.tools.StorageTool",
}


@overload
def run_tool(
    tool: str, args: list[str], *, capture: Literal[False] = False, timeout_s: float | None = None
) -> int: ...
@overload
def run_tool(
    tool: str, args: list[str], *, capture: Literal[True], timeout_s: float | None = None
) -> subprocess.CompletedProcess[str]: ...
def run_tool(
    tool: str, args: list[str], *, capture: bool = False, timeout_s: float | None = None
) -> int | subprocess.CompletedProcess[str]:
    """Run one of Kafka's own CLI tools from the cached jars (a fresh JVM, ~1-3 s).

    Args:
        tool: A short name from :data:`TOOLS` (``topics``, ``console-consumer``,
            ``console-producer``, ``consumer-groups``, ``configs``,
            ``get-offsets``, ``metadata-quorum``, ``features``,
            ``producer-perf-test``, ``consumer-perf-test``, ``storage``) or a
            fully qualified main class name.
        args: The tool's own arguments, e.g.
            ``["--bootstrap-server", "127.0.0.1:9092", "--list"]``.
        capture: If False, the tool shares this process's stdin/stdout/stderr
            and the exit code is returned. If True, stdout and stderr are
            captured as text and the :class:`subprocess.CompletedProcess` is returned.
        timeout_s: Kill the tool after this many seconds
            (raises :class:`subprocess.TimeoutExpired`); None waits forever.

    Returns:
        The exit code, or the CompletedProcess when ``capture`` is True.

    Raises:
        BrokerError: Unknown tool name, Java missing or jar download failed.

    The JVM gets ``-Xmx256m`` and a log4j config that prints only warnings and
    errors, on stderr.
    """
    main_class = TOOLS.get(tool, tool if "." in tool else None)
    if main_class is None:
        raise BrokerError(f"Unknown Kafka tool {tool!r}. Known tools: {', '.join(TOOLS)}.")
    cmd = [*java_command(main_class, TOOL_JVM_FLAGS, TOOLS_LOG4J, ensure_jars()), *args]
    if capture:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    proc = subprocess.Popen(cmd)
    try:
        return proc.wait(timeout=timeout_s)
    except KeyboardInterrupt:  # the tool got the SIGINT too: give it time for its clean shutdown
        return proc.wait(timeout=10)
    finally:
        if proc.poll() is None:  # timeout or a second Ctrl-C
            proc.kill()
            proc.wait()
