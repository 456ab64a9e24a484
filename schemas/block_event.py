"""A block event as the residency rules read it: one tuple of the fields they use, and its compact form.

The residency rules (``stream_apps/residency/rules.py``) read 17 of a ``kv_event`` record's 32 fields. Decoding the
whole record into two dicts in the materializing stage cost more than the rules themselves, so the
repartition stage, which runs in a process of its own, decodes each block event instead and writes those
fields in the fixed layout :data:`BLOCK_FIELDS` (``ownership_batch`` version 2, ``KeyedEvent.block``). The
materializing stage reads them back with one ``struct`` call into a :class:`BlockEvent` tuple
(:class:`schemas.ownership_batch.OwnershipBatchReader`), and never builds the record's dicts.

The strings of a batch message (media, localities, ownerships) and its sources (publisher identities) are
few, so each is written once per message, in the message's ``strings`` and ``sources`` tables, and a block
field names it by index.

Anything that does not fit the layout (a string table past 65,535 entries, a ``group_idx`` outside
0..2³²-2, a parent hash over 254 bytes) is written without block fields, and the materializing stage decodes the
record as before.

The layout changed once: the first one (56 bytes before the block hash, kinds 0 and 1) had no parent hash and
content hash. Its kind bytes name no kind in this one (:data:`KINDS`), so during a rolling upgrade each version's
agent decodes the other version's items from their records rather than misreading their block fields.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from schemas import BLOCK_REMOVED, BLOCK_STORED, BLOCK_STORED_OR_REUSED, FULL_REPORT_MODE
from schemas.avro_writers import avro_long, avro_optional, avro_string, encode_keyed_event
from schemas.compiled import choose
from schemas.content_hash import record_engine, stored_content_hash
from schemas.fast_reader import project
from schemas.tiers import TIERS

#: The layout of ``KeyedEvent.block`` before the parent and block hashes, field by field: (name, ``struct`` code),
#: little-endian and packed, 66 bytes. The one definition of the layout: :data:`BLOCK_FIELDS` and the compiled walk
#: (``schemas/_hotpath.pyx``, which takes each field's offset from it by name and refuses a layout whose field
#: types differ from those it reads) both come from it.
#:
#: ``kind`` indexes :data:`KINDS`; ``source`` the message's ``sources`` table; ``tier`` ``schemas.TIERS``; the
#: string fields (``medium``, ``locality``, ``ownership``) the message's ``strings`` table plus one (0: null);
#: ``group`` is group_idx + 1 (0: null); ``parent_known`` 0 null, 1 false, 2 true; ``content`` the replica content
#: digest when ``has_content``; ``parent_size`` the parent block hash's length + 1 (0: null);
#: ``content_hash`` the store's content hash when ``has_content_hash``. The parent block hash's bytes follow, then
#: the canonical block hash fills the rest.
BLOCK_LAYOUT = (("kind", "B"), ("source", "H"), ("publisher_epoch", "q"), ("seq", "q"), ("batch_index", "i"),
                ("block_index", "i"), ("ts", "d"), ("tier", "B"), ("medium", "H"), ("locality", "H"),
                ("group", "I"), ("ownership", "H"), ("parent_known", "B"), ("has_content", "B"), ("content", "q"),
                ("parent_size", "B"), ("has_content_hash", "B"), ("content_hash", "q"))
#: :data:`BLOCK_LAYOUT` as a ``struct``: the Python walk's and the writer's.
BLOCK_FIELDS = struct.Struct("<" + "".join(code for _, code in BLOCK_LAYOUT))

#: Event kinds by the layout's kind byte (an index into this): 2 BlockStored, 3 BlockRemoved, 4 a BlockStored of a
#: source in full report mode (``BLOCK_STORED_OR_REUSED``). 0 and 1, the kinds of the first layout, name none: a
#: walker refuses such block fields, and their message is decoded from its records (a rolling upgrade), as an
#: older walker refuses kinds 2 and 3, and one of this layout before kind 4 refuses kind 4 (so it decodes the
#: record, and counts the store as its version did).
KINDS = (None, None, BLOCK_STORED, BLOCK_REMOVED, BLOCK_STORED_OR_REUSED)
#: ``parent_known`` in the layout's order.
PARENT_KNOWN = (None, False, True)

_KIND_INDEX = {kind: i for i, kind in enumerate(KINDS) if kind is not None}
_TIER_INDEX = {tier: i for i, tier in enumerate(TIERS)}
_PARENT_KNOWN_INDEX = {None: 0, False: 1, True: 2}
#: Largest index a u16 table reference can hold (0 is null).
_MAX_TABLE = 0xFFFF - 1


#: The ``kv_event`` fields a block event's key and block fields are made of, at any depth (``event`` is the
#: event's kind: the name of its union branch), in the order of :func:`block_route`'s list. The repartition
#: stage reads them from the record's bytes into that list with the compiled projection
#: (:meth:`schemas.codec.AvroCodec.own_version_projection`), or takes them from a decoded record.
ROUTE_FIELDS = ("event", "instance_id", "data_parallel_rank", "worker_rank", "world_size", "aggregation",
                "publisher_epoch", "seq", "batch_index", "block_index", "ts", "block_hash", "tier", "medium",
                "locality", "group_idx", "ownership", "parent_known", "parent_block_hash", "content_hash",
                "report_mode")
#: :data:`ROUTE_FIELDS` by name -> position in the list.
ROUTE_SLOTS = {name: i for i, name in enumerate(ROUTE_FIELDS)}
(R_KIND, R_INSTANCE, R_DP_RANK, R_WORKER_RANK, R_WORLD_SIZE, R_AGGREGATION, R_EPOCH, R_SEQ, R_BATCH_INDEX,
 R_BLOCK_INDEX, R_TS, R_BLOCK_HASH, R_TIER, R_MEDIUM, R_LOCALITY, R_GROUP_IDX, R_OWNERSHIP, R_PARENT_KNOWN, R_PARENT,
 R_CONTENT_HASH, R_REPORT_MODE) = range(len(ROUTE_FIELDS))


def block_route(record: dict) -> list:
    """The :data:`ROUTE_FIELDS` of a decoded BlockStored or BlockRemoved ``kv_event`` record, a store's content
    hash resolved by :func:`store_content_hash` (so one an older producer wrote without it gets one): what
    :meth:`BlockFieldsWriter.block_of` writes. The projection read from the bytes gives the same list for a
    record that carries its content hash (or is a removal)."""
    route = project(record, ROUTE_SLOTS, [None] * len(ROUTE_FIELDS))
    kind, body = record["event"]
    if kind == BLOCK_STORED and route[R_CONTENT_HASH] is None:
        route[R_CONTENT_HASH] = store_content_hash(body, record.get("hash_encoding"))
    return route


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

    #: ``schemas.BLOCK_STORED``, ``schemas.BLOCK_REMOVED``, or ``schemas.BLOCK_STORED_OR_REUSED``: a store of a
    #: source in vLLM's full report mode (``BlockStored.report_mode`` ``"full"``, kv_event v5), which may be an
    #: announcement of a block the source already holds.
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
    #: ``BlockStored.parent_block_hash``: the canonical hash of the block before this one in its chain; None for
    #: a chain's first block (and in offload placeholder stores) and for removals.
    parent_block_hash: bytes | None
    #: The store's content hash (``BlockStored.content_hash``, :func:`store_content_hash`): a signed 64-bit int;
    #: None for a store without tokens and for removals.
    content_hash: int | None


def store_content_hash(body: dict, hash_encoding: str | None) -> int | None:
    """The content hash of a decoded BlockStored body: its own ``content_hash`` (``kv_event`` v4), or, for a record
    an older producer wrote, the one its token ids give by the producers' rule
    (:func:`schemas.content_hash.stored_content_hash`, for the engine :func:`schemas.content_hash.record_engine` reads
    in the record's ``hash_encoding``); None for a store without tokens, and for one that does not say its extra keys
    (a vLLM store without ``extra_keys``)."""
    found = body.get("content_hash")
    if found is None and body.get("token_ids"):
        return stored_content_hash(body, record_engine(hash_encoding))
    return found


def block_event_of(record: dict, content: int | None = None) -> BlockEvent:
    """The :class:`BlockEvent` of a decoded BlockStored or BlockRemoved ``kv_event`` record.

    ``content``: the store's content digest when the rules need one (see :attr:`BlockEvent.content`). A store's
    content hash is :func:`store_content_hash`'s, so a record of an older producer gets one as well.
    """
    kind, body = record["event"]
    source = Source(record["instance_id"], record["data_parallel_rank"], record["worker_rank"],
                    record["world_size"], record["aggregation"])
    stored = kind == BLOCK_STORED
    if stored and body.get("report_mode") == FULL_REPORT_MODE:
        kind = BLOCK_STORED_OR_REUSED
    return BlockEvent(kind, source, record["publisher_epoch"], record["seq"], record["batch_index"],
                      record["block_index"], record["ts"], record["block_hash"], record["tier"], body["medium"],
                      body["locality"], body["group_idx"], body["ownership"], body.get("parent_known"), content,
                      body.get("parent_block_hash") if stored else None,
                      store_content_hash(body, record.get("hash_encoding")) if stored else None)


_ENCODERS: dict = {}


def item_encoder(compiled):
    """The compiled module's ``BlockItemEncoder`` for this module's layout (one per module), or None."""
    if compiled is None:
        return None
    encoder = _ENCODERS.get(compiled)
    if encoder is None:
        encoder = _ENCODERS[compiled] = compiled.BlockItemEncoder(
            BLOCK_LAYOUT, ROUTE_FIELDS, _KIND_INDEX, _TIER_INDEX, BLOCK_STORED, BLOCK_STORED_OR_REUSED,
            FULL_REPORT_MODE, _MAX_TABLE)
    return encoder


class BlockFieldsWriter:
    """The block fields of one ``ownership_batch`` message's items, and the message's tables they index.

    Args:
        compiled: encode items with the compiled twin of :meth:`keyed_item` (``schemas._hotpath.BlockItemEncoder``):
            None (the default) when it is built (:func:`schemas.compiled.choose`), True or False to choose.
    """

    def __init__(self, compiled: bool | None = None) -> None:
        self._sources: dict[tuple, int] = {}
        self._strings: dict[str, int] = {}
        #: Bytes of :meth:`tables` so far, or a few more (a message's size counts them).
        self.table_bytes = 2
        self._encoder = item_encoder(choose(compiled))

    def keyed_item(self, key: bytes, mark: bytes, value: bytes, route: list, content: int | None = None) -> bytes:
        """One ``KeyedEvent`` of schemas/ownership_batch_v2.avsc in Avro binary, with block fields: key ``key``
        (UTF-8), clear mark ``mark`` (:func:`schemas.avro_writers.encode_clear_mark`), the record's bytes
        ``value``, and :meth:`block_of` ``route`` (a block event's :data:`ROUTE_FIELDS`) and ``content``.

        The compiled encoder writes the same bytes and tables without the ``struct`` and the joins, and leaves to
        this method what it does not hold (it then adds nothing to the tables)."""
        encoder = self._encoder
        if encoder is not None:
            done = encoder.item(self._sources, self._strings, key, mark, value, route, content)
            if done is not None:
                item, added = done
                self.table_bytes += added
                return item
        return encode_keyed_event(key, mark, value, self.block_of(route, content))

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
        """``KeyedEvent.block`` of a decoded BlockStored/BlockRemoved record with its block hash and tier set:
        :meth:`block_of` its :func:`block_route`."""
        return self.block_of(block_route(record), content)

    def block_of(self, route: list, content: int | None = None) -> bytes | None:
        """``KeyedEvent.block`` of a block event's :data:`ROUTE_FIELDS` (block hash and tier set); None when a
        field does not fit the layout (the record is then decoded by the reader).

        A store's parent hash and content hash go in too (:func:`block_route` gives one for every store with
        tokens, so the agent finds one for every such store)."""
        kind = route[R_KIND]
        if kind == BLOCK_STORED:
            if route[R_REPORT_MODE] == FULL_REPORT_MODE:
                kind = BLOCK_STORED_OR_REUSED
            parent, content_hash = route[R_PARENT], route[R_CONTENT_HASH]
        else:
            parent = content_hash = None
        source = (route[R_INSTANCE], route[R_DP_RANK], route[R_WORKER_RANK], route[R_WORLD_SIZE], route[R_AGGREGATION])
        group = route[R_GROUP_IDX]
        if group is not None and group < 0:  # 0 in the layout is null
            return None
        try:
            index = self._sources.get(source)
            if index is None:
                if len(self._sources) > _MAX_TABLE:
                    return None
                index = self._sources[source] = len(self._sources)
                # ints and unions: at most 40
                self.table_bytes += len(avro_string(source[0])) + len(source[4] or "") + 40
            fields = BLOCK_FIELDS.pack(
                _KIND_INDEX[kind], index, route[R_EPOCH], route[R_SEQ], route[R_BATCH_INDEX], route[R_BLOCK_INDEX],
                route[R_TS], _TIER_INDEX[route[R_TIER]], self._string(route[R_MEDIUM]), self._string(route[R_LOCALITY]),
                0 if group is None else group + 1, self._string(route[R_OWNERSHIP]),
                _PARENT_KNOWN_INDEX[route[R_PARENT_KNOWN]], content is not None, content or 0,
                0 if parent is None else len(parent) + 1, content_hash is not None, content_hash or 0)
        except (OverflowError, struct.error):
            return None
        if parent is None:
            return fields + route[R_BLOCK_HASH]
        return b"".join((fields, parent, route[R_BLOCK_HASH]))

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
