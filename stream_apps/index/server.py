"""``kvstream index``: a query-only replica of the fleet index, and the index as a library in a router's process.

A replica joins no consumer group, owns no partition and writes nothing: it reads ``<app id>-residency-changelog``
(:mod:`stream_apps.index.feed`) and answers the router APIs (:mod:`stream_apps.index.api`) on plain aiohttp. So
reads scale by adding replicas, and queries never load the workers' write path.

:class:`EmbeddedIndex` is the same index without HTTP: a router written in Python feeds one in a thread and calls
it in process, as llm-d's indexer runs inside its router.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence

from aiohttp import web
from confluent_kafka import KafkaException
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from kafka_io.admin import cluster_metadata
from kafka_io.schema_registry import reader_codec
from schemas.topics import TopicNames
from stream_apps.hotpath import log_hotpath
from stream_apps.index.api import IndexAPI, Reply, configure_limits
from stream_apps.index.conductor import finish_answer
from stream_apps.index.events_feed import EventsFeed
from stream_apps.index.feed import ChangelogFeed
from stream_apps.index.fleet_index import DEFAULT_BLOCK_SIZE, FleetIndex
from stream_apps.index.fresh import CLEAR_TIERS
from stream_apps.index.liveness import DEFAULT_LEASE_S, SourceLeases, SourcesFeed, write_unregister
from stream_apps.index.observe import ReadPathMetrics
from stream_apps.index.registrations import RegistrationsFeed, RegistrationWriter
from stream_apps.web_access import (
    AccessPolicy,
    access_middleware,
    body_limit_middleware,
    check_exposure,
    policy_from_settings,
    read_body,
    refusals_family,
    server_ssl_context,
)

log = logging.getLogger(__name__)


def open_feed(index: FleetIndex, bootstrap_servers: str, topics: TopicNames, schema_registry_url: str = "",
              ) -> ChangelogFeed:
    """A feed of ``index`` from the residency changelog of the app ``topics`` names (not started)."""
    codec = reader_codec("residency", bootstrap_servers, schema_registry_url, topics.schemas)
    return ChangelogFeed(index, bootstrap_servers, topics.changelog("residency"), codec)


def open_events_feed(index: FleetIndex, bootstrap_servers: str, topics: TopicNames, schema_registry_url: str = "",
                     history_s: float = 0.0, clear_tiers: frozenset[str] | None = CLEAR_TIERS) -> EventsFeed:
    """A feed of ``index``'s fresh layer and leases straight from ``kv-events`` (not started;
    :mod:`stream_apps.index.events_feed`): ``history_s`` seconds read back at start for liveness."""
    codec = reader_codec("kv_event", bootstrap_servers, schema_registry_url, topics.schemas)
    return EventsFeed(index, bootstrap_servers, topics.kv_events, codec, history_s=history_s,
                      clear_tiers=clear_tiers)


class IndexMetrics:
    """``GET /metrics`` of an index: its size, the feed's progress and lag, and the answers by view and status."""

    def __init__(self, index: FleetIndex, feed: ChangelogFeed) -> None:
        self.index, self.feed = index, feed
        #: (view, HTTP status) -> answers.
        self.http_requests: Counter = Counter()
        #: The web port's access policy, whose refusals are counted (set by :func:`build_web_app`).
        self.policy: AccessPolicy | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self)
        #: The read path's histograms and per-source gauge (:mod:`stream_apps.index.observe`).
        self.read_path = ReadPathMetrics(index.leases)
        self.registry.register(self.read_path)

    def collect(self):
        """The metric families (prometheus_client's collector protocol)."""
        stats = self.index.stats()
        for name, value, doc in (
                ("kvstream_index_blocks", stats["blocks"], "Blocks in the index (any holder)."),
                ("kvstream_index_resident_pairs", stats["resident_pairs"], "Resident (block, holder) pairs."),
                ("kvstream_index_memory_bytes", stats["memory_bytes"], "Bytes of the index's block table."),
                ("kvstream_index_feed_lag_records", self.feed.lag(), "Changelog records not read yet."),
                ("kvstream_index_caught_up", int(self.feed.caught_up), "1 once the feed read to its start's end.")):
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("kvstream_index_changelog_records", "Changelog records read.",
                                  value=self.feed.records)
        yield CounterMetricFamily("kvstream_index_undecodable_records", "Changelog records skipped: not decodable.",
                                  value=self.feed.undecodable)
        yield CounterMetricFamily("kvstream_index_mixed_hash_queries",
                                  "Token queries that found equal content under unequal engine hashes.",
                                  value=stats["mixed_hash_queries"])
        requests = CounterMetricFamily("kvstream_http_requests", "HTTP answers by view and status.",
                                       labels=["view", "status"])
        for (view, status), n in sorted(self.http_requests.items()):
            requests.add_metric([view, str(status)], n)
        yield requests
        yield refusals_family(self.policy)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


def _response(reply: Reply) -> web.Response:
    return web.Response(status=reply.status, body=reply.body, content_type=reply.content_type)


#: The paths that take POST only (a GET answers 405, as the conductor's).
POST_PATHS = ("/query", "/query_by_hash", "/prefix-match", "/register", "/unregister")


def build_web_app(api: IndexAPI, feed: ChangelogFeed, metrics: IndexMetrics,
                  policy: AccessPolicy | None = None) -> web.Application:
    """The aiohttp application of ``kvstream index``: the router APIs, ``/health``, ``/ready``, ``/metrics``.

    Every path answers with and without its trailing slash (routers write both). ``policy`` decides who may do what
    (:mod:`stream_apps.web_access`); None: everything is open (a test's or an embedding's application)."""
    middlewares = [body_limit_middleware()] + ([access_middleware(policy)] if policy is not None else [])
    app = web.Application(client_max_size=api_body_limit(), middlewares=middlewares)
    metrics.policy = policy
    counts = metrics.http_requests

    def post(view: str, handler):
        timer = metrics.read_path.queries.labels(view)

        async def serve(request: web.Request) -> web.Response:
            body = await read_body(request, api_body_limit())
            started = time.perf_counter()
            reply = handler(body, request.headers.get("Content-Type"), request.headers.get("Accept"))
            timer.observe(time.perf_counter() - started)
            counts[(view, reply.status)] += 1
            return _response(reply)
        return serve

    async def workers(request: web.Request) -> web.Response:
        reply = api.workers(request.headers.get("Accept"))
        counts[("workers", reply.status)] += 1
        return _response(reply)

    async def dump(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        for i, line in enumerate(api.dump()):
            await response.write(line)
            if i % 4096 == 4095:
                await asyncio.sleep(0)  # let queries in between
        await response.write_eof()
        counts[("dump", 200)] += 1
        return response

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def ready(request: web.Request) -> web.Response:
        reasons = feed.not_ready()
        return web.json_response({"ready": not reasons, "reasons": reasons}, status=503 if reasons else 200)

    async def metrics_view(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), content_type="text/plain")

    def conductor_view(view: str, handler):
        async def serve(request: web.Request) -> web.Response:
            # in a thread: /global_view walks the whole index (under its lock, a batch at a time)
            reply = await asyncio.to_thread(handler, request.headers.get("Accept"), request.headers.get("Content-Type"))
            counts[(view, reply.status)] += 1
            return _response(reply)
        return serve

    async def not_allowed(request: web.Request) -> web.Response:
        reply = api.method_not_allowed(request.headers.get("Accept"), request.headers.get("Content-Type"))
        counts[("method_not_allowed", reply.status)] += 1
        return _response(reply)

    routes = [("POST", "/query", post("query", api.query)),
              ("POST", "/query_by_hash", post("query_by_hash", api.query_by_hash)),
              ("POST", "/prefix-match", post("prefix-match", api.prefix_match)),
              ("POST", "/register", post("register", api.register)),
              ("POST", "/unregister", post("unregister", api.unregister)),
              ("GET", "/workers", workers), ("GET", "/dump", dump), ("GET", "/health", health),
              ("GET", "/ready", ready), ("GET", "/metrics", metrics_view)]
    # Mooncake's conductor: its two views, and a 405 for a path asked with the other method (its error map)
    routes += [("GET", "/services", conductor_view("services", api.services)),
               ("GET", "/global_view", conductor_view("global_view", api.global_view))]
    routes += [("GET", path, not_allowed) for path in POST_PATHS] + [("POST", path, not_allowed) for path in
                                                                      ("/services", "/global_view")]
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
        app.router.add_route(method, path + "/", handler)
    return app


def api_body_limit() -> int:
    """Largest request body the server reads (:data:`stream_apps.index.api.MAX_BODY_BYTES` and a little more, so
    that the API, not aiohttp, names the limit)."""
    from stream_apps.index import api

    return api.MAX_BODY_BYTES + 1024


def open_sources_feed(index: FleetIndex, bootstrap_servers: str, topics: TopicNames, schema_registry_url: str,
                      lease_s: float) -> SourcesFeed:
    """Give ``index`` the sources' leases, read from ``<app id>-sources-changelog`` (not started)."""
    index.leases = SourceLeases(lease_s)
    codec = reader_codec("source_status", bootstrap_servers, schema_registry_url, topics.schemas)
    return SourcesFeed(index.leases, bootstrap_servers, topics.changelog("sources"), codec)


def open_registrations_feed(index: FleetIndex, bootstrap_servers: str, topics: TopicNames,
                            schema_registry_url: str) -> RegistrationsFeed:
    """The feed of ``kv-instances`` into ``index``'s registry (not started)."""
    codec = reader_codec("instance_registration", bootstrap_servers, schema_registry_url, topics.schemas)
    return RegistrationsFeed(bootstrap_servers, topics.instances, index.apply_registration, codec)


async def _follow(*feeds) -> None:
    """Poll the small feeds (leases, registrations) in a thread, one after the other: a read takes no wait, but
    looking for a topic that is not there yet may wait seconds for the broker, which must not hold up the
    router APIs in the event loop."""
    def poll_all() -> int:
        read = 0
        for feed in feeds:
            try:
                read += feed.poll()
            except KafkaException as exc:
                log.warning("index: %s; retrying", exc)
        return read

    while True:
        read = await asyncio.to_thread(poll_all)
        await asyncio.sleep(0 if read else 0.1)


def run_index(settings) -> int:
    """Run ``kvstream index`` with :class:`~stream_apps.index.settings.IndexSettings` until interrupted.

    Raises:
        RuntimeError: the brokers did not answer within :data:`kafka_io.config.CONNECT_TIMEOUT_S` at start (as
            ``kvstream worker`` does: a wrong address is said at once, not by a replica that answers 503 for ever).
    """
    check_exposure(settings, log)  # before any connection: a one-line refusal naming the flag
    ssl_context = server_ssl_context(settings.web_tls_cert, settings.web_tls_key, settings.web_tls_client_ca)
    policy = policy_from_settings(settings)
    configure_limits(settings.max_body_bytes, settings.max_tokens, settings.max_hashes, settings.max_nesting_depth)
    cluster_metadata(settings.bootstrap_servers)
    index = FleetIndex(settings.weights, settings.default_block_size)
    feed = open_feed(index, settings.bootstrap_servers, settings.topics, settings.schema_registry_url)
    sources = open_sources_feed(index, settings.bootstrap_servers, settings.topics, settings.schema_registry_url,
                                settings.source_lease_s)
    events = open_events_feed(index, settings.bootstrap_servers, settings.topics, settings.schema_registry_url,
                              settings.source_lease_s)
    registrations = open_registrations_feed(index, settings.bootstrap_servers, settings.topics,
                                            settings.schema_registry_url)

    def unregister(instance: str, rank: int | None, reason: str) -> None:
        # the one write a replica makes: an operator's or a router's explicit deregistration
        write_unregister(settings.bootstrap_servers, settings.topics.kv_events, instance, rank, reason)

    api = IndexAPI(index, feed.not_ready, on_unregister=unregister,
                   prefix_match_limits=(settings.max_body_bytes, settings.max_hashes),
                   registrations=RegistrationWriter(settings.bootstrap_servers, settings.topics.instances))
    metrics = IndexMetrics(index, feed)
    events.on_applied = metrics.read_path.applied
    app = build_web_app(api, feed, metrics, policy)

    async def start_feed(app: web.Application) -> None:
        app["feed"] = asyncio.get_running_loop().create_task(feed.run())
        app["sources"] = asyncio.get_running_loop().create_task(_follow(sources, registrations))
        events.start_thread()

    async def stop_feed(app: web.Application) -> None:
        app["feed"].cancel()
        app["sources"].cancel()
        events.close()
        feed.close()
        sources.close()
        registrations.close()

    app.on_startup.append(start_feed)
    app.on_cleanup.append(stop_feed)
    log_hotpath(log)
    log.info("index: serving the router APIs on %s://%s:%d (reading %s; %s)", "https" if ssl_context else "http",
             settings.web_bind, settings.web_port, feed.topic, policy.describe())
    web.run_app(app, host=settings.web_bind, port=settings.web_port, print=None, access_log=None,
                ssl_context=ssl_context)
    return 0


class EmbeddedIndex:
    """The fleet index in a router's own process, fed from Kafka in a thread; no HTTP hop at all.

    ``with EmbeddedIndex("kafka:9092").start(wait_s=30) as index: index.query_tokens(tokens, model_name=...)``

    Args:
        bootstrap_servers: Kafka bootstrap servers.
        app_id, topic_prefix: the workers' app id and topic prefix.
        schema_registry_url: the registry the workers write through, if any.
        weights: tier weights of the prefix-match score.
        default_block_size: tokens per block of an instance that registered none.
        source_lease_s: seconds without an event or heartbeat after which a source is left out of the answers.
    """

    def __init__(self, bootstrap_servers: str, app_id: str = "kvstream", topic_prefix: str = "",
                 schema_registry_url: str = "", weights: Mapping[str, float] | None = None,
                 default_block_size: int = DEFAULT_BLOCK_SIZE, source_lease_s: float = DEFAULT_LEASE_S) -> None:
        self.index = FleetIndex(weights, default_block_size)
        topics = TopicNames(app_id, topic_prefix)
        self.feed = open_feed(self.index, bootstrap_servers, topics, schema_registry_url)
        self.sources = open_sources_feed(self.index, bootstrap_servers, topics, schema_registry_url, source_lease_s)
        self.events = open_events_feed(self.index, bootstrap_servers, topics, schema_registry_url, source_lease_s)
        self.registrations = open_registrations_feed(self.index, bootstrap_servers, topics, schema_registry_url)
        self._stop = threading.Event()

    def start(self, wait_s: float | None = None) -> EmbeddedIndex:
        """Start the feed's thread; with ``wait_s``, wait that long for it to catch up.

        Raises:
            TimeoutError: not caught up within ``wait_s`` (the reasons in the message).
        """
        self.feed.start_thread()
        self.events.start_thread()
        threading.Thread(target=self._follow_sources, name="kvstream-index-sources", daemon=True).start()
        if wait_s is not None and not self.feed.wait_caught_up(wait_s):
            raise TimeoutError("; ".join(self.feed.not_ready()))
        return self

    @property
    def ready(self) -> bool:
        """True once the index has caught up with the changelog."""
        return self.feed.caught_up

    def query_tokens(self, token_ids: Sequence[int] | bytes, instance_id: str | None = None, **options) -> dict:
        """``/query``'s answer as a dict: :meth:`FleetIndex.query_tokens` (``options`` are its), finished as the
        HTTP API finishes it (every registered rank of the query's context, ``instance_id`` alone if given, why
        instances were left out: :func:`~stream_apps.index.conductor.finish_answer`)."""
        return finish_answer(self.index, self.index.query_tokens(token_ids, **options),
                             model=options.get("model_name"), tenant=options.get("tenant_id"),
                             block_size=options.get("block_size"), instance_id=instance_id)

    def query_hashes(self, chain: Sequence[bytes], instance_id: str | None = None, **options) -> dict:
        """``/query_by_hash``'s answer as a dict: :meth:`FleetIndex.query_hashes`, finished as :meth:`query_tokens`
        finishes it."""
        return finish_answer(self.index, self.index.query_hashes(chain, **options),
                             model=options.get("model_name"), tenant=options.get("tenant_id"),
                             instance_id=instance_id)

    def prefix_match(self, chain: Sequence[bytes]) -> list[dict]:
        """:meth:`FleetIndex.prefix_match` (``/prefix-match/``'s ``matches``)."""
        return self.index.prefix_match(chain)

    def _follow_sources(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.sources.poll() + self.registrations.poll():
                    self._stop.wait(0.1)
            except KafkaException as exc:
                log.warning("index: %s; retrying", exc)
                self._stop.wait(1.0)
        self.sources.close()
        self.registrations.close()

    def close(self) -> None:
        """Stop the feeds."""
        self._stop.set()
        self.events.close()
        self.feed.close()

    def __enter__(self) -> EmbeddedIndex:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
