"""Embedded single-node Apache Kafka broker for development and tests.

Kafka has no PyPI package, so the broker runs from its jars on Maven Central:
``pom.xml`` (next to this file) lists them, and :func:`ensure_jars` lets Maven
copy them into a per-version cache once. :func:`start` then runs a one-node
combined KRaft broker (broker + controller in one JVM, 127.0.0.1 only) as a
detached process that outlives the Python process that started it.

Layout of a broker data directory (default ``.kvstream/broker``)::

    server.properties   generated from server.properties.in on every start
    broker.pid          pid of the running broker JVM
    data/               Kafka log.dirs (topic data and KRaft metadata)
    logs/broker.out     the broker's stdout and stderr

Requires ``java`` (17+) on PATH or in ``$JAVA_HOME``, and ``mvn`` for the
one-time jar download. Every failure is raised as :class:`BrokerError`.
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import hashlib
import itertools
import os
import re
import shlex
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, overload

from kvstream.tls import TlsMaterial, generate_tls_material, load_tls_material

__all__ = [
    "KAFKA_VERSION",
    "TOOLS",
    "BrokerError",
    "BrokerStatus",
    "ensure_jars",
    "start",
    "stop",
    "status",
    "run_tool",
    "register_cli",
]

_HERE = Path(__file__).resolve().parent
_POM = _HERE / "pom.xml"
_SERVER_TEMPLATE = _HERE / "server.properties.in"
_BROKER_LOG4J = _HERE / "log4j2.properties"
_TOOLS_LOG4J = _HERE / "tools-log4j2.properties"

DEFAULT_DATA_DIR = Path(".kvstream/broker")
_MARKER = ".complete"  # written into the jar directory after a successful download


def _pom_kafka_version() -> str:
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    node = ET.parse(_POM).getroot().find("m:properties/m:kafka.version", ns)
    if node is None or not (node.text or "").strip():
        raise RuntimeError(f"{_POM} has no <properties><kafka.version>")
    return node.text.strip()


#: The Kafka version; its only definition is ``<kafka.version>`` in pom.xml.
KAFKA_VERSION = _pom_kafka_version()

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

# Kafka's own G1 settings (kafka-run-class.sh) plus fail-fast on OOM.
_JVM_FLAGS = [
    "-server",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-XX:MaxInlineLevel=15",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
]
# Kafka's defaults for CLI tools (kafka-run-class.sh).
_TOOL_JVM_FLAGS = ["-Xmx256m", "-Djava.awt.headless=true"]


class BrokerError(RuntimeError):
    """The broker or its jars could not be set up, started, stopped or queried.

    The message is meant for humans and includes the relevant log tail.
    """


@dataclass(frozen=True)
class BrokerStatus:
    """State of the broker belonging to one data directory.

    Attributes:
        running: True if the broker JVM of this data dir is alive (it may still
            be booting; :func:`start` only returns once it answers requests).
        pid: Process id of the broker JVM, or None if not running.
        port: client listener port (TCP, on 127.0.0.1) from the last
            generated server.properties, or None if never started.
        bootstrap_servers: ``"127.0.0.1:<port>"`` for Kafka clients, or None.
        data_dir: Absolute path of the broker data directory.
        log_file: Absolute path of the broker's stdout/stderr log
            (``<data_dir>/logs/broker.out``; may not exist yet).
        kafka_version: Kafka version of the jars, e.g. ``"4.1.2"``.
        security_protocol: Protocol of the client listener on ``port``
            (``PLAINTEXT``, ``SASL_PLAINTEXT``, ``SSL`` or ``SASL_SSL``), or None.
    """

    running: bool
    pid: int | None
    port: int | None
    bootstrap_servers: str | None
    data_dir: Path
    log_file: Path
    kafka_version: str
    # Security protocol of the client listener: PLAINTEXT, SASL_PLAINTEXT, SSL or SASL_SSL (None if never started).
    security_protocol: str | None = None


# --------------------------------------------------------------------------- jars


def default_cache_root() -> Path:
    """Where downloaded jars are cached: ``$KVSTREAM_KAFKA_CACHE``, else ``~/.cache/kvstream``."""
    env = os.environ.get("KVSTREAM_KAFKA_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvstream"


def _jar_dir(cache_dir: Path | None) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_root()
    return root.resolve() / f"kafka-{KAFKA_VERSION}" / "libs"


def _pom_digest() -> str:
    return hashlib.sha256(_POM.read_bytes()).hexdigest()


def _jars_complete(libs: Path) -> bool:
    marker = libs / _MARKER
    return marker.is_file() and marker.read_text().strip() == _pom_digest()


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created if needed) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _tail(text: str, lines: int = 40) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # strip ANSI colours
    return "\n".join(text.rstrip().splitlines()[-lines:])


def ensure_jars(cache_dir: Path | None = None, progress: Callable[[str], object] = print) -> Path:
    """Make sure the Kafka jars are in the local cache and return their directory.

    Args:
        cache_dir: Cache root; the jars go to ``<cache_dir>/kafka-<version>/libs``.
            Default: ``$KVSTREAM_KAFKA_CACHE`` if set, else ``~/.cache/kvstream``.
        progress: Called with one human-readable line before and after a
            download (nothing is reported when the cache is already complete).

    Returns:
        Absolute path of the directory holding all jars (use it as ``<dir>/*``
        on a Java classpath).

    Raises:
        BrokerError: ``mvn`` is not installed, or Maven failed (the message
            ends with the tail of Maven's output).

    The cache is complete when its marker file holds the SHA-256 of pom.xml, so
    a second call neither downloads anything nor starts Maven, and an edited
    pom.xml triggers a fresh download. Downloads go to a temporary directory
    that replaces the old one only on success; a file lock serialises
    concurrent callers. About 55 MB, a few seconds to a minute on first use.
    """
    libs = _jar_dir(cache_dir)
    if _jars_complete(libs):
        return libs
    with file_lock(libs.parent / ".lock"):
        if _jars_complete(libs):  # another process finished while we waited
            return libs
        java_executable()  # Maven needs Java too; fail with the clearer message first
        mvn = shutil.which("mvn")
        if mvn is None:
            raise BrokerError(
                "Apache Maven ('mvn') is needed once to download the Kafka jars, "
                "but it is not on PATH. Install it (e.g. 'apt-get install maven')."
            )
        tmp = libs.parent / f"libs.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        progress(f"Downloading Kafka {KAFKA_VERSION} jars with Maven into {libs} (one-time, ~55 MB)...")
        started = time.monotonic()
        cmd = [mvn, "-B", "-q", "-Dstyle.color=never", "-f", str(_POM), "dependency:copy-dependencies"]
        cmd += ["-DincludeScope=runtime", f"-DoutputDirectory={tmp}"]
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if proc.returncode != 0 or not any(tmp.glob("kafka_2.13-*.jar")):
            shutil.rmtree(tmp, ignore_errors=True)
            raise BrokerError(
                f"Maven failed to download the Kafka {KAFKA_VERSION} jars "
                f"(exit code {proc.returncode}; command: {shlex.join(cmd)}).\n"
                f"Last lines of Maven's output:\n{_tail(proc.stdout + proc.stderr)}"
            )
        (tmp / _MARKER).write_text(_pom_digest() + "\n")
        shutil.rmtree(libs, ignore_errors=True)
        tmp.rename(libs)
        size_mb = sum(p.stat().st_size for p in libs.iterdir()) / 1e6
        progress(f"Kafka jars ready: {size_mb:.0f} MB in {time.monotonic() - started:.1f} s")
    return libs


def _java_cmd(main_class: str, jvm_opts: list[str], log4j_config: Path, libs: Path) -> list[str]:
    """Command line running ``main_class`` with all jars of ``libs`` on the classpath."""
    return [java_executable(), *jvm_opts, f"-Dlog4j2.configurationFile={log4j_config}", "-cp", f"{libs}/*", main_class]


def java_executable() -> str:
    """``$JAVA_HOME/bin/java`` if it exists, else ``java`` on PATH; BrokerError if neither."""
    home_java = Path(os.environ.get("JAVA_HOME", "/nonexistent")) / "bin" / "java"
    java = str(home_java) if home_java.exists() else shutil.which("java")
    if java is None:
        raise BrokerError("Kafka needs Java 17 or newer, but there is no $JAVA_HOME/bin/java and no 'java' on PATH.")
    return java


# --------------------------------------------------------------------------- process helpers


def _paths(data_dir: Path) -> tuple[Path, Path, Path, Path]:
    """Return (data_dir, server.properties, pid file, log file), all absolute."""
    d = Path(data_dir).expanduser().resolve()
    return d, d / "server.properties", d / "broker.pid", d / "logs" / "broker.out"


def process_alive(pid: int) -> bool:
    """True if process ``pid`` exists and is not a zombie (reaps our own children)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False  # was our child and has just been reaped
    except ChildProcessError:
        pass  # not our child
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _running_pid(data_dir: Path) -> int | None:
    """Pid of the live broker JVM of ``data_dir`` (per its pid file), else None."""
    _, props, pid_file, _ = _paths(data_dir)
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if not process_alive(pid):
        return None
    try:  # guard against pid reuse: the process must be *this* broker
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"kafka.Kafka" not in cmdline or str(props).encode() not in cmdline:
            return None
    except OSError:
        pass  # no /proc: trust the pid file
    return pid


def _configured_listener(props: Path) -> tuple[str, int] | None:
    """(security protocol, port) of the client listener in the last generated server.properties, or None."""
    try:
        m = re.search(r"^advertised\.listeners=((?:SASL_)?(?:PLAINTEXT|SSL))://[^:]+:(\d+)", props.read_text(), re.M)
    except OSError:
        return None
    return (m.group(1), int(m.group(2))) if m else None


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that were free a moment ago (held open together while chosen)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port_range(n: int, attempts: int = 50) -> int:
    """The first of ``n`` consecutive TCP ports on 127.0.0.1 that were all free a moment ago (for publishers
    that bind ``base + rank``, as vLLM's data-parallel ranks do).

    Raises:
        RuntimeError: no such range found in ``attempts`` tries.
    """
    for _ in range(attempts):
        base = free_port()
        if base + n <= 65536 and not any(port_in_use(port) for port in range(base + 1, base + n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports found on 127.0.0.1")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for brokers, workers and publishers)."""
    return free_ports(1)[0]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True if ``host:port`` cannot be bound, i.e. something listens there (SO_REUSEADDR ignores TIME_WAIT,
    like Java and aiohttp)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _answers(bootstrap: str, client: dict | None = None) -> bool:
    """True if a Kafka broker at ``bootstrap`` returns metadata within ~1 s."""
    host, port = bootstrap.rsplit(":", 1)
    try:  # cheap TCP probe first: keeps librdkafka from logging "connection refused"
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return False
    from confluent_kafka.admin import AdminClient

    try:
        AdminClient({"bootstrap.servers": bootstrap, **(client or {})}).list_topics(timeout=1)
        return True
    except Exception:  # KafkaException while the broker is still starting
        return False


def log_tail(log_file: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file, ANSI colours stripped; a placeholder if it cannot be read."""
    try:
        return _tail(log_file.read_text(errors="replace"), lines)
    except OSError:
        return "(no log output)"


# --------------------------------------------------------------------------- public API


def status(data_dir: Path = DEFAULT_DATA_DIR) -> BrokerStatus:
    """Report the state of the broker of ``data_dir`` (no network access).

    Args:
        data_dir: The broker data directory (relative paths are resolved
            against the current directory).

    Returns:
        A :class:`BrokerStatus`; ``running`` means the broker JVM is alive.
    """
    d, props, _, log_file = _paths(data_dir)
    pid = _running_pid(d)
    listener = _configured_listener(props)
    port = listener[1] if listener else None
    return BrokerStatus(
        running=pid is not None,
        pid=pid,
        port=port,
        bootstrap_servers=f"127.0.0.1:{port}" if port else None,
        data_dir=d,
        log_file=log_file,
        kafka_version=KAFKA_VERSION,
        security_protocol=listener[0] if listener else None,
    )


def start(
    port: int = 9092,
    data_dir: Path = DEFAULT_DATA_DIR,
    timeout_s: float = 90,
    heap: str = "-Xms512m -Xmx1g",
    scram_user: tuple[str, str] | None = None,
    tls: TlsMaterial | None = None,
    require_client_certificate: bool = False,
) -> BrokerStatus:
    """Start the broker of ``data_dir`` on 127.0.0.1:``port`` and wait until it answers.

    Args:
        port: TCP port of the PLAINTEXT listener clients connect to. The KRaft
            controller gets another free port, picked on each start.
        data_dir: Broker data directory (created if missing); topic data
            survives restarts. See the module docstring for its layout.
        timeout_s: Seconds to wait for the broker to answer a metadata request
            (excluding the one-time jar download).
        heap: JVM heap options, split like a shell command line.
        scram_user: ``(name, password)``: clients must then authenticate with SASL SCRAM-SHA-512 on
            ``port`` (SASL_PLAINTEXT); the user is created when the storage is formatted (a data dir
            formatted without it keeps no user). Brokers talk to each other on a PLAINTEXT listener of
            their own.
        tls: serve TLS on ``port`` with this material (:func:`kvstream.tls.generate_tls_material`):
            the listener is ``SSL``, or ``SASL_SSL`` together with ``scram_user``. The broker presents
            ``tls.broker_certificate`` (its key is written inline into server.properties, mode 0600).
        require_client_certificate: with ``tls``: clients must also present a certificate signed by
            ``tls.ca_certificate`` (mutual TLS, ``ssl.client.auth=required``).

    Returns:
        The broker's :class:`BrokerStatus`. If the broker of this data dir is
        already running on ``port``, it is not restarted (waiting for it to
        answer if it is still booting).

    Raises:
        BrokerError: Java/Maven missing or jar download failed; ``port`` is
            taken by another process; this data dir's broker already runs on a
            different port or with another security protocol; storage formatting
            failed; the broker died during start-up or did not answer within
            ``timeout_s`` (it is then stopped).
            Messages include the tail of the relevant log.
        ValueError: ``require_client_certificate`` without ``tls``.

    The broker runs in its own session (it survives the caller) with
    stdout/stderr in ``<data_dir>/logs/broker.out``; stop it with :func:`stop`.
    """
    if require_client_certificate and tls is None:
        raise ValueError("require_client_certificate needs tls (the client certificates are checked against its CA)")
    d, props, pid_file, log_file = _paths(data_dir)
    probe = _probe_client(scram_user, tls, require_client_certificate)
    libs = ensure_jars()
    java_executable()  # fail early and clearly if Java is missing
    bootstrap = f"127.0.0.1:{port}"
    with file_lock(d / ".lock"):
        current = status(d)
        if current.running:
            if current.port != port:
                raise BrokerError(
                    f"The broker of {d} is already running on port {current.port} (pid {current.pid}), "
                    f"not on {port}. Stop it first: kvstream broker stop --data-dir {d}"
                )
            wanted = probe.get("security.protocol", "PLAINTEXT")
            if current.security_protocol != wanted:
                raise BrokerError(
                    f"The broker of {d} is already running with security protocol {current.security_protocol} "
                    f"(pid {current.pid}), not {wanted}. Stop it first: kvstream broker stop --data-dir {d}"
                )
            _wait_until_ready(current.pid, bootstrap, log_file, timeout_s, proc=None, client=probe)
            return status(d)
        pid_file.unlink(missing_ok=True)

        for attempt in itertools.count(1):  # retried only if the controller port was raced away
            if port_in_use(port):
                raise BrokerError(
                    f"Port {port} on 127.0.0.1 is already in use by another process "
                    f"(not by the broker of {d}). Pick another port or stop that process."
                )
            controller_port = free_port()
            while controller_port == port:
                controller_port = free_port()
            _write_server_properties(props, port, controller_port, d / "data")
            if scram_user is not None or tls is not None:
                _secure_client_listener(props, port, scram=scram_user is not None, tls=tls,
                                        require_client_certificate=require_client_certificate)
            _format_storage(libs, props, d, scram_user)
            log_file.parent.mkdir(parents=True, exist_ok=True)
            with open(log_file, "ab") as out:
                banner = f"\n===== kvstream: starting Kafka {KAFKA_VERSION} on {bootstrap} at {time.ctime()} =====\n"
                out.write(banner.encode())
                out.flush()
                jvm_opts = [*shlex.split(heap), *_JVM_FLAGS, f"-Dkafka.logs.dir={log_file.parent}"]
                proc = subprocess.Popen(
                    [*_java_cmd("kafka.Kafka", jvm_opts, _BROKER_LOG4J, libs), str(props)],
                    cwd=d,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # own session: survives the caller and its Ctrl-C
                )
            pid_file.write_text(f"{proc.pid}\n")
            try:
                _wait_until_ready(proc.pid, bootstrap, log_file, timeout_s, proc=proc, client=probe)
                return status(d)
            except BrokerError as exc:
                pid_file.unlink(missing_ok=True)
                bind_race = proc.poll() is not None and "Address already in use" in str(exc)
                if not bind_race or attempt == 3:
                    raise
    raise AssertionError("unreachable")  # pragma: no cover


def _write_server_properties(props: Path, port: int, controller_port: int, log_dirs: Path) -> None:
    template = string.Template(_SERVER_TEMPLATE.read_text())
    props.parent.mkdir(parents=True, exist_ok=True)
    props.write_text(template.substitute(port=port, controller_port=controller_port, log_dirs=log_dirs))


def _probe_client(scram_user: tuple[str, str] | None, tls: TlsMaterial | None,
                  require_client_certificate: bool) -> dict:
    """librdkafka settings that reach the client listener :func:`start` configures (none for PLAINTEXT)."""
    client: dict = {}
    if scram_user is not None:
        client.update({"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-512",
                       "sasl.username": scram_user[0], "sasl.password": scram_user[1]})
    if tls is not None:
        client.update({"security.protocol": "SASL_SSL" if scram_user is not None else "SSL",
                       "ssl.ca.location": str(tls.ca_certificate)})
        if require_client_certificate:
            client.update({"ssl.certificate.location": str(tls.client_certificate),
                           "ssl.key.location": str(tls.client_key), "ssl.key.password": tls.client_key_password})
    return client


def _properties_value(text: str) -> str:
    """``text`` escaped as a java.util.Properties value on one line (PEM blocks keep their newlines)."""
    return text.strip().replace("\\", "\\\\").replace("\n", "\\n")


def _secure_client_listener(props: Path, port: int, *, scram: bool, tls: TlsMaterial | None,
                            require_client_certificate: bool) -> None:
    """Make the client listener on ``port`` SASL_PLAINTEXT, SSL or SASL_SSL; brokers get a PLAINTEXT one of their own.

    SASL means SCRAM-SHA-512 (users come from the storage format, see :func:`_format_storage`). TLS uses
    PEM material inline (``ssl.keystore.type=PEM``: no keytool, no keystore password; the file is made
    readable by its owner only) and trusts ``tls.ca_certificate`` for client certificates.
    """
    protocol = ("SASL_" if scram else "") + ("SSL" if tls is not None else "PLAINTEXT")
    internal_port = free_port()
    lines = []
    for line in props.read_text().splitlines():
        if line.startswith("listeners="):
            line = line.replace(f"PLAINTEXT://127.0.0.1:{port}",
                                f"{protocol}://127.0.0.1:{port},INTERNAL://127.0.0.1:{internal_port}")
        elif line.startswith("advertised.listeners="):
            line = f"advertised.listeners={protocol}://127.0.0.1:{port},INTERNAL://127.0.0.1:{internal_port}"
        elif line.startswith("inter.broker.listener.name="):
            line = "inter.broker.listener.name=INTERNAL"
        elif line.startswith("listener.security.protocol.map="):
            line = f"listener.security.protocol.map=CONTROLLER:PLAINTEXT,INTERNAL:PLAINTEXT,{protocol}:{protocol}"
        lines.append(line)
    if scram:
        lines.append("sasl.enabled.mechanisms=SCRAM-SHA-512")
        # the server side of SCRAM needs a login module but no credentials of its own (brokers use INTERNAL)
        lines.append(f"listener.name.{protocol.lower()}.scram-sha-512.sasl.jaas.config="
                     "org.apache.kafka.common.security.scram.ScramLoginModule required;")
    if tls is not None:
        chain = tls.broker_certificate.read_text().strip() + "\n" + tls.ca_certificate.read_text().strip()
        lines += [
            "ssl.keystore.type=PEM",
            f"ssl.keystore.certificate.chain={_properties_value(chain)}",
            f"ssl.keystore.key={_properties_value(tls.broker_key.read_text())}",
            "ssl.truststore.type=PEM",
            f"ssl.truststore.location={tls.ca_certificate}",
            f"ssl.client.auth={'required' if require_client_certificate else 'none'}",
        ]
    props.chmod(0o600)
    props.write_text("\n".join(lines) + "\n")


def _format_storage(libs: Path, props: Path, d: Path, scram_user: tuple[str, str] | None = None) -> None:
    """Format the KRaft storage of ``d`` once (a new cluster id); no-op if already formatted."""
    if (d / "data" / "meta.properties").exists():
        return
    cluster_id = "-"
    while cluster_id.startswith("-"):  # same format as StorageTool random-uuid, no leading '-'
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
    cmd = _java_cmd("kafka.tools.StorageTool", _TOOL_JVM_FLAGS, _TOOLS_LOG4J, libs)
    cmd += ["format", "--ignore-formatted", "-t", cluster_id, "-c", str(props)]
    if scram_user is not None:  # KRaft keeps SCRAM users in its metadata: they are created with the cluster
        cmd += ["--add-scram", f"SCRAM-SHA-512=[name={scram_user[0]},password={scram_user[1]}]"]
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BrokerError(f"Formatting the Kafka storage in {d / 'data'} failed:\n{_tail(proc.stdout + proc.stderr)}")


def _wait_until_ready(
    pid: int, bootstrap: str, log_file: Path, timeout_s: float, proc: subprocess.Popen | None,
    client: dict | None = None,
) -> None:
    """Poll until ``bootstrap`` answers; BrokerError if ``pid`` dies or ``timeout_s`` passes (then stop it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = proc.poll() is not None if proc is not None else not process_alive(pid)
        if dead:
            code = f" with exit code {proc.returncode}" if proc is not None else ""
            raise BrokerError(
                f"The Kafka broker (pid {pid}) exited{code} during start-up. "
                f"Last lines of {log_file}:\n{log_tail(log_file)}"
            )
        if _answers(bootstrap, client or {}):
            return
        time.sleep(0.25)
    terminate_process(pid, grace_s=10)
    raise BrokerError(
        f"The Kafka broker (pid {pid}) did not answer on {bootstrap} within {timeout_s:g} s and was stopped. "
        f"Last lines of {log_file}:\n{log_tail(log_file)}"
    )


def terminate_process(pid: int, grace_s: float) -> None:
    """SIGTERM ``pid``, wait up to ``grace_s`` seconds, then SIGKILL it."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not process_alive(pid):
                return
            time.sleep(0.1)


def stop(data_dir: Path = DEFAULT_DATA_DIR) -> bool:
    """Stop the broker of ``data_dir``.

    Sends SIGTERM (Kafka then shuts down cleanly), waits up to 30 s, then
    sends SIGKILL. Removes the pid file in any case.

    Args:
        data_dir: The broker data directory.

    Returns:
        True if a running broker was stopped, False if none was running.
    """
    d, _, pid_file, _ = _paths(data_dir)
    if not d.is_dir():
        return False
    with file_lock(d / ".lock"):
        pid = _running_pid(d)
        if pid is not None:
            terminate_process(pid, grace_s=30)
        pid_file.unlink(missing_ok=True)
    return pid is not None


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
    cmd = [*_java_cmd(main_class, _TOOL_JVM_FLAGS, _TOOLS_LOG4J, ensure_jars()), *args]
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


# --------------------------------------------------------------------------- CLI


def _print_status(st: BrokerStatus) -> None:
    state = f"running (pid {st.pid})" if st.running else "not running"
    print(f"Kafka {st.kafka_version} broker: {state}")
    print(f"  bootstrap servers: {st.bootstrap_servers or '-'}")
    print(f"  security protocol: {st.security_protocol or '-'}")
    print(f"  data dir:          {st.data_dir}")
    print(f"  log file:          {st.log_file}")


def _cli_tls_material(tls_dir: Path) -> TlsMaterial:
    """The material of ``tls_dir``: loaded if it has a CA certificate, else generated there."""
    if (tls_dir / "ca.pem").exists():
        return load_tls_material(tls_dir)
    material = generate_tls_material(tls_dir)
    print(f"Generated a throwaway CA, a broker certificate (localhost, 127.0.0.1) and a client certificate "
          f"in {material.ca_certificate.parent}")
    return material


def _cli_start(args: argparse.Namespace) -> int:
    if args.tls_client_auth and args.tls_dir is None:
        print("error: --tls-client-auth needs --tls-dir", file=sys.stderr)
        return 2
    try:
        tls = _cli_tls_material(args.tls_dir) if args.tls_dir is not None else None
        st = start(port=args.port, data_dir=args.data_dir, timeout_s=args.timeout, heap=args.heap, tls=tls,
                   require_client_certificate=args.tls_client_auth)
    except (BrokerError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _print_status(st)
    if tls is not None:  # what a client needs; the key password stays in its file
        print("  clients need:")
        print(f"    export KVSTREAM_SECURITY_PROTOCOL=SSL KVSTREAM_SSL_CA_LOCATION={tls.ca_certificate}")
        if args.tls_client_auth:
            print(f"    export KVSTREAM_SSL_CERTIFICATE_LOCATION={tls.client_certificate}")
            print(f"    export KVSTREAM_SSL_KEY_LOCATION={tls.client_key}")
            print(f"    export KVSTREAM_SSL_KEY_PASSWORD=\"$(cat {tls.client_key_password_file})\"")
    return 0


def _cli_stop(args: argparse.Namespace) -> int:
    stopped = stop(args.data_dir)
    print(f"Stopped the broker of {Path(args.data_dir).resolve()}." if stopped else "No broker was running.")
    return 0


def _cli_status(args: argparse.Namespace) -> int:
    st = status(args.data_dir)
    _print_status(st)
    return 0 if st.running else 1


def _cli_tool(args: argparse.Namespace) -> int:
    try:
        return run_tool(args.name, args.args)
    except BrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``broker`` command (``start|stop|status|tool``) to an argparse subparsers object.

    Every leaf parser sets ``func``: the main CLI should call ``args.func(args)``
    and exit with its return value (0 = success).

    Args:
        subparsers: The object returned by ``parser.add_subparsers()``.

    Returns:
        The ``broker`` parser.
    """
    broker = subparsers.add_parser(
        "broker",
        help=f"run a local single-node Kafka {KAFKA_VERSION} broker (no Docker needed)",
        description=(
            f"Run a local single-node Apache Kafka {KAFKA_VERSION} broker (KRaft, 127.0.0.1 only) "
            "from jars downloaded once with Maven, and Kafka's own CLI tools. "
            "Needs java 17+; mvn for the first download."
        ),
    )
    sub = broker.add_subparsers(dest="broker_command", metavar="{start,stop,status,tool}", required=True)

    def add_data_dir(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--data-dir",
            type=Path,
            default=DEFAULT_DATA_DIR,
            metavar="DIR",
            help="broker data directory: config, pid file, topic data, logs/broker.out (default: %(default)s)",
        )

    p = sub.add_parser(
        "start",
        help="start the broker in the background and wait until it answers",
        description="Start the broker detached (it keeps running after this command exits) and wait until it "
        "answers metadata requests; the first start downloads the jars. Does nothing if it already runs.",
    )
    p.add_argument("--port", type=int, default=9092, help="client port on 127.0.0.1 (default: %(default)s)")
    add_data_dir(p)
    p.add_argument("--timeout", type=float, default=90, metavar="SECONDS", help="start-up timeout (default: 90)")
    p.add_argument("--heap", default="-Xms512m -Xmx1g", metavar="JVM_OPTS", help="JVM heap (default: %(default)s)")
    p.add_argument("--tls-dir", type=Path, metavar="DIR",
                   help="serve TLS (security protocol SSL) on --port with the PEM files of DIR: ca.pem, broker.pem, "
                   "broker-key.pem, client.pem, client-key.pem, client-key.password; if DIR has no ca.pem, a "
                   "throwaway CA and certificates for localhost/127.0.0.1 are generated there first. Clients "
                   "then need KVSTREAM_SECURITY_PROTOCOL=SSL and KVSTREAM_SSL_CA_LOCATION=DIR/ca.pem")
    p.add_argument("--tls-client-auth", action="store_true",
                   help="with --tls-dir: require client certificates signed by DIR/ca.pem (mutual TLS); clients "
                   "also need KVSTREAM_SSL_CERTIFICATE_LOCATION, KVSTREAM_SSL_KEY_LOCATION, "
                   "KVSTREAM_SSL_KEY_PASSWORD")
    p.set_defaults(func=_cli_start)

    p = sub.add_parser(
        "stop",
        help="stop the broker (SIGTERM, SIGKILL after 30 s)",
        description="Stop the broker cleanly with SIGTERM; kill it if it is still running after 30 s.",
    )
    add_data_dir(p)
    p.set_defaults(func=_cli_stop)

    p = sub.add_parser(
        "status",
        help="show whether the broker runs (exit code 0 if running, else 1)",
        description="Print running state, pid, bootstrap servers and log file. Exit code 0 if running, 1 if not.",
    )
    add_data_dir(p)
    p.set_defaults(func=_cli_status)

    p = sub.add_parser(
        "tool",
        help="run a Kafka CLI tool, e.g. 'tool topics --bootstrap-server 127.0.0.1:9092 --list'",
        description="Run one of Kafka's own command-line tools from the same jars. All arguments after NAME "
        "go to the tool; 'tool NAME --help' shows the tool's own help. Exits with the tool's exit code.",
        epilog="NAME is one of: " + ", ".join(TOOLS) + "; or a fully qualified Java main class.",
    )
    p.add_argument("name", metavar="NAME", help="tool name (see below)")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments passed to the tool")
    p.set_defaults(func=_cli_tool)
    return broker
