"""The repartition stage's outgoing ``ownership_batch`` messages of one destination partition, each at most
:data:`MAX_BATCH_BYTES` with the block-field tables its items index."""

from __future__ import annotations

from collections import defaultdict
from functools import partial

from schemas.avro_writers import encode_keyed_event
from schemas.block_event import BlockFieldsWriter, item_encoder
from schemas.compiled import choose

#: Upper bound of one ownership_batch message's payload; the re-keyed topic allows 8 MiB messages.
MAX_BATCH_BYTES = 1 << 20

#: Bytes an item adds besides its key, mark and event, and its table entries besides their text, at most:
#: length varints, the block fields (66 bytes before the parent and block hashes, which the event holds too), a
#: source's ints and unions, the message's framing.
_ITEM_OVERHEAD = 256


class PartitionBatch:
    """The ``ownership_batch`` messages of one destination partition in one batch: each at most
    :data:`MAX_BATCH_BYTES` with its tables (a message's block fields index its own tables only, so a message
    starts new ones).

    Args:
        compiled: encode block items with the compiled encoder (:class:`schemas.block_event.BlockFieldsWriter`):
            None (the default) where it is built.
    """

    def __init__(self, compiled: bool | None = None) -> None:
        self._compiled = compiled
        self._done: list[tuple[bytes, list[bytes]]] = []
        self._start()

    def _start(self) -> None:
        self._writer = BlockFieldsWriter(self._compiled)
        self._items: list[bytes] = []
        self._size = 0

    def _room(self, key: str | bytes, mark: bytes, value: bytes) -> None:
        """Start a new message unless this one has room for the item: itself (key, mark, event, block fields with
        the block hash, framing) and the table entries it may add (strings and a source that all appear in the
        event's bytes too)."""
        if self._items and (self._size + self._writer.table_bytes + 2 * len(value) + len(key) + len(mark)
                            + _ITEM_OVERHEAD > MAX_BATCH_BYTES):
            self._done.append((self._writer.tables(), self._items))
            self._start()

    def add(self, key: str, mark: bytes, value: bytes) -> None:
        """One item without block fields (a source-wide event's, or any the agent decodes from its record)."""
        self._room(key, mark, value)
        item = encode_keyed_event(key, mark, value)
        self._items.append(item)
        self._size += len(item)

    def add_block(self, key: bytes, mark: bytes, value: bytes, route: list, content: int | None = None) -> None:
        """One block event's item: key ``key`` (UTF-8), block fields from ``route`` (its
        :data:`schemas.block_event.ROUTE_FIELDS`) and ``content`` (its content digest, or None)."""
        self._room(key, mark, value)
        item = self._writer.keyed_item(key, mark, value, route, content)
        self._items.append(item)
        self._size += len(item)

    def messages(self) -> list[tuple[bytes, list[bytes]]]:
        """``(tables, encoded items)`` of each message, in order."""
        return [*self._done, (self._writer.tables(), self._items)] if self._items else self._done


def partition_batches(compiled: bool | None = None) -> defaultdict:
    """Destination partition -> its batch, made on first use: a :class:`PartitionBatch`, or where the compiled
    module is built (:func:`schemas.compiled.choose`) its twin ``schemas._hotpath.BlockBatch``, which the
    compiled loop of the repartition process (``rekey_block_events``) adds to without a Python call."""
    module = choose(compiled)
    if module is None:  # and so the Python writer too
        return defaultdict(partial(PartitionBatch, False))
    return defaultdict(partial(module.BlockBatch, BlockFieldsWriter, item_encoder(module), encode_keyed_event,
                               MAX_BATCH_BYTES, _ITEM_OVERHEAD))
