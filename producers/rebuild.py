"""The engine's event rebuilt from its block-level ``kv_event`` records, as the engine sent it: the lossless
inverse of :func:`producers.split.split_event` (:func:`rebuild_event`).

Every record of an event keeps the batch ``seq``, the event's index in the batch, the block's index in its run and
the run length, which is what lets the run be put back together (docs/contract.md, "One Kafka message per
block-level event").
"""

from __future__ import annotations

import msgspec

from producers.engine_events import CONTENT_HASHES, REQUIRED_FIELDS, ParsedEvent, block_content_hash
from schemas import ALL_BLOCKS_CLEARED, BLOCK_REMOVED, BLOCK_STORED
from schemas.block_hash import original_block_hash
from schemas.content_hash import says_extra_keys

_decode_msgpack = msgspec.msgpack.Decoder().decode


def rebuild_event(records: list[dict]) -> dict:
    """Rebuild the engine event as the engine sent it, in map form, from all of its block records.

    Fields the engine always sends (:data:`REQUIRED_FIELDS`; the engine is SGLang when the hashes are
    ``INT64``) are present even when None, the others only when set; token tuples (``token_id_width``) are
    regrouped. ``content_hash`` is the producer's, not the engine's: it is left out, except that content hashes
    the tokens do not give (an event's :data:`CONTENT_HASHES`, e.g. the simulator's stores without tokens) come
    back in that field. A store with tokens that does not say its extra keys (a vLLM store without ``extra_keys``)
    has the content hash the producer remembered for its block (:class:`producers.split.ParentTracker`), or none:
    that is the producer's too, and is left out.

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
    # the fields the engine always sends appear even when None; the others only when set (INT64 hashes are
    # SGLang's, whose medium and lora_name have defaults; REQUIRED_FIELDS)
    required = REQUIRED_FIELDS["sglang" if encoding == "INT64" else "vllm"]
    if kind == BLOCK_REMOVED:
        event = {"type": "BlockRemoved", "block_hashes": hashes, "medium": body["medium"]}
        for name in ("medium", "group_idx", "locality", "ownership"):
            if body[name] is None and name not in required["BlockRemoved"]:
                event.pop(name, None)
            elif body[name] is not None:
                event[name] = body[name]
        return event
    bodies = [r["event"][1] for r in records]
    parent = body["parent_block_hash"]
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None if parent is None else original_block_hash(parent, encoding),
        "token_ids": _regroup([t for b in bodies for t in b["token_ids"]], body.get("token_id_width")),
        "block_size": body["block_size"],
        "lora_id": body["lora_id"],
        "medium": body["medium"],
        "lora_name": body["lora_name"],
    }
    for name in ("medium", "lora_name"):
        if event[name] is None and name not in required["BlockStored"]:
            del event[name]
    if body["extra_keys"] is not None:
        event["extra_keys"] = [_decode_msgpack(b["extra_keys"]) for b in bodies]
    for name in ("group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality", "ownership",
                 "session_id", "cache_salt"):
        if body.get(name) is not None:  # get: records of older schema versions lack the newer fields
            event[name] = body[name]
    if body["lookahead_token_ids"] is not None:
        event["lookahead_token_ids"] = [b["lookahead_token_ids"] for b in bodies]
    given = [b.get("content_hash") for b in bodies]
    if any(h is not None for h in given):
        engine = "sglang" if encoding == "INT64" else "vllm"
        parsed = ParsedEvent(BLOCK_STORED, [], common={"lora_name": body["lora_name"],
                                                        "cache_salt": body.get("cache_salt")},
                              parent=parent, extra_keys=event.get("extra_keys"), engine=engine)
        said = says_extra_keys("extra_keys" in event, engine)
        if any(h is not None and (said or not b["token_ids"]) and h != block_content_hash(parsed, i, b["token_ids"])
               for i, (h, b) in enumerate(zip(given, bodies))):
            event[CONTENT_HASHES] = given
    return event


def _regroup(tokens: list[int], width: int | None) -> list:
    """Flattened token tuples back into the engine's shape: ``width`` ints per position (None or 1: as they are)."""
    if not width or width == 1:
        return tokens
    return [tokens[i:i + width] for i in range(0, len(tokens), width)]
