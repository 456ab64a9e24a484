"""Split engine event batches into block-level ``kv_event`` records.

DESIGN.md ("One Kafka message per block-level event"): a vLLM ``BlockStored`` or
``BlockRemoved`` with n block hashes becomes n records keyed by each block's
canonical hash; an ``AllBlocksCleared`` becomes one record with no key, which
the producer writes to every partition. Every record keeps the batch ``seq``, the
event's index in the batch, the block's index in its run and the run length, so
the original event can be rebuilt losslessly (:func:`rebuild_event`).

Engine events come in vLLM 0.33's map form as plain dicts: ``{"type":
"BlockStored", "block_hashes": [...], "parent_block_hash": ..., ...}``; fields
that vLLM omits when they are None may be absent.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable

import msgspec

from schemas import ALL_BLOCKS_CLEARED, BLOCK_REMOVED, BLOCK_STORED, InvalidBlockHash, canonical_block_hash, tier_of
from schemas.block_hash import original_block_hash

_encode_msgpack = msgspec.msgpack.Encoder().encode
_decode_msgpack = msgspec.msgpack.Decoder().decode
_INT32 = (-(1 << 31), (1 << 31) - 1)


class InvalidEvent(ValueError):
    """An engine event that cannot become block records; the message is the reason (for the dead-letter topic)."""


@dataclass(frozen=True)
class Publisher:
    """Identity of one event publisher (one seq stream) and how its reports aggregate.

    Source identity (DESIGN.md) is ``instance_id`` + ``data_parallel_rank`` (+
    ``worker_rank`` where an engine's workers publish separately).
    """

    #: Serving instance (engine) name, e.g. ``sim-0`` or a pod name.
    instance_id: str
    #: Data-parallel rank of the engine core (vLLM KVEventBatch.data_parallel_rank).
    data_parallel_rank: int = 0
    #: Worker rank for per-worker publishers; None when the scheduler publishes for the engine.
    worker_rank: int | None = None
    #: Workers that report this source's connector events; None means 1.
    world_size: int | None = None
    #: ``REPLICATED`` or ``SHARDED`` for world_size > 1 (see the Avro enum AggregationMode); None means REPLICATED.
    aggregation: str | None = None
    #: Milliseconds since the Unix epoch when this run of the publisher was first seen.
    publisher_epoch: int = 0


def _hashes(values: Any, what: str) -> list[bytes]:
    if not isinstance(values, (list, tuple)) or not values:
        raise InvalidEvent(f"{what} must be a non-empty list of block hashes")
    try:
        return [canonical_block_hash(v) for v in values]
    except InvalidBlockHash as exc:
        raise InvalidEvent(f"{what}: {exc}") from None


def _encoding(values: Iterable[Any]) -> str:
    kind = "UINT64"
    for v in values:
        if isinstance(v, (bytes, bytearray, memoryview)):
            return "BYTES"
        if isinstance(v, int) and v < 0:
            kind = "INT64"
    return kind


def _opt_int(event: dict, name: str, bounds: tuple[int, int] | None = _INT32) -> int | None:
    value = event.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidEvent(f"{name} must be an integer or null, got {type(value).__name__}")
    if bounds and not bounds[0] <= value <= bounds[1]:
        raise InvalidEvent(f"{name}={value} is out of range")
    return value


def _opt_str(event: dict, name: str) -> str | None:
    value = event.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidEvent(f"{name} must be a string or null, got {type(value).__name__}")
    return value


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise InvalidEvent(f"{name} must be a list of integers")
    for t in value:
        if not isinstance(t, int) or isinstance(t, bool) or not _INT32[0] <= t <= _INT32[1]:
            raise InvalidEvent(f"{name} holds {t!r}, not a 32-bit integer")
    return list(value)


def split_event(publisher: Publisher, seq: int, ts: float, batch_index: int, event: dict) -> list[dict]:
    """Turn one engine event into its block-level ``kv_event`` records.

    Args:
        publisher: who published the batch.
        seq: the batch's sequence number in the publisher epoch.
        ts: the batch's wall-clock time, seconds since the Unix epoch.
        batch_index: index of ``event`` in the batch.
        event: the engine event in vLLM map form (see the module docstring).

    Returns:
        One record per block hash, in run order (one record for AllBlocksCleared,
        with ``block_hash`` None).

    Raises:
        InvalidEvent: unknown ``type``, missing or ill-typed fields, bad hashes.
    """
    if not isinstance(event, dict):
        raise InvalidEvent(f"event is a {type(event).__name__}, not a map")
    kind = event.get("type")
    envelope = {
        "instance_id": publisher.instance_id,
        "data_parallel_rank": publisher.data_parallel_rank,
        "worker_rank": publisher.worker_rank,
        "world_size": publisher.world_size,
        "aggregation": publisher.aggregation,
        "publisher_epoch": publisher.publisher_epoch,
        "seq": seq,
        "batch_index": batch_index,
        "ts": ts,
    }
    if kind == "AllBlocksCleared":
        return [{**envelope, "block_hash": None, "hash_encoding": "UINT64", "block_index": 0, "block_count": 1,
                 "tier": None, "event": (ALL_BLOCKS_CLEARED, {})}]
    if kind not in ("BlockStored", "BlockRemoved"):
        raise InvalidEvent(f"unknown event type {kind!r}")
    if "block_hashes" not in event:
        raise InvalidEvent(f"{kind} has no block_hashes")
    raw_hashes = event["block_hashes"]
    hashes = _hashes(raw_hashes, "block_hashes")
    medium = _opt_str(event, "medium")
    tier = tier_of(medium)
    group_idx = _opt_int(event, "group_idx")
    locality = _opt_str(event, "locality")
    ownership = _opt_str(event, "ownership")
    count = len(hashes)

    if kind == "BlockRemoved":
        encoding = _encoding(raw_hashes)
        body = {"medium": medium, "group_idx": group_idx, "locality": locality, "ownership": ownership}
        return [{**envelope, "block_hash": h, "hash_encoding": encoding, "block_index": i, "block_count": count,
                 "tier": tier, "event": (BLOCK_REMOVED, body)} for i, h in enumerate(hashes)]

    parent_raw = event.get("parent_block_hash")
    parent = None if parent_raw is None else _hashes([parent_raw], "parent_block_hash")[0]
    encoding = _encoding(raw_hashes if parent_raw is None else [*raw_hashes, parent_raw])
    if "token_ids" not in event or "block_size" not in event:
        raise InvalidEvent("BlockStored needs token_ids and block_size")
    tokens = _int_list(event["token_ids"], "token_ids")
    block_size = _opt_int(event, "block_size")
    if block_size is None or block_size < 0:
        raise InvalidEvent("block_size must be a non-negative integer")
    extra_keys = event.get("extra_keys")
    if extra_keys is not None and (not isinstance(extra_keys, (list, tuple)) or len(extra_keys) != count):
        raise InvalidEvent(f"extra_keys must hold one entry per block hash ({count})")
    lookahead = event.get("lookahead_token_ids")
    if lookahead is not None and (not isinstance(lookahead, (list, tuple)) or len(lookahead) != count):
        raise InvalidEvent(f"lookahead_token_ids must hold one list per block hash ({count})")
    common = {
        "block_size": block_size,
        "lora_id": _opt_int(event, "lora_id", bounds=(-(1 << 63), (1 << 63) - 1)),
        "medium": medium,
        "lora_name": _opt_str(event, "lora_name"),
        "group_idx": group_idx,
        "kv_cache_spec_kind": _opt_str(event, "kv_cache_spec_kind"),
        "kv_cache_spec_sliding_window": _opt_int(event, "kv_cache_spec_sliding_window"),
        "locality": locality,
        "ownership": ownership,
        "session_id": _opt_str(event, "session_id"),
    }
    records = []
    for i, h in enumerate(hashes):
        start = i * block_size
        block_tokens = tokens[start:] if i == count - 1 else tokens[start:start + block_size]
        body = {
            "parent_block_hash": parent if i == 0 else hashes[i - 1],
            "token_ids": block_tokens,
            "extra_keys": None if extra_keys is None else _encode_msgpack(extra_keys[i]),
            "lookahead_token_ids": None if lookahead is None else _int_list(lookahead[i], "lookahead_token_ids"),
            "parent_known": None,
            **common,
        }
        records.append({**envelope, "block_hash": h, "hash_encoding": encoding, "block_index": i,
                        "block_count": count, "tier": tier, "event": (BLOCK_STORED, body)})
    return records


class ParentTracker:
    """Marks ``BlockStored.parent_known`` on the first block of each run: has this source stored the parent?

    The producer sees each source's events in order, which the stream app (partitioned by block hash)
    cannot. It remembers the last ``capacity`` blocks stored per source and publisher epoch (about 140
    bytes each), least recently stored forgotten first, so "unknown" means "not stored by this source
    within that window since the producer started".
    """

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._stored: dict[tuple, OrderedDict] = {}

    def note(self, record: dict) -> None:
        """Set ``parent_known`` on a BlockStored record (in place) and remember its block."""
        kind, body = record["event"]
        if kind != BLOCK_STORED:
            return
        source = (record["instance_id"], record["data_parallel_rank"], record["worker_rank"],
                  record["publisher_epoch"])
        stored = self._stored.get(source)
        if stored is None:
            stored = self._stored[source] = OrderedDict()
        if record["block_index"] == 0 and body["parent_block_hash"] is not None:
            body["parent_known"] = body["parent_block_hash"] in stored
        stored[record["block_hash"]] = None
        stored.move_to_end(record["block_hash"])
        if len(stored) > self.capacity:
            stored.popitem(last=False)


def source_event(publisher: Publisher, kind: str, body: dict, seq: int, ts: float) -> dict:
    """A record of an event the bridge makes itself (``PUBLISHER_RESTARTED`` or ``SOURCE_STALE``).

    It has no block hash (the producer writes it to every partition) and ``batch_index`` -1.
    """
    return {"instance_id": publisher.instance_id, "data_parallel_rank": publisher.data_parallel_rank,
            "worker_rank": publisher.worker_rank, "world_size": publisher.world_size,
            "aggregation": publisher.aggregation, "publisher_epoch": publisher.publisher_epoch, "seq": seq,
            "batch_index": -1, "ts": ts, "block_hash": None, "hash_encoding": "UINT64", "block_index": 0,
            "block_count": 1, "tier": None, "event": (kind, body)}


def rebuild_event(records: list[dict]) -> dict:
    """Rebuild the engine event (vLLM map form, None fields omitted) from all of its block records.

    Args:
        records: every record of one event (same publisher, seq and batch_index),
            in any order.

    Raises:
        ValueError: records missing, or not all from one event.
    """
    records = sorted(records, key=lambda r: r["block_index"])
    first = records[0]
    if len(records) != first["block_count"] or [r["block_index"] for r in records] != list(range(len(records))):
        raise ValueError("records do not cover the event's whole block run")
    kind, body = first["event"]
    if kind == ALL_BLOCKS_CLEARED:
        return {"type": "AllBlocksCleared"}
    encoding = first["hash_encoding"]
    hashes = [original_block_hash(r["block_hash"], encoding) for r in records]
    if kind == BLOCK_REMOVED:
        event = {"type": "BlockRemoved", "block_hashes": hashes, "medium": body["medium"]}
        for name in ("group_idx", "locality", "ownership"):
            if body[name] is not None:
                event[name] = body[name]
        return event
    bodies = [r["event"][1] for r in records]
    parent = body["parent_block_hash"]
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None if parent is None else original_block_hash(parent, encoding),
        "token_ids": [t for b in bodies for t in b["token_ids"]],
        "block_size": body["block_size"],
        "lora_id": body["lora_id"],
        "medium": body["medium"],
        "lora_name": body["lora_name"],
    }
    if body["extra_keys"] is not None:
        event["extra_keys"] = [_decode_msgpack(b["extra_keys"]) for b in bodies]
    for name in ("group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality", "ownership",
                 "session_id"):
        if body[name] is not None:
            event[name] = body[name]
    if body["lookahead_token_ids"] is not None:
        event["lookahead_token_ids"] = [b["lookahead_token_ids"] for b in bodies]
    return event
