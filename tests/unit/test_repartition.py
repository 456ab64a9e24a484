"""The repartition stage's own code paths, without Kafka: clear history, hand-written Avro, header routing."""

from __future__ import annotations

import random

import pytest

from producers.split import Publisher, split_event
from schemas import AvroCodec
from schemas.avro_writers import encode_clear_mark, encode_keyed_event, encode_ownership_batch
from schemas.clear_position import NO_CLEAR
from schemas.codec import schema_versions
from stream_apps.repartition import ClearHistory, source_of

BATCH = AvroCodec("ownership_batch")
FINGERPRINTS = frozenset(v.fingerprint for v in schema_versions("kv_event"))


def test_a_replayed_event_gets_the_clear_mark_it_got_the_first_time():
    history = ClearHistory("e1", 0, 3)
    assert history.mark_before(10) == NO_CLEAR
    assert history.add(20, (1, 5, 0)) and history.add(40, (1, 9, 2))
    assert not history.add(20, (1, 5, 0))  # the clear read again after a crash: already known
    assert [history.mark_before(o) for o in (10, 20, 21, 40, 41)] == [NO_CLEAR, NO_CLEAR, (1, 5, 0), (1, 5, 0),
                                                                      (1, 9, 2)]
    assert [history.encoded_mark_before(o) for o in (10, 30, 41)] == [encode_clear_mark(NO_CLEAR), encode_clear_mark((1, 5, 0)),
                                                                      encode_clear_mark((1, 9, 2))]
    assert ClearHistory.from_record(history.to_record()) == history
    AvroCodec("source_clears").encode(history.to_record())  # the record fits its schema


@pytest.mark.parametrize("seed", range(5))
def test_hand_written_ownership_batch_decodes_to_what_fastavro_writes(seed):
    rng = random.Random(seed)
    marks = [NO_CLEAR, (0, 0, 0), (1767225600000, 2**40, 7), (-1, 3, 2**31 - 1)]
    items = []
    for _ in range(rng.randrange(0, 50)):
        key = rng.choice(["primary/", "kvcr/", "AllBlocksCleared/ém/"]) + bytes(rng.randrange(8, 33)).hex()
        items.append((key, rng.choice(marks), rng.randbytes(rng.choice([0, 5, 200, 20000]))))
    written = encode_ownership_batch(BATCH._header, [encode_keyed_event(k, encode_clear_mark(m), e) for k, m, e in items])
    expected = {"events": [{"key": k, "clear_mark": None if m == NO_CLEAR else
                            {"publisher_epoch": m[0], "seq": m[1], "batch_index": m[2]}, "event": e}
                           for k, m, e in items]}
    assert BATCH.decode(written) == expected
    assert written == BATCH.encode(expected)


def test_source_is_read_from_the_front_of_the_record_without_decoding_it():
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [], "block_size": 16,
             "lora_id": None, "medium": "GPU", "lora_name": None}
    for version in (1, 2):
        value = AvroCodec("kv_event", version).encode(split_event(Publisher("engine-é7", 300), 5, 1.0, 0, event)[0])
        assert source_of(value, FINGERPRINTS) == ("engine-é7", 300)
        assert source_of(value[:12], FINGERPRINTS) is None  # cut short
    assert source_of(b"\x00\x00\x00\x00\x01rest", FINGERPRINTS) is None  # Confluent framing: decoded instead
    assert source_of(b"\xc3\x01" + bytes(8) + b"\x02a\x00", FINGERPRINTS) is None  # unknown fingerprint
