"""Starting, stopping and the status of the broker of one data directory.

:func:`start` runs a one-node combined KRaft broker (broker + controller in one JVM, 127.0.0.1 only) as a
detached process that outlives the Python process that started it; the data directory's pid file and its
generated server.properties are what :func:`status` and :func:`stop` find it by.
"""

from __future__ import annotations

import itertools
import shlex
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kvstream.broker.config import configured_listener, write_config
from kvstream.broker.errors import BrokerError, log_tail
from kvstream.broker.jars import KAFKA_VERSION, ensure_jars
from kvstream.broker.java import BROKER_LOG4J, JVM_FLAGS, java_command, java_executable
from kvstream.broker.lock import file_lock
from kvstream.broker.ports import port_in_use
from kvstream.broker.process import pid_of, process_alive, terminate_process
from kvstream.broker.security import probe_client
from kvstream.tls import TlsMaterial

DEFAULT_DATA_DIR = Path(".kvstream/broker")
#: Data directory of ``kvstream broker start --nodes N`` (:mod:`kvstream.broker.cluster`).
DEFAULT_CLUSTER_DIR = Path(".kvstream/cluster")


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


def broker_paths(data_dir: Path) -> tuple[Path, Path, Path, Path]:
    """Return (data_dir, server.properties, pid file, log file), all absolute."""
    d = Path(data_dir).expanduser().resolve()
    return d, d / "server.properties", d / "broker.pid", d / "logs" / "broker.out"


def running_pid(data_dir: Path) -> int | None:
    """Pid of the live broker JVM of ``data_dir`` (per its pid file), else None."""
    _, props, pid_file, _ = broker_paths(data_dir)
    return pid_of(pid_file, "kafka.Kafka", str(props))


def answers(bootstrap: str, client: dict | None = None) -> bool:
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


def wait_until_ready(
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
        if answers(bootstrap, client or {}):
            return
        time.sleep(0.25)
    terminate_process(pid, grace_s=10)
    raise BrokerError(
        f"The Kafka broker (pid {pid}) did not answer on {bootstrap} within {timeout_s:g} s and was stopped. "
        f"Last lines of {log_file}:\n{log_tail(log_file)}"
    )


def status(data_dir: Path = DEFAULT_DATA_DIR) -> BrokerStatus:
    """Report the state of the broker of ``data_dir`` (no network access).

    Args:
        data_dir: The broker data directory (relative paths are resolved
            against the current directory).

    Returns:
        A :class:`BrokerStatus`; ``running`` means the broker JVM is alive.
    """
    d, props, _, log_file = broker_paths(data_dir)
    pid = running_pid(d)
    listener = configured_listener(props)
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
            survives restarts. See the :mod:`kvstream.broker` docstring for its layout.
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
    d, props, pid_file, log_file = broker_paths(data_dir)
    probe = probe_client(scram_user, tls, require_client_certificate)
    libs = ensure_jars()
    java_executable()  # fail early and clearly if Java is missing
    bootstrap = f"127.0.0.1:{port}"
    with file_lock(d / ".lock"):
        current = status(d)
        if current.running:
            _check_running_as_asked(current, port, probe)
            wait_until_ready(current.pid, bootstrap, log_file, timeout_s, proc=None, client=probe)
            return status(d)
        pid_file.unlink(missing_ok=True)

        for attempt in itertools.count(1):  # retried only if the controller port was raced away
            _check_port_free(port, d)
            write_config(libs, d, props, port, scram_user, tls, require_client_certificate)
            proc = _launch(libs, d, heap, bootstrap)
            try:
                wait_until_ready(proc.pid, bootstrap, log_file, timeout_s, proc=proc, client=probe)
                return status(d)
            except BrokerError as exc:
                pid_file.unlink(missing_ok=True)
                bind_race = proc.poll() is not None and "Address already in use" in str(exc)
                if not bind_race or attempt == 3:
                    raise
    raise AssertionError("unreachable")  # pragma: no cover


def _check_running_as_asked(current: BrokerStatus, port: int, probe: dict) -> None:
    """BrokerError unless the running broker ``current`` listens on ``port`` with the protocol of ``probe``."""
    d = current.data_dir
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


def _check_port_free(port: int, d: Path) -> None:
    """BrokerError if another process than the broker of ``d`` listens on ``port``."""
    if port_in_use(port):
        raise BrokerError(
            f"Port {port} on 127.0.0.1 is already in use by another process "
            f"(not by the broker of {d}). Pick another port or stop that process."
        )


def _launch(libs: Path, d: Path, heap: str, bootstrap: str) -> subprocess.Popen:
    """Start the broker JVM of ``d`` detached, its output appended to its log after a banner; write its pid file."""
    _, props, pid_file, log_file = broker_paths(d)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as out:
        banner = f"\n===== kvstream: starting Kafka {KAFKA_VERSION} on {bootstrap} at {time.ctime()} =====\n"
        out.write(banner.encode())
        out.flush()
        jvm_opts = [*shlex.split(heap), *JVM_FLAGS, f"-Dkafka.logs.dir={log_file.parent}"]
        proc = subprocess.Popen(
            [*java_command("kafka.Kafka", jvm_opts, BROKER_LOG4J, libs), str(props)],
            cwd=d,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own session: survives the caller and its Ctrl-C
        )
    pid_file.write_text(f"{proc.pid}\n")
    return proc


def stop(data_dir: Path = DEFAULT_DATA_DIR) -> bool:
    """Stop the broker of ``data_dir``.

    Sends SIGTERM (Kafka then shuts down cleanly), waits up to 30 s, then
    sends SIGKILL. Removes the pid file in any case.

    Args:
        data_dir: The broker data directory.

    A data directory holding a cluster (``kvstream broker start --nodes N``) has every node stopped
    (:func:`kvstream.broker.cluster.stop_cluster`).

    Returns:
        True if a running broker (or any node of a cluster) was stopped, False if none was running.
    """
    d, _, pid_file, _ = broker_paths(data_dir)
    if not d.is_dir():
        return False
    if (d / "cluster.json").is_file():
        from kvstream.broker.cluster import stop_cluster

        return stop_cluster(d) > 0
    with file_lock(d / ".lock"):
        pid = running_pid(d)
        if pid is not None:
            terminate_process(pid, grace_s=30)
        pid_file.unlink(missing_ok=True)
    return pid is not None

