"""The residency table's RocksDB settings (stream_apps/store_settings.py)."""

import pytest

from stream_apps.store_settings import MIB, residency_rocksdb_options


def test_defaults_bound_memtables_and_block_cache_per_partition():
    options = residency_rocksdb_options()
    assert options == {"write_buffer_size": 8 * MIB, "max_write_buffer_number": 2, "block_cache_size": 16 * MIB}


def test_sizes_are_given_in_mib():
    options = residency_rocksdb_options(write_buffer_mib=32, block_cache_mib=128)
    assert options["write_buffer_size"] == 32 * MIB
    assert options["block_cache_size"] == 128 * MIB


@pytest.mark.parametrize("value", [0, -1])
def test_a_bad_size_is_refused_with_its_name(value):
    with pytest.raises(ValueError, match="block_cache_mib"):
        residency_rocksdb_options(block_cache_mib=value)
