"""A block event as the residency rules read it: one tuple of the fields they use, and its compact form.

The residency rules (``stream_apps/residency.py``) read 15 of a ``kv_event`` record's 31 fields. Decoding the
whole record into two dicts in the materializing stage cost more than the rules themselves, so the
repartition stage, which runs in a process of its own, decodes each block event instead and writes those
fields in the fixed layout :data:`BLOCK_FIELDS` (``ownership_batch`` version 2, ``KeyedEvent.block``). The
materializing stage reads them back with one ``struct`` call into a :class:`BlockEvent` tuple
(:class:`schemas.ownership_batch.OwnershipBatchReader`), and never builds the record's dicts.

The strings of a batch message (media, localities, ownerships) and its sources (publisher identities) are
few, so each is written once per message, in the message's ``strings`` and ``sources`` tables, and a block
field names it by index.

Anything that does not fit the layout (a string table past 65,535 entries, a ``group_idx`` outside
0..2³²-2) is written without block fields, and the materializing stage decodes the record as before.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from schemas import BLOCK_REMOVED, BLOCK_STORED
from schemas.avro_writers import avro_long, avro_optional, avro_string
from schemas.tiers import TIERS

#: The layout of ``KeyedEvent.block`` before the block hash (little-endian): kind, source index,
#: publisher_epoch, seq, batch_index, block_index, ts, tier index, medium, locality, group_idx + 1 (0: null),
#: ownership, parent_known (0 null, 1 false, 2 true), has_content, content. String fields are indexes into
#: the message's ``strings`` table plus one (0: null). The canonical block hash fills the rest of the bytes.
BLOCK_FIELDS = struct.Struct("<BHqqiidBHHIHBBq")

#: Event kinds in the layout's order (the kind byte is an index into it).
KINDS = (BLOCK_STORED, BLOCK_REMOVED)
#: ``parent_known`` in the layout's order.
PARENT_KNOWN = (None, False, True)

_KIND_INDEX = {kind: i for i, kind in enumerate(KINDS)}
_TIER_INDEX = {tier: i for i, tier in enumerate(TIERS)}
_PARENT_KNOWN_INDEX = {None: 0, False: 1, True: 2}
#: Largest index a u16 table reference can hold (0 is null).
_MAX_TABLE = 0xFFFF - 1


class Source(NamedTuple):
    """A publisher's identity and aggregation, as its ``kv_event`` records carry them (same field names)."""

    #: Serving instance that published the event (``kv_event.instance_id``).
    instance_id: str
    #: Data-parallel rank of the publishing engine core (vLLM ``KVEventBatch.data_parallel_rank``).
    data_parallel_rank: int
    #: Rank of the worker within its engine when workers publish separately; None: the scheduler publishes
    #: for the whole engine.
    worker_rank: int | None
    #: Workers that report this source's events; None means 1.
    world_size: int | None
    #: ``REPLICATED`` or ``SHARDED`` (vLLM ``KVEventAggregator`` semantics); None means REPLICATED.
    aggregation: str | None


class BlockEvent(NamedTuple):
    """One BlockStored or BlockRemoved, as the residency rules read it (``stream_apps.residency.apply_block``).

    The materializing stage builds these as plain tuples in this field order (a NamedTuple's constructor
    costs more than the rules' use of it); this class names the fields, and tests build them with it.
    """

    #: ``schemas.BLOCK_STORED`` or ``schemas.BLOCK_REMOVED``.
    kind: str
    #: The publisher (shared by the events of one batch message).
    source: Source
    #: Order of the event within its publisher: (publisher_epoch, seq, batch_index, block_index), as in
    #: ``kv_event``.
    publisher_epoch: int
    seq: int
    batch_index: int
    block_index: int
    #: Engine wall-clock time of the batch, seconds since the Unix epoch (``kv_event.ts``).
    ts: float
    #: Canonical block hash (``kv_event.block_hash``).
    block_hash: bytes
    #: Canonical tier (``kv_event.tier``): one of ``schemas.TIERS``.
    tier: str
    #: The engine's medium string; None only from the GPU block pool.
    medium: str | None
    #: ``BlockStored.locality`` / ``BlockRemoved.locality``; None when the engine sent none.
    locality: str | None
    #: KV cache group index; None when the engine sent none.
    group_idx: int | None
    #: Ownership (vLLM PR #52067): None for the framework's own tiers, else the secondary tier's name.
    ownership: str | None
    #: ``BlockStored.parent_known``: False when the producer had not seen the parent stored; None for
    #: removals and for records without it.
    parent_known: bool | None
    #: Digest of the stored content (``stream_apps.residency.content_digest``) for a store of a REPLICATED
    #: source with world size > 1, whose workers must agree; None otherwise.
    content: int | None


def block_event_of(record: dict, content: int | None = None) -> BlockEvent:
    """The :class:`BlockEvent` of a decoded BlockStored or BlockRemoved ``kv_event`` record.

    ``content``: the store's content digest when the rules need one (see :attr:`BlockEvent.content`).
    """
    kind, body = record["event"]
    source = Source(record["instance_id"], record["data_parallel_rank"], record["worker_rank"],
                    record["world_size"], record["aggregation"])
    return BlockEvent(kind, source, record["publisher_epoch"], record["seq"], record["batch_index"],
                      record["block_index"], record["ts"], record["block_hash"], record["tier"], body["medium"],
                      body["locality"], body["group_idx"], body["ownership"], body.get("parent_known"), content)


class BlockFieldsWriter:
    """The block fields of one ``ownership_batch`` message's items, and the message's tables they index."""

    def __init__(self) -> None:
        self._sources: dict[tuple, int] = {}
        self._strings: dict[str, int] = {}
        #: Bytes of :meth:`tables` so far, or a few more (a message's size counts them).
        self.table_bytes = 2

    def _string(self, value: str | None) -> int:
        if value is None:
            return 0
        index = self._strings.get(value)
        if index is None:
            if len(self._strings) >= _MAX_TABLE:
                raise OverflowError("string table full")
            index = self._strings[value] = len(self._strings) + 1
            self.table_bytes += len(avro_string(value))
        return index

    def block(self, record: dict, content: int | None = None) -> bytes | None:
        """``KeyedEvent.block`` of a decoded BlockStored/BlockRemoved record with its block hash and tier
        set; None when a field does not fit the layout (the record is then decoded by the reader)."""
        kind, body = record["event"]
        source = (record["instance_id"], record["data_parallel_rank"], record["worker_rank"], record["world_size"],
                  record["aggregation"])
        group = body["group_idx"]
        if group is not None and group < 0:  # 0 in the layout is null
            return None
        try:
            index = self._sources.get(source)
            if index is None:
                if len(self._sources) > _MAX_TABLE:
                    return None
                index = self._sources[source] = len(self._sources)
                self.table_bytes += len(avro_string(source[0])) + len(source[4] or "") + 40  # ints and unions: at most 40
            fields = BLOCK_FIELDS.pack(
                _KIND_INDEX[kind], index, record["publisher_epoch"], record["seq"], record["batch_index"],
                record["block_index"], record["ts"], _TIER_INDEX[record["tier"]], self._string(body["medium"]),
                self._string(body["locality"]), 0 if group is None else group + 1, self._string(body["ownership"]),
                _PARENT_KNOWN_INDEX[body.get("parent_known")], content is not None, content or 0)
        except (OverflowError, struct.error):
            return None
        return fields + record["block_hash"]

    def tables(self) -> bytes:
        """The message's ``sources`` and ``strings`` fields in Avro binary (they precede ``events``)."""
        parts = []
        if self._sources:
            parts.append(avro_long(len(self._sources)))
            for instance, dp_rank, worker_rank, world_size, aggregation in self._sources:
                parts += (avro_string(instance), avro_long(dp_rank), avro_optional(worker_rank, avro_long),
                          avro_optional(world_size, avro_long), avro_optional(aggregation, avro_string))
        parts.append(b"\x00")
        if self._strings:
            parts.append(avro_long(len(self._strings)))
            parts += (avro_string(s) for s in self._strings)
        parts.append(b"\x00")
        return b"".join(parts)
