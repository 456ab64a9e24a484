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

Definitions of every figure are in :data:`DEFINITIONS` (bench/figures.py; written into results.json) and in
bench/README.md, "Figures".
"""

from __future__ import annotations

import datetime
import gc
import io
import itertools
import json
import multiprocessing
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from bench.figures import DEFINITIONS, FIGURES, plot, print_table
from bench.harness import _publish_process, _say, _Workers
from bench.peer_step import PeerStep
from bench.row_steps import RowSteps
from bench.stream_steps import LATENCY_WARMUP_S, StreamSteps  # noqa: F401 (re-exported: bench/index_bench.py)
from bench.tail_step import TailStep
from bench.trace import _eviction_free_fleet, _fleet_batches, _records, _shifted, _vllm_payloads  # noqa: F401 (re-exported)
from kvstream.broker import free_port

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
    #: Parts of the index step to run (None: all); names as in ``bench.index_bench.PARTS``.
    index_parts: tuple[str, ...] | None = None
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


# --------------------------------------------------------------------------- the bench

class Bench(StreamSteps, RowSteps, TailStep, PeerStep):
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

    # ---- steps (the stream, row, tail and peers steps are those of the mixins Bench inherits: bench/stream_steps.py,
    # bench/row_steps.py, bench/tail_step.py, bench/peer_step.py)

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


def run_bench(options: BenchOptions) -> int:
    """Run the benchmark; returns the exit code (1 if any step failed)."""
    return Bench(options).run()


if __name__ == "__main__":
    sys.exit(run_bench(BenchOptions(quick="--quick" in sys.argv)))
