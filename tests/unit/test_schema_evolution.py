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
V1, V2, V3, V4 = (AvroCodec("kv_event", version) for version in (1, 2, 3, 4))
#: The BlockStored fields each version added, with their defaults.
ADDED = {2: {"parent_known": None}, 3: {"cache_salt": None, "token_id_width": None}, 4: {"content_hash": None}}
#: Every (older, newer) pair of versions.
PAIRS = [(V1, V2), (V2, V3), (V3, V4), (V1, V3), (V1, V4), (V2, V4)]


def _stored(**body_fields) -> dict:
    record = split_event(PUBLISHER, 1, 2.0, 0, {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": 8,
                                               "token_ids": [1], "block_size": 1, "lora_id": None, "medium": "CPU",
                                               "lora_name": None, "ownership": "kvcr"})[0]
    record["event"][1].update(body_fields)
    return record


def _as_of(record: dict, version: int) -> dict:
    """The record without the BlockStored fields added after ``version``."""
    body = {k: v for k, v in record["event"][1].items()
            if not any(k in fields for v_added, fields in ADDED.items() if v_added > version)}
    return {**record, "event": (record["event"][0], body)}


@pytest.mark.parametrize("old, new", PAIRS, ids=[f"v{o.schema.version}->v{n.schema.version}" for o, n in PAIRS])
def test_old_writer_new_reader_fills_the_added_fields_with_their_defaults(old, new):
    written = _as_of(_stored(), old.schema.version)
    assert new.decode(old.encode(written)) == _as_of(_stored(parent_known=None, cache_salt=None,
                                                             token_id_width=None, content_hash=None),
                                                     new.schema.version)


@pytest.mark.parametrize("old, new", PAIRS, ids=[f"v{n.schema.version}->v{o.schema.version}" for o, n in PAIRS])
def test_new_writer_old_reader_drops_the_added_fields_and_keeps_the_rest(old, new):
    record = _as_of(_stored(parent_known=False, cache_salt="s", token_id_width=2, content_hash=-(2**63)),
                    new.schema.version)
    decoded = old.decode(new.encode(record))
    assert decoded == _as_of(record, old.schema.version)
    assert decoded["event"][1]["ownership"] == "kvcr" and decoded["block_hash"] == (9).to_bytes(8, "big")


def test_new_event_type_is_a_clear_error_for_an_old_reader():
    record = source_event(PUBLISHER, PUBLISHER_RESTARTED, {"previous_epoch": 4}, -1, 3.0)
    assert V2.decode(V2.encode(record))["event"] == (PUBLISHER_RESTARTED, {"previous_epoch": 4})
    with pytest.raises(DecodeError, match="corrupt kv_event Avro body"):
        V1.decode(V2.encode(record))


def test_a_tier_symbol_from_a_newer_writer_reads_as_the_enum_default():
    """A future schema adds tier HBM; readers of today's schema see UNKNOWN (the enum's default)."""
    future = json.loads((SCHEMA_DIR / "kv_event_v4.avsc").read_text())
    tier_field = next(f for f in future["fields"] if f["name"] == "tier")
    tier_enum = copy.deepcopy(tier_field["type"][1])
    tier_enum["symbols"].append("HBM")
    tier_field["type"][1] = tier_enum
    writer = fastavro.parse_schema(future)
    out = io.BytesIO()
    fastavro.schemaless_writer(out, writer, {**_stored(), "tier": "HBM"})
    read = fastavro.schemaless_reader(io.BytesIO(out.getvalue()), writer, V4.schema.parsed,
                                      return_record_name=True, return_record_name_override=True)
    assert read["tier"] == "UNKNOWN"


def test_every_version_is_kept_and_distinct():
    from schemas.codec import schema_versions

    versions = schema_versions("kv_event")
    assert [v.version for v in versions] == [1, 2, 3, 4]
    assert len({v.fingerprint for v in versions}) == 4
