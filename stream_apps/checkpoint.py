"""The checkpoint protocol of both stages of a worker: what must be durable, in which order, before an offset
is committed.

At least once, with tables that never run ahead of their changelogs, needs one fixed order. It is written
once, in :class:`Checkpoint`'s docstring; both stages run it, each plugging in what its steps are: the
repartition process (:class:`stream_apps.repartition.Repartitioner`) after every batch, and the materializing
agent at Faust's offset commits (:class:`CommitSensor`), at rebalances and at source-wide events.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Awaitable, Callable, Iterable, Mapping, Protocol

import faust

log = logging.getLogger(__name__)

#: How long step 2 of a checkpoint waits for the broker's acknowledgements by default (seconds). The agent's
#: checkpoint waits inside Faust's event loop (see :class:`CommitSensor`): this must stay well below the consumer
#: session timeout.
FLUSH_TIMEOUT_S = 60.0
#: The awaiting flush (:meth:`Checkpoint.prepare`) serves the delivery reports already in, then gives the event
#: loop this long before it looks again (seconds).
PREPARE_POLL_S = 0.001
#: How long the agent's offset commits first wait for the acknowledgements with the event loop free
#: (:func:`prepare_before_commits`; seconds). Long enough for the records a checkpoint produces to come back on
#: a loaded broker (the idempotent output producer has at most 5 requests in flight, and librdkafka puts one
#: partition in each, its issue 1700; a checkpoint writes to some 40 partitions); what is still
#: unacknowledged after it, the synchronous flush waits for.
PRE_COMMIT_WAIT_S = 0.1


class CheckpointError(RuntimeError):
    """Outputs were refused or not acknowledged: nothing may be committed, the worker must stop (a restart reads
    the messages again)."""


class Acknowledging(Protocol):
    """What a checkpoint needs of a stage's producer (:class:`stream_apps.outputs.OutputTopics`, the
    repartition stage's :class:`~stream_apps.repartition.Repartitioner`)."""

    def acknowledge(self, timeout_s: float) -> int:
        """Send what is queued at once and serve delivery reports until every record produced so far is
        acknowledged or refused, for at most ``timeout_s``; returns how many records are still unacknowledged.
        With 0 it only serves the reports already in: librdkafka sends at once only while the call waits, so
        records produced since go out after the producer's ``linger.ms``."""

    def take_delivery_errors(self) -> list[str]:
        """The records the broker refused since the last call (``"topic[partition]: error"``), forgotten here."""


class Checkpoint:
    """The checkpoint protocol: makes every output of the messages handled so far durable, then their offsets.

    :meth:`commit` runs these steps, in this order, with nothing of the stage running in between (it is
    synchronous):

    1. **Produce what is buffered**: the stage's ``produce`` callables, then each store's buffered changelog
       records (``produce_changelog()``). The repartition stage: its batch's re-keyed ``ownership_batch``
       messages and changed clear histories. The agent: every table's changelog records (its residency
       changes, occupancy records and dead letters are produced as they are made).
    2. **Flush the producer** and wait for every acknowledgement, at most ``flush_timeout_s``. A record
       refused, or not acknowledged in time, raises: nothing may be committed then.
    3. **Persist the state**: each store's ``persist()``. A RocksDB store writes its pending entries and the
       changelog offset they reach, one atomic batch per partition; only acknowledged records reach the disk,
       so a crash leaves every database equal to a prefix of its changelog. (The repartition stage has no
       state to persist: its clear histories are durable once step 2 acknowledged them.)
    4. **Commit the offsets**. The checkpoint owns the offsets a stage hands it (:meth:`store_offsets`) and
       commits them through ``commit_offsets`` (the repartition stage: its consumer's, asynchronously). The
       agent's offsets stay Faust's: its checkpoint returns, and Faust's ``Consumer.force_commit``, which runs
       it from :class:`CommitSensor`, then commits the offsets of the messages it has acknowledged. Faust
       gives no other hook before it picks them (see :class:`CommitSensor`).

    Why this order: an offset committed before its message's outputs are acknowledged loses them at a crash
    (the message is not read again), hence 1-2 before 4; a database written before its changelog records are
    acknowledged keeps a value the changelog never gets (the restarted worker ignores the redelivered event as
    a duplicate), hence 2 before 3. Persisting before the commit (Quix Streams commits first) keeps the disk
    within what the next commit covers; either way a crash between the two only replays messages, which the
    tables ignore (idempotent rows).

    The same order holds a source-wide event's effects in place: a clear's row removals (and a publisher
    restart's retired rows) go through steps 1-3 before the record that marks the event applied is written,
    or a worker restarted after a crash could skip the redelivered clear as a duplicate while some of its
    removals never reached the changelog (bench/PROFILE.md, "The reverted 'several messages per flush'
    attempt").

    The flush of step 2 blocks its thread. The repartition stage runs it in its own process, with no event
    loop, once per batch. The agent runs it where Faust calls it: in ``on_commit_initiated``, a synchronous
    hook that Faust's commit coroutine calls and then at once reads the acknowledged offsets, so nothing can
    be awaited there. So each commit of the agent's consumer first awaits :meth:`prepare` (steps 1-2 with
    the event loop free; :func:`prepare_before_commits`), and where a coroutine runs a checkpoint (a
    rebalance), :meth:`commit_async` does the same: the synchronous steps find little left to wait for.
    Between checkpoints the worker produces the changelogs every ``--changelog-interval-s``, the global
    tables' every ``--global-changelog-interval-s`` (:meth:`produce`), and serves delivery reports every 50 ms,
    so that a flush has few left to serve.

    Args:
        producer: the stage's producer (:class:`Acknowledging`).
        stores: stores whose ``produce_changelog()`` is part of step 1 and ``persist()`` is step 3, in this
            order.
        produce: callables producing the stage's other buffered records, before the stores' (step 1); each
            returns how many it produced.
        commit_offsets: commits the offsets stored with :meth:`store_offsets`, ``{partition: next offset}``
            (step 4); None: the stage's offsets are committed by its caller after :meth:`commit` (Faust's).
        flush_timeout_s: how long step 2 waits at most (seconds).
        freeze_gc: whether each checkpoint ends with :meth:`_freeze_gc` (the agent's).
    """

    def __init__(self, producer: Acknowledging, stores: Iterable = (), *, produce: Iterable[Callable[[], int]] = (),
                 commit_offsets: Callable[[dict[int, int]], object] | None = None,
                 flush_timeout_s: float = FLUSH_TIMEOUT_S, freeze_gc: bool = True) -> None:
        self.producer = producer
        self.stores = list(stores)
        self._produce = [*produce, *(store.produce_changelog for store in self.stores)]
        self._commit_offsets = commit_offsets
        self.flush_timeout_s = flush_timeout_s
        self.freeze_gc = freeze_gc
        #: Partition -> next offset to commit, handed over by the stage and not committed yet.
        self.offsets: dict[int, int] = {}
        #: How many commits ran, and their seconds in all (the agent's: ``kvstream_checkpoint_seconds``).
        self.commits = 0
        self.total_seconds = 0.0
        #: Why a checkpoint failed, if one did: every later one fails too (see :meth:`commit`).
        self.failure: str | None = None

    def store_offsets(self, offsets: Mapping[int, int]) -> None:
        """Hand over ``{partition: next offset}`` of messages whose outputs are produced or buffered: the next
        :meth:`commit` commits them after their outputs are durable."""
        self.offsets.update(offsets)

    def commit(self) -> None:
        """Run the steps above.

        Once a checkpoint failed, every later one fails at once. The worker is stopping then, and Faust's
        shutdown commits offsets once more: a second flush would pass (the refused records are no longer
        queued), so the offsets of messages whose outputs never reached the broker would be committed.

        Raises:
            CheckpointError: a record could not be produced, an output was refused or not acknowledged in
                ``flush_timeout_s``, a store could not persist, or an earlier checkpoint failed. Nothing is
                committed; the stage must stop.
        """
        if self.failure is not None:
            raise CheckpointError(f"an earlier checkpoint failed, nothing more is committed: {self.failure}")
        started = time.perf_counter()
        self.produce()
        try:
            check_acknowledged(self.producer, self.producer.acknowledge(self.flush_timeout_s), self.flush_timeout_s)
            for store in self.stores:
                store.persist()
        except Exception as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
            raise CheckpointError(str(exc)) from exc
        if self._commit_offsets is not None and self.offsets:
            offsets, self.offsets = self.offsets, {}
            self._commit_offsets(offsets)
        if self.freeze_gc:
            self._freeze_gc()
        self.total_seconds += time.perf_counter() - started
        self.commits += 1

    async def prepare(self, timeout_s: float | None = None) -> None:
        """Steps 1 and 2 without holding the event loop: produce what is buffered, then serve the
        acknowledgements that came in, giving the loop :data:`PREPARE_POLL_S` in between, until none is
        outstanding or ``timeout_s`` (default ``flush_timeout_s``) has passed. What the stage produces
        meanwhile is produced and waited for too. Nothing is committed or persisted: :meth:`commit` follows,
        and finds little left to wait for. Refusals are raised by that commit."""
        if self.failure is not None:
            return
        deadline = time.monotonic() + (self.flush_timeout_s if timeout_s is None else timeout_s)
        while True:
            self.produce()
            if not self.producer.acknowledge(0) or time.monotonic() >= deadline:
                return
            await asyncio.sleep(PREPARE_POLL_S)

    async def commit_async(self) -> None:
        """:meth:`prepare`, then :meth:`commit`: a checkpoint for a coroutine."""
        await self.prepare()
        self.commit()

    def produce(self, stores: Iterable | None = None) -> int:
        """Step 1 alone: produce what is buffered (the ``produce`` callables, then every store's changelog
        records, in one go); returns how many.

        Args:
            stores: produce only these stores' changelog records (some of the checkpoint's ``stores``), not
                the ``produce`` callables: the agent's changelogs on two intervals (``--changelog-interval-s``
                and ``--global-changelog-interval-s``). None: everything, as :meth:`commit` does. Either way
                nothing is committed, and the next commit produces whatever is left.

        Raises:
            CheckpointError: a record could not be encoded or enqueued; it and the records after it stay
                buffered (so every later checkpoint fails too: the stage must stop).
        """
        calls = self._produce if stores is None else [store.produce_changelog for store in stores]
        try:
            return sum(produce() for produce in calls)
        except Exception as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
            raise CheckpointError(f"a buffered record could not be produced: {self.failure}") from exc

    #: The agent's name for :meth:`produce`: its buffered records are the tables' changelog records.
    produce_changelogs = produce

    @staticmethod
    def _freeze_gc() -> None:
        # Python's full collection scans every tracked object: with a memory store's rows it stopped the worker
        # for long pauses every few seconds, and freed almost nothing (rows are freed by reference
        # counting). Freezing moves what exists now out of the collector's sight, so each collection scans
        # only what was allocated since. The cost: cyclic garbage made before a freeze is never freed.
        gc.freeze()


def check_acknowledged(producer: Acknowledging, unacknowledged: int, timeout_s: float) -> None:
    """Step 2's verdict after ``producer.acknowledge(timeout_s)`` returned ``unacknowledged``.

    Raises:
        RuntimeError: records still unacknowledged, or refused by the broker (their messages' offsets must not
            be committed).
    """
    if unacknowledged:
        raise RuntimeError(f"{unacknowledged} outputs not acknowledged within {timeout_s:.0f} s")
    errors = producer.take_delivery_errors()
    if errors:
        raise RuntimeError(f"{len(errors)} outputs refused by the broker, first: {errors[0]}")


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
    """Runs the agent's checkpoint (:meth:`Checkpoint.commit`) whenever Faust is about to commit offsets.

    Faust calls ``on_commit_initiated`` synchronously at the start of every offset commit (the commit timer,
    rebalances, errors), before it picks the offsets of the acknowledged messages. A message is acknowledged
    only after the agent has finished it, and so has produced or buffered all its outputs. One checkpoint per
    commit (every ``broker_commit_interval``), not per message: each flush waits a broker round trip.

    This sensor is the only hook Faust gives before it picks the offsets to commit, and its API promises no
    order: the order is Faust's ``Consumer.force_commit`` as of the pinned version (the sensor first, then the
    pending acknowledgements). tests/unit/test_commit_sensor.py runs that method of the installed Faust and
    fails if an upgrade reads the acknowledgements before it calls the sensor.

    The hook is a plain function that ``force_commit`` calls and returns from before it reads the
    acknowledgements, without awaiting anything it returns: a coroutine started here would run only after
    Faust had committed the offsets. So the checkpoint cannot await here: its flush blocks the event loop, at
    most ``Checkpoint.flush_timeout_s``, for what is still unacknowledged; :func:`prepare_before_commits` has
    the commit wait for most of that first, with the loop free.

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


def prepare_before_commits(consumer, checkpoint: Checkpoint, crash: Callable[[BaseException], Awaitable],
                           wait_s: float = PRE_COMMIT_WAIT_S) -> None:
    """Make every ``consumer.commit()`` (Faust's commit timer, its commit every ``broker_commit_every``
    acknowledged messages, its rebalances) await :meth:`Checkpoint.prepare` for at most ``wait_s`` seconds
    before it starts, so that the synchronous checkpoint :class:`CommitSensor` then runs finds little left to
    wait for.

    Why: that checkpoint flushes with the event loop held (see :class:`CommitSensor`), and by then it has up to
    a ``--changelog-interval-s`` of changelog records to produce and, with the global tables', some 40
    partitions to write, five requests in flight at a time: at 10,000 events/s it held the agent for 6-60 ms
    every commit (bench/HISTORY.md, "2026-12-05 late morning"). Nothing of the protocol changes: the wait only
    produces and serves acknowledgements earlier, and between its last poll and the checkpoint nothing else
    runs (Faust's ``commit`` reaches the sensor without yielding when no other commit is running; when one is,
    it waits for that one). Under a steady load the agent produces something every millisecond, so the wait
    usually lasts the whole ``wait_s``, and the synchronous flush then waits for the last records, about one
    broker round trip. A commit that starts while another one waits may run a second checkpoint right after
    the first: one more flush and persist, nothing committed early.

    Args:
        consumer: the app's Faust consumer (``app.consumer``); its ``commit`` is replaced on this instance.
        checkpoint: the agent's checkpoint.
        crash: awaited with the error when producing fails (the app's ``crash``: the worker must stop), which is
            then raised, and nothing is committed.
        wait_s: at most this long per commit (seconds).
    """
    faust_commit = consumer.commit

    async def commit(*args, **kwargs):
        try:
            await checkpoint.prepare(wait_s)
        except CheckpointError as exc:
            log.error("stopping the worker: %s", exc)
            await crash(exc)
            raise
        return await faust_commit(*args, **kwargs)

    consumer.commit = commit


class GcPauses:
    """Collections of Python's cyclic GC in this process and the seconds they stopped it, per generation (0, 1,
    2), as the callback :func:`warn_on_long_gc_pauses` installs counts them (``kvstream_gc_pause_seconds``).

    Why: the collector stops every thread of the worker while it scans, and how often and how long depends on
    what the worker holds (its entry cache, a memory store's rows) and on :data:`GC_THRESHOLDS`; the count and
    the seconds per generation say what it costs a running worker, and let two runs be compared.
    """

    def __init__(self) -> None:
        #: Collections finished, by generation.
        self.collections = [0, 0, 0]
        #: Seconds they took (wall clock, ``time.perf_counter``), by generation.
        self.seconds = [0.0, 0.0, 0.0]


#: This process's collections (one collector per process).
GC_PAUSES = GcPauses()


def warn_on_long_gc_pauses(threshold_s: float = 0.2) -> None:
    """Count every collection of Python's cyclic GC in :data:`GC_PAUSES`, and log a warning when a full
    (generation 2) one stops the worker for longer than ``threshold_s`` seconds: it scans every object the worker
    holds, a memory store's rows included. Installed once per process, however many apps it builds."""
    if any(getattr(callback, "_kvstream_gc_pauses", False) for callback in gc.callbacks):
        return
    started = [0.0]
    pauses = GC_PAUSES

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        paused = time.perf_counter() - started[0]
        generation = info["generation"]
        pauses.collections[generation] += 1
        pauses.seconds[generation] += paused
        if generation == 2 and paused > threshold_s:
            log.warning("a full Python GC stopped the worker for %.2f s (%d objects freed)", paused,
                        info["collected"])

    on_gc._kvstream_gc_pauses = True
    gc.callbacks.append(on_gc)
