"""Where the memory store's bytes per resident row go: ``python -m bench.row_memory [--rows N]``.

Builds residency entries as the worker holds them: each event decoded from its Avro bytes (so strings and
numbers are fresh objects, as in the worker) and applied with :func:`stream_apps.residency.apply_block_event`,
one resident row per entry, in a dict ``{key: entry}`` (the ``memory://`` store's ``data``). Then it reports:

- tracemalloc's total per row (the bench's ``bytes_per_row_memory`` measures the same dict, but its deep copy
  shares the strings with the originals, so it leaves them out);
- a breakdown per object kind by ``sys.getsizeof``, each object counted once, objects shared by many rows
  (interned strings, small ints, ``None``) counted apart;
- the same entries as Avro bytes, and decoded from them as the stores' entry cache holds them (the compiled
  records where built): bytes per cached entry, and the time of one decode (what a cache miss pays).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import tracemalloc
from collections import defaultdict

from kvstream.options import positive_int


def build(rows: int) -> dict[str, dict]:
    from bench.run import _eviction_free_fleet, _fleet_batches, _records, _shifted
    from producers.simulator import load_trace
    from schemas import AvroCodec
    from schemas.clear_position import NO_CLEAR
    from stream_apps.residency import ApplyStats, apply_block_event, residency_key

    codec = AvroCodec("kv_event")
    stats = ApplyStats()
    table: dict[str, dict] = {}
    trace = load_trace()
    repetition = 0
    while len(table) < rows:
        batches, _ = _fleet_batches(_shifted(trace, repetition), _eviction_free_fleet(), repetition)
        for record in _records(batches):
            if record["block_hash"] is None:
                continue
            record = codec.decode(codec.encode(record))  # fresh objects, as the worker decodes them
            kind, body = record["event"]
            key = residency_key(body["ownership"], record["block_hash"])
            if key in table:
                continue
            entry, _, _ = apply_block_event(None, record, NO_CLEAR, NO_CLEAR, frozenset({"GPU"}), stats)
            if entry is not None:
                table[key] = entry
                if len(table) >= rows:
                    break
        repetition += 1
    return table


def breakdown(table: dict[str, dict]) -> tuple[dict[str, list[int]], int]:
    """Bytes per object kind (each object once), and the bytes of objects shared by several rows."""
    sizes: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # kind -> [bytes, objects]
    refs: dict[int, int] = defaultdict(int)
    kinds: dict[int, tuple[str, object]] = {}

    def add(obj, kind: str) -> None:
        refs[id(obj)] += 1
        kinds.setdefault(id(obj), (kind, obj))

    def fields(d: dict, prefix: str) -> None:
        for k, v in d.items():
            add(k, "dict keys (str, interned)")
            if not isinstance(v, (dict, list)):
                add(v, f"{prefix}.{k} ({type(v).__name__})")

    for key, entry in table.items():
        add(key, "table key (str)")
        add(entry, "entry dict (3 keys)")
        fields(entry, "entry")
        add(entry["rows"], "rows list")
        for row in entry["rows"]:
            add(row, f"row dict ({len(row)} keys)")
            fields(row, "row")
            add(row["workers"], "workers list")
            for worker in row["workers"]:
                add(worker, f"worker dict ({len(worker)} keys)")
                fields(worker, "worker")
            if isinstance(row["clear_mark"], dict):
                add(row["clear_mark"], "clear_mark dict")
                fields(row["clear_mark"], "clear_mark")
    shared = 0
    for oid, (kind, obj) in kinds.items():
        size = sys.getsizeof(obj)
        if refs[oid] > 1 and not isinstance(obj, (dict, list)):
            shared += size
            continue
        sizes[kind][0] += size
        sizes[kind][1] += 1
    return sizes, shared


def _timed(work) -> float:
    """Seconds ``work()`` took (perf_counter)."""
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.row_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=positive_int, default=200_000,
                   help="resident rows built from the trace and measured (default: %(default)s)")
    args = p.parse_args(argv)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    table = build(args.rows)
    gc.collect()
    total = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    rows = len(table)
    # the table dict itself: its hash table
    dict_bytes = sys.getsizeof(table)
    sizes, shared = breakdown(table)
    print(f"{rows:,} rows, one per entry; tracemalloc (fresh objects, as the worker holds them): "
          f"{total / rows:,.0f} bytes/row")
    print(f"{'object kind':<44} {'bytes/row':>10} {'objects/row':>12}")
    print(f"{'table dict (hash table slots)':<44} {dict_bytes / rows:>10.1f} {'':>12}")
    accounted = dict_bytes
    for label, (size, count) in sorted(sizes.items(), key=lambda kv: -kv[1][0]):
        if size / rows < 0.5:
            continue
        accounted += size
        print(f"{label:<44} {size / rows:>10.1f} {count / rows:>12.2f}")
    print(f"{'sum of getsizeof (each object once)':<44} {accounted / rows:>10.1f}")
    print(f"objects shared by several rows (interned strings, small ints, None): {shared:,} bytes in all")
    # the same rows held as the changelog's Avro bytes (the value the memory store already encodes for the
    # changelog at every write), under the same string keys
    from schemas import AvroCodec
    from stream_apps.store import value_encoder

    encode = value_encoder(AvroCodec("residency"))
    values = [(key, encode(entry)) for key, entry in table.items()]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    packed = {(key + " ")[:-1]: bytes(bytearray(value)) for key, value in values}
    packed_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    mean_value = sum(len(v) for _, v in values) / len(values)
    print(f"\nthe same rows as {{str key: Avro bytes of the entry}} (the changelog's value, {mean_value:.0f} bytes of "
          f"Avro on average): {packed_bytes / len(packed):,.0f} bytes/row (tracemalloc)")
    del packed
    # the same rows decoded from those bytes as the stores' entry cache holds them (the compiled records where
    # they are built), and what a decode costs: what a cache miss pays, and what each cached key keeps
    from stream_apps.residency.records import EntryCodec

    codec = EntryCodec(AvroCodec("residency"))
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cached = {(key + " ")[:-1]: codec.decode(value) for key, value in values}
    cached_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del cached
    raw = [value for _, value in values]
    gc.disable()  # the collector's passes are the worker's business (stream_apps.checkpoint.GC_THRESHOLDS)
    try:
        best = min(_timed(lambda: [codec.decode(value) for value in raw]) for _ in range(3))
    finally:
        gc.enable()
    print(f"decoded into the entry cache's form ({'compiled records' if codec.compiled else 'dicts'}): "
          f"{cached_bytes / len(values):,.0f} bytes/entry with its key (tracemalloc), "
          f"{best / len(raw) * 1e9:,.0f} ns per decode (best of 3)")
    entry = next(iter(table.values()))
    print("\none entry:", entry)
    return 0


if __name__ == "__main__":
    sys.exit(main())
