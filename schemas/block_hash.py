"""Canonical block hashes: one byte string per KV block, whatever the engine sent.

vLLM publishes block hashes as unsigned 64-bit ints by default (the low 8 bytes of
a SHA-256 chain hash, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or as raw digests
(32 bytes for sha256); SGLang publishes signed 64-bit ints. The contract
(docs/contract.md, "Canonical block hash") maps every int to its 8-byte
big-endian two's complement, so ``2**64 - 1`` (vLLM) and ``-1`` (SGLang) are the
same block, and keeps bytes as they are. JSON and HTTP show the hex form.
"""

from __future__ import annotations

_U64 = (1 << 64) - 1
_INT_MIN = -(1 << 63)
_INT_MAX = (1 << 64) - 1

#: Longest byte digest accepted as a block hash (SHA-512 is 64 bytes).
MAX_HASH_BYTES = 64


class InvalidBlockHash(ValueError):
    """A value that cannot be a block hash: wrong type, out of the 64-bit range, or empty/oversized bytes."""


def canonical_block_hash(value: int | bytes | bytearray | memoryview) -> bytes:
    """Return the canonical bytes of an engine's block hash.

    Args:
        value: an int in [-2**63, 2**64) (vLLM unsigned or SGLang signed 64-bit),
            or 1..64 bytes (a raw digest).

    Returns:
        8 bytes (big-endian two's complement) for ints; the bytes unchanged otherwise.

    Raises:
        InvalidBlockHash: for bools, floats, out-of-range ints, empty or oversized bytes.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value < _INT_MIN or value > _INT_MAX:
            raise InvalidBlockHash(f"integer block hash {value} is outside the 64-bit range")
        return (value & _U64).to_bytes(8, "big")
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if not 0 < len(raw) <= MAX_HASH_BYTES:
            raise InvalidBlockHash(f"byte block hash of {len(raw)} bytes (expected 1..{MAX_HASH_BYTES})")
        return raw
    raise InvalidBlockHash(f"block hash of type {type(value).__name__} (expected int or bytes)")


def original_block_hash(canonical: bytes, encoding: str) -> int | bytes:
    """Rebuild the value the engine sent from its canonical bytes and ``hash_encoding``.

    ``UINT64`` gives an unsigned int, ``INT64`` a signed int, ``BYTES`` the bytes.
    """
    if encoding == "UINT64":
        return int.from_bytes(canonical, "big", signed=False)
    if encoding == "INT64":
        return int.from_bytes(canonical, "big", signed=True)
    return canonical


def parse_hex_block_hash(text: str) -> bytes:
    """Parse the hex form used in JSON and HTTP (``0x`` prefix optional).

    Raises:
        InvalidBlockHash: when the text is not even-length hex of 1..64 bytes.
    """
    body = text[2:] if text[:2].lower() == "0x" else text
    try:
        raw = bytes.fromhex(body)
    except ValueError:
        raise InvalidBlockHash(f"block hash {text[:80]!r} is not hex") from None
    if not 0 < len(raw) <= MAX_HASH_BYTES:
        raise InvalidBlockHash(f"block hash of {len(raw)} bytes (expected 1..{MAX_HASH_BYTES})")
    return raw
