"""Engine events parsed and validated: what the block-level records of one engine event are built from.

Engine events come in vLLM 0.33's map form as plain dicts: ``{"type":
"BlockStored", "block_hashes": [...], "parent_block_hash": ..., ...}``; fields
that vLLM omits when they are None may be absent (:data:`REQUIRED_FIELDS` names those that may not).

:func:`parse_event` checks one event and canonicalizes its hashes and tier into a :class:`ParsedEvent`, or raises
:class:`InvalidEvent`, whose message is the reason the dead-letter topic gets; :class:`Publisher` is who
published it. :func:`block_content_hash` is a stored block's content hash, which :mod:`producers.split` writes and
:mod:`producers.rebuild` compares with the one a record carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from schemas import ALL_BLOCKS_CLEARED, BLOCK_REMOVED, BLOCK_STORED, InvalidBlockHash, canonical_block_hash, tier_of
from schemas.content_hash import content_hash, says_extra_keys, stored_extra_keys

_INT32 = (-(1 << 31), (1 << 31) - 1)
#: Avro ``long``: the range of a signed 64-bit integer.
LONG_RANGE = (-(1 << 63), (1 << 63) - 1)


class InvalidEvent(ValueError):
    """An engine event that cannot become block records; the message is the reason (for the dead-letter topic)."""


@dataclass(frozen=True)
class Publisher:
    """Identity of one event publisher (one seq stream) and how its reports aggregate.

    Source identity (docs/contract.md, "Source identity, epochs and order") is ``instance_id`` +
    ``data_parallel_rank`` (+ ``worker_rank`` where an engine's workers publish separately).
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
    #: The serving engine's protocol: ``vllm`` (unsigned 64-bit hashes; medium and lora_name always sent) or
    #: ``sglang`` (signed 64-bit hashes). It decides which fields must be present and the hash encoding
    #: (:data:`REQUIRED_FIELDS`, :func:`hash_encoding`).
    engine: str = "vllm"
    #: How the engine reports prefix-cache reuse (``kv_event`` v5 ``BlockStored.report_mode``): None, the engine's
    #: default, every store a block just stored; ``"full"``: vLLM's ``kv_cache_report_mode="full"`` (PR #45261),
    #: which also re-announces reused blocks, so a repeated store is not a second copy (docs/residency.md).
    report_mode: str | None = None


def _hashes(values: Any, what: str) -> list[bytes]:
    if not isinstance(values, (list, tuple)) or not values:
        raise InvalidEvent(f"{what} must be a non-empty list of block hashes")
    try:
        return [canonical_block_hash(v) for v in values]
    except InvalidBlockHash as exc:
        raise InvalidEvent(f"{what}: {exc}") from None


#: The engines whose protocols the producers read, and the HashEncoding of their integer block hashes:
#: vLLM publishes unsigned 64-bit ints (the low 8 bytes of a SHA-256 chain hash), SGLang signed ones
#: (``hash_str_to_int64``). Byte digests are ``BYTES`` in both.
ENGINE_INT_ENCODING = {"vllm": "UINT64", "sglang": "INT64"}

#: Fields an engine always puts on the wire, per event type: its structs (``omit_defaults=True``) leave out
#: only fields whose default is None. vLLM 0.33's ``BlockStored`` has no default for its first seven fields and
#: ``BlockRemoved`` for its first two; SGLang 0.5.23's have none for five and one (medium, lora_name,
#: cache_salt and session_id default to None there). An event without one of these is malformed and is
#: dead-lettered naming the field; every other field may be absent and then means None (docs/contract.md,
#: "Absent fields"), with one reading of None: a vLLM store without ``extra_keys`` does not say its extra keys
#: (:func:`block_content_hash`).
REQUIRED_FIELDS = {
    "vllm": {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                             "lora_name"),
             "BlockRemoved": ("block_hashes", "medium")},
    "sglang": {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"),
               "BlockRemoved": ("block_hashes",)},
}


#: Field of a BlockStored event that no engine sends: one content hash per block hash (a signed 64-bit int, or None
#: for a block without one), for a producer that knows its blocks' content hashes but not their tokens (the
#: simulator: producers.trace.trace_block_content_hash). When present it is every block's
#: ``BlockStored.content_hash``, whatever the block's tokens; :func:`producers.rebuild.rebuild_event` gives it back
#: only where it differs from what the tokens give.
CONTENT_HASHES = "kvstream_content_hashes"

_REQUIRED_SETS = {engine: {kind: frozenset(names) for kind, names in kinds.items()}
                  for engine, kinds in REQUIRED_FIELDS.items()}


def hash_encoding(values: Iterable[Any], engine: str) -> str:
    """The HashEncoding of an event's hashes, from the engine's protocol (never from the values' signs).

    Raises:
        InvalidEvent: an int outside the engine's range (a negative vLLM hash, an SGLang hash of 2**63 or more).
    """
    encoding = ENGINE_INT_ENCODING[engine]
    for v in values:
        if isinstance(v, (bytes, bytearray, memoryview)):
            return "BYTES"
        if encoding == "UINT64" and v < 0:
            raise InvalidEvent(f"block hash {v} is negative; {engine} publishes unsigned 64-bit hashes")
        if encoding == "INT64" and v >= 1 << 63:
            raise InvalidEvent(f"block hash {v} is beyond 2**63-1; {engine} publishes signed 64-bit hashes")
    return encoding


def check_envelope(seq: int, batch_index: int, publisher: Publisher) -> None:
    """The batch fields every record of an event carries must fit their Avro types (``long``).

    Raises:
        InvalidEvent: naming the field, e.g. a batch ``seq`` of 2**63 (the bridge reads it from 8 unsigned
            bytes; Avro's long is signed).
    """
    low, high = LONG_RANGE
    epoch = publisher.publisher_epoch
    if type(seq) is int and type(batch_index) is int and type(epoch) is int and low <= seq <= high \
            and low <= batch_index <= high and low <= epoch <= high:
        return  # the common case in one test: this runs per engine event
    for name, value in (("seq", seq), ("batch_index", batch_index), ("publisher_epoch", epoch)):
        if type(value) is not int or not low <= value <= high:
            raise InvalidEvent(f"{name}={value!r} is not an integer in Avro's long range [-2**63, 2**63)")


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


def _token_positions(value: Any) -> tuple[list[int], int]:
    """``token_ids`` as (flat ints, ints per position): plain ints (width 1), or positions that are tuples of w
    ints each, as SGLang publishes them with EAGLE speculative decoding (bigram pages: w = 2).

    Raises:
        InvalidEvent: not a list, mixed shapes, tuples of different lengths, or ints outside 32 bits.
    """
    if not isinstance(value, (list, tuple)):
        raise InvalidEvent("token_ids must be a list of integers (or of equal-length lists of integers)")
    if not value or not isinstance(value[0], (list, tuple)):
        return _int_list(value, "token_ids"), 1
    width = len(value[0])
    if width < 2 or not all(isinstance(p, (list, tuple)) and len(p) == width for p in value):
        raise InvalidEvent(f"token_ids holds token tuples of different lengths (the first has {width}); "
                           "expected ints, or lists of 2 or more ints all of one length")
    return _int_list([t for p in value for t in p], "token_ids"), width


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise InvalidEvent(f"{name} must be a list of integers")
    for t in value:
        if not isinstance(t, int) or isinstance(t, bool) or not _INT32[0] <= t <= _INT32[1]:
            raise InvalidEvent(f"{name} holds {t!r}, not a 32-bit integer")
    return list(value)


@dataclass(slots=True)
class ParsedEvent:
    """One engine event, validated: what every block record of it is built from."""

    #: Full Avro branch name (BLOCK_STORED, BLOCK_REMOVED, ALL_BLOCKS_CLEARED).
    kind: str
    #: Canonical block hashes, in run order (empty for a clear).
    hashes: list[bytes]
    #: HashEncoding symbol of the event's hashes.
    encoding: str = "UINT64"
    #: Canonical tier; None for a clear.
    tier: str | None = None
    #: The body fields every block shares (BlockStored without the per-block ones; BlockRemoved whole).
    common: dict | None = None
    #: BlockStored only: parent of the first block, all tokens, extra keys and lookahead per block.
    parent: bytes | None = None
    tokens: list[int] | None = None
    extra_keys: Any = None
    lookahead: list[list[int]] | None = None
    #: Ints per token position: 1, or w when the engine sent each position as a w-tuple (flattened in tokens).
    token_width: int = 1
    #: The event's :data:`CONTENT_HASHES`, one per block; None when it has none (the hashes are computed).
    content_hashes: list | None = None
    #: The publishing engine (:attr:`Publisher.engine`): which fields say a block's extra keys
    #: (:func:`schemas.content_hash.says_extra_keys`).
    engine: str = "vllm"


def parse_event(event: dict, engine: str = "vllm") -> ParsedEvent:
    """Validate one engine event (vLLM map form) and canonicalize its hashes and tier.

    Raises:
        InvalidEvent: see :func:`split_event`.
    """
    if not isinstance(event, dict):
        raise InvalidEvent(f"event is a {type(event).__name__}, not a map")
    kind = event.get("type")
    if kind == "AllBlocksCleared":
        return ParsedEvent(ALL_BLOCKS_CLEARED, [])
    if kind not in ("BlockStored", "BlockRemoved"):
        raise InvalidEvent(f"unknown event type {kind!r}")
    if not event.keys() >= _REQUIRED_SETS[engine][kind]:
        missing = [name for name in REQUIRED_FIELDS[engine][kind] if name not in event]
        raise InvalidEvent(f"{kind} from {engine} lacks required field {missing[0]!r}"
                           + (f" (and {', '.join(map(repr, missing[1:]))})" if len(missing) > 1 else ""))
    raw_hashes = event["block_hashes"]
    hashes = _hashes(raw_hashes, "block_hashes")
    medium = _opt_str(event, "medium")
    tier = tier_of(medium)
    group_idx = _opt_int(event, "group_idx")
    locality = _opt_str(event, "locality")
    ownership = _opt_str(event, "ownership")
    count = len(hashes)

    if kind == "BlockRemoved":
        return ParsedEvent(BLOCK_REMOVED, hashes, hash_encoding(raw_hashes, engine), tier,
                            {"medium": medium, "group_idx": group_idx, "locality": locality, "ownership": ownership})

    parent_raw = event.get("parent_block_hash")
    parent = None if parent_raw is None else _hashes([parent_raw], "parent_block_hash")[0]
    encoding = hash_encoding(raw_hashes if parent_raw is None else [*raw_hashes, parent_raw], engine)
    raw_tokens = event["token_ids"]
    if raw_tokens and isinstance(raw_tokens, list) and type(raw_tokens[0]) is int:  # plain token ids: most events
        tokens, token_width = _int_list(raw_tokens, "token_ids"), 1
    else:
        tokens, token_width = _token_positions(raw_tokens)
    block_size = _opt_int(event, "block_size")
    if block_size is None or block_size < 0:
        raise InvalidEvent("block_size must be a non-negative integer")
    extra_keys = event.get("extra_keys")
    if extra_keys is not None and (not isinstance(extra_keys, (list, tuple)) or len(extra_keys) != count):
        raise InvalidEvent(f"extra_keys must hold one entry per block hash ({count})")
    lookahead = event.get("lookahead_token_ids")
    if lookahead is not None and (not isinstance(lookahead, (list, tuple)) or len(lookahead) != count):
        raise InvalidEvent(f"lookahead_token_ids must hold one list per block hash ({count})")
    if lookahead is not None:
        lookahead = [_int_list(tokens_i, "lookahead_token_ids") for tokens_i in lookahead]
    given = event.get(CONTENT_HASHES)
    if given is not None:
        if not isinstance(given, (list, tuple)) or len(given) != count:
            raise InvalidEvent(f"{CONTENT_HASHES} must hold one entry per block hash ({count})")
        for h in given:
            if h is not None and (type(h) is not int or not LONG_RANGE[0] <= h <= LONG_RANGE[1]):
                raise InvalidEvent(f"{CONTENT_HASHES} holds {h!r}, not a signed 64-bit integer or null")
        given = list(given)
    common = {
        "block_size": block_size,
        "lora_id": _opt_int(event, "lora_id", bounds=LONG_RANGE),
        "medium": medium,
        "lora_name": _opt_str(event, "lora_name"),
        "group_idx": group_idx,
        "kv_cache_spec_kind": _opt_str(event, "kv_cache_spec_kind"),
        "kv_cache_spec_sliding_window": _opt_int(event, "kv_cache_spec_sliding_window"),
        "locality": locality,
        "ownership": ownership,
        "session_id": _opt_str(event, "session_id"),
        "cache_salt": _opt_str(event, "cache_salt"),
        "token_id_width": None if token_width == 1 else token_width,
    }
    return ParsedEvent(BLOCK_STORED, hashes, encoding, tier, common, parent, tokens, extra_keys, lookahead,
                        token_width, given, engine)


def block_content_hash(parsed: ParsedEvent, i: int, block_tokens: list[int]) -> int | None:
    """``BlockStored.content_hash`` of block ``i`` of a parsed store whose tokens are ``block_tokens``, from the event
    alone: the event's :data:`CONTENT_HASHES` entry when it has them; else the hash of the tokens and the block's extra
    keys (:func:`schemas.content_hash.stored_extra_keys`).

    Returns:
        A signed 64-bit int; None for a block without tokens, and for a store that does not say its extra keys: a
        vLLM store without ``extra_keys`` (vLLM 0.33's ``OffloadingEventsTracker`` sends its CPU stores so), whose
        tokens alone would give the content of the same tokens unsalted and without LoRA
        (:func:`schemas.content_hash.says_extra_keys`). :class:`producers.split.ParentTracker` gives such a block the
        content known for its engine hash, when it knows it.
    """
    if parsed.content_hashes is not None:
        return parsed.content_hashes[i]
    if not block_tokens:
        return None
    extra_keys, common = parsed.extra_keys, parsed.common
    if extra_keys is not None:
        entry = extra_keys[i]
        if entry is None:  # vLLM's entry for a block without extra keys: no call, most blocks are such
            return content_hash(block_tokens)
        return content_hash(block_tokens, stored_extra_keys(entry, True))
    if not says_extra_keys(False, parsed.engine):
        return None
    return content_hash(block_tokens, stored_extra_keys(None, False, common["lora_name"], common["cache_salt"],
                                                        i == 0 and parsed.parent is None))
