"""The worker's HTTP views (docs/querying.md): residency of a block, prefix match, occupancy, sources, stats,
and the router APIs of the fleet index (``/query``, ``/query_by_hash``, ``/register``, ``/workers``, ``/dump``).

Every view answers for the whole fleet. Prefix matches and the router APIs answer from the worker's own fleet
index (:mod:`stream_apps.index`), without a network hop. ``GET /residency/{hash}/`` gives the full rows (copies,
per-worker counts, since), which only the worker holding the key has: it looks the block up under every
ownership seen and forwards the lookups of keys other workers hold to them (Faust's router,
``GET /residency-key/{key}/``).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from urllib.parse import quote

import aiohttp
import faust

from schemas import InvalidBlockHash, parse_block_hash
from stream_apps.applier import Materializer
from stream_apps.fleet import known_ownerships, occupancy_rows, source_rows
from stream_apps.health import Readiness
from stream_apps.index.api import IndexAPI, Reply
from stream_apps.index.fleet_index import FleetIndex
from stream_apps.metrics import WorkerMetrics
from stream_apps.residency import key_partition, residency_key
from stream_apps.tables import Tables

#: Limits of POST /prefix-match/: request body bytes and block hashes per request.
MAX_REQUEST_BYTES = 256 * 1024
MAX_PREFIX_BLOCKS = 2048
#: Largest body the router APIs read; a longer one is cut there and refused by the API as too long.
MAX_INDEX_REQUEST_BYTES = 8 << 20 + 1


def _row_json(ownership: str | None, row: dict) -> dict:
    return {"ownership": ownership, "instance_id": row["instance_id"],
            "data_parallel_rank": row["data_parallel_rank"], "tier": row["tier"], "medium": row["medium"],
            "locality": row["locality"], "group_idx": row["group_idx"], "copies": row["copies"],
            "since": row["since"], "last_ts": row["last_ts"],
            "workers": [{"worker_rank": None if w["worker_rank"] < 0 else w["worker_rank"], "count": w["count"],
                         "publisher_epoch": w["publisher_epoch"], "last_seq": w["seq"]} for w in row["workers"]]}


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


def register_views(app: faust.App, tables: Tables, materializer: Materializer, index: FleetIndex,
                   index_not_ready: Callable[[], list[str]], counters: Callable[[], dict[str, int]],
                   readiness: Readiness, metrics: WorkerMetrics,
                   unregister: Callable[[str, int | None, str], None] | None = None,
                   registrations=None) -> None:
    """Declare the HTTP views on ``app``.

    Args:
        index: the worker's fleet index, which prefix matches and the router APIs answer from.
        index_not_ready: why the index may not answer yet (its feed has not caught up).
        unregister: writes a ``SourceUnregistered`` of (instance, rank or None, reason) to kv-events
            (``POST /unregister``).
        registrations: writes ``POST /register`` and ``/unregister`` to ``kv-instances``
            (:class:`~stream_apps.index.registrations.RegistrationWriter`), so every process has them.
        counters: this worker's event counters (``/stats/``), including the repartition process's.
        readiness: the conditions of ``GET /ready``; lookups answer 503 until they hold.
        metrics: ``GET /metrics``; every view's answers are counted there.
    """
    residency = tables.residency

    def counted(view: str):
        """Count the view's answers by status (``kvstream_http_requests_total``)."""
        def decorate(handler):
            @functools.wraps(handler)
            async def wrapper(*args, **kwargs):
                response = await handler(*args, **kwargs)
                metrics.http_requests[(view, response.status)] += 1
                return response
            return wrapper
        return decorate

    def not_ready(web):
        """A 503 with the reasons, or None when the worker is ready for lookups of its tables (``/residency/``
        reads the tables, not the index, so it does not wait for the index to catch up)."""
        reasons = readiness.reasons()
        if not reasons:
            return None
        return web.json({"error": f"not ready: {'; '.join(reasons)}; retry", "reasons": reasons}, status=503)
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
        """Resident rows of one block over all ownerships, from whichever workers hold them (the tables, not the
        index: this view is exact as of the workers' last write, and gives what the index does not keep)."""
        keys = [residency_key(own, block_hash) for own in sorted(known_ownerships(tables), key=lambda o: o or "")]
        parts = await asyncio.gather(*(lookup(key) for key in keys))
        return [row for part in parts for row in part]

    @app.page("/residency-key/{key:.+/[0-9a-f]+}/")
    @app.table_route(table=residency, match_info="key")
    async def residency_key_view(web, request, key: str):
        """Internal: resident rows of one table key, answered by the worker that holds it."""
        return web.json({"rows": entry_json(key)})

    @app.page("/residency/{block_hash_hex}")
    @counted("residency")
    async def residency_no_slash_view(web, request, block_hash_hex: str):
        """``GET /residency/{hash}`` without the trailing slash: the same view (routers write it so)."""
        return await residency_answer(web, block_hash_hex)

    @app.page("/residency/{block_hash_hex}/")
    @counted("residency")
    async def residency_view(web, request, block_hash_hex: str):
        """Every resident row of a block, over all ownerships, and the freshness of each source holding it."""
        return await residency_answer(web, block_hash_hex)

    async def residency_answer(web, block_hash_hex: str):
        """Every resident row of a block, over all ownerships, of the sources that are live, and the freshness of
        each source holding it: ``{"block_hash": hex, "rows": [...], "sources": [{..., "last_event_ts", "lag_s",
        "stale"}]}``."""
        try:
            block_hash = parse_block_hash(block_hash_hex)
        except InvalidBlockHash as exc:
            return web.json({"error": str(exc)}, status=400)
        if (refusal := not_ready(web)) is not None:
            return refusal
        try:
            rows = await block_rows(block_hash)
        except (aiohttp.ClientError, OSError, KeyError) as exc:  # the owner is gone or not yet assigned
            return web.json({"error": f"the worker holding this block did not answer ({type(exc).__name__}); "
                                      "the group is probably rebalancing: retry"}, status=503)
        down = index.leases.down() if index.leases is not None else frozenset()
        if down:  # a source whose lease lapsed answers nothing: its rows are kept, not shown
            rows = [row for row in rows if (row["instance_id"], row["data_parallel_rank"]) not in down]
        holders = {(row["instance_id"], row["data_parallel_rank"]) for row in rows}
        freshness = [{name: source[name] for name in ("instance_id", "data_parallel_rank", "worker_rank",
                                                      "publisher_epoch", "last_event_ts", "lag_s", "stale")}
                     for source in source_rows(tables)
                     if (source["instance_id"], source["data_parallel_rank"]) in holders]
        return web.json({"block_hash": block_hash.hex(), "rows": rows, "sources": freshness})

    api = IndexAPI(index, lambda: readiness.reasons() + index_not_ready(),
                   prefix_match_limits=(MAX_REQUEST_BYTES, MAX_PREFIX_BLOCKS), on_unregister=unregister,
                   registrations=registrations)

    def reply(web, answer: Reply):
        return web.bytes(answer.body, content_type=answer.content_type, status=answer.status)

    def post_view(path: str, name: str, handler) -> None:
        """``POST path`` (with and without its trailing slash) answered by an :class:`IndexAPI` handler."""
        class IndexView(faust.web.View):
            @counted(name)
            async def post(self, request):
                body = await _read_body(request, MAX_INDEX_REQUEST_BYTES)
                return reply(self, handler(body, request.headers.get("Content-Type"), request.headers.get("Accept")))
        IndexView.__name__ = IndexView.__qualname__ = f"{name.title().replace('-', '').replace('_', '')}View"
        IndexView.__doc__ = handler.__doc__
        app.page(path)(IndexView)
        app.page(path.rstrip("/") + ("" if path.endswith("/") else "/"))(type(IndexView.__name__ + "Slash",
                                                                              (IndexView,), {}))

    post_view("/prefix-match/", "prefix-match", api.prefix_match)
    post_view("/query", "query", api.query)
    post_view("/query_by_hash", "query_by_hash", api.query_by_hash)
    post_view("/register", "register", api.register)
    post_view("/unregister", "unregister", api.unregister)

    @app.page("/workers")
    @counted("workers")
    async def workers_view(web, request):
        """Every instance and data-parallel rank the index knows, with its blocks per tier."""
        return reply(web, api.workers(request.headers.get("Accept")))

    @app.page("/dump")
    @counted("dump")
    async def dump_view(web, request):
        """The whole index as JSON lines, one block per line."""
        return web.bytes(b"".join(api.dump()), content_type="application/x-ndjson")

    @app.page("/occupancy/")
    @counted("occupancy")
    async def occupancy_view(web, request):
        """Resident blocks per (ownership, tier, instance), each row saying whether its instance is live (a row
        of a source whose lease lapsed is counted apart: ``live`` false), and whether the workers have consumed
        their input: ``{"occupancy": [...], "caught_up": bool, "lag": n, "lag_by_topic": {...}}``
        (docs/querying.md)."""
        lag = await metrics.input_lag.reading()  # first: the rows are then at least as new as the reading
        states = index.leases.states() if index.leases is not None else {}
        live_instances = {instance for (instance, _), state in states.items() if state.live}
        known_instances = {instance for instance, _ in states}
        rows = [{**row, "live": row["instance_id"] in live_instances if row["instance_id"] in known_instances
                 else None} for row in occupancy_rows(tables)]
        return web.json({"occupancy": rows, **lag.json()})

    @app.page("/sources/")
    @counted("sources")
    async def sources_view(web, request):
        """Per publisher: epoch, restarts, stale, the last lost seqs, lags; and whether the workers have consumed
        their input: ``{"sources": [...], "caught_up": bool, "lag": n, "lag_by_topic": {...}}``."""
        lag = await metrics.input_lag.reading()
        return web.json({"sources": source_rows(tables), **lag.json()})

    @app.page("/stats/")
    @counted("stats")
    async def stats_view(web, request):
        """This worker's counters: events re-keyed and materialized, duplicates, unknown removals, dead letters."""
        stats = materializer.stats
        return web.json({**counters(), "applied": stats.applied, "duplicates": stats.duplicates,
                         "cleared_late": stats.cleared_late, "retired_late": stats.retired_late,
                         "unknown_removals": stats.unknown_removals, "unknown_parents": stats.unknown_parents,
                         "replica_disagreements": stats.replica_disagreements, "reuse_reports": stats.reuse_reports,
                         "became_resident": stats.became_resident, "stopped_resident": stats.stopped_resident,
                         "unknown_media": stats.unknown_media})

    @app.page("/health")
    @counted("health")
    async def health_view(web, request):
        """Liveness: 200 while the worker's event loop answers (the process has not hung)."""
        return web.json({"status": "alive"})

    @app.page("/ready")
    @counted("ready")
    async def ready_view(web, request):
        """Readiness: 200 once the worker holds its partitions, has recovered its tables and runs its repartition
        process; 503 with the reasons otherwise (docs/operations.md, "Probes")."""
        reasons = readiness.reasons()
        return web.json({"ready": not reasons, "reasons": reasons}, status=503 if reasons else 200)

    @app.page("/metrics")
    @counted("metrics")
    async def metrics_view(web, request):
        """Prometheus metrics in the text format (docs/operations.md, "Metrics")."""
        await metrics.refresh_lag()
        return web.bytes(metrics.render(), content_type="text/plain")  # the text exposition format
