"""Delivery reports gathered without a Python call per record: the stores' changelog records per partition, and
the worker's other outputs.

librdkafka reports every produced record once, through the callback given to ``produce()``. A Python function
there costs a frame per record, and the residency store produces about one changelog record per event: that was
a measurable share of the worker's main thread (bench/PROFILE.md). What the store needs of those reports is
little: per partition, the offset the acknowledged records reach (persisted with the entries, where a restarted
worker resumes reading the changelog), and whether any record was refused.

So each partition's callback is a dict's ``__setitem__``, a C slot: ``reports[error] = message``. A success
(``error`` None) replaces the partition's last successful message; a refusal is kept under its error. The last
successful report of a partition is the one with the highest offset, since a partition's records are appended
and acknowledged in order. Were an earlier one reported last, the offset persisted would be lower than reached,
and a restart would read some records again: values are whole entries, so that only costs time.
"""

from __future__ import annotations

from typing import Callable


def refused(reports: dict) -> list[str]:
    """``"topic[partition]: error"`` of each refusal in ``reports`` (``{error or None: message}``, filled by
    ``reports.__setitem__`` as a delivery callback): one per partition and error code, as a dict keeps one
    message per equal key."""
    return [f"{message.topic()}[{message.partition()}]: {error}" for error, message in reports.items()
            if error is not None]


class DeliveryReports(dict):
    """Partition -> the ``produce()`` delivery callback of records sent to it (created on first use).

    Reading the reports: :meth:`refused` (any partition's refusals, kept until taken with
    :meth:`take_offsets`) and :meth:`take_offsets` (the offset each partition reached since the last call).
    """

    def __init__(self) -> None:
        super().__init__()
        #: Partition -> {None: last acknowledged message, KafkaError: last message refused with it}.
        self._by_partition: dict[int, dict] = {}

    def __missing__(self, partition: int) -> Callable:
        reports = self._by_partition[partition] = {}
        callback = self[partition] = reports.__setitem__
        return callback

    def refused(self) -> list[str]:
        """:func:`refused` of every partition's reports since the last :meth:`take_offsets`."""
        return [line for reports in self._by_partition.values() for line in refused(reports)]

    def take_offsets(self) -> dict[int, int]:
        """Partition -> offset of the last record acknowledged since the previous call; forgets the reports."""
        offsets = {}
        for partition, reports in self._by_partition.items():
            message = reports.get(None)
            if message is not None:
                offsets[partition] = message.offset()
            reports.clear()
        return offsets
