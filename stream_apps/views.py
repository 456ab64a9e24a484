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
import time
from collections.abc import Callable
from urllib.parse import quote

import aiohttp
import faust
from faust.types import TP

from schemas import InvalidBlockHash, parse_block_hash
from stream_apps.applier import Materializer
from stream_apps.fleet import known_ownerships, occupancy_rows, source_rows
from stream_apps.health import Readiness
from stream_apps.index import api as index_api
from stream_apps.index.api import IndexAPI, Reply
from stream_apps.index.fleet_index import FleetIndex
from stream_apps.metrics import WorkerMetrics
from stream_apps.residency import key_partition, residency_key
from stream_apps.store import PartitionNotHeld
from stream_apps.tables import Tables
from stream_apps.web_access import read_body

#: Limits of POST /prefix-match/: request body bytes and block hashes per request.
MAX_REQUEST_BYTES = 256 * 1024
MAX_PREFIX_BLOCKS = 2048


def _row_json(ownership: str | None, row: dict) -> dict:
    return {"ownership": ownership, "instance_id": row["instance_id"],
            "data_parallel_rank": row["data_parallel_rank"], "tier": row["tier"], "medium": row["medium"],
            "locality": row["locality"], "group_idx": row["group_idx"], "copies": row["copies"],
            "since": row["since"], "last_ts": row["last_ts"],
            "workers": [{"worker_rank": None if w["worker_rank"] < 0 else w["worker_rank"], "count": w["count"],
                         "publisher_epoch": w["publisher_epoch"], "last_seq": w["seq"]} for w in row["workers"]]}


def index_request_bytes() -> int:
    """Largest body the router APIs read (``--max-body-bytes`` and one byte): a longer one is cut there and refused
    by the API as too long. (It was ``8 << 20 + 1``, which Python reads as ``8 << 21``: 16 MiB.)"""
    return index_api.MAX_BODY_BYTES + 1


class WorkerViews:
    """The worker's HTTP views over its tables, its fleet index and its counters (module docstring).

    Args:
        app: the Faust app whose web server answers.
        tables: the worker's tables (``/residency/`` reads them).
        materializer: the agent's counters (``/stats/``).
        index: the worker's fleet index, which prefix matches and the router APIs answer from.
        index_not_ready: why the index may not answer yet (its feed has not caught up).
        counters: this worker's event counters (``/stats/``), including the repartition process's.
        readiness: the conditions of ``GET /ready``; lookups answer 503 until they hold.
        metrics: ``GET /metrics``; every view's answers are counted there.
        unregister: writes a ``SourceUnregistered`` of (instance, rank or None, reason) to kv-events
            (``POST /unregister``).
        registrations: writes ``POST /register`` and ``/unregister`` to ``kv-instances``
            (:class:`~stream_apps.index.registrations.RegistrationWriter`), so every process has them.
        policy: the web port's access policy (:mod:`stream_apps.web_access`): this worker's lookups forwarded to
            another worker carry its token; None: no token.
    """

    def __init__(self, app: faust.App, tables: Tables, materializer: Materializer, index: FleetIndex,
                 index_not_ready: Callable[[], list[str]], counters: Callable[[], dict[str, int]],
                 readiness: Readiness, metrics: WorkerMetrics,
                 unregister: Callable[[str, int | None, str], None] | None = None, registrations=None,
                 policy=None) -> None:
        self.app = app
        self.policy = policy
        self.tables = tables
        self.materializer = materializer
        self.index = index
        self.counters = counters
        self.readiness = readiness
        self.metrics = metrics
        self.api = IndexAPI(index, lambda: readiness.reasons() + index_not_ready(),
                            prefix_match_limits=(MAX_REQUEST_BYTES, MAX_PREFIX_BLOCKS), on_unregister=unregister,
                            registrations=registrations)

    def register(self) -> None:
        """Declare every view on the app (paths in docs/querying.md; each answer is counted by view and status in
        ``kvstream_http_requests_total``)."""
        app, residency = self.app, self.tables.residency
        # internal: the worker holding a key answers it (Faust's router forwards the others' lookups)
        app.page("/residency-key/{key:.+/[0-9a-f]+}/")(
            app.table_route(table=residency, match_info="key")(self._handler(None, self.residency_key)))
        # every path answers with and without its trailing slash: routers and users write both (issue 28), and
        # without it aiohttp's 404 is plain text that names nothing
        for path in _with_and_without_slash("/residency/{block_hash_hex}/"):
            app.page(path)(self._handler("residency", self.residency))
        for path, name, handler in (("/prefix-match/", "prefix-match", self.api.prefix_match),
                                    ("/query", "query", self.api.query),
                                    ("/query_by_hash", "query_by_hash", self.api.query_by_hash),
                                    ("/register", "register", self.api.register),
                                    ("/unregister", "unregister", self.api.unregister)):
            self._post(path, name, handler)
        for path, name, handler in (("/services", "services", self.api.services),
                                    ("/global_view", "global_view", self.api.global_view)):
            self._conductor_view(path, name, handler)
        for path, name, view in (("/workers", "workers", self.workers), ("/dump", "dump", self.dump),
                                 ("/occupancy/", "occupancy", self.occupancy), ("/sources/", "sources", self.sources),
                                 ("/stats/", "stats", self.stats), ("/health", "health", self.health),
                                 ("/ready", "ready", self.ready), ("/metrics", "metrics", self.metrics_text)):
            for variant in _with_and_without_slash(path):
                app.page(variant)(self._handler(name, view))

    def _handler(self, name: str | None, view):
        """A Faust page handler (a function: Faust makes it a View's ``get``) calling the method ``view``, its
        answers counted under ``name`` (None: an internal view, not counted)."""
        requests = self.metrics.http_requests

        async def handler(web, request, **match):
            response = await view(web, request, **match)
            if name is not None:
                requests[(name, response.status)] += 1
            return response
        handler.__name__ = handler.__qualname__ = f"{view.__name__}_view"
        handler.__doc__ = view.__doc__
        return handler

    def _post(self, path: str, name: str, handler) -> None:
        """``POST path`` (with and without its trailing slash) answered by an :class:`IndexAPI` handler."""
        requests = self.metrics.http_requests
        timer = self.metrics.read_path.queries.labels(name)

        class IndexView(faust.web.View):
            async def post(self, request):
                body = await read_body(request, index_request_bytes())
                started = time.perf_counter()
                answer = handler(body, request.headers.get("Content-Type"), request.headers.get("Accept"))
                timer.observe(time.perf_counter() - started)
                requests[(name, answer.status)] += 1
                return _reply(self, answer)

            async def get(self, request):  # the conductor's 405, its error map (not Faust's)
                return _reply(self, api.method_not_allowed(request.headers.get("Accept"),
                                                           request.headers.get("Content-Type")))
        api = self.api
        IndexView.__name__ = IndexView.__qualname__ = f"{name.title().replace('-', '').replace('_', '')}View"
        IndexView.__doc__ = handler.__doc__
        documented, other = _with_and_without_slash(path)
        self.app.page(documented)(IndexView)
        self.app.page(other)(type(IndexView.__name__ + "Slash", (IndexView,), {}))

    def _conductor_view(self, path: str, name: str, handler) -> None:
        """``GET path`` (with and without its trailing slash) answered by an :class:`IndexAPI` view of Mooncake's
        conductor (``/services``, ``/global_view``), in a thread (``/global_view`` walks the whole index); a POST
        answers the conductor's 405."""
        requests, api = self.metrics.http_requests, self.api

        class ConductorView(faust.web.View):
            async def get(self, request):
                answer = await asyncio.to_thread(handler, request.headers.get("Accept"),
                                                 request.headers.get("Content-Type"))
                requests[(name, answer.status)] += 1
                return _reply(self, answer)

            async def post(self, request):
                return _reply(self, api.method_not_allowed(request.headers.get("Accept"),
                                                           request.headers.get("Content-Type")))
        ConductorView.__name__ = ConductorView.__qualname__ = f"{name.title().replace('_', '')}View"
        ConductorView.__doc__ = handler.__doc__
        documented, other = _with_and_without_slash(path)
        self.app.page(documented)(ConductorView)
        self.app.page(other)(type(ConductorView.__name__ + "Slash", (ConductorView,), {}))

    # -- /residency/: the tables, not the index --------------------------------------------------------------

    def _not_ready(self, web):
        """A 503 with the reasons, or None when the worker is ready for lookups of its tables (``/residency/``
        reads the tables, not the index, so it does not wait for the index to catch up)."""
        reasons = self.readiness.reasons()
        if not reasons:
            return None
        return web.json({"error": f"not ready: {'; '.join(reasons)}; retry", "reasons": reasons}, status=503)

    def _entry_json(self, key: str) -> list[dict]:
        """Resident rows of one local residency key, as JSON-ready dicts.

        Raises:
            PartitionNotHeld: this worker is not the active holder of the key's partition now, or its store
                cannot read that partition yet: an empty answer would say "no copies" where the truth is
                unknown here.
        """
        residency, store = self.tables.residency, self.tables.residency_store
        partition = key_partition(key, residency.partitions)
        if not (self.app.assignor.is_active(TP(store.changelog, partition)) and store.holds(partition)):
            raise PartitionNotHeld(f"partition {partition} of {store.changelog} is not held here now")
        entry = store.lookup(key, partition)
        if entry is None:
            return []
        return [_row_json(entry["ownership"], row) for row in entry["rows"] if row["copies"] > 0]

    async def _lookup(self, key: str) -> list[dict]:
        app = self.app
        url = app.router.key_store(self.tables.residency.name, key)
        if (url.host, url.port) == (app.conf.canonical_url.host, app.conf.canonical_url.port):
            return self._entry_json(key)
        token = self.policy.peer_token() if self.policy is not None else None
        headers = {"Authorization": f"Bearer {token}"} if token else None
        async with app.http_client.get(url.with_path(f"/residency-key/{quote(key, safe='/')}/"),
                                       headers=headers) as response:
            response.raise_for_status()
            return (await response.json())["rows"]

    async def _block_rows(self, block_hash: bytes) -> list[dict]:
        """Resident rows of one block over all ownerships, from whichever workers hold them (the tables, not the
        index: this view is exact as of the workers' last write, and gives what the index does not keep)."""
        keys = [residency_key(own, block_hash)
                for own in sorted(known_ownerships(self.tables), key=lambda o: o or "")]
        parts = await asyncio.gather(*(self._lookup(key) for key in keys))
        return [row for part in parts for row in part]

    async def residency_key(self, web, request, key: str):
        """Internal: resident rows of one table key, answered by the worker that holds it; 503 while it is not
        ready (a rebalance gives it partitions whose databases it is still filling from their changelogs) or
        does not hold the key's partition, which the asking worker passes on as its own 503."""
        if (refusal := self._not_ready(web)) is not None:
            return refusal
        try:
            return web.json({"rows": self._entry_json(key)})
        except PartitionNotHeld as exc:
            return web.json({"error": f"{exc}: the group is probably rebalancing; retry"}, status=503)

    async def residency(self, web, request, block_hash_hex: str):
        """Every resident row of a block, over all ownerships, of the sources that are live, and the freshness of
        each source holding it: ``{"block_hash": hex, "rows": [...], "sources": [{..., "last_event_ts", "lag_s",
        "stale"}]}``."""
        try:
            block_hash = parse_block_hash(block_hash_hex)
        except InvalidBlockHash as exc:
            return web.json({"error": str(exc)}, status=400)
        if (refusal := self._not_ready(web)) is not None:
            return refusal
        try:
            rows = await self._block_rows(block_hash)
        except (aiohttp.ClientError, OSError, KeyError, PartitionNotHeld) as exc:
            # the holder is gone, not yet assigned, or not ready to answer (its 503 arrives as a ClientResponseError)
            return web.json({"error": f"the worker holding this block did not answer ({type(exc).__name__}); "
                                      "the group is probably rebalancing: retry"}, status=503)
        leases = self.index.leases
        down = leases.down() if leases is not None else frozenset()
        if down:  # a source whose lease lapsed answers nothing: its rows are kept, not shown
            rows = [row for row in rows if (row["instance_id"], row["data_parallel_rank"]) not in down]
        holders = {(row["instance_id"], row["data_parallel_rank"]) for row in rows}
        freshness = [{name: source[name] for name in ("instance_id", "data_parallel_rank", "worker_rank",
                                                      "publisher_epoch", "last_event_ts", "lag_s", "stale")}
                     for source in source_rows(self.tables)
                     if (source["instance_id"], source["data_parallel_rank"]) in holders]
        return web.json({"block_hash": block_hash.hex(), "rows": rows, "sources": freshness})

    # -- the fleet index and the fleet views -----------------------------------------------------------------

    async def workers(self, web, request):
        """Every instance and data-parallel rank the index knows, with its blocks per tier."""
        return _reply(web, self.api.workers(request.headers.get("Accept")))

    async def dump(self, web, request):
        """The whole index as JSON lines, one block per line."""
        return web.bytes(b"".join(self.api.dump()), content_type="application/x-ndjson")

    async def occupancy(self, web, request):
        """Resident blocks per (ownership, tier, instance), each row saying whether its instance is live (a row
        of a source whose lease lapsed is counted apart: ``live`` false), and whether the workers have consumed
        their input: ``{"occupancy": [...], "caught_up": bool, "lag": n, "lag_by_topic": {...}}``
        (docs/querying.md)."""
        lag = await self.metrics.input_lag.reading()  # first: the rows are then at least as new as the reading
        states = self.index.leases.states() if self.index.leases is not None else {}
        live_instances = {instance for (instance, _), state in states.items() if state.live}
        known_instances = {instance for instance, _ in states}
        rows = [{**row, "live": row["instance_id"] in live_instances if row["instance_id"] in known_instances
                 else None} for row in occupancy_rows(self.tables)]
        return web.json({"occupancy": rows, **lag.json()})

    async def sources(self, web, request):
        """Per publisher: epoch, restarts, stale, the last lost seqs, lags; and whether the workers have consumed
        their input: ``{"sources": [...], "caught_up": bool, "lag": n, "lag_by_topic": {...}}``."""
        lag = await self.metrics.input_lag.reading()
        return web.json({"sources": source_rows(self.tables), **lag.json()})

    async def stats(self, web, request):
        """This worker's counters: events re-keyed and materialized, duplicates, unknown removals, dead letters."""
        stats = self.materializer.stats
        return web.json({**self.counters(), "applied": stats.applied, "duplicates": stats.duplicates,
                         "cleared_late": stats.cleared_late, "retired_late": stats.retired_late,
                         "unknown_removals": stats.unknown_removals, "unknown_parents": stats.unknown_parents,
                         "replica_disagreements": stats.replica_disagreements, "reuse_reports": stats.reuse_reports,
                         "became_resident": stats.became_resident, "stopped_resident": stats.stopped_resident,
                         "unknown_media": stats.unknown_media})

    # -- probes and metrics ----------------------------------------------------------------------------------

    async def health(self, web, request):
        """Liveness: 200 while the worker's event loop answers (the process has not hung)."""
        return web.json({"status": "alive"})

    async def ready(self, web, request):
        """Readiness: 200 once the worker holds its partitions, has recovered its tables and runs its repartition
        process; 503 with the reasons otherwise (docs/operations.md, "Probes")."""
        reasons = self.readiness.reasons()
        return web.json({"ready": not reasons, "reasons": reasons}, status=503 if reasons else 200)

    async def metrics_text(self, web, request):
        """Prometheus metrics in the text format (docs/operations.md, "Metrics")."""
        await self.metrics.refresh_lag()
        return web.bytes(self.metrics.render(), content_type="text/plain")  # the text exposition format


def _with_and_without_slash(path: str) -> tuple[str, str]:
    """``(path, its twin)``: the documented path first, then the same with its trailing slash added or removed
    (``"/occupancy/"`` -> ``("/occupancy/", "/occupancy")``; ``"/workers"`` -> ``("/workers", "/workers/")``)."""
    return path, path.rstrip("/") if path.endswith("/") else path + "/"


def _reply(web, answer: Reply):
    return web.bytes(answer.body, content_type=answer.content_type, status=answer.status)


def register_views(app: faust.App, *args, **kwargs) -> WorkerViews:
    """Declare the HTTP views on ``app``: :class:`WorkerViews` (same arguments) and its ``register()``."""
    views = WorkerViews(app, *args, **kwargs)
    views.register()
    return views
