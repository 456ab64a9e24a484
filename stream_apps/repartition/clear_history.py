"""The repartition stage's clear history: each source's last clears on a kv-events partition, with their offsets,
so an event gets the clear mark it got the first time, across restarts and rebalances (kept in the compacted
topic ``<app id>-repartition-source-clears``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.avro_writers import encode_clear_mark
from schemas.clear_position import NO_CLEAR, ClearPosition

#: Clears kept per source and partition; a replay reaches back a batch or two (each batch's offsets are committed,
#: asynchronously, right after its flush), so this only has to exceed the clears one source can emit within them.
CLEAR_HISTORY = 8


@dataclass
class ClearHistory:
    """The latest ``AllBlocksCleared`` copies of one source on one kv-events partition.

    ``clears`` holds ``(offset, (publisher_epoch, seq, batch_index))``, oldest first.
    """

    instance_id: str
    data_parallel_rank: int
    partition: int
    clears: list[tuple[int, ClearPosition]] = field(default_factory=list)
    _newest_encoded: bytes | None = field(default=None, repr=False, compare=False)

    def mark_before(self, offset: int) -> ClearPosition:
        """Position of the latest clear read before ``offset`` (:data:`NO_CLEAR` if none is kept)."""
        for clear_offset, mark in reversed(self.clears):
            if clear_offset < offset:
                return mark
        return NO_CLEAR

    def encoded_mark_before(self, offset: int) -> bytes:
        """:func:`schemas.avro_writers.encode_clear_mark` of :meth:`mark_before` (the common case, the newest clear,
        is encoded once)."""
        if self.clears and self.clears[-1][0] < offset:
            if self._newest_encoded is None:
                self._newest_encoded = encode_clear_mark(self.clears[-1][1])
            return self._newest_encoded
        return encode_clear_mark(self.mark_before(offset))

    def add(self, offset: int, mark: ClearPosition) -> bool:
        """Record the clear read at ``offset``; False if it is already known (a redelivery)."""
        if any(clear_offset == offset for clear_offset, _ in self.clears):
            return False
        self.clears.append((offset, mark))
        self.clears.sort()
        del self.clears[:-CLEAR_HISTORY]
        self._newest_encoded = None
        return True

    def to_record(self) -> dict:
        """The Avro ``SourceClears`` value (schemas/source_clears_v1.avsc)."""
        return {"instance_id": self.instance_id, "data_parallel_rank": self.data_parallel_rank,
                "partition": self.partition,
                "clears": [{"offset": o, "publisher_epoch": m[0], "seq": m[1], "batch_index": m[2]}
                           for o, m in self.clears]}

    @classmethod
    def from_record(cls, record: dict) -> "ClearHistory":
        """Inverse of :meth:`to_record`."""
        return cls(record["instance_id"], record["data_parallel_rank"], record["partition"],
                   [(c["offset"], (c["publisher_epoch"], c["seq"], c["batch_index"])) for c in record["clears"]])
