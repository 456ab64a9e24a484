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


_WRITER = """
import os, sys
from rocksdict import Rdict, WriteBatch
from stream_apps.store_settings import ResidencyRocksDBOptions, residency_rocksdb_options, residency_write_options

path, flushed_batches, batches, end = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
db = Rdict(path, options=ResidencyRocksDBOptions(**residency_rocksdb_options()).as_options())
options = residency_write_options()
for n in range(batches):
    batch = WriteBatch(raw_mode=True)
    for i in range(100):
        batch.put(b"primary/%016x" % (n * 100 + i), b"v%d" % n)
    batch.put(b"__offset__", b"%d" % n)  # as persist() does: the changelog offset the batch reaches
    db.write(batch, options)
    if n + 1 == flushed_batches:
        db.flush()
if end == "close":
    db.close()
else:
    os._exit(0)  # a crash: no close, no flush
"""


def _write_then_end(tmp_path, flushed_batches: int, batches: int, end: str) -> tuple[bytes | None, list]:
    """Run _WRITER in a child process; then the database's offset and every batch's first and last value."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", _WRITER, str(tmp_path), str(flushed_batches), str(batches), end],
                   check=True, timeout=120)
    db = Rdict(str(tmp_path), options=ResidencyRocksDBOptions(**residency_rocksdb_options()).as_options())
    try:
        values = [(db.get(b"primary/%016x" % (n * 100)), db.get(b"primary/%016x" % (n * 100 + 99)))
                  for n in range(batches)]
        return db.get(b"__offset__"), values
    finally:
        db.close()


def test_writes_without_the_wal_come_back_from_a_crash_as_of_the_last_flush(tmp_path):
    """The residency databases skip the WAL (residency_write_options): a process killed before a flush loses the
    memtable whole, so the offset on disk and the entries are those of one prefix of the batches, from which the
    changelog copy reads on."""
    offset, values = _write_then_end(tmp_path, flushed_batches=3, batches=8, end="crash")
    assert offset == b"2"
    assert values == [(b"v%d" % n, b"v%d" % n) for n in range(3)] + [(None, None)] * 5


def test_writes_without_the_wal_are_on_disk_after_a_clean_close(tmp_path):
    offset, values = _write_then_end(tmp_path, flushed_batches=0, batches=8, end="close")
    assert offset == b"7"
    assert values == [(b"v%d" % n, b"v%d" % n) for n in range(8)]
