"""The fleet index's block table against its targets: ``python -m bench.index_table [--quick]``.

Builds the compiled table (stream_apps/index/_table.pyx; the pure-Python twin with ``--python``) and prints:

- **bytes per link** and total memory (``memory_bytes()``, the arrays' allocated capacity, and the process's RSS
  growth beside it) for 2.5M blocks x 4 holders and 10M blocks x 1 holder: targets at most 100 bytes per
  resident (block, holder) and 10M of them in at most 1 GiB;
- **holders_at** of a 27-block chain, and the same with a longest-prefix aggregation in Python above it (the
  router's path): p50 / p99 / mean in µs, target p99 <= 100 µs with the aggregation, aim <= 20 µs;
- **content_walk** of a 27-deep token path that two engines of different hash seeds both hold (two candidate
  blocks per depth);
- **FleetIndex lookups**, embedded: ``prefix_match`` and ``query_hashes`` of a 27-block chain over an index of
  2.5M blocks fed with ``apply_entry`` (4 holders of 64 instances per block, as ``make bench``'s index step lays
  it out), each walked and scored by the table in one call (``BlockTable.chain_runs``); beside them the same
  answers scored in Python over ``holders_at`` (``scoring.prefix_runs``, the reference: the path before),
  ``query_hashes`` with every instance registered (a holder filter on every call), and a fleet of 2 ranks x
  (GPU, CPU) per instance; wall p50 / p99 / mean and the p99 of the thread's CPU time per call (on a shared
  machine the wall p99 is mostly the waits for a CPU); target p99 <= 100 µs;
- **replace** rates: new blocks, holder changes on present blocks, removals (calls per second from a Python
  loop over prepared arguments; the same loop calling a no-op function is printed beside them).

The 2.5M x 4 table is laid out as the fleet's: token paths of 27 blocks, each path stored under two engine hash
seeds (so equal content under unequal block keys), 4 holders of 64 per block. No assertion: figures only.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from kvstream.options import positive_int
from stream_apps.index.fleet_index import FleetIndex, SourceInfo
from stream_apps.index.scoring import instances_answer, prefix_match_rows, prefix_runs
from stream_apps.index.table import CompiledBlockTable, PyBlockTable

MASK = (1 << 64) - 1
#: An odd multiplier: i -> i * GOLDEN mod 2**64 is a bijection, so the block keys are distinct and spread.
GOLDEN = 0x9E3779B97F4A7C15
CHAIN = 27
GIB = 1 << 30


def _rss() -> int:
    """The process's resident set, in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def _percentiles(ns: list[int]) -> str:
    ns = sorted(ns)

    def p(q: float) -> float:
        return ns[min(len(ns) - 1, int(q * len(ns)))] / 1000

    return f"p50 {p(0.50):6.2f} µs  p99 {p(0.99):6.2f} µs  mean {statistics.fmean(ns) / 1000:6.2f} µs"


def longest_prefix(rows: list[tuple[int, ...]]) -> dict[int, int]:
    """Per holder, how many leading blocks it holds: the aggregation a router runs over ``holders_at``."""
    depth: dict[int, int] = {}
    alive: set[int] | None = None
    for i, row in enumerate(rows, 1):
        alive = set(row) if alive is None else alive.intersection(row)
        if not alive:
            break
        for h in alive:
            depth[h] = i
    return depth


def _key(seed: int, path: int, depth: int) -> int:
    return ((((seed * 1_000_003 + path) * CHAIN) + depth + 1) * GOLDEN) & MASK


def fleet(table_class, paths: int, holders_per_block: int, rng: random.Random):
    """A table of ``paths`` token paths x 2 seeds x 27 blocks, and the build's replace rate."""
    patterns = [tuple(sorted(rng.sample(range(64), holders_per_block))) for _ in range(1024)]
    contents = [[rng.getrandbits(64) for _ in range(CHAIN)] for _ in range(min(paths, 4096))]
    table = table_class()
    replace = table.replace
    calls = 0
    gc.disable()
    started = time.perf_counter()
    for path in range(paths):
        tokens = contents[path % len(contents)] if path < len(contents) else None
        for seed in (0, 1):
            parent = None
            for depth in range(CHAIN):
                block = _key(seed, path, depth)
                # beyond the first paths, contents are not kept by the bench (memory): derive them
                content = tokens[depth] if tokens is not None else (block ^ 0x5555) & MASK
                replace(block, 0, patterns[(path + depth) & 1023], parent, content)
                parent = block
                calls += 1
    elapsed = time.perf_counter() - started
    gc.enable()
    return table, contents, calls / elapsed


def memory_figures(table_class, blocks: int, holders_per_block: int, rng: random.Random) -> None:
    """Builds ``blocks`` blocks of ``holders_per_block`` holders each with the fewest Python objects, and
    prints memory and bytes per link."""
    patterns = [tuple(sorted(rng.sample(range(1024), holders_per_block))) for _ in range(1024)]
    gc.collect()
    before = _rss()
    table = table_class()
    replace = table.replace
    started = time.perf_counter()
    parent = None
    for i in range(blocks):
        block = (i * GOLDEN) & MASK
        # chains of 27, as the requests' block chains are
        replace(block, 0, patterns[i & 1023], parent if i % CHAIN else None, (block >> 1) ^ 0x1234)
        parent = block
    elapsed = time.perf_counter() - started
    grown = _rss() - before
    size = table.memory_bytes()
    print(f"  {blocks:>11,} blocks x {holders_per_block} holder(s) = {table.links:,} links: "
          f"memory_bytes {size / 2**20:,.0f} MiB ({size / table.links:.1f} B/link), "
          f"RSS +{grown / 2**20:,.0f} MiB ({grown / table.links:.1f} B/link); "
          f"built at {blocks / elapsed / 1e6:.2f} M replace/s")
    if table.links >= 10_000_000:
        verdict = "within" if size <= GIB else "OVER"
        print(f"    10M links target 1 GiB: {size / GIB:.2f} GiB, {verdict}")
    del table
    gc.collect()


def fleet_index(table_class, blocks: int, rng: random.Random, tiers: bool = False) -> FleetIndex:
    """A FleetIndex of ``blocks`` blocks fed with ``apply_entry``: chains of 27, each chain's blocks held by the
    same 4 of 64 instances on the GPU of rank 0 (``tiers``: 2 of them, each on rank 0 and 1, on GPU and CPU, the
    chain's last 7 blocks off the GPU of rank 1), a parent and a content hash per block."""
    index = FleetIndex(table=table_class())
    patterns = [sorted(rng.sample(range(64), 2 if tiers else 4)) for _ in range(1024)]
    apply = index.apply_entry
    parent = None
    for i in range(blocks):
        block = ((i * GOLDEN) & MASK).to_bytes(8, "big")
        held = patterns[(i // CHAIN) & 1023]
        if tiers:
            far = i % CHAIN >= 20
            rows = [{"instance_id": f"sim-{h}", "data_parallel_rank": rank, "tier": tier, "copies": 1}
                    for h in held for rank in (0, 1) for tier in ("GPU", "CPU") if not (far and rank and tier == "GPU")]
        else:
            rows = [{"instance_id": f"sim-{h}", "data_parallel_rank": 0, "tier": "GPU", "copies": 1} for h in held]
        apply(f"primary/{block.hex()}", {"rows": rows, "parent_block_hash": parent if i % CHAIN else None,
                                         "content_hash": ((i * GOLDEN) >> 1 & MASK) - (1 << 63)})
        parent = block
    return index


def _timed(call, arguments: list, queries: int) -> str:
    """Percentiles of ``queries`` calls of ``call`` over ``arguments`` in turn, after a warm-up: wall time, and
    the thread's CPU time beside it (``cpu p99``: a call's own cost, without the time the thread waited for a
    CPU, which on a shared machine is most of the wall p99). No collection runs inside a call (it would scan
    the bench's objects, not the lookup's)."""
    for argument in arguments[:1000]:
        call(argument)
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    ns, cpu_ns = [], []
    gc.collect()
    gc.disable()
    try:
        for i in range(queries):
            argument = arguments[i % len(arguments)]
            c0 = cpu()
            t0 = wall()
            call(argument)
            t1 = wall()
            cpu_ns.append(cpu() - c0)
            ns.append(t1 - t0)
    finally:
        gc.enable()
    cpu_ns.sort()
    return f"{_percentiles(ns)}  cpu p99 {cpu_ns[min(len(cpu_ns) - 1, int(0.99 * len(cpu_ns)))] / 1000:6.2f} µs"


def lookup_figures(table_class, blocks: int, queries: int, rng: random.Random) -> None:
    """Prints the embedded FleetIndex lookups of a 27-block chain over a ``blocks``-block index."""
    started = time.perf_counter()
    index = fleet_index(table_class, blocks, rng)
    print(f"fleet index: {index.stats()['blocks']:,} blocks, {index.stats()['resident_pairs']:,} pairs "
          f"(apply_entry: {blocks / (time.perf_counter() - started):,.0f}/s)")
    whole = blocks // CHAIN
    chains = [[(((c * CHAIN + d) * GOLDEN) & MASK).to_bytes(8, "big") for d in range(CHAIN)]
              for c in (rng.randrange(whole) for _ in range(4096))]
    assert all(m["matched_blocks"] == CHAIN for m in index.prefix_match(chains[0]))

    def reference_prefix_match(chain):  # the lookup before the table scored it: holders_at, then Python
        with index.lock:
            runs = prefix_runs(index._table.holders_at([int.from_bytes(h, "big") for h in chain]), index._holders,
                               index.weights, index._allowed(None, None, None))
        return prefix_match_rows(runs)

    def reference_query_hashes(chain):
        with index.lock:
            runs = prefix_runs(index._table.holders_at([int.from_bytes(h, "big") for h in chain]), index._holders,
                               index.weights, index._allowed(None, None, None))
            return instances_answer(runs, index.sources.block_size)

    for chain in chains[:64]:
        assert index.prefix_match(chain) == reference_prefix_match(chain)
        assert index.query_hashes(chain) == reference_query_hashes(chain)
    label = f"{CHAIN}-block chain, embedded:"
    print(f"  {'prefix_match, ' + label:<56}{_timed(index.prefix_match, chains, queries)}")
    print(f"  {'query_hashes, ' + label:<56}{_timed(index.query_hashes, chains, queries)}")
    print(f"  {'  before (Python scoring over holders_at): prefix_match':<56}"
          f"{_timed(reference_prefix_match, chains, queries)}")
    print(f"  {'  before: query_hashes':<56}{_timed(reference_query_hashes, chains, queries)}")
    for i in range(64):  # every instance registered: a holder filter on every call
        index.sources.register(SourceInfo(f"sim-{i}", block_size=16, dp_ranks={0}))
    print(f"  {'query_hashes, instances registered (filtered):':<56}{_timed(index.query_hashes, chains, queries)}")
    del index
    gc.collect()

    index = fleet_index(table_class, blocks // 4, rng, tiers=True)
    whole = blocks // 4 // CHAIN
    chains = [[(((c * CHAIN + d) * GOLDEN) & MASK).to_bytes(8, "big") for d in range(CHAIN)]
              for c in (rng.randrange(whole) for _ in range(4096))]
    detail = index.query_hashes(chains[0])["kvstream"]["ranks"]
    assert all(ranks["1"]["prefix_blocks"] == {"CPU": CHAIN, "GPU": 20} for ranks in detail.values()), detail
    print(f"  query_hashes, {blocks // 4:,} blocks of 2 instances x 2 ranks x (GPU, CPU):")
    print(f"  {'':<56}{_timed(index.query_hashes, chains, queries)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.index_table", description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="store_true", help="bench the pure-Python twin (small sizes only)")
    parser.add_argument("--quick", action="store_true", help="a tenth of the sizes")
    parser.add_argument("--queries", type=positive_int, default=50_000, help="timed calls per query figure")
    args = parser.parse_args(argv)
    table_class = PyBlockTable if args.python or CompiledBlockTable is None else CompiledBlockTable
    scale = 10 if args.quick or table_class is PyBlockTable else 1
    rng = random.Random(7)
    print(f"table: {table_class.__module__}.{table_class.__name__}" + (" (quick: sizes / 10)" if scale > 1 else ""))

    print("memory (targets: <= 100 B per link, 10M links <= 1 GiB)")
    memory_figures(table_class, 2_500_000 // scale, 4, rng)
    memory_figures(table_class, 10_000_000 // scale, 1, rng)

    paths = 2_500_000 // (2 * CHAIN * scale)  # 2.5M blocks x 4 holders
    table, contents, build_rate = fleet(table_class, paths, 4, rng)
    print(f"fleet table: {len(table):,} blocks, {table.links:,} links, {table.memory_bytes() / 2**20:,.0f} MiB "
          f"({table.memory_bytes() / table.links:.1f} B/link), built at {build_rate / 1e6:.2f} M replace/s")

    chains = [[_key(rng.randrange(2), path, d) for d in range(CHAIN)]
              for path in (rng.randrange(paths) for _ in range(4096))]
    timer = time.perf_counter_ns
    holders_at = table.holders_at
    for chain in chains[:1000]:  # warm up
        holders_at(chain)
    ns, agg = [], []
    for i in range(args.queries):
        chain = chains[i & 4095]
        t0 = timer()
        rows = holders_at(chain)
        t1 = timer()
        longest_prefix(rows)
        t2 = timer()
        ns.append(t1 - t0)
        agg.append(t2 - t0)
    assert len(rows) == CHAIN
    print(f"{f'holders_at, {CHAIN}-block chain:':<45}{_percentiles(ns)}")
    print(f"{'holders_at + longest-prefix aggregation:':<45}{_percentiles(agg)}  (target p99 <= 100 µs)")

    walks = [contents[rng.randrange(len(contents))] for _ in range(4096)]
    walk = table.content_walk
    ns = []
    for i in range(args.queries):
        path = walks[i & 4095]
        t0 = timer()
        rows = walk(path)
        ns.append(timer() - t0)
    assert len(rows) == CHAIN and len(table.content_walk_blocks(path)[0]) >= 2
    print(f"{f'content_walk, {CHAIN} deep x 2 seeds:':<45}{_percentiles(ns)}")

    print("FleetIndex lookups (walk and scoring; target p99 <= 100 µs)")
    lookup_figures(table_class, 2_500_000 // scale, args.queries // (10 if table_class is PyBlockTable else 1), rng)

    print("replace rates (calls from a Python loop over prepared arguments, into the fleet table)")
    patterns = [tuple(sorted(rng.sample(range(64), 4))) for _ in range(1024)]
    fresh = [(_key(2, p, d), patterns[(p + d) & 1023], None if d == 0 else _key(2, p, d - 1), rng.getrandbits(64))
             for p in range(500_000 // (CHAIN * scale)) for d in range(CHAIN)]
    keys = [_key(s, p, d) for s in (0, 1) for p in range(min(paths, 10_000)) for d in range(CHAIN)]
    changed = [(block, patterns[(i * 7) & 1023]) for i, block in enumerate(keys)]

    def noop(block, scope, holders, parent, content):
        pass

    def rate(label: str, call, rows) -> None:
        gc.disable()
        started = time.perf_counter()
        for block, holders, parent, content in rows:
            call(block, 0, holders, parent, content)
        elapsed = time.perf_counter() - started
        gc.enable()
        print(f"  {label:<48} {len(rows) / elapsed / 1e6:5.2f} M/s ({elapsed / len(rows) * 1e9:4.0f} ns a call)")

    rate("a no-op Python function, same loop", noop, fresh)
    rate(f"new blocks of 4 holders ({len(fresh):,})", table.replace, fresh)
    rate("holders changed on present blocks", table.replace, [(b, h, None, None) for b, h in changed])
    rate("holders changed, parent and content moved", table.replace,
         [(b, patterns[0], b ^ 1, b ^ 2) for b, _ in changed])
    rate("removals", table.replace, [(b, (), None, None) for b, _ in changed])
    big = table_class()
    holders = list(range(4000))
    started = time.perf_counter()
    for i in range(1, 1001):
        big.replace(1, 0, holders[: 3000 + i], None, 100)
    print(f"  one block of 3,000..4,000 holders, one more each call: "
          f"{(time.perf_counter() - started) / 1000 * 1e6:.1f} µs a call")
    started = time.perf_counter()
    affected = table.remove_holder(3)
    print(f"remove_holder over {len(table):,} blocks: {(time.perf_counter() - started) * 1000:.1f} ms "
          f"({affected:,} blocks affected)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
