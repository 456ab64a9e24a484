"""Per-stage cost of the worker's hot path, without Kafka: ``python -m bench.profile_stages``.

The simulator's events for ``--requests`` trace requests are encoded as the producers write them (the real
``KvEventProducer.send_event``, into a recording fake producer), laid out on 8 kv-events partitions as murmur2
puts them, and then run through the worker's own code, stage by stage:

1. the repartition child: :meth:`stream_apps.repartition.Repartitioner.process` over batches of 10,000
   messages (header routing, residency key, murmur2, clear marks, ``ownership_batch`` encode, produce);
2. the materializing agent, as :func:`stream_apps.materialize.register_agent` runs it: ``ownership_batch``
   decode, ``kv_event`` decode per item, :meth:`stream_apps.applier.BatchApplier.apply` (the residency rules,
   :func:`stream_apps.residency.apply_block`, timed apart), :meth:`~stream_apps.applier.BatchApplier.finish`
   (entry encode, changelog produce, occupancy, sources) and a checkpoint (:class:`stream_apps.checkpoint.Checkpoint`)
   every ``--commit-every`` batch messages (the flush itself is a no-op here: no broker).

The stores are the worker's (:class:`stream_apps.store.MemoryTableStore` or
:class:`~stream_apps.store.RocksDBTableStore` methods on plain objects, RocksDB with the worker's options).
``--producer librdkafka`` (default) enqueues every output in a real confluent-kafka producer whose broker never
answers (the enqueue cost the worker's thread pays; librdkafka's own threads do the rest), ``fake`` in a list.

Per-call timers (``time.perf_counter_ns``, about 0.1 µs each) wrap the stages inside ``apply``; bench/PROFILE.md
reads the output. ``--cprofile FILE`` also writes a cProfile of stage 2 (slower; use it for shares, not µs).
Faust's own per-message cost and the broker round trips are not here: see PROFILE.md for the worker under py-spy.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
import types
from collections import OrderedDict, defaultdict
from pathlib import Path

from murmurhash2 import murmurhash2

from kvstream.options import positive_int
from stream_apps.checkpoint import tune_gc

PARTITIONS = 8
_SEED = 0x9747B28C


class RecordingProducer:
    """confluent-kafka's ``Producer`` surface that the hot paths use, keeping what was produced."""

    def __init__(self, *args, **kwargs) -> None:
        self.messages: list[tuple] = []

    def produce(self, topic, value=None, key=None, partition=-1, on_delivery=None, headers=None, **_):
        self.messages.append((topic, value, key, partition, headers))

    def poll(self, *_):
        return 0

    def flush(self, *_):
        return 0

    def __len__(self):
        return 0


class CountingProducer(RecordingProducer):
    """Keeps counts only (stage 2's outputs)."""

    def __init__(self, *args, **kwargs) -> None:
        self.count = 0
        self.bytes = 0
        self.by_topic: dict[str, int] = defaultdict(int)

    def produce(self, topic, value=None, key=None, partition=-1, on_delivery=None, headers=None, **_):
        self.count += 1
        self.by_topic[topic] += 1
        self.bytes += len(value or b"")


def unreachable_producer():
    """A real librdkafka producer whose broker never answers: ``produce`` costs what it costs in the worker."""
    from confluent_kafka import Producer

    return Producer({"bootstrap.servers": "127.0.0.1:9", "queue.buffering.max.messages": 10_000_000,
                     "queue.buffering.max.kbytes": 2_097_151, "message.timeout.ms": 3_600_000,
                     "linger.ms": 5, "compression.type": "lz4", "log_level": 0})


class FakeMessage:
    __slots__ = ("_p", "_o", "_k", "_v", "_h")

    def __init__(self, partition, offset, key, value, headers):
        self._p, self._o, self._k, self._v, self._h = partition, offset, key, value, headers

    def partition(self):
        return self._p

    def offset(self):
        return self._o

    def key(self):
        return self._k

    def value(self):
        return self._v

    def headers(self):
        return self._h

    def error(self):
        return None

    def topic(self):
        return "kv-events"


def kv_events_input(requests: int | None) -> tuple[dict[int, list[FakeMessage]], int]:
    """The simulator's events, encoded by the real producer path, per kv-events partition in offset order."""
    import producers.kafka_sink as sink
    from producers.simulator import TRACE_START_TS, ClusterSimulator, load_trace

    sink.topic_partitions = lambda *a, **k: PARTITIONS
    sink.Producer = RecordingProducer
    producer = sink.KvEventProducer("unused:0", "kv-events")
    sim = ClusterSimulator(None, publisher_epoch=int(TRACE_START_TS * 1000))
    for batch in sim.run(load_trace(limit=requests)):
        for index, event in enumerate(batch.events):
            producer.send_event(batch.publisher, batch.seq, batch.ts, index, event)
    partitions: dict[int, list[FakeMessage]] = defaultdict(list)
    for topic, value, key, partition, headers in producer._producer.messages:
        if partition is None or partition < 0:
            partition = (murmurhash2(key, _SEED) & 0x7FFFFFFF) % PARTITIONS
        headers = list(headers.items()) if isinstance(headers, dict) else headers
        partitions[partition].append(FakeMessage(partition, len(partitions[partition]), key, value, headers))
    return partitions, len(producer._producer.messages)


def consume_batches(partitions: dict[int, list[FakeMessage]], size: int = 10_000, per_fetch: int = 1_250):
    """Batches as ``Consumer.consume(10_000)`` returns them: chunks of partitions in turn."""
    cursors = {p: 0 for p in partitions}
    while cursors:
        batch = []
        for p in list(cursors):
            start = cursors[p]
            chunk = partitions[p][start:start + per_fetch]
            batch += chunk
            cursors[p] = start + len(chunk)
            if cursors[p] >= len(partitions[p]):
                del cursors[p]
            if len(batch) >= size:
                break
        yield batch


class CollectorClock:
    """A ``gc.callbacks`` entry: wall seconds spent in Python's collector, and collections per generation."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.collections[info["generation"]] += 1


def run_repartition(partitions) -> tuple[list[tuple[int, bytes]], float, int]:
    """Stage 1: Repartitioner.process over the input; returns the ownership_batch messages (partition, value)."""
    from schemas.topics import TopicNames
    from stream_apps.repartition import Repartitioner

    producer = RecordingProducer()
    r = Repartitioner("unused:0", TopicNames("profile"), PARTITIONS, defaultdict(int), stop_event=None,
                      consumer=types.SimpleNamespace(commit=lambda **_: None), producer=producer)
    batches = list(consume_batches(partitions))
    gc.collect()
    t0 = time.thread_time()
    for batch in batches:
        r.process(batch)
    seconds = time.thread_time() - t0  # CPU seconds of this thread: the machine's load does not inflate it
    out = [(partition, value) for topic, value, key, partition, headers in producer.messages
           if topic == r.output_topic]
    return out, seconds, sum(map(len, batches))


class Timer:
    """Accumulated nanoseconds and calls of one stage."""

    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0

    def wrap(self, fn):
        clock = time.perf_counter_ns

        def timed(*args, **kwargs):
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns += clock() - t
                self.calls += 1
        return timed


def _bind(ns, cls, *names):
    for name in names:
        setattr(ns, name, types.MethodType(getattr(cls, name), ns))
    return ns


def _stand_in(ns, store_class, *names):
    """``ns`` as a ``store_class``: its methods ``names`` bound to it, with the changelog buffer and delivery
    reports that ``_BoundStore.bind`` sets up in the worker."""
    from stream_apps.delivery_reports import DeliveryReports
    from stream_apps.store import MemoryTableStore

    ns._unproduced, ns.changelog_records, ns.buffers_bytes = {}, 0, store_class.buffers_bytes
    ns.mirror = store_class.mirror  # no mirror: the worker gives one to tier-occupancy's store only
    ns._reports = ns._changelog_delivery = DeliveryReports()
    _bind(ns, MemoryTableStore, "acknowledged_offsets")
    return _bind(ns, store_class, "produce_changelog", "_changelog_value", *names)


def make_materializer(store_kind: str, producer, tmp: Path, timers: dict[str, Timer], instrument: bool = True):
    """A Materializer over the worker's store methods on plain objects, outputs into ``producer``."""
    from rocksdict import Rdict

    import stream_apps.store as store_module
    from schemas import AvroCodec
    from schemas.topics import TopicNames
    from stream_apps.applier import Materializer
    from stream_apps.checkpoint import Checkpoint
    from stream_apps.outputs import OutputTopics
    from stream_apps.residency import SourceSettings
    from stream_apps.residency.records import EntryCodec, EntryForm, entry_form
    from stream_apps.settings import MEMORY_RESIDENCY_CACHE, ROCKSDB_RESIDENCY_CACHE
    from stream_apps.store_settings import ResidencyRocksDBOptions, residency_rocksdb_options

    outputs = OutputTopics("unused:0", TopicNames("profile"))
    outputs._producer = producer
    outputs.acknowledge = lambda timeout_s: 0  # no broker: the flush's round trip is not measured here
    if instrument:
        outputs.produce = timers["produce (enqueue, all outputs)"].wrap(outputs.produce)
        outputs.change = timers["residency change: encode + produce"].wrap(outputs.change)

    def small(family: str, changelog: str):
        ns = types.SimpleNamespace(data={}, _key_partition={}, written_at={}, outputs=outputs, changelog=changelog,
                                   encode=store_module.value_encoder(AvroCodec(family)))
        return _stand_in(ns, store_module.MemoryTableStore, "entry", "lookup", "write", "persist", "partition_keys")

    codec = AvroCodec("residency")
    entries = EntryCodec(codec)  # the worker's form of entry: the compiled record where it is built
    encode, decode = entries.encode, entries.decode
    if instrument:
        encode = timers["entry encode (residency writer)"].wrap(encode)
    if store_kind == "memory":  # the residency table's memory store, as the worker runs it: Avro bytes + a cache
        residency = types.SimpleNamespace(data={}, _cache=OrderedDict(), cache_entries=MEMORY_RESIDENCY_CACHE,
                                          outputs=outputs,
                                          changelog="profile-residency-changelog", encode=encode, codec=codec,
                                          decode=decode, table=types.SimpleNamespace(partitions=PARTITIONS))
        _stand_in(residency, store_module.CompactMemoryTableStore, "entry", "lookup", "_remember", "write", "persist",
                  "partition_keys", "_partition_of")
    else:
        options = ResidencyRocksDBOptions(**residency_rocksdb_options()).as_options()
        dbs = {}

        def db_for_partition(partition):
            if partition not in dbs:
                dbs[partition] = Rdict(str(tmp / f"residency-{partition}"), options=options)
            return dbs[partition]

        residency = types.SimpleNamespace(_pending=defaultdict(dict), _cache=OrderedDict(),
                                          cache_entries=ROCKSDB_RESIDENCY_CACHE,
                                          codec=codec, encode=encode, decode=decode, outputs=outputs,
                                          changelog="profile-residency-changelog", offset_key=b"__faust\0offset__",
                                          _db_for_partition=db_for_partition, _dbs=dbs)
        _stand_in(residency, store_module.RocksDBTableStore, "entry", "lookup", "_remember", "write", "persist",
                  "partition_keys")
        residency.close_all = lambda: [db.close() for db in dbs.values()]
    form = entry_form(entries.compiled)
    residency.entry_form = EntryForm(form.compiled, timers["residency rules (apply_block)"].wrap(form.apply_block)
                                     if instrument else form.apply_block)
    residency.window_keys = set()
    residency.merged_writes = 0
    residency.total_writes = 0
    tables = types.SimpleNamespace(
        residency_store=residency,
        tier_occupancy=types.SimpleNamespace(data=small("tier_occupancy", "profile-tier-occupancy-changelog")),
        sources=types.SimpleNamespace(data=small("source_status", "profile-sources-changelog")),
        clear_watermarks=types.SimpleNamespace(data=small("clear_watermark", "profile-clear-watermarks-changelog")),
        publisher_epochs=types.SimpleNamespace(data=small("clear_watermark", "profile-publisher-epochs-changelog")))
    if not instrument:
        return Materializer(tables, outputs, Checkpoint(outputs, [residency]), SourceSettings()), residency
    residency.entry = timers["entry read (store/cache, decode on miss)"].wrap(residency.entry)
    # changelog writes, and the distinct keys among them per checkpoint window (what a cache that merges the
    # writes to one key until the commit, as Kafka Streams' record cache does, would write)
    write = residency.write

    def counted_write(partition, key, value):
        residency.total_writes += 1
        residency.window_keys.add(key)
        write(partition, key, value)

    residency.write = counted_write
    persist = residency.persist

    def counted_persist():
        residency.merged_writes += len(residency.window_keys)
        residency.window_keys.clear()
        persist()

    residency.persist = counted_persist
    checkpoint = Checkpoint(outputs, [residency])  # after the wrappers: it calls residency.persist
    return Materializer(tables, outputs, checkpoint, SourceSettings()), residency


def run_materialize(batches, store_kind: str, producer, commit_every: int, cprofile: str | None,
                    instrument: bool = True) -> dict:
    """Stage 2 over the ownership_batch messages; returns seconds per stage (wall) and the thread's CPU seconds.

    ``instrument`` False: no per-call timers (the pass whose CPU time is the stage's true total).
    """
    import stream_apps.applier as applier_module
    from schemas import AvroCodec
    from schemas.ownership_batch import OwnershipBatchReader

    timers = defaultdict(Timer)
    original_write_back = applier_module.BatchApplier.write_back
    if instrument:
        write_back_timer = timers["write-back (entry encode, changelog produce, store write)"]
        applier_module.BatchApplier.write_back = write_back_timer.wrap(original_write_back)
    tmp = Path(tempfile.mkdtemp(prefix="kvstream-profile-"))
    try:
        materializer, residency = make_materializer(store_kind, producer, tmp, timers, instrument)
        if instrument:
            materializer.add_occupancy = timers["occupancy and sources"].wrap(materializer.add_occupancy)
            materializer.note_applied = timers["occupancy and sources"].wrap(materializer.note_applied)
        event_codec = AvroCodec("kv_event")
        reader = OwnershipBatchReader(event_codec)
        decode = event_codec.decode
        clock = time.perf_counter_ns
        t_batch = t_event = t_apply = t_finish = t_commit = 0
        items_total = 0
        profiler = None
        if cprofile:
            import cProfile

            profiler = cProfile.Profile()
        gc.collect()
        gc.freeze()
        collector = CollectorClock()
        gc.callbacks.append(collector)
        started = time.perf_counter()
        cpu_started = time.thread_time()
        if profiler:
            profiler.enable()
        for n, (partition, value) in enumerate(batches, 1):
            t0 = clock()
            items = reader.read(value)
            t1 = clock()
            records = [decode(buffer[start:end]) if record is None else record
                       for _, _, buffer, start, end, record in items]
            t2 = clock()
            applier = applier_module.BatchApplier(materializer, partition)
            for (key, mark, *_), record in zip(items, records):
                if type(record) is tuple:
                    applier.apply(key, mark, record)
                else:
                    applier.apply_record(key, mark, record)
            t3 = clock()
            applier.finish()
            t4 = clock()
            t_batch += t1 - t0
            t_event += t2 - t1
            t_apply += t3 - t2
            t_finish += t4 - t3
            items_total += len(items)
            if n % commit_every == 0:
                materializer.checkpoint.commit()
                t_commit += clock() - t4
        t5 = clock()
        materializer.checkpoint.commit()
        t_commit += clock() - t5
        if profiler:
            profiler.disable()
            profiler.dump_stats(cprofile)
        wall = time.perf_counter() - started
        cpu = time.thread_time() - cpu_started
        gc.callbacks.remove(collector)
        stats = materializer.stats
        if store_kind == "memory":
            entries = [residency.codec.decode(raw) for raw in residency.data.values()]
        else:
            entries = None
        resident = None
        if entries is not None:
            resident = sum(1 for e in entries for r in e["rows"] if r["copies"] > 0)
        result = {"items": items_total, "batch_messages": len(batches), "wall_s": wall, "cpu_s": cpu,
                  "gc_s": collector.seconds, "gc_collections": collector.collections,
                  "ownership_batch decode": t_batch / 1e9, "kv_event decode": t_event / 1e9,
                  "apply loop": t_apply / 1e9, "finish (write-back, occupancy, sources)": t_finish / 1e9,
                  "checkpoint (persist, gc.freeze; no flush)": t_commit / 1e9,
                  "timers": {k: {"s": v.ns / 1e9, "calls": v.calls} for k, v in timers.items()},
                  "resident_rows": resident, "became_resident": stats.became_resident,
                  "changelog_writes_merged_per_checkpoint": residency.merged_writes,
                  "changelog_writes": residency.total_writes,
                  "stopped_resident": stats.stopped_resident, "applied": stats.applied,
                  "outputs": dict(getattr(producer, "by_topic", {})) or len(producer)}
        if store_kind == "rocksdb":
            residency.close_all()
        return result
    finally:
        applier_module.BatchApplier.write_back = original_write_back
        shutil.rmtree(tmp, ignore_errors=True)


def report(events: int, repartition_s: float, stage2: dict, plain: dict, store_kind: str) -> tuple[str, dict]:
    """The per-stage table: each stage's share of the instrumented pass's wall time, times the CPU time of the
    uninstrumented pass (so neither the timers' own cost nor the machine's load inflates the µs)."""
    t = stage2["timers"]
    rules = t["residency rules (apply_block)"]["s"]
    change = t["residency change: encode + produce"]["s"]
    entry = t["entry read (store/cache, decode on miss)"]["s"]
    encode = t["entry encode (residency writer)"]["s"]
    produce = t["produce (enqueue, all outputs)"]["s"]
    write_back = t["write-back (entry encode, changelog produce, store write)"]["s"]
    small = t["occupancy and sources"]["s"]
    apply_rest = (stage2["apply loop"] + stage2["finish (write-back, occupancy, sources)"]
                  - rules - change - entry - write_back - small)
    parts = [
        ("decode: batch items (block fields; other events' records), one pass", stage2["ownership_batch decode"]),
        ("kv_event decode of other versions (codec)", stage2["kv_event decode"]),
        ("entry read (store/cache; RocksDB get + decode on miss)", entry),
        ("residency rules (apply_block)", rules),
        ("BatchApplier.apply bookkeeping (keys, sources, marks)", apply_rest),
        ("residency change record: encode + produce", change),
        ("write-back: entry encode", encode),
        ("write-back: changelog produce, store write", write_back - encode),
        ("occupancy and sources tables (+ kv-tier-occupancy)", small),
        ("checkpoint without flush (persist, gc.freeze)", stage2["checkpoint (persist, gc.freeze; no flush)"]),
    ]
    wall = sum(v for _, v in parts)
    cpu_us = plain["cpu_s"] / events * 1e6
    figures = {"repartition child: Repartitioner.process (CPU)": repartition_s / events * 1e6}
    lines = [f"store {store_kind}: {events:,} kv-events messages, {stage2['items']:,} items in "
             f"{stage2['batch_messages']:,} ownership_batch messages",
             f"{'stage':<78} {'share':>6} {'µs/event':>9}",
             f"{'repartition child: Repartitioner.process (another process; its CPU)':<78} {'':>6} "
             f"{repartition_s / events * 1e6:>9.2f}"]
    for name, seconds in parts:
        share = seconds / wall
        figures[f"stage 2: {name}"] = share * cpu_us
        lines.append(f"{'stage 2: ' + name:<78} {share:>6.1%} {share * cpu_us:>9.2f}")
    lines.append(f"{'stage 2 total: CPU of the pass without timers (Faust, broker round trips excluded)':<78} "
                 f"{'':>6} {cpu_us:>9.2f}")
    lines.append(f"  (the pass with timers: {stage2['cpu_s'] / events * 1e6:.2f} µs/event of CPU, "
                 f"{stage2['wall_s'] / events * 1e6:.2f} wall)")
    lines.append(f"  of which Python's collector: {plain['gc_s'] / events * 1e6:.2f} µs/event "
                 f"(collections by generation: {plain['gc_collections']}; thresholds {gc.get_threshold()})")
    lines.append(f"  of which produce() enqueue, all outputs: {produce / wall * cpu_us:.2f} µs/event "
                 f"({t['produce (enqueue, all outputs)']['calls'] / events:.2f} outputs per event)")
    lines.append(f"  calls: rules {t['residency rules (apply_block)']['calls']:,}, change records "
                 f"{t['residency change: encode + produce']['calls']:,}, entry encodes "
                 f"{t['entry encode (residency writer)']['calls']:,}, entry reads "
                 f"{t['entry read (store/cache, decode on miss)']['calls']:,}")
    lines.append(f"  resident rows at the end: {stage2['resident_rows']}; became {stage2['became_resident']:,}, "
                 f"stopped {stage2['stopped_resident']:,}")
    lines.append(f"  residency changelog records: {stage2['changelog_writes']:,} (one per touched key per batch "
                 f"message; {t['entry encode (residency writer)']['calls']:,} values, the rest tombstones); distinct "
                 f"keys per checkpoint window: {stage2['changelog_writes_merged_per_checkpoint']:,}")
    figures["stage 2 total"] = cpu_us
    return "\n".join(lines), figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile_stages", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=positive_int, default=None, help="trace requests (default: the whole trace)")
    p.add_argument("--store", choices=("memory", "rocksdb", "both"), default="both",
                   help="the residency store(s) whose stages are measured (default: %(default)s)")
    p.add_argument("--producer", choices=("librdkafka", "fake"), default="librdkafka",
                   help="librdkafka: a real producer whose broker never answers (produce() costs its real enqueue); "
                        "fake: a counting stand-in, no librdkafka (default: %(default)s)")
    p.add_argument("--commit-every", type=positive_int, default=25,
                   help="batch messages between checkpoints (the worker commits every 2.8 s; default %(default)s)")
    p.add_argument("--cprofile", default=None, metavar="FILE", help="also write a cProfile of stage 2")
    p.add_argument("--json", default=None, metavar="FILE", help="write the figures as JSON too")
    args = p.parse_args(argv)

    tune_gc()  # the worker's collector thresholds (stream_apps.checkpoint.GC_THRESHOLDS)
    t0 = time.perf_counter()
    partitions, events = kv_events_input(args.requests)
    print(f"input: {events:,} kv-events messages ({time.perf_counter() - t0:.1f}s to simulate and encode)",
          flush=True)
    batches, repartition_s, consumed = run_repartition(partitions)
    print(f"repartition: {consumed:,} messages -> {len(batches):,} ownership_batch messages in {repartition_s:.2f}s",
          flush=True)
    out = {"events": events, "repartition_s": repartition_s, "stores": {}}
    for store_kind in (("memory", "rocksdb") if args.store == "both" else (args.store,)):
        passes = {}
        for instrument in (False, True):
            producer = unreachable_producer() if args.producer == "librdkafka" else CountingProducer()
            passes[instrument] = run_materialize(batches, store_kind, producer, args.commit_every,
                                                 args.cprofile and instrument and f"{args.cprofile}.{store_kind}",
                                                 instrument)
            if args.producer == "librdkafka":
                producer.purge()
            del producer
        text, figures = report(events, repartition_s, passes[True], passes[False], store_kind)
        out["stores"][store_kind] = {"timed": passes[True], "plain": passes[False], "us_per_event": figures}
        print()
        print(text, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
