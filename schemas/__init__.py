"""The event contract: what a KV cache event is once it is in Kafka.

* ``kv_event_v1.avsc``: one block-level KV event (topic ``kv-events``).
* ``residency_v1.avsc``: one residency-table entry (the stream app's changelog).
* ``tier_occupancy_v1.avsc``, ``clear_watermark_v1.avsc``: the stream app's other tables.
* ``ownership_batch_v1.avsc``: the stream app's repartition topic ``kv-events-by-ownership``.
* :mod:`schemas.codec`: fastavro codec with single-object framing.
* :mod:`schemas.block_hash`: canonical block hashes.
* :mod:`schemas.tiers`: medium strings to canonical tiers.
"""

from schemas.block_hash import InvalidBlockHash, canonical_block_hash, parse_hex_block_hash
from schemas.codec import AvroCodec, DecodeError
from schemas.tiers import TIERS, tier_of

#: Full Avro names of the event union branches, as fastavro returns them.
BLOCK_STORED = "kvstream.v1.BlockStored"
BLOCK_REMOVED = "kvstream.v1.BlockRemoved"
ALL_BLOCKS_CLEARED = "kvstream.v1.AllBlocksCleared"

__all__ = [
    "ALL_BLOCKS_CLEARED",
    "BLOCK_REMOVED",
    "BLOCK_STORED",
    "TIERS",
    "AvroCodec",
    "DecodeError",
    "InvalidBlockHash",
    "canonical_block_hash",
    "parse_hex_block_hash",
    "tier_of",
]
