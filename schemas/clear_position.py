"""The position of an ``AllBlocksCleared`` in its source's stream, and how it is written in Avro.

A clear is a watermark (docs/residency.md, "Clears"): it removes the source's rows whose last store came
before it, and a store that comes before it but arrives later is ignored. Comparing positions is comparing
``(publisher_epoch, seq, batch_index)`` in that order, which a tuple does natively.
"""

from __future__ import annotations

from typing import NamedTuple

_tuple_new = tuple.__new__


class ClearPosition(NamedTuple):
    """Where a clear stands among its source's events; ordered like the events themselves."""

    #: The publisher epoch the clear was published in (a publisher restart starts a higher one).
    publisher_epoch: int
    #: The engine batch's sequence number within the epoch (vLLM's ``seq``).
    seq: int
    #: The event's index within that batch.
    batch_index: int

    @classmethod
    def of(cls, record: dict | None) -> "ClearPosition":
        """The position of a ``ClearMark``, ``ClearWatermark`` or ``kv_event`` record; :data:`NO_CLEAR` for None."""
        if record is None:
            return NO_CLEAR
        # tuple.__new__ directly: the generated NamedTuple constructor costs twice as much, and this runs per event
        return _tuple_new(cls, (record["publisher_epoch"], record["seq"], record["batch_index"]))



#: "No clear yet": lower than any real position.
NO_CLEAR = ClearPosition(-1, -1, -1)


#: Position -> its ``ClearMark`` record: every row an event touches gets one, and a source has few clears.
_MARK_RECORDS: dict[tuple[int, int, int], dict] = {}


def clear_mark_record(position: tuple[int, int, int]) -> dict | None:
    """The Avro ``ClearMark`` record of a position (a :class:`ClearPosition` or a plain 3-tuple); None for
    :data:`NO_CLEAR`.

    The record is shared by every row with that mark (rows replace their mark, never change it in place), so
    callers must not modify it.
    """
    record = _MARK_RECORDS.get(position)
    if record is None:
        if position == NO_CLEAR:
            return None
        if len(_MARK_RECORDS) >= 4096:  # a bound, not an LRU: marks come and go with sources' clears
            _MARK_RECORDS.clear()
        epoch, seq, batch_index = position
        record = _MARK_RECORDS[tuple(position)] = {"publisher_epoch": epoch, "seq": seq, "batch_index": batch_index}
    return record
