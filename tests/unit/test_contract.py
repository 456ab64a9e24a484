"""The event contract: canonical hashes, tiers, the Avro codec and its framing."""

from __future__ import annotations

import struct

import pytest

from schemas import (
    ALL_BLOCKS_CLEARED,
    BLOCK_REMOVED,
    BLOCK_STORED,
    AvroCodec,
    DecodeError,
    InvalidBlockHash,
    canonical_block_hash,
    parse_block_hash,
    tier_of,
)
from schemas.block_hash import original_block_hash
from schemas.codec import schema_versions


def _record(event, block_hash=b"\x00" * 7 + b"\x2a", tier="GPU"):
    return {"instance_id": "i-0", "data_parallel_rank": 1, "worker_rank": None, "world_size": None,
            "aggregation": None, "publisher_epoch": 1767225600000, "seq": 7, "batch_index": 2, "ts": 1767225600.5,
            "block_hash": block_hash, "hash_encoding": "UINT64", "block_index": 0, "block_count": 1, "tier": tier,
            "event": event}


STORED = (BLOCK_STORED, {"parent_block_hash": None, "token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": None,
                         "medium": "GPU", "lora_name": None, "extra_keys": b"\xc0", "group_idx": 0,
                         "kv_cache_spec_kind": "full_attention", "kv_cache_spec_sliding_window": None,
                         "locality": None, "ownership": "kvcr", "session_id": "s-1",
                         "lookahead_token_ids": None, "parent_known": None, "cache_salt": "salt-ø",
                         "token_id_width": None, "content_hash": -(2**63), "report_mode": "full"})
REMOVED = (BLOCK_REMOVED, {"medium": "CPU", "group_idx": 1, "locality": "LOCAL", "ownership": None})


@pytest.mark.parametrize("event", [STORED, REMOVED, (ALL_BLOCKS_CLEARED, {})], ids=["stored", "removed", "cleared"])
def test_codec_round_trips_every_event_type(event):
    codec = AvroCodec("kv_event")
    record = _record(event, block_hash=None if event[0] == ALL_BLOCKS_CLEARED else b"\x01" * 8,
                     tier=None if event[0] == ALL_BLOCKS_CLEARED else "GPU")
    assert codec.decode(codec.encode(record)) == record


def test_single_object_framing_is_c301_plus_little_endian_crc64_fingerprint():
    codec = AvroCodec("kv_event")
    data = codec.encode(_record(REMOVED))
    assert data[:2] == b"\xc3\x01"
    assert data[2:10] == schema_versions("kv_event")[-1].fingerprint
    # the spec's fingerprint of "null" as a check of the byte order fastavro gives (Avro spec: 0x63dd24e7cc258f8a)
    from fastavro.schema import fingerprint
    assert bytes.fromhex(fingerprint('"null"', "CRC-64-AVRO")) == struct.pack("<Q", 0x63DD24E7CC258F8A)


@pytest.mark.parametrize("data, reason", [
    (b"\xc3\x01" + b"\xff" * 8 + b"\x00", "unknown kv_event schema fingerprint"),
    (b"\x7b\x22\x61\x22\x3a\x31\x7d", "unknown framing"),
    (b"\xc3", "too short"),
])
def test_decode_rejects_bad_framing_with_a_reason(data, reason):
    with pytest.raises(DecodeError, match=reason):
        AvroCodec("kv_event").decode(data)


def test_decode_rejects_truncated_and_padded_bodies():
    codec = AvroCodec("kv_event")
    data = codec.encode(_record(STORED))
    with pytest.raises(DecodeError, match="corrupt"):
        codec.decode(data[:-5])
    with pytest.raises(DecodeError, match="trailing bytes"):
        codec.decode(data + b"\x00")


def test_confluent_wire_format_round_trips_through_a_registry():
    codec = AvroCodec("kv_event", registry_url="mock://contract-test", subject="kv-events-value")
    data = codec.encode(_record(REMOVED))
    assert data[:1] == b"\x00"
    schema_id = struct.unpack(">I", data[1:5])[0]
    assert codec.decode(data) == _record(REMOVED)
    # a reader without its own encoding side finds the writer schema in the registry by id
    reader = AvroCodec("kv_event", registry_url="mock://contract-test", subject="kv-events-value")
    assert reader.decode(data)["event"] == REMOVED
    assert schema_id >= 1
    # a schema fetched by id that is a version the reader ships is that version (by fingerprint), so its
    # records take the generated reader as single-object ones do
    reader._registry_ids.clear()
    assert reader.decode(data) == _record(REMOVED)
    assert reader._registry_ids[schema_id] is reader.schema.parsed


def test_confluent_record_without_registry_is_a_clear_error():
    with pytest.raises(DecodeError, match="no schema registry"):
        AvroCodec("kv_event").decode(b"\x00\x00\x00\x00\x01" + b"\x00" * 20)


@pytest.mark.parametrize("value, expected", [
    (42, bytes.fromhex("000000000000002a")),
    (2**64 - 1, b"\xff" * 8),
    (-1, b"\xff" * 8),
    (-7, bytes.fromhex("fffffffffffffff9")),
    (1882140585328457242, bytes.fromhex("1a1eb4e3edd9361a")),  # vLLM's real hash of tokens [1,2,3,4]
    (bytes(31) + b"\x2a", bytes(31) + b"\x2a"),
])
def test_canonical_block_hash(value, expected):
    assert canonical_block_hash(value) == expected


def test_unsigned_and_signed_forms_of_one_hash_are_one_block_but_digest_is_another():
    assert canonical_block_hash(2**64 - 1) == canonical_block_hash(-1)
    assert canonical_block_hash(42) != canonical_block_hash(bytes(31) + b"\x2a")


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, True, 1.5, b"", bytes(65), "ab"])
def test_invalid_block_hashes_are_rejected(value):
    with pytest.raises(InvalidBlockHash):
        canonical_block_hash(value)


@pytest.mark.parametrize("value, encoding", [(2**64 - 1, "UINT64"), (-7, "INT64"), (bytes(32), "BYTES")])
def test_original_hash_is_rebuilt_from_canonical_bytes(value, encoding):
    assert original_block_hash(canonical_block_hash(value), encoding) == value


def test_block_hashes_are_read_as_users_give_them():
    vllm = 0x1A1EB4E3EDD9361A  # 1882425186426320410 as vLLM logs it
    canonical = bytes.fromhex("1a1eb4e3edd9361a")
    assert parse_block_hash("0x1A1EB4E3EDD9361A") == parse_block_hash("1a1eb4e3edd9361a") == canonical
    assert parse_block_hash(str(vllm)) == canonical  # vLLM's unsigned decimal
    high = 0xD41BC1F76B956DDE  # at or above 2**63: SGLang's signed form of the same 8 bytes is negative
    assert parse_block_hash(str(high)) == parse_block_hash(str(high - 2**64)) == bytes.fromhex("d41bc1f76b956dde")
    assert parse_block_hash("-1") == parse_block_hash(str(2**64 - 1)) == b"\xff" * 8  # SGLang's -1 is vLLM's 2**64-1
    assert parse_block_hash("0x" + "ab" * 32) == bytes.fromhex("ab" * 32)  # a sha256 digest
    assert parse_block_hash("+1234567890123456") == (1234567890123456).to_bytes(8, "big")  # '+': decimal


@pytest.mark.parametrize("bad", ["3e9", "a1b2c3d4e5f6", "0x1a1eb4e3", "xyz", "", "ab" * 65, str(2**64), "0x",
                                 "1.5", "١٢٣"])
def test_other_block_hash_forms_are_refused_with_the_accepted_ones(bad):
    with pytest.raises(InvalidBlockHash, match="16 or 64 hex digits, optionally 0x-prefixed|64-bit range"):
        parse_block_hash(bad)


@pytest.mark.parametrize("medium, tier", [
    (None, "GPU"), ("GPU", "GPU"), ("gpu", "GPU"), ("CPU", "CPU"), ("cpu", "CPU"), ("CPU_PINNED", "CPU"),
    ("STORAGE", "STORAGE"), ("DISK", "STORAGE"), ("EXTERNAL", "EXTERNAL"), ("NVME_X", "UNKNOWN"), ("", "UNKNOWN"),
])
def test_medium_maps_to_canonical_tier(medium, tier):
    assert tier_of(medium) == tier


def test_every_table_schema_parses_and_has_docs_on_every_field():
    import json
    from pathlib import Path

    import schemas

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "record":
                assert node.get("doc"), f"record {node['name']} has no doc"
                for field in node["fields"]:
                    assert field.get("doc"), f"field {node['name']}.{field['name']} has no doc"
                    walk(field["type"])
            elif node.get("type") == "enum":
                assert "default" in node, f"enum {node['name']} has no default symbol"
            else:
                for value in node.values():
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    files = sorted(Path(schemas.__file__).parent.glob("*_v*.avsc"))
    assert len(files) >= 5
    for path in files:
        walk(json.loads(path.read_text()))
        AvroCodec(path.name.rsplit("_v", 1)[0])


@pytest.mark.parametrize("event", [{}, {"block_hashes": [1], "medium": "GPU"}, ("NoSuchBranch", {}), None])
def test_encode_refuses_an_event_whose_union_branch_it_would_have_to_guess(event):
    record = {**_a_block_record(), "event": event}
    with pytest.raises(ValueError, match="field 'event' is a union of records: give \\(branch, record\\)"):
        AvroCodec("kv_event").encode(record)


def test_encode_takes_the_branch_it_is_given():
    record = _a_block_record()
    codec = AvroCodec("kv_event")
    assert codec.decode(codec.encode(record))["event"][0] == record["event"][0]


def _a_block_record() -> dict:
    from producers.split import Publisher, split_event

    event = {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}
    return split_event(Publisher("e", 0, publisher_epoch=1), 0, 1.0, 0, event)[0]


def test_every_schema_file_parses_alone_with_fastavro():
    """Issue 14, item 5: other tools read one .avsc at a time, so each defines the named types it uses."""
    import json
    from pathlib import Path

    import fastavro

    import schemas

    files = sorted(Path(schemas.__file__).parent.glob("*_v*.avsc"))
    assert files, f"no schema file matches *_v*.avsc in {Path(schemas.__file__).parent}"  # else nothing is checked
    for path in files:
        fastavro.parse_schema(json.loads(path.read_text()), named_schemas={})  # a fresh namespace each time


@pytest.mark.parametrize("family", ["residency", "ownership_batch", "residency_change", "tier_occupancy"])
def test_records_written_before_the_schemas_were_self_contained_still_decode(family):
    """These files once referred to types in other files, and fastavro fingerprinted the bare names: records
    written then carry the old fingerprint, and decode as the same v1 schema."""
    from schemas.codec import LEGACY_FINGERPRINTS, SINGLE_OBJECT_MAGIC

    v1 = schema_versions(family)[0]
    assert v1.version == 1 and v1.legacy_fingerprint == bytes.fromhex(LEGACY_FINGERPRINTS[family][1])
    sample = {"residency": {"block_hash": b"\x5a" * 8, "ownership": None, "rows": []},
              "ownership_batch": {"events": []},
              "residency_change": {"block_hash": b"\x5a" * 8, "ownership": None, "instance_id": "e", "tier": "GPU",
                                   "data_parallel_rank": 0, "medium": None, "locality": None, "group_idx": None,
                                   "resident": True, "copies": 1, "ts": 1.5, "cause": "BlockStored"},
              "tier_occupancy": {"ownership": None, "tier": "CPU", "instance_id": "e", "resident_blocks": 3}}[family]
    body = AvroCodec(family, 1).encode(sample)[10:]
    decoded = AvroCodec(family).decode(SINGLE_OBJECT_MAGIC + v1.legacy_fingerprint + body)
    assert {k: decoded[k] for k in sample} == sample


def test_a_writer_schema_from_the_schemas_topic_must_have_the_fingerprint_it_is_published_under():
    """A reader resolves an unknown fingerprint through its writer-schema source, checks the text's own
    fingerprint, and asks again for no fingerprint it was told is unknown."""
    from schemas.codec import SINGLE_OBJECT_MAGIC

    v2, v3 = schema_versions("kv_event")[1:3]
    asked = []

    def source(fingerprint: bytes):
        asked.append(fingerprint)
        return {b"\x01" * 8: v2.text, v3.fingerprint: v3.text}.get(fingerprint)

    reader = AvroCodec("kv_event", 2, writer_schemas=source)
    reader._by_fingerprint.pop(v3.fingerprint)  # as a reader released before v3 existed
    data = AvroCodec("kv_event").encode(_record(REMOVED))
    assert reader.decode(data)["event"] == REMOVED  # v3's record, resolved through the source to v2
    with pytest.raises(DecodeError, match="has fingerprint"):
        reader.decode(SINGLE_OBJECT_MAGIC + b"\x01" * 8 + data[10:])
    with pytest.raises(DecodeError, match="not in the schemas topic"):
        reader.decode(SINGLE_OBJECT_MAGIC + b"\x02" * 8 + data[10:])
    with pytest.raises(DecodeError, match="not in the schemas topic"):
        reader.decode(SINGLE_OBJECT_MAGIC + b"\x02" * 8 + data[10:])
    assert asked.count(b"\x02" * 8) == 1


@pytest.mark.parametrize("url, accepted", [("", ""), ("http://127.0.0.1:8081/", "http://127.0.0.1:8081"),
                                           ("https://reg.example:443/apis/ccompat/v7", None),
                                           ("127.0.0.1:8081", ValueError), ("kafka://x", ValueError)])
def test_schema_registry_urls_are_checked(url, accepted):
    from kafka_io.schema_registry import check_registry_url

    if accepted is ValueError:
        with pytest.raises(ValueError, match="http"):
            check_registry_url(url)
    else:
        assert check_registry_url(url) == (url if accepted is None else accepted)
