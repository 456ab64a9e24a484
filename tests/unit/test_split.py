"""Per-block split of engine events, and its lossless inverse."""

from __future__ import annotations

import msgspec
import pytest

from harness.payloads import VLLM_PAYLOAD
from producers.split import (
    REQUIRED_FIELDS,
    BlockEncoder,
    InvalidEvent,
    ParentTracker,
    Publisher,
    rebuild_event,
    split_event,
)
from schemas import ALL_BLOCKS_CLEARED, BLOCK_STORED, AvroCodec
from schemas.avro_writers import KvEventWriter

PUBLISHER = Publisher("vllm-0", 0, publisher_epoch=1767225600000)
SGLANG = Publisher("sglang-0", 0, publisher_epoch=1767225600000, engine="sglang")


def _split_batch(payload: bytes) -> list[list[dict]]:
    ts, events, dp_rank = msgspec.msgpack.decode(payload)
    assert dp_rank == 0
    return [split_event(PUBLISHER, 0, ts, i, event) for i, event in enumerate(events)]


def test_real_vllm_payload_splits_into_one_record_per_block():
    stored, removed, cleared = _split_batch(VLLM_PAYLOAD)
    assert [r["block_hash"].hex() for r in stored] == ["1a1eb4e3edd9361a", "d41bc1f76b956dde"]
    assert [(r["block_index"], r["block_count"]) for r in stored] == [(0, 2), (1, 2)]
    assert [r["event"][1]["token_ids"] for r in stored] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert stored[1]["event"][1]["parent_block_hash"] == stored[0]["block_hash"]
    assert {r["tier"] for r in stored} == {"STORAGE"} and stored[0]["event"][1]["ownership"] == "kvcr"
    assert removed[0]["tier"] == "GPU" and removed[0]["event"][1]["group_idx"] == 0
    assert cleared[0]["block_hash"] is None and cleared[0]["event"] == (ALL_BLOCKS_CLEARED, {})
    assert all(r["seq"] == 0 and r["ts"] == 1767225600.0 for part in (stored, removed, cleared) for r in part)


def test_rebuild_after_avro_round_trip_gives_back_the_original_events():
    codec = AvroCodec("kv_event")
    _, events, _ = msgspec.msgpack.decode(VLLM_PAYLOAD)
    for original, records in zip(events, _split_batch(VLLM_PAYLOAD)):
        decoded = [codec.decode(codec.encode(r)) for r in reversed(records)]
        assert rebuild_event(decoded) == original


def test_rebuild_keeps_signed_hashes_extra_keys_lookahead_and_trailing_tokens():
    event = {"type": "BlockStored", "block_hashes": [-5, 7], "parent_block_hash": -9, "token_ids": list(range(10)),
             "block_size": 4, "lora_id": 3, "medium": "CPU_PINNED", "lora_name": "adapter",
             "extra_keys": [["adapter", ["mm", 0]], None], "group_idx": 1, "kv_cache_spec_kind": "sliding_window",
             "kv_cache_spec_sliding_window": 128, "locality": "LOCAL", "session_id": "s",
             "lookahead_token_ids": [[9], [10]]}
    records = split_event(SGLANG, 3, 1.0, 0, event)  # signed hashes: SGLang's protocol
    assert [r["event"][1]["token_ids"] for r in records] == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]
    assert {r["hash_encoding"] for r in records} == {"INT64"} and records[0]["tier"] == "CPU"
    assert rebuild_event(records) == event


STORED = {"type": "BlockStored", "parent_block_hash": None, "lora_id": None, "medium": "GPU", "lora_name": None}


@pytest.mark.parametrize("event, reason", [
    ({"type": "TierBlocksCleared"}, "unknown event type"),
    ({**STORED, "block_hashes": [], "token_ids": [], "block_size": 4}, "non-empty list"),
    ({"type": "BlockRemoved", "block_hashes": [2**64], "medium": "GPU"}, "outside the 64-bit range"),
    ({"type": "BlockRemoved", "block_hashes": [1], "medium": 5}, "medium must be a string"),
    ({**STORED, "block_hashes": [1], "block_size": 4}, "lacks required field 'token_ids'"),
    ({**STORED, "block_hashes": [1], "token_ids": ["a"], "block_size": 4}, "not a 32-bit integer"),
    ({**STORED, "block_hashes": [1, 2], "token_ids": [], "block_size": 0, "extra_keys": [None]},
     "one entry per block"),
    ({"type": "BlockRemoved", "block_hashes": [-1], "medium": "GPU"}, "vllm publishes unsigned"),
    ([1, 2, 3], "not a map"),
])
def test_malformed_events_are_rejected_with_a_reason(event, reason):
    with pytest.raises(InvalidEvent, match=reason):
        split_event(PUBLISHER, 0, 0.0, 0, event)


def test_store_records_pick_the_union_branch_explicitly_and_encode():
    records = split_event(PUBLISHER, 0, 0.0, 0, {"type": "BlockStored", "block_hashes": [1], "token_ids": [],
                                                 "block_size": 0, "parent_block_hash": None, "lora_id": None,
                                                 "medium": None, "lora_name": None})
    assert records[0]["event"][0] == BLOCK_STORED and records[0]["tier"] == "GPU"
    assert AvroCodec("kv_event").encode(records[0])[:2] == b"\xc3\x01"


def test_parent_tracker_marks_a_parent_the_source_never_stored():
    from producers.split import ParentTracker

    tracker = ParentTracker(capacity=2)

    def store(blocks, parent, publisher=PUBLISHER):
        records = split_event(publisher, 0, 0.0, 0, {"type": "BlockStored", "block_hashes": blocks,
                                                     "parent_block_hash": parent, "token_ids": [], "block_size": 0,
                                                     "lora_id": None, "medium": "GPU", "lora_name": None})
        for record in records:
            tracker.note(record)
        return [r["event"][1]["parent_known"] for r in records]

    assert store([0xD3, 0xD4], 0xD2) == [False, None]  # 0xD2 never stored; 0xD4's parent is 0xD3 in the run
    assert store([0xD5], 0xD4) == [True]
    assert store([0xD6], 0xD4, Publisher("other")) == [False]  # another source stored nothing
    assert store([0xD7], 0xD3) == [False]  # capacity 2 per source: 0xD3 has been forgotten
    assert store([0xD8], None) == [None]
    # SHARDED: the ranks of one engine store different blocks; a parent another rank stored is known
    rank0, rank1 = (Publisher("tp-engine", 0, worker_rank=r, world_size=2, aggregation="SHARDED") for r in (0, 1))
    assert store([0xE1], None, rank0) == [None]
    assert store([0xE2], 0xE1, rank1) == [True]


def _simulated_events(requests: int = 400):
    from producers.simulator import ClusterSimulator, load_trace

    for batch in ClusterSimulator().run(load_trace(limit=requests)):
        for index, event in enumerate(batch.events):
            yield batch.publisher, batch.seq, batch.ts, index, event


def _reference(events) -> list[tuple[bytes | None, bytes]]:
    """What split_event + ParentTracker.note + AvroCodec.encode (fastavro) write, record by record."""
    codec, parents, out = AvroCodec("kv_event"), ParentTracker(), []
    for args in events:
        for record in split_event(*args):
            parents.note(record)
            out.append((record["block_hash"], codec.encode(record)))
    return out


def test_block_encoder_writes_the_bytes_of_split_event_and_fastavro():
    from producers.split import BlockEncoder
    from schemas.avro_writers import KvEventWriter

    _, events, _ = msgspec.msgpack.decode(VLLM_PAYLOAD)
    odd = {"type": "BlockStored", "block_hashes": [-5, 7, b"\x01" * 32], "parent_block_hash": -9,
           "token_ids": list(range(10)) + [-(1 << 31), (1 << 31) - 1], "block_size": 4, "lora_id": -(1 << 63),
           "medium": "CPU_PINNED", "lora_name": "adäpter", "extra_keys": [["adapter", ["mm", 0]], None, 3],
           "group_idx": 1, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 128,
           "locality": "LOCAL", "ownership": "kvcr", "session_id": "s", "lookahead_token_ids": [[9], [], [1, 2]]}
    publishers = [PUBLISHER, Publisher("sim-1", 3, worker_rank=1, world_size=2, aggregation="SHARDED",
                                       publisher_epoch=(1 << 62)), Publisher("full-1", report_mode="full")]
    unsigned = {**odd, "block_hashes": [5, 7, b"\x01" * 32], "parent_block_hash": 9}
    events = [*_simulated_events(),
              *((p, seq, 1767225600.25, i, e) for p in publishers for seq in (0, 5000, 1 << 40)
                for i, e in enumerate([*events, unsigned, {**unsigned, "parent_block_hash": 7}])),
              *((SGLANG, seq, 1767225600.25, 0, e) for seq in (0, 1 << 40)
                for e in (odd, {**odd, "parent_block_hash": 7}))]
    encoder = BlockEncoder(KvEventWriter(AvroCodec("kv_event")), ParentTracker())
    fast = [pair for args in events for pair in encoder.encode_event(*args)]
    assert fast == _reference(events)


def test_kv_event_writer_encodes_every_event_type_like_fastavro():
    from producers.split import source_event
    from schemas import PUBLISHER_RESTARTED, SOURCE_DISCONNECTED, SOURCE_STALE
    from schemas.avro_writers import KvEventWriter

    codec = AvroCodec("kv_event")
    writer = KvEventWriter(codec)
    publisher = Publisher("x", 1, 2, 3, "SHARDED", 5)
    records = [source_event(publisher, PUBLISHER_RESTARTED, {"previous_epoch": 3}, -1, 1.5),
               source_event(publisher, PUBLISHER_RESTARTED, {"previous_epoch": None}, -1, 1.5),
               source_event(publisher, SOURCE_STALE, {"first_lost_seq": 3, "last_lost_seq": 1 << 50}, 9, 1.5),
               source_event(publisher, SOURCE_DISCONNECTED, {"reason": "replay-silent"}, 9, 1.5),
               source_event(publisher, SOURCE_DISCONNECTED, {"reason": None}, -1, 1.5),
               *(r for args in _simulated_events(60) for r in split_event(*args))]
    assert [writer.encode(r) for r in records] == [codec.encode(r) for r in records]
    with pytest.raises(ValueError, match="kv_event v6"):
        KvEventWriter(AvroCodec("kv_event", version=5))


@pytest.mark.parametrize("engine, kind",
                         [(engine, kind) for engine, kinds in REQUIRED_FIELDS.items() for kind in kinds])
def test_every_required_field_of_each_engine_is_refused_when_absent_naming_it(engine, kind):
    publisher = Publisher("e", 0, engine=engine)
    complete = {"type": kind, "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2], "block_size": 2,
                "lora_id": None, "medium": "GPU", "lora_name": None}
    if kind == "BlockRemoved":
        complete = {"type": kind, "block_hashes": [1], "medium": "GPU"}
    assert split_event(publisher, 0, 1.0, 0, complete)
    for name in REQUIRED_FIELDS[engine][kind]:
        event = {k: v for k, v in complete.items() if k != name}
        with pytest.raises(InvalidEvent, match=f"{kind} from {engine} lacks required field '{name}'"):
            split_event(publisher, 0, 1.0, 0, event)
    # fields with a default may be absent: they mean None
    optional = {k: v for k, v in complete.items() if k == "type" or k in REQUIRED_FIELDS[engine][kind]}
    assert split_event(publisher, 0, 1.0, 0, optional)


def test_the_hash_encoding_is_the_engines_not_the_values_sign():
    event = {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}
    assert split_event(SGLANG, 0, 1.0, 0, event)[0]["hash_encoding"] == "INT64"  # non-negative, still SGLang's
    assert split_event(PUBLISHER, 0, 1.0, 0, event)[0]["hash_encoding"] == "UINT64"
    with pytest.raises(InvalidEvent, match="sglang publishes signed"):
        split_event(SGLANG, 0, 1.0, 0, {**event, "block_hashes": [2**63]})


def test_sglang_eagle_bigram_tokens_and_cache_salt_survive_avro_and_rebuild_as_sent():
    """SGLang with EAGLE publishes each position as a bigram; its pages are bigrams. Nothing may be lost."""
    event = {"type": "BlockStored", "block_hashes": [-3, 4], "parent_block_hash": None,
             "token_ids": [[11, 12], [12, 13], [13, 14], [14, 15], [15, 16]], "block_size": 2, "lora_id": None,
             "cache_salt": "tenant-a", "session_id": "s"}
    records = split_event(SGLANG, 0, 1.0, 0, event)
    assert [r["event"][1]["token_ids"] for r in records] == [[11, 12, 12, 13], [13, 14, 14, 15, 15, 16]]
    assert {r["event"][1]["token_id_width"] for r in records} == {2}
    codec = AvroCodec("kv_event")
    encoder = BlockEncoder(KvEventWriter(codec), None)
    wire = [value for _, value in encoder.encode_event(SGLANG, 0, 1.0, 0, event)]
    assert wire == [codec.encode(r) for r in records]
    assert rebuild_event([codec.decode(v) for v in wire]) == event


@pytest.mark.parametrize("tokens", [[[1, 2], [3]], [[1, 2], 3], [[1]], [[1, "x"]]])
def test_token_tuples_of_other_shapes_are_refused(tokens):
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": tokens,
             "block_size": 1, "lora_id": None}
    with pytest.raises(InvalidEvent, match="token"):
        split_event(SGLANG, 0, 1.0, 0, event)


# --------------------------------------------------------------------------- content hashes (kv_event v4)

def _content_hashes(records: list[dict]) -> list:
    return [r["event"][1]["content_hash"] for r in records]


def test_a_vllm_store_gets_the_content_hash_of_each_blocks_tokens_and_extra_keys_entry():
    """vLLM puts [lora_name] on every block of a LoRA request and the salt on block 0 as well: the stored blocks'
    content hashes are then the ones a query with the same tokens, LoRA name and salt computes."""
    from schemas.content_hash import block_content_hashes, content_hash

    tokens = list(range(100, 112))
    event = {"type": "BlockStored", "block_hashes": [11, 12, 13], "parent_block_hash": None, "token_ids": tokens,
             "block_size": 4, "lora_id": 1, "medium": "GPU", "lora_name": "sql",
             "extra_keys": [["sql", "salt-1"], ["sql"], ["sql"]]}
    records = split_event(PUBLISHER, 0, 1.0, 0, event)
    assert _content_hashes(records) == block_content_hashes(tokens, 4, "sql", "salt-1")
    # an entry of None is a block without extra keys: its tokens alone, as a block of a plain request
    plain = split_event(PUBLISHER, 0, 1.0, 0, {**event, "lora_name": None, "extra_keys": [None, ["mm", 3], None]})
    assert _content_hashes(plain) == [content_hash(tokens[:4]), content_hash(tokens[4:8], ["mm", 3]),
                                      content_hash(tokens[8:])]
    assert _content_hashes(plain)[0] == block_content_hashes(tokens, 4)[0]


@pytest.mark.parametrize("parent", [None, -9], ids=["first of its chain", "continues a chain"])
def test_an_sglang_store_hashes_its_lora_name_on_every_block_and_its_salt_on_a_chains_first_block(parent):
    from schemas.content_hash import content_hash

    tokens = list(range(8))
    event = {"type": "BlockStored", "block_hashes": [-5, 7], "parent_block_hash": parent, "token_ids": tokens,
             "block_size": 4, "lora_id": None, "lora_name": "adapter", "cache_salt": "tenant-a"}
    first = ["adapter", "tenant-a"] if parent is None else ["adapter"]
    assert _content_hashes(split_event(SGLANG, 0, 1.0, 0, event)) == [content_hash(tokens[:4], first),
                                                                       content_hash(tokens[4:], ["adapter"])]
    bare = {k: v for k, v in event.items() if k not in ("lora_name", "cache_salt")}
    assert _content_hashes(split_event(SGLANG, 0, 1.0, 0, bare)) == [content_hash(tokens[:4]),
                                                                      content_hash(tokens[4:])]


def test_eagle_token_pairs_are_hashed_as_their_flat_list_and_tokenless_blocks_get_none():
    from schemas.content_hash import content_hash

    event = {"type": "BlockStored", "block_hashes": [-3, 4], "parent_block_hash": None,
             "token_ids": [[11, 12], [12, 13], [13, 14], [14, 15]], "block_size": 2, "lora_id": None}
    assert _content_hashes(split_event(SGLANG, 0, 1.0, 0, event)) == [content_hash([11, 12, 12, 13]),
                                                                       content_hash([13, 14, 14, 15])]
    placeholder = {**event, "token_ids": [], "block_size": 0}  # an offload connector's store: no tokens
    assert _content_hashes(split_event(SGLANG, 0, 1.0, 0, placeholder)) == [None, None]
    short = {**event, "token_ids": [[11, 12], [12, 13]]}  # tokens for the first block only
    assert _content_hashes(split_event(SGLANG, 0, 1.0, 0, short)) == [content_hash([11, 12, 12, 13]), None]


def test_the_record_rule_gives_the_producers_content_hash_for_every_store():
    """The repartition process computes a content hash for records written without one (an older producer),
    from the decoded record alone (schemas.content_hash.stored_content_hash): it must be the producer's."""
    from schemas.content_hash import stored_content_hash

    codec = AvroCodec("kv_event")
    events = [
        {"type": "BlockStored", "block_hashes": [1, 2, 3], "parent_block_hash": None, "token_ids": list(range(10)),
         "block_size": 4, "lora_id": 3, "medium": "CPU", "lora_name": "a", "extra_keys": [["a", "s"], None, 3]},
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": 9, "token_ids": [[1, 2]] * 4,
         "block_size": 2, "lora_id": None, "lora_name": "b", "cache_salt": "s"},
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [5] * 8,
         "block_size": 4, "lora_id": None, "lora_name": "b", "cache_salt": "s"},
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [], "block_size": 0,
         "lora_id": None, "medium": "CPU", "lora_name": None},
    ]
    for publisher in (SGLANG, PUBLISHER):  # a vLLM store without extra_keys says none: no content hash, both ways
        for event in events:
            for record in split_event(publisher, 0, 1.0, 0, {"medium": None, **event}):
                body = codec.decode(codec.encode(record))["event"][1]
                assert stored_content_hash(body, publisher.engine) == body["content_hash"] == \
                    record["event"][1]["content_hash"]
    assert stored_content_hash({**body, "token_ids": [1], "extra_keys": b"\xc1"}, "vllm") is None  # not msgpack


def test_content_hashes_an_event_gives_are_the_blocks_and_come_back_in_the_rebuilt_event():
    """A producer that knows its blocks' content but not their tokens (the simulator) gives the hashes; the bytes are
    the same through BlockEncoder as through split_event and fastavro."""
    from producers.split import CONTENT_HASHES

    event = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": [],
             "block_size": 512, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None, None],
             CONTENT_HASHES: [-(2**63), 2**63 - 1]}
    records = split_event(PUBLISHER, 0, 1.0, 0, event)
    assert _content_hashes(records) == [-(2**63), 2**63 - 1]
    codec = AvroCodec("kv_event")
    wire = [value for _, value in BlockEncoder(KvEventWriter(codec), None).encode_event(PUBLISHER, 0, 1.0, 0, event)]
    assert wire == [codec.encode(r) for r in records]
    assert rebuild_event([codec.decode(v) for v in wire]) == event
    with_tokens = {**event, "token_ids": list(range(1024)), CONTENT_HASHES: [5, None]}
    assert _content_hashes(split_event(PUBLISHER, 0, 1.0, 0, with_tokens)) == [5, None]
    assert rebuild_event(split_event(PUBLISHER, 0, 1.0, 0, with_tokens)) == with_tokens
    # hashes the tokens give anyway add nothing: the event comes back as an engine sends it
    computed = _content_hashes(split_event(PUBLISHER, 0, 1.0, 0, {**with_tokens, CONTENT_HASHES: None}))
    no_hashes = {k: v for k, v in with_tokens.items() if k != CONTENT_HASHES}
    assert rebuild_event(split_event(PUBLISHER, 0, 1.0, 0, {**with_tokens, CONTENT_HASHES: computed})) == no_hashes
    for bad, reason in [([1], "one entry per block hash"), ([1, 2**63], "not a signed 64-bit"),
                        ([True, 1], "not a signed 64-bit"), ("ab", "one entry per block hash")]:
        with pytest.raises(InvalidEvent, match=reason):
            split_event(PUBLISHER, 0, 1.0, 0, {**event, CONTENT_HASHES: bad})


def test_records_of_an_older_producer_rebuild_without_content_hashes():
    """A v3 record read as v4 has content_hash null: the rebuilt event is the engine's, with nothing added."""
    v3, v4 = AvroCodec("kv_event", 3), AvroCodec("kv_event")
    event = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
             "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None}
    old = []
    for record in split_event(PUBLISHER, 0, 1.0, 0, event):
        body = {k: v for k, v in record["event"][1].items() if k != "content_hash"}
        old.append(v4.decode(v3.encode({**record, "event": (BLOCK_STORED, body)})))
    assert _content_hashes(old) == [None, None]
    assert rebuild_event(old) == event
