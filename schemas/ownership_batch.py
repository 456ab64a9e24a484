"""One pass over an ``ownership_batch`` message: its items, each with its event already decoded.

Decoding a batch message with its codec gives a list of ``KeyedEvent`` dicts, each with a clear-mark dict,
and each event then goes through the event codec's framing checks.
:class:`OwnershipBatchReader` walks the message once instead. For each item it gives the key, the clear mark
as a :class:`~schemas.clear_position.ClearPosition`, where the event's bytes lie in the message (a dead
letter slices them out), and the event decoded by the event codec's generated reader without its framing
checks per record (:meth:`schemas.codec.AvroCodec.own_version_reader`).

Anything else is left to the codecs, so the result never differs from decoding item by item: a batch
message written with another ``ownership_batch`` version is decoded by its codec; an event written with
another ``kv_event`` version, or whose bytes the generated reader refuses, comes with record None, and the
caller decodes it with the event codec, which resolves the version or raises the ``DecodeError`` that says
why.
"""

from __future__ import annotations

from schemas.clear_position import NO_CLEAR, ClearPosition
from schemas.codec import _HEADER_LEN, SINGLE_OBJECT_MAGIC, AvroCodec
from schemas.fast_reader import _long_tail

#: One item of a batch message: ``(key, clear mark, buffer, start, end, record or None)``. The event's
#: framed bytes are ``buffer[start:end]``; ``record`` is None when the caller must decode those bytes with
#: the event codec.
BatchItem = tuple[str, ClearPosition, bytes, int, int, "dict | None"]

_tuple_new = tuple.__new__


def _long(data: bytes, pos: int) -> tuple[int, int]:
    """The zig-zag varint at ``pos`` and the position after it."""
    b = data[pos]
    if b & 0x80:
        return _long_tail(data, pos + 1, b)
    return (b >> 1) ^ -(b & 1), pos + 1


class OwnershipBatchReader:
    """Reads ``ownership_batch`` messages (schemas/ownership_batch_v1.avsc) into :data:`BatchItem` lists.

    Args:
        event_codec: the ``kv_event`` codec of the caller (its framing, registry and writer schemas); records
            of its own version are decoded as the items are read.
    """

    def __init__(self, event_codec: AvroCodec) -> None:
        self._batch_codec = AvroCodec("ownership_batch")
        own = self._batch_codec.schema.parsed
        self._headers = frozenset(SINGLE_OBJECT_MAGIC + fp for fp, parsed in self._batch_codec._by_fingerprint.items()
                                  if parsed is own)
        self._read_event = event_codec.own_version_reader()

    def read(self, data: bytes) -> list[BatchItem]:
        """The items of one batch message, in order.

        Raises:
            DecodeError: the message is not an ``ownership_batch`` record (the codec's reason).
        """
        if data is None or data[:_HEADER_LEN] not in self._headers:
            return self._read_decoded(data)
        try:
            return self._walk(data)
        except (IndexError, UnicodeDecodeError, ValueError):
            return self._read_decoded(data)  # raises the codec's DecodeError, which names the fault

    def _read_decoded(self, data: bytes) -> list[BatchItem]:
        """Through the batch codec: another version of the batch schema, or a message the walk refused."""
        batch = self._batch_codec.decode(data)
        return [(item["key"], ClearPosition.of(item["clear_mark"]), item["event"], 0, len(item["event"]), None)
                for item in batch["events"]]

    def _walk(self, data: bytes) -> list[BatchItem]:
        # The newest batch schema read in line: an array of (key: string, clear_mark: [null, ClearMark],
        # event: bytes). Anything unusual (a long-form union index, a bad length) raises IndexError or
        # ValueError, and read() hands the message to the codec, which reads what is valid and names what is not.
        read_event, items, size, pos = self._read_event, [], len(data), _HEADER_LEN
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
                b = data[end]; pos = end + 1
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
                end = pos + n
                if n < 0 or end > size:
                    raise ValueError("bad event length")
                items.append((key, mark, data, pos, end, read_event(data, pos, end)))
                pos = end
        if pos != size:
            raise ValueError("trailing bytes")
        return items
