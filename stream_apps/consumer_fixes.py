"""Two corrections to faust-streaming 0.15.3's aiokafka driver that keep a rebalance from skipping messages.

Both were found by ``make chaos``'s rebalance scenario, which lost rows about once in six runs, with or without
standby replicas (docs/operations.md, "Standby replicas"). The sequence that lost them:

1. A partition of the re-keyed topic has no committed offset yet (Faust drops its acknowledged offsets when
   partitions are revoked, before it commits them), and a message arrives on it while the worker recovers
   its tables after a rebalance.
2. When recovery ends Faust pauses its changelog partitions. With no standby partitions to resume, its set
   of active partitions is empty for a moment, and Faust hands that (live, mutable) set to aiokafka's
   ``fetched_records``, which reads an empty set as *every* partition. The message is fetched and aiokafka's
   position moves past it; Faust drops it because its partition is not active.
3. Faust then seeks each partition to its committed offset, but aiokafka only seeks partitions that have one
   above 0, so the position stays past the message and the message is never applied.

The corrections, each a method of Faust's ``AIOKafkaConsumerThread``:

- :func:`_fetch_records`: fetch with a snapshot of the active set, and nothing at all when it is empty;
- :func:`_seek_to_committed`: a stream partition with no committed offset goes to its beginning (what
  ``consumer_auto_offset_reset="earliest"`` means); the events read again are ignored as duplicates.

:func:`install` applies them once per process; ``pyproject.toml`` pins the faust-streaming version they were
written against, and :data:`FAUST_VERSION` is checked.
"""

from __future__ import annotations

import logging

import faust
from faust.transport.drivers import aiokafka as driver

log = logging.getLogger(__name__)

#: The faust-streaming version whose driver these methods replace.
FAUST_VERSION = "0.15.3"

_original_fetch_records = driver.AIOKafkaConsumerThread._fetch_records


async def _fetch_records(self, consumer, active_partitions, timeout=None, max_records=None):
    """Faust's fetch, with a frozen copy of the active partitions, and no fetch when there are none (aiokafka
    would read an empty set as every assigned partition)."""
    active = frozenset(active_partitions)
    if not active:
        return {}
    return await _original_fetch_records(self, consumer, active, timeout=timeout, max_records=max_records)


async def _seek_to_committed(self):
    """Seek every assigned partition to its committed offset, and a stream partition that has none to its
    beginning. Returns the committed offsets, as Faust's does."""
    changelogs = self.consumer.app.tables.changelog_topics

    async def seek(consumer):
        committed = await consumer.seek_to_committed()
        never_committed = [tp for tp, offset in committed.items() if not offset and tp.topic not in changelogs]
        if never_committed:
            await consumer.seek_to_beginning(*never_committed)
            log.debug("partitions without a committed offset read from their beginning: %s", never_committed)
        return committed

    return await self.call_thread(seek, self._ensure_consumer())


def install() -> None:
    """Replace the two driver methods (idempotent).

    Raises:
        RuntimeError: another faust-streaming version is installed; the corrections must be checked against it.
    """
    if faust.__version__ != FAUST_VERSION:
        raise RuntimeError(f"stream_apps.consumer_fixes was written for faust-streaming {FAUST_VERSION}, not "
                           f"{faust.__version__}: check whether its driver still needs them")
    driver.AIOKafkaConsumerThread._fetch_records = _fetch_records
    driver.AIOKafkaConsumerThread.seek_to_committed = _seek_to_committed
