"""Decode the msgpack payloads that vLLM and SGLang publish, in every shape that is out there.

A payload is one ``KVEventBatch`` (docs/ingesting.md, "Live engines"):
a positional array ``[ts, events, data_parallel_rank]``, or ``[ts, events]``
from older vLLM. Each event is

* a map tagged by ``"type"`` (vLLM since PR #42892, SGLang): fields by name,
  fields whose value is None may be absent, unknown fields are ignored;
* or a positional array whose first element is the tag (older vLLM,
  ``array_like=True``): fields in declaration order, trailing ones may be absent.

Events are decoded one by one, so an unknown ``type`` or a malformed event
fails alone (it goes to the dead-letter topic with its exact bytes) while the
rest of its batch flows. Hashes may be unsigned (vLLM) or signed (SGLang)
64-bit ints or raw digests; msgspec accepts non-minimal msgpack headers such as
the map16 vLLM writes for 11 pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

#: Field order of the positional (array_like) encoding, vLLM 0.33 ``kv_events.py``; older
#: releases send a prefix of it.
POSITIONAL_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                    "locality", "ownership", "session_id", "lookahead_token_ids"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality", "ownership"),
    "AllBlocksCleared": (),
}

_decode_raw_list = msgspec.msgpack.Decoder(list[msgspec.Raw]).decode
_decode_any = msgspec.msgpack.Decoder().decode


class BatchDecodeError(ValueError):
    """A payload that is not a KV event batch at all; the message is the reason."""


@dataclass
class EventFailure:
    """One event of a batch that could not be decoded."""

    #: Index of the event in its batch.
    batch_index: int
    #: Why, for the dead-letter record.
    reason: str
    #: The event's exact msgpack bytes.
    raw: bytes


@dataclass
class DecodedBatch:
    """A decoded KVEventBatch: events in vLLM map form, plus the events that failed."""

    #: Wall-clock seconds since the Unix epoch (vLLM KVEventBatch.ts).
    ts: float
    #: The batch's data-parallel rank (SGLang: attn_dp_rank); None when absent.
    data_parallel_rank: int | None
    #: (index in the batch, event as a map with "type", the event's exact msgpack bytes) for every event that
    #: decoded.
    events: list[tuple[int, dict, bytes]] = field(default_factory=list)
    failures: list[EventFailure] = field(default_factory=list)


def normalize_event(event: Any) -> dict:
    """One decoded msgpack event (map or tagged array) as a vLLM map-form dict.

    Raises:
        ValueError: not a map or array, no known ``type`` tag, or a positional
            event longer than its fields.
    """
    if isinstance(event, dict):
        kind = event.get("type")
        if not isinstance(kind, str) or kind not in POSITIONAL_FIELDS:
            raise ValueError(f"unknown event type {kind!r}"[:200])
        return event
    if isinstance(event, list) and event and isinstance(event[0], str):
        kind, values = event[0], event[1:]
        names = POSITIONAL_FIELDS.get(kind)
        if names is None:
            raise ValueError(f"unknown event type {kind!r}"[:200])
        if len(values) > len(names):
            values = values[:len(names)]  # fields from a newer release than this reader: ignored, as in maps
        # a field absent at the tail is one an older release did not have yet: None, as an omitted default
        return {"type": kind, **dict.fromkeys(names), **dict(zip(names, values))}
    raise ValueError(f"event is a {type(event).__name__}, not a tagged map or array")


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one published payload.

    Raises:
        BatchDecodeError: not msgpack, not an array of 2+ elements, a ``ts`` that
            is not a number, events that are not an array, or a non-integer rank.
    """
    try:
        parts = _decode_raw_list(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BatchDecodeError(f"not a msgpack KV event batch: {exc}") from None
    if len(parts) < 2:
        raise BatchDecodeError(f"batch array of {len(parts)} elements (expected [ts, events, dp_rank?])")
    try:
        ts = _decode_any(parts[0])
        raw_events = _decode_raw_list(parts[1])
        rank = _decode_any(parts[2]) if len(parts) > 2 else None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BatchDecodeError(f"malformed batch envelope: {exc}") from None
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise BatchDecodeError(f"batch ts is a {type(ts).__name__}, not a number")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise BatchDecodeError(f"batch data_parallel_rank is a {type(rank).__name__}, not an integer")
    batch = DecodedBatch(float(ts), rank)
    for index, raw in enumerate(raw_events):
        try:
            batch.events.append((index, normalize_event(_decode_any(raw)), bytes(raw)))
        except (msgspec.DecodeError, ValueError) as exc:
            batch.failures.append(EventFailure(index, str(exc), bytes(raw)))
    return batch
