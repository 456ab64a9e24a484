"""The residency table's keys and their partitions: ``<ownership or primary>/<block hash hex>``, placed by Kafka's
murmur2 partitioner as Faust's router and Java clients place them (docs/architecture.md, "Topics")."""

from __future__ import annotations

from murmurhash2 import murmurhash2

#: Table-key prefix for ownership null: the serving framework's own tiers.
PRIMARY = "primary"


def residency_key(ownership: str | None, block_hash: bytes) -> str:
    """Table and repartition key: ``<ownership or 'primary'>/<block hash hex>``."""
    return f"{ownership or PRIMARY}/{block_hash.hex()}"


#: Seed of Kafka's murmur2 partitioner (``org.apache.kafka.common.utils.Utils.murmur2``).
KAFKA_MURMUR2_SEED = 0x9747B28C


def key_partition(key: str, partitions: int) -> int:
    """Partition of a residency key: Kafka's murmur2 of its UTF-8 bytes, as Faust's router and Java clients compute.

    ``positive(murmur2(key)) % partitions``, the rule of Kafka's default partitioner and of aiokafka's
    ``murmur2`` (which Faust's router uses). The hash comes from the ``murmurhash2`` package (compiled, many
    times faster than aiokafka's pure-Python one); ``tests/unit/test_residency.py`` checks it against Kafka's own
    test vectors and against aiokafka's on random keys.
    """
    return (murmurhash2(key.encode(), KAFKA_MURMUR2_SEED) & 0x7FFFFFFF) % partitions


def block_key(ownership: str | None, block_hash: bytes, partitions: int) -> tuple[int, bytes]:
    """``(partition, key)`` of a block event in the repartition stage: its :func:`residency_key` in UTF-8 and
    that key's :func:`key_partition`. ``schemas._hotpath.block_key`` is the compiled twin (same results; the
    repartition stage uses it where it is built)."""
    key = residency_key(ownership, block_hash).encode()
    return (murmurhash2(key, KAFKA_MURMUR2_SEED) & 0x7FFFFFFF) % partitions, key
