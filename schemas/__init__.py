"""The event contract: what a KV cache event is once it is in Kafka.

* ``kv_event_v6.avsc`` (and v1 to v5): one block-level KV event (topic ``kv-events``).
* ``residency_v3.avsc`` (and v1, v2): one residency-table entry (the stream app's changelog).
* ``tier_occupancy_v1.avsc``, ``clear_watermark_v1.avsc``: the stream app's other tables.
* ``ownership_batch_v1.avsc``: the stream app's repartition topic ``<app id>-kv-events-by-ownership``.
* :mod:`schemas.codec`: fastavro codec with single-object framing.
* :mod:`schemas.block_hash`: canonical block hashes.
* :mod:`schemas.tiers`: medium strings to canonical tiers.
"""

from schemas.block_hash import InvalidBlockHash, canonical_block_hash, parse_block_hash
from schemas.codec import AvroCodec, DecodeError
from schemas.tiers import TIERS, tier_of

#: Full Avro names of the event union branches, as fastavro returns them.
BLOCK_STORED = "kvstream.v1.BlockStored"
BLOCK_REMOVED = "kvstream.v1.BlockRemoved"
ALL_BLOCKS_CLEARED = "kvstream.v1.AllBlocksCleared"
#: Events the bridge makes itself (schema v2): the publisher restarted / batches were lost for good.
PUBLISHER_RESTARTED = "kvstream.v1.PublisherRestarted"
SOURCE_STALE = "kvstream.v1.SourceStale"
#: Events the producers make for liveness (schema v4): the source is alive / the source was deregistered.
SOURCE_HEARTBEAT = "kvstream.v1.SourceHeartbeat"
SOURCE_UNREGISTERED = "kvstream.v1.SourceUnregistered"
#: The bridge saw its engine go (schema v6): its ZMQ connection dropped, or its replay socket stopped answering.
SOURCE_DISCONNECTED = "kvstream.v1.SourceDisconnected"
#: Not an Avro branch: the residency rules' kind of a BlockStored whose source runs in vLLM's full report mode
#: (kv_event v5 ``BlockStored.report_mode`` ``"full"``), which may re-announce a block it already holds
#: (``stream_apps.residency.apply_block``). The block events of the materializing stage carry it.
BLOCK_STORED_OR_REUSED = "kvstream.v1.BlockStored/full-report"
#: The kinds of a block event that stores: :data:`BLOCK_STORED` and :data:`BLOCK_STORED_OR_REUSED`.
STORE_KINDS = frozenset({BLOCK_STORED, BLOCK_STORED_OR_REUSED})
#: The ``report_mode`` (kv_event v5) of a source that re-announces reused blocks (vLLM PR #45261).
FULL_REPORT_MODE = "full"
#: Events without a block hash, written to every partition of kv-events.
SOURCE_WIDE_EVENTS = frozenset({ALL_BLOCKS_CLEARED, PUBLISHER_RESTARTED, SOURCE_STALE, SOURCE_HEARTBEAT,
                                SOURCE_UNREGISTERED, SOURCE_DISCONNECTED})

__all__ = [
    "ALL_BLOCKS_CLEARED",
    "BLOCK_REMOVED",
    "BLOCK_STORED",
    "BLOCK_STORED_OR_REUSED",
    "FULL_REPORT_MODE",
    "PUBLISHER_RESTARTED",
    "SOURCE_DISCONNECTED",
    "SOURCE_HEARTBEAT",
    "SOURCE_STALE",
    "SOURCE_UNREGISTERED",
    "SOURCE_WIDE_EVENTS",
    "STORE_KINDS",
    "TIERS",
    "AvroCodec",
    "DecodeError",
    "InvalidBlockHash",
    "canonical_block_hash",
    "parse_block_hash",
    "tier_of",
]
