"""The residency table's RocksDB settings (stream_apps/store_settings.py)."""

import pytest
from rocksdict import Rdict, WriteBatch

from stream_apps.store_settings import (
    BLOOM_BITS_PER_KEY,
    MEMTABLE_BLOOM_RATIO,
    MIB,
    ResidencyRocksDBOptions,
    residency_rocksdb_options,
)


def test_defaults_bound_memtables_and_block_cache_per_partition():
    options = residency_rocksdb_options()
    assert options == {"write_buffer_size": 8 * MIB, "max_write_buffer_number": 2, "block_cache_size": 16 * MIB,
                       "bloom_filter_size": BLOOM_BITS_PER_KEY, "memtable_bloom_ratio": MEMTABLE_BLOOM_RATIO}


def test_sizes_are_given_in_mib():
    options = residency_rocksdb_options(write_buffer_mib=32, block_cache_mib=128)
    assert options["write_buffer_size"] == 32 * MIB
    assert options["block_cache_size"] == 128 * MIB


@pytest.mark.parametrize("value", [0, -1])
def test_a_bad_size_is_refused_with_its_name(value):
    with pytest.raises(ValueError, match="block_cache_mib"):
        residency_rocksdb_options(block_cache_mib=value)


@pytest.mark.parametrize("ratio", [-0.1, 0.3])
def test_a_memtable_filter_ratio_outside_rocksdbs_range_is_refused(ratio):
    with pytest.raises(ValueError, match="memtable_bloom_ratio"):
        ResidencyRocksDBOptions(memtable_bloom_ratio=ratio)


def test_the_memtable_filter_stays_out_of_fausts_extra_options():
    # Faust passes extra_options to python-rocksdb's Options, which knows no memtable_bloom_ratio
    options = ResidencyRocksDBOptions(**residency_rocksdb_options())
    assert options.extra_options == {}
    assert options.bloom_filter_size == BLOOM_BITS_PER_KEY


def _fill(path, options, keys: range) -> None:
    db = Rdict(str(path), options=options.as_options())
    batch = WriteBatch(raw_mode=True)
    for i in keys:
        batch.put(f"primary/{i:016x}".encode(), b"v%d" % i)
    db.write(batch)
    db.flush()  # into an SST file, written with these options' filter
    db.close()


def test_databases_written_with_fausts_default_filter_read_with_the_new_options(tmp_path):
    """A worker upgraded in place opens the databases its previous version wrote (3-bit filters)."""
    from faust.stores.rocksdb import RocksDBOptions

    old = RocksDBOptions(**{k: v for k, v in residency_rocksdb_options().items()
                            if k not in ("bloom_filter_size", "memtable_bloom_ratio")})
    new = ResidencyRocksDBOptions(**residency_rocksdb_options())
    _fill(tmp_path, old, range(0, 2000))
    _fill(tmp_path, new, range(2000, 4000))  # one SST file of each filter, and then the memtable
    db = Rdict(str(tmp_path), options=new.as_options())
    db[b"primary/in-memtable"] = b"m"
    try:
        for i in (0, 1999, 2000, 3999):
            assert db.get(f"primary/{i:016x}".encode()) == b"v%d" % i
        assert db.get(b"primary/in-memtable") == b"m"
        assert [db.get(f"primary/{i:016x}".encode()) for i in range(4000, 4100)] == [None] * 100
    finally:
        db.close()
