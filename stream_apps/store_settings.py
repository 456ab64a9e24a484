"""RocksDB settings of the ``residency`` table's store (``--store rocksdb://``).

Faust opens one RocksDB database per table partition with defaults meant for a large dedicated host: 64 MiB
write buffers, up to 3 of them, and a 2 GiB block cache, each per database. With 8 partitions a worker's
memtables alone grow to about 8 x 64 MiB before the first flush. The residency table reads mostly through
the store's cache of decoded entries (``--residency-cache``), so small write buffers and a small block cache
cost little speed.
"""

from __future__ import annotations

MIB = 1 << 20


def residency_rocksdb_options(write_buffer_mib: int = 8, block_cache_mib: int = 16) -> dict[str, int]:
    """Options for Faust's ``RocksDBOptions`` (the table's ``options=``), per partition database.

    Args:
        write_buffer_mib: memtable size, MiB; two per database, so at most twice this per partition
            (``kvstream worker --rocksdb-write-buffer-mib``).
        block_cache_mib: LRU cache of uncompressed data blocks per partition, MiB
            (``--rocksdb-block-cache-mib``).

    Raises:
        ValueError: a size below 1 MiB.
    """
    for name, value in (("write_buffer_mib", write_buffer_mib), ("block_cache_mib", block_cache_mib)):
        if value < 1:
            raise ValueError(f"{name}={value!r}: expected a positive whole number of MiB")
    return {"write_buffer_size": write_buffer_mib * MIB, "max_write_buffer_number": 2,
            "block_cache_size": block_cache_mib * MIB}
