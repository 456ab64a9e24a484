"""Block keys: the u64 the fleet index's block table keys a block by, from its canonical hash or from a
residency table key. Its own module, imported by both :mod:`stream_apps.index.table` and the compiled
``_table.pyx`` (whose ``residency_key_block`` falls back to the reference here).
"""

from __future__ import annotations

import xxhash

#: Residency-table key prefix of ownership null (``stream_apps.residency.PRIMARY``).
PRIMARY = "primary"


def block_key(canonical_hash: bytes) -> int:
    """The u64 block key of a canonical block hash: an 8-byte hash read big-endian (vLLM's and SGLang's
    64-bit hashes are their own keys), any other length (sha256 hashes: 32 bytes) its XXH3-64."""
    if len(canonical_hash) == 8:
        return int.from_bytes(canonical_hash, "big")
    return xxhash.xxh3_64_intdigest(canonical_hash)


def residency_key_block(key: bytes) -> tuple[str | None, int]:
    """``(ownership, block key)`` of a residency table key ``<ownership or primary>/<block hash hex>`` as bytes
    (a changelog record's key): ownership None for ``primary``, the block key :func:`block_key` of the hash.
    The reference of the compiled ``_table.residency_key_block``.

    Raises:
        ValueError: the key is not UTF-8 (UnicodeDecodeError), or what follows its last ``/`` is not hex.
    """
    ownership, _, hex_hash = key.decode().rpartition("/")
    return (None if ownership == PRIMARY else ownership), block_key(bytes.fromhex(hex_hash))
