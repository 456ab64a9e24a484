"""``make chaos``: the fault scenarios, each against a real embedded Kafka broker.

Every run starts a fresh one-node broker (its own data directory under the work
directory, a free port) and a fresh app id, because the stream app's input topic
``kv-events`` is a fixed name: runs never see each other's data. Each run ends by
reading the residency table back from its changelog topic
(:mod:`stream_apps.snapshot`) and comparing it, row by row and copy count by copy
count, with the ground truth of what was published.

Scenarios (:data:`SCENARIOS`):

``crash``
    A trace slice is replayed, partly before and partly while a worker runs; the
    worker is SIGKILLed (its whole process group) once the live producer has sent a
    seeded random fraction of its records, restarted on the same app id and data
    directory (``rocksdb://`` and ``memory://`` stores alternate), and left to finish.
``rebalance``
    Two workers share the partitions; one is stopped (SIGTERM) mid-stream and
    later restarted. A thread asks ``GET /residency/{hex}/`` of the running
    workers for known blocks throughout and counts answers, 503 retries and failures.
``broker-outage``
    While the producer (idempotent, ``acks=all``) publishes, the broker is stopped
    for ``outage_s`` seconds and started again on the same port and data directory.
    The producer's acknowledged count must equal the messages in ``kv-events``.
``bridge-restart``
    A vLLM-protocol publisher (:class:`harness.vllm_publisher.FakeVllmPublisher`)
    publishes one simulated instance's batches; the bridge (``kvstream bridge``
    with a state file, a child process) is SIGKILLed mid-stream, publishing goes on,
    and the bridge is restarted. Two runs: a replay buffer that covers the outage
    (everything recovered) and one too small for it (the rest is a reported gap:
    ``SourceStale``, ``GET /sources/`` stale).
``table-recovery``
    After a run has finished, its worker is stopped and a new worker with an empty
    data directory (and another web port) starts on the same app id; it rebuilds
    its tables from the changelogs and must answer a sample of residency lookups
    and ``GET /occupancy/`` exactly as the first worker did.
``engine-crash``
    Three engines (:class:`harness.vllm_publisher.FakeVllmPublisher`, each one simulated instance's batches)
    publish through one ``kvstream bridge`` (heartbeats every 0.5 s) into two workers whose sources hold a 3 s
    lease (:data:`ENGINE_LEASE_S`: the other scenarios keep a day's). While events flow, one engine is killed
    (its sockets closed at once) and comes back 10 s later as a new process, one is killed for good, the third
    runs throughout. A thread asks both workers ``GET /workers``, ``POST /prefix-match/`` and
    ``POST /query_by_hash`` about the dead engines' blocks: no answer may name a dead engine more than the
    lease + 5 s after its kill. At the end every worker's answers (``POST /prefix-match/`` of every block ever
    stored, ``GET /workers``' ``live``) must name exactly what the engines alive at the end hold, and the
    residency table must keep the dead engine's rows and have retired the restarted engine's old ones.

:func:`run_chaos` runs the chosen scenarios, prints progress and a summary table,
and writes the results (shape: :data:`DEFINITIONS`) to a JSON file.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec
from confluent_kafka import Consumer, TopicPartition

from harness.vllm_publisher import FakeVllmPublisher
from kafka_io.admin import ensure_topics, group_progress
from kafka_io.config import client_config
from kafka_io.reader import messages_to_end
from kvstream import broker
from kvstream.client import IndexClient, IndexQueryError
from kvstream.worker import spawn_worker, stop_worker, wait_until_consumed
from producers.kafka_sink import KvEventProducer, ProduceError
from producers.simulator import Batch, ClusterSimulator, FleetConfig, load_trace
from producers.split import split_event
from schemas import AvroCodec
from schemas.tiers import tier_of
from schemas.topics import KV_EVENTS, KV_EVENTS_DEAD_LETTER, by_ownership_topic, changelog_topic
from stream_apps.repartition import repartition_group
from stream_apps.settings import WorkerSettings
from stream_apps.snapshot import read_table, resident_rows

#: Scenario names, in the order they run.
SCENARIOS = ("crash", "rebalance", "broker-outage", "bridge-restart", "table-recovery", "engine-crash")

#: What the numbers of the results file mean (written into it as ``definitions``).
DEFINITIONS = {
    "runs": "runs of the scenario; each on a fresh broker data dir and a fresh app id",
    "runs_matching_truth": "runs whose final residency table (read back from <app id>-residency-changelog) "
                           "equals the ground truth row for row and copy count for copy count. engine-crash: the "
                           "truth is the engines' residency as far as it reached kv-events (the dead engine's rows "
                           "kept, the restarted engine's killed process retired), and every worker's final answers "
                           "must also name exactly what the engines alive at the end hold ('final_answers')",
    "runs_passed": "runs matching the truth whose scenario checks also held (see each run's 'checks')",
    "events_produced": "Kafka messages the producer (or bridge) reported acknowledged into kv-events; a clear "
                       "counts once per partition. bridge-restart, engine-crash: messages of every batch the "
                       "engines published",
    "messages_in_topic": "sum over the partitions of kv-events of (end offset - start offset); engine-crash: the "
                         "messages of engine batches only (the bridge's own, per kind, are in 'source_events')",
    "events_lost": "messages acknowledged but missing from kv-events (max(0, produced - in topic); "
                   "bridge-restart: records of batches outside the reported gap that are not in kv-events; "
                   "engine-crash: records of batches not in kv-events but for a killed engine's tail) "
                   "+ residency rows of the truth that are missing from the table or hold fewer copies than the "
                   "truth. Mixed units on purpose: any non-zero value is a loss",
    "duplicates_applied": "residency rows holding more copies than the truth, plus resident rows the truth does "
                          "not have (a store applied more often than its removals; a lost removal would also "
                          "show here). Redelivered messages that the tables ignored are not counted: see "
                          "'duplicates_ignored' (the final workers' /stats/ 'duplicates' counter)",
    "events_in_reported_gap": "bridge-restart: records of the batches the engine's replay buffer no longer held "
                              "when the bridge came back, reported as lost (SourceStale, GET /sources/ stale)",
    "topic_surplus": "messages in kv-events beyond one copy of each (bridge-restart: batches the restarted "
                     "bridge produced again because its state file lagged); the tables must ignore them",
    "kill": "crash: the moment of the SIGKILL: the seeded fraction of the live records (those produced while "
            "the worker runs) sent when it comes, what the worker's /stats/ showed at its last poll before the "
            "kill, seconds since the worker started, whether the live producer was still producing, and the "
            "offsets of kv-events the group had committed",
    "differences_by_source": "differing rows per <instance>/<tier>/<missing|extra|below|above>",
    "worker_view": "in 'differences': the copies the (restarted or surviving) worker itself answers for the row "
                   "over GET /residency/{hex}/ (its local table) while the changelog says 'actual'",
    "rekey": "for a run that differs: distinct kv-events payloads, items and distinct payloads in "
             "<app id>-kv-events-by-ownership, and kv-events payloads never re-keyed (lost by the repartition process)",
    "dead_engine_named_s": "engine-crash: the longest time, in seconds after its kill, that an answer of a worker "
                           "named an engine while it was dead: POST /prefix-match/ or POST /query_by_hash of a block "
                           "it held at the kill listing it, or GET /workers giving it live true; the max over the "
                           "run's kills, each timed when the answer came back. scenario entry: "
                           "dead_engine_named_max_s, the max over the runs",
    "dead_engine_bound_s": "engine-crash: the most dead_engine_named_s may be: the workers' --source-lease-s (3 s) "
                           "+ 5 s (issue 26); the bridge heartbeats every 0.5 s, its probes time out after 0.5 s",
    "kills": "engine-crash: per kill: engine, restarted_after_s (null: killed for good), named_for_s and named_by "
             "(the answer that named it last: API and worker), named_after_kill (the watch saw it named before its "
             "lease lapsed: its questions can see it), watched_for_s (how long after the kill it was still asked "
             "about; must exceed the bound), down_seen_s (per worker, when GET /workers first said live false), "
             "held_blocks, asked; old_blocks, old_asked, old_named_s: after the restart, POST /prefix-match/ of "
             "the blocks the killed process held (old_blocks of them) that the new process had not stored yet when "
             "asked, and the latest answer naming the engine for one (seconds after the restart; null: none)",
    "final_answers": "engine-crash: GET /workers of every worker until each engine's blocks per tier equal the "
                     "table's and its live flag is right (alive at the end: live true; killed for good: false), "
                     "then POST /prefix-match/ of every block any engine process stored, one per request, on every "
                     "worker: the holders and their tiers must be exactly what the engines alive at the end hold; "
                     "retried for 30 s. blocks_asked, wrong_blocks (with examples), rounds, seconds; counts_equal "
                     "and workers_view: the last GET /workers (blocks per tier, live flags)",
    "watch": "engine-crash: lookups the watch asked, and those that got no answer (a 503 or an error: not counted "
             "as an answer)",
    "old_blocks_named_after_restart_s": "engine-crash: the kill's old_named_s for the restarted engine",
    "epochs": "engine-crash: publisher epochs per engine in kv-events; one per engine process (the bridge found the "
              "restart and took nothing else for one)",
    "tail_lost_with_engine": "engine-crash: messages of the batches a killed engine published after the last one "
                             "that reached kv-events: still queued in its PUB socket when it died, they died with it "
                             "(a crashed vLLM loses them too); not counted in events_lost",
    "queries": "rebalance: GET /residency/{hex}/ lookups of known blocks; 'answered' got 200 (possibly after "
               "retries), 'retried' counts 503 answers (rebalancing: retry) that were retried, 'failed' never got a "
               "200 within 30 s or got another error",
}

#: Small pools (as tests/integration/test_pipeline.py): blocks cascade GPU -> CPU -> KVCR and get evicted; one GPU
#: reset.
CHAOS_FLEET = FleetConfig(gpu_blocks=600, cpu_blocks=900, kvcr_blocks=1200, clear_instance=1, clear_at=0.6)

#: Faust's consumer session timeout for the workers of a chaos run, in seconds (Faust's default is 60). A
#: SIGKILLed worker never leaves its group; its partitions go to the others (or its restart) only after it.
SESSION_TIMEOUT_S = 6

#: Environment of every worker a chaos run starts (Faust reads these settings from the environment).
WORKER_ENV = {"BROKER_SESSION_TIMEOUT": str(SESSION_TIMEOUT_S), "BROKER_HEARTBEAT_INTERVAL": "1"}

#: engine-crash: the workers' ``--source-lease-s``, seconds. Short, so that a run sees leases lapse; the other
#: scenarios keep a day's lease on purpose (their sources publish once and are checked long after).
ENGINE_LEASE_S = 3.0
#: engine-crash: the bridge's ``--heartbeat-interval-s`` and ``--heartbeat-probe-timeout-s``, seconds: well below
#: the lease, so a live idle engine never lapses between two heartbeats.
ENGINE_HEARTBEAT_S = 0.5
ENGINE_PROBE_TIMEOUT_S = 0.5
#: engine-crash: how much longer than its lease an answer may still name a dead engine, seconds (issue 26).
DEAD_ANSWER_SLACK_S = 5.0


@dataclass
class ChaosOptions:
    """Options of ``make chaos`` (see its ``--help``)."""

    #: Scenarios to run, names from :data:`SCENARIOS`.
    scenarios: tuple[str, ...] = SCENARIOS
    #: Runs of the crash scenario.
    crash_runs: int = 10
    #: Runs of the rebalance scenario; even runs have no standby replicas, odd runs one (both must hold).
    rebalance_runs: int = 6
    #: Runs of the engine-crash scenario; the store alternates (even runs memory://, odd runs rocksdb://).
    engine_crash_runs: int = 2
    #: Requests of the Mooncake trace replayed per run (the first N).
    requests: int = 300
    #: Results file (JSON); None: do not write one.
    output: Path | None = Path("chaos/results.json")
    #: Brokers, worker data dirs and logs; emptied at start.
    work_dir: Path = Path(".kvstream/chaos")
    #: Seed of every random choice (kill moments, split points); a run's choices depend on it and the run number.
    seed: int = 5
    #: Partitions of kv-events and of the app's topics.
    partitions: int = 4
    #: Seconds the broker stays down in the broker-outage scenario.
    outage_s: float = 10.0
    #: Seconds any single wait (consumption, web server, recovery) may take before the run fails.
    timeout_s: float = 300.0
    #: Seconds over which the live producers spread the records they publish while a worker runs.
    live_s: float = 8.0


# --------------------------------------------------------------------------- workload and ground truth


@dataclass
class Workload:
    """A simulated trace slice: its batches, the block records they become, and the ground truth."""

    #: Batches in publishing order (see :class:`producers.simulator.Batch`).
    batches: list[Batch]
    #: Block-level ``kv_event`` records in producing order.
    records: list[dict]
    #: Kafka messages the records become with ``partitions`` partitions (a clear once per partition).
    messages: int
    #: Final residency: (instance, dp rank, tier, ownership, locality, group, hash bytes) -> copies.
    ground_truth: dict


def simulate_workload(requests: int, fleet: FleetConfig, partitions: int) -> Workload:
    """Simulate the first ``requests`` requests of the vendored trace through ``fleet``."""
    sim = ClusterSimulator(fleet)
    batches = list(sim.run(load_trace(limit=requests)))
    records = [record for batch in batches for index, event in enumerate(batch.events)
               for record in split_event(batch.publisher, batch.seq, batch.ts, index, event)]
    return Workload(batches, records, message_count(records, partitions), sim.ground_truth())


def message_count(records: list[dict], partitions: int) -> int:
    """Kafka messages ``records`` become: one per keyed record, one per partition for a record without a key."""
    return sum(1 if record["block_hash"] is not None else partitions for record in records)


def naive_residency(batches: list[Batch], skip_seqs: set[int] = frozenset()) -> dict:
    """Apply batches in order with plain reference counts (GPU clears; one worker per source).

    Args:
        skip_seqs: seqs of batches that never arrived (a gap), left out.

    Returns:
        ``{(instance, dp rank, tier, ownership, locality, group, hash bytes): copies}`` of resident rows, the
        identity :func:`stream_apps.snapshot.resident_rows` uses. Sources with several workers
        (``world_size`` > 1) are not supported: the fleet scenarios use the simulator's own ground truth.
    """
    counts: Counter = Counter()
    for batch in batches:
        if batch.seq in skip_seqs:
            continue
        p = batch.publisher
        for event in batch.events:
            if event["type"] == "AllBlocksCleared":
                for key in [k for k in counts if k[0] == p.instance_id and k[1] == p.data_parallel_rank
                            and k[2] == "GPU"]:
                    del counts[key]
                continue
            tier = tier_of(event.get("medium"))
            for h in event["block_hashes"]:
                key = (p.instance_id, p.data_parallel_rank, tier, event.get("ownership"), event.get("locality"),
                       event.get("group_idx") or 0, h.to_bytes(8, "big"))
                if event["type"] == "BlockStored":
                    counts[key] += 1
                elif counts[key] > 0:
                    counts[key] -= 1
                    if not counts[key]:
                        del counts[key]
    return {key: copies for key, copies in counts.items() if copies > 0}


# --------------------------------------------------------------------------- checks


@dataclass
class RowCheck:
    """The residency table against the ground truth, in rows."""

    #: Resident rows in the truth.
    truth_rows: int
    #: Resident rows in the table.
    table_rows: int
    #: Rows equal on both sides.
    matching: int
    #: Rows of the truth the table does not hold.
    missing: int
    #: Resident rows of the table the truth does not have.
    extra: int
    #: Rows held with fewer copies than the truth.
    below: int
    #: Rows held with more copies than the truth.
    above: int
    #: Up to 10 differences: {"row": [...], "expected": copies or None, "actual": copies or None}.
    examples: list = field(default_factory=list)
    #: Differences per "<instance>/<tier>/<missing|extra|below|above>".
    by_source: dict = field(default_factory=dict)

    @property
    def matches(self) -> bool:
        """True when every row matches."""
        return not (self.missing or self.extra or self.below or self.above)

    @property
    def lost(self) -> int:
        """Rows missing or below the truth."""
        return self.missing + self.below

    @property
    def duplicated(self) -> int:
        """Rows above the truth or not in it."""
        return self.above + self.extra


def compare_residency(truth: dict, actual: dict) -> RowCheck:
    """Compare two ``{row identity: copies}`` maps and classify every difference."""
    check = RowCheck(len(truth), len(actual), 0, 0, 0, 0, 0)
    for identity in truth.keys() | actual.keys():
        want, got = truth.get(identity), actual.get(identity)
        if want == got:
            check.matching += 1
            continue
        if got is None:
            check.missing += 1
        elif want is None:
            check.extra += 1
        elif got < want:
            check.below += 1
        else:
            check.above += 1
        kind = "missing" if got is None else "extra" if want is None else "below" if got < want else "above"
        label = f"{identity[0]}/{identity[2]}/{kind}"
        check.by_source[label] = check.by_source.get(label, 0) + 1
        if len(check.examples) < 10:
            check.examples.append({"row": [*identity[:6], identity[6].hex()], "expected": want, "actual": got})
    return check


def check_residency(bootstrap: str, app_id: str, truth: dict) -> RowCheck:
    """Read ``<app_id>-residency-changelog`` to its end and compare its resident rows with ``truth``."""
    table = read_table(bootstrap, changelog_topic(app_id, "residency"), "residency", timeout_s=120)
    return compare_residency(truth, resident_rows(table))


def rekey_check(bootstrap: str, app_id: str) -> dict:
    """Which events of kv-events never reached ``<app_id>-kv-events-by-ownership`` (the repartition process's output).

    Returns:
        ``{"kv_events_distinct", "rekeyed_items", "rekeyed_distinct", "never_rekeyed"}``: distinct event
        payloads (a clear's copies count once) in kv-events, items in the re-keyed topic, distinct payloads
        among them, and payloads of kv-events missing from the re-keyed topic. Tells a loss in the repartition
        process from one in the materializing agent.
    """
    upstream = set(read_topic(bootstrap, KV_EVENTS))
    codec = AvroCodec("ownership_batch")
    items = 0
    rekeyed = set()
    for value in read_topic(bootstrap, by_ownership_topic(app_id)):
        for item in codec.decode(value)["events"]:
            items += 1
            rekeyed.add(item["event"])
    return {"kv_events_distinct": len(upstream), "rekeyed_items": items, "rekeyed_distinct": len(rekeyed),
            "never_rekeyed": len(upstream - rekeyed)}


def topic_messages(bootstrap: str, topic: str = KV_EVENTS) -> int:
    """Messages in ``topic``: the sum over its partitions of end offset minus start offset."""
    consumer = Consumer(client_config(bootstrap, **{"group.id": f"kvstream-chaos-{uuid.uuid4()}"}))
    try:
        metadata = consumer.list_topics(topic, timeout=30)
        total = 0
        for p in metadata.topics[topic].partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)
            total += high - low
        return total
    finally:
        consumer.close()


def read_topic(bootstrap: str, topic: str = KV_EVENTS, timeout_s: float = 120.0) -> list[bytes]:
    """Every message value of ``topic`` from the start to its current end, partition by partition."""
    return [message.value() for message in messages_to_end(bootstrap, topic, timeout_s)]


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


# --------------------------------------------------------------------------- brokers, producers, workers


class RunEnv:
    """One run's isolated world: a fresh broker (own data dir, free port) and everything the run spawns.

    Use as a context manager: entering starts the broker and creates ``kv-events``; leaving stops every
    worker and child process still running, then the broker.
    """

    def __init__(self, run_dir: Path, partitions: int, log=print) -> None:
        self.dir = run_dir
        self.partitions = partitions
        self.log = log
        self.broker_dir = run_dir / "broker"
        self.port = 0
        self.bootstrap = ""
        self.workers: list[Worker] = []
        self.children: list[subprocess.Popen] = []

    def __enter__(self) -> RunEnv:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
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
        broker.stop(self.broker_dir)

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


def _run_result(run: int, check: RowCheck, produced: int, in_topic: int, seconds: float,
                checks: dict[str, bool] | None = None, lost_in_topic: int | None = None, **detail) -> dict:
    """One run's entry of the results file."""
    checks = checks or {}
    missing_messages = max(produced - in_topic, 0) if lost_in_topic is None else lost_in_topic
    return {"run": run, "matches_truth": check.matches, "passed": check.matches and all(checks.values()),
            "events_produced": produced, "messages_in_topic": in_topic,
            "events_lost": missing_messages + check.lost, "duplicates_applied": check.duplicated,
            "rows": {k: v for k, v in asdict(check).items() if k not in ("examples", "by_source")},
            "differences_by_source": check.by_source,
            "differences": check.examples, "checks": checks, "seconds": round(seconds, 1), **detail}


# --------------------------------------------------------------------------- scenarios


class Chaos:
    """Runs the scenarios with one set of :class:`ChaosOptions`; ``log`` prints progress."""

    def __init__(self, options: ChaosOptions, log=print) -> None:
        self.options = options
        self.log = log
        self.work = options.work_dir.resolve()
        self._workload: Workload | None = None

    @property
    def workload(self) -> Workload:
        """The trace slice every fleet scenario replays (simulated once)."""
        if self._workload is None:
            self._workload = simulate_workload(self.options.requests, CHAOS_FLEET, self.options.partitions)
        return self._workload

    def env(self, name: str) -> RunEnv:
        """A fresh broker for one run, in ``<work dir>/<name>``."""
        return RunEnv(self.work / name, self.options.partitions, self.log)

    def rng(self, scenario: str, run: int) -> random.Random:
        """The seeded random source of one run."""
        return random.Random(f"{self.options.seed}/{scenario}/{run}")

    # ----------------------------------------------------------------- 1. worker crash

    def crash(self, run: int) -> dict:
        """SIGKILL a worker at a seeded random moment during live flow, restart it, let it finish."""
        o, w = self.options, self.workload
        rng = self.rng("crash", run)
        store = ("rocksdb://", "memory://")[run % 2]
        before = rng.uniform(0.3, 0.6)  # fraction of the records produced before the worker starts
        kill_at = rng.uniform(0.1, 0.9)  # fraction of the live records produced when the worker is killed
        app_id = _fresh_app_id("crash", run)
        started = time.monotonic()
        with self.env(f"crash-{run}") as env:
            split = int(len(w.records) * before)
            produced = produce_now(env.bootstrap, w.records[:split])
            worker = env.worker("worker", app_id, store=store)
            ready_s = worker.wait_ready(o.timeout_s)
            live = PacedProducer(env.bootstrap, w.records[split:], (len(w.records) - split) / o.live_s)
            live.start()
            target = int(kill_at * (len(w.records) - split))
            last: dict = {}

            def reached():  # the live producer is that far, and the worker is consuming
                stats = worker.stats()
                if stats:
                    last.update(stats)
                if not worker.alive():
                    raise RuntimeError(f"the worker exited before the kill:\n{worker.tail()}")
                return live.sent_records >= target and last.get("materialized", 0) > 0

            _wait_for(reached, o.timeout_s, f"the live producer did not send {target} records", poll_s=0.05)
            worker.kill()
            kill = {"target_fraction_of_live_records": round(kill_at, 3), "live_records_sent": live.sent_records,
                    "materialized": last.get("materialized"), "repartitioned": last.get("repartitioned"),
                    "seconds_after_start": round(time.monotonic() - worker.started, 2),
                    "producer_running": live.is_alive(), "records_produced_before": live.sent_records + split}
            committed = group_progress(env.bootstrap, repartition_group(app_id), [KV_EVENTS])[KV_EVENTS].committed
            kill["kv_events_committed"] = committed
            self.log(f"      killed {kill['seconds_after_start']}s after start, {live.sent_records:,} of "
                     f"{len(w.records) - split:,} live records sent, {kill['materialized']:,} of "
                     f"{w.messages:,} messages materialized ({committed:,} committed; producer "
                     f"{'running' if kill['producer_running'] else 'done'}); restarting ({store})")
            worker.start()
            live.join()
            if live.error:
                raise ProduceError(live.error)
            produced += live.stats.acked
            consumed_s = _consume(env, worker, o.timeout_s)
            final = worker.stats() or {}
            check = check_residency(env.bootstrap, app_id, w.ground_truth)
            _explain(worker, check)
            worker.stop()
            in_topic = topic_messages(env.bootstrap)
            rekey = None if check.matches else _diagnose(rekey_check, env.bootstrap, app_id)
        return _run_result(run, check, produced, in_topic, time.monotonic() - started,
                           checks={"all messages in kv-events": in_topic == produced == w.messages},
                           store=store, app_id=app_id, records_before_worker=split, worker_ready_s=round(ready_s, 1),
                           kill=kill,
                           restart_consumed_s=round(consumed_s, 1), rekey=rekey,
                           duplicates_ignored=final.get("duplicates"))

    # ----------------------------------------------------------------- 2. rebalance

    def rebalance(self, run: int) -> dict:
        """Two workers; one stops mid-stream and rejoins; lookups are asked of the running workers throughout.
        Odd runs give each table partition a standby replica on the other worker. At the end every worker's
        views must equal the ground truth (occupancy, a lookup sample) and each other (sources)."""
        o, w = self.options, self.workload
        rng = self.rng("rebalance", run)
        app_id = _fresh_app_id("rebalance", run)
        standbys = run % 2
        store = ("memory://", "rocksdb://")[run // 2 % 2]
        started = time.monotonic()
        with self.env(f"rebalance-{run}") as env:
            self.log(f"      {standbys} standby replicas, store {store}")
            split = int(len(w.records) * 0.3)
            produced = produce_now(env.bootstrap, w.records[:split])
            first = env.worker("worker-1", app_id, store=store, standby_replicas=standbys)
            second = env.worker("worker-2", app_id, store=store, standby_replicas=standbys)
            first.wait_ready(o.timeout_s)
            second.wait_ready(o.timeout_s)
            known = sorted({r["block_hash"] for r in w.records[:split] if r["block_hash"] is not None})
            queries = _QueryLoad([first, second], rng.sample(known, min(200, len(known))))
            queries.start()
            live = PacedProducer(env.bootstrap, w.records[split:], (len(w.records) - split) / (3 * o.live_s))
            live.start()

            def materialized() -> int:
                return sum((x.stats() or {}).get("materialized", 0) for x in (first, second))

            stop_at = int(rng.uniform(0.35, 0.6) * w.messages)
            _wait_for(lambda: materialized() >= stop_at, o.timeout_s, f"workers did not materialize {stop_at}")
            queries.remove(second)
            stop_s = time.monotonic()
            second.stop()
            self.log(f"      worker-2 stopped (SIGTERM) at {stop_at:,} of {w.messages:,} messages materialized")
            base = (first.stats() or {}).get("materialized", 0)
            # let the survivor take over and make progress alone (or the stream end) before the rejoin
            _wait_for(lambda: (first.stats() or {}).get("materialized", 0) - base >= 0.15 * w.messages
                      or not live.is_alive(), o.timeout_s, "worker-1 did not take over", poll_s=0.3)
            down_s = time.monotonic() - stop_s
            second.start()
            second.wait_ready(o.timeout_s)
            queries.add(second)
            self.log(f"      worker-2 rejoined after {down_s:.1f}s")
            live.join()
            if live.error:
                raise ProduceError(live.error)
            produced += live.stats.acked
            _consume(env, first, o.timeout_s)
            time.sleep(2)  # a few more lookups on the settled group
            queries.stop()
            duplicates = sum((x.stats() or {}).get("duplicates", 0) for x in (first, second))
            http = {x.options.web_port: _http_sample(x.url, w.ground_truth, 100, rng) for x in (first, second)}
            views = _fleet_views([first, second], w.ground_truth)
            check = check_residency(env.bootstrap, app_id, w.ground_truth)
            _explain(first, check)
            in_topic = topic_messages(env.bootstrap)
            rekey = None if check.matches else _diagnose(rekey_check, env.bootstrap, app_id)
        counts = queries.counts
        self.log(f"      lookups: {counts['answered']:,} answered, {counts['retried']:,} 503 retries, "
                 f"{counts['failed']:,} failed")
        return _run_result(run, check, produced, in_topic, time.monotonic() - started,
                           checks={"all messages in kv-events": in_topic == produced == w.messages,
                                   "no lookup failed": counts["failed"] == 0,
                                   "both workers answer the sample as the truth": all(
                                       h["wrong"] == 0 for h in http.values()),
                                   "every worker's occupancy equals the truth": views["occupancy_equal"],
                                   "every worker answers the same sources": views["sources_equal"]},
                           app_id=app_id, standby_replicas=standbys, store=store, views=views,
                           stopped_at_materialized=stop_at, worker_2_down_s=round(down_s, 1),
                           queries=counts, query_failures=queries.failures[:5],
                           http_sample={str(port): h for port, h in http.items()}, duplicates_ignored=duplicates,
                           rekey=rekey)

    # ----------------------------------------------------------------- 3. broker outage

    def broker_outage(self, run: int) -> dict:
        """Stop the broker for ``outage_s`` while the producer publishes; then run a worker to the end."""
        o, w = self.options, self.workload
        rng = self.rng("broker-outage", run)
        app_id = _fresh_app_id("broker-outage", run)
        started = time.monotonic()
        with self.env(f"broker-outage-{run}") as env:
            # paced so the producer is still publishing through the whole outage
            rate = len(w.records) / (o.outage_s + 8)
            live = PacedProducer(env.bootstrap, w.records, rate)
            live.start()
            stop_after = int(len(w.records) * rng.uniform(0.15, 0.3))
            _wait_for(lambda: live.sent_records >= stop_after, o.timeout_s, "the producer did not start")
            t0 = time.monotonic()
            broker.stop(env.broker_dir)
            stopped_s = time.monotonic() - t0
            down_from = time.monotonic()
            time.sleep(o.outage_s)
            sent_during = live.sent_records - stop_after
            broker.start(port=env.port, data_dir=env.broker_dir)
            down_s = time.monotonic() - down_from
            self.log(f"      broker down {down_s:.1f}s (stop took {stopped_s:.1f}s) after {stop_after:,} records; "
                     f"{sent_during:,} records sent meanwhile")
            live.join()
            stats = asdict(live.stats)
            if live.error:
                self.log(f"      producer: {live.error}")
            produced = live.stats.acked
            in_topic = topic_messages(env.bootstrap)
            worker = env.worker("worker", app_id)
            _consume(env, worker, o.timeout_s)
            final = worker.stats() or {}
            worker.stop()
            check = check_residency(env.bootstrap, app_id, w.ground_truth)
        return _run_result(run, check, produced, in_topic, time.monotonic() - started,
                           checks={"producer acknowledged everything": live.error is None
                                   and produced == w.messages,
                                   "produced equals messages in kv-events": in_topic == produced},
                           app_id=app_id, outage_s=round(down_s, 1), broker_stop_s=round(stopped_s, 1),
                           records_before_outage=stop_after, records_sent_during_outage=sent_during,
                           producer=stats, producer_error=live.error, duplicates_ignored=final.get("duplicates"),
                           topic_surplus=max(in_topic - produced, 0))

    # ----------------------------------------------------------------- 4. bridge restart

    def bridge_restart(self, run: int) -> dict:
        """Kill the bridge mid-stream while the engine keeps publishing; restart it from its state file.

        Run 0 gives the publisher a replay buffer that covers the outage, run 1 one that does not.
        """
        o = self.options
        rng = self.rng("bridge-restart", run)
        fleet = FleetConfig(instances=1, tp_instances=(), clear_instance=0, clear_at=0.5, gpu_blocks=600,
                            cpu_blocks=900, kvcr_blocks=1200)
        sim = ClusterSimulator(fleet)
        batches = list(sim.run(load_trace(limit=o.requests)))
        if naive_residency(batches) != sim.ground_truth():
            raise AssertionError("naive replay of the one-instance simulation differs from its ground truth")
        instance = batches[0].publisher.instance_id
        records_of = {b.seq: [r for i, e in enumerate(b.events) for r in split_event(b.publisher, b.seq, b.ts, i, e)]
                      for b in batches}
        small_buffer = run % 2 == 1
        down_batches = 60
        buffer_steps = 20 if small_buffer else 10_000
        kill_after = rng.randint(len(batches) // 5, len(batches) // 2)
        pace_s = 0.01
        app_id = _fresh_app_id("bridge-restart", run)
        started = time.monotonic()
        with self.env(f"bridge-restart-{run}") as env:
            port, replay_port = broker.free_port(), broker.free_port()
            publisher = FakeVllmPublisher(port, replay_port, buffer_steps=buffer_steps)
            state_file = env.dir / "bridge-state.json"
            log_file = env.dir / "bridge.log"
            command = [sys.executable, "-m", "kvstream.cli", "bridge", "--bootstrap-servers", env.bootstrap,
                       "--endpoint", f"tcp://127.0.0.1:{port}", "--replay-endpoint",
                       f"tcp://127.0.0.1:{replay_port}", "--instance-id", instance, "--partitions",
                       str(o.partitions), "--state-file", str(state_file)]

            def start_bridge() -> subprocess.Popen:
                return _start_bridge(env, command, log_file, o.timeout_s)

            def publish(batch: Batch) -> None:
                publisher.publish_payload(msgspec.msgpack.encode([batch.ts, batch.events, 0]))
                time.sleep(pace_s)

            try:
                bridge = start_bridge()
                for batch in batches[:kill_after]:
                    publish(batch)
                time.sleep(rng.uniform(0.0, 0.5))
                _kill_group(bridge, signal.SIGKILL)
                saved = json.loads(state_file.read_text()) if state_file.exists() else {}
                saved_last = max((s["last_seq"] for s in saved.values()), default=None)
                for batch in batches[kill_after:kill_after + down_batches]:
                    publish(batch)
                oldest_at_restart = publisher.oldest_buffered_seq()
                published_at_restart = publisher.seq
                self.log(f"      bridge killed after {kill_after} batches (state file: last seq {saved_last}); "
                         f"{down_batches} published while down; buffer {buffer_steps} batches, oldest held "
                         f"{oldest_at_restart}; restarting")
                bridge = start_bridge()
                for batch in batches[kill_after + down_batches:]:
                    publish(batch)
                time.sleep(2.0)
                bridge.send_signal(signal.SIGTERM)
                bridge.wait(60)
            finally:
                publisher.close()
            values = read_topic(env.bootstrap)
            worker = env.worker("worker", app_id)
            _consume(env, worker, o.timeout_s)
            final = worker.stats() or {}
            sources = http_json(f"{worker.url}/sources/")[1].get("sources", [])
            worker.stop()
            source = next((s for s in sources if s["instance_id"] == instance), {})
            lost = set()
            if source.get("stale"):
                lost = set(range(source["first_lost_seq"], source["last_lost_seq"] + 1))
            # per seq: records in kv-events against the records of the batch (clears once per partition)
            codec = AvroCodec("kv_event")
            got = Counter()
            source_events = 0
            for value in values:
                record = codec.decode(value)
                kind = record["event"][0].rsplit(".", 1)[-1]
                if record["seq"] in records_of and kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
                    got[record["seq"]] += 1
                else:
                    source_events += 1
            want = {seq: message_count(records, o.partitions) for seq, records in records_of.items()}
            delivered = {seq for seq in want if got[seq] >= want[seq]}
            partial = sorted(seq for seq in want if 0 < got[seq] < want[seq])
            # the truth: every batch that reached kv-events (a batch of the reported gap may have been produced
            # before the kill, while the state file still named an older seq)
            truth = naive_residency(batches, set(want) - delivered)
            check = check_residency(env.bootstrap, app_id, truth)
        missing = sum(max(want[s] - got[s], 0) for s in want if s not in lost)
        surplus = sum(max(got[s] - want[s], 0) for s in want)
        in_gap = sum(want[s] - got[s] for s in lost if s not in delivered)
        recoverable = set(range(saved_last + 1 if saved_last is not None else 0, oldest_at_restart or 0))
        checks = {
            "everything outside the reported gap is in kv-events": missing == 0,
            "a gap is reported exactly when the buffer could not cover the outage":
                bool(lost) == bool(recoverable) and bool(lost) == small_buffer,
            "no batch is in kv-events only in part": not partial,
        }
        if lost:
            checks["the gap starts right after the bridge's saved seq"] = min(lost) == saved_last + 1
            checks["the gap ends before what the buffer held at the restart"] = max(lost) + 1 >= oldest_at_restart
            checks["nothing published after the restart is in the gap"] = max(lost) < published_at_restart
            checks["GET /sources/ marks the source stale with one gap"] = bool(source.get("stale")) and \
                source.get("gaps") == 1
        produced = sum(want.values())
        return _run_result(run, check, produced, len(values), time.monotonic() - started, checks=checks,
                           lost_in_topic=missing, app_id=app_id, buffer_steps=buffer_steps, batches=len(batches),
                           killed_after_batches=kill_after, state_file_last_seq=saved_last,
                           published_while_down=down_batches, oldest_buffered_at_restart=oldest_at_restart,
                           reported_gap=[min(lost), max(lost)] if lost else None, events_in_reported_gap=in_gap,
                           gap_batches_in_kv_events=sorted(lost & delivered), partial_batches=partial[:10],
                           topic_surplus=surplus, source_events=source_events,
                           source={k: source.get(k) for k in ("stale", "first_lost_seq", "last_lost_seq", "gaps",
                                                              "restarts", "publisher_epoch", "last_seq")},
                           duplicates_ignored=final.get("duplicates"))

    # ----------------------------------------------------------------- 5. table recovery

    def table_recovery(self, run: int) -> dict:
        """Finish a run, then rebuild the tables in a worker with an empty data dir and compare its answers."""
        o, w = self.options, self.workload
        rng = self.rng("table-recovery", run)
        app_id = _fresh_app_id("table-recovery", run)
        started = time.monotonic()
        with self.env(f"table-recovery-{run}") as env:
            produced = produce_now(env.bootstrap, w.records)
            first = env.worker("worker-1", app_id, store="rocksdb://")
            _consume(env, first, o.timeout_s)
            first.wait_ready(o.timeout_s)
            blocks = sorted({identity[6] for identity in w.ground_truth})
            sample = rng.sample(blocks, min(200, len(blocks)))
            gone = sorted({r["block_hash"] for r in w.records if r["block_hash"] is not None} - set(blocks))
            sample += rng.sample(gone, min(20, len(gone)))  # blocks that were resident once and are gone
            before = _answers(first.url, sample)
            first.stop()
            second = env.worker("worker-2", app_id, store="rocksdb://", data_dir=env.dir / "empty-data-dir")
            recovered_s = second.wait_ready(o.timeout_s)
            after = _answers(second.url, sample)
            final = second.stats() or {}
            second.stop()
            check = check_residency(env.bootstrap, app_id, w.ground_truth)
            in_topic = topic_messages(env.bootstrap)
        differing = [block for block in before if before[block] != after[block]]
        truth_http = _http_agrees(before, w.ground_truth)
        self.log(f"      new worker ready in {recovered_s:.1f}s; {len(before) - len(differing)} of {len(before)} "
                 f"answers identical")
        return _run_result(run, check, produced, in_topic, time.monotonic() - started,
                           checks={"identical answers after the rebuild": not differing,
                                   "answers before agree with the truth": truth_http == 0,
                                   "all messages in kv-events": in_topic == produced == w.messages},
                           app_id=app_id, queries=len(before), differing_answers=differing[:5],
                           recovered_s=round(recovered_s, 1), duplicates_ignored=final.get("duplicates"))

    # ----------------------------------------------------------------- 6. engine crash

    def engine_crash(self, run: int) -> dict:
        """Three engines publish through ``kvstream bridge`` into two workers with a short lease: one is killed and
        comes back as a new process, one is killed for good, one runs throughout. No answer may name a dead engine
        for longer than its lease plus :data:`DEAD_ANSWER_SLACK_S`, and the final answers must name exactly the
        blocks the engines alive at the end hold."""
        o = self.options
        rng = self.rng("engine-crash", run)
        fleet = FleetConfig(instances=3, tp_instances=(), clear_instance=rng.randrange(3), clear_at=0.6,
                            gpu_blocks=600, cpu_blocks=900, kvcr_blocks=1200)
        batches_of: dict[str, list[Batch]] = {}
        for batch in ClusterSimulator(fleet).run(load_trace(limit=o.requests)):
            batches_of.setdefault(batch.publisher.instance_id, []).append(batch)
        restarting, dying, surviving = rng.sample(sorted(batches_of), 3)
        store = ("memory://", "rocksdb://")[run % 2]
        bound_s = ENGINE_LEASE_S + DEAD_ANSWER_SLACK_S
        down_s = bound_s + 2.0  # the restarting engine stays dead past the bound, so the bound is tested on it too
        flow_s = 1.5 * o.live_s  # how long an engine that is never killed would take to publish its batches
        n = {name: len(b) for name, b in batches_of.items()}
        app_id = _fresh_app_id("engine-crash", run)
        started = time.monotonic()
        with self.env(f"engine-crash-{run}") as env:
            workers = [env.worker(f"worker-{i}", app_id, store=store, source_lease_s=ENGINE_LEASE_S,
                                  source_expiry_s=0.0)  # 0: never; the dead engine's rows stay for the table check
                       for i in (1, 2)]
            for worker in workers:
                worker.wait_ready(o.timeout_s)
            watch = _DeadEngineWatch([w.url for w in workers])
            ports = {name: (broker.free_port(), broker.free_port()) for name in sorted(batches_of)}
            engines = {
                restarting: _Engine(restarting, batches_of[restarting], ports[restarting], watch,
                                    pace_s=flow_s / n[restarting], down_s=down_s,
                                    kill_after=max(1, int(rng.uniform(0.25, 0.5) * n[restarting]))),
                dying: _Engine(dying, batches_of[dying], ports[dying], watch, pace_s=flow_s / n[dying],
                               kill_after=max(1, int(rng.uniform(0.3, 0.7) * n[dying]))),
                # paced to publish until the restarted engine is back and publishing: events flow throughout
                surviving: _Engine(surviving, batches_of[surviving], ports[surviving], watch,
                                   pace_s=(flow_s + down_s) / n[surviving]),
            }
            names = sorted(engines)
            log_file = env.dir / "bridge.log"
            command = [sys.executable, "-m", "kvstream.cli", "bridge", "--bootstrap-servers", env.bootstrap,
                       "--partitions", str(o.partitions), "--state-file", str(env.dir / "bridge-state.json"),
                       "--heartbeat-interval-s", str(ENGINE_HEARTBEAT_S),
                       "--heartbeat-probe-timeout-s", str(ENGINE_PROBE_TIMEOUT_S)]
            for name in names:
                command += ["--endpoint", f"tcp://127.0.0.1:{ports[name][0]}",
                            "--replay-endpoint", f"tcp://127.0.0.1:{ports[name][1]}", "--instance-id", name]
            self.log(f"      engines {restarting} (killed after {engines[restarting].kill_after} of "
                     f"{n[restarting]} batches, back {down_s:.0f}s later), {dying} (killed after "
                     f"{engines[dying].kill_after} of {n[dying]}), {surviving} (runs throughout); lease "
                     f"{ENGINE_LEASE_S:g}s, heartbeats every {ENGINE_HEARTBEAT_S:g}s; store {store}")
            try:
                for engine in engines.values():
                    engine.bind()
                bridge = _start_bridge(env, command, log_file, o.timeout_s)
                watch.start()
                for engine in engines.values():
                    engine.start()
                for engine in engines.values():
                    engine.join(o.timeout_s)
                    if engine.error:
                        raise RuntimeError(f"engine {engine.engine}: {engine.error}")
                # the engine killed for good is watched past the bound before the final answers are read
                kill = watch.kill_of(dying)
                time.sleep(max(0.0, kill.killed_at + bound_s + 1.0 - time.monotonic()))
                watch.stop()
                published = {name: e.incarnations for name, e in engines.items()}
                live_truth = naive_residency([b for name in (restarting, surviving)
                                              for b in published[name][-1]])
                delivery = _engine_delivery(read_topic(env.bootstrap), published, {dying}, o.partitions)
                stored = {h.to_bytes(8, "big") for processes in published.values() for batches in processes
                          for b in batches for e in b.events if e["type"] == "BlockStored" for h in e["block_hashes"]}
                final = _final_answers(workers, live_truth, delivery["table_truth"],
                                       {name: name != dying for name in names}, sorted(stored), settle_s=30.0)
                check = check_residency(env.bootstrap, app_id, delivery["table_truth"])
                _explain(workers[0], check)
                bridge.send_signal(signal.SIGTERM)
                bridge.wait(60)
            finally:
                watch.stop()
                for engine in engines.values():
                    engine.close()
            duplicates = sum((w.stats() or {}).get("duplicates", 0) for w in workers)
        kills = [k.summary(bound_s) for k in watch.kills]
        named_s = max((k["named_for_s"] for k in kills), default=None)
        old_named = watch.kill_of(restarting).old_named_s
        self.log(f"      dead engines named up to {named_s}s after their kill (bound {bound_s:g}s); final answers "
                 f"{'equal' if final['equal'] else 'DIFFER from'} the live truth on {final['blocks_asked']:,} "
                 f"blocks x {len(workers)} workers ({final['rounds']} rounds, {final['seconds']}s)")
        checks = {
            "no answer named a dead engine for more than its lease + 5 s": all(
                k["named_for_s"] <= bound_s for k in kills),
            "every dead engine was watched past the bound": all(k["watched_for_s"] > bound_s for k in kills),
            "every killed engine was named after its kill until its lease lapsed (the watch asks what it held)":
                all(k["named_after_kill"] for k in kills),
            ("after the restart, no answer named the engine for a block its killed process held and the new one "
             "had not stored (some were asked)"): old_named is None and watch.kill_of(restarting).old_asked > 0,
            "GET /workers: the engines alive at the end live, the dead one not": final["live_flags_equal"],
            "each engine process is one epoch in kv-events (the restart found, nothing else taken for one)":
                delivery["epochs_match"],
            "nothing but the killed engines' unsent last batches is missing from kv-events": delivery["lost"] == 0,
            "no gap reported (SourceStale)": delivery["source_events"].get("SourceStale", 0) == 0,
        }
        entry = _run_result(run, check, delivery["produced"], delivery["in_topic"], time.monotonic() - started,
                            checks=checks, lost_in_topic=delivery["lost"], app_id=app_id, store=store,
                            source_lease_s=ENGINE_LEASE_S, heartbeat_interval_s=ENGINE_HEARTBEAT_S,
                            dead_engine_named_s=named_s, dead_engine_bound_s=bound_s, kills=kills,
                            old_blocks_named_after_restart_s=old_named,
                            engines={name: {"role": "restarted" if name == restarting else "killed"
                                            if name == dying else "survives", "batches": n[name],
                                            "published_per_process": [len(i) for i in published[name]]}
                                     for name in names},
                            final_answers={k: v for k, v in final.items() if k != "equal"},
                            table_matches_truth=check.matches, tail_lost_with_engine=delivery["tail"],
                            epochs=delivery["epochs"], source_events=delivery["source_events"],
                            watch={"asked": watch.asked, "errors": watch.errors,
                                   "error_examples": watch.error_examples[:5]},
                            duplicates_ignored=duplicates)
        entry["matches_truth"] = final["equal"] and check.matches
        entry["passed"] = entry["matches_truth"] and all(checks.values())
        return entry

    # ----------------------------------------------------------------- driver

    def run(self) -> dict:
        """Run every chosen scenario; returns the results (see :data:`DEFINITIONS`)."""
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        plan = {"crash": (self.crash, self.options.crash_runs),
                "rebalance": (self.rebalance, self.options.rebalance_runs),
                "broker-outage": (self.broker_outage, 1), "bridge-restart": (self.bridge_restart, 2),
                "table-recovery": (self.table_recovery, 1),
                "engine-crash": (self.engine_crash, self.options.engine_crash_runs)}
        results: dict = {}
        for number, name in enumerate(self.options.scenarios, 1):
            method, runs = plan[name]
            self.log(f"[{number}/{len(self.options.scenarios)}] {name}: {runs} run{'s' * (runs > 1)}")
            entries = []
            for run in range(runs):
                t0 = time.monotonic()
                try:
                    entry = method(run)
                except Exception as exc:  # a failed run is a result, not the end of the chaos run
                    entry = {"run": run, "matches_truth": False, "passed": False, "events_produced": 0,
                             "events_lost": 0, "duplicates_applied": 0, "seconds": round(time.monotonic() - t0, 1),
                             "error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc(limit=-6)}
                entries.append(entry)
                verdict = "matches truth" if entry["matches_truth"] else "DIFFERS from truth"
                failed = [c for c, ok in entry.get("checks", {}).items() if not ok]
                self.log(f"    run {run + 1}/{runs}: {verdict}; {entry['events_produced']:,} produced, "
                         f"{entry['events_lost']} lost, {entry['duplicates_applied']} duplicates applied, "
                         f"{entry['seconds']}s" + (f"; failed checks: {failed}" if failed else "")
                         + (f"; error: {entry['error']}" if "error" in entry else ""))
                for difference in entry.get("differences", [])[:3]:
                    self.log(f"      {difference}")
            results[name] = summarize(entries)
        return results


class _QueryLoad(threading.Thread):
    """Ask ``GET /residency/{hex}/`` of the current target workers in a loop, counting the outcomes.

    A 503 (the group is rebalancing) is retried after 0.2 s for up to 30 s; anything else that is not a 200 is
    a failure, recorded with its reason in ``failures``.
    """

    def __init__(self, workers: list[Worker], blocks: list[bytes]) -> None:
        super().__init__(daemon=True)
        self.targets = list(workers)
        self.blocks = blocks
        self.counts = {"answered": 0, "retried": 0, "failed": 0}
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._done = threading.Event()

    def add(self, worker: Worker) -> None:
        """Ask ``worker`` too from now on."""
        with self._lock:
            self.targets.append(worker)

    def remove(self, worker: Worker) -> None:
        """Stop asking ``worker`` (before it is stopped); waits for a lookup in flight to end."""
        with self._lock:
            self.targets.remove(worker)

    def stop(self) -> None:
        """End the loop and wait for it."""
        self._done.set()
        self.join(60)

    def run(self) -> None:
        index = 0
        while not self._done.is_set():
            block = self.blocks[index % len(self.blocks)]
            with self._lock:
                targets = list(self.targets)
                self._ask(targets[index % len(targets)], block)
            index += 1
            time.sleep(0.02)

    def _ask(self, worker: Worker, block: bytes) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                status, body = http_json(f"{worker.url}/residency/{block.hex()}/", timeout_s=30)
            except (OSError, ValueError) as exc:
                status, body = None, {"error": f"{type(exc).__name__}: {exc}"}
            if status == 200:
                self.counts["answered"] += 1
                return
            if status == 503 and time.monotonic() < deadline:
                self.counts["retried"] += 1
                time.sleep(0.2)
                continue
            self.counts["failed"] += 1
            if len(self.failures) < 20:
                self.failures.append(f":{worker.options.web_port} {block.hex()}: {status} {body.get('error')}")
            return


class _Engine(threading.Thread):
    """An engine double (:class:`FakeVllmPublisher`: vLLM's ZMQ PUB and replay sockets) publishing one simulated
    instance's batches, one every ``pace_s`` seconds, in a thread.

    With ``kill_after`` it is killed after that many batches: its sockets close at once, as the kernel closes a
    SIGKILLed vLLM's, so what is still queued is never sent and nothing answers its replay socket. With ``down_s``
    too, it comes back that many seconds later as a new process on the same ports (seq from 0, an empty cache
    and replay buffer), loads for ``boot_s`` seconds and publishes the rest of its batches; otherwise it stays
    dead. The engine that is never killed stays up, idle, once it has published everything (the bridge's probes
    keep its lease).

    After :meth:`join`, ``incarnations`` holds per process the batches it published (index = its seq) and
    ``error`` the traceback text of a failure.
    """

    def __init__(self, name: str, batches: list[Batch], ports: tuple[int, int], watch: _DeadEngineWatch, *,
                 pace_s: float, kill_after: int | None = None, down_s: float | None = None,
                 boot_s: float = 0.5) -> None:
        super().__init__(daemon=True, name=f"engine-{name}")
        self.engine = name
        self.batches = batches
        self.ports = ports
        self.watch = watch
        self.pace_s = pace_s
        self.kill_after = kill_after
        self.down_s = down_s
        self.boot_s = boot_s
        self.publisher: FakeVllmPublisher | None = None
        self.incarnations: list[list[Batch]] = []
        #: Canonical hashes the current process has stored so far, each added before its batch is sent.
        self.stored: set[bytes] = set()
        self.error: str | None = None
        self._halt = threading.Event()

    def bind(self) -> None:
        """Start the first process: bind its sockets (before the bridge connects)."""
        self.publisher = FakeVllmPublisher(*self.ports)
        self.incarnations.append([])

    def run(self) -> None:
        try:
            end = len(self.batches) if self.kill_after is None else self.kill_after
            self._publish(self.batches[:end])
            if self.kill_after is None or self._halt.is_set():
                return
            held = naive_residency(self.incarnations[-1])
            killed_at = time.monotonic()
            self.publisher.kill()
            self.publisher = None
            self.watch.killed(self.engine, killed_at, sorted({identity[6] for identity in held}))
            if self.down_s is None or self._halt.wait(self.down_s):
                return
            self.stored = set()  # a new object: the watch keeps the new process's
            self.publisher = FakeVllmPublisher(*self.ports)
            self.incarnations.append([])
            self.watch.restarted(self.engine, time.monotonic(), sorted({identity[6] for identity in held}),
                                 self.stored)
            if self._halt.wait(self.boot_s):
                return
            self._publish(self.batches[end:])
        except Exception:  # noqa: BLE001 - reported by the scenario, which fails the run
            self.error = traceback.format_exc(limit=-4)

    def _publish(self, batches: list[Batch]) -> None:
        start = time.monotonic()
        for i, batch in enumerate(batches):
            # an absolute schedule: the pace holds however long a send takes
            if self._halt.wait(max(0.0, start + i * self.pace_s - time.monotonic())):
                return
            # before the send: a block the watch finds missing here was not published when it asked
            self.stored.update(h.to_bytes(8, "big") for e in batch.events if e["type"] == "BlockStored"
                               for h in e["block_hashes"])
            self.publisher.publish_payload(msgspec.msgpack.encode([batch.ts, batch.events, 0]))
            self.incarnations[-1].append(batch)

    def close(self) -> None:
        """Stop publishing and close the current process's sockets (end of the run)."""
        self._halt.set()
        if self.is_alive():
            self.join(10)
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None


@dataclass
class _Kill:
    """One engine kill as :class:`_DeadEngineWatch` saw its answers (times: ``time.monotonic()``)."""

    engine: str
    killed_at: float
    #: Blocks the engine held when it was killed (what the watch asks about while it is dead).
    blocks: list[bytes]
    restarted_at: float | None = None
    #: After the restart: the blocks the dead process held, and what the new process has stored so far (its
    #: :attr:`_Engine.stored`); a block of the first not yet in the second is asked about.
    old_blocks: list[bytes] = field(default_factory=list)
    stored_since_restart: set = field(default_factory=set)
    #: Latest answer naming the engine while it was dead, seconds after the kill; and which (API, worker).
    named_for_s: float = 0.0
    named_by: str | None = None
    named_after_kill: bool = False
    #: Last time the watch asked about the engine while it was dead, seconds after the kill.
    watched_for_s: float = 0.0
    #: Per worker URL: seconds after the kill when GET /workers first said ``live: false``.
    down_seen_s: dict = field(default_factory=dict)
    #: Latest answer naming the restarted engine for a block its dead process held and the new one had not
    #: stored when asked, seconds after the restart (None: none did).
    old_named_s: float | None = None
    asked: int = 0
    old_asked: int = 0
    _turn: int = 0

    def next_block(self, blocks: list[bytes]) -> bytes:
        """The next of ``blocks`` to ask about, in turn (``blocks`` must not be empty)."""
        self._turn += 1
        return blocks[self._turn % len(blocks)]

    def next_old_block(self) -> bytes | None:
        """The next block the dead process held that the new one has not stored yet; None if there is none."""
        for _ in range(len(self.old_blocks)):
            block = self.next_block(self.old_blocks)
            if block not in self.stored_since_restart:
                return block
        return None

    def summary(self, bound_s: float) -> dict:
        """The kill's entry of the results file."""
        return {"engine": self.engine, "restarted_after_s": None if self.restarted_at is None
                else round(self.restarted_at - self.killed_at, 2), "named_for_s": round(self.named_for_s, 2),
                "bound_s": bound_s, "named_by": self.named_by, "named_after_kill": self.named_after_kill,
                "watched_for_s": round(self.watched_for_s, 2),
                "down_seen_s": {url: round(v, 2) for url, v in self.down_seen_s.items()},
                "held_blocks": len(self.blocks), "asked": self.asked,
                "old_blocks": len(self.old_blocks), "old_asked": self.old_asked, "old_named_s": self.old_named_s}


class _DeadEngineWatch(threading.Thread):
    """Asks every worker, in a loop, the lookups a router makes about the engines that are dead now:
    ``GET /workers`` (is it ``live``?), ``POST /prefix-match/`` and ``POST /query_by_hash`` of one block it held
    when it was killed, each in turn; and, once an engine is back, ``POST /prefix-match/`` of blocks its dead
    process held that the new one has not stored yet. Records when each answer last named a dead engine
    (:class:`_Kill`). A 503 or an error is counted in ``errors``, not taken for an answer."""

    def __init__(self, urls: list[str], pause_s: float = 0.1) -> None:
        super().__init__(daemon=True, name="dead-engine-watch")
        self.clients = {url: IndexClient(url, timeout_s=10) for url in urls}
        self.pause_s = pause_s
        self.kills: list[_Kill] = []
        self.asked = 0
        self.errors = 0
        self.error_examples: list[str] = []
        self._lock = threading.Lock()
        self._done = threading.Event()

    def killed(self, engine: str, at: float, blocks: list[bytes]) -> None:
        """``engine`` was killed at ``at`` (monotonic), holding ``blocks``."""
        with self._lock:
            self.kills.append(_Kill(engine, at, blocks))

    def restarted(self, engine: str, at: float, old_blocks: list[bytes], stored: set[bytes]) -> None:
        """``engine`` is back since ``at`` (monotonic); ``old_blocks``: what its dead process held; ``stored``:
        the set of what the new process stores, which its engine thread fills as it publishes."""
        with self._lock:
            kill = self.kill_of(engine)
            kill.restarted_at, kill.old_blocks, kill.stored_since_restart = at, old_blocks, stored

    def kill_of(self, engine: str) -> _Kill:
        """The (last) kill of ``engine``. Raises StopIteration if it was not killed."""
        return next(k for k in reversed(self.kills) if k.engine == engine)

    def stop(self) -> None:
        """End the loop and wait for it."""
        self._done.set()
        if self.is_alive():
            self.join(30)
        for client in self.clients.values():
            client.close()

    def run(self) -> None:
        while not self._done.is_set():
            with self._lock:
                kills = list(self.kills)
            for url, client in self.clients.items():
                dead = [k for k in kills if k.restarted_at is None]
                back = [k for k in kills if k.restarted_at is not None and k.old_blocks]
                if dead:
                    workers = self._ask(url, client.workers)
                    if workers is not None:
                        live = {w["instance_id"] for w in workers["workers"] if w["live"]}
                        for kill in dead:
                            self._saw(kill, url, "GET /workers", kill.engine in live)
                            if kill.engine not in live:
                                kill.down_seen_s.setdefault(url, time.monotonic() - kill.killed_at)
                for kill in (k for k in dead if k.blocks):
                    answer = self._ask(url, client.prefix_match, [kill.next_block(kill.blocks)])
                    if answer is not None:
                        self._saw(kill, url, "POST /prefix-match/",
                                  any(m["instance_id"] == kill.engine for m in answer["matches"]))
                    answer = self._ask(url, client.query_by_hash, [kill.next_block(kill.blocks)])
                    if answer is not None:
                        self._saw(kill, url, "POST /query_by_hash", kill.engine in answer["instances"])
                for kill in back:
                    block = kill.next_old_block()
                    answer = None if block is None else self._ask(url, client.prefix_match, [block])
                    if answer is not None:
                        kill.old_asked += 1
                        if any(m["instance_id"] == kill.engine for m in answer["matches"]):
                            kill.old_named_s = round(time.monotonic() - kill.restarted_at, 2)
            self._done.wait(self.pause_s)

    def _ask(self, url: str, call, *args):
        self.asked += 1
        try:
            return call(*args)
        except (IndexQueryError, OSError, ValueError) as exc:
            self.errors += 1
            if len(self.error_examples) < 20:
                self.error_examples.append(f"{url} {getattr(call, '__name__', call)}: {type(exc).__name__}: {exc}")
            return None

    @staticmethod
    def _saw(kill: _Kill, url: str, api: str, named: bool) -> None:
        # the answer's time is when it came back: an upper bound of when the worker computed it
        now = time.monotonic()
        if kill.restarted_at is not None and now >= kill.restarted_at:
            return  # asked while dead, answered after the restart: the engine is alive again
        kill.asked += 1
        kill.watched_for_s = max(kill.watched_for_s, now - kill.killed_at)
        if named:
            kill.named_after_kill = True
            if now - kill.killed_at >= kill.named_for_s:
                kill.named_for_s, kill.named_by = now - kill.killed_at, f"{api} {url}"


#: Kinds of ``kv_event`` that carry an engine batch's block events (the rest are the bridge's source events).
_BLOCK_EVENT_KINDS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


def _engine_delivery(values: list[bytes], published: dict[str, list[list[Batch]]], killed_for_good: set[str],
                     partitions: int) -> dict:
    """What of the engines' batches reached kv-events (``values``), per engine process.

    Args:
        published: engine -> per process, the batches it published (index = seq). Every process but an engine's
            last was killed (it was restarted); so was the last one of the engines in ``killed_for_good``.

    Returns:
        ``{"produced", "in_topic", "lost", "tail", "epochs", "epochs_match", "source_events", "table_truth"}``:
        messages of every published batch; block-event messages in kv-events; messages missing but for the
        ``tail`` of killed processes (batches after the last one that reached kv-events: still queued in the PUB
        socket when it closed, they died with the engine); epochs per engine; whether each engine has one epoch
        per process; the bridge's source events by kind; and the residency the tables must hold
        (:func:`naive_residency` of each engine's last process, as far as it reached kv-events: a restarted
        engine's earlier processes are retired, the dead engine's rows stay).
    """
    codec = AvroCodec("kv_event")
    got: Counter = Counter()
    epochs: dict[str, set[int]] = {}
    source_events: Counter = Counter()
    for value in values:
        record = codec.decode(value)
        kind = record["event"][0].rsplit(".", 1)[-1]
        if kind in _BLOCK_EVENT_KINDS:
            got[(record["instance_id"], record["publisher_epoch"], record["seq"])] += 1
            epochs.setdefault(record["instance_id"], set()).add(record["publisher_epoch"])
        else:
            source_events[kind] += 1
    produced = lost = tail = 0
    table_batches: list[Batch] = []
    for engine, processes in published.items():
        engine_epochs = sorted(epochs.get(engine, ()))  # epochs grow: the bridge's clock at each new process
        for number, batches in enumerate(processes):
            last_process = number == len(processes) - 1
            killed = not last_process or engine in killed_for_good
            epoch = engine_epochs[number] if number < len(engine_epochs) else None
            want = [message_count([r for i, e in enumerate(b.events)
                                   for r in split_event(b.publisher, seq, b.ts, i, e)], partitions)
                    for seq, b in enumerate(batches)]
            have = [got[(engine, epoch, seq)] for seq in range(len(batches))]
            produced += sum(want)
            last_delivered = max((seq for seq, n in enumerate(have) if n), default=-1)
            for seq, (w, h) in enumerate(zip(want, have)):
                if killed and seq > last_delivered:
                    tail += w
                else:
                    lost += max(w - h, 0)
            if last_process:
                table_batches += [b for seq, b in enumerate(batches) if have[seq]]
    return {"produced": produced, "in_topic": sum(got.values()), "lost": lost, "tail": tail,
            "epochs": {engine: len(e) for engine, e in sorted(epochs.items())},
            "epochs_match": all(len(epochs.get(engine, ())) == len(processes)
                                for engine, processes in published.items()),
            "source_events": dict(sorted(source_events.items())), "table_truth": naive_residency(table_batches)}


def _final_answers(workers: list[Worker], live_truth: dict, table_truth: dict, live: dict[str, bool],
                   blocks: list[bytes], settle_s: float) -> dict:
    """Every worker's final answers against the truth, retried for up to ``settle_s`` seconds while the last
    events reach every worker's fleet index.

    First ``GET /workers`` until, on every worker, each engine's resident blocks per tier equal ``table_truth``'s
    (the index holds what the tables hold, the dead engine's rows included) and its ``live`` flag equals
    ``live``; then ``POST /prefix-match/`` of every block any engine stored, one block per request, whose
    holders and their tiers must be exactly ``live_truth``'s (what the engines alive at the end hold).

    Args:
        live_truth, table_truth: residency as :func:`naive_residency` gives it.
        live: engine -> whether it is alive at the end.
        blocks: the canonical hashes (8 bytes) to ask about: every block any engine process stored.

    Returns:
        ``{"equal", "live_flags_equal", "counts_equal", "blocks_asked", "wrong_blocks", "examples", "rounds",
        "seconds", "workers_view"}``: ``equal`` when the live flags and every block's answer are right;
        ``counts_equal`` whether ``GET /workers``' blocks per tier equal the table truth's (said, not judged: the
        residency table is compared row by row apart); ``examples`` (up to 10) give a wrong block's worker, hash,
        expected and answered ``{instance: tiers}``; ``workers_view`` each worker's last ``live`` flags.

    Raises:
        kvstream.client.IndexQueryError: a worker answered a lookup 4xx or 5xx. OSError: a worker did not answer.
    """
    started = time.monotonic()
    deadline = started + settle_s
    expected_counts: dict[str, Counter] = {engine: Counter() for engine in live}
    # the index holds one (block, holder) per ownership and tier: locality and group are not in it
    for engine, tier, _, _ in {(i[0], i[2], i[3], i[6]) for i in table_truth}:
        expected_counts[engine][tier] += 1
    views: dict = {}
    while True:
        views = {}
        for worker in workers:
            status, body = http_json(f"{worker.url}/workers")
            rows = body.get("workers", []) if status == 200 else []
            views[worker.url] = {r["instance_id"]: {"live": r["live"], "blocks": r["blocks"]} for r in rows}
        flags_equal = all(view.get(engine, {}).get("live") == alive for view in views.values()
                          for engine, alive in live.items())
        counts_equal = all(Counter(view.get(engine, {}).get("blocks", {})) == expected_counts[engine]
                           for view in views.values() for engine in live)
        if (flags_equal and counts_equal) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    by_block: dict[bytes, dict[str, set]] = {}
    for engine, _, tier, _, _, _, block in live_truth:
        by_block.setdefault(block, {}).setdefault(engine, set()).add(tier)
    blocks = sorted(set(blocks) | {i[6] for i in table_truth} | set(by_block))
    rounds = 0
    while True:
        rounds += 1
        wrong: list[dict] = []
        for worker in workers:
            with IndexClient(worker.url, timeout_s=30) as client:
                for block in blocks:
                    matches = client.prefix_match([block])["matches"]
                    got = {m["instance_id"]: set(m["prefix_blocks"]) for m in matches}
                    if got != by_block.get(block, {}):
                        wrong.append({"worker": worker.url, "block": block.hex(),
                                      "expected": {k: sorted(v) for k, v in by_block.get(block, {}).items()},
                                      "answered": {k: sorted(v) for k, v in got.items()}})
        if not wrong or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    return {"equal": not wrong and flags_equal, "live_flags_equal": flags_equal, "counts_equal": counts_equal,
            "blocks_asked": len(blocks), "wrong_blocks": len(wrong), "examples": wrong[:10], "rounds": rounds,
            "seconds": round(time.monotonic() - started, 1),
            "workers_view": {url: {e: v.get("live") for e, v in view.items()} for url, view in views.items()}}


def _diagnose(function, *args):
    """``function(*args)``, or the error it raised as text: a diagnosis must not lose the run's comparison."""
    try:
        return function(*args)
    except Exception as exc:  # noqa: BLE001 - reported in the results instead
        return f"diagnosis failed: {type(exc).__name__}: {exc}"


def _explain(worker: Worker, check: RowCheck) -> None:
    """Add the worker's own answer (``GET /residency/{hex}/``, its local table) to each difference of ``check``.

    Tells a table that is right locally but whose changelog missed an update from one that is wrong itself.
    """
    for difference in check.examples:
        identity = tuple(difference["row"][:6])
        try:
            status, body = http_json(f"{worker.url}/residency/{difference['row'][6]}/")
        except (OSError, ValueError) as exc:
            difference["worker_view"] = f"no answer: {exc}"
            continue
        difference["worker_view"] = _rows_of(body["rows"]).get(identity) if status == 200 else f"HTTP {status}"


def _answers(url: str, blocks: list[bytes]) -> dict:
    """Each block's ``GET /residency/{hex}/`` answer (rows, and sources without the clock-dependent lag), plus
    ``GET /occupancy/`` under the key ``"occupancy"``.

    Raises:
        RuntimeError: a lookup did not answer 200.
    """
    answers = {}
    for block in blocks:
        status, body = http_json(f"{url}/residency/{block.hex()}/")
        if status != 200:
            raise RuntimeError(f"GET {url}/residency/{block.hex()}/ answered {status}: {body}")
        answers[block.hex()] = {"rows": body["rows"],
                                "sources": [{k: v for k, v in s.items() if k != "lag_s"} for s in body["sources"]]}
    status, body = http_json(f"{url}/occupancy/")
    if status != 200:
        raise RuntimeError(f"GET {url}/occupancy/ answered {status}: {body}")
    answers["occupancy"] = sorted(body["occupancy"], key=lambda r: (r["ownership"] or "", r["tier"], r["instance_id"]))
    return answers


def _rows_of(answer_rows: list[dict]) -> dict:
    return {(r["instance_id"], r["data_parallel_rank"], r["tier"], r["ownership"], r["locality"], r["group_idx"]):
            r["copies"] for r in answer_rows}


def _http_agrees(answers: dict, truth: dict) -> int:
    """How many sampled blocks of ``answers`` (from :func:`_answers`) disagree with ``truth``."""
    by_block: dict[str, dict] = {}
    for identity, copies in truth.items():
        by_block.setdefault(identity[6].hex(), {})[identity[:6]] = copies
    return sum(1 for block, answer in answers.items()
               if block != "occupancy" and _rows_of(answer["rows"]) != by_block.get(block, {}))


#: Fields of a ``/sources/`` row that each worker measures by its own clock (``applied_ts``: a worker's own
#: writes at the write, the others' at their changelog record, up to ``--changelog-interval-s`` later).
_OWN_CLOCK_FIELDS = frozenset({"lag_s", "applied_ts", "arrival_lag_s"})


def _fleet_views(workers: list, truth: dict, settle_s: float = 20.0) -> dict:
    """Each worker's ``/occupancy/`` against the truth's resident rows per (ownership, tier, instance), and
    ``/sources/`` compared across workers (without what each worker measures by its own clock: ``lag_s``,
    ``applied_ts``, ``arrival_lag_s``), retried for ``settle_s`` while the global
    tables reach every worker. Returns each worker's occupancy total, the truth's, and whether all agree."""
    expected = Counter((own, tier, inst) for (inst, _, tier, own, _, _, _) in truth)
    deadline = time.monotonic() + settle_s
    while True:
        occupancy, sources = {}, {}
        for worker in workers:
            occupancy[worker.url] = {(r["ownership"], r["tier"], r["instance_id"]): r["resident_blocks"]
                                     for r in _get_json(f"{worker.url}/occupancy/")["occupancy"]}
            sources[worker.url] = [{k: v for k, v in s.items() if k not in _OWN_CLOCK_FIELDS}
                                   for s in _get_json(f"{worker.url}/sources/")["sources"]]
        occupancy_equal = all(o == expected for o in occupancy.values())
        sources_equal = all(s == next(iter(sources.values())) for s in sources.values())
        if (occupancy_equal and sources_equal) or time.monotonic() > deadline:
            return {"occupancy_totals": {url: sum(o.values()) for url, o in occupancy.items()},
                    "truth_total": sum(expected.values()), "occupancy_equal": occupancy_equal,
                    "sources_equal": sources_equal}
        time.sleep(0.5)


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _http_sample(url: str, truth: dict, sample: int, rng: random.Random) -> dict:
    """Ask ``sample`` resident blocks of ``truth`` over HTTP; returns {"asked", "wrong"}."""
    blocks = rng.sample(sorted({identity[6] for identity in truth}), min(sample, len(truth)))
    answers = _answers(url, blocks)
    return {"asked": len(blocks), "wrong": _http_agrees(answers, truth)}


def summarize(entries: list[dict]) -> dict:
    """A scenario's entry of the results file: totals over its runs, and the runs themselves."""
    return {"runs": len(entries),
            "runs_matching_truth": sum(1 for e in entries if e["matches_truth"]),
            "runs_passed": sum(1 for e in entries if e["passed"]),
            "events_produced": sum(e["events_produced"] for e in entries),
            "events_lost": sum(e["events_lost"] for e in entries),
            "duplicates_applied": sum(e["duplicates_applied"] for e in entries),
            "seconds": round(sum(e["seconds"] for e in entries), 1),
            **({"dead_engine_named_max_s": max((e["dead_engine_named_s"] for e in entries
                                                if e.get("dead_engine_named_s") is not None), default=None),
                "dead_engine_bound_s": next(e["dead_engine_bound_s"] for e in entries if "dead_engine_bound_s" in e)}
               if any("dead_engine_bound_s" in e for e in entries) else {}),
            "run_details": entries}


def print_summary(results: dict, log=print) -> None:
    """Print one line per scenario: runs, matching, passed, produced, lost, duplicates, seconds; then engine-crash's
    longest dead-engine answer against its bound."""
    log(f"\n{'scenario':<16}{'runs':>5}{'match':>7}{'passed':>8}{'produced':>11}{'lost':>6}{'dups':>6}{'seconds':>9}")
    for name, s in results.items():
        log(f"{name:<16}{s['runs']:>5}{s['runs_matching_truth']:>7}{s['runs_passed']:>8}{s['events_produced']:>11,}"
            f"{s['events_lost']:>6}{s['duplicates_applied']:>6}{s['seconds']:>9}")
    for name, s in results.items():
        if "dead_engine_bound_s" in s:
            log(f"{name}: dead engines named up to {s['dead_engine_named_max_s']}s after their kill "
                f"(bound {s['dead_engine_bound_s']:g}s)")


def run_chaos(options: ChaosOptions, log=print) -> int:
    """Run the scenarios, print a summary, write ``options.output``; returns 0 when every run passed, else 1.

    Raises:
        ValueError: an unknown scenario name.
        kvstream.broker.BrokerError: Java or the Kafka jars are missing.
    """
    unknown = [s for s in options.scenarios if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    started = time.monotonic()
    chaos = Chaos(options, log)
    log(f"make chaos: {', '.join(options.scenarios)}; trace slice of {options.requests} requests, "
        f"{options.partitions} partitions, seed {options.seed}; work dir {chaos.work}")
    results = chaos.run()
    print_summary(results, log)
    passed = all(s["runs_passed"] == s["runs"] for s in results.values())
    document = {"kafka_version": broker.KAFKA_VERSION,
                "generated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "options": {"scenarios": list(options.scenarios), "crash_runs": options.crash_runs,
                            "rebalance_runs": options.rebalance_runs, "engine_crash_runs": options.engine_crash_runs,
                            "requests": options.requests, "partitions": options.partitions, "seed": options.seed,
                            "outage_s": options.outage_s, "live_s": options.live_s,
                            "worker_session_timeout_s": SESSION_TIMEOUT_S},
                "seconds": round(time.monotonic() - started, 1), "all_passed": passed,
                "definitions": DEFINITIONS, "scenarios": results}
    if options.output is not None:
        options.output.parent.mkdir(parents=True, exist_ok=True)
        options.output.write_text(json.dumps(document, indent=1, default=str) + "\n")
        log(f"results: {options.output}")
    log("all runs passed" if passed else "SOME RUNS FAILED")
    return 0 if passed else 1
