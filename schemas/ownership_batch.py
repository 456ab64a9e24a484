"""One pass over an ``ownership_batch`` message: its items, each with its event ready for the rules.

Decoding a batch message with its codec gives a list of ``KeyedEvent`` dicts, each with a clear-mark dict,
and each event then goes through the event codec's framing checks and into two dicts.
:class:`OwnershipBatchReader` walks the message once instead. For each item it gives the key, the clear mark
as a :class:`~schemas.clear_position.ClearPosition`, where the event's bytes lie in the message (a dead
letter slices them out), and the event: a :class:`~schemas.block_event.BlockEvent` tuple read from the block
fields the repartition stage wrote (one ``struct`` call, no record decoded), or, for an item without them
(source-wide events, records the repartition stage left undecoded), the record decoded by the event codec's
generated reader without its framing checks per record (:meth:`schemas.codec.AvroCodec.own_version_reader`).

Anything else is left to the codecs, so the result never differs from decoding item by item: a batch
message written with another ``ownership_batch`` version, or whose walk fails, is decoded by its codec
(its items then come as records, their block fields unread); an event written with another ``kv_event``
version, or whose bytes the generated reader refuses, comes with None, and the caller decodes it with the
event codec, which resolves the version or raises the ``DecodeError`` that says why.
"""

from __future__ import annotations

import logging
import struct

from schemas.block_event import BLOCK_FIELDS, BLOCK_LAYOUT, KINDS, PARENT_KNOWN, BlockEvent, Source
from schemas.clear_position import NO_CLEAR, ClearPosition
from schemas.codec import SINGLE_OBJECT_HEADER_LEN, AvroCodec
from schemas.compiled import choose
from schemas.fast_reader import compile_reader, long_tail
from schemas.tiers import TIERS

#: One item of a batch message: ``(key, clear mark, buffer, start, end, event)``. The event's framed bytes are
#: ``buffer[start:end]``; ``event`` is a :class:`BlockEvent` tuple (from the item's block fields), a decoded
#: ``kv_event`` record dict, or None when the caller must decode those bytes with the event codec.
BatchItem = tuple[str, ClearPosition, bytes, int, int, BlockEvent | dict | None]

_tuple_new = tuple.__new__
log = logging.getLogger(__name__)


def _long(data: bytes, pos: int) -> tuple[int, int]:
    """The zig-zag varint at ``pos`` and the position after it."""
    b = data[pos]
    if b & 0x80:
        c = data[pos + 1]
        if c & 0x80:
            return long_tail(data, pos + 1, b)
        b = (b & 0x7F) | (c << 7)  # two bytes, in line: an event's length and its block fields' (64 to 8191)
        return (b >> 1) ^ -(b & 1), pos + 2
    return (b >> 1) ^ -(b & 1), pos + 1


class OwnershipBatchReader:
    """Reads ``ownership_batch`` messages (schemas/ownership_batch_v2.avsc, and v1) into :data:`BatchItem` lists.

    Args:
        event_codec: the ``kv_event`` codec of the caller (its framing, registry and writer schemas); records
            of its own version are decoded as the items are read.
        compiled: walk the items with the compiled hot path (:func:`schemas._hotpath.walk_items`): None when it
            is built (:mod:`schemas.compiled`) and reads :data:`~schemas.block_event.BLOCK_LAYOUT` (else an error is
            logged and Python walks), True always (ImportError if not built, ValueError if it cannot read the
            layout), False never. Both give the same items.
    """

    def __init__(self, event_codec: AvroCodec, compiled: bool | None = None) -> None:
        hotpath = choose(compiled)
        if hotpath is not None and compiled is None:
            try:  # a compiled walk built for another layout than the source's: the Python walk reads it
                hotpath.check_block_layout(BLOCK_LAYOUT)
            except ValueError as exc:
                log.error("the compiled batch walk does not read this block layout (%s); walking in Python", exc)
                hotpath = None
        elif hotpath is not None:
            hotpath.check_block_layout(BLOCK_LAYOUT)  # compiled=True: say why it cannot be used
        self._walk_items = None if hotpath is None else hotpath.walk_items
        self._batch_codec = AvroCodec("ownership_batch")
        own = self._batch_codec.schema.parsed
        self._headers = self._batch_codec.own_version_headers()
        self._read_event = event_codec.own_version_reader()
        # the message's tables are read by generated readers (once per message; the items, per event, in line)
        fields = {field["name"]: field["type"] for field in own["fields"]}
        self._read_sources = compile_reader(fields["sources"])
        self._read_strings = compile_reader(fields["strings"])

    def read(self, data: bytes) -> list[BatchItem]:
        """The items of one batch message, in order.

        Raises:
            DecodeError: the message is not an ``ownership_batch`` record (the codec's reason).
        """
        if data is None or data[:SINGLE_OBJECT_HEADER_LEN] not in self._headers:
            return self._read_decoded(data)
        try:
            return self._walk(data)
        except (IndexError, UnicodeDecodeError, ValueError, struct.error):
            return self._read_decoded(data)  # raises the codec's DecodeError, which names the fault

    def _read_decoded(self, data: bytes) -> list[BatchItem]:
        """Through the batch codec: another version of the batch schema, or a message the walk refused."""
        batch = self._batch_codec.decode(data)
        return [(item["key"], ClearPosition.of(item["clear_mark"]), item["event"], 0, len(item["event"]), None)
                for item in batch["events"]]  # block fields unread: the caller decodes every event

    def _walk(self, data: bytes) -> list[BatchItem]:
        """The Python walk of a message of the newest batch schema; one function (over the house's 80 lines) for
        the same reason as the compiled one it is the twin of: it runs per item, where a call costs as much as
        the item's fields."""
        # The newest batch schema read in line: the sources and strings tables, then an array of (key: string,
        # clear_mark: [null, ClearMark], event: bytes, block: [null, bytes]). Anything unusual (a long-form union
        # index, a bad length, a block field's index out of its table) raises IndexError, ValueError (ReadError
        # included) or struct.error, and read() hands the message to the codec, which reads what is valid and names
        # what is not.
        read_event, items, size = self._read_event, [], len(data)
        sources, pos = self._read_sources(data, SINGLE_OBJECT_HEADER_LEN)
        sources = [_tuple_new(Source, (s["instance_id"], s["data_parallel_rank"], s["worker_rank"], s["world_size"],
                                       s["aggregation"])) for s in sources]
        strings, pos = self._read_strings(data, pos)
        strings = (None, *strings)  # a block field's string index 0 is null
        if self._walk_items is not None and type(data) is bytes:  # the compiled walk takes bytes, not a subclass
            pos = self._walk_items(data, pos, items, sources, strings, KINDS, TIERS, PARENT_KNOWN, read_event,
                                   ClearPosition, NO_CLEAR, BLOCK_LAYOUT)
            if pos != size:
                raise ValueError("trailing bytes")
            return items
        unpack, fields_size, kinds, tiers, known = (BLOCK_FIELDS.unpack_from, BLOCK_FIELDS.size, KINDS, TIERS,
                                                    PARENT_KNOWN)
        while True:
            count, pos = _long(data, pos)
            if count == 0:
                break
            if count < 0:  # a block that gives its byte size, which a one-pass reader does not need
                count = -count
                _, pos = _long(data, pos)
            for _ in range(count):
                n, pos = _long(data, pos)
                end = pos + n
                if n < 0 or end > size:
                    raise ValueError("bad key length")
                key = data[pos:end].decode()
                b = data[end]
                pos = end + 1
                if b == 0:
                    mark = NO_CLEAR
                elif b == 2:
                    epoch, pos = _long(data, pos)
                    seq, pos = _long(data, pos)
                    index, pos = _long(data, pos)
                    mark = _tuple_new(ClearPosition, (epoch, seq, index))
                else:
                    raise ValueError("clear_mark union index")
                n, pos = _long(data, pos)
                start = pos
                pos = end = start + n
                if n < 0 or end > size:
                    raise ValueError("bad event length")
                b = data[pos]
                pos += 1
                if b == 0:
                    items.append((key, mark, data, start, end, read_event(data, start, end)))
                    continue
                if b != 2:
                    raise ValueError("block union index")
                n, pos = _long(data, pos)
                fields = pos + fields_size
                if n < fields_size or pos + n > size:
                    raise ValueError("bad block length")
                (kind, source, epoch, seq, batch_index, block_index, ts, tier, medium, locality, group, ownership,
                 parent_known, has_content, content, parent_size, has_content_hash, content_hash) = unpack(data, pos)
                pos += n
                kind = kinds[kind]
                if kind is None:
                    raise ValueError("block fields of the first layout")  # an older repartition process's
                if parent_size:
                    parent_end = fields + parent_size - 1
                    if parent_end > pos:
                        raise ValueError("parent block hash past the block fields")
                    parent = data[fields:parent_end]
                else:
                    parent, parent_end = None, fields
                items.append((key, mark, data, start, end, (
                    kind, sources[source], epoch, seq, batch_index, block_index, ts, data[parent_end:pos],
                    tiers[tier], strings[medium], strings[locality], group - 1 if group else None, strings[ownership],
                    known[parent_known], content if has_content else None, parent,
                    content_hash if has_content_hash else None)))
        if pos != size:
            raise ValueError("trailing bytes")
        return items

