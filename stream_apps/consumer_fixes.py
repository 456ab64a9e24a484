"""Three corrections to faust-streaming 0.15.3 (its aiokafka driver, and mode's flow control) that keep a
rebalance from skipping messages, one to its offset commit that keeps a restart from committing one offset
per commit interval or past messages not yet applied, one setting of its consumer that Faust does not
expose, the changelog partitions it pauses paused in aiokafka too, and its hand-off of each fetched message
without four tasks.

The two sequences below, which the corrections close, were found by ``make chaos``'s rebalance scenario, which
lost rows about once in six runs, with or without standby replicas (docs/operations.md, "Standby replicas"). The
sequence that lost them:

1. A partition of the re-keyed topic has no committed offset yet (Faust drops its acknowledged offsets when
   partitions are revoked, before it commits them), and a message arrives on it while the worker recovers
   its tables after a rebalance.
2. When recovery ends Faust pauses its changelog partitions. With no standby partitions to resume, its set
   of active partitions is empty for a moment, and Faust hands that (live, mutable) set to aiokafka's
   ``fetched_records``, which reads an empty set as *every* partition. The message is fetched and aiokafka's
   position moves past it; Faust drops it because its partition is not active.
3. Faust then seeks each partition to its committed offset, but aiokafka only seeks partitions that have one
   above 0, so the position stays past the message and the message is never applied.

A second sequence lost rows the same way, with committed offsets: at the end of a recovery Faust resumes the
stream partitions, awaits the seek to their committed offsets (the fetcher keeps running, and a message can
reach the agent's queue meanwhile, moving Faust's read offset past it), then calls
``flow_control.resume()``, which in mode empties every agent queue on every call, suspended before or not. A
message dropped there is never acknowledged; when it is the first after the committed offset, Faust's gap
check (``min(acked) - committed > 1``) lets the next commit pass it.

The corrections:

- :func:`_fetch_records` (Faust's ``AIOKafkaConsumerThread``): fetch with a snapshot of the active set, and
  nothing at all when it is empty; nor any partition of a topic another reader takes
  (:class:`stream_apps.rekeyed_reader.RekeyedReader`, which follows this consumer);
- :func:`_seek_to_committed` (the same class): a stream partition with no committed offset goes to its
  beginning (what ``consumer_auto_offset_reset="earliest"`` means); the events read again are ignored as
  duplicates;
- :func:`_new_offset` (Faust's ``Consumer``): the offset to commit, with every offset counted once and no gap
  counted past the highest acknowledged offset (see "The commit" below);
- :func:`_resume_flow_control` (mode's ``FlowControlEvent.resume``): empty the queues only when flow was
  suspended. Stale events of a previous assignment are still dropped: Faust clears the queues when
  partitions are revoked, the first resume after a suspend clears them, and streams skip messages of
  another generation.

The commit: Faust's consumer keeps, per partition, a list of acknowledged offsets and a set of "gaps" (offsets
it will never see: compacted away, transaction markers), and commits the first run of consecutive offsets
after filling the gaps into the list. Its gap check trips on its own seek too: at the end of a recovery it
seeks the stream partitions to their committed offsets while the fetcher keeps delivering, and the reset of
its read offset makes the next message delivered look like a jump past every message delivered meanwhile. It
records those as a gap (the new message included), and drops their redelivery after the seek. Two faults
followed:

- The gap's messages are acknowledged too, so filling the gap put each of them in the list a second time, and
  Faust's run of consecutive offsets stopped at the first duplicate: every commit moved the partition one
  offset further. ``make chaos``'s crash run on seed 5 waited 140-200 s, 55 offsets at one per
  ``broker_commit_interval`` (2.8 s), for a restarted worker to commit what it had applied in seconds.
- Filling the whole gap counts as done the messages still queued for the agent; a crash after such a commit
  would lose them. The crawl above made that window rare.

:func:`_new_offset` is Faust's with each offset counted once, and a gap filled only up to the highest
acknowledged offset.

The setting: Faust builds its aiokafka consumer with ``fetch_max_wait_ms=1500``. aiokafka sends one fetch
request per broker at a time, for the partitions that have no fetched records waiting, so a request for
partitions that receive nothing holds back the next fetch of those that do until the broker gives up on it:
the agent then sat idle for 1-1.5 s with messages waiting on the broker, at low rates (bench latency step) and
on a backlog alike (several times per run of the whole trace). :func:`_create_worker_consumer` lowers the wait
to :data:`FETCH_MAX_WAIT_MS`.

The pause: Faust pauses a partition in its own books only, so aiokafka kept asking the broker for the
partitioned tables' changelogs (which Faust reads only in a recovery) in every fetch request of the agent's
consumer. :func:`_on_recovery_completed` pauses them in aiokafka as well once a recovery is over, and
:func:`_resume_partitions` resumes them there when Faust does. At 10,000 events/s a request went from 41
partitions to 25 and the worker used 2-4% less CPU (bench/HISTORY.md, "2026-12-05 morning").

The hand-off: Faust's drain loop passes every fetched message to the conductor (which queues it for the agent or
a table) through mode's ``Service.wait_first(conductor(message), suspend_flow.wait())``, so that a rebalance can
abandon a hand-off blocked on a full queue. ``wait_first`` wraps the two coroutines and the service's ``stopped``
and ``crashed`` events in four tasks, waits for the first to finish and cancels the other three: several rounds
of the event loop per message, for a conductor call that nearly always finishes without waiting. At low rates
the agent takes hundreds of small batch messages a second, and each one's hand-off stood between it and the
previous one (bench/HISTORY.md, "2026-12-05 midday"). :func:`_wait_first` runs the first coroutine's first step
at once; if it finishes, that is the result ``wait_first`` would have given (nothing else could finish first:
the flow was not suspended, the service neither stopped nor crashed, and nothing ran in between). If it waits,
the rest of it and the other coroutine go to ``wait_first`` as before. Two things change: the drain loop now
yields to the event loop only every 100 messages (its own ``sleep(0)``) and between fetches, not at every message,
so a rebalance's ``stop_flow`` may wait for one such burst of hand-offs, as it could already wait for one; and the
first step runs in the drain loop's task and context, not a copy (nothing on the conductor's path reads the
current task or sets a context variable).

:func:`install` applies them once per process; ``pyproject.toml`` pins the faust-streaming and
mode-streaming versions they were written against, and both are checked.
"""

from __future__ import annotations

import asyncio
import logging
import types
from importlib.metadata import version

from aiokafka import TopicPartition
from faust.tables.recovery import Recovery
from faust.transport import consumer as faust_consumer
from faust.transport.drivers import aiokafka as driver
from faust.types.tuples import ack_lock
from mode.services import WaitResults
from mode.utils.queues import FlowControlEvent

log = logging.getLogger(__name__)

#: The faust-streaming and mode-streaming versions whose methods these replace.
FAUST_VERSION = "0.15.3"
MODE_VERSION = "0.7.1"

_original_fetch_records = driver.AIOKafkaConsumerThread._fetch_records
#: Faust's own commit offset choice. Not called here: tests/unit/test_consumer_fixes.py runs it on the state a
#: recovery's seek leaves, to show the stall :func:`_new_offset` removes.
_original_new_offset = faust_consumer.Consumer._new_offset
_original_resume = FlowControlEvent.resume


async def _fetch_records(self, consumer, active_partitions, timeout=None, max_records=None):
    """Faust's fetch, with a frozen copy of the active partitions, and no fetch when there are none (aiokafka
    would read an empty set as every assigned partition). Partitions of a topic another reader takes (Faust's
    consumer's ``_topics_read_elsewhere``, set by :meth:`stream_apps.rekeyed_reader.RekeyedReader.install`) are
    never handed to Faust's streams; when nothing else is active, the call waits out its timeout (at most a
    second) rather than return at once into a loop that would call it again."""
    elsewhere = getattr(self.consumer, "_topics_read_elsewhere", None)
    active = frozenset(tp for tp in active_partitions if tp.topic not in elsewhere) if elsewhere else \
        frozenset(active_partitions)
    if not active:
        if elsewhere and active_partitions:
            await asyncio.sleep(min(timeout or 0.0, 1.0))
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


def _resume_flow_control(self) -> None:
    """mode's ``FlowControlEvent.resume``, which empties the agents' queues only when flow was suspended."""
    if self._suspend.is_set():
        _original_resume(self)


def _new_offset(self, tp):
    """The next offset to commit for ``tp``, or None: Faust's ``Consumer._new_offset`` with each offset counted
    once, and a gap counted as done only up to the highest acknowledged offset.

    As Faust's: gaps join the acknowledged offsets; if the lowest is more than one past the committed offset,
    nothing is committed (Faust's rule, kept as it is); otherwise the first run of consecutive offsets is taken
    off the list and its last + 1 returned. Unlike Faust's:

    - an offset both acknowledged and filled from a gap is one entry, so the run goes on past it;
    - the part of a gap above the highest acknowledged offset stays a gap until acknowledgements pass it.
      Faust filled the whole gap, and its gap includes the message whose arrival recorded it: after a
      recovery's seek, the messages queued for the agent but not yet applied. Faust's one-offset-per-commit
      crawl used to hide that; committing at once past them would lose them at a crash. The agent's one stream
      acknowledges in offset order, so every gap offset below the highest acknowledged one was delivered and
      applied (or is a real hole: compacted away, a transaction marker), and a real hole is filled entirely
      once the message after it is acknowledged.

    Held under Faust's ``ack_lock``, as its ``ack`` is: the list is rebuilt here, and an acknowledgement from
    another thread in between would be lost.
    """
    with ack_lock:
        acked = self._acked[tp]
        if not acked:
            return None
        gaps = self._gap[tp]
        if gaps:
            highest = max(acked)
            for interval in gaps.overlap(0, highest + 1):
                acked.extend(range(interval.begin, min(interval.end, highest + 1)))
            gaps.chop(0, highest + 1)
        acked[:] = sorted(set(acked))
        committed = self._committed_offset[tp]
        if committed and acked[0] - committed > 1:
            return None
        run = 1
        while run < len(acked) and acked[run] == acked[run - 1] + 1:
            run += 1
        batch = acked[:run]
        del acked[:run]
        self._acked_index[tp].difference_update(batch)
        return batch[-1] + 1


_original_create_worker_consumer = driver.AIOKafkaConsumerThread._create_worker_consumer

#: Longest a fetch request of the agent's consumer waits at the broker for data (Faust: 1500 ms). It bounds
#: how long such a request holds back the partitions that do receive data. Shorter costs CPU: with 20 ms the
#: worker spent about 3 us more per event on the empty fetches of partitions without news, for no gain in
#: latency once the repartition batches adapt. On the whole trace (bench.profile_worker, RocksDB) the agent
#: waited 4.5 s for messages in waits of 0.1 s or more with 1500 ms, 1.2 s with 100 ms.
FETCH_MAX_WAIT_MS = 100


def _create_worker_consumer(self, transport):
    """Faust's consumer, whose fetch requests wait at most :data:`FETCH_MAX_WAIT_MS` at the broker."""
    consumer = _original_create_worker_consumer(self, transport)
    consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS
    return consumer


_original_on_recovery_completed = Recovery.on_recovery_completed
_original_resume_partitions = faust_consumer.Consumer.resume_partitions


async def _on_recovery_completed(self, generation_id: int = 0) -> None:
    """Faust's end of a recovery; then the changelog partitions it keeps paused in its own books
    (``Consumer._paused_partitions``) are paused in aiokafka too, through the consumer's thread, where aiokafka
    runs (the module docstring, "The pause", says why). aiokafka asks for a partition in every fetch request
    until records of it sit in its buffer, which Faust then never takes.

    A rebalance gives aiokafka a new assignment, whose partitions start unpaused, so this never outlives the
    assignment it was made for; :func:`_resume_partitions` undoes it if Faust resumes one of them before.
    """
    await _original_on_recovery_completed(self, generation_id)
    if self.app.consumer_generation_id == generation_id:
        await stop_fetching_paused_changelogs(self.app.consumer, self._is_changelog_tp)


async def stop_fetching_paused_changelogs(consumer, is_changelog) -> set:
    """Pause in aiokafka the partitions ``consumer`` (Faust's) has paused in its books and ``is_changelog(tp)``
    says are changelog partitions; returns them. :func:`_on_recovery_completed` calls it after each recovery."""
    idle = {tp for tp in consumer._paused_partitions if is_changelog(tp)}
    if idle:
        # Only added to, across rebalances (a resume takes its partitions out): aiokafka installs a new assignment
        # before Faust learns of its generation, so this pause can land on the next assignment's partitions, and
        # then it is Faust's resumes in the next recovery, mirrored through this set, that fetch them again
        paused = consumer.__dict__.setdefault("_fetch_paused", set())
        paused |= idle
        await pause_fetching(consumer, idle)
    return idle


async def pause_fetching(consumer, tps) -> None:
    """Make aiokafka stop fetching ``tps`` for ``consumer`` (Faust's), in its thread; Faust's own books are left
    as they are. Those no longer assigned there are skipped."""
    if tps:
        thread = consumer._thread
        await thread.call_thread(_set_fetching, thread._ensure_consumer(), tps, False)


def _resume_partitions(self, tps) -> None:
    """Faust's ``resume_partitions``, and aiokafka's for those :func:`_on_recovery_completed` paused there,
    queued to the consumer's thread after that pause."""
    tps = set(tps)
    _original_resume_partitions(self, tps)
    paused = getattr(self, "_fetch_paused", None)
    if paused and not paused.isdisjoint(tps):
        back = paused & tps
        paused -= back
        thread = self._thread
        task = asyncio.ensure_future(thread.call_thread(_set_fetching, thread._ensure_consumer(), back, True))
        _resuming.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(_resumed)


#: The aiokafka resumes queued by :func:`_resume_partitions` and not done yet.
_resuming: set[asyncio.Future] = set()


def _resumed(task: asyncio.Future) -> None:
    _resuming.discard(task)
    if not task.cancelled() and task.exception() is not None:  # the recovery waiting for them would hang
        log.error("could not resume changelog partitions in aiokafka: %r", task.exception())


def _set_fetching(client, tps, fetch: bool) -> None:
    """In the consumer's thread: aiokafka fetches ``tps`` again (``fetch``) or stops fetching them, those of
    them still assigned."""
    assigned = client.assignment()
    partitions = [TopicPartition(tp.topic, tp.partition) for tp in tps if tp in assigned]
    (client.resume if fetch else client.pause)(*partitions)


_original_wait_first = faust_consumer.Consumer.wait_first


async def _wait_first(self, *coros, timeout=None):
    """mode's ``Service.wait_first`` on Faust's consumer, without its tasks when the first of two coroutines
    finishes in its first step (the module docstring, "The hand-off"). Returns mode's ``WaitResults``; the first
    coroutine's exception propagates, as mode's does."""
    if (len(coros) != 2 or timeout is not None or not all(asyncio.iscoroutine(coro) for coro in coros)
            or self.suspend_flow.is_set() or self._stopped.is_set() or self._crashed.is_set()):
        return await _original_wait_first(self, *coros, timeout=timeout)
    first, other = coros
    try:
        waiting_on = first.send(None)
    except StopIteration as finished:
        other.close()  # never started: closing it spares the "never awaited" warning
        return WaitResults([first], [finished.value], False)
    except BaseException:
        other.close()
        raise
    return await _original_wait_first(self, _go_on(first, waiting_on), other)


async def _go_on(coro, waiting_on):
    """``coro``, whose first step already ran and gave ``waiting_on``, run on to its end (in the task mode's
    ``wait_first`` makes of this coroutine)."""
    return await _continue(coro, waiting_on)


@types.coroutine
def _continue(coro, waiting_on):
    """Delegate to ``coro`` from where it stopped, as ``await coro`` would have from its start: what it waits on
    goes up to the task, and what the task sends or throws (a cancellation) goes down to it."""
    while True:
        try:
            sent = yield waiting_on
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:
            try:
                waiting_on = coro.throw(exc)
            except StopIteration as finished:
                return finished.value
        else:
            try:
                waiting_on = coro.send(sent)
            except StopIteration as finished:
                return finished.value


def install() -> None:
    """Replace the eight methods (idempotent).

    Raises:
        RuntimeError: another faust-streaming or mode-streaming version is installed; the corrections must be
            checked against it.
    """
    for package, pinned in (("faust-streaming", FAUST_VERSION), ("mode-streaming", MODE_VERSION)):
        if version(package) != pinned:
            raise RuntimeError(f"stream_apps.consumer_fixes was written for {package} {pinned}, not "
                               f"{version(package)}: check whether it still needs them")
    driver.AIOKafkaConsumerThread._fetch_records = _fetch_records
    driver.AIOKafkaConsumerThread.seek_to_committed = _seek_to_committed
    FlowControlEvent.resume = _resume_flow_control
    driver.AIOKafkaConsumerThread._create_worker_consumer = _create_worker_consumer
    faust_consumer.Consumer._new_offset = _new_offset
    Recovery.on_recovery_completed = _on_recovery_completed
    faust_consumer.Consumer.resume_partitions = _resume_partitions
    faust_consumer.Consumer.wait_first = _wait_first
