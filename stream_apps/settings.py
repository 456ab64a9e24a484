"""The settings of a stream-app worker: one typed object, built once and passed down.

Precedence, highest first: the ``kvstream worker`` flag, the ``KVSTREAM_<NAME>`` environment variable, the
default below (docs/configuration.md lists them; a test checks that table against this class). Nothing in
:mod:`stream_apps` reads the environment for its settings; the Kafka security settings are the exception
(:mod:`kafka_io.config`), so that secrets never appear on a command line.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kafka_io.config import DEFAULT_BOOTSTRAP_SERVERS, DEFAULT_PARTITIONS, BootstrapServers
from kafka_io.schema_registry import RegistryUrl, schema_registry_field
from schemas.topics import TopicNames
from stream_apps.index.api import MAX_BODY_BYTES, MAX_CHAIN_BLOCKS, MAX_NESTING_DEPTH, MAX_TOKENS
from stream_apps.residency import SourceSettings, parse_tier_weights
from stream_apps.web_settings import (
    ApiTokenFile,
    InsecureHttp,
    MaxBodyBytes,
    MaxHashes,
    MaxNestingDepth,
    MaxTokens,
    ReadRequiresToken,
    RegisterAllowCidr,
    WebTlsCa,
    WebTlsCert,
    WebTlsClientCa,
    WebTlsKey,
)

#: Default ``residency_cache`` of the RocksDB store: decoded entries. At most about 90 MB at 630-700 bytes an entry
#: with its key (compiled records, ``python -m bench.row_memory``): the memory it had when an entry cost 920 bytes
#: and the default was 100,000.
ROCKSDB_RESIDENCY_CACHE = 130_000
#: Default ``residency_cache`` of the memory store, whose point is a small footprint (its entries are all held
#: encoded already).
MEMORY_RESIDENCY_CACHE = 10_000


class WorkerSettings(BaseSettings):
    """Settings of one worker of the stream app (``kvstream worker --help``)."""

    model_config = SettingsConfigDict(env_prefix="KVSTREAM_", frozen=True, extra="forbid")

    #: Kafka bootstrap servers, ``HOST:PORT[,HOST:PORT...]`` (no URL scheme).
    bootstrap_servers: BootstrapServers = DEFAULT_BOOTSTRAP_SERVERS
    #: Faust app id: the consumer group of the materializing agent and the prefix of every topic the app owns
    #: (``<app id>-kv-events-by-ownership``, ``<app id>-residency-changelog``, ...). Workers with the same app
    #: id share the partitions; another app id is another, independent set of tables.
    app_id: str = Field("kvstream", min_length=1, description="app id: consumer group and topic prefix")
    #: Put in front of every topic name the app reads or creates (``kv-events`` included) and of its consumer
    #: groups, for clusters whose ACLs grant a prefix; empty: none (schemas/topics.py).
    topic_prefix: str = Field("", description="prefix of every topic name and consumer group; empty: none")
    #: A Confluent-compatible schema registry (``kvstream registry start`` prints one): every topic written for
    #: others then carries the Confluent wire format, its schema registered under ``<topic>-value``; empty:
    #: single-object framing, writer schemas published to the schemas topic (docs/registry.md).
    schema_registry_url: RegistryUrl = schema_registry_field()
    #: Partitions of kv-events and of every topic and table of the app (Faust needs them co-partitioned).
    partitions: int = Field(DEFAULT_PARTITIONS, ge=1, description="partitions of kv-events and the app's topics")
    #: Store of the residency table: ``rocksdb://`` keeps it on disk in ``data_dir`` (a restart reads only
    #: the changelog written since); ``memory://`` holds it in RAM and rebuilds it from the whole changelog
    #: at every start. The small tables are always in memory.
    store: Literal["rocksdb://", "memory://"] = Field("rocksdb://", description="residency table store")
    #: Local state directory: RocksDB databases and Faust's own files.
    data_dir: Path = Field(Path(".kvstream/worker"), description="local state directory")
    #: HTTP port of the views and of the lookups other workers forward to this one.
    web_port: int = Field(6066, ge=1, le=65535, description="HTTP port")
    #: Address the HTTP server binds to.
    web_bind: str = Field("127.0.0.1", description="HTTP bind address")
    #: Host name or address other workers reach this one at (lookups of keys this worker holds go there).
    web_host: str = Field("127.0.0.1", description="host name other workers reach this worker at")
    #: Publish every residency transition to ``<app id>-kv-residency-changes`` (what ``kvstream export`` and
    #: ``kvstream report`` read). Off unless asked for: it is about 0.8 messages per input event, more than
    #: the changelogs (docs/querying.md, "Output topics").
    residency_changes: bool = Field(False, description="publish every residency transition to "
                                                       "<app id>-kv-residency-changes (for analytics)")
    #: Tiers an ``AllBlocksCleared`` removes: ``gpu`` (vLLM's meaning: a prefix-cache reset) or ``all``,
    #: then per-instance overrides, e.g. ``gpu,engine-7=all``.
    clear_scope: str = Field("gpu", description="tiers an AllBlocksCleared removes: gpu|all[,INSTANCE=gpu|all...]")
    #: World size and mode of sources whose events do not declare them: ``engine-3=2:REPLICATED,...``
    #: (docs/residency.md, "Aggregation across workers"). Empty: every such source has one worker.
    aggregation: str = Field("", description="INSTANCE=WORLD_SIZE[:REPLICATED|SHARDED][,...] for sources "
                                             "whose events do not declare it")
    #: Tier weights of ``POST /prefix-match/``: ``GPU=1.0,CPU=0.8,STORAGE=0.5``; tiers not named weigh 0.25.
    tier_weights: str = Field("", description="tier weights of POST /prefix-match/, e.g. GPU=1.0,CPU=0.8")
    #: Standby replicas of each table partition on other workers. 0 by default: docs/operations.md says why.
    standby_replicas: int = Field(0, ge=0, description="standby replicas of each table partition")
    #: The repartition process forwards at most this many events per batch...
    repartition_batch: int = Field(10_000, ge=1, description="most events the repartition process reads per batch")
    #: ... or, while a whole batch already waits on the broker, what arrives within this many seconds; with
    #: nothing arrived, the longest wait for the first event.
    repartition_within_s: float = Field(0.1, gt=0, description="longest wait of a repartition batch while the "
                                                                "input is backlogged, seconds")
    #: Not backlogged, a batch takes what arrived within this many seconds of the previous batch's read: an
    #: event's wait there. Lower means lower latency and more, smaller messages for the materializing agent.
    repartition_linger_s: float = Field(0.02, ge=0, description="a repartition batch that is not backlogged takes "
                                                                "what arrived within this many seconds of the "
                                                                "previous one, seconds")
    #: Niceness added to the repartition process (``os.nice``): while the input is backlogged the process runs
    #: ahead of the materializing agent, the stage that limits the worker's rate, and on a host with fewer
    #: free cores than busy processes an equal share of the CPU made the agent wait for it. A lower priority
    #: hands that CPU to the agent when both want it and costs nothing when a core is free: the scheduler gives
    #: an idle core to a niced process as to any other (docs/operations.md, "CPU priority of the stages").
    #: 0: the worker's own priority.
    repartition_nice: int = Field(10, ge=0, le=19, description="niceness added to the repartition process, so "
                                                               "that the agent gets the CPU first when both "
                                                               "want it; 0: the worker's own priority")
    #: How the materializing agent reads the re-keyed topic: ``librdkafka``, a consumer of the worker's own that
    #: fetches in librdkafka's C threads and follows Faust's assignment, flow and commits
    #: (stream_apps/rekeyed_reader.py); ``faust``, through Faust's aiokafka consumer like every other topic,
    #: which costs the worker more CPU per message (bench/PROFILE.md, "2026-12-05 afternoon").
    rekeyed_reader: Literal["librdkafka", "faust"] = Field("librdkafka", description="how the agent reads the "
                                                                                     "re-keyed topic: librdkafka "
                                                                                     "(own consumer) or faust")
    #: Each table write is buffered, and every this many seconds the latest value of each key written is
    #: produced to the table's changelog (and at every checkpoint); the global tables' follow
    #: :attr:`global_changelog_interval_s` instead. Standby replicas and the fleet index (its own and every
    #: ``kvstream index`` replica's) follow within it; lower costs more records and CPU (docs/residency.md,
    #: "Changelogs and fleet views").
    changelog_interval_s: float = Field(0.25, ge=0.01, le=60, description="produce each table key's latest "
                                                                          "value to its changelog this often, "
                                                                          "seconds")
    #: The same for the two global tables, ``tier-occupancy`` and ``sources``, and each changed
    #: ``kv-tier-occupancy`` row with them (and at every checkpoint). Every worker reads these changelogs
    #: whole, each record through Faust's recovery path, so their records cost every worker; what follows
    #: them (other workers' ``/occupancy/`` and ``/sources/``, the sources' leases of the other workers and
    #: index replicas, ``kv-tier-occupancy``) lags by up to this much, so it must be at most half of
    #: ``--source-lease-s`` (docs/residency.md, "Changelogs and fleet views").
    global_changelog_interval_s: float = Field(1.0, ge=0.01, le=60, description="produce the global tables' "
                                                                                "(tier-occupancy, sources) "
                                                                                "changelog records this often, "
                                                                                "seconds")
    #: Decoded residency entries cached in front of the store's encoded ones (a block's events come close
    #: together); none: 130,000 with ``rocksdb://`` (at most about 90 MB of decoded entries, ROCKSDB_RESIDENCY_CACHE),
    #: 10,000 with ``memory://``, whose point is a small footprint.
    residency_cache: int | None = Field(None, ge=0, description="decoded residency entries cached in front of the "
                                                               "store; none: 130000 (rocksdb), 10000 (memory)")
    #: RocksDB memtable size of each residency partition database, MiB (two per database).
    rocksdb_write_buffer_mib: int = Field(8, ge=1, description="RocksDB memtable size per residency partition, MiB")
    #: RocksDB block cache of each residency partition database, MiB.
    rocksdb_block_cache_mib: int = Field(16, ge=1, description="RocksDB block cache per residency partition, MiB")
    #: Longest the changelog copy of one rebalance may take before the worker gives up (seconds).
    recovery_timeout_s: float = Field(600.0, gt=0, description="longest changelog copy of one rebalance, seconds")
    #: Seconds without an event or heartbeat after which a source is down: its rows are kept but left out of every
    #: answer (docs/residency.md, "Liveness"). The workers' clock of arrival, not the engine's timestamps.
    source_lease_s: float = Field(30.0, gt=0, description="seconds without an event or heartbeat after which a "
                                                          "source is down (left out of every answer)")
    #: Seconds a source stays down before this worker clears it (a ``SourceUnregistered`` to kv-events); 0: never.
    source_expiry_s: float = Field(600.0, ge=0, description="seconds a down source stays before it is cleared; "
                                                            "0: never")
    #: Log level of the worker and of Faust.
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    #: ``text``, or ``json``: one JSON object per line (kafka_io/logs.py).
    log_format: Literal["text", "json"] = Field("text", description="log format: text, or json (one object per line)")

    # the web port: who may do what, HTTPS, body limits (stream_apps/web_settings.py; docs/security.md)
    api_token_file: ApiTokenFile = None
    read_requires_token: ReadRequiresToken = False
    register_allow_cidr: RegisterAllowCidr = ""
    insecure_http: InsecureHttp = False
    web_tls_cert: WebTlsCert = None
    web_tls_key: WebTlsKey = None
    web_tls_client_ca: WebTlsClientCa = None
    web_tls_ca: WebTlsCa = None
    max_body_bytes: MaxBodyBytes = MAX_BODY_BYTES
    max_tokens: MaxTokens = MAX_TOKENS
    max_hashes: MaxHashes = MAX_CHAIN_BLOCKS
    max_nesting_depth: MaxNestingDepth = MAX_NESTING_DEPTH

    @field_validator("clear_scope")
    @classmethod
    def _valid_clear_scope(cls, value: str) -> str:
        SourceSettings.parse(clear_scope=value)
        return value

    @field_validator("aggregation")
    @classmethod
    def _valid_aggregation(cls, value: str) -> str:
        SourceSettings.parse(aggregation=value)
        return value

    @field_validator("tier_weights")
    @classmethod
    def _valid_tier_weights(cls, value: str) -> str:
        parse_tier_weights(value)
        return value

    @model_validator(mode="after")
    def _global_changelogs_within_the_lease(self) -> "WorkerSettings":
        # Other workers and index replicas learn that a source was heard of only from its sources records, which
        # go out every global_changelog_interval_s: a lease not well above that lapses there between two of them
        if 2 * self.global_changelog_interval_s > self.source_lease_s:
            raise ValueError(f"--global-changelog-interval-s ({self.global_changelog_interval_s:g} s) must be at "
                             f"most half of --source-lease-s ({self.source_lease_s:g} s): other workers and index "
                             "replicas renew a source's lease from its sources records, produced that often")
        return self

    @property
    def residency_cache_entries(self) -> int:
        """``residency_cache``, or its default for the store."""
        if self.residency_cache is not None:
            return self.residency_cache
        return ROCKSDB_RESIDENCY_CACHE if self.store == "rocksdb://" else MEMORY_RESIDENCY_CACHE

    @property
    def topics(self) -> TopicNames:
        """Every topic name of this app."""
        return TopicNames(self.app_id, self.topic_prefix)

    @cached_property
    def sources(self) -> SourceSettings:
        """Clear scopes and aggregation per source, parsed."""
        return SourceSettings.parse(self.clear_scope, self.aggregation)

    @cached_property
    def weights(self) -> dict[str, float]:
        """Tier weights of the prefix match, parsed."""
        return parse_tier_weights(self.tier_weights)
