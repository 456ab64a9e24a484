"""``make bench``: every figure of the pipeline's benchmark, measured in one run on a broker of its own.

Steps (each writes its figures into ``bench/results.json`` as soon as it has them, so a failed or
interrupted step leaves the others):

1. baselines that need no broker: fastavro's raw decode (and encode) rate of the simulator's
   ``kv_event`` records on one core;
2. memory per resident row: the in-memory store (tracemalloc over the entry dicts) and a RocksDB store
   (rocksdict with Faust's options; bytes on disk after flush and compaction);
3. the producer path: the simulator's engine events through per-block split, Avro encode, produce and
   acknowledgement into ``kv-events`` (the simulation runs first and is timed apart);
4. the plain-consumer baseline: ``kv-events`` consumed in batches, decoded and applied with
   :func:`stream_apps.residency.apply_block_event` into a dict (no Faust, no changelog);
5. the bridge: a local ZMQ publisher (another process) sends the simulator's batches at full speed;
6. the stream app with one worker, then event-to-table latency at a steady rate on that worker;
7. the stream app with two workers;
8. peak RSS of a worker (RocksDB store) at 1 million resident rows, then recovery of those rows by a
   fresh worker with an empty data dir; optionally the same peak RSS at 10 million rows;
9. the fleet index (bench/index_bench.py): lookups over HTTP and in process, a mixed run, memory per resident
   pair, catch-up on a changelog, freshness at a steady rate.

Definitions of every figure are in :data:`DEFINITIONS` (written into results.json) and in
bench/README.md, "Figures".
"""

from __future__ import annotations

import datetime
import gc
import io
import itertools
import json
import math
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from tqdm import tqdm

from bench.index_bench import INDEX_DEFINITIONS
from kvstream.broker import free_port

#: Target, unit and definition of every figure, and which figure (if any) is its baseline.
DEFINITIONS: dict[str, dict] = {
    "producer_events_per_s": {
        "unit": "block events/s", "target": 150_000, "better": "higher", "baseline": "fastavro_encode_per_s",
        "definition": "Simulator engine events (generated beforehand, not timed) through per-block split, Avro "
                      "encode and produce to kv-events, until the broker acknowledged all (flush). Baseline: "
                      "fastavro's schemaless_writer alone on the same records, one core."},
    "bridge_events_per_s": {
        "unit": "block events/s", "target": 150_000, "better": "higher", "baseline": "producer_events_per_s",
        "definition": "A local ZMQ PUB publisher (another process) sends the simulator's batches as vLLM msgpack "
                      "at full speed; the bridge decodes, splits, encodes and produces them. From the first "
                      "batch received to the last message acknowledged."},
    "stream_events_per_s_1w": {
        "unit": "events/s", "target": 30_000, "better": "higher", "baseline": "plain_consumer_events_per_s",
        "definition": "One worker, kv-events pre-filled with the producer step's events: kv-events messages "
                      "divided by the time from the worker's first materialized event (GET /stats/) to the "
                      "consumer group having committed everything in kv-events and the re-keyed topic. "
                      "'including_startup_s' counts from the worker's start. Store memory://."},
    "stream_events_per_s_1w_rocksdb": {
        "unit": "events/s", "target": None, "better": "higher", "baseline": "stream_events_per_s_1w",
        "definition": "As stream_events_per_s_1w with store rocksdb://, the default of 'kvstream worker' and of "
                      "deployments: every table partition in RocksDB, entries read back through its cache."},
    "stream_events_per_s_2w": {
        "unit": "events/s", "target": "1.6 x stream_events_per_s_1w", "better": "higher",
        "baseline": "stream_events_per_s_1w",
        "definition": "As stream_events_per_s_1w with two workers of one app id (separate web ports and data "
                      "dirs), from the first materialized event on either worker to everything committed."},
    "stream_2w_vs_1w": {
        "unit": "ratio", "target": None, "better": "higher", "baseline": None,
        "definition": "stream_events_per_s_2w / stream_events_per_s_1w, reported with the CPU µs per event of "
                      "each process of both runs (details.cpu_us_per_event_by_process_1w, _2w): on a 2-core "
                      "machine two workers and their repartition children share the cores with the broker, so "
                      "the ratio says how much of the machine one worker left idle, not how the app scales."},
    "latency_p50_ms": {
        "unit": "ms", "target": None, "better": "lower", "baseline": None,
        "definition": "Event-to-table delay while kv-events receives a steady 10,000 block events/s (fresh "
                      "blocks, ts = wall clock at produce) and one caught-up worker runs: for every record of "
                      "kv-residency-changes caused by those events, its Kafka timestamp (set when the worker "
                      "produced it, right after applying the event to the table) minus the event's ts. Includes "
                      "the producer's linger and the worker's batching. details: p99 per 5 s, and the two "
                      "halves' [p50, p99] split at the repartition topic."},
    "latency_p99_ms": {
        "unit": "ms", "target": 50, "better": "lower", "baseline": None,
        "definition": "99th percentile of the delays of latency_p50_ms. Issue 27's target; its moonshot is 20."},
    "bytes_per_row_memory": {
        "unit": "bytes/row", "target": 300, "better": "lower", "baseline": None,
        "definition": "tracemalloc's traced memory of what the memory:// store holds, divided by rows: a dict "
                      "{residency key: the entry's Avro bytes} for entries built with apply_block_event from "
                      "the simulator's stores (one resident row per entry), plus its cache of decoded entries "
                      "at the default size (details: cache_entries, and the figure without_cache)."},
    "bytes_per_row_rocksdb": {
        "unit": "bytes/row", "target": 250, "better": "lower", "baseline": "bytes_per_row_memory",
        "definition": "The same rows in a RocksDB store opened with Faust's rocksdict options (raw UTF-8 key, "
                      "Avro 'residency' value with single-object framing): size of the database directory after "
                      "flush and full compaction, divided by rows."},
    "rss_peak_mib_1m_rows": {
        "unit": "MiB", "target": None, "better": "lower", "baseline": None,
        "definition": "Peak RSS (sampled every 0.5 s, psutil) of a worker process tree with store rocksdb:// "
                      "while it materializes everything in kv-events, which holds at least 1 million resident "
                      "rows (the Mooncake trace repeated through an eviction-free fleet, block ids shifted per "
                      "repetition)."},
    "rss_peak_mib_10m_rows": {
        "unit": "MiB", "target": 1536, "better": "lower", "baseline": "rss_peak_mib_1m_rows",
        "definition": "As rss_peak_mib_1m_rows with at least 10 million resident rows (--rows-large)."},
    "recovery_s_1m_rows": {
        "unit": "s", "target": 60, "better": "lower", "baseline": None,
        "definition": "A fresh worker (same app id, empty data dir, store rocksdb://) after the 1 million rows "
                      "run: seconds from its start until Faust logs 'Recovery complete' (tables rebuilt from "
                      "their changelogs)."},
    "fastavro_encode_per_s": {
        "unit": "records/s", "target": None, "better": "higher", "baseline": None,
        "definition": "fastavro.schemaless_writer over the simulator's kv_event records, one core, no Kafka: the "
                      "producer path's baseline."},
    "fastavro_decode_per_s": {
        "unit": "records/s", "target": None, "better": "higher", "baseline": None,
        "definition": "fastavro.schemaless_reader over the encoded kv_event bodies of the simulator's records, "
                      "one core, no Kafka: the limit of any consumer that decodes every event."},
    "kafka_streams_events_per_s": {
        "unit": "events/s", "target": None, "better": "higher", "baseline": None,
        "definition": "Step peers: the Kafka Streams peer (bench/kafka_streams: Processor API, one stream thread, "
                      "RocksDB store with a changelog and caching, commit every 1 s, clears applied by a store "
                      "scan, no repartition, epochs or idempotency) over peers.kv-events (the trace, as the "
                      "stream steps): events divided by the time from its first event processed to its group "
                      "having committed the end of the topic. Median of --peer-rounds runs."},
    "stream_vs_kafka_streams_rocksdb": {
        "unit": "ratio", "target": 1.0, "better": "higher", "baseline": None,
        "definition": "Step peers: one kvstream worker with rocksdb:// over the same topic, same definition of the "
                      "rate, divided by kafka_streams_events_per_s (medians of the same rounds, interleaved). "
                      "Issue 27's target; its moonshot is 1.3."},
    "stream_vs_kafka_streams_memory": {
        "unit": "ratio", "target": 1.2, "better": "higher", "baseline": None,
        "definition": "As stream_vs_kafka_streams_rocksdb with memory://. Issue 27's target; its moonshot is 1.5."},
    "cpu_vs_kafka_streams_rocksdb": {
        "unit": "ratio", "target": 1.0, "better": "lower", "baseline": None,
        "definition": "Step peers: cpu_us_per_event_stream_rocksdb / cpu_us_per_event_kafka_streams, every process "
                      "of the worker (its repartition child included) against every thread of the peer's JVM; "
                      "details.by_process has each process's share."},
    "cpu_vs_kafka_streams_memory": {
        "unit": "ratio", "target": 1.0, "better": "lower", "baseline": None,
        "definition": "As cpu_vs_kafka_streams_rocksdb with memory://."},
    "cpu_us_per_event_stream_rocksdb": {
        "unit": "µs/event", "target": None, "better": "lower", "baseline": "cpu_us_per_event_kafka_streams",
        "definition": "Step peers: user + system CPU of the worker's process tree (the worker and its repartition "
                      "child) from its first event to everything committed, per input event; the broker's apart. "
                      "details.peers has it per process."},
    "cpu_us_per_event_stream_memory": {
        "unit": "µs/event", "target": None, "better": "lower", "baseline": "cpu_us_per_event_kafka_streams",
        "definition": "As cpu_us_per_event_stream_rocksdb with memory://."},
    "cpu_us_per_event_kafka_streams": {
        "unit": "µs/event", "target": None, "better": "lower", "baseline": None,
        "definition": "As cpu_us_per_event_stream_rocksdb for the Kafka Streams peer's JVM (every thread: stream "
                      "thread, producer, RocksDB, GC, JIT)."},
    "messages_per_event_stream_rocksdb": {
        "unit": "messages/event", "target": None, "better": "lower", "baseline": "messages_per_event_kafka_streams",
        "definition": "Step peers: messages the run wrote to the broker (end offsets of every topic but the input "
                      "and __consumer_offsets, after minus before), per input event. details.peers has them per "
                      "topic."},
    "messages_per_event_stream_memory": {
        "unit": "messages/event", "target": None, "better": "lower", "baseline": "messages_per_event_kafka_streams",
        "definition": "As messages_per_event_stream_rocksdb with memory://."},
    "messages_per_event_kafka_streams": {
        "unit": "messages/event", "target": None, "better": "lower", "baseline": None,
        "definition": "As messages_per_event_stream_rocksdb for the Kafka Streams peer (its changelog)."},
    "plain_consumer_events_per_s": {
        "unit": "events/s", "target": None, "better": "higher", "baseline": "fastavro_decode_per_s",
        "definition": "confluent-kafka consumer over kv-events (batches of 10,000), Avro decode, "
                      "apply_block_event / apply_clear into a dict: the stream app's aggregation without Faust "
                      "and without changelogs, from the first message to the last."},
    "tail_messages_per_s": {
        "unit": "messages/s", "target": None, "better": "higher", "baseline": "kcat_messages_per_s",
        "definition": "'kvstream tail kv-events --from-beginning --to-end' as a process (Python start-up included), "
                      "every record decoded with the project's codec and printed as a JSON line to /dev/null: "
                      "messages in kv-events divided by the wall time from its start to its exit. Best of 2. "
                      "details.tail also has the same on the stream-1w app's kv-residency-changes topic."},
    "kcat_messages_per_s": {
        "unit": "messages/s", "target": None, "better": "higher", "baseline": None,
        "definition": "'kcat -C -o beginning -e -q' on the same topic in the same run, raw values to /dev/null "
                      "(no decoding): messages divided by wall time from start to exit. Best of 2. None, with the "
                      "reason in details, when kcat is not installed."},
    "tail_vs_kcat": {
        "unit": "ratio", "target": 0.3, "better": "higher", "baseline": None,
        "definition": "tail_messages_per_s / kcat_messages_per_s on kv-events."},
}

DEFINITIONS.update(INDEX_DEFINITIONS)  # the index step's (bench/index_bench.py)

#: The keys results.json always holds (value null when a step was skipped or failed); fastavro_encode_per_s is
#: an extra, the producer path's baseline.
FIGURES = tuple(DEFINITIONS)

_DEFAULT_OUTPUT = Path("bench")


@dataclass
class BenchOptions:
    """Options of ``make bench`` (see its ``--help``)."""

    #: Where results.json and results.png go.
    output_dir: Path = _DEFAULT_OUTPUT
    #: Broker, workers and temporary stores (emptied at start).
    work_dir: Path = Path(".kvstream/bench")
    #: Short smoke run: small sizes, no 10M-row step.
    quick: bool = False
    #: Trace requests replayed by the producer and bridge steps (None: the whole trace; quick: 3000).
    requests: int | None = None
    #: Trace requests written to kv-events for the plain-consumer and stream-app steps (None: as ``requests``;
    #: quick: 600).
    stream_requests: int | None = None
    #: Resident rows of the RSS step (quick: 60,000) and of the optional large step (0: skip).
    rows: int = 1_000_000
    rows_large: int = 10_000_000
    #: Steady rate and duration of the latency step.
    latency_rate: int = 10_000
    latency_s: float = 30.0
    #: Rows of the memory step.
    memory_rows: int = 200_000
    partitions: int = 8
    #: Seconds any one wait (a worker consuming, a broker starting) may take.
    timeout_s: float = 7200.0
    #: Steps to run (None: all); names as in :data:`STEPS`.
    only: tuple[str, ...] | None = None
    #: Runs of each contestant of the peers step (medians reported; quick: 1). Three, not two: the first
    #: contestant of a run pays about twice the broker CPU per event of the later rounds (cause unknown; see
    #: bench/HISTORY.md), and the peer's rate moves by up to 40% between rounds; a median of two is their mean.
    peer_rounds: int = 3
    #: A schema registry: producers and workers then use the Confluent wire format (registry mode); empty: none.
    schema_registry: str = ""
    #: Resident (block, holder) pairs of the index step's memory part (quick: 1M), and rows of its catch-up part's
    #: changelog (quick: 400,000): the targets are stated for 10M of each.
    index_pairs: int = 10_000_000
    index_rows: int = 10_000_000

    def apply_quick(self) -> None:
        """Shrink every size for a smoke run (--requests and --stream-requests given explicitly are kept)."""
        self.requests = self.requests or 3000
        self.stream_requests = self.stream_requests or min(600, self.requests)
        self.rows = min(self.rows, 60_000)
        self.rows_large = 0
        self.latency_s = min(self.latency_s, 5.0)
        self.memory_rows = min(self.memory_rows, 20_000)
        self.peer_rounds = min(self.peer_rounds, 1)
        self.index_pairs = min(self.index_pairs, 1_000_000)
        self.index_rows = min(self.index_rows, 400_000)


def _say(text: str) -> None:
    print(text, flush=True)


# --------------------------------------------------------------------------- trace helpers

def _fleet_batches(requests, fleet=None, epoch_offset: int = 0):
    """The simulator's batches for ``requests`` (the simulation is run here, all at once)."""
    from producers.simulator import TRACE_START_TS, ClusterSimulator

    sim = ClusterSimulator(fleet, publisher_epoch=int(TRACE_START_TS * 1000) + epoch_offset)
    return list(sim.run(requests)), sim


def _shifted(requests, repetition: int):
    """The requests with block ids shifted past every earlier repetition: distinct blocks, same shape."""
    from producers.simulator import Request

    if repetition == 0:
        return requests
    offset = repetition * (1 << 40)
    return [Request(r.timestamp_ms, tuple(h + offset for h in r.hash_ids)) for r in requests]


def _eviction_free_fleet():
    """A fleet whose tiers never evict, so every stored block stays resident (for the row-count steps)."""
    from producers.simulator import FleetConfig

    big = 1 << 40
    return FleetConfig(gpu_blocks=big, cpu_blocks=big, kvcr_blocks=big, clear_instance=None)


def _records(batches) -> Iterator[dict]:
    """The block records of ``batches``, one at a time (a whole trace's records as dicts take gigabytes)."""
    from producers.split import split_event

    for b in batches:
        for i, e in enumerate(b.events):
            yield from split_event(b.publisher, b.seq, b.ts, i, e)


# --------------------------------------------------------------------------- worker helpers

def _http_json(url: str, timeout_s: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


def _stats(port: int) -> dict | None:
    try:
        return _http_json(f"http://127.0.0.1:{port}/stats/", 5)
    except (OSError, ValueError):
        return None


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds used so far by these processes and all their live children (psutil)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for p in (proc, *proc.children(recursive=True)):
                times = p.cpu_times()
                total += times.user + times.system
        except psutil.Error:
            pass
    return total


class _Peak:
    """Samples the RSS of a process and its children every ``every_s`` in a thread; ``peak`` in bytes."""

    def __init__(self, pids: Callable[[], list[int]], every_s: float = 0.5) -> None:
        self.peak = 0
        self._pids = pids
        self._every = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            total = 0
            for pid in self._pids():
                try:
                    proc = psutil.Process(pid)
                    total += proc.memory_info().rss
                    total += sum(c.memory_info().rss for c in proc.children(recursive=True))
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(self._every)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


@dataclass
class _Workers:
    """Workers of one app id started by the bench, with their ports and logs."""

    bootstrap: str
    app_id: str
    work: Path
    store: str = "memory://"
    partitions: int = 8
    #: ``--topic-prefix`` of the workers (the peers step reads ``peers.kv-events``).
    topic_prefix: str = ""
    #: ``--residency-changes``: the stream steps publish them (the latency and tail steps read them); the peers
    #: step does not, as a deployment that does not ask for them.
    residency_changes: bool = False
    #: ``--schema-registry-url`` of the workers (``make bench BENCH_ARGS=--schema-registry=URL``).
    schema_registry_url: str = ""
    processes: list = field(default_factory=list)
    ports: list = field(default_factory=list)
    logs: list = field(default_factory=list)

    def start(self, count: int = 1, fresh_dirs: bool = True) -> None:
        from kvstream.worker import spawn_worker
        from stream_apps.settings import WorkerSettings

        for _ in range(count):
            index = len(self.processes)
            port = free_port()
            data_dir = self.work / f"{self.app_id}-{index}-{port}"
            if fresh_dirs:
                shutil.rmtree(data_dir, ignore_errors=True)
            log = self.work / f"{self.app_id}-{index}.log"
            options = WorkerSettings(bootstrap_servers=self.bootstrap, web_port=port, data_dir=data_dir,
                                    store=self.store, partitions=self.partitions, app_id=self.app_id, log_level="info",
                                    topic_prefix=self.topic_prefix, residency_changes=self.residency_changes,
                                    schema_registry_url=self.schema_registry_url,
                                    source_lease_s=BENCH_SOURCE_LEASE_S)
            self.processes.append(spawn_worker(options, log))
            self.ports.append(port)
            self.logs.append(log)

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.poll() is None]

    def materialized(self) -> int:
        return sum((_stats(port) or {}).get("materialized", 0) for port in self.ports)

    def resident_rows(self) -> int:
        total = 0
        for port in self.ports:
            s = _stats(port) or {}
            total += s.get("became_resident", 0) - s.get("stopped_resident", 0)
        return total

    def check_alive(self) -> None:
        for process, log in zip(self.processes, self.logs):
            if process.poll() is not None:
                tail = log.read_text(errors="replace").splitlines()[-15:]
                raise RuntimeError(f"worker exited with code {process.returncode}; last lines of {log}:\n  "
                                   + "\n  ".join(tail))

    def wait_first_event(self, timeout_s: float) -> float:
        """Wait until a worker has materialized an event; returns the perf_counter time it was seen."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            if self.materialized() > 0:
                return time.perf_counter()
            time.sleep(0.1)
        raise TimeoutError(f"workers of {self.app_id} materialized nothing within {timeout_s:.0f}s")

    def wait_consumed(self, total: int, timeout_s: float, label: str) -> float:
        """Wait until the group has committed everything; returns the perf_counter time it was seen."""
        from kvstream.worker import wait_until_consumed
        from schemas.topics import TopicNames

        with tqdm(total=total, unit="ev", desc=label, leave=False, disable=None) as bar:
            def show(_progress):
                bar.n = min(self.materialized(), total)
                bar.refresh()

            process = self.processes[0]
            try:
                wait_until_consumed(self.bootstrap, TopicNames(self.app_id, self.topic_prefix), process,
                                    timeout_s=timeout_s, on_progress=show,
                                    poll_s=0.25)
            except RuntimeError:
                self.check_alive()
                raise
        self.check_alive()
        return time.perf_counter()

    def stop(self) -> None:
        from kvstream.worker import stop_worker

        for process in self.processes:
            stop_worker(process)


# --------------------------------------------------------------------------- the publisher of the bridge step

def _publish_process(port: int, payloads: list[bytes], start, done) -> None:
    """Child process: bind PUB on 127.0.0.1:port, wait for ``start``, send every payload, set ``done``."""
    import zmq

    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # never drop: the bridge's receive buffer is the bound
    pub.bind(f"tcp://127.0.0.1:{port}")
    start.wait()
    for seq, payload in enumerate(payloads):
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
    done.set()
    pub.close(linger=-1)
    context.term()


def _vllm_payloads(batches) -> list[bytes]:
    """Each simulator batch as vLLM 0.33 publishes it: msgpack ``[ts, [event maps], dp_rank]``."""
    import msgspec

    encode = msgspec.msgpack.Encoder().encode
    return [encode([b.ts, b.events, 0]) for b in batches]


# --------------------------------------------------------------------------- the bench

class Bench:
    """One benchmark run: owns the broker, the workers and ``results.json``.

    Args:
        options: what to run and how big.

    Use :meth:`run`; figures land in :attr:`results` and in ``<output_dir>/results.json``.
    """

    def __init__(self, options: BenchOptions) -> None:
        self.o = options
        self.work = options.work_dir.resolve()
        self.results: dict = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "mode": "quick" if options.quick else ("full" if _is_full(options) else "custom"),
            "machine": _machine(),
            "figures": {k: {"value": None, **{f: DEFINITIONS[k][f] for f in ("unit", "target", "better")},
                            "baseline": DEFINITIONS[k]["baseline"], "definition": DEFINITIONS[k]["definition"]}
                        for k in FIGURES},
            "details": {},
            "errors": {},
        }
        self.bootstrap: str | None = None
        self.broker_pid: int | None = None
        self._trace = None
        self._batches = None
        self._kv_events_messages = 0
        self._peer_input_info: dict | None = None

    # ---- bookkeeping

    def _set(self, key: str, value: float | None, **details) -> None:
        self.results["figures"][key]["value"] = None if value is None else round(float(value), 3)
        if details:
            self.results["details"][key] = details
        self._write()

    def _write(self) -> None:
        self.o.output_dir.mkdir(parents=True, exist_ok=True)
        for figure in self.results["figures"].values():
            base = figure["baseline"]
            if isinstance(base, str):
                figure["baseline_value"] = self.results["figures"][base]["value"]
        path = self.o.output_dir / "results.json"
        path.write_text(json.dumps(self.results, indent=1) + "\n")

    def _trace_requests(self):
        if self._trace is None:
            from producers.simulator import load_trace

            self._trace = load_trace(limit=self.o.requests)
        return self._trace

    def _sim_batches(self):
        if self._batches is None:
            t0 = time.perf_counter()
            self._batches, _ = _fleet_batches(self._trace_requests())
            self.results["details"]["simulation"] = {"batches": len(self._batches),
                                                     "seconds": round(time.perf_counter() - t0, 3)}
        return self._batches

    # ---- steps

    def step_baselines(self) -> None:
        """fastavro decode (and encode) of the simulator's kv_event records, one core."""
        import fastavro

        from schemas import AvroCodec

        codec = AvroCodec("kv_event")
        records = list(itertools.islice(_records(self._sim_batches()), 200_000))
        parsed = codec.schema.parsed
        t0 = time.perf_counter()
        bodies = []
        for record in records:
            out = io.BytesIO()
            fastavro.schemaless_writer(out, parsed, record)
            bodies.append(out.getvalue())
        encode_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for body in bodies:
            fastavro.schemaless_reader(io.BytesIO(body), parsed, None, return_record_name=True,
                                       return_record_name_override=True)
        decode_s = time.perf_counter() - t0
        self._set("fastavro_encode_per_s", len(records) / encode_s)
        self._set("fastavro_decode_per_s", len(records) / decode_s, records=len(records),
                  mean_body_bytes=round(sum(map(len, bodies)) / len(bodies), 1))
        _say(f"      fastavro on {len(records):,} records: encode {len(records) / encode_s:,.0f}/s, "
             f"decode {len(records) / decode_s:,.0f}/s")

    def _row_entries(self, count: int) -> Iterator[tuple[str, dict]]:
        """``count`` (key, entry) pairs as the residency table holds them, one resident row each."""
        from schemas.clear_position import NO_CLEAR
        from stream_apps.residency import ApplyStats, apply_block_event, residency_key

        stats = ApplyStats()
        made = 0
        repetition = 0
        while True:
            batches, _ = _fleet_batches(_shifted(self._trace_requests(), repetition), _eviction_free_fleet(),
                                        repetition)
            entries: dict[str, dict] = {}
            for record in _records(batches):
                kind, body = record["event"]
                if record["block_hash"] is None:
                    continue
                key = residency_key(body["ownership"], record["block_hash"])
                if key in entries:
                    continue  # one row per entry: the figure is per row
                entry, _, _ = apply_block_event(None, record, NO_CLEAR, NO_CLEAR, frozenset({"GPU"}), stats)
                if entry is None:
                    continue
                entries[key] = entry
                yield key, entry
                made += 1
                if made >= count:
                    return
            repetition += 1

    def step_memory(self) -> None:
        """Bytes per resident row in the memory store (tracemalloc) and in a RocksDB store (disk)."""
        from schemas import AvroCodec
        from stream_apps.store_settings import ResidencyRocksDBOptions, residency_rocksdb_options

        rows = self.o.memory_rows
        pairs = list(tqdm(self._row_entries(rows), total=rows, unit="row", desc="rows", leave=False,
                          disable=None))
        # memory: what the memory store (stream_apps.store.CompactMemoryTableStore) holds, built from fresh
        # copies under tracemalloc: every entry as its Avro bytes under its key, and its default cache of
        # decoded entries (the last 10,000 written)
        from stream_apps.settings import WorkerSettings
        from stream_apps.store import value_encoder

        encode = value_encoder(AvroCodec("residency"))
        cache_entries = WorkerSettings(store="memory://").residency_cache_entries
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        table = {}
        for key, entry in pairs:
            table[(key + " ")[:-1]] = encode(entry)
        encoded_only = tracemalloc.get_traced_memory()[0] - before
        cache = {(key + " ")[:-1]: _deep_copy(entry) for key, entry in pairs[-cache_entries:]}
        memory = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        del table, cache
        self._set("bytes_per_row_memory", memory / rows, rows=rows, cache_entries=cache_entries,
                  without_cache=round(encoded_only / rows, 1))

        codec = AvroCodec("residency")
        path = self.work / "rocksdb-bytes-per-row"
        shutil.rmtree(path, ignore_errors=True)
        from rocksdict import Rdict

        options = ResidencyRocksDBOptions(**residency_rocksdb_options())  # the worker's, default sizes
        db = Rdict(str(path), options=options.as_options())
        value_bytes = 0
        for key, entry in pairs:
            value = codec.encode(entry)
            value_bytes += len(value)
            db[key.encode()] = value
        db.flush()
        db.compact_range(None, None)
        db.close()
        disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        sst = sum(f.stat().st_size for f in path.rglob("*.sst"))
        self._set("bytes_per_row_rocksdb", disk / rows, rows=rows, sst_bytes_per_row=round(sst / rows, 1),
                  avro_value_bytes_per_row=round(value_bytes / rows, 1), directory_bytes=disk)
        _say(f"      {rows:,} rows: memory store {memory / rows:,.0f} B/row ({encoded_only / rows:,.0f} without its "
             f"cache of {cache_entries:,} decoded entries); RocksDB {disk / rows:,.0f} B/row on "
             f"disk ({sst / rows:,.0f} in SST files; Avro value {value_bytes / rows:,.0f} B)")
        shutil.rmtree(path, ignore_errors=True)

    def step_producer(self) -> None:
        """The producer path into a topic of its own (``bench-producer``, partitioned as kv-events)."""
        from kafka_io.admin import ensure_topics

        batches = self._sim_batches()
        gc.freeze()  # the pre-generated batches are the harness's, not the path's: keep them out of GC passes
        ensure_topics(self.bootstrap, {"bench-producer": self.o.partitions})
        producer = self._kv_producer("bench-producer")
        records = 0
        t0 = time.perf_counter()
        for batch in tqdm(batches, unit="batch", desc="produce", leave=False, disable=None):
            for index, event in enumerate(batch.events):
                records += producer.send_event(batch.publisher, batch.seq, batch.ts, index, event)
        stats = producer.flush()
        seconds = time.perf_counter() - t0
        sim_s = self.results["details"]["simulation"]["seconds"]
        self._set("producer_events_per_s", records / seconds, block_events=records, messages=stats.acked,
                  seconds=round(seconds, 3), engine_events=sum(len(b.events) for b in batches),
                  with_simulation_events_per_s=round(records / (seconds + sim_s)))
        _say(f"      {records:,} block events ({stats.acked:,} messages) in {seconds:.2f}s: "
             f"{records / seconds:,.0f} events/s ({records / (seconds + sim_s):,.0f}/s with the simulation)")
        del producer

    def _stream_input(self) -> None:
        """Write the simulator's events for ``stream_requests`` into kv-events once (not timed)."""
        if self._kv_events_messages:
            return
        from producers.simulator import load_trace
        from schemas.topics import KV_EVENTS

        requests = self._trace_requests()
        if self.o.stream_requests is not None and self.o.stream_requests != len(requests):
            requests = load_trace(limit=self.o.stream_requests)
        batches, _ = _fleet_batches(requests)
        producer = self._kv_producer(KV_EVENTS)
        for batch in batches:
            for index, event in enumerate(batch.events):
                producer.send_event(batch.publisher, batch.seq, batch.ts, index, event)
        self._kv_events_messages += producer.flush().acked
        self.results["details"]["kv_events_input"] = {"requests": len(requests),
                                                      "messages": self._kv_events_messages}
        _say(f"      kv-events: {self._kv_events_messages:,} messages from {len(requests):,} trace requests")

    def step_plain_consumer(self) -> None:
        """The aggregation as a plain confluent-kafka consumer loop over kv-events."""
        self._stream_input()
        import uuid

        from confluent_kafka import Consumer, TopicPartition

        from kafka_io.config import client_config
        from schemas import ALL_BLOCKS_CLEARED, SOURCE_WIDE_EVENTS, AvroCodec
        from schemas.clear_position import NO_CLEAR
        from schemas.topics import KV_EVENTS
        from stream_apps.residency import ApplyStats, SourceSettings, apply_block_event, apply_clear, residency_key

        codec = AvroCodec("kv_event")
        settings = SourceSettings()
        consumer = Consumer(client_config(self.bootstrap, **{
            "group.id": f"bench-plain-{uuid.uuid4()}", "enable.auto.commit": False,
            "auto.offset.reset": "earliest", "fetch.max.bytes": 64 << 20,
            "max.partition.fetch.bytes": 16 << 20}))
        ends = {}
        for p in range(self.o.partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(KV_EVENTS, p), timeout=10)
            if high > low:
                ends[p] = high
        consumer.assign([TopicPartition(KV_EVENTS, p, 0) for p in ends])
        table: dict[str, dict] = {}
        marks: dict[tuple, tuple] = {}
        stats = ApplyStats()
        events = 0
        t0 = None
        deadline = time.monotonic() + self.o.timeout_s
        try:
            while ends:
                if time.monotonic() > deadline:
                    raise TimeoutError("plain consumer did not reach the end of kv-events")
                for message in consumer.consume(10_000, timeout=1.0):
                    if message.error():
                        continue
                    if t0 is None:
                        t0 = time.perf_counter()
                    events += 1
                    record = codec.decode(message.value())
                    kind, _ = record["event"]
                    source = (message.partition(), record["instance_id"], record["data_parallel_rank"])
                    if kind in SOURCE_WIDE_EVENTS:
                        if kind == ALL_BLOCKS_CLEARED:
                            mark = (record["publisher_epoch"], record["seq"], record["batch_index"])
                            marks[source] = mark
                            tiers = settings.clear_tiers(record["instance_id"])
                            for key in list(table):
                                entry, _, changed = apply_clear(table[key], record["instance_id"],
                                                                record["data_parallel_rank"], mark, tiers, stats)
                                if changed:
                                    if entry is None:
                                        del table[key]
                                    else:
                                        table[key] = entry
                    else:
                        mark = marks.get(source, NO_CLEAR)
                        key = residency_key(record["event"][1]["ownership"], record["block_hash"])
                        entry, _, _ = apply_block_event(table.get(key), record, mark, mark,
                                                        settings.clear_tiers(record["instance_id"]), stats)
                        if entry is None:
                            table.pop(key, None)
                        else:
                            table[key] = entry
                    p = message.partition()
                    if p in ends and message.offset() + 1 >= ends[p]:
                        del ends[p]
        finally:
            consumer.close()
        seconds = time.perf_counter() - (t0 or time.perf_counter())
        resident = sum(1 for e in table.values() for r in e["rows"] if r["copies"] > 0)
        self._set("plain_consumer_events_per_s", events / seconds if seconds else None, events=events,
                  seconds=round(seconds, 3), resident_rows=resident)
        _say(f"      {events:,} events in {seconds:.2f}s: {events / seconds:,.0f} events/s; {resident:,} resident rows")

    def step_bridge(self) -> None:
        """The bridge fed by a local publisher process at full speed."""
        from kafka_io.admin import ensure_topics
        from producers.bridge import Bridge, BridgeMetrics, KafkaBatchSink, PublisherEndpoint

        topic = "bench-bridge"
        ensure_topics(self.bootstrap, {topic: self.o.partitions})
        payloads = _vllm_payloads(self._sim_batches())
        gc.freeze()  # as in the producer step: the harness's data stays out of GC passes
        port = free_port()
        context = multiprocessing.get_context("spawn")
        start, done = context.Event(), context.Event()
        publisher = context.Process(target=_publish_process, args=(port, payloads, start, done), daemon=True)
        publisher.start()
        producer = self._kv_producer(topic)
        metrics = BridgeMetrics()
        bridge = Bridge([PublisherEndpoint(f"tcp://127.0.0.1:{port}", None, "bench-0")],
                        KafkaBatchSink(producer, metrics), metrics=metrics, receive_hwm=0)
        try:
            time.sleep(1.0)  # let the subscription reach the publisher (ZMQ's slow joiner)
            start.set()
            handled = 0
            t0 = None
            deadline = time.monotonic() + self.o.timeout_s
            with tqdm(total=len(payloads), unit="batch", desc="bridge", leave=False, disable=None) as bar:
                while handled < len(payloads):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the bridge received {handled} of {len(payloads)} batches")
                    # one poll drains everything that has arrived (and produces it): the clock starts before
                    # the poll that gets the first batch, and polls wait at most 1 ms for data
                    before = time.perf_counter()
                    n = bridge.poll(1)
                    if n and t0 is None:
                        t0 = before
                    handled += n
                    bar.update(n)
            stats = producer.flush()
            seconds = time.perf_counter() - t0
        finally:
            bridge.close()
            publisher.join(10)
            if publisher.is_alive():
                publisher.terminate()
        records = stats.acked
        self._set("bridge_events_per_s", records / seconds, messages=records, batches=len(payloads),
                  seconds=round(seconds, 3), dead_lettered=stats.dead_lettered)
        _say(f"      {records:,} messages from {len(payloads):,} batches in {seconds:.2f}s: "
             f"{records / seconds:,.0f} events/s")

    def _stream(self, workers: int, key: str, keep: bool = False, store: str = "memory://") -> _Workers | None:
        from bench.peers import process_cpu

        self._stream_input()
        app_id = f"bench-{workers}w" + ("" if store == "memory://" else "-" + store.split(":")[0])
        group = self._workers(app_id, self.work, store=store, partitions=self.o.partitions,
                         residency_changes=True)
        t_start = time.perf_counter()
        group.start(workers)
        try:
            t_first = group.wait_first_event(self.o.timeout_s)
            labels = {pid: f"worker{n}" for n, pid in enumerate(group.pids())}
            cpu_first = _cpu_seconds(group.pids()), _cpu_seconds([self.broker_pid])
            by_process_first = process_cpu(group.pids(), labels)
            t_done = group.wait_consumed(self._kv_events_messages, self.o.timeout_s, f"{workers} worker(s)")
            cpu_done = _cpu_seconds(group.pids()), _cpu_seconds([self.broker_pid])
            by_process_done = process_cpu(group.pids(), labels)
        except BaseException:
            group.stop()
            raise
        events = self._kv_events_messages
        seconds = t_done - t_first
        # cores busy on average from the first event to the last: how much of the machine this rate took
        self._set(key, events / seconds, events=events, seconds=round(seconds, 3),
                  including_startup_s=round(t_done - t_start, 3),
                  including_startup_events_per_s=round(events / (t_done - t_start)),
                  worker_cores=round((cpu_done[0] - cpu_first[0]) / seconds, 2),
                  broker_cores=round((cpu_done[1] - cpu_first[1]) / seconds, 2), machine_cores=os.cpu_count(),
                  cpu_us_per_event_by_process={
                      label: round((cpu - by_process_first.get(label, 0.0)) / events * 1e6, 2)
                      for label, cpu in by_process_done.items() if not label.endswith("resource_tracker")},
                  broker_cpu_us_per_event=round((cpu_done[1] - cpu_first[1]) / events * 1e6, 2), store=store)
        one, two = (self.results["figures"][k]["value"] for k in ("stream_events_per_s_1w", "stream_events_per_s_2w"))
        if one and two:
            details = self.results["details"]
            self._set("stream_2w_vs_1w", two / one, **{
                f"cpu_us_per_event_by_process_{n}w": details.get(f"stream_events_per_s_{n}w", {}).get(
                    "cpu_us_per_event_by_process") for n in (1, 2)})
        _say(f"      {events:,} events in {seconds:.1f}s from the first event ({t_done - t_start:.1f}s from start): "
             f"{events / seconds:,.0f} events/s")
        if keep:
            return group
        group.stop()
        return None

    def step_stream_1w(self) -> None:
        """One worker end to end; then the latency step on the same (caught-up) worker."""
        group = self._stream(1, "stream_events_per_s_1w", keep="latency" in self._steps)
        if group is not None:
            try:
                self._latency(group)
            finally:
                group.stop()

    def step_stream_1w_rocksdb(self) -> None:
        """One worker end to end with the RocksDB store, the default of ``kvstream worker``."""
        self._stream(1, "stream_events_per_s_1w_rocksdb", store="rocksdb://")

    def step_stream_2w(self) -> None:
        """Two workers of one app id end to end."""
        self._stream(2, "stream_events_per_s_2w")

    def _latency(self, group: _Workers) -> None:
        """Steady produce of fresh blocks at ``latency_rate``; delays from kv-residency-changes, split at the
        repartition topic (the ``ownership_batch`` message that carried each event)."""
        from bench.peers import partition_end_offsets
        from kafka_io.reader import messages_to_end
        from schemas import AvroCodec
        from schemas.topics import KV_EVENTS, TopicNames

        _say(f"[latency] {self.o.latency_rate:,} events/s for {LATENCY_WARMUP_S:.0f}s of warm-up, then "
             f"{self.o.latency_s:.0f}s measured, into a running worker")
        total = int(self.o.latency_rate * (LATENCY_WARMUP_S + self.o.latency_s))
        events = []
        repetition = 1000
        while len(events) < total:  # fresh blocks: the trace shifted, through the normal fleet
            batches, _ = _fleet_batches(_shifted(self._trace_requests(), repetition), None, repetition)
            events += [(b.publisher, b.seq, i, e) for b in batches for i, e in enumerate(b.events)]
            repetition += 1
        topics = TopicNames(group.app_id)
        ends = partition_end_offsets(self.bootstrap, [topics.residency_changes, topics.by_ownership])
        starts = {topic: {p: offset for (t, p), offset in ends.items() if t == topic}
                  for topic in (topics.residency_changes, topics.by_ownership)}
        producer = self._kv_producer(KV_EVENTS)
        sent = 0
        t0 = time.perf_counter()
        began = time.time()
        index = 0
        with tqdm(total=total, unit="ev", desc="steady", leave=False, disable=None) as bar:
            while sent < total:
                due = int((time.perf_counter() - t0) * self.o.latency_rate)
                while sent < min(due, total) and index < len(events):
                    publisher, seq, batch_index, event = events[index]
                    index += 1
                    sent += producer.send_event(publisher, seq, time.time(), batch_index, event)
                producer.poll()
                bar.n = sent
                bar.refresh()
                time.sleep(0.002)
        produced_s = time.perf_counter() - t0
        stats = producer.flush()
        self._kv_events_messages += stats.acked
        group.wait_consumed(self._kv_events_messages, self.o.timeout_s, "catch up")
        # When the repartition process wrote each event's ownership_batch message (its Kafka timestamp), by the
        # event's (block hash, instance, ts): the delay's two halves, before and after the repartition topic
        batch_codec, event_codec = AvroCodec("ownership_batch"), AvroCodec("kv_event")
        rekeyed: dict[tuple, float] = {}
        for message in messages_to_end(self.bootstrap, topics.by_ownership, self.o.timeout_s,
                                       starts[topics.by_ownership]):
            for item in batch_codec.decode(message.value())["events"]:
                event = event_codec.decode(item["event"])
                if event["ts"] >= began and event["block_hash"] is not None:
                    rekeyed[(event["block_hash"], event["instance_id"], event["ts"])] = message.timestamp()[1]
        codec = AvroCodec("residency_change")
        delays, to_batch, after_batch = [], [], []
        windows: dict[int, list[float]] = defaultdict(list)  # 5 s windows of event time -> delays
        for message in messages_to_end(self.bootstrap, topics.residency_changes, self.o.timeout_s,
                                       starts[topics.residency_changes]):
            change = codec.decode(message.value())
            if change["ts"] < began:
                continue
            changed_ms, event_ms = message.timestamp()[1], change["ts"] * 1000.0
            delay = changed_ms - event_ms
            windows[int((change["ts"] - began) // 5)].append(delay)
            if change["ts"] >= began + LATENCY_WARMUP_S:
                delays.append(delay)
                batch_ms = rekeyed.get((change["block_hash"], change["instance_id"], change["ts"]))
                if batch_ms is not None:
                    to_batch.append(batch_ms - event_ms)
                    after_batch.append(changed_ms - batch_ms)
        if not delays:
            raise RuntimeError("no kv-residency-changes records from the steady-rate events")
        delays.sort()
        p50, p99 = _percentile(delays, 0.5), _percentile(delays, 0.99)
        details = {"samples": len(delays), "events": sent, "seconds": round(produced_s, 2),
                   "achieved_rate": round(sent / produced_s), "max_ms": round(delays[-1], 1),
                   "mean_ms": round(statistics.fmean(delays), 1),
                   "warmup_s": LATENCY_WARMUP_S,
                   # per 5 s of event time, the warm-up's first: the transient and the steady state apart
                   "p99_ms_per_5s": [round(_percentile(sorted(w), 0.99)) for _, w in sorted(windows.items())],
                   # event ts -> its ownership_batch message written (producer linger, broker, the repartition
                   # process's read, batching, re-keying), then -> its table change produced (the batch's
                   # flush, the agent's fetch and queue, the apply); p50 and p99 of each, in ms
                   "to_repartition_topic_ms": _quantiles(to_batch),
                   "repartition_topic_to_table_ms": _quantiles(after_batch)}
        self._set("latency_p50_ms", p50, **details)
        self._set("latency_p99_ms", p99, **details)
        _say(f"      {sent:,} events at {sent / produced_s:,.0f}/s; {len(delays):,} table changes: "
             f"p50 {p50:,.0f} ms, p99 {p99:,.0f} ms, max {delays[-1]:,.0f} ms; p50/p99 to the repartition "
             f"topic {details['to_repartition_topic_ms']}, from there to the table "
             f"{details['repartition_topic_to_table_ms']}")

    def _fill_rows(self, rows_wanted: int, label: str) -> int:
        """Append eviction-free repetitions of the trace to kv-events until it holds ``rows_wanted`` more
        resident rows; returns the rows added."""
        from schemas.topics import KV_EVENTS

        producer = self._kv_producer(KV_EVENTS)
        added = 0
        repetition = self.results["details"].setdefault("_next_repetition", 1)
        with tqdm(total=rows_wanted, unit="row", desc=label, leave=False, disable=None) as bar:
            while added < rows_wanted:
                batches, sim = _fleet_batches(_shifted(self._trace_requests(), repetition),
                                              _eviction_free_fleet(), repetition)
                for batch in batches:
                    for index, event in enumerate(batch.events):
                        producer.send_event(batch.publisher, batch.seq, batch.ts, index, event)
                rows = len(sim.ground_truth())
                added += rows
                bar.update(rows)
                repetition += 1
        self.results["details"]["_next_repetition"] = repetition
        stats = producer.flush()
        self._kv_events_messages += stats.acked
        return added

    def _rss(self, rows: int, key: str, app_id: str, recovery: bool) -> None:
        self._stream_input()
        have = self.results["details"].get("_rows_in_kv_events", 0)
        if have < rows:
            _say(f"      writing {rows - have:,}+ resident rows into kv-events")
            have += self._fill_rows(rows - have, "rows")
            self.results["details"]["_rows_in_kv_events"] = have
        group = self._workers(app_id, self.work, store="rocksdb://", partitions=self.o.partitions)
        group.start(1)
        peak = _Peak(group.pids)
        try:
            t0 = time.perf_counter()
            group.wait_consumed(self._kv_events_messages, self.o.timeout_s, f"{app_id}")
            seconds = time.perf_counter() - t0
            resident = group.resident_rows()
        finally:
            peak_bytes = peak.stop()
            group.stop()
        self._set(key, peak_bytes / (1 << 20), resident_rows=resident, events=self._kv_events_messages,
                  consume_seconds=round(seconds, 1))
        _say(f"      {resident:,} resident rows; peak RSS {peak_bytes / (1 << 20):,.0f} MiB "
             f"({self._kv_events_messages:,} events in {seconds:.0f}s)")
        if recovery:
            self._recovery(app_id, resident)

    def _recovery(self, app_id: str, rows: int) -> None:
        group = self._workers(app_id, self.work / "recovery", store="rocksdb://",
                         partitions=self.o.partitions)
        t0 = time.perf_counter()
        group.start(1)
        try:
            deadline = time.monotonic() + self.o.timeout_s
            while True:
                group.check_alive()
                if "Recovery complete" in group.logs[0].read_text(errors="replace"):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("the recovering worker did not log 'Recovery complete'")
                time.sleep(0.1)
            seconds = time.perf_counter() - t0
        finally:
            group.stop()
        self._set("recovery_s_1m_rows", seconds, resident_rows=rows,
                  rows_per_s=round(rows / seconds) if seconds else None)
        _say(f"      fresh worker recovered {rows:,} rows in {seconds:.1f}s (from its start)")

    def step_rss(self) -> None:
        """Peak RSS at ``rows`` resident rows, then recovery of those rows."""
        self._rss(self.o.rows, "rss_peak_mib_1m_rows", "bench-rows", recovery=True)

    def step_rss_large(self) -> None:
        """Peak RSS at ``rows_large`` resident rows (optional)."""
        if not self.o.rows_large:
            self.results["details"]["rss_peak_mib_10m_rows"] = {"skipped": "--rows-large 0 (or --quick)"}
            self._write()
            _say("      skipped (--rows-large 0 or --quick)")
            return
        self._rss(self.o.rows_large, "rss_peak_mib_10m_rows", "bench-rows-large", recovery=False)

    def _time_process(self, argv: list[str], runs: int = 2) -> float:
        """Best wall time of ``runs`` runs of a command with its output to /dev/null, in seconds.

        Raises:
            RuntimeError: the command exited with a non-zero code (its standard error in the message).
        """
        import subprocess

        best = math.inf
        for _ in range(runs):
            t0 = time.perf_counter()
            done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=self.o.timeout_s)
            seconds = time.perf_counter() - t0
            if done.returncode != 0:
                raise RuntimeError(f"{argv[0]} exited with {done.returncode}: {done.stderr.decode()[-500:]}")
            best = min(best, seconds)
        return best

    def _tail_vs_kcat(self, topic: str) -> dict:
        """tail's and kcat's rates over every message of ``topic``, one after the other."""
        from confluent_kafka import Consumer, TopicPartition

        from kafka_io.config import client_config

        consumer = Consumer(client_config(self.bootstrap, **{"group.id": "bench-tail-count"}))
        try:
            partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
            messages = 0
            for p in partitions:
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                messages += high - low
        finally:
            consumer.close()
        registry = ["--schema-registry", self.o.schema_registry] if self.o.schema_registry else []
        tail_s = self._time_process([sys.executable, "-c", "import sys; from kvstream.cli import main; "
                                     "sys.exit(main())", "tail", topic, "--bootstrap-servers", self.bootstrap,
                                     "--from-beginning", "--to-end", *registry])
        found = {"topic": topic, "messages": messages, "tail_s": round(tail_s, 3),
                 "tail_messages_per_s": round(messages / tail_s)}
        kcat = shutil.which("kcat") or shutil.which("kafkacat")
        if kcat is None:
            found["kcat_skipped"] = "kcat is not installed (Debian: apt-get install kcat)"
            return found
        kcat_s = self._time_process([kcat, "-C", "-b", self.bootstrap, "-t", topic, "-o", "beginning", "-e", "-q"])
        found.update(kcat_s=round(kcat_s, 3), kcat_messages_per_s=round(messages / kcat_s),
                     tail_vs_kcat=round(kcat_s / tail_s, 3))
        # kcat above prints the raw bytes; in registry mode a kcat built with Avro support decodes them to JSON
        # as tail does (the same job), so that ratio is in details too
        avro_kcat = _kcat_with_avro()
        if self.o.schema_registry and avro_kcat:
            avro_s = self._time_process([avro_kcat, "-C", "-b", self.bootstrap, "-t", topic, "-o", "beginning", "-e",
                                         "-q", "-s", "value=avro", "-r", self.o.schema_registry, "-f", "%s\n"])
            found.update(kcat_avro_s=round(avro_s, 3), kcat_avro_messages_per_s=round(messages / avro_s),
                         tail_vs_kcat_avro=round(avro_s / tail_s, 3))
        return found

    def step_tail(self) -> None:
        """``kvstream tail`` against kcat on kv-events (and on a changes topic, if a stream step made one)."""
        self._stream_input()
        from schemas.topics import KV_EVENTS, TopicNames

        main = self._tail_vs_kcat(KV_EVENTS)
        topics = {KV_EVENTS: main}
        changes = TopicNames("bench-1w").residency_changes
        from confluent_kafka.admin import AdminClient

        from kafka_io.config import client_config

        if changes in AdminClient(client_config(self.bootstrap)).list_topics(timeout=10).topics:
            topics[changes] = self._tail_vs_kcat(changes)
        self._set("tail_messages_per_s", main["tail_messages_per_s"], topics=topics)
        self._set("kcat_messages_per_s", main.get("kcat_messages_per_s"), **(
            {"skipped": main["kcat_skipped"]} if "kcat_skipped" in main else {}))
        self._set("tail_vs_kcat", main.get("tail_vs_kcat"))
        for topic, found in topics.items():
            _say(f"      {topic}: {found['messages']:,} messages; tail {found['tail_messages_per_s']:,}/s, kcat "
                 + (f"{found['kcat_messages_per_s']:,}/s: tail/kcat {found['tail_vs_kcat']:.2f}"
                    if "kcat_s" in found else f"skipped ({found['kcat_skipped']})"))

    # ---- the peers step (bench/peers.py)

    def _peer_input(self) -> dict:
        """``peers.kv-events``, written once with the stream steps' trace requests (untimed), and the truth."""
        if self._peer_input_info is not None:
            return self._peer_input_info
        from bench.peers import PEER_PREFIX
        from kafka_io.admin import ensure_topics
        from producers.simulator import load_trace
        from schemas.topics import TopicNames

        topic = TopicNames(prefix=PEER_PREFIX).kv_events
        ensure_topics(self.bootstrap, {topic: self.o.partitions})
        requests = self._trace_requests()
        if self.o.stream_requests is not None and self.o.stream_requests != len(requests):
            requests = load_trace(limit=self.o.stream_requests)
        batches, sim = _fleet_batches(requests)
        producer = self._kv_producer(topic,
                                   dead_letter_topic=TopicNames(prefix=PEER_PREFIX).dead_letter)
        for batch in batches:
            for index, event in enumerate(batch.events):
                producer.send_event(batch.publisher, batch.seq, batch.ts, index, event)
        messages = producer.flush().acked
        truth = sum(1 for copies in sim.ground_truth().values() if copies > 0)
        self._peer_input_info = {"topic": topic, "events": messages, "requests": len(requests), "truth_rows": truth}
        _say(f"      {topic}: {messages:,} messages from {len(requests):,} trace requests; truth {truth:,} rows")
        return self._peer_input_info

    def _peer_round(self, name: str, round_: int, classpath: str | None) -> dict:
        """One run of one contestant over ``peers.kv-events``: its figures (see bench/peers.py)."""
        from bench.peers import PEER_PREFIX, KafkaStreamsPeer, process_cpu, topic_end_offsets, wait_committed

        source = self._peer_input()
        topic, events = source["topic"], source["events"]
        app_id = f"{name}-{round_}"
        before = topic_end_offsets(self.bootstrap)
        t_start = time.perf_counter()
        if name == "kafka-streams":
            peer = KafkaStreamsPeer(classpath, self.bootstrap, app_id, self.work / f"peer-{app_id}",
                                    free_port(), self.work / f"peer-{app_id}.log", topic)
            pids, labels, alive = peer.pids, {peer.process.pid: "kafka_streams"}, peer.check_alive
            processed = lambda: (peer.stats() or {}).get("events", 0)  # noqa: E731
            group = app_id
            stop = peer.stop
        else:
            store = "rocksdb://" if name == "stream-rocksdb" else "memory://"
            workers = self._workers(app_id, self.work, store=store, partitions=self.o.partitions,
                               topic_prefix=PEER_PREFIX)
            workers.start(1)
            pids, labels, alive = workers.pids, {workers.processes[0].pid: "worker"}, workers.check_alive
            processed = workers.materialized
            group = None
            stop = workers.stop
        peak = _Peak(pids)
        try:
            deadline = time.monotonic() + self.o.timeout_s
            while processed() == 0:
                alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} processed nothing within {self.o.timeout_s:.0f}s")
                time.sleep(0.1)
            t_first = time.perf_counter()
            cpu_first = process_cpu(pids(), labels), _cpu_seconds([self.broker_pid])
            if group is None:
                t_done = workers.wait_consumed(events, self.o.timeout_s, app_id)
            else:
                t_done = wait_committed(self.bootstrap, group, topic, self.o.timeout_s, alive)
            cpu_done = process_cpu(pids(), labels), _cpu_seconds([self.broker_pid])
            if name == "kafka-streams":
                stats = peer.stats() or {}
                rows = peer.rows()
                resident = rows["resident_rows"]
                processed_s = (stats["last_event_ms"] - stats["first_event_ms"]) / 1000.0
                extra = {"peer_stats": stats, "peer_rows": rows}
            else:
                resident = workers.resident_rows()
                processed_s = None
                extra = {"worker_stats": _stats(workers.ports[0])}
        finally:
            rss = peak.stop()
            stop()
        after = topic_end_offsets(self.bootstrap)
        seconds = t_done - t_first
        written = {t: after.get(t, 0) - before.get(t, 0) for t in after
                   if t != topic and after.get(t, 0) != before.get(t, 0)}
        offsets = written.pop("__consumer_offsets", 0)
        by_process = {label: round((cpu_done[0].get(label, 0.0) - cpu_first[0].get(label, 0.0)) / events * 1e6, 2)
                      for label in cpu_done[0]}
        result = {
            "round": round_, "events": events, "seconds": round(seconds, 3), "events_per_s": events / seconds,
            "including_startup_s": round(t_done - t_start, 3),
            "processed_events_per_s": (events / processed_s) if processed_s else None,
            "cpu_us_per_event": round(sum(by_process.values()), 2), "cpu_us_per_event_by_process": by_process,
            "broker_cpu_us_per_event": round((cpu_done[1] - cpu_first[1]) / events * 1e6, 2),
            "rss_peak_mib": round(rss / (1 << 20), 1), "messages_written": sum(written.values()),
            "messages_per_event": round(sum(written.values()) / events, 4), "messages_by_topic": written,
            "consumer_offsets_messages": offsets, "resident_rows": resident,
            "rows_equal_truth": resident == source["truth_rows"], **extra}
        _say(f"      {name} round {round_}: {events / seconds:,.0f} events/s, {result['cpu_us_per_event']:.1f} µs CPU "
             f"per event (broker {result['broker_cpu_us_per_event']:.1f}), peak RSS {result['rss_peak_mib']:,.0f} "
             f"MiB, {result['messages_per_event']:.2f} messages/event, {resident:,} resident rows "
             f"({'=' if result['rows_equal_truth'] else '!='} truth {source['truth_rows']:,})")
        return result

    def step_peers(self) -> None:
        """kvstream's worker (RocksDB, memory) against the Kafka Streams peer, one at a time, medians of rounds."""
        from bench.peers import CONTESTANTS, build_kafka_streams, summarize

        classpath = build_kafka_streams(_say)
        source = self._peer_input()
        peers = self.results.setdefault("peers", {})
        peers.update({"rounds": self.o.peer_rounds, "events": source["events"], "truth_rows": source["truth_rows"],
                      "topic": source["topic"], "load_average_at_start": _load(),
                      "contestants": {name: {"rounds": []} for name in CONTESTANTS}})
        errors = []
        for round_ in range(self.o.peer_rounds):  # interleaved: a slow minute of the machine hits every one
            for name in CONTESTANTS:
                try:
                    peers["contestants"][name]["rounds"].append(self._peer_round(name, round_, classpath))
                except KeyboardInterrupt:
                    raise
                except Exception as exc:  # one contestant's failure keeps the others' rounds
                    errors.append(f"{name} round {round_}: {type(exc).__name__}: {exc}")
                    _say(f"      {name} round {round_} FAILED: {type(exc).__name__}: {exc}")
                self._write()
        peers["load_average_at_end"] = _load()
        medians = {}
        for name, contestant in peers["contestants"].items():
            contestant["median"] = summarize(contestant["rounds"]) if contestant["rounds"] else None
            medians[name] = contestant["median"] or {}
        ks = medians["kafka-streams"].get("events_per_s")
        self._set("kafka_streams_events_per_s", ks, rows_equal_truth=medians["kafka-streams"].get("rows_equal_truth"))
        for store in ("rocksdb", "memory"):
            m = medians[f"stream-{store}"]
            rate = m.get("events_per_s")
            self._set(f"stream_vs_kafka_streams_{store}", rate / ks if rate and ks else None,
                      stream_events_per_s=rate, kafka_streams_events_per_s=ks)
            self._set(f"cpu_us_per_event_stream_{store}", m.get("cpu_us_per_event"),
                      by_process=m.get("cpu_us_per_event_by_process"))
            self._set(f"messages_per_event_stream_{store}", m.get("messages_per_event"))
        k = medians["kafka-streams"]
        self._set("cpu_us_per_event_kafka_streams", k.get("cpu_us_per_event"),
                  by_process=k.get("cpu_us_per_event_by_process"))
        for store in ("rocksdb", "memory"):
            m = medians[f"stream-{store}"]
            ours, theirs = m.get("cpu_us_per_event"), k.get("cpu_us_per_event")
            self._set(f"cpu_vs_kafka_streams_{store}", ours / theirs if ours and theirs else None,
                      by_process=m.get("cpu_us_per_event_by_process"), kafka_streams_cpu_us_per_event=theirs)
        self._set("messages_per_event_kafka_streams", k.get("messages_per_event"))
        if errors:
            raise RuntimeError("; ".join(errors))

    # ---- the index step (bench/index_bench.py)

    def step_index(self) -> None:
        """The fleet index against issue 25's targets; last, so that its 10M-row changelog and its processes
        load no other step."""
        from bench.index_bench import run_step

        run_step(self, _say)

    # ---- producers and workers in the run's framing

    def _kv_producer(self, topic: str, **kwargs):
        """A kv-event producer to ``topic``; with ``--schema-registry``, in the Confluent wire format."""
        from kafka_io.schema_registry import writer_codec
        from producers.kafka_sink import KvEventProducer
        from schemas.topics import SCHEMAS

        codec = writer_codec("kv_event", self.bootstrap, topic, self.o.schema_registry, SCHEMAS)
        return KvEventProducer(self.bootstrap, topic, codec=codec, **kwargs)

    def _workers(self, app_id: str, work: Path, **kwargs) -> _Workers:
        """A group of workers of ``app_id``, with the run's schema registry."""
        return _Workers(self.bootstrap, app_id, work, schema_registry_url=self.o.schema_registry, **kwargs)

    # ---- driver

    @property
    def _steps(self) -> tuple[str, ...]:
        return tuple(step for step in STEPS if self.o.only is None or step in self.o.only)

    def run(self) -> int:
        """Run every selected step; returns 0 if all succeeded, 1 if any failed (the rest still ran)."""
        from kafka_io.admin import ensure_topics
        from kvstream import broker
        from schemas.topics import KV_EVENTS

        if self.o.quick:
            self.o.apply_quick()
        self.results["options"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(self.o).items()}
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        port = free_port()
        _say(f"[broker] starting Kafka on 127.0.0.1:{port} (data in {self.work / 'broker'})")
        status = broker.start(port=port, data_dir=self.work / "broker")
        self.bootstrap = status.bootstrap_servers
        self.broker_pid = status.pid
        failed = 0
        try:
            ensure_topics(self.bootstrap, {KV_EVENTS: self.o.partitions})
            for name in self._steps:
                if name == "latency":
                    continue  # runs inside stream-1w, on its caught-up worker
                _say(f"[{name}] {STEP_HELP[name]}")
                t0 = time.perf_counter()
                try:
                    getattr(self, "step_" + name.replace("-", "_"))()
                except KeyboardInterrupt:
                    raise
                except Exception as exc:  # one failed step must not lose the others' figures
                    failed += 1
                    self.results["errors"][name] = f"{type(exc).__name__}: {exc}"
                    self._write()
                    _say(f"      FAILED: {type(exc).__name__}: {exc}")
                self.results["details"].setdefault("step_seconds", {})[name] = round(time.perf_counter() - t0, 1)
        finally:
            broker.stop(self.work / "broker")
            for k in [k for k in self.results["details"] if k.startswith("_")]:
                del self.results["details"][k]
            self._write()
        print_table(self.results)
        try:
            plot(self.results, self.o.output_dir / "results.png")
            _say(f"\nwrote {self.o.output_dir / 'results.json'} and {self.o.output_dir / 'results.png'}")
        except ImportError as exc:
            _say(f"\nwrote {self.o.output_dir / 'results.json'}; no plot ({exc}: install the 'bench' extra)")
        return 1 if failed else 0


def _percentile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile (0 to 1) of the sorted list ``ordered``, by the nearest-rank rule."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(len(ordered) * q) - 1))]


def _quantiles(values: list[float]) -> list[float] | None:
    """``[p50, p99]`` of ``values`` in ms, rounded to 0.1; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return [round(_percentile(ordered, 0.5), 1), round(_percentile(ordered, 0.99), 1)]


#: Seconds of the steady rate before the latency step measures: the producer's first connection and the
#: worker's switch from catching up to steady flow are a transient, not the steady state the figure is about
#: (their delays are still in ``details``, as the first ``p99_ms_per_5s`` window).
LATENCY_WARMUP_S = 5.0


def _kcat_with_avro() -> str | None:
    """A kcat that decodes Confluent-framed Avro (``-s value=avro``; Debian's package does not), or None."""
    for candidate in ("/opt/kcat-avro/bin/kcat", shutil.which("kcat")):
        if candidate and shutil.which(candidate):
            shown = subprocess.run([candidate, "-h"], capture_output=True, text=True, check=False)
            if "avro" in (shown.stdout + shown.stderr).lower():
                return candidate
    return None


#: The bench workers' --source-lease-s: the bench's sources publish once and are asked about long after, so a day.
BENCH_SOURCE_LEASE_S = 86_400.0

#: Steps in run order (``--only`` takes these names).
STEPS = ("baselines", "memory", "producer", "plain-consumer", "bridge", "stream-1w", "latency", "stream-1w-rocksdb",
         "stream-2w", "tail", "peers", "rss", "rss-large", "index")
STEP_HELP = {
    "baselines": "fastavro decode/encode of the simulator's records, one core",
    "memory": "bytes per resident row: memory store and RocksDB store",
    "producer": "simulator events -> split -> Avro -> topic bench-producer, acknowledged",
    "plain-consumer": "kv-events -> decode -> apply_block_event into a dict, no Faust",
    "bridge": "ZMQ publisher process -> bridge -> Kafka, acknowledged",
    "stream-1w": "one worker end to end (then the latency step on it)",
    "latency": "steady rate into a running worker; event-to-table delay",
    "stream-1w-rocksdb": "one worker end to end, RocksDB store (the worker's default)",
    "stream-2w": "two workers end to end",
    "tail": "kvstream tail against kcat on kv-events (and the stream-1w app's changes topic)",
    "peers": "kvstream worker (rocksdb, memory) against the Kafka Streams peer, one at a time, medians of rounds",
    "rss": "worker peak RSS at --rows resident rows (rocksdb store), then recovery of them",
    "rss-large": "worker peak RSS at --rows-large resident rows",
    "index": "the fleet index: HTTP and embedded lookups, a mixed run, memory, catch-up, freshness",
}


def _is_full(options: BenchOptions) -> bool:
    """True when every size is the full run's (the whole trace, 1M and 10M rows, 30 s at 10,000/s)."""
    full = BenchOptions()
    return (options.only is None and options.requests is None and options.stream_requests is None
            and (options.rows, options.rows_large, options.latency_rate, options.latency_s, options.memory_rows)
            == (full.rows, full.rows_large, full.latency_rate, full.latency_s, full.memory_rows)
            and options.peer_rounds == full.peer_rounds
            and (options.index_pairs, options.index_rows) == (full.index_pairs, full.index_rows))


def _deep_copy(value):
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    if isinstance(value, bytes):
        return bytes(bytearray(value))
    return value


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _machine() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for package in ("confluent-kafka", "fastavro", "faust-streaming", "aiokafka", "rocksdict", "pyzmq", "msgspec"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    import confluent_kafka

    from kvstream.broker import KAFKA_VERSION

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"cores": os.cpu_count(), "python": platform.python_version(), "implementation":
            platform.python_implementation(), "platform": platform.platform(), "processor": platform.processor(),
            "librdkafka": confluent_kafka.libversion()[0], "kafka": KAFKA_VERSION, "versions": versions,
            "load_average_at_start": load}


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.2f}"


def _met(value, target, better: str) -> str:
    """``yes``/``NO`` for a figure with a numeric target, ``-`` without one or without a value."""
    if not isinstance(target, (int, float)) or value is None:
        return "-"
    return "yes" if (value >= target if better == "higher" else value <= target) else "NO"


def print_table(results: dict) -> None:
    """Print every figure with its unit, target and baseline."""
    print(f"\n{'figure':<30} {'value':>14} {'target':>24} {'met':>4} {'baseline':>32}  unit")
    figures = results["figures"]
    for key, f in figures.items():
        base = f.get("baseline")
        base_text = f"{base}={_fmt(figures[base]['value'])}" if isinstance(base, str) else "-"
        target = bound = f["target"]
        if target == "1.6 x stream_events_per_s_1w":
            one = figures["stream_events_per_s_1w"]["value"]
            bound = 1.6 * one if one else None
            target = f"1.6x1w={_fmt(bound)}" if one else "1.6 x 1w"
        print(f"{key:<30} {_fmt(f['value']):>14} {_fmt(target):>24} {_met(f['value'], bound, f['better']):>4} "
              f"{base_text:>32}  {f['unit']}")
    from bench.peers import print_peers

    print_peers(results.get("peers"))
    if results.get("errors"):
        print("\nfailed steps: " + "; ".join(f"{k}: {v}" for k, v in results["errors"].items()))


def plot(results: dict, path: Path) -> None:
    """One small bar chart per figure: the value, its baseline (if any) and its target (dashed line).

    Raises:
        ImportError: matplotlib is not installed (the ``bench`` extra).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = results["figures"]
    keys = list(figures)
    cols = 4
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows))
    for ax, key in zip(axes.flat, keys):
        f = figures[key]
        labels, values, colors = ["value"], [f["value"] or 0], ["tab:blue"]
        base = f.get("baseline")
        if isinstance(base, str) and figures[base]["value"] is not None:
            labels.append(base.replace("_events_per_s", "").replace("_per_s", "")[:18])
            values.append(figures[base]["value"])
            colors.append("tab:gray")
        ax.bar(labels, values, color=colors)
        target = f["target"]
        if target == "1.6 x stream_events_per_s_1w" and figures["stream_events_per_s_1w"]["value"]:
            target = 1.6 * figures["stream_events_per_s_1w"]["value"]
        if isinstance(target, (int, float)):
            ax.axhline(target, color="tab:red", linestyle="--", label=f"target {target:,.0f}")
            ax.legend(fontsize=7)
        ax.set_title(f"{key}\n({f['unit']}, {f['better']} is better)", fontsize=8)
        ax.tick_params(labelsize=7)
        if f["value"] is None:
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", fontsize=8)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    machine = results["machine"]
    fig.suptitle(f"make bench ({results['mode']}), {results['date']}, {machine['cores']} cores, "
                 f"Python {machine['python']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run_bench(options: BenchOptions) -> int:
    """Run the benchmark; returns the exit code (1 if any step failed)."""
    return Bench(options).run()


if __name__ == "__main__":
    sys.exit(run_bench(BenchOptions(quick="--quick" in sys.argv)))
