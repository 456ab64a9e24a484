"""The materializing agent's one-pass batch reader (schemas/ownership_batch.py) against decoding item by item."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producers.split import Publisher, split_event
from schemas import AvroCodec, DecodeError
from schemas.avro_writers import NO_TABLES, avro_long, encode_clear_mark, encode_keyed_event, encode_ownership_batch
from schemas.block_event import BLOCK_FIELDS, KINDS, PARENT_KNOWN, BlockEvent, BlockFieldsWriter, Source, block_event_of
from schemas.clear_position import NO_CLEAR, ClearPosition
from schemas.ownership_batch import OwnershipBatchReader
from schemas.tiers import TIERS
from tests.conftest import hotpath_module

BATCH = AvroCodec("ownership_batch")
EVENTS = AvroCodec("kv_event")
#: Every test here runs with the pure-Python walk and the compiled one (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("hotpath")
STORE = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [1, 2],
         "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}


def _event(version: int | None = None, block: int = 7, instance: str = "e1") -> bytes:
    record = split_event(Publisher(instance), 3, 1.5, 0, {**STORE, "block_hashes": [block]})[0]
    return AvroCodec("kv_event", version).encode(record)


def _item_by_item(message: bytes) -> list[tuple]:
    """What the agent got before the one-pass reader: the batch codec, then the event codec per item."""
    items = []
    for item in BATCH.decode(message)["events"]:
        try:
            record = EVENTS.decode(item["event"])
        except DecodeError as exc:
            record = exc
        items.append((item["key"], ClearPosition.of(item["clear_mark"]), item["event"], record))
    return items


def _one_pass(message: bytes) -> list[tuple]:
    items = []
    for key, mark, buffer, start, end, record in OwnershipBatchReader(EVENTS).read(message):
        event = buffer[start:end]
        if record is None:  # the caller's part: the codec resolves the version or says why not
            try:
                record = EVENTS.decode(event)
            except DecodeError as exc:
                record = exc
        items.append((key, mark, event, record))
    return items


def _same(ours: list[tuple], theirs: list[tuple]) -> None:
    assert len(ours) == len(theirs)
    for mine, expected in zip(ours, theirs):
        assert mine[:3] == expected[:3]
        if isinstance(expected[3], DecodeError):
            assert isinstance(mine[3], DecodeError) and str(mine[3]) == str(expected[3])
        else:  # repr: a corrupted double can be NaN, which equals nothing, not even itself
            assert repr(mine[3]) == repr(expected[3])


@pytest.mark.parametrize("seed", range(8))
def test_the_one_pass_reader_gives_what_item_by_item_decoding_gives(seed):
    rng = random.Random(seed)
    marks = [NO_CLEAR, (0, 0, 0), (1767225600000, 2**40, 7), (-1, 3, 2**31 - 1)]
    events = [_event(), _event(block=2**64 - 1, instance="é" * 70), _event(version=1), _event(version=2),
              _event()[:-1], b"\xc3\x01" + bytes(8) + b"\x02a", b"\x00\x00\x00\x00\x07", b""]
    items = [(rng.choice(["primary/", "kvcr/", "clear/e1/"]) + bytes(rng.randrange(0, 70)).hex(),
              rng.choice(marks), rng.choice(events)) for _ in range(rng.randrange(0, 60))]
    message = encode_ownership_batch(BATCH.header,
                                     [encode_keyed_event(k, encode_clear_mark(m), e) for k, m, e in items])
    _same(_one_pass(message), _item_by_item(message))
    # records of the codec's own version come decoded; older versions and invalid records are left to the caller
    for key, mark, buffer, start, end, record in OwnershipBatchReader(EVENTS).read(message):
        event = buffer[start:end]
        if record is not None:
            assert event[:10] == EVENTS.header
        elif event[:10] == EVENTS.header:
            with pytest.raises(DecodeError):
                EVENTS.decode(event)


def test_a_message_whose_array_block_gives_its_byte_size_reads_the_same():
    """Avro allows an array block's count negated and followed by the block's byte size; our writers do not
    produce it, but a writer in another language may."""
    events = [_event(block=b) for b in range(5)]
    block = b"".join(encode_keyed_event(f"primary/{b:016x}", encode_clear_mark((1, 2, 3)), e)
                     for b, e in enumerate(events))
    message = BATCH.header + NO_TABLES + avro_long(-5) + avro_long(len(block)) + block + b"\x00"
    assert len(_one_pass(message)) == 5
    _same(_one_pass(message), _item_by_item(message))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_corrupted_message_is_refused_as_the_codec_refuses_it_or_read_as_it_reads_it(data):
    items = [(f"primary/{b:016x}", (1, b, 0) if b % 2 else NO_CLEAR, _event(block=b)) for b in range(4)]
    message = bytearray(encode_ownership_batch(BATCH.header, [encode_keyed_event(k, encode_clear_mark(m), e)
                                                              for k, m, e in items]))
    position = data.draw(st.integers(min_value=0, max_value=len(message) - 1))
    message[position] = data.draw(st.integers(min_value=0, max_value=255))
    try:
        expected = _item_by_item(bytes(message))
    except DecodeError as exc:
        with pytest.raises(DecodeError) as refused:
            OwnershipBatchReader(EVENTS).read(bytes(message))
        assert str(refused.value) == str(exc)
        return
    _same(_one_pass(bytes(message)), expected)


def test_a_registry_framed_event_of_a_known_schema_id_is_decoded_in_place_and_others_are_left_to_the_codec():
    codec = AvroCodec("kv_event", registry_url="mock://one-pass", subject="kv-events-value")
    event = codec.encode(split_event(Publisher("e1"), 3, 1.5, 0, STORE)[0])
    assert event[:1] == b"\x00"  # Confluent framing: magic byte and the schema id registered above
    unknown_id = b"\x00\x00\x00\x03\xe7" + event[5:]  # id 999, which this registry never gave
    message = encode_ownership_batch(BATCH.header, [encode_keyed_event("primary/07", b"\x00", event),
                                                    encode_keyed_event("primary/07", b"\x00", unknown_id)])
    items = OwnershipBatchReader(codec).read(message)
    assert items[0][5] == codec.decode(event)
    assert items[1][5] is None
    with pytest.raises(DecodeError, match="schema id 999 not found"):
        codec.decode(unknown_id)


def test_the_generated_reader_is_given_only_the_events_own_bytes():
    """A corrupt array count inside one event must not send the reader on through the events after it (it
    checks lengths against the end of what it is given): 4,000 such events in one message once took 73 s."""
    codec = AvroCodec("kv_event")
    given = []
    read = codec._fast_read

    def recording(data, pos):
        given.append(len(data))
        return read(data, pos)

    codec._fast_read = recording
    events = [_event(block=b) for b in range(3)]
    message = encode_ownership_batch(BATCH.header, [encode_keyed_event(f"primary/{b:016x}", b"\x00", e)
                                                    for b, e in enumerate(events)])
    items = OwnershipBatchReader(codec).read(message)
    assert given == [len(e) for e in events]
    assert [record for *_, record in items] == [EVENTS.decode(e) for e in events]


# --------------------------------------------------------------------------- block fields (ownership_batch v2)

def _records(rng: random.Random, count: int) -> list[dict]:
    """Decoded block-event records with every field the block layout carries set in every way it can be."""
    records = []
    for n in range(count):
        instance = rng.choice(["e1", "engine-é7", "x" * 300])
        publisher = Publisher(instance, rng.choice([0, 3, 2**31 - 1]), worker_rank=rng.choice([None, 0, 5]),
                              world_size=rng.choice([None, 1, 4]),
                              aggregation=rng.choice([None, "REPLICATED", "SHARDED"]),
                              report_mode=rng.choice([None, "full"]))
        kind = rng.choice(["BlockStored", "BlockRemoved"])
        event = {"type": kind,
                 "block_hashes": [rng.choice([n, 2**64 - 1 - n, bytes(rng.randrange(32) for _ in range(32))])],
                 "medium": rng.choice([None, "GPU", "cpu", "DISK", "weird-é"]),
                 "group_idx": rng.choice([None, 0, 7, 2**31 - 1]),
                 "locality": rng.choice([None, "node-1", ""]), "ownership": rng.choice([None, "kvcr", "ö"])}
        if kind == "BlockStored":
            event.update(parent_block_hash=rng.choice([None, n + 1, bytes(rng.randrange(256) for _ in range(32))]),
                         token_ids=rng.choice([[1, 2], [], list(range(16))]), block_size=16, lora_id=None,
                         lora_name=None)
        record = EVENTS.decode(EVENTS.encode(split_event(publisher, rng.randrange(2**40), rng.random() * 2e9,
                                                         rng.randrange(100), event)[0]))
        if kind == "BlockStored":
            body = record["event"][1]
            body["parent_known"] = rng.choice([None, False, True])
            # every content hash the layout holds, and none (a tokenless store, or one from before kv_event v4)
            body["content_hash"] = rng.choice([body["content_hash"], None, -2**63, 2**63 - 1, 0])
            if body["content_hash"] is None:
                body["token_ids"] = []
        records.append(record)
    return records


def _block_message(records: list[dict], contents: list) -> tuple[bytes, list[bytes | None]]:
    writer = BlockFieldsWriter()
    blocks = [writer.block(r, c) for r, c in zip(records, contents)]
    items = [encode_keyed_event(f"k{n}", encode_clear_mark((1, n, 0)), EVENTS.encode(r), b)
             for n, (r, b) in enumerate(zip(records, blocks))]
    return encode_ownership_batch(BATCH.header, items, writer.tables()), blocks


@pytest.mark.parametrize("seed", range(6))
def test_block_fields_read_back_as_the_block_event_of_the_record_they_were_written_from(seed):
    rng = random.Random(seed)
    records = _records(rng, rng.randrange(1, 80))
    contents = [rng.choice([None, 0, -2**63, 2**63 - 1]) for _ in records]
    message, blocks = _block_message(records, contents)
    assert all(b is not None for b in blocks)
    items = OwnershipBatchReader(EVENTS).read(message)
    assert [item[5] for item in items] == [block_event_of(r, c) for r, c in zip(records, contents)]
    assert all(type(item[5]) is tuple for item in items)
    # a full report mode source's stores read back as the kind the rules take for possible announcements
    full = [item[5][0] for item, r in zip(items, records) if r["event"][1].get("report_mode") == "full"]
    assert set(full) <= {"kvstream.v1.BlockStored/full-report", "kvstream.v1.BlockRemoved"}
    # the events themselves still travel, for dead letters and for readers of the topic (fastavro reads it all)
    decoded = BATCH.decode(message)
    assert [EVENTS.decode(item["event"]) for item in decoded["events"]] == records
    assert [item["block"] for item in decoded["events"]] == blocks
    assert {s["instance_id"] for s in decoded["sources"]} == {r["instance_id"] for r in records}


@pytest.mark.parametrize("seed", range(4))
def test_the_compiled_item_encoder_writes_the_items_and_tables_the_python_writer_writes(seed):
    """The repartition stage encodes a block event's item with the compiled encoder (schemas._hotpath
    BlockItemEncoder) where it is built. On random routes, routes with fields the layout cannot hold or of
    another type, and tables nearly full, its items, tables and table sizes are those of the Python writer."""
    from schemas.block_event import R_BATCH_INDEX, R_GROUP_IDX, R_PARENT, R_TS, block_route

    hotpath_module("compiled")
    rng = random.Random(seed)
    routes = [block_route(r) for r in _records(rng, 200)]
    odd = [(R_GROUP_IDX, -1), (R_GROUP_IDX, 2**32 - 1), (R_GROUP_IDX, 2**32 - 2), (R_BATCH_INDEX, 2**31),
           (R_BATCH_INDEX, -2**31), (R_PARENT, bytes(254)), (R_PARENT, bytes(255)), (R_TS, 3)]
    for index, value in odd:
        route = list(rng.choice(routes))
        if index != R_PARENT or route[0] == "kvstream.v1.BlockStored":
            route[index] = value
            routes.insert(rng.randrange(len(routes)), route)
    compiled, python = BlockFieldsWriter(compiled=True), BlockFieldsWriter(compiled=False)
    assert compiled._encoder is not None and python._encoder is None
    if seed % 2:  # a strings table that fills up on the way: the encoder leaves its last entries to Python
        for writer in (compiled, python):
            writer._strings.update((f"s{n}", n + 1) for n in range(0xFFFF - 1 - 6))
    for n, route in enumerate(routes):
        key, mark, value = f"primary/{n:x}".encode(), encode_clear_mark((1, n, 0)), bytes(rng.randrange(40))
        content = rng.choice([None, 0, -2**63, 2**63 - 1])
        assert compiled.keyed_item(key, mark, value, route, content) == python.keyed_item(key, mark, value, route,
                                                                                          content)
        assert compiled.table_bytes == python.table_bytes
    assert compiled.tables() == python.tables()
    # most items above were the encoder's own, not the Python writer's answer in its place
    assert sum(compiled._encoder.item({}, {}, b"k", b"", b"", r, None) is not None for r in routes) > 150


def test_a_field_the_layout_cannot_hold_leaves_the_event_to_be_decoded():
    record = _records(random.Random(1), 1)[0]
    record["event"][1]["group_idx"] = -1  # valid Avro, but the layout's 0 means null
    message, blocks = _block_message([record], [None])
    assert blocks == [None]
    (item,) = OwnershipBatchReader(EVENTS).read(message)
    assert item[5] == record
    store = next(r for r in _records(random.Random(7), 40) if r["event"][0] == "kvstream.v1.BlockStored")
    store["event"][1]["parent_block_hash"] = bytes(255)  # no canonical hash is that long; the length byte is full
    assert BlockFieldsWriter().block(store) is None


def test_block_fields_carry_a_stores_parent_and_content_hash_and_compute_a_missing_one():
    """A store of an older producer (kv_event v3: no content_hash) with tokens gets the content hash its tokens and
    extra keys give, in the repartition process that writes the block fields; one without tokens has none, nor has a
    vLLM store without ``extra_keys`` (it does not say its extra keys)."""
    from schemas.content_hash import content_hash

    event = {**STORE, "block_hashes": [7, 8], "parent_block_hash": 6, "token_ids": list(range(32)),
             "extra_keys": [None, None]}
    unsaid = {**STORE, "block_hashes": [9], "parent_block_hash": 8, "token_ids": list(range(16))}
    v3, records = AvroCodec("kv_event", 3), []
    for record in [*split_event(Publisher("e1"), 3, 1.5, 0, event), *split_event(Publisher("e1"), 4, 1.5, 0, unsaid)]:
        body = {k: v for k, v in record["event"][1].items() if k != "content_hash"}
        records.append(EVENTS.decode(v3.encode({**record, "event": (record["event"][0], body)})))
    tokenless = EVENTS.decode(_event())
    tokenless["event"][1].update(token_ids=[], content_hash=None)
    assert [r["event"][1]["content_hash"] for r in records] == [None, None, None]
    message, _ = _block_message([*records, tokenless], [None] * 4)
    events = [item[5] for item in OwnershipBatchReader(EVENTS).read(message)]
    assert [(e.parent_block_hash, e.content_hash) for e in map(BlockEvent._make, events)] == [
        ((6).to_bytes(8, "big"), content_hash(range(16))), ((7).to_bytes(8, "big"), content_hash(range(16, 32))),
        ((8).to_bytes(8, "big"), None), (None, None)]
    assert events == [block_event_of(r) for r in [*records, tokenless]]


def _first_layout_block(record: dict, writer: BlockFieldsWriter) -> bytes:
    """Block fields as a repartition process of before the parent and content hashes wrote them: 56 bytes, kinds
    0 and 1, then the block hash."""
    import struct

    full = writer.block(record)
    fields = BLOCK_FIELDS.unpack_from(full)
    return struct.pack("<BHqqiidBHHIHBBq", fields[0] - 2, *fields[1:15]) + record["block_hash"]


def test_block_fields_of_the_first_layout_are_not_misread_but_decoded_from_their_records():
    """A rolling upgrade: items an older repartition process wrote reach a newer agent (and the other way round).
    Their kind bytes name no kind in the other layout, so the message is decoded from its records."""
    records = _records(random.Random(5), 12)
    writer = BlockFieldsWriter()
    old = [_first_layout_block(r, writer) for r in records]
    items = [encode_keyed_event(f"k{n}", b"\x00", EVENTS.encode(r), b) for n, (r, b) in enumerate(zip(records, old))]
    message = encode_ownership_batch(BATCH.header, items, writer.tables())
    read = OwnershipBatchReader(EVENTS).read(message)
    assert [item[5] for item in read] == [None] * len(records)  # the caller decodes each record
    assert [EVENTS.decode(buffer[start:end]) for _, _, buffer, start, end, _ in read] == records
    # and the kinds of this layout are outside the first one's table (KINDS was 2 long)
    assert KINDS.index("kvstream.v1.BlockStored") >= 2 and KINDS.index("kvstream.v1.BlockRemoved") >= 2


def test_a_source_shared_by_a_messages_events_is_one_object():
    records = _records(random.Random(2), 40)
    for r in records:
        r.update(instance_id="e1", data_parallel_rank=0, worker_rank=None, world_size=None, aggregation=None)
    message, _ = _block_message(records, [None] * len(records))
    sources = {id(item[5][1]) for item in OwnershipBatchReader(EVENTS).read(message)}
    assert len(sources) == 1 and BATCH.decode(message)["sources"] == [
        {"instance_id": "e1", "data_parallel_rank": 0, "worker_rank": None, "world_size": None, "aggregation": None}]


def _reference_block_event(block: bytes, sources: list[dict], strings: list[str]) -> tuple:
    """The layout read independently of the reader: what schemas/ownership_batch_v2.avsc's doc says."""
    (kind, source, epoch, seq, batch_index, block_index, ts, tier, medium, locality, group, ownership, known,
     has_content, content, parent_size, has_content_hash, content_hash) = BLOCK_FIELDS.unpack_from(block)
    text = [None, *strings]
    s = sources[source]
    assert BLOCK_FIELDS.size == 66 and kind in (2, 3, 4)
    hash_start = BLOCK_FIELDS.size + max(parent_size - 1, 0)
    kinds = ("kvstream.v1.BlockStored", "kvstream.v1.BlockRemoved", "kvstream.v1.BlockStored/full-report")
    return BlockEvent(kinds[kind - 2],
                      Source(s["instance_id"], s["data_parallel_rank"], s["worker_rank"], s["world_size"],
                             s["aggregation"]),
                      epoch, seq, batch_index, block_index, ts, block[hash_start:], TIERS[tier], text[medium],
                      text[locality], None if group == 0 else group - 1, text[ownership], PARENT_KNOWN[known],
                      content if has_content else None, block[BLOCK_FIELDS.size:hash_start] if parent_size else None,
                      content_hash if has_content_hash else None)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_corrupted_message_with_block_fields_is_refused_as_the_codec_refuses_it_or_read_as_it_reads_it(data):
    records = _records(random.Random(3), 4)
    message, _ = _block_message(records, [None, 5, None, None])
    message = bytearray(message)
    position = data.draw(st.integers(min_value=0, max_value=len(message) - 1))
    message[position] = data.draw(st.integers(min_value=0, max_value=255))
    message = bytes(message)
    try:
        decoded = BATCH.decode(message)
    except DecodeError as exc:
        with pytest.raises(DecodeError) as refused:
            OwnershipBatchReader(EVENTS).read(message)
        assert str(refused.value) == str(exc)
        return
    items = OwnershipBatchReader(EVENTS).read(message)
    assert [(key, buffer[start:end]) for key, _, buffer, start, end, _ in items] == [
        (item["key"], item["event"]) for item in decoded["events"]]
    for (*_, event), item in zip(items, decoded["events"]):
        if type(event) is tuple:  # read from the block fields: exactly what they say
            assert repr(event) == repr(tuple(_reference_block_event(item["block"], decoded["sources"],
                                                                    decoded["strings"])))
        elif event is not None:  # decoded from the event's bytes
            assert repr(event) == repr(EVENTS.decode(item["event"]))


def _outcome(message: bytes, compiled: bool):
    try:
        return repr(OwnershipBatchReader(EVENTS, compiled=compiled).read(message))
    except DecodeError as exc:
        return f"DecodeError: {exc}"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_compiled_walk_reads_any_message_exactly_as_the_python_walk(data):
    """schemas/_hotpath.pyx's walk_items against OwnershipBatchReader's own loop, on messages with and without
    block fields, with up to three bytes changed anywhere: the same items, or the same refusal."""
    records = _records(random.Random(data.draw(st.integers(0, 1000))), data.draw(st.integers(1, 6)))
    message, _ = _block_message(records, [data.draw(st.none() | st.integers(-2**63, 2**63 - 1)) for _ in records])
    if data.draw(st.booleans()):  # an item of the first layout, which both walks refuse
        writer = BlockFieldsWriter()
        blocks = [_first_layout_block(r, writer) if n == 0 else writer.block(r) for n, r in enumerate(records)]
        message = encode_ownership_batch(BATCH.header, [
            encode_keyed_event(f"k{n}", b"\x00", EVENTS.encode(r), b) for n, (r, b) in enumerate(zip(records, blocks))],
            writer.tables())
    message = bytearray(message)
    for _ in range(data.draw(st.integers(0, 3))):
        message[data.draw(st.integers(0, len(message) - 1))] = data.draw(st.integers(0, 255))
    assert _outcome(bytes(message), compiled=True) == _outcome(bytes(message), compiled=False)


#: Messages found by an adversarial review of the compiled walk (schemas/_hotpath.pyx): a length near 2**63 in
#: an item's event (the compiled walk's end position wrapped around: a read before the buffer, a crash) and key
#: (MemoryError), and an array block count of -2**63 (accepted where the Python walk refuses it).
REVIEWED = {
    "event length near 2**63": b"\xc3\x01\xd7e\x8dM\x18\xf7\x9a\xdb\x00\x00\x02\x02k\x00\xfa\xff\xff\xff\xff\xff\xff"
                               b"\xff\xff\x01xyz\x00\x00",
    "key length near 2**63": b"\xc3\x01\xd7e\x8dM\x18\xf7\x9a\xdb\x00\x00\x02\xfa\xff\xff\xff\xff\xff\xff\xff\xff\x01"
                             b"abc\x00",
    "block count -2**63": b"\xc3\x01\xd7e\x8dM\x18\xf7\x9a\xdb\x00\x00\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01\x00\x02"
                          b"\x02k\x00\n\x00\x00\x00\x00\x07\x00\x00",
}


@pytest.mark.parametrize("message", REVIEWED.values(), ids=REVIEWED.keys())
def test_messages_that_broke_the_compiled_walk_are_refused_as_the_python_walk_refuses_them(message):
    assert message[:10] == BATCH.header  # still the current version's framing: the walk reads them
    outcome = _outcome(message, compiled=True)
    assert outcome.startswith("DecodeError") and outcome == _outcome(message, compiled=False)


def test_a_length_near_2_63_in_a_block_field_is_refused_as_the_python_walk_refuses_it():
    records = _records(random.Random(4), 2)
    message, _ = _block_message(records, [None, None])
    block = BlockFieldsWriter().block(records[0])
    start = message.index(block)  # the first item's block field, after its length varint
    length = avro_long(len(block))
    assert message[start - len(length):start] == length
    broken = message[:start - len(length)] + avro_long(2**63 - 2) + message[start:]
    assert _outcome(broken, compiled=True) == _outcome(broken, compiled=False)
    assert _outcome(broken, compiled=True).startswith("DecodeError")


# --------------------------------------------------------------------------- one layout for both walks

def test_the_compiled_walk_takes_the_offsets_from_the_layout_and_refuses_other_types(monkeypatch):
    """A reordered layout of the same fields is read right (the offsets come from the one definition,
    schemas.block_event.BLOCK_LAYOUT); a field of another type is refused naming it, not misread."""
    import struct

    from schemas.block_event import BLOCK_LAYOUT

    _hotpath = hotpath_module("compiled")
    records = _records(random.Random(11), 20)
    contents = [None, 5, -7, None] * 5
    message, _ = _block_message(records, contents)
    expected = [item[5] for item in OwnershipBatchReader(EVENTS, compiled=True).read(message)]
    # medium and locality swapped, and the content hash moved to the front: the same sizes at other offsets
    swapped = list(BLOCK_LAYOUT)
    i, j = [n for n, (name, _) in enumerate(swapped) if name in ("medium", "locality")]
    swapped[i], swapped[j] = swapped[j], swapped[i]
    swapped.insert(0, swapped.pop(next(n for n, (name, _) in enumerate(swapped) if name == "content_hash")))
    layout = tuple(swapped)
    packed = struct.Struct("<" + "".join(code for _, code in layout))
    names = [name for name, _ in BLOCK_LAYOUT]
    writer = BlockFieldsWriter()
    blocks = []
    for record, content in zip(records, contents):
        block = writer.block(record, content)
        values = dict(zip(names, BLOCK_FIELDS.unpack_from(block)))
        blocks.append(packed.pack(*(values[name] for name, _ in layout)) + block[BLOCK_FIELDS.size:])
    other = encode_ownership_batch(BATCH.header, [
        encode_keyed_event(f"k{n}", encode_clear_mark((1, n, 0)), EVENTS.encode(r), b)
        for n, (r, b) in enumerate(zip(records, blocks))], writer.tables())
    assert other != message
    monkeypatch.setattr("schemas.ownership_batch.BLOCK_LAYOUT", layout)
    assert [item[5] for item in OwnershipBatchReader(EVENTS, compiled=True).read(other)] == expected
    with pytest.raises(ValueError, match="block field 'seq' is 'i' in the layout, 'q' in the compiled walk"):
        _hotpath.check_block_layout(tuple((name, "i" if name == "seq" else code) for name, code in BLOCK_LAYOUT))
    with pytest.raises(ValueError, match=r"missing from the layout"):
        _hotpath.check_block_layout(BLOCK_LAYOUT[:-1])
    assert _hotpath.check_block_layout(BLOCK_LAYOUT) == BLOCK_FIELDS.size == 66


def test_a_compiled_walk_that_cannot_read_the_layout_leaves_the_walk_to_python(monkeypatch, caplog):
    from schemas.block_event import BLOCK_LAYOUT

    records = _records(random.Random(12), 6)
    message, _ = _block_message(records, [None] * len(records))
    expected = OwnershipBatchReader(EVENTS, compiled=False).read(message)
    bad = tuple((name, "H" if name == "kind" else code) for name, code in BLOCK_LAYOUT)
    monkeypatch.setattr("schemas.ownership_batch.BLOCK_LAYOUT", bad)
    monkeypatch.setattr("schemas.compiled.HOTPATH", hotpath_module("compiled"))
    reader = OwnershipBatchReader(EVENTS)
    assert reader._walk_items is None and "walking in Python" in caplog.text
    monkeypatch.setattr("schemas.ownership_batch.BLOCK_LAYOUT", BLOCK_LAYOUT)
    assert repr(reader.read(message)) == repr(expected)
    with pytest.raises(ValueError, match="block field 'kind' is 'H'"):
        monkeypatch.setattr("schemas.ownership_batch.BLOCK_LAYOUT", bad)
        OwnershipBatchReader(EVENTS, compiled=True)
