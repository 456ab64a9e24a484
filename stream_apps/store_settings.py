"""RocksDB settings of the ``residency`` table's store (``--store rocksdb://``).

Faust opens one RocksDB database per table partition with defaults meant for a
large dedicated host: 64 MiB write buffers, up to 3 of them, and a 2 GiB block
cache, each per database. With 8 partitions a worker's memtables alone grow to
about 8 x 64 MiB before the first flush, which is most of the RSS growth seen at
10 million rows (about 100 bytes per row). The residency table reads mostly
through stage 2's cache of decoded entries (``KVSTREAM_RESIDENCY_CACHE``), so
small write buffers and a small block cache cost little speed.
"""

from __future__ import annotations

import os
from typing import Mapping

MIB = 1 << 20


def residency_rocksdb_options(environ: Mapping[str, str] | None = None) -> dict[str, int]:
    """Options for Faust's ``RocksDBOptions`` (the table's ``options=``), per partition database.

    Read from ``KVSTREAM_ROCKSDB_WRITE_BUFFER_MIB`` (default 8: memtable size, MiB; two per database, so
    at most 16 MiB of memtables per partition) and ``KVSTREAM_ROCKSDB_BLOCK_CACHE_MIB`` (default 16: LRU
    cache of uncompressed data blocks per partition, MiB).

    Raises:
        ValueError: a setting is not a positive integer.
    """
    environ = os.environ if environ is None else environ
    settings = {}
    for name, default in (("KVSTREAM_ROCKSDB_WRITE_BUFFER_MIB", 8), ("KVSTREAM_ROCKSDB_BLOCK_CACHE_MIB", 16)):
        text = environ.get(name, str(default))
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"{name}={text!r}: expected a positive whole number of MiB")
        settings[name] = int(text) * MIB
    return {"write_buffer_size": settings["KVSTREAM_ROCKSDB_WRITE_BUFFER_MIB"], "max_write_buffer_number": 2,
            "block_cache_size": settings["KVSTREAM_ROCKSDB_BLOCK_CACHE_MIB"]}
