"""The worker's HTTP views (docs/querying.md): residency of a block, prefix match, occupancy, sources, stats.

Every view answers for the whole fleet: a lookup of a key held by another worker is forwarded to that worker
(Faust's router, ``GET /residency-key/{key}/``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from typing import Callable
from urllib.parse import quote

import aiohttp
import faust

from schemas import InvalidBlockHash, parse_hex_block_hash
from stream_apps.applier import Materializer
from stream_apps.residency import key_partition, prefix_match, residency_key
from stream_apps.tables import Tables

#: Limits of POST /prefix-match/: request body bytes and block hashes per request.
MAX_REQUEST_BYTES = 256 * 1024
MAX_PREFIX_BLOCKS = 2048


def occupancy_rows(tables: Tables) -> list[dict]:
    """Resident blocks per (ownership, tier, instance), summed over partitions, sorted."""
    totals: dict[tuple, int] = defaultdict(int)
    for value in tables.tier_occupancy.values():
        totals[(value["ownership"] or "", value["tier"], value["instance_id"])] += value["resident_blocks"]
    return [{"ownership": own or None, "tier": tier, "instance_id": inst, "resident_blocks": n}
            for (own, tier, inst), n in sorted(totals.items()) if n]


def known_ownerships(tables: Tables) -> set[str | None]:
    """Ownerships with resident blocks anywhere (None = primary), from the global occupancy table."""
    return {None} | {value["ownership"] for value in tables.tier_occupancy.values()}


def source_rows(tables: Tables, now: float | None = None) -> list[dict]:
    """One status per publisher, merged over partitions, sorted.

    Source-wide facts (epoch, restarts, stale) come from the partition copy with the newest epoch and most
    restarts; ``events_applied`` is the sum over partitions, ``last_event_ts`` and ``last_seq`` the newest.
    ``lag_s`` is ``now`` minus ``last_event_ts`` (the engine's clock against this worker's).
    """
    now = time.time() if now is None else now
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for status in tables.sources.values():
        groups[(status["instance_id"], status["data_parallel_rank"], status["worker_rank"])].append(status)
    rows = []
    for _, copies in sorted(groups.items()):
        facts = max(copies, key=lambda c: (c["publisher_epoch"], c["restarts"]))
        newest = max(copies, key=lambda c: c["last_event_ts"] or 0.0)
        last_ts = newest["last_event_ts"]
        rows.append({**facts, "worker_rank": None if facts["worker_rank"] < 0 else facts["worker_rank"],
                     "events_applied": sum(c["events_applied"] for c in copies), "last_event_ts": last_ts,
                     "last_seq": newest["last_seq"], "lag_s": None if last_ts is None else round(now - last_ts, 3)})
    return rows


def _row_json(ownership: str | None, row: dict) -> dict:
    return {"ownership": ownership, "instance_id": row["instance_id"],
            "data_parallel_rank": row["data_parallel_rank"], "tier": row["tier"], "medium": row["medium"],
            "locality": row["locality"], "group_idx": row["group_idx"], "copies": row["copies"],
            "since": row["since"], "last_ts": row["last_ts"],
            "workers": [{"worker_rank": None if w["worker_rank"] < 0 else w["worker_rank"], "count": w["count"],
                         "publisher_epoch": w["publisher_epoch"], "last_seq": w["seq"]} for w in row["workers"]]}


class _BadRequest(ValueError):
    """A request the API refuses (HTTP 400); the message is the reason."""


def _prefix_request(body: bytes) -> list[bytes]:
    if len(body) > MAX_REQUEST_BYTES:
        raise _BadRequest(f"request body of {len(body)} bytes (limit {MAX_REQUEST_BYTES})")
    try:
        request = json.loads(body)
    except ValueError:
        raise _BadRequest("request body is not JSON") from None
    hashes = request.get("block_hashes") if isinstance(request, dict) else None
    if not isinstance(hashes, list) or not hashes or not all(isinstance(h, str) for h in hashes):
        raise _BadRequest('expected {"block_hashes": ["<hex>", ...]} with at least one hash')
    if len(hashes) > MAX_PREFIX_BLOCKS:
        raise _BadRequest(f"{len(hashes)} block hashes (limit {MAX_PREFIX_BLOCKS})")
    try:
        return [parse_hex_block_hash(h) for h in hashes]
    except InvalidBlockHash as exc:
        raise _BadRequest(str(exc)) from None


async def _read_body(request, limit: int) -> bytes:
    """The request body, or its first ``limit`` bytes if it is longer (``content.read(n)`` alone returns what
    has arrived so far, which under load is part of the body)."""
    body = bytearray()
    while len(body) < limit:
        chunk = await request.content.read(limit - len(body))
        if not chunk:
            break
        body += chunk
    return bytes(body)


def register_views(app: faust.App, tables: Tables, materializer: Materializer, weights: dict[str, float],
                   counters: Callable[[], dict[str, int]]) -> None:
    """Declare the HTTP views on ``app``.

    Args:
        weights: tier weights of the prefix match.
        counters: this worker's event counters (``/stats/``), including the repartition process's.
    """
    residency = tables.residency
    store = tables.residency_store
    partitions = residency.partitions

    def entry_json(key: str) -> list[dict]:
        """Resident rows of one local residency key, as JSON-ready dicts."""
        entry = store.lookup(key, key_partition(key, partitions))
        if entry is None:
            return []
        return [_row_json(entry["ownership"], row) for row in entry["rows"] if row["copies"] > 0]

    async def lookup(key: str) -> list[dict]:
        url = app.router.key_store(residency.name, key)
        if (url.host, url.port) == (app.conf.canonical_url.host, app.conf.canonical_url.port):
            return entry_json(key)
        async with app.http_client.get(url.with_path(f"/residency-key/{quote(key, safe='/')}/")) as response:
            response.raise_for_status()
            return (await response.json())["rows"]

    async def block_rows(block_hash: bytes) -> list[dict]:
        """Resident rows of one block over all ownerships, from whichever workers hold them."""
        keys = [residency_key(own, block_hash) for own in sorted(known_ownerships(tables), key=lambda o: o or "")]
        parts = await asyncio.gather(*(lookup(key) for key in keys))
        return [row for part in parts for row in part]

    @app.page("/residency-key/{key:.+/[0-9a-f]+}/")
    @app.table_route(table=residency, match_info="key")
    async def residency_key_view(web, request, key: str):
        """Internal: resident rows of one table key, answered by the worker that holds it."""
        return web.json({"rows": entry_json(key)})

    @app.page("/residency/{block_hash_hex}/")
    async def residency_view(web, request, block_hash_hex: str):
        """Every resident row of a block, over all ownerships, and the freshness of each source holding it:
        ``{"block_hash": hex, "rows": [...], "sources": [{..., "last_event_ts", "lag_s", "stale"}]}``."""
        try:
            block_hash = parse_hex_block_hash(block_hash_hex)
        except InvalidBlockHash as exc:
            return web.json({"error": str(exc)}, status=400)
        try:
            rows = await block_rows(block_hash)
        except (aiohttp.ClientError, OSError, KeyError) as exc:  # the owner is gone or not yet assigned
            return web.json({"error": f"the worker holding this block did not answer ({type(exc).__name__}); "
                                      "the group is probably rebalancing: retry"}, status=503)
        holders = {(row["instance_id"], row["data_parallel_rank"]) for row in rows}
        freshness = [{name: source[name] for name in ("instance_id", "data_parallel_rank", "worker_rank",
                                                      "publisher_epoch", "last_event_ts", "lag_s", "stale")}
                     for source in source_rows(tables)
                     if (source["instance_id"], source["data_parallel_rank"]) in holders]
        return web.json({"block_hash": block_hash.hex(), "rows": rows, "sources": freshness})

    @app.page("/prefix-match/")
    class PrefixMatchView(faust.web.View):
        """``POST /prefix-match/`` with ``{"block_hashes": [hex, ...]}`` (prefix order): per (instance, dp rank)
        the longest consecutive prefix resident on each tier and a tier-weighted score, best first."""

        async def post(self, request):
            body = await _read_body(request, MAX_REQUEST_BYTES + 1)
            try:
                hashes = _prefix_request(body)
            except _BadRequest as exc:
                return self.json({"error": str(exc)}, status=400)
            try:
                rows = await asyncio.gather(*(block_rows(h) for h in hashes))
            except (aiohttp.ClientError, OSError, KeyError) as exc:
                return self.json({"error": f"a worker did not answer ({type(exc).__name__}); the group is "
                                           "probably rebalancing: retry"}, status=503)
            return self.json({"block_count": len(hashes), "weights": weights,
                              "matches": prefix_match(rows, weights)})

    @app.page("/occupancy/")
    async def occupancy_view(web, request):
        """Resident blocks per (ownership, tier, instance): ``{"occupancy": [...]}``."""
        return web.json({"occupancy": occupancy_rows(tables)})

    @app.page("/sources/")
    async def sources_view(web, request):
        """Per publisher: epoch, restarts, stale and the last lost seqs: ``{"sources": [...]}``."""
        return web.json({"sources": source_rows(tables)})

    @app.page("/stats/")
    async def stats_view(web, request):
        """This worker's counters: events re-keyed and materialized, duplicates, unknown removals, dead letters."""
        stats = materializer.stats
        return web.json({**counters(), "applied": stats.applied, "duplicates": stats.duplicates,
                         "cleared_late": stats.cleared_late, "retired_late": stats.retired_late,
                         "unknown_removals": stats.unknown_removals, "unknown_parents": stats.unknown_parents,
                         "became_resident": stats.became_resident, "stopped_resident": stats.stopped_resident,
                         "unknown_media": stats.unknown_media})
