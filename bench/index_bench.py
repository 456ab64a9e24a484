"""The fleet index against its targets (issue 25): the ``index`` step of ``make bench``, and the processes it starts
(``python -m bench.index_bench serve|minimal|load``).

The step (:func:`run_step`, called by ``bench.run.Bench.step_index``) measures, each figure against its target or as
a ratio to a baseline measured in the same run (:data:`INDEX_DEFINITIONS`; bench/README.md, "The index step"):

1. **lookups over HTTP**: ``kvstream index``'s application (:func:`stream_apps.index.server.build_web_app`) over an
   index filled in its own process from the Mooncake trace, and a minimal aiohttp server answering a constant body
   of the same size, each loaded by a third process over loopback keep-alive connections: unloaded p50/p99 of
   ``POST /query`` (a 4,096-token prompt) and ``POST /prefix-match/`` (a request's chain), and queries/s with 16
   clients; then the same against the worker of part 6, if it ran; and (part ``malformed``) a well-behaved client's
   ``/query`` p99 alone and while a second client process sends 200 malformed bodies a second to the POST endpoints,
   in interleaved rounds, every malformed body's answer checked to be a 4xx;
2. **embedded lookups**: ``prefix_match`` and ``query_hashes`` of 27-block chains of the trace, in process;
3. **a mixed run**: residency entries (stores and tombstones of the trace through a small LRU per instance)
   applied in a thread in batches under the index's lock, as the feed applies them, while the main thread queries;
4. **memory**: the block table's bytes per resident (block, holder) pair and the process's RSS growth, at
   :attr:`~bench.run.BenchOptions.index_pairs` pairs;
5. **catch-up**: a fresh :class:`~stream_apps.index.feed.ChangelogFeed` reading a residency changelog of
   :attr:`~bench.run.BenchOptions.index_rows` rows from its start to its end;
6. **freshness**: a steady rate of fresh blocks into a worker's kv-events, from each block's event to an index
   replica (another process reading the worker's changelog) applying its first record.

Parts 2 to 5 each run in a fresh process: the bench's own heap (the trace, earlier steps' data) would otherwise
pause their lookups for collections and hide their RSS growth.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import gc
import json
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

from bench.freshness import FRESHNESS_DEFINITIONS, freshness_part

#: Serving instances the trace's requests are stored on (request i on ``sim-<i mod 4>``).
INSTANCES = 4
#: Blocks of a ``/query`` prompt: 8 blocks of 512 tokens, 4,096 tokens.
PROMPT_BLOCKS = 8
#: Blocks of an embedded lookup's chain (the trace's longer requests; the block table's own bench uses 27 too).
CHAIN_BLOCKS = 27
#: Distinct prompts and chains each load cycles through.
PROMPTS = 256
#: Concurrent keep-alive clients of the throughput figure.
CLIENTS = 16
#: Rows per residency entry of the memory and catch-up parts (4 holders per block: 2.5M entries are 10M rows).
ROWS_PER_ENTRY = 4
#: Blocks per LRU of the mixed run, per instance: small, so that the trace's replay evicts (tombstones and
#: holder changes, not only stores).
MIXED_LRU_BLOCKS = 4096
#: Entries the mixed run's writer applies per lock, as the feed does per poll (stream_apps.index.feed.POLL_BATCH).
MIXED_BATCH = 500
#: Rows of 10M: the size the memory and catch-up targets are stated for.
TEN_MILLION = 10_000_000
_U64 = (1 << 64) - 1
_JSON = {"Content-Type": "application/json"}

#: Target, unit and definition of every figure of the step (merged into bench.run.DEFINITIONS).
INDEX_DEFINITIONS: dict[str, dict] = {
    "index_http_query_p50_ms": {
        "unit": "ms", "target": None, "better": "lower", "baseline": "index_http_minimal_p50_ms",
        "definition": "Step index: POST /query of a 4,096-token prompt (8 blocks of 512 tokens of a trace request, "
                      "JSON token ids, block_size 512) to kvstream index's aiohttp application over an index of the "
                      "trace's requests (request i's blocks on instance i mod 4), one request at a time over one "
                      "loopback keep-alive connection from another process (aiohttp client): median of the time "
                      "from sending to the whole answer read. Baseline: the same client against a minimal aiohttp "
                      "server answering a constant body of the same size."},
    "index_http_query_p99_ms": {
        "unit": "ms", "target": 2, "better": "lower", "baseline": "index_http_minimal_p99_ms",
        "definition": "99th percentile of index_http_query_p50_ms's samples."},
    "index_http_prefix_match_p99_ms": {
        "unit": "ms", "target": 2, "better": "lower", "baseline": "index_http_minimal_p99_ms",
        "definition": "As index_http_query_p99_ms for POST /prefix-match/ with a trace request's whole block chain "
                      "(hex block hashes). details: p50, and the minimal server's figures for this path."},
    "index_http_minimal_p50_ms": {
        "unit": "ms", "target": None, "better": "lower", "baseline": None,
        "definition": "The floor of the HTTP figures: the same client and requests against a minimal aiohttp server "
                      "that reads the body and answers a constant body of the index's median answer size "
                      "(POST /query)."},
    "index_http_minimal_p99_ms": {
        "unit": "ms", "target": None, "better": "lower", "baseline": None,
        "definition": "99th percentile of index_http_minimal_p50_ms's samples."},
    "index_http_queries_per_s": {
        "unit": "queries/s", "target": None, "better": "higher", "baseline": "index_http_minimal_queries_per_s",
        "definition": "POST /query with 16 concurrent keep-alive clients (one aiohttp session, 16 connections, in "
                      "another process) against kvstream index's application: answers divided by the window's "
                      "time, bounded in requests and seconds. Median of interleaved rounds with the minimal "
                      "server. details: the CPU cores the server and the client used."},
    "index_http_minimal_queries_per_s": {
        "unit": "queries/s", "target": None, "better": "higher", "baseline": None,
        "definition": "As index_http_queries_per_s against the minimal aiohttp server."},
    "index_http_vs_minimal": {
        "unit": "ratio", "target": 0.5, "better": "higher", "baseline": None,
        "definition": "index_http_queries_per_s / index_http_minimal_queries_per_s."},
    "index_http_query_p99_ms_alone_same_run": {
        "unit": "ms", "target": None, "better": "lower", "baseline": None,
        "definition": "Part malformed: a well-behaved client (its own process, one keep-alive connection) sends POST "
                      "/query of index_http_query_p50_ms's 4,096-token prompts one at a time for a bounded time "
                      "to a fresh kvstream index application over the same trace, with no other client: median "
                      "over its rounds of each round's 99th percentile. The rounds alternate with those of "
                      "index_http_query_p99_ms_under_malformed (alone, loaded, alone, ...), so the machine's drift "
                      "falls on both."},
    "index_http_query_p99_ms_under_malformed": {
        "unit": "ms", "target": None, "better": "lower", "baseline": "index_http_query_p99_ms_alone_same_run",
        "definition": "As index_http_query_p99_ms_alone_same_run while a second client process sends 200 malformed "
                      "bodies a second (paced, at most 32 in flight) to the POST endpoints (/query, /query_by_hash, "
                      "/prefix-match/, /register, /unregister): malformed JSON bytes, msgpack garbage, a JSON "
                      "object nested 5,000 deep, fields of the wrong types, a /query token array just under the "
                      "8 MiB body limit (too many tokens), a /query body cut half-way (its Content-Length "
                      "announced, half sent, the connection's write side closed) and a Content-Length over the "
                      "limit; every one must be answered 4xx (the part fails on a 5xx, on any other answer, or if "
                      "the server dies). Median over the loaded rounds of each round's p99. details: the malformed "
                      "client's achieved rate, its answers' statuses per kind of body, and every round."},
    "index_http_malformed_p99_ratio": {
        "unit": "ratio", "target": None, "better": "lower", "baseline": None,
        "definition": "index_http_query_p99_ms_under_malformed / index_http_query_p99_ms_alone_same_run: what 200 "
                      "malformed bodies a second cost a well-behaved client's /query p99. details: each loaded "
                      "round's p99 over the alone round before it."},
    "index_worker_query_p99_ms": {
        "unit": "ms", "target": 2, "better": "lower", "baseline": "index_http_query_p99_ms",
        "definition": "As index_http_query_p99_ms against the kvstream worker of the freshness part (Faust's web "
                      "server, its index fed from its own residency changelog), prompts of the blocks it was sent. "
                      "details: /prefix-match/, queries/s with 16 clients, and how many answers matched a block."},
    "index_embedded_prefix_match_p99_us": {
        "unit": "µs", "target": 100, "better": "lower", "baseline": None,
        "definition": "FleetIndex.prefix_match of a 27-block chain of a trace request (canonical block hashes), in "
                      "process, the index filled from the trace as for the HTTP figures: 99th percentile of "
                      "perf_counter_ns around the call. details: p50, and the same at index_pairs pairs."},
    "index_embedded_query_hashes_p99_us": {
        "unit": "µs", "target": 100, "better": "lower", "baseline": None,
        "definition": "As index_embedded_prefix_match_p99_us for FleetIndex.query_hashes (/query_by_hash's "
                      "answer). details: query_tokens of the 4,096-token prompts."},
    "index_mixed_block_ops_per_s": {
        "unit": "block ops/s", "target": None, "better": "higher", "baseline": None,
        "definition": "Residency entries (stores, holder changes, tombstones of the trace replayed through an LRU of "
                      "4,096 blocks per instance) applied by a thread in batches of 500 under the index's lock, as "
                      "the feed applies them, while the main thread queries back to back: entries divided by the "
                      "writer's time. Both share one GIL, so each gets about half of a core. details: the writer "
                      "alone (no queries), and queries with the writer paced at --latency-rate."},
    "index_mixed_query_p99_us": {
        "unit": "µs", "target": None, "better": "lower", "baseline": "index_embedded_query_hashes_p99_us",
        "definition": "99th percentile of the main thread's query_hashes (27 blocks of the request last written) "
                      "during index_mixed_block_ops_per_s's run: with the writer's GIL share and lock waits."},
    "index_bytes_per_pair": {
        "unit": "bytes/pair", "target": 100, "better": "lower", "baseline": None,
        "definition": "The compiled block table's memory_bytes() divided by its resident (block, holder) links, "
                      "after index_pairs pairs were applied with FleetIndex.apply_entry (chains of 27 blocks, 4 "
                      "holders of 64 instances per block, parent and content hash per block)."},
    "index_rss_mib_10m_pairs": {
        "unit": "MiB", "target": 1024, "better": "lower", "baseline": None,
        "definition": "Growth of the process's RSS while those entries were applied (a fresh process), per 10M "
                      "pairs: measured at index_pairs, scaled linearly when that is below 10M (details)."},
    "index_catch_up_s_10m_rows": {
        "unit": "s", "target": 30, "better": "lower", "baseline": None,
        "definition": "A fresh ChangelogFeed (server.open_feed, in a fresh process) over a residency changelog of "
                      "index_rows rows (entries of 4 rows, written with the workers' encoder): seconds from the "
                      "feed's creation to caught up. Scaled linearly to 10M rows when fewer were measured "
                      "(details: measured_rows, measured_s)."},
    "index_changelog_freshness_p50_ms": {
        "unit": "ms", "target": None, "better": "lower", "baseline": None,
        "definition": "The changelog path alone: a steady --latency-rate of fresh blocks (the trace shifted, the "
                      "simulator's fleet) into a "
                      "worker's kv-events (topic prefix 'index.'), --latency-seconds after 5 s of warm-up: per "
                      "block stored in the measured window, the time an index replica in another process (a "
                      "ChangelogFeed over the worker's residency changelog) applied the block's first record, "
                      "minus the wall clock when its event was produced. Includes the producer's linger, the "
                      "worker's apply and its --changelog-interval-s."},
    "index_changelog_freshness_p99_ms": {
        "unit": "ms", "target": None, "better": "lower", "baseline": None,
        "definition": "99th percentile of index_changelog_freshness_p50_ms's delays."},
    **FRESHNESS_DEFINITIONS,
}


# --------------------------------------------------------------------------- the trace as the index holds it

def _percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted ``ordered``, by the nearest-rank rule (as bench.run's)."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(len(ordered) * q) - 1))]


def _summary(values: Sequence[float], scale: float) -> dict | None:
    """p50, p99, mean and max of ``values`` divided by ``scale``; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return {"p50": round(_percentile(ordered, 0.5) / scale, 3), "p99": round(_percentile(ordered, 0.99) / scale, 3),
            "mean": round(statistics.fmean(ordered) / scale, 3), "max": round(ordered[-1] / scale, 3),
            "samples": len(ordered)}


def block_bytes(hash_id: int) -> bytes:
    """The canonical block hash (8 bytes, big-endian) of trace block ``hash_id``, as the simulated engines publish
    it (``producers.simulator.block_hash_of``)."""
    from producers.simulator import block_hash_of

    return block_hash_of(hash_id).to_bytes(8, "big")


def residency_row(instance_id: str) -> dict:
    """A resident GPU row of ``instance_id`` with every field of the ``residency`` schema, as a worker writes a
    block stored once by an engine's scheduler (one copy)."""
    return {"instance_id": instance_id, "data_parallel_rank": 0, "tier": "GPU", "medium": "GPU", "locality": None,
            "group_idx": 0, "world_size": 1, "aggregation": "REPLICATED",
            "workers": [{"worker_rank": -1, "count": 1, "publisher_epoch": 1_767_225_601_000, "seq": 123_456,
                         "batch_index": 3, "block_index": 2, "content": None}],
            "copies": 1, "since": 1_767_225_700.5, "last_ts": 1_767_225_700.5, "clear_mark": None}


def residency_entry(block: bytes, parent: bytes | None, content: int | None, rows: list[dict]) -> dict:
    """A ``residency`` value: ``rows`` hold ``block``, whose parent and content hash (signed) are given."""
    return {"block_hash": block, "ownership": None, "rows": rows, "parent_block_hash": parent,
            "content_hash": content}


def _key(block: bytes) -> str:
    return f"primary/{block.hex()}"


def _complete(record: dict, schema: dict) -> dict:
    """``record`` with every field of the record schema ``schema`` that it lacks set to the field's default
    (recursively through arrays of records), so that entries built here stay encodable when the residency
    schema gains optional fields."""
    for field in schema["fields"]:
        name, kind = field["name"], field["type"]
        if name not in record:
            record[name] = field.get("default")
        elif isinstance(kind, dict) and kind.get("type") == "array" and isinstance(kind["items"], dict) \
                and kind["items"].get("type") == "record":
            for item in record[name]:
                _complete(item, kind["items"])
    return record


def trace_entries(requests) -> Iterator[tuple[str, dict]]:
    """``(key, entry)`` of every block of ``requests``: request i's blocks stored on ``sim-<i mod 4>`` (so a
    shared prefix has several holders), each block's parent the block before it, its content hash that of its
    512 tokens (``producers.simulator.trace_block_content_hash``)."""
    from producers.simulator import trace_block_content_hash

    blocks: dict[int, list] = {}
    for i, request in enumerate(requests):
        instance = i % INSTANCES
        parent = None
        for hash_id in request.hash_ids:
            held = blocks.get(hash_id)
            if held is None:
                held = blocks[hash_id] = [parent, set()]
            held[1].add(instance)
            parent = hash_id
    rows = [residency_row(f"sim-{i}") for i in range(INSTANCES)]
    for hash_id, (parent, held) in blocks.items():
        block = block_bytes(hash_id)
        yield _key(block), residency_entry(block, None if parent is None else block_bytes(parent),
                                           trace_block_content_hash(hash_id), [rows[i] for i in sorted(held)])


def register_instances(index, count: int = INSTANCES) -> None:
    """Register ``sim-0`` .. with 512-token blocks, as a Mooncake router registers its instances."""
    from producers.simulator import TRACE_BLOCK_SIZE
    from stream_apps.index.fleet_index import SourceInfo

    for i in range(count):
        index.sources.register(SourceInfo(f"sim-{i}", block_size=TRACE_BLOCK_SIZE, dp_ranks={0}))


def trace_index(requests):
    """A FleetIndex holding ``requests`` (:func:`trace_entries`), its instances registered."""
    from stream_apps.index.fleet_index import FleetIndex

    index = FleetIndex()
    register_instances(index)
    for key, entry in trace_entries(requests):
        index.apply_entry(key, entry)
    return index


def prompts(requests, count: int = PROMPTS, shift: int = 0) -> list[list[int]]:
    """Token ids of ``count`` prompts of 8 blocks (4,096 tokens): the first 8 blocks of requests of at least that
    many, drawn the same on every call; ``shift`` added to every block id."""
    from producers.simulator import trace_request_tokens

    eligible = [r for r in requests if len(r.hash_ids) >= PROMPT_BLOCKS]
    picked = random.Random(25).sample(eligible, min(count, len(eligible)))
    return [trace_request_tokens([h + shift for h in r.hash_ids[:PROMPT_BLOCKS]]) for r in picked]


def chains(requests, count: int = PROMPTS, shift: int = 0, blocks: int | None = None) -> list[list[bytes]]:
    """Canonical block hashes of ``count`` requests' chains (their first ``blocks``, or all; with ``blocks``, only
    requests at least that long), drawn the same on every call."""
    eligible = [r for r in requests if blocks is None or len(r.hash_ids) >= blocks]
    picked = random.Random(27).sample(eligible, min(count, len(eligible)))
    return [[block_bytes(h + shift) for h in r.hash_ids[:blocks]] for r in picked]


def query_bodies(requests, shift: int = 0) -> list[bytes]:
    """``POST /query`` bodies (JSON): a prompt's token ids and the block size."""
    from producers.simulator import TRACE_BLOCK_SIZE

    return [json.dumps({"token_ids": tokens, "block_size": TRACE_BLOCK_SIZE}, separators=(",", ":")).encode()
            for tokens in prompts(requests, shift=shift)]


def prefix_bodies(requests, shift: int = 0) -> list[bytes]:
    """``POST /prefix-match/`` bodies (JSON): a request's whole chain as hex block hashes."""
    return [json.dumps({"block_hashes": [b.hex() for b in chain]}).encode()
            for chain in chains(requests, shift=shift)]


# --------------------------------------------------------------------------- the two servers

class _CaughtUpFeed:
    """What :func:`build_web_app` and :class:`IndexMetrics` read of a feed, for an index filled directly."""

    caught_up = True
    records = 0
    undecodable = 0

    def not_ready(self) -> list[str]:
        return []

    def lag(self) -> int:
        return 0


def serve_index(port: int, requests_limit: int | None) -> None:
    """``kvstream index``'s application on 127.0.0.1:``port`` over the trace's first ``requests_limit`` requests
    (None: all), applied directly instead of read from a changelog; serves until killed."""
    from aiohttp import web

    from producers.simulator import load_trace
    from stream_apps.index.api import IndexAPI
    from stream_apps.index.server import IndexMetrics, build_web_app

    started = time.perf_counter()
    index = trace_index(load_trace(limit=requests_limit))
    feed = _CaughtUpFeed()
    app = build_web_app(IndexAPI(index, list), feed, IndexMetrics(index, feed))  # always ready: nothing to read
    print(json.dumps({"fill_s": round(time.perf_counter() - started, 2), **index.stats()}), flush=True)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def serve_minimal(port: int, query_bytes: int, prefix_bytes: int) -> None:
    """The baseline: an aiohttp server that reads each request's body and answers a constant JSON body of the
    given size (``/query``, ``/prefix-match/``), on the same routes and with the same framework as the index."""
    from aiohttp import web

    def body(size: int) -> bytes:
        return b'{"pad":"' + b"0" * max(0, size - 10) + b'"}'

    def answer(constant: bytes):
        async def handler(request: web.Request) -> web.Response:
            await request.read()
            return web.Response(body=constant, content_type="application/json")
        return handler

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    app = web.Application()
    for path, handler in (("/query", answer(body(query_bytes))), ("/prefix-match", answer(body(prefix_bytes)))):
        app.router.add_post(path, handler)
        app.router.add_post(path + "/", handler)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# --------------------------------------------------------------------------- the load client (a process of its own)

async def _sequential(session, url: str, bodies: list[bytes], count: int, warmup: int,
                      max_s: float | None = None) -> dict:
    """``count`` requests one at a time after ``warmup`` (and, with ``max_s``, no more than that many seconds
    after the warm-up): latencies, answer sizes, failures."""
    from time import perf_counter_ns

    ns, sizes, failed, hits = [], [], 0, 0
    deadline = None
    for i in range(warmup + count):
        if i == warmup and max_s is not None:
            deadline = perf_counter_ns() + int(max_s * 1e9)
        if deadline is not None and perf_counter_ns() >= deadline:
            break
        body = bodies[i % len(bodies)]
        t0 = perf_counter_ns()
        async with session.post(url, data=body, headers=_JSON) as response:
            data = await response.read()
            status = response.status
        t1 = perf_counter_ns()
        if i < warmup:
            continue
        ns.append(t1 - t0)
        sizes.append(len(data))
        if status != 200:
            failed += 1
        elif b'"matched_blocks":' in data or b'"longest_matched":' in data:
            hits += 1
    return {"ms": _summary(ns, 1e6), "answer_bytes_median": statistics.median(sizes), "failed": failed,
            "answers_with_a_match": hits}


def _cpu(pid: int | None) -> float:
    import psutil

    if pid is None:
        return 0.0
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return times.user + times.system


async def _throughput(url: str, bodies: list[bytes], clients: int, max_requests: int, max_s: float,
                      pid: int | None) -> dict:
    """``clients`` keep-alive connections sending back to back until ``max_requests`` or ``max_s``."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one(i: int) -> int:
            async with session.post(url, data=bodies[i % len(bodies)], headers=_JSON) as response:
                await response.read()
                return response.status

        await asyncio.gather(*(one(i) for i in range(clients)))  # every connection open before the clock starts
        issued = 0
        done = failed = 0
        deadline = time.perf_counter() + max_s

        async def client() -> None:
            nonlocal issued, done, failed
            while issued < max_requests and time.perf_counter() < deadline:
                issued += 1
                status = await one(issued)
                done += 1
                failed += status != 200

        cpu0, own0 = _cpu(pid), time.process_time()
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        seconds = time.perf_counter() - t0
        cpu1, own1 = _cpu(pid), time.process_time()
    return {"queries_per_s": round(done / seconds, 1), "answers": done, "failed": failed,
            "seconds": round(seconds, 3), "server_cores": round((cpu1 - cpu0) / seconds, 2),
            "client_cores": round((own1 - own0) / seconds, 2),
            # what a query costs the server whatever else shares the cores: its capacity per core is 1000 / this
            "server_cpu_ms_per_query": round((cpu1 - cpu0) / done * 1000, 3) if done else None}


async def _load(spec: dict) -> dict:
    import aiohttp

    from producers.simulator import load_trace

    requests = load_trace(limit=spec["requests"])
    if spec.get("request_ids"):
        requests = [requests[i] for i in spec["request_ids"]]
    bodies = {"/query": query_bodies(requests, spec["shift"]), "/prefix-match/": prefix_bodies(requests, spec["shift"])}
    out: dict = {name: {"unloaded": {}, "loaded": []} for name in spec["targets"]}
    for name, target in spec["targets"].items():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            for path, path_bodies in bodies.items():
                out[name]["unloaded"][path] = await _sequential(session, target["base"] + path, path_bodies,
                                                                spec["unloaded"], spec["warmup"])
    for _ in range(spec["rounds"]):  # interleaved: a slow second of the machine falls on every target
        for name, target in spec["targets"].items():
            out[name]["loaded"].append(await _throughput(target["base"] + "/query", bodies["/query"],
                                                         spec["clients"], spec["max_requests"], spec["round_s"],
                                                         target.get("pid")))
    for result in out.values():
        result["queries_per_s"] = statistics.median(r["queries_per_s"] for r in result["loaded"])
        result["server_cpu_ms_per_query"] = statistics.median(r["server_cpu_ms_per_query"] or 0
                                                              for r in result["loaded"])
    return out


def run_load(spec: dict) -> dict:
    """The load client's measurements against every target of ``spec`` (see :func:`_http_part`)."""
    return asyncio.run(_load(spec))


# --------------------------------------------------------------------------- the malformed part's two clients

#: Malformed bodies a second the malformed part's second client sends, and the most it has in flight (past that it
#: falls behind the rate, which its achieved rate shows).
MALFORMED_RATE = 200
MALFORMED_IN_FLIGHT = 32
#: The mix, per 200 bodies (a second at the rate): kind -> bodies. The body just under the 8 MiB limit is one a
#: second: the API reads and refuses it in about 150 ms of the server's one event loop, so five a second (one in 40)
#: would saturate the server by itself.
MALFORMED_MIX = {"bad_json": 34, "msgpack_garbage": 34, "deep_json": 34, "wrong_types": 40, "cut_half": 34,
                 "stops_half_way": 10, "over_limit": 13, "huge_tokens": 1}
#: The kinds of body whose right answer may also be none: the client closed its side of the connection half-way
#: through the body, and aiohttp closes a connection whose client sent its end (``eof_received``) before the
#: handler's 400 can be written.
MAY_GO_UNANSWERED = ("stops_half_way",)
#: The POST endpoints of the router APIs (stream_apps.index.server.POST_PATHS).
POST_ENDPOINTS = ("/query", "/query_by_hash", "/prefix-match/", "/register", "/unregister")
#: A field of the wrong type per endpoint (each sent as JSON and as msgpack).
_WRONG_TYPES = {
    "/query": ({"token_ids": "1 2 3"}, {"token_ids": [1, "2", 3]}, {"token_ids": [1.5, 2.5]},
               {"token_ids": [1, 2], "block_size": "512"}, {"token_ids": {"0": 1}},
               {"token_ids": [1, 2], "instance_id": 7}),
    "/query_by_hash": ({"seq_hashes": "abc"}, {"seq_hashes": [[1, 2]]}, {"seq_hashes": [1.5]},
                       {"seq_hashes": [1], "model_name": 3}),
    "/prefix-match/": ({"block_hashes": {"x": 1}}, {"block_hashes": [{"h": 1}]}, {"block_hashes": ["not hex"]},
                       {"block_hashes": None}),
    "/register": ({"instance_id": 42, "block_size": "big", "type": "vLLM"},
                  {"instance_id": "bench-malformed", "block_size": [512], "type": "vLLM"},
                  {"instance_id": "bench-malformed", "block_size": 512, "dp_rank": "zero", "type": "vLLM"}),
    "/unregister": ({"instance_id": ["bench-malformed"]}, {"instance_id": "bench-malformed", "dp_rank": "zero"},
                    {"instance_id": None}),
}
_JSON_TYPE, _MSGPACK_TYPE = "application/json", "application/msgpack"


def malformed_bodies(cut: dict[str, bytes], body_limit: int) -> dict[str, list[tuple[str, str, bytes, int]]]:
    """Per kind of :data:`MALFORMED_MIX`, its variants ``(path, content type, bytes sent, Content-Length)``.

    ``cut`` holds a valid JSON body per path (``/query``: a prompt, ``/prefix-match/``: a chain): ``cut_half`` is its
    first half (JSON and msgpack) with the half's length; ``stops_half_way`` announces the whole and sends half (the
    caller then closes its write side); ``over_limit`` announces twice ``body_limit`` and sends 64 KiB;
    ``huge_tokens`` is a ``/query`` token array just under ``body_limit`` (twice the tokens the API takes)."""
    import msgspec

    rng = random.Random(50)
    bad_json = (b'{"token_ids": [1, 2,, 3]}', b'{"token_ids": [1, 2, 3]', b"\x00\xff\xfe not JSON at all",
                b'{"block_hashes": ["00ff"],}', b"{'instance_id': 'single quotes'}", b'{"a" 1}', b"", b"[1, 2, 3")
    garbage = [bytes([0xC1]) + rng.randbytes(rng.randrange(300)) for _ in range(16)] + \
        [rng.randbytes(rng.randrange(1, 300)) for _ in range(16)]
    deep = (b'{"a":' * 5000 + b"1" + b"}" * 5000, b'{"token_ids":' + b"[" * 5000 + b"1" + b"]" * 5000 + b"}")
    tokens = (body_limit - 64) // 2
    huge = b'{"token_ids":[' + b"1," * (tokens - 1) + b'1],"block_size":512}'

    def sent(path: str, content_type: str, body: bytes) -> tuple[str, str, bytes, int]:
        return path, content_type, body, len(body)

    return {
        "bad_json": [sent(path, _JSON_TYPE, body) for body in bad_json for path in POST_ENDPOINTS],
        "msgpack_garbage": [sent(POST_ENDPOINTS[i % len(POST_ENDPOINTS)], _MSGPACK_TYPE, body)
                            for i, body in enumerate(garbage)],
        "deep_json": [sent(path, _JSON_TYPE, body) for body in deep for path in POST_ENDPOINTS],
        "wrong_types": [sent(path, content_type, encode(value)) for path, values in _WRONG_TYPES.items()
                        for value in values for content_type, encode in ((_JSON_TYPE, lambda v: json.dumps(v).encode()),
                                                                         (_MSGPACK_TYPE, msgspec.msgpack.encode))],
        "cut_half": [sent(path, content_type, body[: len(body) // 2]) for path, whole in cut.items()
                     for content_type, body in ((_JSON_TYPE, whole),
                                                (_MSGPACK_TYPE, msgspec.msgpack.encode(json.loads(whole))))],
        "stops_half_way": [(path, _JSON_TYPE, body[: len(body) // 2], len(body)) for path, body in cut.items()],
        "over_limit": [(path, _JSON_TYPE, b"[" * 65536, 2 * body_limit) for path in POST_ENDPOINTS],
        "huge_tokens": [sent("/query", _JSON_TYPE, huge)],
    }


async def _raw_post(host: str, port: int, path: str, content_type: str, body: bytes, length: int,
                    close_write: bool) -> int | str:
    """A POST on a connection of its own announcing ``length`` bytes and sending ``body`` (then, with
    ``close_write``, closing the connection's write side): the answer's status, or ``no answer``."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\n"
                     f"Content-Length: {length}\r\n\r\n".encode() + body)
        try:
            await writer.drain()
            if close_write:
                writer.write_eof()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before the body's end: the answer is what counts
        line = await asyncio.wait_for(reader.readline(), 30)
    finally:
        writer.close()
    parts = line.split()
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else "no answer"


async def _send_malformed(session, base: str, kind: str, path: str, content_type: str, body: bytes,
                          length: int) -> tuple[int | str, float]:
    """One malformed body: its answer's status (or the client's error) and the seconds it took."""
    import aiohttp

    host, port = base.rsplit("/", 1)[1].rsplit(":", 1)
    started = time.perf_counter()
    try:
        if kind in ("stops_half_way", "over_limit"):
            status = await _raw_post(host, int(port), path, content_type, body, length, kind == "stops_half_way")
        else:
            async with session.post(base + path, data=body, headers={"Content-Type": content_type}) as response:
                await response.read()
                status = response.status
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
        status = f"client error {type(exc).__name__}"
    return status, time.perf_counter() - started


async def _malformed_round(send, variants: dict, rate: float, stop: asyncio.Event) -> dict:
    """Bodies of :data:`MALFORMED_MIX` at ``rate`` a second until ``stop``, at most :data:`MALFORMED_IN_FLIGHT` at a
    time; more than 20 bodies behind, it skips ahead instead of bursting to catch up. Returns the counts, statuses
    per kind, and per kind every body's milliseconds from sending to its answer."""
    schedule = [kind for kind, n in MALFORMED_MIX.items() for _ in range(n)]
    random.Random(4).shuffle(schedule)
    cursors = dict.fromkeys(variants, 0)
    statuses: dict[str, dict[str, int]] = {}
    ms: dict[str, list[float]] = {}
    slots = asyncio.Semaphore(MALFORMED_IN_FLIGHT)
    tasks: set = set()

    async def one(kind: str, variant: tuple) -> None:
        try:
            status, seconds = await send(kind, *variant)
            counts = statuses.setdefault(kind, {})
            counts[str(status)] = counts.get(str(status), 0) + 1
            ms.setdefault(kind, []).append(seconds * 1000)
        finally:
            slots.release()

    sent = skips = 0
    started = due = time.perf_counter()
    while not stop.is_set():
        pause = due - time.perf_counter()
        if pause > 0:
            try:
                await asyncio.wait_for(stop.wait(), pause)
                break
            except asyncio.TimeoutError:
                pass
        elif pause < -20 / rate:
            due, skips = time.perf_counter(), skips + 1
        await slots.acquire()
        kind = schedule[sent % len(schedule)]
        variant = variants[kind][cursors[kind] % len(variants[kind])]
        cursors[kind] += 1
        task = asyncio.create_task(one(kind, variant))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        sent += 1
        due += 1 / rate
    seconds = time.perf_counter() - started
    await asyncio.gather(*tasks)
    return {"sent": sent, "seconds": round(seconds, 3), "sent_per_s": round(sent / seconds, 1),
            "skipped_ahead": skips, "statuses": statuses,
            "ms": {kind: [round(x, 2) for x in v] for kind, v in ms.items()}}


async def _malformed_client(base: str, rate: float, cut: dict[str, bytes], connection) -> None:
    import aiohttp

    from stream_apps.index.api import MAX_BODY_BYTES

    variants = malformed_bodies(cut, MAX_BODY_BYTES)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=MALFORMED_IN_FLIGHT),
                                     timeout=timeout) as session:
        async def send(kind: str, *variant) -> tuple[int | str, float]:
            return await _send_malformed(session, base, kind, *variant)

        probe: dict[str, dict[str, int]] = {}
        for kind, items in variants.items():  # every variant once, one at a time: each kind's own answers
            for variant in items:
                status, _ = await send(kind, *variant)
                counts = probe.setdefault(kind, {})
                counts[str(status)] = counts.get(str(status), 0) + 1
        connection.send(("ready", {"probe": probe, "variants": {kind: len(v) for kind, v in variants.items()},
                                   "bytes": {kind: round(statistics.fmean(len(v[2]) for v in items))
                                             for kind, items in variants.items()}}))
        while await asyncio.to_thread(connection.recv) == "start":
            connection.send("sending")
            stop = asyncio.Event()
            waiter = asyncio.create_task(asyncio.to_thread(connection.recv))  # the round's "stop"
            waiter.add_done_callback(lambda _: stop.set())
            result = await _malformed_round(send, variants, rate, stop)
            await waiter
            connection.send(result)


def malformed_client(base: str, rate: float, cut: dict[str, bytes], connection) -> None:
    """The malformed part's second client, a process of its own: sends every variant of every kind once and says
    ``("ready", its statuses)``; then, per ``"start"``, says ``"sending"`` and sends the mix at ``rate`` bodies a
    second until ``"stop"``, answering with the round's counts; anything else ends it."""
    asyncio.run(_malformed_client(base, rate, cut, connection))


async def _well_behaved(base: str, bodies: list[bytes], connection) -> None:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        url = base + "/query"
        await _sequential(session, url, bodies, 300, 0)
        connection.send("ready")
        while (seconds := connection.recv()) is not None:  # blocks the loop: nothing else runs here meanwhile
            connection.send(await _sequential(session, url, bodies, 10**9, 0, max_s=seconds))


def well_behaved_client(base: str, bodies: list[bytes], connection) -> None:
    """The malformed part's well-behaved client, a process of its own: 300 ``/query`` to warm up, says
    ``"ready"``; then per number of seconds received, ``/query`` one at a time for that long (:func:`_sequential`),
    answering with its latencies; None ends it."""
    asyncio.run(_well_behaved(base, bodies, connection))


# --------------------------------------------------------------------------- the parts that run in a fresh process

def _time_calls(call, arguments: Sequence, calls: int, warmup: int = 1000) -> list[int]:
    from time import perf_counter_ns

    for i in range(min(warmup, calls)):
        call(arguments[i % len(arguments)])
    ns = []
    for i in range(calls):
        argument = arguments[i % len(arguments)]
        t0 = perf_counter_ns()
        call(argument)
        ns.append(perf_counter_ns() - t0)
    return ns


def embedded_part(requests_limit: int | None, calls: int) -> dict:
    """Part 2: prefix_match, query_hashes (27-block chains) and query_tokens (4,096 tokens) in process."""
    from producers.simulator import TRACE_BLOCK_SIZE, load_trace
    from stream_apps.index.table import block_key

    requests = load_trace(limit=requests_limit)
    started = time.perf_counter()
    index = trace_index(requests)
    fill_s = time.perf_counter() - started
    chain_list = chains(requests, 1024, blocks=CHAIN_BLOCKS)
    tokens = prompts(requests)
    full = sum(1 for chain in chain_list if any(m["matched_blocks"] == CHAIN_BLOCKS
                                                for m in index.prefix_match(chain)))
    keys = [[block_key(h) for h in chain] for chain in chain_list]
    return {"index": index.stats(), "fill_s": round(fill_s, 2), "chains": len(chain_list),
            "chains_matched_whole": full,
            # the block table's walk alone (the compiled part of prefix_match), without the scoring above it
            "table_holders_at_us": _summary(_time_calls(index._table.holders_at, keys, calls), 1e3),
            "prefix_match_us": _summary(_time_calls(index.prefix_match, chain_list, calls), 1e3),
            "query_hashes_us": _summary(_time_calls(index.query_hashes, chain_list, calls), 1e3),
            "query_tokens_us": _summary(_time_calls(
                lambda t: index.query_tokens(t, block_size=TRACE_BLOCK_SIZE), tokens, max(1000, calls // 4)), 1e3)}


def lru_replay(requests, ops_wanted: int, capacity: int = MIXED_LRU_BLOCKS):
    """The residency entries of the trace through an LRU of ``capacity`` blocks per instance (request i on
    instance i mod 4), repeated with shifted block ids until ``ops_wanted``: each a block's entry after a store or
    an eviction (its holders then; a tombstone, None, when none is left).

    Returns:
        ``(ops, starts, chains)``: the ``(key, entry)`` list, and per request the index in ``ops`` of its first
        entry and its first 27 canonical block hashes (what a router asks right after the request).
    """
    from producers.simulator import trace_block_content_hash

    rows = [residency_row(f"sim-{i}") for i in range(INSTANCES)]
    lrus = [OrderedDict() for _ in range(INSTANCES)]
    holders: dict[int, set[int]] = {}
    parents: dict[int, int | None] = {}
    contents: dict[int, int] = {}
    ops: list[tuple[str, dict | None]] = []
    starts: list[int] = []
    chain_list: list[list[bytes]] = []

    def entry_of(hash_id: int) -> dict:
        parent = parents[hash_id]
        return residency_entry(block_bytes(hash_id), None if parent is None else block_bytes(parent),
                               contents[hash_id], [rows[i] for i in sorted(holders[hash_id])])

    repetition = 0
    while len(ops) < ops_wanted:
        shift = repetition << 40
        for i, request in enumerate(requests):
            instance = i % INSTANCES
            lru = lrus[instance]
            ids = [h + shift for h in request.hash_ids]
            starts.append(len(ops))
            chain_list.append([block_bytes(h) for h in ids[:CHAIN_BLOCKS]])
            parent = None
            for hash_id in ids:
                if hash_id in lru:
                    lru.move_to_end(hash_id)
                else:
                    lru[hash_id] = None
                    if hash_id not in contents:
                        contents[hash_id] = trace_block_content_hash(hash_id)
                    parents[hash_id] = parent
                    holders.setdefault(hash_id, set()).add(instance)
                    ops.append((_key(block_bytes(hash_id)), entry_of(hash_id)))
                    if len(lru) > capacity:
                        old, _ = lru.popitem(last=False)
                        holders[old].discard(instance)
                        if holders[old]:
                            ops.append((_key(block_bytes(old)), entry_of(old)))
                        else:
                            del holders[old]
                            ops.append((_key(block_bytes(old)), None))
                parent = hash_id
            if len(ops) >= ops_wanted:
                break
        repetition += 1
    return ops, starts, chain_list


def _mixed_run(ops, starts, chain_list, rate: float | None, queries: bool = True) -> dict:
    """One mixed run over a fresh index: a writer thread applies ``ops`` (at ``rate`` entries/s, None: full speed)
    while this thread runs query_hashes of the request last written, back to back (``queries``; else it waits)."""
    from time import perf_counter_ns

    from stream_apps.index.fleet_index import FleetIndex

    index = FleetIndex()
    register_instances(index)
    position = 0
    finished = threading.Event()
    timing: dict = {}

    def writer() -> None:
        nonlocal position
        apply, lock = index.apply_entry, index.lock
        t0 = time.perf_counter()
        for start in range(0, len(ops), MIXED_BATCH):
            if rate is not None:
                due = t0 + start / rate
                pause = due - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
            with lock:  # one batch per lock, as ChangelogFeed.poll applies a poll's records
                for key, entry in ops[start:start + MIXED_BATCH]:
                    apply(key, entry)
            position = start + MIXED_BATCH
            # the feed's consume() between batches releases the GIL; without this the writer takes the lock
            # again before a waiting query can (CPython's locks are not fair) and starves it
            time.sleep(0)
        timing["seconds"] = time.perf_counter() - t0
        finished.set()

    thread = threading.Thread(target=writer, name="mixed-writer", daemon=True)
    ns: list[int] = []
    matched = 0
    query = index.query_hashes
    thread.start()
    if not queries:
        finished.wait()
    while not finished.is_set():
        request = bisect.bisect_right(starts, position) - 1
        chain = chain_list[max(0, request - 1)]  # the last request whose entries are all applied
        t0 = perf_counter_ns()
        answer = query(chain)
        ns.append(perf_counter_ns() - t0)
        matched += bool(answer["instances"])
    thread.join()
    seconds = timing["seconds"]
    return {"ops": len(ops), "seconds": round(seconds, 3), "ops_per_s": round(len(ops) / seconds),
            "queries": len(ns), "queries_per_s": round(len(ns) / seconds), "queries_with_a_match": matched,
            "query_us": _summary(ns, 1e3), "index_at_end": index.stats()}


def mixed_part(requests_limit: int | None, ops_wanted: int, paced_rate: int, paced_s: float) -> dict:
    """Part 3: the mixed run at full speed, then paced at ``paced_rate`` entries/s for ``paced_s``."""
    from producers.simulator import load_trace

    started = time.perf_counter()
    ops, starts, chain_list = lru_replay(load_trace(limit=requests_limit), ops_wanted)
    replay_s = time.perf_counter() - started
    tombstones = sum(1 for _, entry in ops if entry is None)
    alone = _mixed_run(ops, starts, chain_list, None, queries=False)
    full = _mixed_run(ops, starts, chain_list, None)
    paced_ops = min(len(ops), int(paced_rate * paced_s))
    paced = _mixed_run(ops[:paced_ops], starts, chain_list, paced_rate)
    return {"full_speed": full, "paced": {"rate": paced_rate, **paced}, "writer_alone": alone,
            "tombstones": tombstones,
            "lru_blocks_per_instance": MIXED_LRU_BLOCKS, "batch": MIXED_BATCH, "replay_build_s": round(replay_s, 1)}


def _synthetic_entries(entries: int, instances: int = 64, schema: dict | None = None
                       ) -> Iterator[tuple[str, dict]]:
    """``entries`` residency entries laid out as the fleet's: chains of 27 blocks, each chain's blocks held by
    the same 4 of ``instances`` instances, a parent and a content hash per block; with ``schema`` (the
    ``residency`` record schema), every field it has and they lack at its default (:func:`_complete`)."""
    from bench.index_table import CHAIN, GOLDEN, MASK

    rng = random.Random(7)
    rows = [residency_row(f"sim-{i}") for i in range(instances)]
    extra: dict = {}
    if schema is not None:
        rows = [_complete({"rows": [row]}, schema)["rows"][0] for row in rows]
        extra = {name: value for name, value in _complete({"rows": []}, schema).items()
                 if name not in residency_entry(b"", None, None, [])}
    patterns = [[rows[h] for h in sorted(rng.sample(range(instances), ROWS_PER_ENTRY))] for _ in range(1024)]
    parent = None
    for i in range(entries):
        block = ((i * GOLDEN) & MASK).to_bytes(8, "big")
        entry = residency_entry(block, parent if i % CHAIN else None, ((i * GOLDEN) >> 1 & MASK) - (1 << 63),
                                patterns[(i // CHAIN) & 1023])
        if extra:
            entry.update(extra)
        yield _key(block), entry
        parent = block


def _synthetic_chains(entries: int, count: int) -> list[list[bytes]]:
    from bench.index_table import CHAIN, GOLDEN, MASK

    rng = random.Random(11)
    whole = entries // CHAIN
    return [[(((c * CHAIN + d) * GOLDEN) & MASK).to_bytes(8, "big") for d in range(CHAIN)]
            for c in (rng.randrange(whole) for _ in range(count))]


def memory_part(pairs: int, calls: int) -> dict:
    """Part 4: ``pairs`` resident pairs (entries of 4 holders) applied with FleetIndex.apply_entry; the table's
    bytes per pair, the process's RSS growth, and the embedded lookups at that size."""
    from bench.index_table import _rss
    from stream_apps.index.fleet_index import FleetIndex

    entries = pairs // ROWS_PER_ENTRY
    gc.collect()
    before = _rss()
    index = FleetIndex()
    apply = index.apply_entry
    started = time.perf_counter()
    for key, entry in _synthetic_entries(entries):
        apply(key, entry)
    seconds = time.perf_counter() - started
    gc.collect()
    grown = _rss() - before
    stats = index.stats()
    chain_list = _synthetic_chains(entries, 4096)
    return {"entries": entries, "pairs": stats["resident_pairs"], "blocks": stats["blocks"],
            "memory_bytes": stats["memory_bytes"], "rss_growth_bytes": grown,
            "bytes_per_pair": stats["memory_bytes"] / stats["resident_pairs"],
            "rss_bytes_per_pair": round(grown / stats["resident_pairs"], 1),
            "apply_entries_per_s": round(entries / seconds), "build_s": round(seconds, 1),
            "prefix_match_us": _summary(_time_calls(index.prefix_match, chain_list, calls), 1e3),
            "query_hashes_us": _summary(_time_calls(index.query_hashes, chain_list, calls), 1e3)}


def catch_up_part(bootstrap: str, app_id: str, timeout_s: float) -> dict:
    """Part 5, the reading side: a fresh feed over ``<app_id>-residency-changelog`` until caught up."""
    from bench.index_table import _rss
    from schemas.topics import TopicNames
    from stream_apps.index.fleet_index import FleetIndex
    from stream_apps.index.server import open_feed

    before = _rss()
    index = FleetIndex()
    feed = open_feed(index, bootstrap, TopicNames(app_id))
    feed.start_thread()
    try:
        if not feed.wait_caught_up(timeout_s):
            raise TimeoutError("; ".join(feed.not_ready()))
    finally:
        feed.close()
    stats = index.stats()
    return {"catch_up_s": feed.catch_up_s, "records": feed.records, "undecodable": feed.undecodable,
            "blocks": stats["blocks"], "pairs": stats["resident_pairs"], "rss_growth_mib": (_rss() - before) / 2**20}


def produce_changelog(bootstrap: str, topic: str, entries: int, partitions: int) -> dict:
    """Part 5, the writing side: ``entries`` residency entries of 4 rows into ``topic`` (compacted, as the
    workers' changelog), encoded as the workers encode them (stream_apps.store.value_encoder)."""
    from confluent_kafka import Producer

    from kafka_io.admin import ensure_topics
    from kafka_io.config import producer_config
    from schemas import AvroCodec
    from stream_apps.store import value_encoder

    ensure_topics(bootstrap, {topic: partitions}, configs={topic: {"cleanup.policy": "compact"}})
    codec = AvroCodec("residency")
    encode = value_encoder(codec)
    producer = Producer(producer_config(bootstrap))
    produce = producer.produce
    value_bytes = 0
    started = time.perf_counter()
    for n, (key, entry) in enumerate(_synthetic_entries(entries, schema=codec.schema.parsed)):
        value = encode(entry)
        value_bytes += len(value)
        while True:
            try:
                produce(topic, value, key.encode())
                break
            except BufferError:
                producer.poll(0.05)
        if n % 10_000 == 0:
            producer.poll(0)
    left = producer.flush(600)
    if left:
        raise RuntimeError(f"{left} changelog records not acknowledged")
    return {"entries": entries, "rows": entries * ROWS_PER_ENTRY, "seconds": round(time.perf_counter() - started, 1),
            "mean_value_bytes": round(value_bytes / entries, 1), "schema_version": codec.schema.version}


class _SeenIndex:
    """Wraps a FleetIndex to remember when each key's first record was applied (the freshness replica)."""

    def __init__(self, index) -> None:
        self.index = index
        self.seen: dict[str, float] = {}
        self.lock = index.lock

    def apply_entry(self, key: str, entry) -> None:
        if key not in self.seen:
            self.seen[key] = time.time()
        self.index.apply_entry(key, entry)

    def stats(self) -> dict:
        return self.index.stats()


def replica_part(bootstrap: str, app_id: str, prefix: str, connection) -> None:
    """Part 6, the replica: a feed over the worker's residency changelog; says "ready" once caught up, and
    answers "stop" with every key's first-applied wall time."""
    from schemas.topics import TopicNames
    from stream_apps.index.fleet_index import FleetIndex
    from stream_apps.index.server import open_feed

    index = _SeenIndex(FleetIndex())
    feed = open_feed(index, bootstrap, TopicNames(app_id, prefix))
    feed.start_thread()
    connection.send("ready" if feed.wait_caught_up(300) else "; ".join(feed.not_ready()))
    connection.recv()
    feed.close()
    connection.send({"seen": index.seen, "records": feed.records, "stats": index.stats()})


def in_fresh_process(function, *args):
    """``function(*args)`` in a new process (spawn), its return value back."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


# --------------------------------------------------------------------------- the step

def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _post_size(url: str, body: bytes) -> int:
    request = urllib.request.Request(url, data=body, headers=_JSON, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return len(response.read())


def _wait_http(url: str, process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}: {log.read_text(errors='replace')[-800:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f}s")


def _spawn(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "bench.index_bench", *argv], stdout=out,
                                stderr=subprocess.STDOUT)


def _stop(process: subprocess.Popen | None) -> None:
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _load_sizes(quick: bool) -> dict:
    return ({"unloaded": 500, "warmup": 100, "rounds": 1, "round_s": 2.0, "max_requests": 20_000} if quick else
            {"unloaded": 3000, "warmup": 300, "rounds": 3, "round_s": 4.0, "max_requests": 60_000})


def _run_load_client(bench, spec: dict, label: str) -> dict:
    spec_path = bench.work / f"index-load-{label}.json"
    out_path = bench.work / f"index-load-{label}-out.json"
    spec_path.write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, "-m", "bench.index_bench", "load", "--spec", str(spec_path), "--out",
                           str(out_path)], capture_output=True, text=True, timeout=bench.o.timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the load client exited with {done.returncode}: {done.stderr[-800:]}")
    return json.loads(out_path.read_text())


def _http_part(bench, say) -> None:
    """Part 1: the index's application and the minimal server, each a process, loaded by a third."""
    from kvstream.broker import free_port
    from producers.simulator import load_trace

    limit = bench.o.requests
    requests = load_trace(limit=limit)
    bodies = {"/query": query_bodies(requests), "/prefix-match/": prefix_bodies(requests)}
    index_port, minimal_port = free_port(), free_port()
    log = bench.work / "index-servers.log"
    server = minimal = None
    try:
        server = _spawn(["serve", "--port", str(index_port)] + ([] if limit is None else ["--requests", str(limit)]),
                        log)
        base = f"http://127.0.0.1:{index_port}"
        _wait_http(base + "/health", server, log, bench.o.timeout_s)
        index_stats = json.loads(urllib.request.urlopen(base + "/workers", timeout=30).read())["index"]
        # the minimal server answers the index's median answer size of each path
        sizes = {path: int(statistics.median(_post_size(base + path, body) for body in path_bodies[:64]))
                 for path, path_bodies in bodies.items()}
        minimal = _spawn(["minimal", "--port", str(minimal_port), "--query-bytes", str(sizes["/query"]),
                          "--prefix-bytes", str(sizes["/prefix-match/"])], log)
        _wait_http(f"http://127.0.0.1:{minimal_port}/health", minimal, log, 60)
        spec = {"requests": limit, "shift": 0, "clients": CLIENTS, **_load_sizes(bench.o.quick),
                "targets": {"index": {"base": base, "pid": server.pid},
                            "minimal": {"base": f"http://127.0.0.1:{minimal_port}", "pid": minimal.pid}}}
        found = _run_load_client(bench, spec, "servers")
    finally:
        _stop(server)
        _stop(minimal)
    index, base_ = found["index"], found["minimal"]
    q, p = index["unloaded"]["/query"], index["unloaded"]["/prefix-match/"]
    mq, mp = base_["unloaded"]["/query"], base_["unloaded"]["/prefix-match/"]
    common = {"trace_requests": len(requests), "index": index_stats, "answer_bytes": sizes,
              "request_bytes": {path: round(statistics.fmean(map(len, b))) for path, b in bodies.items()},
              "client": "aiohttp ClientSession, one keep-alive connection (unloaded), in its own process"}
    bench._set("index_http_minimal_p50_ms", mq["ms"]["p50"], query=mq, prefix_match=mp)
    bench._set("index_http_minimal_p99_ms", mq["ms"]["p99"])
    bench._set("index_http_query_p50_ms", q["ms"]["p50"], **q, **common)
    bench._set("index_http_query_p99_ms", q["ms"]["p99"])
    bench._set("index_http_prefix_match_p99_ms", p["ms"]["p99"], **p)
    bench._set("index_http_queries_per_s", index["queries_per_s"], rounds=index["loaded"], clients=CLIENTS,
               server_cpu_ms_per_query=index["server_cpu_ms_per_query"])
    bench._set("index_http_minimal_queries_per_s", base_["queries_per_s"], rounds=base_["loaded"],
               server_cpu_ms_per_query=base_["server_cpu_ms_per_query"])
    ratio = index["queries_per_s"] / base_["queries_per_s"] if base_["queries_per_s"] else None
    cpu_ratio = (base_["server_cpu_ms_per_query"] / index["server_cpu_ms_per_query"]
                 if index["server_cpu_ms_per_query"] else None)
    bench._set("index_http_vs_minimal", ratio, cpu_per_query_ratio=cpu_ratio, load_average=_load_average())
    say(f"      index of {len(requests):,} trace requests ({index_stats['blocks']:,} blocks, "
        f"{index_stats['resident_pairs']:,} pairs); answers of {sizes['/query']:,} B (/query) and "
        f"{sizes['/prefix-match/']:,} B (/prefix-match/)")
    say(f"      POST /query unloaded: p50 {q['ms']['p50']:.2f} ms, p99 {q['ms']['p99']:.2f} ms (target p99 <= 2; "
        f"minimal server p50 {mq['ms']['p50']:.2f}, p99 {mq['ms']['p99']:.2f}); {q['answers_with_a_match']:,} of "
        f"{q['ms']['samples']:,} answers matched")
    say(f"      POST /prefix-match/ unloaded: p50 {p['ms']['p50']:.2f} ms, p99 {p['ms']['p99']:.2f} ms (target p99 "
        f"<= 2; minimal server p99 {mp['ms']['p99']:.2f})")
    say(f"      {CLIENTS} clients, /query: {index['queries_per_s']:,.0f} queries/s against the minimal server's "
        f"{base_['queries_per_s']:,.0f}: ratio {ratio:.2f} (target >= 0.5); server cores "
        f"{[r['server_cores'] for r in index['loaded']]} / {[r['server_cores'] for r in base_['loaded']]}, client "
        f"cores {[r['client_cores'] for r in index['loaded']]} / {[r['client_cores'] for r in base_['loaded']]}; "
        f"server CPU per query {index['server_cpu_ms_per_query']:.3f} / {base_['server_cpu_ms_per_query']:.3f} ms "
        f"(minimal / index {cpu_ratio:.2f})")


def _receive(connection, timeout_s: float, who: str):
    """The next message of a client process, or why there is none."""
    if not connection.poll(timeout_s):
        raise TimeoutError(f"{who} said nothing within {timeout_s:.0f}s")
    try:
        return connection.recv()
    except EOFError:
        raise RuntimeError(f"{who} exited") from None


def _not_4xx(statuses: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The answers of ``statuses`` (kind -> status -> count) that break the rule: anything but a 4xx (or, for a
    kind of :data:`MAY_GO_UNANSWERED`, no answer)."""
    wrong = {}
    for kind, counts in statuses.items():
        bad = {status: n for status, n in counts.items() if not ((status.isdigit() and 400 <= int(status) < 500)
                                                                  or (status == "no answer"
                                                                      and kind in MAY_GO_UNANSWERED))}
        if bad:
            wrong[kind] = bad
    return wrong


def _add_counts(total: dict[str, dict[str, int]], more: dict[str, dict[str, int]]) -> None:
    for kind, counts in more.items():
        into = total.setdefault(kind, {})
        for status, n in counts.items():
            into[status] = into.get(status, 0) + n


def _malformed_sizes(quick: bool) -> dict:
    return {"rounds": 3, "round_s": 3.0} if quick else {"rounds": 5, "round_s": 8.0}


def _malformed_part(bench, say) -> None:
    """Part malformed: a well-behaved client's /query p99 alone and while a second client sends 200 malformed bodies
    a second, in interleaved rounds, against a fresh ``serve`` process (the http part's application and trace)."""
    import multiprocessing

    import psutil

    from kvstream.broker import free_port
    from producers.simulator import load_trace

    limit = bench.o.requests
    requests = load_trace(limit=limit)
    bodies = query_bodies(requests)
    chain = prefix_bodies(requests)[0]
    cut = {"/query": bodies[0], "/query_by_hash": chain.replace(b'"block_hashes"', b'"seq_hashes"'),
           "/prefix-match/": chain}
    sizes = _malformed_sizes(bench.o.quick)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = bench.work / "index-malformed-server.log"
    context = multiprocessing.get_context("spawn")
    well_end, well_theirs = context.Pipe()
    bad_end, bad_theirs = context.Pipe()
    server = None
    well = context.Process(target=well_behaved_client, args=(base, bodies, well_theirs), daemon=True)
    bad = context.Process(target=malformed_client, args=(base, MALFORMED_RATE, cut, bad_theirs), daemon=True)

    def check_alive(during: str) -> None:
        if server.poll() is not None:
            raise RuntimeError(f"the index server died {during} (exit code {server.returncode}): "
                               f"{log.read_text(errors='replace')[-800:]}")

    rounds: list[dict] = []
    malformed_ms: dict[str, list[float]] = {}
    try:
        server = _spawn(["serve", "--port", str(port)] + ([] if limit is None else ["--requests", str(limit)]), log)
        _wait_http(base + "/health", server, log, bench.o.timeout_s)
        well.start()
        bad.start()
        well_theirs.close()  # only the clients hold their ends: a client that dies is an EOF here, not a wait
        bad_theirs.close()
        _receive(well_end, 300, "the well-behaved client")
        _, ready = _receive(bad_end, 300, "the malformed client")
        check_alive("while the malformed client sent every body once")
        server_process, bad_process = psutil.Process(server.pid), psutil.Process(bad.pid)

        def cpu(process) -> float:
            times = process.cpu_times()
            return times.user + times.system

        for n in range(sizes["rounds"]):
            for loaded in (False, True):  # interleaved: a slow minute of the machine falls on both
                try:
                    if loaded:
                        bad_end.send("start")
                        _receive(bad_end, 30, "the malformed client")
                        time.sleep(0.5)  # its rate settled before the measured round starts
                    cpu0, bad0, t0 = cpu(server_process), cpu(bad_process), time.perf_counter()
                    well_end.send(sizes["round_s"])
                    found = _receive(well_end, sizes["round_s"] + 120, "the well-behaved client")
                    seconds = time.perf_counter() - t0
                    cpu1, bad1 = cpu(server_process), cpu(bad_process)
                    sent = None
                    if loaded:
                        bad_end.send("stop")
                        sent = _receive(bad_end, 120, "the malformed client")
                except (RuntimeError, TimeoutError, psutil.Error):
                    try:
                        server.wait(5)  # a client failed: the server's exit, if it is exiting, names the cause
                    except subprocess.TimeoutExpired:
                        pass
                    check_alive(f"in round {n + 1} ({'loaded' if loaded else 'alone'})")
                    raise
                check_alive(f"in round {n + 1} ({'loaded' if loaded else 'alone'})")
                if sent is not None:
                    for kind, values in sent.pop("ms").items():
                        malformed_ms.setdefault(kind, []).extend(values)
                rounds.append({"round": n + 1, "malformed": loaded, "p50_ms": found["ms"]["p50"],
                               "p99_ms": found["ms"]["p99"], "max_ms": found["ms"]["max"],
                               "queries": found["ms"]["samples"], "failed": found["failed"],
                               "server_cores": round((cpu1 - cpu0) / seconds, 2),
                               "malformed_client_cores": round((bad1 - bad0) / seconds, 2), "sent": sent})
        well_end.send(None)
        bad_end.send("exit")
        _wait_http(base + "/health", server, log, 10)  # still answering after every round
        check_alive("after the rounds")
    finally:
        for process in (well, bad):
            if process.is_alive():
                process.join(5)
            if process.is_alive():
                process.terminate()
        _stop(server)
    alone = [r["p99_ms"] for r in rounds if not r["malformed"]]
    loaded_ = [r["p99_ms"] for r in rounds if r["malformed"]]
    alone_p99, loaded_p99 = statistics.median(alone), statistics.median(loaded_)
    sent_rounds = [r["sent"] for r in rounds if r["malformed"]]
    statuses: dict[str, dict[str, int]] = {}
    for sent in sent_rounds:
        _add_counts(statuses, sent["statuses"])
    rate = statistics.median(s["sent_per_s"] for s in sent_rounds)
    by_round = [round(loaded_[i] / alone[i], 2) for i in range(len(loaded_))]
    strays = {**_not_4xx(ready["probe"]), **{f"{k} (rounds)": v for k, v in _not_4xx(statuses).items()}}
    failed = sum(r["failed"] for r in rounds)
    bench._set("index_http_query_p99_ms_alone_same_run", alone_p99, p99_ms_by_round=alone,
               round_s=sizes["round_s"], trace_requests=len(requests))
    bench._set("index_http_query_p99_ms_under_malformed", loaded_p99, p99_ms_by_round=loaded_,
               malformed_rate_wanted=MALFORMED_RATE, malformed_achieved_per_s=rate,
               malformed_achieved_per_s_by_round=[s["sent_per_s"] for s in sent_rounds],
               malformed_statuses=statuses,
               # from sending to the answer: what refusing each kind costs the server's one event loop
               malformed_ms_by_kind={kind: _summary(v, 1) for kind, v in malformed_ms.items()},
               probe_statuses=ready["probe"], mix_per_200=MALFORMED_MIX, variants=ready["variants"],
               mean_body_bytes=ready["bytes"], in_flight_limit=MALFORMED_IN_FLIGHT, not_4xx=strays,
               well_behaved_failed=failed, rounds=rounds, round_s=sizes["round_s"], load_average=_load_average())
    bench._set("index_http_malformed_p99_ratio", loaded_p99 / alone_p99 if alone_p99 else None,
               by_round=by_round)
    answered = sum(sum(c.values()) for c in statuses.values())
    say(f"      POST /query one at a time, {sizes['rounds']} rounds of {sizes['round_s']:.0f}s each way: p99 alone "
        f"{alone} ms, under malformed bodies {loaded_} ms; medians {alone_p99:.2f} / {loaded_p99:.2f} ms: ratio "
        f"{loaded_p99 / alone_p99:.2f} (by round {by_round}); queries per round "
        f"{[r['queries'] for r in rounds if not r['malformed']]} / {[r['queries'] for r in rounds if r['malformed']]}")
    say(f"      malformed client: {rate:,.0f} bodies/s (wanted {MALFORMED_RATE}; by round "
        f"{[s['sent_per_s'] for s in sent_rounds]}), {answered:,} answers: "
        + ", ".join(f"{kind} {counts}" for kind, counts in statuses.items())
        + f"; server cores alone / loaded {[r['server_cores'] for r in rounds if not r['malformed']]} / "
          f"{[r['server_cores'] for r in rounds if r['malformed']]}")
    if strays or failed:
        raise RuntimeError(f"answers other than a 4xx: {strays}" if strays else
                           f"{failed} of the well-behaved client's queries were not answered 200")


def _embedded_and_mixed(bench, say) -> None:
    """Parts 2 and 3, each in a fresh process."""
    calls = 5000 if bench.o.quick else 20_000
    found = in_fresh_process(embedded_part, bench.o.requests, calls)
    pm, qh, qt = found["prefix_match_us"], found["query_hashes_us"], found["query_tokens_us"]
    bench._set("index_embedded_prefix_match_p99_us", pm["p99"], **found)
    bench._set("index_embedded_query_hashes_p99_us", qh["p99"])
    say(f"      embedded, {found['chains']:,} chains of {CHAIN_BLOCKS} blocks ({found['chains_matched_whole']:,} held "
        f"whole): prefix_match p50 {pm['p50']:.1f} µs, p99 {pm['p99']:.1f} µs; query_hashes p50 {qh['p50']:.1f} µs, "
        f"p99 {qh['p99']:.1f} µs (target p99 <= 100); query_tokens of 4,096 tokens p50 {qt['p50']:.1f} µs, p99 "
        f"{qt['p99']:.1f} µs")
    ops = 200_000 if bench.o.quick else 1_000_000
    mixed = in_fresh_process(mixed_part, bench.o.requests, ops, bench.o.latency_rate, 5.0 if bench.o.quick else 10.0)
    full, paced, alone = mixed["full_speed"], mixed["paced"], mixed["writer_alone"]
    bench._set("index_mixed_block_ops_per_s", full["ops_per_s"], **mixed)
    bench._set("index_mixed_query_p99_us", full["query_us"]["p99"])
    say(f"      mixed: {full['ops']:,} entries ({mixed['tombstones']:,} tombstones) at {full['ops_per_s']:,} block "
        f"ops/s (alone: {alone['ops_per_s']:,}) while {full['queries']:,} query_hashes ran ({full['queries_per_s']:,}"
        f"/s): p50 {full['query_us']['p50']:.1f} µs, p99 {full['query_us']['p99']:.1f} µs (no writes: "
        f"{qh['p99']:.1f}); writer paced at {paced['rate']:,}/s: query p99 {paced['query_us']['p99']:.1f} µs")


def _memory(bench, say) -> None:
    """Part 4, in a fresh process."""
    found = in_fresh_process(memory_part, bench.o.index_pairs, 5000 if bench.o.quick else 20_000)
    scale = TEN_MILLION / found["pairs"]
    rss_10m = found["rss_growth_bytes"] * scale / 2**20
    bench._set("index_bytes_per_pair", found["bytes_per_pair"], **found)
    bench._set("index_rss_mib_10m_pairs", rss_10m, measured_pairs=found["pairs"],
               measured_rss_growth_mib=round(found["rss_growth_bytes"] / 2**20, 1), scaled=scale != 1,
               table_mib_10m_pairs=round(found["memory_bytes"] * scale / 2**20, 1))
    say(f"      {found['pairs']:,} pairs ({found['blocks']:,} blocks): {found['bytes_per_pair']:.1f} B/pair in the "
        f"table (target <= 100), RSS +{found['rss_growth_bytes'] / 2**20:,.0f} MiB"
        + (f", {rss_10m:,.0f} MiB per 10M pairs scaled" if scale != 1 else "")
        + f" (target <= 1,024); built at {found['apply_entries_per_s']:,} apply_entry/s; at this size prefix_match "
          f"p99 {found['prefix_match_us']['p99']:.1f} µs, query_hashes p99 {found['query_hashes_us']['p99']:.1f} µs")


def _catch_up(bench, say) -> None:
    """Part 5: write the changelog here, read it in a fresh process."""
    from schemas.topics import TopicNames

    app_id = "bench-index-catch-up"
    topic = TopicNames(app_id).changelog("residency")
    entries = bench.o.index_rows // ROWS_PER_ENTRY
    written = produce_changelog(bench.bootstrap, topic, entries, bench.o.partitions)
    say(f"      {topic}: {written['entries']:,} entries ({written['rows']:,} rows, {written['mean_value_bytes']:.0f} B "
        f"a value, residency v{written['schema_version']}) written in {written['seconds']:.0f}s")
    read = in_fresh_process(catch_up_part, bench.bootstrap, app_id, bench.o.timeout_s)
    rows = written["rows"]
    scaled = read["catch_up_s"] * TEN_MILLION / rows
    bench._set("index_catch_up_s_10m_rows", scaled, measured_rows=rows, measured_s=round(read["catch_up_s"], 2),
               extrapolated=rows < TEN_MILLION, records_per_s=round(read["records"] / read["catch_up_s"]),
               written=written, read=read)
    say(f"      fresh feed caught up on {read['records']:,} records ({read['pairs']:,} pairs) in "
        f"{read['catch_up_s']:.1f}s: {read['records'] / read['catch_up_s']:,.0f} records/s"
        + (f"; {scaled:,.0f}s for 10M rows, extrapolated linearly from {rows:,}" if rows < TEN_MILLION else "")
        + " (target <= 30 s)")


#: First repetition of the trace the freshness part sends (block ids shifted by it << 40): past the latency step's
#: (1000 on), so its blocks are ones no other step wrote.
FRESHNESS_REPETITION = 2000


#: Block events sent at full speed into the fresh worker before the steady rate (quick: a fifth): a worker
#: that has just started takes tens of seconds to settle (the latency step's worker has consumed the stream
#: steps' input before its steady rate).
FRESHNESS_WARM_EVENTS = 100_000


def _freshness_events(bench, total: int, repetition: int = FRESHNESS_REPETITION) -> list[tuple]:
    """The simulator's events of the trace shifted by ``repetition`` (and the next ones), at least ``total``
    block events."""
    from bench.run import _fleet_batches, _shifted

    events: list[tuple] = []
    blocks = 0
    while blocks < total:
        batches, _ = _fleet_batches(_shifted(bench._trace_requests(), repetition), None, repetition)
        for b in batches:
            for i, e in enumerate(b.events):
                events.append((b.publisher, b.seq, i, e))
                blocks += len(e.get("block_hashes") or ()) or 1
        repetition += 1
    return events


def _table_changes(bench, topic: str) -> dict[str, float]:
    """Per residency key, the Kafka timestamp (s) of its first record in the worker's kv-residency-changes: when
    the worker applied the key's first event to its table."""
    from kafka_io.reader import messages_to_end
    from schemas import AvroCodec

    codec = AvroCodec("residency_change")
    first: dict[str, float] = {}
    for message in messages_to_end(bench.bootstrap, topic, bench.o.timeout_s):
        change = codec.decode(message.value())
        key = f"{change['ownership'] or 'primary'}/{change['block_hash'].hex()}"
        stamp = message.timestamp()[1] / 1000.0
        if stamp < first.get(key, math.inf):
            first[key] = stamp
    return first


def _freshness(bench, say) -> None:
    """Part 6 (and part 1 against its worker): a steady rate into a worker; an index replica's first sight of
    each block, split where the worker applied it to its table."""
    import multiprocessing

    from bench.run import LATENCY_WARMUP_S
    from kafka_io.admin import ensure_topics
    from schemas.topics import TopicNames

    prefix, app_id = "index.", "bench-index"
    topics = TopicNames(app_id, prefix)
    ensure_topics(bench.bootstrap, {topics.kv_events: bench.o.partitions})
    rate, measured_s = bench.o.latency_rate, bench.o.latency_s
    total = int(rate * (LATENCY_WARMUP_S + measured_s))
    events = _freshness_events(bench, total)
    # residency changes on: their timestamps split each delay at the worker's table (as the latency step's)
    group = bench._workers(app_id, bench.work, store="memory://", partitions=bench.o.partitions, topic_prefix=prefix,
                           residency_changes=True)
    group.start(1)
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    replica = context.Process(target=replica_part, args=(bench.bootstrap, app_id, prefix, theirs), daemon=True)
    try:
        base = f"http://127.0.0.1:{group.ports[0]}"
        group.wait_ready(bench.o.timeout_s)  # assigned, recovered, its changelog topics created
        replica.start()
        answer = ours.recv() if ours.poll(300) else "no answer within 300 s"
        if answer != "ready":
            raise RuntimeError(f"the index replica did not catch up: {answer}")
        producer = bench._kv_producer(topics.kv_events)
        warm = FRESHNESS_WARM_EVENTS // (5 if bench.o.quick else 1)
        warmed = 0
        for publisher, seq, batch_index, event in _freshness_events(bench, warm, FRESHNESS_REPETITION - 1):
            warmed += producer.send_event(publisher, seq, time.time(), batch_index, event)
            if warmed >= warm:
                break
        warm_started = time.perf_counter()
        group.wait_consumed(producer.flush().acked, bench.o.timeout_s, "index freshness warm-up")
        warm_s = time.perf_counter() - warm_started
        first_store: dict[str, float] = {}
        sent = position = 0
        t0 = time.perf_counter()
        began = time.time()
        while sent < total and position < len(events):
            due = int((time.perf_counter() - t0) * rate)
            while sent < min(due, total) and position < len(events):
                publisher, seq, batch_index, event = events[position]
                position += 1
                ts = time.time()
                sent += producer.send_event(publisher, seq, ts, batch_index, event)
                if event["type"] == "BlockStored":
                    scope = event.get("ownership") or "primary"
                    for block_hash in event["block_hashes"]:
                        first_store.setdefault(f"{scope}/{(block_hash & _U64).to_bytes(8, 'big').hex()}", ts)
            producer.poll()
            time.sleep(0.002)
        produced_s = time.perf_counter() - t0
        acked = producer.flush().acked  # cumulative: the warm-up's too
        t_flushed = time.perf_counter()
        group.wait_consumed(acked, bench.o.timeout_s, "index freshness")
        behind_s = time.perf_counter() - t_flushed
        time.sleep(2.0)  # past the worker's changelog interval and the replica's next poll
        ours.send("stop")
        seen = ours.recv()
        replica.join(30)
        applied = _table_changes(bench, topics.residency_changes)
        measured = {key: ts for key, ts in first_store.items() if ts >= began + LATENCY_WARMUP_S}
        seen_at = seen["seen"]
        delays = sorted((seen_at[key] - ts) * 1000 for key, ts in measured.items() if key in seen_at)
        if not delays:
            raise RuntimeError("the replica saw none of the measured blocks")
        to_table = [(applied[key] - ts) * 1000 for key, ts in measured.items() if key in applied and key in seen_at]
        after_table = [(seen_at[key] - applied[key]) * 1000 for key in measured if key in applied and key in seen_at]
        windows: dict[int, list[float]] = {}
        for key, ts in first_store.items():
            if key in seen_at:
                windows.setdefault(int((ts - began) // 5), []).append((seen_at[key] - ts) * 1000)
        p50, p99 = _percentile(delays, 0.5), _percentile(delays, 0.99)
        halves = {name: None if not values else [round(_percentile(sorted(values), q), 1) for q in (0.5, 0.99)]
                  for name, values in (("to_table_ms", to_table), ("table_to_replica_ms", after_table))}
        details = {"blocks": len(measured), "missing": len(measured) - len(delays), "events": sent,
                   "achieved_rate": round(sent / produced_s), "seconds": round(produced_s, 1),
                   "max_ms": round(delays[-1], 1), "mean_ms": round(statistics.fmean(delays), 1),
                   # growing windows: the worker fell behind the rate (behind_s: its catch-up after the last event)
                   "p99_ms_per_5s": [round(_percentile(sorted(w), 0.99)) for _, w in sorted(windows.items())],
                   "worker_behind_at_end_s": round(behind_s, 1), **halves,
                   "warm_events": warmed, "warm_consumed_s": round(warm_s, 1),
                   "replica_records": seen["records"], "warmup_s": LATENCY_WARMUP_S, "load_average": _load_average()}
        bench._set("index_changelog_freshness_p50_ms", p50, **details)
        bench._set("index_changelog_freshness_p99_ms", p99)
        say(f"      {sent:,} events at {sent / produced_s:,.0f}/s; {len(delays):,} blocks seen by the replica "
            f"({details['missing']:,} never): p50 {p50:,.0f} ms, p99 {p99:,.0f} ms, max {delays[-1]:,.0f} ms "
            f"(the changelog path alone); p50/p99 to the worker's table {halves['to_table_ms']}, from there to the "
            f"replica {halves['table_to_replica_ms']}; p99 per 5 s {details['p99_ms_per_5s']}")
        shift = FRESHNESS_REPETITION << 40
        sent_ids = [i for i, r in enumerate(bench._trace_requests()) if len(r.hash_ids) >= PROMPT_BLOCKS
                    and all(_key(block_bytes(h + shift)) in first_store for h in r.hash_ids[:PROMPT_BLOCKS])]
        instances = sorted({publisher.instance_id for publisher, _, _, _ in events[:position]})
        _worker_http(bench, say, base, group.processes[0].pid, sent_ids[:4 * PROMPTS], instances)
    finally:
        if replica.is_alive():
            replica.terminate()
        group.stop()


def _worker_http(bench, say, base: str, pid: int, request_ids: list[int], instances: list[str]) -> None:
    """Part 1 against the freshness worker: prompts of requests whose first 8 blocks it was sent, its instances
    registered with their 512-token blocks first (as a router registers them; an instance that registered none
    counts as of 16-token blocks, and a query of 512-token blocks would match none of it)."""
    from producers.simulator import TRACE_BLOCK_SIZE

    if not request_ids:
        raise RuntimeError("no trace request had its first 8 blocks sent to the worker")
    for instance in instances:
        body = json.dumps({"instance_id": instance, "block_size": TRACE_BLOCK_SIZE, "dp_rank": 0,
                           "type": "vLLM"}).encode()
        _post_size(base + "/register", body)
    spec = {"requests": bench.o.requests, "request_ids": request_ids, "shift": FRESHNESS_REPETITION << 40,
            "clients": CLIENTS, **_load_sizes(True), "targets": {"worker": {"base": base, "pid": pid}}}
    found = _run_load_client(bench, spec, "worker")["worker"]
    q, p = found["unloaded"]["/query"], found["unloaded"]["/prefix-match/"]
    bench._set("index_worker_query_p99_ms", q["ms"]["p99"], query=q, prefix_match=p,
               queries_per_s=found["queries_per_s"], rounds=found["loaded"])
    say(f"      the worker's POST /query: p50 {q['ms']['p50']:.2f} ms, p99 {q['ms']['p99']:.2f} ms "
        f"({q['answers_with_a_match']:,} of {q['ms']['samples']:,} matched); /prefix-match/ p99 "
        f"{p['ms']['p99']:.2f} ms ({p['answers_with_a_match']:,} matched); {CLIENTS} clients "
        f"{found['queries_per_s']:,.0f} queries/s")


#: The step's parts in run order: (name, function). The last two need the broker.
PARTS = (("http", _http_part), ("malformed", _malformed_part), ("embedded", _embedded_and_mixed), ("memory", _memory),
         ("catch-up", _catch_up), ("changelog-freshness", _freshness), ("freshness", freshness_part))


def run_step(bench, say) -> None:
    """The ``index`` step of ``bench.run.Bench``: every part, each failure recorded and the others run.

    Raises:
        RuntimeError: some part failed (each one's error in the message; its figures stay null).
    """
    errors = []
    bench.results["details"]["index_load_average"] = {"start": _load_average()}
    for name, part in PARTS:
        if bench.o.index_parts is not None and name not in bench.o.index_parts:
            continue
        say(f"    [{name}]")
        started = time.perf_counter()
        try:
            part(bench, say)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # one part's failure keeps the others' figures
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            say(f"      {name} FAILED: {type(exc).__name__}: {exc}")
        bench.results["details"].setdefault("index_part_seconds", {})[name] = round(time.perf_counter() - started, 1)
        bench._write()
    bench.results["details"]["index_load_average"]["end"] = _load_average()
    bench._write()
    if errors:
        raise RuntimeError("; ".join(errors))


# --------------------------------------------------------------------------- command line of the processes

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.index_bench", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="kvstream index's application over the trace (filled directly)")
    serve.add_argument("--port", type=int, required=True)
    serve.add_argument("--requests", type=int, default=None, help="trace requests held (default: all)")
    minimal = commands.add_parser("minimal", help="the baseline: constant answers of the given sizes")
    minimal.add_argument("--port", type=int, required=True)
    minimal.add_argument("--query-bytes", type=int, required=True)
    minimal.add_argument("--prefix-bytes", type=int, required=True)
    load = commands.add_parser("load", help="the load client: a spec file in, a results file out")
    load.add_argument("--spec", type=Path, required=True)
    load.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve_index(args.port, args.requests)
    elif args.command == "minimal":
        serve_minimal(args.port, args.query_bytes, args.prefix_bytes)
    else:
        args.out.write_text(json.dumps(run_load(json.loads(args.spec.read_text()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
