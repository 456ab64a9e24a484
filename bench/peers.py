"""The ``peers`` step of ``make bench``: kvstream's worker against the Kafka Streams peer, one at a time.

Contestants, each run ``--peer-rounds`` times (default 3) in turn on one broker and one input topic
(``peers.kv-events``: the simulator's events of ``--stream-requests`` trace requests, written once, untimed),
medians reported:

- ``stream-rocksdb``: one ``kvstream worker`` with ``rocksdb://`` (the default store);
- ``stream-memory``: the same with ``memory://``;
- ``kafka-streams``: the Kafka Streams peer in ``bench/kafka_streams`` (Processor API, RocksDB store with a
  changelog, clears by a store scan), built with Maven on first use (``mvn -q package``, cached in
  ``bench/kafka_streams/target`` until its sources change).

Each contestant gets its own app id, so its consumer groups, changelogs and outputs are its own. Measured per
run: events/s from its first event processed to its consumer group having committed everything, the CPU time of
each of its processes and of the broker over that window, the peak RSS of its process tree, the messages it
wrote to the broker (the end offsets of every topic before and after, the input topic excluded) and its resident
rows against the simulator's ground truth. bench/README.md ("The peers step") says how to read them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

#: Topic prefix of the peers step: its input is ``peers.kv-events``, apart from the other steps' kv-events
#: (which the latency and RSS steps extend), so every contestant reads exactly the trace.
PEER_PREFIX = "peers."
CONTESTANTS = ("stream-rocksdb", "stream-memory", "kafka-streams")
#: The contestant the others are divided by.
PEER = "kafka-streams"
_PROJECT = Path(__file__).resolve().parent / "kafka_streams"
_JAR = _PROJECT / "target" / "kvstream-kafka-streams-peer.jar"
_LIB = _PROJECT / "target" / "lib"
_SCHEMAS = Path(__file__).resolve().parent.parent / "schemas"
#: JVM options of the peer: a heap as the embedded broker's, G1 as Kafka's scripts.
PEER_JVM_FLAGS = ["-Xms256m", "-Xmx1g", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true"]


class PeerBuildError(RuntimeError):
    """Maven or Java is missing, or the build failed."""


def _sources() -> list[Path]:
    return [_PROJECT / "pom.xml", *sorted((_PROJECT / "src").rglob("*.java"))]


def build_kafka_streams(say=print) -> str:
    """Build the Kafka Streams peer if its jar is missing or older than its sources; returns its classpath.

    Raises:
        PeerBuildError: no ``java`` or ``mvn`` on PATH, or Maven failed (with the end of its output).
    """
    if shutil.which("java") is None:
        raise PeerBuildError("java (17+) is needed for the Kafka Streams peer")
    newest = max(p.stat().st_mtime for p in _sources())
    if not (_JAR.exists() and _LIB.is_dir() and _JAR.stat().st_mtime >= newest):
        mvn = shutil.which("mvn")
        if mvn is None:
            raise PeerBuildError("Apache Maven ('mvn') is needed to build the Kafka Streams peer")
        say(f"      building the Kafka Streams peer (mvn -q package in {_PROJECT})")
        shutil.rmtree(_LIB, ignore_errors=True)  # copy-dependencies keeps stale jars otherwise
        done = subprocess.run([mvn, "-B", "-q", "-Dstyle.color=never", "package"], cwd=_PROJECT,
                              capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-20:]
            raise PeerBuildError("mvn package failed:\n  " + "\n  ".join(tail))
        _JAR.touch()
    return f"{_JAR}{os.pathsep}{_LIB}{os.sep}*"


def _http_json(url: str, timeout_s: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


class KafkaStreamsPeer:
    """One JVM running the peer (``kvstream.peer.Main``), its output in ``log``."""

    def __init__(self, classpath: str, bootstrap: str, app_id: str, state_dir: Path, port: int, log: Path,
                 topic: str, threads: int = 1) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.port = port
        self.log = log
        self.app_id = app_id
        command = ["java", *PEER_JVM_FLAGS, "-cp", classpath, "kvstream.peer.Main", "--bootstrap", bootstrap,
                   "--app-id", app_id, "--state-dir", str(state_dir), "--schemas", str(_SCHEMAS),
                   "--http-port", str(port), "--topic", topic, "--threads", str(threads)]
        with open(log, "ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def pids(self) -> list[int]:
        return [self.process.pid] if self.process.poll() is None else []

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            tail = self.log.read_text(errors="replace").splitlines()[-20:]
            raise RuntimeError(f"the Kafka Streams peer exited with code {self.process.returncode}:\n  "
                               + "\n  ".join(tail))

    def stats(self) -> dict | None:
        try:
            return _http_json(f"http://127.0.0.1:{self.port}/stats/", 5)
        except (OSError, ValueError):
            return None

    def rows(self) -> dict:
        return _http_json(f"http://127.0.0.1:{self.port}/rows/", 120)

    def stop(self, grace_s: float = 30.0) -> None:
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def partition_end_offsets(bootstrap: str, topics: list[str] | None = None) -> dict[tuple[str, int], int]:
    """(topic, partition) -> end offset (high watermark) now, for ``topics`` (None: every topic); where a
    read of what is written from now on starts."""
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient, OffsetSpec

    from kafka_io.config import client_config

    admin = AdminClient(client_config(bootstrap))
    metadata = admin.list_topics(timeout=10)
    partitions = [TopicPartition(t, p) for t, m in metadata.topics.items() if topics is None or t in topics
                  for p in m.partitions]
    latest = admin.list_offsets({tp: OffsetSpec.latest() for tp in partitions}, request_timeout=30)
    return {(tp.topic, tp.partition): future.result().offset for tp, future in latest.items()}


def topic_end_offsets(bootstrap: str) -> dict[str, int]:
    """Every topic's end offsets summed over its partitions: messages ever written to it (compaction and
    retention do not lower them)."""
    ends: dict[str, int] = {}
    for (topic, _), offset in partition_end_offsets(bootstrap).items():
        ends[topic] = ends.get(topic, 0) + offset
    return ends


def process_cpu(pids: list[int], labels: dict[int, str]) -> dict[str, float]:
    """User + system CPU seconds of each process (and its live children), by label; a child's label is
    its parent's plus what it runs (``worker/repartition``)."""
    import psutil

    out: dict[str, float] = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            procs = [(labels.get(pid, str(pid)), proc)]
            for child in proc.children(recursive=True):
                try:
                    cmd = " ".join(child.cmdline())
                except psutil.Error:
                    cmd = ""
                kind = ("resource_tracker" if "resource_tracker" in cmd else
                        "repartition" if "spawn_main" in cmd else child.name())
                procs.append((f"{labels.get(pid, str(pid))}/{kind}", child))
            for label, p in procs:
                times = p.cpu_times()
                out[label] = out.get(label, 0.0) + times.user + times.system
        except psutil.Error:
            pass
    return out


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(rounds: list[dict]) -> dict:
    """Medians over a contestant's rounds of every numeric figure (per-process CPU included)."""
    keys = ("events_per_s", "processed_events_per_s", "cpu_us_per_event", "broker_cpu_us_per_event",
            "rss_peak_mib", "messages_per_event", "seconds")
    median = {k: _median([r.get(k) for r in rounds]) for k in keys}
    labels = sorted({label for r in rounds for label in r.get("cpu_us_per_event_by_process", {})})
    median["cpu_us_per_event_by_process"] = {
        label: _median([r["cpu_us_per_event_by_process"].get(label) for r in rounds]) for label in labels}
    median["rows_equal_truth"] = all(r.get("rows_equal_truth") for r in rounds)
    median["resident_rows"] = [r.get("resident_rows") for r in rounds]
    return median


def paired_ratios(rounds: list[dict], peer_rounds: list[dict], key: str = "events_per_s") -> list[float]:
    """``key`` of each of a contestant's rounds divided by the same round of the peer's, in round order.

    The rounds are interleaved, so round ``i`` of both ran within the same minute: a slow minute of the machine
    slows both, and their ratio keeps less of it than the ratio of the medians does. Rounds that either side lacks
    (a failed round) or without a value are left out.
    """
    theirs = {r["round"]: r.get(key) for r in peer_rounds}
    return [r[key] / theirs[r["round"]] for r in rounds
            if r.get(key) and theirs.get(r["round"])]


def print_peers(peers: dict) -> None:
    """The peers table: one line per contestant, medians."""
    if not peers or not peers.get("contestants"):
        return
    print(f"\npeers (medians of {peers.get('rounds')} rounds; input {peers.get('events'):,} events, "
          f"truth {peers.get('truth_rows'):,} rows)")
    print(f"{'contestant':<16} {'events/s':>10} {'CPU µs/ev':>10} {'broker µs/ev':>13} {'peak RSS MiB':>13} "
          f"{'msgs/event':>11}  rows = truth  CPU µs/event by process")
    for name, c in peers["contestants"].items():
        m = c.get("median") or {}
        if not m:
            continue

        def f(v, spec):
            return "-" if v is None else format(v, spec)
        by = ", ".join(f"{k} {v:.1f}" for k, v in m["cpu_us_per_event_by_process"].items() if v is not None)
        print(f"{name:<16} {f(m['events_per_s'], ',.0f'):>10} {f(m['cpu_us_per_event'], '.1f'):>10} "
              f"{f(m['broker_cpu_us_per_event'], '.1f'):>13} {f(m['rss_peak_mib'], ',.0f'):>13} "
              f"{f(m['messages_per_event'], '.2f'):>11}  {'yes' if m['rows_equal_truth'] else 'NO':<12}  {by}")
    peer = peers["contestants"].get(PEER)
    for name, c in peers["contestants"].items():
        if name == PEER or not peer:
            continue
        ratios = paired_ratios(c.get("rounds", []), peer.get("rounds", []))
        if ratios:
            print(f"{name} / {PEER}, events/s round by round: {', '.join(f'{r:.2f}' for r in ratios)} "
                  f"(median {statistics.median(ratios):.2f}, spread {min(ratios):.2f}-{max(ratios):.2f})")


def wait_committed(bootstrap: str, group: str, topic: str, timeout_s: float, alive, poll_s: float = 0.25) -> float:
    """Wait until ``group`` has committed the end of every partition of ``topic``; returns perf_counter then.
    One :class:`~kafka_io.admin.GroupProgressReader` for the whole wait, as the kvstream contestants'
    (:func:`kvstream.worker.wait_until_consumed`): the poll's own load on the broker is the same for both."""
    from kafka_io.admin import GroupProgressReader

    deadline = time.monotonic() + timeout_s
    with GroupProgressReader(bootstrap) as reader:
        while True:
            alive()
            try:
                progress = reader.group_progress(group, [topic])[topic]
                if progress.end and progress.lag == 0:
                    return time.perf_counter()
            except RuntimeError:
                pass  # the group coordinator is still loading
            if time.monotonic() > deadline:
                raise TimeoutError(f"group {group} did not commit the end of {topic} within {timeout_s:.0f}s")
            time.sleep(poll_s)
