"""Split engine event batches into block-level ``kv_event`` records.

docs/contract.md, "One Kafka message per block-level event": a vLLM ``BlockStored`` or
``BlockRemoved`` with n block hashes becomes n records keyed by each block's
canonical hash; an ``AllBlocksCleared`` becomes one record with no key, which
the producer writes to every partition. Every record keeps the batch ``seq``, the
event's index in the batch, the block's index in its run and the run length, so
the original event can be rebuilt losslessly (:func:`rebuild_event`).

Engine events come in vLLM 0.33's map form as plain dicts: ``{"type":
"BlockStored", "block_hashes": [...], "parent_block_hash": ..., ...}``; fields
that vLLM omits when they are None may be absent.

Every stored block with tokens gets its content hash (``BlockStored.content_hash``, kv_event v4), computed here
from its tokens and extra keys (:func:`schemas.content_hash.stored_extra_keys`): it is the producer's, not the
engine's, so :func:`rebuild_event` leaves it out. A producer that knows its blocks' content without their tokens
(the simulator, whose trace has block ids, not tokens) gives the hashes in the event's :data:`CONTENT_HASHES`
field instead, which no engine sends.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable

import msgspec

from schemas import ALL_BLOCKS_CLEARED, BLOCK_REMOVED, BLOCK_STORED, InvalidBlockHash, canonical_block_hash, tier_of
from schemas.avro_writers import AVRO_NULL, KvEventWriter, avro_bytes, avro_double, avro_int_array, avro_long
from schemas.block_hash import original_block_hash
from schemas.content_hash import content_hash, stored_extra_keys

_BRANCH_1 = b"\x02"

_encode_msgpack = msgspec.msgpack.Encoder().encode
_decode_msgpack = msgspec.msgpack.Decoder().decode
_INT32 = (-(1 << 31), (1 << 31) - 1)
_LONG = (-(1 << 63), (1 << 63) - 1)


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
#: "Absent fields").
REQUIRED_FIELDS = {
    "vllm": {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                             "lora_name"),
             "BlockRemoved": ("block_hashes", "medium")},
    "sglang": {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"),
               "BlockRemoved": ("block_hashes",)},
}


#: BlockStored's v3 fields ``cache_salt`` and ``token_id_width``, both null: what nearly every store ends with.
_NO_SUFFIX = AVRO_NULL + AVRO_NULL

#: Field of a BlockStored event that no engine sends: one content hash per block hash (a signed 64-bit int, or None
#: for a block without one), for a producer that knows its blocks' content hashes but not their tokens (the
#: simulator: producers.simulator.trace_block_content_hash). When present it is every block's
#: ``BlockStored.content_hash``, whatever the block's tokens; :func:`rebuild_event` gives it back only where it
#: differs from what the tokens give.
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


def _check_envelope(seq: int, batch_index: int, publisher: Publisher) -> None:
    """The batch fields every record of an event carries must fit their Avro types (``long``).

    Raises:
        InvalidEvent: naming the field, e.g. a batch ``seq`` of 2**63 (the bridge reads it from 8 unsigned
            bytes; Avro's long is signed).
    """
    low, high = _LONG
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
class _ParsedEvent:
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


def _parse_event(event: dict, engine: str = "vllm") -> _ParsedEvent:
    """Validate one engine event (vLLM map form) and canonicalize its hashes and tier.

    Raises:
        InvalidEvent: see :func:`split_event`.
    """
    if not isinstance(event, dict):
        raise InvalidEvent(f"event is a {type(event).__name__}, not a map")
    kind = event.get("type")
    if kind == "AllBlocksCleared":
        return _ParsedEvent(ALL_BLOCKS_CLEARED, [])
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
        return _ParsedEvent(BLOCK_REMOVED, hashes, hash_encoding(raw_hashes, engine), tier,
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
            if h is not None and (type(h) is not int or not _LONG[0] <= h <= _LONG[1]):
                raise InvalidEvent(f"{CONTENT_HASHES} holds {h!r}, not a signed 64-bit integer or null")
        given = list(given)
    common = {
        "block_size": block_size,
        "lora_id": _opt_int(event, "lora_id", bounds=_LONG),
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
    return _ParsedEvent(BLOCK_STORED, hashes, encoding, tier, common, parent, tokens, extra_keys, lookahead,
                        token_width, given)


def _block_tokens(tokens: list[int], block_size: int, i: int, count: int) -> list[int]:
    """Block ``i``'s tokens: ``block_size`` of them; the last block also takes any beyond the full blocks."""
    start = i * block_size
    return tokens[start:] if i == count - 1 else tokens[start:start + block_size]


def _content_hash(parsed: _ParsedEvent, i: int, block_tokens: list[int]) -> int | None:
    """``BlockStored.content_hash`` of block ``i`` of a parsed store whose tokens are ``block_tokens``: the event's
    :data:`CONTENT_HASHES` entry when it has them; else the hash of the tokens and the block's extra keys
    (:func:`schemas.content_hash.stored_extra_keys`); None for a block without tokens."""
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
    return content_hash(block_tokens, stored_extra_keys(None, False, common["lora_name"], common["cache_salt"],
                                                        i == 0 and parsed.parent is None))


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
    parsed = _parse_event(event, publisher.engine)
    _check_envelope(seq, batch_index, publisher)
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
    if parsed.kind == ALL_BLOCKS_CLEARED:
        return [{**envelope, "block_hash": None, "hash_encoding": "UINT64", "block_index": 0, "block_count": 1,
                 "tier": None, "event": (ALL_BLOCKS_CLEARED, {})}]
    hashes, encoding, tier = parsed.hashes, parsed.encoding, parsed.tier
    count = len(hashes)
    if parsed.kind == BLOCK_REMOVED:
        body = parsed.common
        return [{**envelope, "block_hash": h, "hash_encoding": encoding, "block_index": i, "block_count": count,
                 "tier": tier, "event": (BLOCK_REMOVED, dict(body))} for i, h in enumerate(hashes)]

    common, extra_keys, lookahead = parsed.common, parsed.extra_keys, parsed.lookahead
    block_ints = common["block_size"] * parsed.token_width
    records = []
    for i, h in enumerate(hashes):
        tokens = _block_tokens(parsed.tokens, block_ints, i, count)
        body = {
            "parent_block_hash": parsed.parent if i == 0 else hashes[i - 1],
            "token_ids": tokens,
            "extra_keys": None if extra_keys is None else _encode_msgpack(extra_keys[i]),
            "lookahead_token_ids": None if lookahead is None else lookahead[i],
            "parent_known": None,
            **common,
            "content_hash": _content_hash(parsed, i, tokens),
            "report_mode": publisher.report_mode,
        }
        records.append({**envelope, "block_hash": h, "hash_encoding": encoding, "block_index": i,
                        "block_count": count, "tier": tier, "event": (BLOCK_STORED, body)})
    return records


class ParentTracker:
    """Marks ``BlockStored.parent_known`` on the first block of each run: has this engine stored the parent?

    The producer sees each engine's events in order, which the stream app (partitioned by block hash)
    cannot. It remembers the last ``capacity`` blocks stored per engine, ``(instance_id,
    data_parallel_rank)``, least recently stored forgotten first, so "unknown" means "not stored by this
    engine within that window since the producer started". Per engine, not per worker rank: in SHARDED
    mode the ranks store different blocks of one engine's cache, so a parent stored by another rank is
    known (docs/residency.md, "Reference counting").
    """

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._stored: dict[tuple, OrderedDict] = {}

    def note(self, record: dict) -> None:
        """Set ``parent_known`` on a BlockStored record (in place) and remember its block."""
        kind, body = record["event"]
        if kind != BLOCK_STORED:
            return
        source = (record["instance_id"], record["data_parallel_rank"])
        stored = self._stored.get(source)
        if stored is None:
            stored = self._stored[source] = OrderedDict()
        if record["block_index"] == 0 and body["parent_block_hash"] is not None:
            body["parent_known"] = body["parent_block_hash"] in stored
        stored[record["block_hash"]] = None
        stored.move_to_end(record["block_hash"])
        if len(stored) > self.capacity:
            stored.popitem(last=False)


    def note_run(self, source: tuple, parent: bytes | None, hashes: list[bytes]) -> bool | None:
        """:meth:`note` for a whole BlockStored run at once: returns the first block's ``parent_known``.

        Args:
            source: the engine, ``(instance_id, data_parallel_rank)``.
            parent: the run's parent hash (None: ``parent_known`` stays None).
            hashes: the run's block hashes, in order.
        """
        stored = self._stored.get(source)
        if stored is None:
            stored = self._stored[source] = OrderedDict()
        known = None if parent is None else parent in stored
        for h in hashes:
            if h in stored:
                stored.move_to_end(h)
            else:
                stored[h] = None
        while len(stored) > self.capacity:
            stored.popitem(last=False)
        return known


class BlockEncoder:
    """Split an engine event and encode its block records in one step, without building record dicts.

    The bytes are exactly those of :func:`split_event`, then :meth:`ParentTracker.note` and
    :meth:`schemas.codec.AvroCodec.encode` on each record (tests/unit/test_split.py checks it); the parts
    that every block of an event shares are encoded once per event.

    Args:
        writer: the ``kv_event`` v5 writer (:class:`schemas.avro_writers.KvEventWriter`).
        parents: tracker that sets ``parent_known``; None leaves it null.
    """

    def __init__(self, writer: KvEventWriter, parents: ParentTracker | None = None) -> None:
        self.writer = writer
        self.parents = parents
        self._stored_branch = writer.branch[BLOCK_STORED]
        self._removed_branch = writer.branch[BLOCK_REMOVED]
        self._cleared = writer.branch[ALL_BLOCKS_CLEARED]

    def encode_event(self, publisher: Publisher, seq: int, ts: float, batch_index: int,
                     event: dict) -> list[tuple[bytes | None, bytes]]:
        """One engine event's block records as ``(key, value)``: key = block hash, None for a clear.

        Arguments as :func:`split_event`.

        Raises:
            InvalidEvent: as :func:`split_event`.
        """
        parsed = _parse_event(event, publisher.engine)
        if not (type(seq) is int and type(batch_index) is int and _LONG[0] <= seq <= _LONG[1]
                and _LONG[0] <= batch_index <= _LONG[1]):  # the common case inline: this runs per engine event
            _check_envelope(seq, batch_index, publisher)
        w = self.writer
        head = b"".join((w.prefix(publisher.instance_id, publisher.data_parallel_rank, publisher.worker_rank,
                                  publisher.world_size, publisher.aggregation, publisher.publisher_epoch),
                         avro_long(seq), avro_long(batch_index), avro_double(ts)))
        if parsed.kind == ALL_BLOCKS_CLEARED:
            return [(None, b"".join((head, AVRO_NULL, w.hash_encoding["UINT64"], avro_long(0), avro_long(1),
                                     w.tier[None], self._cleared)))]
        hashes = parsed.hashes
        count = len(hashes)
        encoding = w.hash_encoding[parsed.encoding]
        after_index = b"".join((avro_long(count), w.tier[parsed.tier]))
        if parsed.kind == BLOCK_REMOVED:
            tail = after_index + self._removed_branch + w.removed_body(parsed.common)
            return [(h, b"".join((head, _BRANCH_1, avro_bytes(h), encoding, avro_long(i), tail)))
                    for i, h in enumerate(hashes)]

        common = parsed.common
        after_index += self._stored_branch
        middle = w.stored_middle(common)
        tail = w.stored_tail(common)
        block_ints, tokens, extra_keys, lookahead = common["block_size"] * parsed.token_width, parsed.tokens, \
            parsed.extra_keys, parsed.lookahead
        salt, width = common["cache_salt"], common["token_id_width"]
        suffix = _NO_SUFFIX if salt is None and width is None else w.stored_suffix(salt, width)
        parent_known = None
        if self.parents is not None:
            parent_known = self.parents.note_run((publisher.instance_id, publisher.data_parallel_rank),
                                                 parsed.parent, hashes)
        given = parsed.content_hashes
        report_mode = AVRO_NULL if publisher.report_mode is None else w.report_mode(publisher.report_mode)
        out = []
        parent = parsed.parent
        for i, h in enumerate(hashes):
            encoded_hash = avro_bytes(h)
            if tokens:
                block_tokens = _block_tokens(tokens, block_ints, i, count)
                encoded_tokens = avro_int_array(block_tokens)
                digest = _content_hash(parsed, i, block_tokens)
            else:  # placeholder stores (offload connectors): no tokens, no content unless the event gives it
                encoded_tokens = b"\x00"
                digest = None if given is None else given[i]
            out.append((h, b"".join((
                head, _BRANCH_1, encoded_hash, encoding, avro_long(i), after_index,
                AVRO_NULL if parent is None else _BRANCH_1 + avro_bytes(parent),
                encoded_tokens, middle,
                AVRO_NULL if extra_keys is None else _BRANCH_1 + avro_bytes(_encode_msgpack(extra_keys[i])), tail,
                AVRO_NULL if lookahead is None else _BRANCH_1 + avro_int_array(lookahead[i]),
                AVRO_NULL if i or parent_known is None else (b"\x02\x01" if parent_known else b"\x02\x00"),
                suffix, AVRO_NULL if digest is None else _BRANCH_1 + avro_long(digest), report_mode))))
            parent = h
        return out


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
    """Rebuild the engine event as the engine sent it, in map form, from all of its block records.

    Fields the engine always sends (:data:`REQUIRED_FIELDS`; the engine is SGLang when the hashes are
    ``INT64``) are present even when None, the others only when set; token tuples (``token_id_width``) are
    regrouped. ``content_hash`` is the producer's, not the engine's: it is left out, except that content hashes
    the tokens do not give (an event's :data:`CONTENT_HASHES`, e.g. the simulator's stores without tokens) come
    back in that field.

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
        parsed = _ParsedEvent(BLOCK_STORED, [], common={"lora_name": body["lora_name"],
                                                        "cache_salt": body.get("cache_salt")},
                              parent=parent, extra_keys=event.get("extra_keys"))
        if any(h is not None and h != _content_hash(parsed, i, b["token_ids"]) for i, (h, b) in
               enumerate(zip(given, bodies))):
            event[CONTENT_HASHES] = given
    return event


def _regroup(tokens: list[int], width: int | None) -> list:
    """Flattened token tuples back into the engine's shape: ``width`` ints per position (None or 1: as they are)."""
    if not width or width == 1:
        return tokens
    return [tokens[i:i + width] for i in range(0, len(tokens), width)]
