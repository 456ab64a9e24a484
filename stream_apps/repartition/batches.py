"""The repartition stage's outgoing ``ownership_batch`` messages of one destination partition, each at most
:data:`MAX_BATCH_BYTES` with the block-field tables its items index."""

from __future__ import annotations

from schemas.avro_writers import encode_keyed_event
from schemas.block_event import BlockFieldsWriter

#: Upper bound of one ownership_batch message's payload; the re-keyed topic allows 8 MiB messages.
MAX_BATCH_BYTES = 1 << 20

#: Bytes an item adds besides its key, mark and event, and its table entries besides their text, at most:
#: length varints, the block fields (66 bytes before the parent and block hashes, which the event holds too), a
#: source's ints and unions, the message's framing.
_ITEM_OVERHEAD = 256


class PartitionBatch:
    """The ``ownership_batch`` messages of one destination partition in one batch: each at most
    :data:`MAX_BATCH_BYTES` with its tables (a message's block fields index its own tables only, so a message
    starts new ones)."""

    def __init__(self) -> None:
        self._done: list[tuple[bytes, list[bytes]]] = []
        self._start()

    def _start(self) -> None:
        self._writer = BlockFieldsWriter()
        self._items: list[bytes] = []
        self._size = 0

    def add(self, key: str, mark: bytes, value: bytes, route: list | None = None,
            content: int | None = None) -> None:
        """One item: ``route`` (a block event's :data:`schemas.block_event.ROUTE_FIELDS`) gives its block
        fields; None, an item without them."""
        # What the item can add, at most: itself (key, mark, event, block fields with the block hash, framing),
        # and table entries for strings and a source that all appear in the event's bytes too
        if self._items and (self._size + self._writer.table_bytes + 2 * len(value) + len(key) + len(mark)
                            + _ITEM_OVERHEAD > MAX_BATCH_BYTES):
            self._done.append((self._writer.tables(), self._items))
            self._start()
        item = encode_keyed_event(key, mark, value, None if route is None else self._writer.block_of(route, content))
        self._items.append(item)
        self._size += len(item)

    def messages(self) -> list[tuple[bytes, list[bytes]]]:
        """``(tables, encoded items)`` of each message, in order."""
        return [*self._done, (self._writer.tables(), self._items)] if self._items else self._done
