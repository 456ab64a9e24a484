"""The run environment of a chaos run: its own broker, the workers and bridges it starts and kills, and its
producers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from kafka_io.admin import ensure_topics
from kvstream import broker
from kvstream.worker import spawn_worker, stop_worker, wait_until_consumed
from producers.kafka_sink import KvEventProducer, ProduceError
from schemas.topics import KV_EVENTS, KV_EVENTS_DEAD_LETTER
from stream_apps.settings import WorkerSettings

#: Faust's consumer session timeout for the workers of a chaos run, in seconds (Faust's default is 60). A
#: SIGKILLed worker never leaves its group; its partitions go to the others (or its restart) only after it.
SESSION_TIMEOUT_S = 6


#: Environment of every worker a chaos run starts (Faust reads these settings from the environment).
WORKER_ENV = {"BROKER_SESSION_TIMEOUT": str(SESSION_TIMEOUT_S), "BROKER_HEARTBEAT_INTERVAL": "1"}


def http_json(url: str, timeout_s: float = 30.0) -> tuple[int, dict]:
    """GET ``url``; returns (HTTP status, decoded JSON body). Raises OSError when no HTTP answer came."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return exc.code, json.loads(body)
        except ValueError:
            return exc.code, {"error": body[:200].decode(errors="replace")}


class RunEnv:
    """One run's isolated world: a fresh broker (own data dir, free port) and everything the run spawns.

    Use as a context manager: entering starts the broker and creates ``kv-events``; leaving stops every
    worker and child process still running, then the broker.

    Args:
        nodes: 1 for one broker; more for a local KRaft cluster of that many nodes
            (:func:`kvstream.broker.start_cluster`, data dir ``<run dir>/broker``, nodes 1..N), whose nodes a run
            fails with :func:`kvstream.broker.kill_node` and :func:`kvstream.broker.restart_node`.
    """

    def __init__(self, run_dir: Path, partitions: int, log=print, nodes: int = 1) -> None:
        self.dir = run_dir
        self.partitions = partitions
        self.log = log
        self.nodes = nodes
        self.broker_dir = run_dir / "broker"
        self.port = 0
        self.bootstrap = ""
        self.workers: list[Worker] = []
        self.children: list[subprocess.Popen] = []

    def __enter__(self) -> RunEnv:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        if self.nodes > 1:
            self.port = broker.free_port_range(2 * self.nodes)
            status = broker.start_cluster(nodes=self.nodes, port=self.port, data_dir=self.broker_dir, timeout_s=240)
        else:
            self.port = broker.free_port()
            status = broker.start(port=self.port, data_dir=self.broker_dir)
        self.bootstrap = status.bootstrap_servers
        ensure_topics(self.bootstrap, {KV_EVENTS: self.partitions, KV_EVENTS_DEAD_LETTER: 1})
        return self

    def __exit__(self, *exc) -> None:
        for worker in self.workers:
            worker.stop()
        for child in self.children:
            if child.poll() is None:
                _kill_group(child, signal.SIGKILL)
        broker.stop(self.broker_dir)  # every node of a cluster

    def worker(self, name: str, app_id: str, *, store: str = "memory://", data_dir: Path | None = None,
               web_port: int | None = None, standby_replicas: int = 0, source_lease_s: float = 86_400.0,
               source_expiry_s: float | None = None) -> Worker:
        """Spawn a worker (log ``<run dir>/<name>.log``, data dir ``<run dir>/<name>`` unless given).

        Args:
            source_lease_s: the worker's ``--source-lease-s``, seconds. A day by default: the fleet scenarios'
                sources publish once and are checked long after (engine-crash gives its own short one).
            source_expiry_s: the worker's ``--source-expiry-s``, seconds (0: never); None: the settings' default.
        """
        expiry = {} if source_expiry_s is None else {"source_expiry_s": source_expiry_s}
        options = WorkerSettings(bootstrap_servers=self.bootstrap, web_port=web_port or broker.free_port(),
                                data_dir=data_dir or self.dir / name, store=store, partitions=self.partitions,
                                app_id=app_id, standby_replicas=standby_replicas, source_lease_s=source_lease_s,
                                **expiry)
        worker = Worker(options, self.dir / f"{name}.log")
        worker.start()
        self.workers.append(worker)
        return worker


class Worker:
    """A stream-app worker child process (:func:`kvstream.worker.spawn_worker`) and its HTTP views."""

    def __init__(self, options: WorkerSettings, log_file: Path) -> None:
        self.options = options
        self.log_file = log_file
        self.process: subprocess.Popen | None = None
        #: time.monotonic() of the last start.
        self.started = 0.0
        #: Size of the log file at the last start (what this incarnation logged comes after it).
        self.log_offset = 0

    @property
    def url(self) -> str:
        """Base URL of the worker's HTTP views."""
        return f"http://127.0.0.1:{self.options.web_port}"

    def start(self) -> None:
        """Start (or restart, same options) the worker process."""
        self.log_offset = self.log_file.stat().st_size if self.log_file.exists() else 0
        self.process = spawn_worker(self.options, self.log_file, extra_env=WORKER_ENV)
        self.started = time.monotonic()

    def alive(self) -> bool:
        """True while the process runs."""
        return self.process is not None and self.process.poll() is None

    def stats(self) -> dict | None:
        """The worker's ``GET /stats/`` answer, or None when it does not answer."""
        try:
            status, body = http_json(f"{self.url}/stats/", timeout_s=5)
        except (OSError, ValueError):
            return None
        return body if status == 200 else None

    def log_since_start(self) -> str:
        """What this incarnation has logged so far."""
        with open(self.log_file, "rb") as log:
            log.seek(self.log_offset)
            return log.read().decode(errors="replace")

    def wait_ready(self, timeout_s: float) -> float:
        """Wait until Faust logged ``Worker ready`` (tables recovered, streams resumed) and the views answer.

        Returns:
            Seconds since the start.

        Raises:
            RuntimeError: the worker exited. TimeoutError: not ready within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"worker {self.options.app_id} on :{self.options.web_port} exited with code "
                                   f"{self.process.returncode}; last lines of {self.log_file}:\n"
                                   + self.tail())
            if "Worker ready" in self.log_since_start() and self.stats() is not None:
                return time.monotonic() - self.started
            time.sleep(0.2)
        raise TimeoutError(f"worker on :{self.options.web_port} not ready after {timeout_s:.0f}s; "
                           f"last lines of {self.log_file}:\n" + self.tail())

    def tail(self, lines: int = 15) -> str:
        """The last lines of the log file."""
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the worker's process group (no clean shutdown, no commit, no LeaveGroup)."""
        if self.alive():
            _kill_group(self.process, signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM (Faust shuts down cleanly and leaves the group), SIGKILL after 30 s."""
        if self.process is not None:
            stop_worker(self.process)


def _kill_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
    if sig == signal.SIGKILL:
        process.wait()


class PacedProducer(threading.Thread):
    """Produce records through a :class:`KvEventProducer` in a thread, at most ``rate`` records per second.

    After :meth:`join`, ``stats`` holds the producer's counters and ``error`` the
    :class:`ProduceError` text if not every message was acknowledged.

    Args:
        rate: records per second; None for as fast as possible.
        flush_timeout_s: how long the final flush may wait for acknowledgements.
    """

    def __init__(self, bootstrap: str, records: list[dict], rate: float | None,
                 flush_timeout_s: float = 300.0) -> None:
        super().__init__(daemon=True)
        self.records = records
        self.rate = rate
        self.flush_timeout_s = flush_timeout_s
        self.producer = KvEventProducer(bootstrap, KV_EVENTS)
        self.stats = self.producer.stats
        #: Records handed to the producer so far.
        self.sent_records = 0
        self.error: str | None = None

    def run(self) -> None:
        started = time.monotonic()
        for record in self.records:
            self.producer.send(record)
            self.sent_records += 1
            if self.rate and self.sent_records % 100 == 0:
                ahead = self.sent_records / self.rate - (time.monotonic() - started)
                if ahead > 0:  # librdkafka's own thread keeps sending meanwhile
                    time.sleep(ahead)
        try:
            self.producer.flush(self.flush_timeout_s)
        except ProduceError as exc:
            self.error = str(exc)


def produce_now(bootstrap: str, records: list[dict]) -> int:
    """Produce ``records`` and wait for every acknowledgement; returns the messages acknowledged.

    Raises:
        ProduceError: not every message was acknowledged.
    """
    producer = PacedProducer(bootstrap, records, rate=None)
    producer.run()
    if producer.error:
        raise ProduceError(producer.error)
    return producer.stats.acked


def _fresh_app_id(scenario: str, run: int) -> str:
    return f"chaos-{scenario}-{run}-{uuid.uuid4().hex[:6]}"


def _wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.1):
    """Poll ``condition()`` until it returns a truthy value; TimeoutError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:.0f}s")
        time.sleep(poll_s)


def _consume(env: RunEnv, worker: Worker, timeout_s: float) -> float:
    """Wait until the group of ``worker`` has committed everything; raises with the worker's log tail."""
    try:
        return wait_until_consumed(env.bootstrap, worker.options.app_id, worker.process, timeout_s=timeout_s)
    except (RuntimeError, TimeoutError) as exc:
        raise type(exc)(f"{exc}; last lines of {worker.log_file}:\n{worker.tail()}") from None


def _start_bridge(env: RunEnv, command: list[str], log_file: Path, timeout_s: float) -> subprocess.Popen:
    """Start ``kvstream bridge`` (``command``) as a child of ``env``, its output appended to ``log_file``, and wait
    until it has subscribed to its publishers.

    Raises:
        RuntimeError: the bridge exited. TimeoutError: it did not subscribe within ``timeout_s``.
    """
    offset = log_file.stat().st_size if log_file.exists() else 0
    with open(log_file, "ab") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
    env.children.append(child)

    def subscribed():
        if child.poll() is not None:
            raise RuntimeError(f"the bridge exited with code {child.returncode}:\n"
                               + log_file.read_text(errors="replace")[-2000:])
        with open(log_file, "rb") as log:
            log.seek(offset)
            return b"subscribed to" in log.read()

    _wait_for(subscribed, timeout_s, "the bridge did not subscribe")
    time.sleep(1.0)  # ZMQ's slow joiner: let the subscription reach the publisher
    return child
