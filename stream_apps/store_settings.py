"""RocksDB settings of the ``residency`` table's store (``--store rocksdb://``).

Faust opens one RocksDB database per table partition with defaults meant for a large dedicated host: 64 MiB
write buffers, up to 3 of them, and a 2 GiB block cache, each per database. With 8 partitions a worker's
memtables alone grow to about 8 x 64 MiB before the first flush. The residency table reads mostly through
the store's cache of decoded entries (``--residency-cache``), so small write buffers and a small block cache
cost little speed.

What does reach RocksDB is mostly a miss: the first event of a new block looks its key up and finds
nothing. Bloom filters answer those without searching: 10 bits per key in the SST files (Faust's default
is 3, which lets about a quarter of the absent keys through to a data block) and a whole-key filter on the
memtables, which otherwise are searched for every absent key and hold most recent keys. Both only change
how a database is read: SST files written with other filter settings keep their own filters and read as
before, and a memtable's filter lives in memory.
"""

from __future__ import annotations

from typing import Any

from faust.stores.rocksdb import RocksDBOptions

MIB = 1 << 20
#: Bits per key of the SST files' Bloom filters (about 1% false positives).
BLOOM_BITS_PER_KEY = 10
#: Size of each memtable's whole-key Bloom filter as a fraction of the write buffer: 0.02 of 8 MiB is 168 KB,
#: about 20 bits per key at the ~100 bytes a residency entry takes in a memtable.
MEMTABLE_BLOOM_RATIO = 0.02


def residency_rocksdb_options(write_buffer_mib: int = 8, block_cache_mib: int = 16) -> dict[str, Any]:
    """Options for the table's ``options=``, per partition database: the keyword arguments of
    :class:`ResidencyRocksDBOptions` (Faust's ``RocksDBOptions`` plus ``memtable_bloom_ratio``).

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
            "block_cache_size": block_cache_mib * MIB, "bloom_filter_size": BLOOM_BITS_PER_KEY,
            "memtable_bloom_ratio": MEMTABLE_BLOOM_RATIO}


class ResidencyRocksDBOptions(RocksDBOptions):
    """Faust's ``RocksDBOptions`` with a whole-key Bloom filter on the memtables (rocksdict only).

    Args:
        memtable_bloom_ratio: the filter's size as a fraction of ``write_buffer_size`` (RocksDB's
            ``memtable_prefix_bloom_size_ratio``, at most 0.25); 0: no memtable filter.
        **kwargs: Faust's ``RocksDBOptions`` arguments.

    Raises:
        ValueError: ``memtable_bloom_ratio`` outside [0, 0.25].
    """

    def __init__(self, *, memtable_bloom_ratio: float = 0.0, **kwargs: Any) -> None:
        if not 0 <= memtable_bloom_ratio <= 0.25:
            raise ValueError(f"memtable_bloom_ratio={memtable_bloom_ratio!r}: expected a fraction of the write "
                             "buffer from 0 to 0.25")
        super().__init__(**kwargs)  # not in Faust's extra_options: python-rocksdb would be given it
        self.memtable_bloom_ratio = memtable_bloom_ratio

    def as_options(self):
        """Faust's options object, with the memtable filter when rocksdict is the driver."""
        options = super().as_options()
        if self.use_rocksdict and self.memtable_bloom_ratio:
            options.set_memtable_prefix_bloom_ratio(self.memtable_bloom_ratio)
            # without a prefix extractor the memtable filter is a whole-key one, which is what gets need
            options.set_memtable_whole_key_filtering(True)
        return options
