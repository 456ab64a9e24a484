"""Builds the Faust stream app of one worker from its settings (docs/architecture.md has the topology).

:func:`create_app` wires the pieces, each in its own module:

- :mod:`stream_apps.repartition`: the repartition process (re-keys ``kv-events`` by ownership and block hash
  into ``<app id>-kv-events-by-ownership``, stamping each event with its source's latest clear);
- :mod:`stream_apps.tables` and :mod:`stream_apps.store`: the tables and their stores;
- :mod:`stream_apps.materialize` and :mod:`stream_apps.applier`: the agent that applies the re-keyed events;
- :mod:`stream_apps.outputs`: the output producer (changelogs, ``<app id>-kv-residency-changes``,
  ``<app id>-kv-tier-occupancy``, dead letters);
- :mod:`stream_apps.checkpoint`: the commit protocol;
- :mod:`stream_apps.views`, :mod:`stream_apps.fleet`, :mod:`stream_apps.health`, :mod:`stream_apps.metrics`:
  the HTTP views, the fleet-wide views they share, readiness and Prometheus metrics;
- :mod:`stream_apps.consumer_fixes`: four corrections to faust-streaming (two in its aiokafka driver, one in
  its offset commit, one in mode's flow control) and the agent consumer's fetch wait, a setting Faust does
  not expose.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import faust
from confluent_kafka import KafkaException

from kafka_io.config import aiokafka_security
from kafka_io.schema_registry import SCHEMAS_TOPIC_CONFIG, reader_codec
from schemas import AvroCodec
from schemas.topics import DEAD_LETTER_TOPIC_CONFIG
from stream_apps import consumer_fixes
from stream_apps.agent_progress import AgentProgress
from stream_apps.applier import Materializer
from stream_apps.checkpoint import (
    Checkpoint,
    CheckpointError,
    CommitSensor,
    prepare_before_commits,
    tune_gc,
    warn_on_long_gc_pauses,
)
from stream_apps.health import Readiness
from stream_apps.index.api import configure_limits
from stream_apps.index.fleet_index import FleetIndex
from stream_apps.index.fresh import CLEAR_TIERS
from stream_apps.index.liveness import SourceLeases, leases_from_sources_table, unregister_record
from stream_apps.index.registrations import RegistrationsFeed, RegistrationWriter
from stream_apps.index.server import open_events_feed, open_feed
from stream_apps.materialize import message_applier, register_agent
from stream_apps.metrics import WorkerMetrics
from stream_apps.outputs import OutputTopics
from stream_apps.rekeyed_reader import RekeyedReader
from stream_apps.repartition import RepartitionService
from stream_apps.settings import WorkerSettings
from stream_apps.store import STORE_SCHEMES
from stream_apps.tables import Tables, define_tables
from stream_apps.views import register_views
from stream_apps.web_access import (
    AccessPolicy,
    access_middleware,
    body_limit_middleware,
    client_ssl_context,
    peer_client_class,
    policy_from_settings,
    server_ssl_context,
)

log = logging.getLogger(__name__)


def broker_credentials():
    """Faust's credentials from the Kafka security settings (:func:`kafka_io.config.aiokafka_security`)."""
    settings = aiokafka_security()
    protocol = settings.get("security_protocol", "PLAINTEXT")
    if protocol.startswith("SASL"):
        return faust.SASLCredentials(username=settings["sasl_plain_username"],
                                     password=settings["sasl_plain_password"], mechanism=settings["sasl_mechanism"],
                                     ssl_context=settings.get("ssl_context"))
    if protocol == "SSL":
        return faust.SSLCredentials(settings["ssl_context"])
    return None


#: How often the worker looks for sources down for --source-expiry-s, to clear them (seconds).
LEASE_CHECK_EVERY_S = 1.0
#: Seconds between reads of kv-instances (registrations are rare; a second is what a router waits at most to see
#: another process's registration here).
REGISTRATIONS_EVERY_S = 1.0
#: How often the worker serves its output producer's delivery reports between checkpoints (seconds).
DELIVERY_REPORTS_EVERY_S = 0.05


@dataclass
class StreamApp:
    """One worker's app and the pieces :func:`create_app` wired into it."""

    settings: WorkerSettings
    app: faust.App
    tables: Tables
    outputs: OutputTopics
    checkpoint: Checkpoint
    materializer: Materializer
    repartition: RepartitionService
    readiness: Readiness
    metrics: WorkerMetrics
    #: The worker's fleet index and its feed from the residency changelog (set by :func:`create_app`).
    index: FleetIndex | None = None
    index_feed: object | None = None
    #: The index's feed straight from kv-events (:mod:`stream_apps.index.events_feed`), set with the index.
    index_events_feed: object | None = None

    def counters(self) -> dict[str, int]:
        """This worker's event counters: the agent's and the repartition process's."""
        upstream = self.repartition.counters()
        return {"materialized": self.materializer.materialized, "repartitioned": upstream.get("repartitioned", 0),
                "dead_lettered": self.outputs.dead_lettered + upstream.get("dead_lettered", 0)}

    def declared_topics(self) -> dict[str, tuple[int, dict[str, str]]]:
        """Every topic this app reads or writes: name -> (partitions, topic configs).

        ``kvstream worker`` creates them before Faust starts: a topic that Faust creates while the consumer
        group forms is left out of the first assignment (seen with the re-keyed topic and the global tables'
        changelogs: their agents stayed idle until the next rebalance).
        """
        partitions, names = self.settings.partitions, self.settings.topics
        compacted = {"cleanup.policy": "compact"}
        topics = {names.kv_events: (partitions, {}),
                  names.by_ownership: (partitions, {"max.message.bytes": str(8 << 20)}),
                  names.source_clears: (partitions, compacted),
                  names.dead_letter: (1, DEAD_LETTER_TOPIC_CONFIG),
                  names.residency_changes: (partitions, {}), names.tier_occupancy: (partitions, compacted),
                  f"{names.scoped_app_id}-__assignor-__leader": (1, {}),
                  # made here rather than by the output producer's first use (kafka_io.schema_registry.publish_schema),
                  # which could fall into a broker outage: on a cluster with a node down, a topic of 3 replicas
                  # cannot be created, and the worker stopped (make chaos, broker-bounce)
                  names.schemas: (1, SCHEMAS_TOPIC_CONFIG)}
        for table in self.tables.all():
            topics[table.changelog_topic.get_topic_name()] = (table.partitions or partitions, compacted)
        return topics


#: Bytes the agent's consumer fetches per partition of the re-keyed topic in one request (aiokafka's
#: ``max_partition_fetch_bytes``; Faust's default is 1 MiB). A batch message holds about 1,250 events
#: (some 240 KB), so 1 MiB was four messages per partition: the agent, reading them faster than one round
#: trip brought more, waited in the event loop about a tenth of the time on a backlog. Measured with
#: ``bench.profile_worker`` on the trace: 39,400 events/s with 1 MiB, 42,800 with 4 or 8 MiB (and less CPU:
#: fewer fetches). At most this many bytes per assigned partition wait in memory.
AGENT_FETCH_BYTES = 4 << 20


def create_app(settings: WorkerSettings, replication_factor: int = 1) -> StreamApp:
    """Build the Faust app of one worker: tables, agent, output producer, checkpoint, views, repartition
    process. Nothing is started; ``StreamApp.app.main()`` runs it.

    ``replication_factor`` is Faust's ``topic_replication_factor``, for a topic Faust would create itself (it
    finds every one made already by ``kvstream worker``, with the cluster's replication:
    :func:`kafka_io.admin.ensure_topics`)."""
    consumer_fixes.install()
    configure_limits(settings.max_body_bytes, settings.max_tokens, settings.max_hashes, settings.max_nesting_depth)
    policy = policy_from_settings(settings)
    app = _faust_app(settings, policy, replication_factor)
    stream_app, agent_progress = _write_path(app, settings)
    stream_app.metrics.access_policy = policy
    _read_path(stream_app, policy)
    _checkpoint_hooks(stream_app, agent_progress)
    tune_gc()
    warn_on_long_gc_pauses()
    return stream_app


def _faust_app(settings: WorkerSettings, policy: AccessPolicy, replication_factor: int = 1) -> faust.App:
    topics = settings.topics
    server_tls = server_ssl_context(settings.web_tls_cert, settings.web_tls_key, settings.web_tls_client_ca)
    web: dict = {"web_application_options": {"middlewares": [access_middleware(policy), body_limit_middleware()]}}
    if server_tls is not None:
        # the other workers forward lookups to https://<web host>:<port>, checking its certificate against
        # --web-tls-ca (or the client CA) and presenting this worker's own certificate (mutual TLS)
        peer_tls = client_ssl_context(settings.web_tls_ca or settings.web_tls_client_ca, settings.web_tls_cert,
                                      settings.web_tls_key)
        web.update(web_ssl_context=server_tls, canonical_url=f"https://{settings.web_host}:{settings.web_port}",
                   HttpClient=peer_client_class(peer_tls))
    return faust.App(
        topics.scoped_app_id,  # the consumer group, and the prefix of Faust's changelog topics
        broker=[f"kafka://{server}" for server in settings.bootstrap_servers.split(",")],
        store=STORE_SCHEMES[settings.store],
        datadir=str(settings.data_dir),
        topic_partitions=settings.partitions,
        processing_guarantee="at_least_once",
        consumer_auto_offset_reset="earliest",
        web_port=settings.web_port,
        web_bind=settings.web_bind,
        web_host=settings.web_host,
        key_serializer="raw",
        value_serializer="raw",
        broker_credentials=broker_credentials(),
        table_standby_replicas=settings.standby_replicas,
        topic_replication_factor=replication_factor,
        # Faust's own producer sends none of the app's records (the outputs and changelogs go through
        # stream_apps/outputs.py: idempotent, acks=all); acks=all is said here all the same
        producer_acks=-1,
        consumer_max_fetch_size=AGENT_FETCH_BYTES,
        **web,
    )


def _write_path(app: faust.App, settings: WorkerSettings) -> tuple[StreamApp, AgentProgress]:
    """The tables, the output producer, the checkpoint, the agent and the repartition process: the worker's write
    path."""
    topics = settings.topics
    tables = define_tables(app, settings)
    # a success's report costs a Message object (key and value copied) per record, about one per event: only a
    # store that persists its changelog's offsets needs them (the RocksDB residency store)
    outputs = OutputTopics(settings.bootstrap_servers, topics, settings.schema_registry_url,
                           residency_changes=settings.residency_changes,
                           report_successes=any(table.data.needs_acknowledged_offsets for table in tables.all()))
    for table in tables.all():
        table.data.bind(outputs, bootstrap_servers=settings.bootstrap_servers,
                        cache_entries=settings.residency_cache_entries, recovery_timeout_s=settings.recovery_timeout_s)
    tables.tier_occupancy.data.mirror = outputs.occupancy  # kv-tier-occupancy gets the table's changelog records
    checkpoint = Checkpoint(outputs, [table.data for table in tables.all()])
    app.sensors.add(CommitSensor(checkpoint, app.crash))
    prepare_before_commits(app.consumer, checkpoint, app.crash)
    materializer = Materializer(tables, outputs, checkpoint, settings.sources)
    by_ownership = app.topic(topics.by_ownership, key_type=bytes, value_type=bytes,
                             partitions=settings.partitions, internal=True)
    apply_message = message_applier(app, materializer, reader_codec("kv_event", settings.bootstrap_servers,
                                                                    settings.schema_registry_url, topics.schemas))
    register_agent(app, by_ownership, apply_message)
    repartition = RepartitionService(app, settings.bootstrap_servers, topics, settings.partitions,
                                     batch_size=settings.repartition_batch, within_s=settings.repartition_within_s,
                                     linger_s=settings.repartition_linger_s,
                                     nice=settings.repartition_nice,
                                     log_format=settings.log_format,
                                     schema_registry_url=settings.schema_registry_url,
                                     aggregation=settings.sources.aggregation)
    app.service(repartition)
    agent_progress = AgentProgress(topics.by_ownership, repartition.agent_progress)
    app.sensors.add(agent_progress)
    readiness = Readiness(app, lambda: repartition.alive)
    metrics = WorkerMetrics(settings, materializer, checkpoint, repartition, readiness, lambda: app.in_recovery)
    if settings.rekeyed_reader == "librdkafka":
        reader = RekeyedReader(app, settings.bootstrap_servers, topics.by_ownership, apply_message,
                               repartition.agent_progress)
        reader.install()
        app.task(reader.run)
        metrics.rekeyed_reader = reader
    return StreamApp(settings, app, tables, outputs, checkpoint, materializer, repartition, readiness,
                     metrics), agent_progress


def _read_path(stream_app: StreamApp, policy: AccessPolicy | None = None) -> None:
    """The fleet index, the sources' leases and their expiry, the registrations, and the views: the worker's read
    path."""
    settings, app, tables, outputs = stream_app.settings, stream_app.app, stream_app.tables, stream_app.outputs
    topics = settings.topics
    # The fleet index: every worker reads the whole residency changelog into its own compact index, which the
    # prefix matches and the router APIs answer from (stream_apps/index/).
    index = FleetIndex(settings.weights)
    index_feed = open_feed(index, settings.bootstrap_servers, topics, settings.schema_registry_url)
    stream_app.index, stream_app.index_feed = index, index_feed
    # Sources' leases from the global sources table: a worker writes a source's row whenever it applies one of
    # its events or heartbeats, and the store keeps when (stream_apps/index/liveness.py).
    sources_store = tables.sources.data
    index.leases = stream_app.metrics.leases = leases = SourceLeases(settings.source_lease_s, refresh=lambda leases: (
        leases_from_sources_table(leases, tables.sources.items(), getattr(sources_store, "written_at", {}))))
    # the fresh path: kv-events applied to the index as they arrive, the changelog its recovery point and check;
    # a clear's own tiers per instance are the changelog's to settle (the default scope is applied at once)
    events_feed = open_events_feed(index, settings.bootstrap_servers, topics, settings.schema_registry_url,
                                   settings.source_lease_s,
                                   None if settings.clear_scope.split(",")[0] == "all" else CLEAR_TIERS)
    stream_app.index_events_feed = events_feed
    stream_app.metrics.read_path.leases = leases
    events_feed.on_applied = stream_app.metrics.read_path.applied
    kv_event_codec = AvroCodec("kv_event")

    def unregister(instance: str, rank: int | None, reason: str) -> None:
        """Write a SourceUnregistered to every partition of kv-events, through the output producer."""
        value = kv_event_codec.encode(unregister_record(instance, rank, reason))
        for partition in range(settings.partitions):
            outputs.produce(topics.kv_events, None, value, partition=partition)
        log.info("unregistering %s%s: %s", instance, "" if rank is None else f" rank {rank}", reason)

    # registrations are the fleet's, not this worker's: written to kv-instances and read back by every process
    registrations = RegistrationsFeed(settings.bootstrap_servers, topics.instances, index.apply_registration,
                                      reader_codec("instance_registration", settings.bootstrap_servers,
                                                   settings.schema_registry_url, topics.schemas))
    register_views(app, tables, stream_app.materializer, index, index_feed.not_ready, stream_app.counters,
                   stream_app.readiness, stream_app.metrics, unregister,
                   RegistrationWriter(settings.bootstrap_servers, topics.instances), policy)
    expired: set[tuple[str, int]] = set()

    @app.timer(LEASE_CHECK_EVERY_S)
    async def _check_leases() -> None:
        if not settings.source_expiry_s:
            return
        now = time.time()
        for source, state in leases.states(now).items():
            if state.live:
                expired.discard(source)
            elif now - state.down_since >= settings.source_expiry_s and source not in expired:
                expired.add(source)  # once per time down; every worker may write it: a second one removes nothing
                unregister(source[0], source[1], f"down for {now - state.down_since:.0f} s "
                                                 f"(--source-expiry-s {settings.source_expiry_s:g})")

    @app.task
    async def _feed_index() -> None:
        events_feed.start_thread()
        await index_feed.run()

    @app.timer(REGISTRATIONS_EVERY_S)
    async def _read_registrations() -> None:
        try:  # in a thread: looking for the topic may wait seconds for a broker that does not answer
            await asyncio.to_thread(registrations.poll)
        except KafkaException as exc:
            log.warning("reading %s: %s; retrying", topics.instances, exc)


def _checkpoint_hooks(stream_app: StreamApp, agent_progress: AgentProgress) -> None:
    """The checkpoint's timers (delivery reports, changelogs) and the rebalance hooks."""
    app, checkpoint, outputs = stream_app.app, stream_app.checkpoint, stream_app.outputs
    store = stream_app.tables.residency_store
    by_ownership = stream_app.settings.topics.by_ownership

    @app.timer(DELIVERY_REPORTS_EVERY_S)
    async def _serve_delivery_reports() -> None:
        outputs.serve_delivery_reports()

    # The checkpoint's step 1 alone, per store: the changelogs follow the tables. The global tables' go out less
    # often: every worker reads them whole, each record through Faust's recovery path (bench/HISTORY.md,
    # "2026-12-05 morning"), and what follows them lags far less than a source's lease
    partitioned = [table.data for table in stream_app.tables.partitioned_tables()]
    global_stores = [table.data for table in stream_app.tables.global_tables()]

    async def produce_changelogs(stores: list) -> None:
        try:
            checkpoint.produce(stores)
        except CheckpointError as exc:
            log.error("stopping the worker: %s", exc)
            await app.crash(exc)

    @app.timer(stream_app.settings.changelog_interval_s)
    async def _produce_changelogs() -> None:
        await produce_changelogs(partitioned)

    @app.timer(stream_app.settings.global_changelog_interval_s)
    async def _produce_global_changelogs() -> None:
        await produce_changelogs(global_stores)

    @app.on_partitions_revoked.connect
    async def _checkpoint_on_revoke(app, revoked, **kwargs) -> None:
        # pending RocksDB entries of revoked partitions reach the disk before their DBs close; a coroutine, so the
        # wait for the acknowledgements leaves the event loop free (Checkpoint.commit_async)
        await checkpoint.commit_async()
        store.forget_cache()

    @app.on_partitions_assigned.connect
    async def _on_assigned(app, assigned, **kwargs) -> None:
        store.forget_cache()
        agent_progress.assigned({tp.partition for tp in assigned if tp.topic == by_ownership})
        stream_app.readiness.assigned = True
        stream_app.metrics.rebalances += 1
