"""The commit protocol of a worker: what must be durable, in which order, before Faust commits an offset.

At least once, with tables that never run ahead of their changelogs, needs one fixed order. It lives here
and only here; every caller (Faust's offset commits, rebalances, source-wide events) runs
:meth:`Checkpoint.commit`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Callable, Iterable

import faust

from stream_apps.outputs import OutputTopics

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """Outputs were refused or not acknowledged: nothing may be committed, the worker must stop (a restart reads
    the messages again)."""


class Checkpoint:
    """Makes every output of the messages applied so far durable.

    :meth:`commit` runs these steps, in this order:

    1. **Produce the buffered changelog records** of every store (:meth:`produce_changelogs`).
    2. **Flush the output producer** and wait for every acknowledgement: the tables' changelog records, the
       ``kv-residency-changes`` and ``kv-tier-occupancy`` records and the dead letters of every message the
       agent has finished. A refused or unacknowledged record raises: nothing may be committed then.
    3. **Persist the stores**: each RocksDB store writes its pending entries and the changelog offset they
       reach, one atomic batch per partition. Only acknowledged records reach the disk, so a crash leaves
       every database equal to a prefix of its changelog.
    4. **Freeze Python's garbage collector** on what exists now (see :meth:`_freeze_gc`).
    5. Return. Faust then commits the offsets of the acknowledged messages (its ``on_commit_initiated``
       hook runs this synchronously before it picks them).

    Outside offset commits, the same order holds a source-wide event's effects in place: a clear's row
    removals (and a publisher restart's retired rows) go through steps 1-3 before the record that marks the
    event applied is written, or a worker restarted after a crash could skip the redelivered clear as a
    duplicate while some of its removals never reached the changelog.

    Between checkpoints the worker calls :meth:`produce_changelogs` every ``--changelog-interval-s``, so
    that the changelogs (and what reads them: the other workers' copies of the global tables, standby
    replicas) follow the tables within that interval.

    Args:
        outputs: the worker's output producer.
        stores: the stores to persist (their ``persist()``), in any order.
    """

    def __init__(self, outputs: OutputTopics, stores: Iterable) -> None:
        self.outputs = outputs
        self.stores = list(stores)
        #: How many commits ran, and their seconds in all (``kvstream_checkpoint_seconds``).
        self.commits = 0
        self.total_seconds = 0.0
        #: Why a checkpoint failed, if one did: every later one fails too (see :meth:`commit`).
        self.failure: str | None = None

    def commit(self) -> None:
        """Run the steps above.

        Once a checkpoint failed, every later one fails at once. The worker is stopping then, and Faust's
        shutdown commits offsets once more: a second flush would pass (the refused records are no longer
        queued), so the offsets of messages whose outputs never reached the broker would be committed.

        Raises:
            CheckpointError: a changelog record could not be produced, an output was refused or not
                acknowledged (:meth:`stream_apps.outputs.OutputTopics.flush`), a store could not persist, or
                an earlier checkpoint failed. Nothing may be committed; the worker must stop.
        """
        if self.failure is not None:
            raise CheckpointError(f"an earlier checkpoint failed, nothing more is committed: {self.failure}")
        started = time.perf_counter()
        self.produce_changelogs()
        try:
            self.outputs.flush()
            for store in self.stores:
                store.persist()
        except Exception as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
            raise CheckpointError(str(exc)) from exc
        self._freeze_gc()
        self.total_seconds += time.perf_counter() - started
        self.commits += 1

    def produce_changelogs(self) -> int:
        """Produce every store's buffered changelog records, all stores in one go (so the records of one
        message reach the broker together, as they did when each write produced its own); returns how many.

        Raises:
            CheckpointError: a record could not be encoded or enqueued; it and the records after it stay
                buffered (so every later checkpoint fails too: the worker must stop).
        """
        try:
            return sum(store.produce_changelog() for store in self.stores)
        except Exception as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
            raise CheckpointError(f"a changelog record could not be produced: {self.failure}") from exc

    @staticmethod
    def _freeze_gc() -> None:
        # Python's full collection scans every tracked object: with a memory store's rows it stopped the worker
        # for long pauses every few seconds, and freed almost nothing (rows are freed by reference
        # counting). Freezing moves what exists now out of the collector's sight, so each collection scans
        # only what was allocated since. The cost: cyclic garbage made before a freeze is never freed.
        gc.freeze()


#: The worker's collector thresholds: a young-generation collection every 10,000 net container allocations
#: (Python's default is 700). The hot path allocates about five containers per event that outlive a few
#: events (decoded entries, touched rows, cache entries); with the default every 140 events a collection
#: scanned them, and the older generations that such survivors fill were scanned again and again until the
#: next checkpoint froze them. Measured on the trace with ``bench.profile_stages``, collections took a
#: quarter to a third of the stage's CPU with the default thresholds, and a tenth of that with these; a
#: young collection then stops the worker for a few milliseconds.
GC_THRESHOLDS = (10_000, 10, 10)


def tune_gc() -> None:
    """Set the worker process's collector thresholds to :data:`GC_THRESHOLDS`. Cyclic garbage is still
    collected, only in fewer, larger passes; the checkpoint's ``gc.freeze`` keeps the scanned set small."""
    gc.set_threshold(*GC_THRESHOLDS)


class CommitSensor(faust.Sensor):
    """Runs the checkpoint whenever Faust is about to commit offsets.

    Faust calls ``on_commit_initiated`` synchronously at the start of every offset commit (the commit timer,
    rebalances, errors), before it picks the offsets of the acknowledged messages. A message is acknowledged
    only after the agent has finished it, and so has produced all its outputs. One checkpoint per commit
    (every ``broker_commit_interval``), not per message: each flush waits a broker round trip.

    This sensor is the only hook Faust gives before it picks the offsets to commit, and its API promises no order:
    the order is Faust's ``Consumer.force_commit`` as of the pinned version (the sensor first, then the pending
    acknowledgements). tests/unit/test_commit_sensor.py runs that method of the installed Faust and fails if an
    upgrade reads the acknowledgements before it calls the sensor.

    Args:
        checkpoint: the worker's checkpoint.
        crash: called with the error when a checkpoint fails (the worker must stop; a restart reads the
            messages again).
    """

    def __init__(self, checkpoint: Checkpoint, crash: Callable[[BaseException], object]) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.crash = crash

    def on_commit_initiated(self, consumer) -> None:
        try:
            self.checkpoint.commit()
        except CheckpointError as exc:
            log.error("stopping the worker: %s", exc)
            asyncio.ensure_future(self.crash(exc))
            raise


def warn_on_long_gc_pauses(threshold_s: float = 0.2) -> None:
    """Log a warning when a full (generation 2) collection of Python's cyclic GC stops the worker for longer
    than ``threshold_s`` seconds: it scans every object the worker holds, a memory store's rows included."""
    if any(getattr(callback, "_kvstream_gc_pauses", False) for callback in gc.callbacks):
        return  # once per process, however many apps it builds
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif info["generation"] == 2:
            paused = time.perf_counter() - started[0]
            if paused > threshold_s:
                log.warning("a full Python GC stopped the worker for %.2f s (%d objects freed)", paused,
                            info["collected"])

    on_gc._kvstream_gc_pauses = True
    gc.callbacks.append(on_gc)
