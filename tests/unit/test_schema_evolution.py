"""Schema evolution of kv_event: every version stays in schemas/, and data crosses versions both ways."""

from __future__ import annotations

import copy
import io
import json

import fastavro
import pytest

from producers.split import Publisher, source_event, split_event
from schemas import PUBLISHER_RESTARTED, SOURCE_DISCONNECTED, SOURCE_HEARTBEAT, AvroCodec, DecodeError
from schemas.codec import SCHEMA_DIR

PUBLISHER = Publisher("evolve", publisher_epoch=5)
V1, V2, V3, V4, V5, V6 = (AvroCodec("kv_event", version) for version in (1, 2, 3, 4, 5, 6))
VERSIONS = (V1, V2, V3, V4, V5, V6)
#: The BlockStored fields each version added, with their defaults (version 6 added an event type only).
ADDED = {2: {"parent_known": None}, 3: {"cache_salt": None, "token_id_width": None}, 4: {"content_hash": None},
         5: {"report_mode": None}}
#: Every (older, newer) pair of versions.
PAIRS = [(old, new) for i, old in enumerate(VERSIONS) for new in VERSIONS[i + 1:]]


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
    defaults = {name: value for version, fields in ADDED.items() if version > old.schema.version
                for name, value in fields.items()}
    assert new.decode(old.encode(written)) == _as_of(_stored(**defaults), new.schema.version)


@pytest.mark.parametrize("old, new", PAIRS, ids=[f"v{n.schema.version}->v{o.schema.version}" for o, n in PAIRS])
def test_new_writer_old_reader_drops_the_added_fields_and_keeps_the_rest(old, new):
    record = _as_of(_stored(parent_known=False, cache_salt="s", token_id_width=2, content_hash=-(2**63),
                            report_mode="full"), new.schema.version)
    decoded = old.decode(new.encode(record))
    assert decoded == _as_of(record, old.schema.version)
    assert decoded["event"][1]["ownership"] == "kvcr" and decoded["block_hash"] == (9).to_bytes(8, "big")


def test_new_event_type_is_a_clear_error_for_an_old_reader():
    record = source_event(PUBLISHER, PUBLISHER_RESTARTED, {"previous_epoch": 4}, -1, 3.0)
    assert V2.decode(V2.encode(record))["event"] == (PUBLISHER_RESTARTED, {"previous_epoch": 4})
    with pytest.raises(DecodeError, match="corrupt kv_event Avro body"):
        V1.decode(V2.encode(record))


def test_a_source_disconnected_is_read_by_v6_and_a_clear_error_for_older_readers():
    """Version 6's new event: a v6 reader (today's) reads it; a reader of v5 or older cannot decode it and says so
    (the repartition process dead-letters such a record with the reason), while the older events still cross."""
    record = source_event(PUBLISHER, SOURCE_DISCONNECTED, {"reason": "disconnected"}, 41, 3.0)
    written = V6.encode(record)
    assert V6.decode(written) == {**record, "event": (SOURCE_DISCONNECTED, {"reason": "disconnected"})}
    assert V6.decode(V6.encode(source_event(PUBLISHER, SOURCE_DISCONNECTED, {}, -1, 3.0)))["event"] == (
        SOURCE_DISCONNECTED, {"reason": None})
    for old in (V4, V5):
        with pytest.raises(DecodeError, match="kv_event"):
            old.decode(written)
        heartbeat = source_event(PUBLISHER, SOURCE_HEARTBEAT, {"evidence": "replay"}, 41, 3.0)
        assert old.decode(V6.encode(heartbeat))["event"] == (SOURCE_HEARTBEAT, {"evidence": "replay"})


def test_a_tier_symbol_from_a_newer_writer_reads_as_the_enum_default():
    """A future schema adds tier HBM; readers of today's schema see UNKNOWN (the enum's default)."""
    future = json.loads((SCHEMA_DIR / "kv_event_v6.avsc").read_text())
    tier_field = next(f for f in future["fields"] if f["name"] == "tier")
    tier_enum = copy.deepcopy(tier_field["type"][1])
    tier_enum["symbols"].append("HBM")
    tier_field["type"][1] = tier_enum
    writer = fastavro.parse_schema(future)
    out = io.BytesIO()
    fastavro.schemaless_writer(out, writer, {**_stored(), "tier": "HBM"})
    read = fastavro.schemaless_reader(io.BytesIO(out.getvalue()), writer, V6.schema.parsed,
                                      return_record_name=True, return_record_name_override=True)
    assert read["tier"] == "UNKNOWN"


def test_every_version_is_kept_and_distinct():
    from schemas.codec import schema_versions

    versions = schema_versions("kv_event")
    assert [v.version for v in versions] == [1, 2, 3, 4, 5, 6]
    assert len({v.fingerprint for v in versions}) == 6


RESIDENCY_ROW = {"instance_id": "e", "data_parallel_rank": 0, "tier": "CPU", "medium": "CPU", "locality": None,
                 "group_idx": 0, "world_size": 1, "aggregation": "REPLICATED", "copies": 1, "since": 1.5,
                 "last_ts": 1.5, "clear_mark": None,
                 "workers": [{"worker_rank": -1, "count": 1, "publisher_epoch": 5, "seq": 1, "batch_index": 0,
                              "block_index": 0, "content": None}]}


@pytest.mark.parametrize("old", [1, 2])
def test_residency_entries_cross_versions_with_the_content_keys_null_or_dropped(old):
    """residency v3 adds the entry's parent_block_hash and content_hash: older changelogs read with both null,
    and a reader of an older version reads v3 entries without them."""
    row = dict(RESIDENCY_ROW)
    if old == 1:
        row["workers"] = [{k: v for k, v in w.items() if k != "content"} for w in row["workers"]]
    entry = {"block_hash": b"\x5a" * 8, "ownership": None, "rows": [row]}
    newest = AvroCodec("residency")
    assert newest.schema.version == 3
    assert newest.decode(AvroCodec("residency", old).encode(entry)) == {
        **entry, "rows": [RESIDENCY_ROW], "parent_block_hash": None, "content_hash": None}
    written = newest.encode({**entry, "rows": [RESIDENCY_ROW], "parent_block_hash": b"\x59" * 8, "content_hash": -3})
    assert AvroCodec("residency", old).decode(written) == entry
