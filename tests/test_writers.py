"""Hand-written Avro encoders (schemas.codec): byte for byte what fastavro writes, or a refusal."""

from __future__ import annotations

import io

import fastavro
import pytest

from schemas.codec import avro_long

LONG_MIN, LONG_MAX = -(1 << 63), (1 << 63) - 1
#: Around every power of two, both signs: every varint length from 1 to 10 bytes and its boundaries.
LONGS = sorted(n for n in {sign * ((1 << bits) + delta) for bits in range(64) for delta in (-1, 0, 1)
                           for sign in (1, -1)} | {0, -1024, -1025, 4095, 4096, LONG_MIN, LONG_MAX}
               if LONG_MIN <= n <= LONG_MAX)


def _fastavro_long(n: int) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema("long"), n)
    return out.getvalue()


def test_avro_long_writes_fastavros_bytes_for_every_varint_length():
    assert [avro_long(n) for n in LONGS] == [_fastavro_long(n) for n in LONGS]
