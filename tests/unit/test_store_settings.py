"""The residency table's RocksDB settings (stream_apps/store_settings.py)."""

import pytest

from stream_apps.store_settings import MIB, residency_rocksdb_options


def test_defaults_bound_memtables_and_block_cache_per_partition():
    options = residency_rocksdb_options({})
    assert options == {"write_buffer_size": 8 * MIB, "max_write_buffer_number": 2, "block_cache_size": 16 * MIB}


def test_settings_come_from_the_environment():
    options = residency_rocksdb_options({"KVSTREAM_ROCKSDB_WRITE_BUFFER_MIB": "32",
                                         "KVSTREAM_ROCKSDB_BLOCK_CACHE_MIB": "128"})
    assert options["write_buffer_size"] == 32 * MIB
    assert options["block_cache_size"] == 128 * MIB


@pytest.mark.parametrize("text", ["0", "-1", "8.5", "lots", ""])
def test_a_bad_setting_is_refused_with_its_name(text):
    with pytest.raises(ValueError, match="KVSTREAM_ROCKSDB_BLOCK_CACHE_MIB"):
        residency_rocksdb_options({"KVSTREAM_ROCKSDB_BLOCK_CACHE_MIB": text})
