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


#: Hex digits of the hashes the engines publish: an 8-byte int, or a 32-byte sha256 digest.
HEX_DIGITS = (16, 64)
_HEX = frozenset("0123456789abcdefABCDEF")
_FORMS = ("expected 16 or 64 hex digits, optionally 0x-prefixed (e.g. 1a1eb4e3edd9361a, as kvstream prints "
          "hashes), or a decimal integer as vLLM logs it (unsigned, e.g. 1882425186426320410) or SGLang (signed, "
          "e.g. -1882425186426320410)")


def parse_block_hash(text: str) -> bytes:
    """Parse a block hash as a user gives it to the query API or ``kvstream query``; returns its canonical bytes.

    Accepted (docs/querying.md, "Block hashes"):

    - 16 or 64 hex digits, with an optional ``0x``: the form kvstream prints (an 8-byte int, a 32-byte digest);
    - a decimal integer, as vLLM logs its unsigned hashes and SGLang its signed ones, converted with the
      producers' rule (:func:`canonical_block_hash`). A decimal of exactly 16 or 64 digits reads as hex; write
      it with a leading ``+`` to mean decimal.

    Raises:
        InvalidBlockHash: anything else (e.g. 12 hex digits, ``3e9``); the message shows the accepted forms.
    """
    stripped = text.strip()
    digits = stripped[2:] if stripped[:2].lower() == "0x" else None
    if digits is None and len(stripped) in HEX_DIGITS and set(stripped) <= _HEX:
        digits = stripped
    if digits is not None:
        if len(digits) in HEX_DIGITS and set(digits) <= _HEX:
            return bytes.fromhex(digits)
        raise InvalidBlockHash(f"block hash {text[:80]!r}: {len(digits)} hex digits; {_FORMS}")
    sign, number = (stripped[0], stripped[1:]) if stripped[:1] in ("+", "-") else ("", stripped)
    if number.isascii() and number.isdigit():
        return canonical_block_hash(int(sign + number))  # InvalidBlockHash when outside the 64-bit range
    raise InvalidBlockHash(f"block hash {text[:80]!r}: {_FORMS}")
