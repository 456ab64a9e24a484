"""Liveness of sources: a lease per (instance, data-parallel rank), renewed by its events and heartbeats.

An answer must be true now, not only as of a source's last event: a router acting on the blocks of a dead
engine sends requests to a dead pod. So every source holds a **lease** (docs/residency.md, "Liveness"):

* the workers write a source's ``sources`` row whenever they apply one of its events or its ``SourceHeartbeat``
  (which the bridge sends while it has evidence the engine is alive, and the simulator while it publishes);
* the lease runs on the **workers' clock of arrival**: the time a worker wrote the row (the timestamp of its
  changelog record), never the engine's timestamps, so a capture replayed with old timestamps, or the simulator's
  2026-01-01 trace, does not expire on load;
* a source not heard of for ``--source-lease-s`` (30 s) is **down**: its rows are kept but left out of every
  lookup, query and prefix match, and ``/workers`` and ``/sources/`` say ``live: false`` with ``down_since``;
* a source down for ``--source-expiry-s`` (10 min) is **cleared**: a worker writes ``SourceUnregistered`` to
  ``kv-events``, which removes its rows on every tier, in order, on every worker and index;
* a source that comes back answers again from what its events say.

:class:`SourceLeases` keeps the last time each ``sources`` key was written; a worker fills it from its global
``sources`` table, an index replica from ``<app id>-sources-changelog`` (:class:`SourcesFeed`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from confluent_kafka import Producer

from kafka_io.config import producer_config
from schemas import SOURCE_UNREGISTERED, AvroCodec
from stream_apps.index.compacted_feed import CompactedFeed

log = logging.getLogger(__name__)

#: Default lease of a source, seconds (``--source-lease-s``): LMCache's controller reaps workers after 30 s
#: without a heartbeat.
DEFAULT_LEASE_S = 30.0
#: Default time a source stays down before a worker clears it, seconds (``--source-expiry-s``).
DEFAULT_EXPIRY_S = 600.0
#: Longest a worker's leases lag its sources table, seconds.
REFRESH_EVERY_S = 0.25


class SourceState(NamedTuple):
    """One (instance, data-parallel rank)'s liveness as of a moment."""

    #: False once no event and no heartbeat arrived for one lease.
    live: bool
    #: When a worker last heard of the source (its clock), seconds since the Unix epoch.
    last_heard: float
    #: When the lease lapsed (``last_heard`` + lease) if down; None while live.
    down_since: float | None


class SourceLeases:
    """Last-heard times per ``sources`` key, and the leases they give (module docstring).

    Args:
        lease_s: seconds without an event or heartbeat after which a source is down.
        clock: the current time, seconds since the Unix epoch (tests pass their own).
    """

    def __init__(self, lease_s: float = DEFAULT_LEASE_S, clock: Callable[[], float] = time.time,
                 refresh: Callable[[SourceLeases], None] | None = None) -> None:
        self.lease_s = lease_s
        self._clock = clock
        #: Called with this object before :meth:`states` answers, at most every :data:`REFRESH_EVERY_S` (a worker
        #: takes the last-heard times from its sources table then, so an answer right after its start has them).
        self._refresh = refresh
        self._refreshed_at = -1.0
        #: sources key -> (instance, data-parallel rank, last written, seconds since the Unix epoch).
        self._heard: dict[str, tuple[str, int, float]] = {}
        #: (instance, data-parallel rank) -> when an index's events feed last read one of its events or heartbeats
        #: (seconds since the Unix epoch): evidence straight from kv-events, not through a worker's table.
        self._direct: dict[tuple[str, int], float] = {}
        #: (instance, data-parallel rank) -> when its bridge said it disconnected (``SourceDisconnected``): down
        #: from then until an event or heartbeat read after it (:meth:`heard`), whatever the tables say.
        self._down_marks: dict[tuple[str, int], float] = {}
        self._lock = threading.Lock()

    def note(self, key: str, instance_id: str, data_parallel_rank: int, written_at: float) -> None:
        """A worker wrote ``key`` (``<partition>/<instance>/<rank>/<worker rank>``) at ``written_at``."""
        with self._lock:
            known = self._heard.get(key)
            if known is None or written_at >= known[2]:
                self._heard[key] = (instance_id, data_parallel_rank, written_at)

    def heard(self, instance_id: str, data_parallel_rank: int, at: float) -> None:
        """An event or heartbeat of the source was read from kv-events at ``at`` (seconds since the Unix epoch):
        it renews the lease, and lifts a down mark older than it."""
        source = (instance_id, data_parallel_rank)
        with self._lock:
            if at >= self._direct.get(source, 0.0):
                self._direct[source] = at
            mark = self._down_marks.get(source)
            if mark is not None and at > mark:
                del self._down_marks[source]

    def mark_down(self, instance_id: str, data_parallel_rank: int | None, at: float) -> None:
        """The source's bridge saw its engine go (``SourceDisconnected``, read at ``at``): down at once, every rank
        of the instance when ``data_parallel_rank`` is None, until :meth:`heard` hears of it after ``at``."""
        with self._lock:
            ranks = [data_parallel_rank] if data_parallel_rank is not None else sorted(
                {rank for instance, rank, _ in self._heard.values() if instance == instance_id}
                | {rank for instance, rank in self._direct if instance == instance_id} or {0})
            for rank in ranks:
                source = (instance_id, rank)
                if at > self._down_marks.get(source, 0.0):
                    self._down_marks[source] = at

    def forget(self, key: str) -> None:
        """``key`` was deleted (the source was unregistered)."""
        with self._lock:
            self._heard.pop(key, None)

    def replace_all(self, heard: dict[str, tuple[str, int, float]]) -> None:
        """Take a whole new set of last-heard times (a worker's view of its global ``sources`` table)."""
        with self._lock:
            self._heard = dict(heard)

    def states(self, now: float | None = None) -> dict[tuple[str, int], SourceState]:
        """(instance, data-parallel rank) -> :class:`SourceState`, from the newest write over its keys."""
        now = self._clock() if now is None else now
        if self._refresh is not None and time.monotonic() - self._refreshed_at >= REFRESH_EVERY_S:
            self._refreshed_at = time.monotonic()
            self._refresh(self)
        newest: dict[tuple[str, int], float] = {}
        with self._lock:
            for instance, rank, written in self._heard.values():
                source = (instance, rank)
                if written > newest.get(source, 0.0):
                    newest[source] = written
            for source, heard in self._direct.items():
                if heard > newest.get(source, 0.0):
                    newest[source] = heard
            marks = dict(self._down_marks)
        states = {}
        for source, heard in newest.items():
            mark = marks.get(source)
            if mark is not None:
                states[source] = SourceState(False, heard, mark)
            elif now - heard <= self.lease_s:
                states[source] = SourceState(True, heard, None)
            else:
                states[source] = SourceState(False, heard, heard + self.lease_s)
        for source, mark in marks.items():
            if source not in states:
                states[source] = SourceState(False, mark, mark)
        return states

    def down(self, now: float | None = None) -> frozenset[tuple[str, int]]:
        """The (instance, data-parallel rank) pairs that are down now. A source never heard of is not in it: its
        rows came with events, which a worker wrote down with them."""
        return frozenset(source for source, state in self.states(now).items() if not state.live)


def leases_from_sources_table(leases: SourceLeases, sources_items, written_at: dict[str, float]) -> None:
    """Fill ``leases`` from a worker's global ``sources`` table (``(key, status)`` items) and its store's
    per-key write times (:attr:`stream_apps.store.MemoryTableStore.written_at`)."""
    leases.replace_all({key: (status["instance_id"], status["data_parallel_rank"], written_at[key])
                        for key, status in sources_items if key in written_at})


class SourcesFeed(CompactedFeed):
    """Reads ``<app id>-sources-changelog`` into ``leases``, for an index replica (which holds no tables): every
    record's Kafka timestamp is when a worker wrote the row (the workers produce their changelogs every
    ``--global-changelog-interval-s``, so at most that much later)."""

    def __init__(self, leases: SourceLeases, bootstrap_servers: str, topic: str, codec: AvroCodec) -> None:
        super().__init__(bootstrap_servers, topic, codec, "kvstream-index-sources")
        self.leases = leases

    def on_record(self, key: str, record: dict, message) -> None:
        _, stamp = message.timestamp()
        written = stamp / 1000 if stamp and stamp > 0 else time.time()
        self.leases.note(key, record["instance_id"], record["data_parallel_rank"], written)

    def on_tombstone(self, key: str) -> None:
        self.leases.forget(key)


def unregister_record(instance_id: str, data_parallel_rank: int | None = None, reason: str | None = None) -> dict:
    """The ``kv_event`` record of a ``SourceUnregistered`` of ``instance_id`` (one rank, or all when
    ``data_parallel_rank`` is None): source-wide, so it goes to every partition of ``kv-events``."""
    return {"instance_id": instance_id, "data_parallel_rank": data_parallel_rank or 0, "worker_rank": None,
            "world_size": None, "aggregation": None, "publisher_epoch": 0, "seq": -1, "batch_index": -1,
            "ts": time.time(), "block_hash": None, "hash_encoding": "UINT64", "block_index": 0, "block_count": 1,
            "tier": None, "event": (SOURCE_UNREGISTERED, {"all_ranks": data_parallel_rank is None,
                                                           "reason": reason})}


def write_unregister(bootstrap_servers: str, kv_events_topic: str, instance_id: str,
                     data_parallel_rank: int | None = None, reason: str | None = None,
                     producer: Producer | None = None, timeout_s: float = 30.0) -> int:
    """Write a ``SourceUnregistered`` of ``instance_id`` to every partition of ``kv_events_topic`` and wait for
    the broker's acknowledgements; returns the partitions written.

    Raises:
        RuntimeError: the topic does not exist, or the broker did not acknowledge within ``timeout_s``.
    """
    own = producer is None
    producer = producer or Producer(producer_config(bootstrap_servers))
    metadata = producer.list_topics(kv_events_topic, timeout=10).topics.get(kv_events_topic)
    if metadata is None or metadata.error is not None or not metadata.partitions:
        raise RuntimeError(f"topic {kv_events_topic} does not exist on {bootstrap_servers}")
    value = AvroCodec("kv_event").encode(unregister_record(instance_id, data_parallel_rank, reason))
    for partition in metadata.partitions:
        producer.produce(kv_events_topic, value=value, partition=partition)
    if own and producer.flush(timeout_s):
        raise RuntimeError(f"the broker at {bootstrap_servers} did not acknowledge the unregistration within "
                           f"{timeout_s:.0f} s")
    return len(metadata.partitions)
