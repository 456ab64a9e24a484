"""Schema evolution of kv_event: every version stays in schemas/, and data crosses versions both ways."""

from __future__ import annotations

import copy
import io
import json

import fastavro
import pytest

from producers.split import Publisher, source_event, split_event
from schemas import PUBLISHER_RESTARTED, AvroCodec, DecodeError
from schemas.codec import SCHEMA_DIR

PUBLISHER = Publisher("evolve", publisher_epoch=5)
V1, V2 = AvroCodec("kv_event", 1), AvroCodec("kv_event", 2)


def _stored(parent_known=None) -> dict:
    record = split_event(PUBLISHER, 1, 2.0, 0, {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": 8,
                                               "token_ids": [1], "block_size": 1, "lora_id": None, "medium": "CPU",
                                               "lora_name": None, "ownership": "kvcr"})[0]
    record["event"][1]["parent_known"] = parent_known
    return record


def test_old_writer_new_reader_fills_the_added_field_with_its_default():
    record = _stored()
    body = dict(record["event"][1])
    del body["parent_known"]
    v1_record = {**record, "event": (record["event"][0], body)}
    assert V2.decode(V1.encode(v1_record)) == _stored(parent_known=None)


def test_new_writer_old_reader_drops_the_added_field_and_keeps_the_rest():
    decoded = V1.decode(V2.encode(_stored(parent_known=False)))
    assert "parent_known" not in decoded["event"][1]
    assert decoded["event"][1]["ownership"] == "kvcr" and decoded["block_hash"] == (9).to_bytes(8, "big")


def test_new_event_type_is_a_clear_error_for_an_old_reader():
    record = source_event(PUBLISHER, PUBLISHER_RESTARTED, {"previous_epoch": 4}, -1, 3.0)
    assert V2.decode(V2.encode(record))["event"] == (PUBLISHER_RESTARTED, {"previous_epoch": 4})
    with pytest.raises(DecodeError, match="corrupt kv_event Avro body"):
        V1.decode(V2.encode(record))


def test_a_tier_symbol_from_a_newer_writer_reads_as_the_enum_default():
    """A future schema adds tier HBM; readers of today's schema see UNKNOWN (the enum's default)."""
    future = json.loads((SCHEMA_DIR / "kv_event_v2.avsc").read_text())
    tier_field = next(f for f in future["fields"] if f["name"] == "tier")
    tier_enum = copy.deepcopy(tier_field["type"][1])
    tier_enum["symbols"].append("HBM")
    tier_field["type"][1] = tier_enum
    writer = fastavro.parse_schema(future)
    out = io.BytesIO()
    fastavro.schemaless_writer(out, writer, {**_stored(), "tier": "HBM"})
    read = fastavro.schemaless_reader(io.BytesIO(out.getvalue()), writer, V2.schema.parsed,
                                      return_record_name=True, return_record_name_override=True)
    assert read["tier"] == "UNKNOWN"


def test_every_version_is_kept_and_distinct():
    from schemas.codec import schema_versions

    versions = schema_versions("kv_event")
    assert [v.version for v in versions] == [1, 2]
    assert len({v.fingerprint for v in versions}) == 2
