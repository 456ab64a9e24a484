"""Property-based fuzzing of the decoders: bad input raises the decoder's own error, never anything else.

Whatever comes off the wire or out of Kafka, the bridge and the stream app must be able to turn it into
a dead-letter record with a reason; an escaping exception would crash them instead.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.payloads import VLLM_PAYLOAD
from producers.engine_decode import BatchDecodeError, decode_batch
from producers.split import BlockEncoder, InvalidEvent, Publisher, split_event
from schemas import AvroCodec, DecodeError
from schemas.avro_writers import KvEventWriter

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PUBLISHER = Publisher("fuzz")

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=12), children, max_size=6),
    max_leaves=30)
field_names = st.sampled_from(["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                               "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                               "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
                               "lookahead_token_ids"])
events = st.dictionaries(field_names, msgpack_values, max_size=12).map(
    lambda e: e) | st.builds(lambda kind, rest: {"type": kind, **rest},
                             st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"]),
                             st.dictionaries(field_names, msgpack_values, max_size=12))


def _mutate(data: bytes, position: int, byte: int) -> bytes:
    if not data:
        return bytes([byte])
    position %= len(data)
    return data[:position] + bytes([byte]) + data[position + 1:]


@FUZZ
@given(st.binary(max_size=400))
def test_random_bytes_never_escape_the_batch_decoder(payload):
    try:
        decode_batch(payload)
    except BatchDecodeError:
        pass


@FUZZ
@given(st.integers(min_value=0), st.integers(min_value=0, max_value=255), st.integers(min_value=0, max_value=296))
def test_mutated_vllm_payloads_fail_alone_or_decode(position, byte, cut):
    payload = _mutate(VLLM_PAYLOAD, position, byte)[: max(cut, 1)]
    try:
        batch = decode_batch(payload)
    except BatchDecodeError:
        return
    for index, event, _ in batch.events:
        try:
            split_event(PUBLISHER, 0, batch.ts, index, event)
        except InvalidEvent:
            pass


@FUZZ
@given(st.lists(events, max_size=5), msgpack_values)
def test_random_events_split_or_raise_invalid_event(batch_events, rank):
    payload = msgspec.msgpack.encode([1.0, batch_events, rank])
    try:
        batch = decode_batch(payload)
    except BatchDecodeError:
        return
    good = 0
    for index, event, _ in batch.events:
        encoder = BlockEncoder(KvEventWriter(AvroCodec("kv_event")))
        try:
            records = split_event(PUBLISHER, 0, batch.ts, index, event)
        except InvalidEvent:
            with pytest.raises(InvalidEvent):  # the producer's fast path rejects the same events
                encoder.encode_event(PUBLISHER, 0, batch.ts, index, event)
            continue
        good += 1
        codec = AvroCodec("kv_event")
        for record in records:  # what split_event accepts, the contract can carry
            assert codec.decode(codec.encode(record)) == record
        # and the fast path writes the same bytes
        assert encoder.encode_event(PUBLISHER, 0, batch.ts, index, event) == [
            (r["block_hash"], codec.encode(r)) for r in records]
    assert good + len(batch.failures) <= len(batch_events)


@FUZZ
@given(st.binary(max_size=300), st.integers(min_value=0), st.integers(min_value=0, max_value=255))
def test_random_and_mutated_avro_raise_decode_error(noise, position, byte):
    codec = AvroCodec("kv_event")
    valid = codec.encode(split_event(PUBLISHER, 3, 1.0, 0, {"type": "BlockRemoved", "block_hashes": [7],
                                                           "medium": "GPU"})[0])
    for data in (noise, b"\xc3\x01" + valid[2:10] + noise, _mutate(valid, position, byte)):
        try:
            codec.decode(data)
        except DecodeError:
            pass
