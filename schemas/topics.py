"""Topic names of the pipeline: part of the contract, named after what they carry (docs/architecture.md, "Topics")."""

#: Block-level KV events from every producer, Avro ``kv_event``, key = canonical block hash.
KV_EVENTS = "kv-events"
#: Stream-app repartition topic: the same events re-keyed by ``<ownership or primary>/<block hash hex>``, carried in
#: ``ownership_batch`` messages, one per destination partition (the key's murmur2 partition) and read batch.
KV_EVENTS_BY_OWNERSHIP = "kv-events-by-ownership"


def by_ownership_topic(app_id: str) -> str:
    """The repartition topic of one stream app: ``<app id>-kv-events-by-ownership``.

    App-scoped, as Kafka Streams names its repartition topics: two apps on one cluster (say, two clear
    scopes) must not read each other's batches.
    """
    return f"{app_id}-{KV_EVENTS_BY_OWNERSHIP}"
#: Records that could not be decoded or applied, with the reason in the ``kvstream-error`` header.
KV_EVENTS_DEAD_LETTER = "kv-events-dead-letter"
#: Topic configs of the dead-letter topic, whoever creates it: it must take any record it is handed, up to a
#: whole re-keyed batch message (8 MiB, the re-keyed topic's own limit).
DEAD_LETTER_TOPIC_CONFIG = {"max.message.bytes": str(8 << 20)}
#: One record per residency transition (became / stopped being resident), Avro ``residency_change``, key = block hash.
KV_RESIDENCY_CHANGES = "kv-residency-changes"
#: Compacted: resident blocks per partition, ownership, tier and instance (Avro ``tier_occupancy``); sum the
#: partitions' latest values per (ownership, tier, instance) for the fleet's occupancy.
KV_TIER_OCCUPANCY = "kv-tier-occupancy"

#: Optional header of a block record on kv-events, written by the project's producers: the event's ownership in
#: UTF-8, empty for the primary tiers (ownership null). The stream app's repartition stage routes a record by it
#: without decoding it and decodes records that lack it; the materializing stage dead-letters a record whose
#: ownership contradicts it. Other consumers can ignore it.
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


def changelog_topic(app_id: str, table: str) -> str:
    """The changelog topic of a table of the stream app: ``<app id>-<table>-changelog`` (Faust's name)."""
    return f"{app_id}-{table}-changelog"


def source_clears_topic(app_id: str) -> str:
    """The compacted topic of the repartition process's clear history: ``<app id>-repartition-source-clears``
    (schemas/source_clears_v1.avsc, keyed ``<kv-events partition>/<instance>/<dp rank>``)."""
    return f"{app_id}-repartition-source-clears"


def topic_family(topic: str) -> str | None:
    """Schema family of the values of any topic the pipeline writes, or None for raw bytes (dead letters, topics
    it does not know). Per-app topics are recognised by their suffix, whatever the app id."""
    fixed = {KV_EVENTS: "kv_event", KV_RESIDENCY_CHANGES: "residency_change", KV_TIER_OCCUPANCY: "tier_occupancy"}
    if topic in fixed:
        return fixed[topic]
    if topic.endswith("-" + KV_EVENTS_BY_OWNERSHIP):
        return "ownership_batch"
    if topic.endswith(source_clears_topic("")):
        return "source_clears"
    return next((family for table, family in TABLE_FAMILIES.items() if topic.endswith(f"-{table}-changelog")),
                None)
