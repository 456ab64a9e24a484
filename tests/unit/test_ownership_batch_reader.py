"""The materializing agent's one-pass batch reader (schemas/ownership_batch.py) against decoding item by item."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producers.split import Publisher, split_event
from schemas import AvroCodec, DecodeError
from schemas.avro_writers import avro_long, encode_clear_mark, encode_keyed_event, encode_ownership_batch
from schemas.clear_position import NO_CLEAR, ClearPosition
from schemas.ownership_batch import OwnershipBatchReader

BATCH = AvroCodec("ownership_batch")
EVENTS = AvroCodec("kv_event")
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
    message = encode_ownership_batch(BATCH.header, [encode_keyed_event(k, encode_clear_mark(m), e) for k, m, e in items])
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
    message = BATCH.header + avro_long(-5) + avro_long(len(block)) + block + b"\x00"
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
