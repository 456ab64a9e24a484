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
engine's, so :func:`rebuild_event` leaves it out. A vLLM store without ``extra_keys`` does not say its extra keys
(an offload tier's store may hold a salted or LoRA block): it gets the content hash the engine's earlier store of the
same block had (:class:`ParentTracker`), or none. A producer that knows its blocks' content without their tokens
(the simulator, whose trace has block ids, not tokens) gives the hashes in the event's :data:`CONTENT_HASHES`
field instead, which no engine sends.

This module splits (:func:`split_event`; :class:`BlockEncoder` splits and encodes in one step, with
:class:`ParentTracker` for ``parent_known`` and the content of stores that do not say it) and makes the records of
the bridge's own events (:func:`source_event`). The rest is in one module per concern, and every name other modules
use is importable from here:

* :mod:`producers.engine_events`: one engine event parsed and validated (:class:`Publisher`,
  :class:`InvalidEvent`, :data:`REQUIRED_FIELDS`, :data:`ENGINE_INT_ENCODING`, :data:`CONTENT_HASHES`,
  :func:`hash_encoding`);
* :mod:`producers.rebuild`: the engine's event rebuilt from its records (:func:`rebuild_event`).
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from producers.engine_events import (
    CONTENT_HASHES,
    ENGINE_INT_ENCODING,
    LONG_RANGE,
    REQUIRED_FIELDS,
    InvalidEvent,
    Publisher,
    block_content_hash,
    check_envelope,
    hash_encoding,
    parse_event,
)
from producers.rebuild import rebuild_event
from schemas import ALL_BLOCKS_CLEARED, BLOCK_REMOVED, BLOCK_STORED
from schemas.avro_writers import AVRO_NULL, KvEventWriter, avro_bytes, avro_double, avro_int_array, avro_long

__all__ = [
    "InvalidEvent", "Publisher", "ENGINE_INT_ENCODING", "REQUIRED_FIELDS", "CONTENT_HASHES", "hash_encoding",
    "split_event", "ParentTracker", "BlockEncoder", "source_event", "rebuild_event",
]

_BRANCH_1 = b"\x02"

_encode_msgpack = msgspec.msgpack.Encoder().encode

#: BlockStored's v3 fields ``cache_salt`` and ``token_id_width``, both null: what nearly every store ends with.
_NO_SUFFIX = AVRO_NULL + AVRO_NULL


def _block_tokens(tokens: list[int], block_size: int, i: int, count: int) -> list[int]:
    """Block ``i``'s tokens: ``block_size`` of them; the last block also takes any beyond the full blocks."""
    start = i * block_size
    return tokens[start:] if i == count - 1 else tokens[start:start + block_size]


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
    parsed = parse_event(event, publisher.engine)
    check_envelope(seq, batch_index, publisher)
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
            "content_hash": block_content_hash(parsed, i, tokens),
            "report_mode": publisher.report_mode,
        }
        records.append({**envelope, "block_hash": h, "hash_encoding": encoding, "block_index": i,
                        "block_count": count, "tier": tier, "event": (BLOCK_STORED, body)})
    return records


class ParentTracker:
    """Marks ``BlockStored.parent_known`` on the first block of each run: has this engine stored the parent? And gives
    a stored block whose event does not say its content the content hash of the engine's earlier store of that block.

    The producer sees each engine's events in order, which the stream app (partitioned by block hash)
    cannot. It remembers the last ``capacity`` blocks stored per engine, ``(instance_id,
    data_parallel_rank)``, least recently stored forgotten first, so "unknown" means "not stored by this
    engine within that window since the producer started". Per engine, not per worker rank: in SHARDED
    mode the ranks store different blocks of one engine's cache, so a parent stored by another rank is
    known (docs/residency.md, "Reference counting").

    With each block it remembers the content hash and parent of its latest store that had a content hash, of any
    tier or ownership. A store of a block that has tokens but no content hash (a vLLM store without ``extra_keys``,
    as vLLM 0.33's ``OffloadingEventsTracker`` sends the CPU tier's: :func:`producers.engine_events.block_content_hash`)
    gets that content hash when it names the same parent: an engine's block hash covers the parent, the tokens and
    the extra keys (salt, LoRA name), so the content is the block's; a store that names another parent does not say
    its place in the chain, and its content keys would move the block's. Otherwise the store gets none, and answers
    no query by tokens rather than one of another tenant's or adapter's namespace; the stream app keeps the content
    of the entry's earlier store (docs/residency.md, "Content keys").
    """

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        #: engine -> block hash -> (content hash, parent hash) of its latest store with a content hash, or None (stored,
        #: content unknown); least recently stored first.
        self._stored: dict[tuple, OrderedDict] = {}

    def note(self, record: dict) -> None:
        """Set ``parent_known`` on a BlockStored record (in place) and remember its block; a block with tokens but no
        ``content_hash`` gets the one remembered for its hash, if its parent is the remembered one (in place too)."""
        kind, body = record["event"]
        if kind != BLOCK_STORED:
            return
        source = (record["instance_id"], record["data_parallel_rank"])
        stored = self._stored.get(source)
        if stored is None:
            stored = self._stored[source] = OrderedDict()
        parent = body["parent_block_hash"]
        if record["block_index"] == 0 and parent is not None:
            body["parent_known"] = parent in stored
        block_hash, content = record["block_hash"], body.get("content_hash")
        if content is not None:
            stored[block_hash] = (content, parent)
            stored.move_to_end(block_hash)
        elif block_hash in stored:
            stored.move_to_end(block_hash)
            memory = stored[block_hash]
            if memory is not None and body["token_ids"] and memory[1] == parent:
                body["content_hash"] = memory[0]
        else:
            stored[block_hash] = None
        if len(stored) > self.capacity:
            stored.popitem(last=False)

    def note_run(self, source: tuple, parent: bytes | None, hashes: list[bytes], contents: list | None = None,
                 block_tokens: list | None = None) -> bool | None:
        """:meth:`note` for a whole BlockStored run at once: returns the first block's ``parent_known``.

        Args:
            source: the engine, ``(instance_id, data_parallel_rank)``.
            parent: the run's parent hash (None: ``parent_known`` stays None).
            hashes: the run's block hashes, in order.
            contents: each block's content hash as the event gives it (None: none), or None when no block has one;
                a None entry of a block with tokens gets the remembered one, in place, as :meth:`note` gives it.
            block_tokens: each block's tokens (only whether they are empty is read); None: no block has tokens.
        """
        stored = self._stored.get(source)
        if stored is None:
            stored = self._stored[source] = OrderedDict()
        known = None if parent is None else parent in stored
        capacity = self.capacity
        fill = contents is not None and block_tokens is not None
        for i, h in enumerate(hashes):
            content = None if contents is None else contents[i]
            if content is not None:
                if h in stored:
                    stored[h] = (content, parent)
                    stored.move_to_end(h)
                else:  # a new key goes last by itself
                    stored[h] = (content, parent)
            elif h in stored:
                stored.move_to_end(h)
                if fill and block_tokens[i]:
                    memory = stored[h]
                    if memory is not None and memory[1] == parent:
                        contents[i] = memory[0]
            else:
                stored[h] = None
            if len(stored) > capacity:  # a block at a time, as note() forgets: the same memory after every block
                stored.popitem(last=False)
            parent = h
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
        parsed = parse_event(event, publisher.engine)
        if not (type(seq) is int and type(batch_index) is int and LONG_RANGE[0] <= seq <= LONG_RANGE[1]
                and LONG_RANGE[0] <= batch_index <= LONG_RANGE[1]):  # the common case inline: runs per engine event
            check_envelope(seq, batch_index, publisher)
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
        if tokens:
            blocks = [_block_tokens(tokens, block_ints, i, count) for i in range(count)]
            digests = [block_content_hash(parsed, i, block) for i, block in enumerate(blocks)]
        else:  # placeholder stores (offload connectors): no tokens, no content unless the event gives it
            blocks, digests = None, parsed.content_hashes
        parent_known = None
        if self.parents is not None:
            # fills, in digests, the content of blocks with tokens whose event does not say it (ParentTracker)
            parent_known = self.parents.note_run((publisher.instance_id, publisher.data_parallel_rank),
                                                 parsed.parent, hashes, digests, blocks)
        report_mode = AVRO_NULL if publisher.report_mode is None else w.report_mode(publisher.report_mode)
        out = []
        parent = parsed.parent
        for i, h in enumerate(hashes):
            encoded_hash = avro_bytes(h)
            encoded_tokens = b"\x00" if blocks is None else avro_int_array(blocks[i])
            digest = None if digests is None else digests[i]
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
