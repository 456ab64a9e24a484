"""The hand-written Avro encoders accept exactly what fastavro accepts, and write the same bytes, on edge values:
the integer limits of Avro's int and long and beyond, NaN and infinities, None where a field is not nullable,
strings that are not valid UTF-8, empty and large arrays. A record one of them would write unreadably (a long
beyond 64 bits) must be refused, as fastavro refuses it."""

from __future__ import annotations

import copy
import math

import pytest

from producers.split import Publisher, split_event
from schemas import AvroCodec
from schemas.avro_writers import KvEventWriter, ResidencyChangeWriter, ResidencyWriter
from tests.unit.test_writers import CHANGES, ENTRIES

INTS = [0, -1, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1]
DOUBLES = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e308]
STRINGS = ["", "ø 🚀", "\udc80 not UTF-8", None]


def _outcome(encode, record):
    try:
        return "ok", encode(copy.deepcopy(record))
    except (ValueError, TypeError, OverflowError, AttributeError, KeyError, UnicodeEncodeError) as exc:
        return "refused", type(exc).__name__


def _assert_parity(writer_encode, codec: AvroCodec, record: dict, where: str) -> None:
    ours, theirs = _outcome(writer_encode, record), _outcome(codec.encode, record)
    assert ours[0] == theirs[0], f"{where}: hand-written {ours}, fastavro {theirs}"
    if ours[0] == "ok":
        assert ours[1] == theirs[1], where


def _variants(record: dict, path: tuple, values: list):
    for value in values:
        changed = copy.deepcopy(record)
        target = changed
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = value
        yield f"{'.'.join(map(str, path))}={value!r}", changed


def _stored_record() -> dict:
    event = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": 10, "token_ids": [1, 2, 3, 4],
             "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": "a", "group_idx": 0}
    return split_event(Publisher("e", 0, publisher_epoch=1), 7, 1.5, 0, event)[1]


KV_EVENT_FIELDS = {("seq",): INTS, ("batch_index",): INTS, ("publisher_epoch",): INTS,
                   ("data_parallel_rank",): INTS, ("block_index",): INTS, ("block_count",): INTS,
                   ("ts",): DOUBLES, ("instance_id",): STRINGS,
                   ("event", 1, "block_size"): INTS, ("event", 1, "lora_id"): [*INTS, None],
                   ("event", 1, "lora_name"): STRINGS, ("event", 1, "medium"): STRINGS,
                   ("event", 1, "token_ids"): [[], [0] * 5000, [2**31], [2**63], [None], None],
                   ("event", 1, "content_hash"): [*INTS, None]}


@pytest.mark.parametrize("path", list(KV_EVENT_FIELDS), ids=lambda p: ".".join(map(str, p)))
def test_kv_event_writer_accepts_what_fastavro_accepts(path):
    codec = AvroCodec("kv_event")
    writer = KvEventWriter(codec)
    record = _stored_record()
    record["event"] = (record["event"][0], dict(record["event"][1]))
    for where, variant in _variants(record, path, KV_EVENT_FIELDS[path]):
        variant["event"] = tuple(variant["event"])
        _assert_parity(writer.encode, codec, variant, where)


@pytest.mark.parametrize("field, values", [("copies", INTS), ("data_parallel_rank", INTS), ("ts", DOUBLES),
                                           ("instance_id", STRINGS), ("ownership", STRINGS), ("cause", STRINGS)])
def test_residency_change_writer_accepts_what_fastavro_accepts(field, values):
    codec = AvroCodec("residency_change")
    writer = ResidencyChangeWriter(codec)
    for where, variant in _variants(CHANGES["everything set"], (field,), values):
        _assert_parity(writer.encode, codec, variant, where)


@pytest.mark.parametrize("path, values", [
    (("rows", 0, "copies"), INTS), (("rows", 0, "since"), [*DOUBLES, None]), (("rows", 0, "last_ts"), DOUBLES),
    (("rows", 0, "instance_id"), STRINGS), (("rows", 0, "workers", 0, "seq"), INTS),
    (("rows", 0, "workers", 0, "count"), INTS), (("rows", 0, "workers", 0, "content"), [*INTS, None]),
    (("ownership",), STRINGS), (("rows",), [[], None]), (("content_hash",), [*INTS, None]),
    (("parent_block_hash",), [b"", bytes(64), None, "not bytes", 5])])
def test_residency_writer_accepts_what_fastavro_accepts(path, values, hotpath):
    codec = AvroCodec("residency")
    writer = ResidencyWriter(codec)
    entry = next(e for e in ENTRIES.values() if e["rows"] and e["rows"][0]["workers"])
    for where, variant in _variants(entry, path, values):
        _assert_parity(writer.encode, codec, variant, where)
