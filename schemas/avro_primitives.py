"""Avro binary encoding of the primitives the hand-written writers are built from, byte for byte as fastavro
writes them: ``avro_long`` (``int`` and ``long``), ``avro_double``, ``avro_bytes``, ``avro_string``,
``avro_int_array`` and the ``["null", X]`` unions (``avro_optional``, ``avro_optional_string``), following the
Avro specification's binary encoding.

:data:`SMALL_INTS` and :data:`BRANCH_1` are public for the writers that encode small ints and union branches in
line (:mod:`schemas.avro_writers`, :mod:`schemas.kv_event_writer`).
"""

from __future__ import annotations

import struct

#: Avro ``long``: a signed 64-bit integer.
LONG_MIN, LONG_MAX = -(1 << 63), (1 << 63) - 1


#: Varint bytes of every 14-bit chunk (both bytes with the continuation bit), and of the last 8 bits of a varint of
#: 57 to 64 bits: a 64-bit hash's varint in five lookups, about half the loop's time.
_VARINT_14 = [bytes((i & 0x7F | 0x80, i >> 7 | 0x80)) for i in range(1 << 14)]
_VARINT_TAIL = [bytes((i,)) if i < 0x80 else bytes((i & 0x7F | 0x80, i >> 7)) for i in range(256)]


def _zigzag_varint(n: int) -> bytes:
    """Avro ``int``/``long``: zig-zag, then a little-endian base-128 varint.

    Raises:
        OverflowError: ``n`` is outside Avro's long range (fastavro refuses it too; the zig-zag of a larger
            int would be a varint no reader can read back).
    """
    if not LONG_MIN <= n <= LONG_MAX:
        raise OverflowError(f"{n} is outside Avro's long range [-2**63, 2**63)")
    n = (n << 1) ^ (n >> 63)
    if n >> 56:  # 9 or 10 bytes: content hashes and digests, one per stored block; four 14-bit chunks and the rest
        return b"".join((_VARINT_14[n & 0x3FFF], _VARINT_14[n >> 14 & 0x3FFF], _VARINT_14[n >> 28 & 0x3FFF],
                         _VARINT_14[n >> 42 & 0x3FFF], _VARINT_TAIL[n >> 56]))
    # one, two and three bytes (|n| below 2**20: batch seqs, offsets) without the loop, which is slower
    if n < 0x80:
        return bytes((n,))
    if n < 0x4000:
        return bytes((n & 0x7F | 0x80, n >> 7))
    if n < 0x200000:
        return bytes((n & 0x7F | 0x80, n >> 7 & 0x7F | 0x80, n >> 14))
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


#: Encodings of the ints -1024..4095, the positions, counts and indexes most records carry
#: (ResidencyWriter.encode writes these bounds in line).
_SMALL_MIN, _SMALL_MAX = -1024, 4095
SMALL_INTS = [_zigzag_varint(n) for n in range(_SMALL_MIN, _SMALL_MAX + 1)]
#: Avro ``double``: 8 bytes, little-endian IEEE 754.
avro_double = struct.Struct("<d").pack


def avro_long(n: int) -> bytes:
    """Avro binary encoding of an ``int`` or ``long`` (the same varint), as fastavro writes it."""
    if _SMALL_MIN <= n <= _SMALL_MAX:
        return SMALL_INTS[n - _SMALL_MIN]
    return _zigzag_varint(n)


def avro_bytes(value: bytes) -> bytes:
    """Avro ``bytes``: length, then the bytes."""
    return avro_long(len(value)) + value


def avro_string(value: str) -> bytes:
    """Avro ``string``: length of the UTF-8 bytes, then the bytes."""
    return avro_bytes(value.encode())


def avro_int_array(values: list[int]) -> bytes:
    """Avro ``{"type": "array", "items": "int"}`` as fastavro writes it: one block of all items, then 0.

    Raises:
        TypeError: ``values`` is None or holds a non-integer (fastavro refuses both).
    """
    if not len(values):
        return b"\x00"
    return b"".join([avro_long(len(values)), *map(avro_long, values), b"\x00"])


#: ``["null", X]`` with null: union branch 0.
AVRO_NULL = b"\x00"
#: ``["null", X]`` with a value: union branch 1, then the value's encoding.
BRANCH_1 = b"\x02"


def avro_optional(value, encode) -> bytes:
    """Avro ``["null", X]``: branch 0 for None, else branch 1 and ``encode(value)``."""
    return AVRO_NULL if value is None else BRANCH_1 + encode(value)


def avro_optional_string(value: str | None) -> bytes:
    """Avro ``["null", "string"]``: :func:`avro_optional` with :func:`avro_string`, in one call."""
    return AVRO_NULL if value is None else BRANCH_1 + avro_string(value)
