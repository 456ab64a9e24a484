"""Fleet-wide views of the tables: occupancy, ownerships and publisher status over every partition, and how far
the workers are behind their input.

They read the global tables (``tier-occupancy``, ``sources``), which every worker holds whole. Those are
complete only once the workers have consumed their input: :class:`InputLagReader` says whether they have, for
``GET /occupancy/`` and ``GET /sources/`` to answer with (``caught_up``, ``lag``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from kafka_io.admin import GroupProgress, GroupProgressReader
from schemas.topics import TopicNames
from stream_apps.repartition import repartition_group
from stream_apps.tables import Tables

log = logging.getLogger(__name__)

#: Seconds a reading of the workers' input lag is reused by the fleet views (each costs a few admin requests).
INPUT_LAG_CACHE_S = 1.0
#: Longest a fleet view waits for a fresh reading; past it, it answers without one (``caught_up`` false).
INPUT_LAG_WAIT_S = 2.0


def occupancy_rows(tables: Tables) -> list[dict]:
    """Resident blocks per (ownership, tier, instance), summed over partitions, sorted."""
    totals: dict[tuple, int] = defaultdict(int)
    for value in tables.tier_occupancy.values():
        totals[(value["ownership"] or "", value["tier"], value["instance_id"])] += value["resident_blocks"]
    return [{"ownership": own or None, "tier": tier, "instance_id": inst, "resident_blocks": n}
            for (own, tier, inst), n in sorted(totals.items()) if n]


def known_ownerships(tables: Tables) -> set[str | None]:
    """Ownerships with resident blocks anywhere (None = primary), from the global occupancy table."""
    return {None} | {value["ownership"] for value in tables.tier_occupancy.values()}


def source_rows(tables: Tables, now: float | None = None) -> list[dict]:
    """One status per publisher, merged over partitions, sorted.

    Source-wide facts (epoch, restarts, stale) come from the partition copy with the newest epoch and most
    restarts; ``events_applied`` is the sum over partitions, ``last_event_ts`` and ``last_seq`` the newest.
    ``lag_s`` is ``now`` minus ``last_event_ts`` (the engine's clock against this worker's). ``applied_ts`` is
    when a worker last applied an event of the publisher (its clock, as the ``sources`` store keeps it per key,
    :attr:`stream_apps.store.MemoryTableStore.written_at`; None where the store keeps none) and
    ``arrival_lag_s`` is ``now`` minus that: the workers' clock only, so it means the same for replayed data.
    """
    now = time.time() if now is None else now
    written_at = getattr(tables.sources.data, "written_at", {})
    groups: dict[tuple, list[tuple[str, dict]]] = defaultdict(list)
    # in key order, so that ties (several partitions' copies with the same epoch) resolve alike on every worker,
    # whatever order its copy of the table was filled in
    for key, status in sorted(tables.sources.items()):
        groups[(status["instance_id"], status["data_parallel_rank"], status["worker_rank"])].append((key, status))
    rows = []
    for _, keyed in sorted(groups.items()):
        copies = [status for _, status in keyed]
        facts = max(copies, key=lambda c: (c["publisher_epoch"], c["restarts"]))
        newest = max(copies, key=lambda c: c["last_event_ts"] or 0.0)
        last_ts = newest["last_event_ts"]
        applied = [written_at[key] for key, _ in keyed if key in written_at]
        applied_ts = max(applied) if applied else None
        rows.append({**facts, "worker_rank": None if facts["worker_rank"] < 0 else facts["worker_rank"],
                     "events_applied": sum(c["events_applied"] for c in copies), "last_event_ts": last_ts,
                     "last_seq": newest["last_seq"], "lag_s": None if last_ts is None else round(now - last_ts, 3),
                     "applied_ts": applied_ts,
                     "arrival_lag_s": None if applied_ts is None else round(max(now - applied_ts, 0.0), 3)})
    return rows


def input_progress(reader: GroupProgressReader, topics: TopicNames) -> dict[str, GroupProgress]:
    """How far an app's two consumer groups have committed through its input: ``kv-events`` (the repartition
    stage's group ``<app id>-repartition``) and the re-keyed topic (the agent's group, the app id). Blocking.

    Raises:
        RuntimeError: as :meth:`kafka_io.admin.GroupProgressReader.partition_progress`.
    """
    return {**reader.group_progress(repartition_group(topics.scoped_app_id), [topics.kv_events]),
            **reader.group_progress(topics.scoped_app_id, [topics.by_ownership])}


@dataclass(frozen=True)
class InputLag:
    """One reading of the workers' lag behind their input."""

    #: Messages of the input not yet consumed (committed) by the app's groups: kv-events by the repartition
    #: stage, plus the re-keyed topic by the agent (each of those a batch of events); None: unknown.
    lag: int | None
    #: The same per topic.
    topics: dict[str, int] = field(default_factory=dict)
    #: Why there is no fresh reading (the broker did not answer in time, the group coordinator is loading).
    error: str | None = None

    @property
    def caught_up(self) -> bool:
        """The workers have consumed everything their input held when this was read: the fleet views are
        complete as of then (global tables: up to ``--global-changelog-interval-s`` later on other workers)."""
        return self.lag == 0 and self.error is None

    def json(self) -> dict:
        """The fields a fleet view answers with: ``caught_up``, ``lag``, ``lag_by_topic`` (and ``lag_error``)."""
        answer = {"caught_up": self.caught_up, "lag": self.lag, "lag_by_topic": self.topics}
        if self.error is not None:
            answer["lag_error"] = self.error
        return answer


class InputLagReader:
    """The workers' lag behind their input, for the fleet views: read from the broker in the event loop's
    executor (the admin calls block), at most once per ``cache_s`` however many requests ask at once, and
    never waited for longer than ``wait_s``.

    Args:
        read: the blocking read, ``{topic: GroupProgress}`` (:func:`input_progress`).
    """

    def __init__(self, read: Callable[[], dict[str, GroupProgress]], *, cache_s: float = INPUT_LAG_CACHE_S,
                 wait_s: float = INPUT_LAG_WAIT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._read, self._cache_s, self._wait_s, self._clock = read, cache_s, wait_s, clock
        self._last: InputLag | None = None
        self._last_at = float("-inf")
        self._pending: asyncio.Future | None = None

    @classmethod
    def for_app(cls, progress: GroupProgressReader, topics: TopicNames, **kwargs) -> InputLagReader:
        """The reader of an app's groups over ``progress`` (kept by the caller for the worker's life)."""
        return cls(lambda: input_progress(progress, topics), **kwargs)

    async def reading(self) -> InputLag:
        """The latest reading if it is younger than ``cache_s``, else a fresh one (shared by the requests that
        ask meanwhile); if none comes within ``wait_s``, a reading without lag (``caught_up`` false)."""
        if self._last is not None and self._clock() - self._last_at < self._cache_s:
            return self._last
        if self._pending is None or self._pending.done():
            self._pending = asyncio.ensure_future(self._refresh())
        try:
            return await asyncio.wait_for(asyncio.shield(self._pending), self._wait_s)
        except TimeoutError:
            return InputLag(None, {}, f"no answer from the broker on the consumer groups within {self._wait_s:g} s")

    async def _refresh(self) -> InputLag:
        try:
            progress = await asyncio.get_running_loop().run_in_executor(None, self._read)
        except Exception as exc:  # noqa: BLE001 - the broker or its group coordinator did not answer: say so
            log.debug("input lag unreadable: %s", exc)
            reading = InputLag(None, {}, str(exc))
        else:
            reading = InputLag(sum(p.lag for p in progress.values()), {t: p.lag for t, p in progress.items()})
        self._last, self._last_at = reading, self._clock()
        return reading
