"""Topic names of the pipeline: part of the contract, named after what they carry (docs/architecture.md, "Topics").

Two kinds of topic:

- **shared** by every producer and app on a cluster: ``kv-events``, ``kv-events-dead-letter`` and the
  registrations ``kv-instances``;
- **per app** (one stream app = one app id = one set of tables): the re-keyed topic, the clear history, the
  tables' changelogs and the output topics, all named ``<app id>-...``, as Kafka Streams names an
  application's internal topics. Two apps on one cluster (say, two clear scopes) never read or overwrite each
  other's records.

An optional **topic prefix** goes in front of every name (shared and per app), for clusters whose ACLs grant
a prefix to a team. :class:`TopicNames` gives every name of one app; the module constants are the base names.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Block-level KV events from every producer, Avro ``kv_event``, key = canonical block hash.
KV_EVENTS = "kv-events"
#: Records that could not be decoded or applied, with the reason in the ``kvstream-error`` header.
KV_EVENTS_DEAD_LETTER = "kv-events-dead-letter"
#: Compacted: the serving instances routers and operators registered (``POST /register``), Avro
#: ``instance_registration``, key = instance id; a tombstone is an unregistration. Shared: an instance's model,
#: block size and endpoint are facts of the fleet, which every app, index replica and following bridge reads.
KV_INSTANCES = "kv-instances"
#: Per app: the same events re-keyed by ``<ownership or primary>/<block hash hex>``, carried in
#: ``ownership_batch`` messages, one per destination partition (the key's murmur2 partition) and read batch.
KV_EVENTS_BY_OWNERSHIP = "kv-events-by-ownership"
#: Per app: one record per residency transition (became / stopped being resident), Avro ``residency_change``,
#: key = block hash.
KV_RESIDENCY_CHANGES = "kv-residency-changes"
#: Per app, compacted: resident blocks per partition, ownership, tier and instance (Avro ``tier_occupancy``); sum
#: the partitions' latest values per (ownership, tier, instance) for the fleet's occupancy.
KV_TIER_OCCUPANCY = "kv-tier-occupancy"
#: Compacted topic of writer schemas, keyed by fingerprint (hex), for readers without a schema registry
#: (kafka_io.schema_registry); the topic prefix applies.
SCHEMAS = "kvstream-schemas"

#: Topic configs of the dead-letter topic, whoever creates it: it must take any record it is handed, up to a
#: whole re-keyed batch message (8 MiB, the re-keyed topic's own limit).
DEAD_LETTER_TOPIC_CONFIG = {"max.message.bytes": str(8 << 20)}

#: Optional header of a block record on kv-events, written by the project's producers: the event's ownership in
#: UTF-8, empty for the primary tiers (ownership null), for consumers that route records without decoding them.
#: The stream app does not read it: it decodes every record, and the record's ownership decides the key.
OWNERSHIP_HEADER = "kvstream-ownership"

#: Header of a dead-letter record: why it could not be published or applied (UTF-8, at most 1,000 bytes).
ERROR_HEADER = "kvstream-error"
#: Header of a dead-letter record: where its bytes came from (``topic/partition/offset``, or the engine
#: endpoint, seq and event index of a bridge input).
SOURCE_HEADER = "kvstream-source"

#: Table of the stream app -> schema family of its values. Each table's changelog topic is
#: ``<app id>-<table>-changelog`` (:func:`changelog_topic`), keyed by the table key in UTF-8.
TABLE_FAMILIES = {"residency": "residency", "clear-watermarks": "clear_watermark",
                  "publisher-epochs": "clear_watermark", "tier-occupancy": "tier_occupancy",
                  "sources": "source_status"}


def by_ownership_topic(app_id: str) -> str:
    """The re-keyed topic of one stream app: ``<app id>-kv-events-by-ownership``."""
    return f"{app_id}-{KV_EVENTS_BY_OWNERSHIP}"


def changelog_topic(app_id: str, table: str) -> str:
    """The changelog topic of a table of the stream app: ``<app id>-<table>-changelog`` (Faust's name)."""
    return f"{app_id}-{table}-changelog"


def source_clears_topic(app_id: str) -> str:
    """The compacted topic of the repartition process's clear history: ``<app id>-repartition-source-clears``
    (schemas/source_clears_v1.avsc, keyed ``<kv-events partition>/<instance>/<dp rank>``)."""
    return f"{app_id}-repartition-source-clears"


@dataclass(frozen=True)
class TopicNames:
    """Every topic name of one stream app, and the shared ones, with the cluster's topic prefix.

    ``TopicNames("kvstream")`` gives ``kv-events``, ``kvstream-kv-residency-changes``, ...;
    ``TopicNames("kvstream", prefix="team-a.")`` gives ``team-a.kv-events``, ``team-a.kvstream-...``.
    """

    #: The app id (``kvstream worker --app-id``).
    app_id: str = "kvstream"
    #: Put in front of every topic name (``--topic-prefix``); empty: none.
    prefix: str = ""

    @property
    def scoped_app_id(self) -> str:
        """The app id with the prefix: Faust's app id, so its consumer group and topics carry the prefix too."""
        return self.prefix + self.app_id

    @property
    def kv_events(self) -> str:
        return self.prefix + KV_EVENTS

    @property
    def dead_letter(self) -> str:
        return self.prefix + KV_EVENTS_DEAD_LETTER

    @property
    def instances(self) -> str:
        return self.prefix + KV_INSTANCES

    @property
    def by_ownership(self) -> str:
        return by_ownership_topic(self.scoped_app_id)

    @property
    def source_clears(self) -> str:
        return source_clears_topic(self.scoped_app_id)

    @property
    def residency_changes(self) -> str:
        return f"{self.scoped_app_id}-{KV_RESIDENCY_CHANGES}"

    @property
    def tier_occupancy(self) -> str:
        return f"{self.scoped_app_id}-{KV_TIER_OCCUPANCY}"

    @property
    def schemas(self) -> str:
        """The writer schemas of the pipeline's topics, for readers without a registry (shared by every app)."""
        return self.prefix + SCHEMAS

    def changelog(self, table: str) -> str:
        """The changelog topic of ``table``."""
        return changelog_topic(self.scoped_app_id, table)


def topic_family(topic: str) -> str | None:
    """Schema family of the values of any topic the pipeline writes, or None for raw bytes (dead letters, topics
    it does not know). Per-app topics are recognised by their suffix, whatever the app id and prefix."""
    if topic.endswith(KV_EVENTS_DEAD_LETTER):
        return None
    suffixes = {KV_EVENTS_BY_OWNERSHIP: "ownership_batch", "repartition-source-clears": "source_clears",
                KV_RESIDENCY_CHANGES: "residency_change", KV_TIER_OCCUPANCY: "tier_occupancy",
                **{f"{table}-changelog": family for table, family in TABLE_FAMILIES.items()}}
    for suffix, family in suffixes.items():
        if topic.endswith("-" + suffix):
            return family
    return "kv_event" if topic.endswith(KV_EVENTS) else None
