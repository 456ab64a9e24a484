"""The corrections of stream_apps.consumer_fixes, each on the real objects it corrects.

The commit correction runs on a worker app's Faust consumer, set to the state a restarted worker showed.

The flow-control correction runs on mode's own ``FlowControlEvent`` and ``FlowControlQueue``. The driver's run on
a started Faust ``AIOKafkaConsumerThread`` of a worker app (its own aiokafka consumer, in its own thread and
loop) reading the session's broker: partitions are assigned, not subscribed, so no rebalance decides what the
consumer reads, and every wait is for a state of aiokafka's fetcher, not for time (those tests are marked
``integration``). tests/chaos and ``make chaos`` run the rebalances that found the lost rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
import warnings
from functools import partial

import faust
import pytest
from aiokafka import TopicPartition
from confluent_kafka import Producer
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
from mode.utils.queues import FlowControlEvent, FlowControlQueue

from kafka_io.admin import ensure_topics
from kafka_io.config import client_config
from stream_apps import consumer_fixes

#: Seconds any one wait for the broker or aiokafka's fetcher may take before the test fails.
WAIT_S = 30.0


def test_resuming_an_active_flow_keeps_the_messages_an_agent_has_not_taken_yet():
    consumer_fixes.install()

    async def scenario() -> tuple[int, int]:
        flow = FlowControlEvent(initially_suspended=False)
        queue = FlowControlQueue(flow_control=flow, clear_on_resume=True)
        queue.put_nowait("a message fetched during the seek")
        flow.resume()  # what Faust's recovery calls at its end, while the flow is already active
        kept = queue.qsize()
        flow.suspend()
        flow.resume()  # after a real suspension, stale messages are still dropped
        return kept, queue.qsize()

    assert asyncio.run(scenario()) == (1, 0)


def _worker_consumer():
    """A worker app's Faust consumer, never started, with the corrections installed."""
    consumer_fixes.install()
    return faust.App(f"kvstream-test-fixes-{uuid.uuid4().hex}", broker="kafka://127.0.0.1:9").consumer


def _after_a_recovery_seek(applied_to: int = 140):
    """A worker's consumer in the state a worker restarted by ``make chaos``'s crash scenario showed on a
    partition of the re-keyed topic: 84 committed, offsets 84 to ``applied_to`` applied and acknowledged, and
    the gap Faust recorded when message 129 arrived just after the recovery's seek had reset its read offset to
    84 (``_add_gap(tp, 85, 129)``: 85-129, the new message included). Returns ``(consumer, tp)``."""
    consumer = _worker_consumer()
    tp = TopicPartition("kv-events-by-ownership", 2)
    consumer._committed_offset[tp] = 84
    consumer._acked[tp].extend(range(84, applied_to + 1))
    consumer._acked_index[tp].update(range(84, applied_to + 1))
    asyncio.run(consumer._add_gap(tp, 85, 129))
    return consumer, tp


def test_a_commit_after_a_recovery_seek_takes_every_acknowledged_offset_at_once():
    consumer, tp = _after_a_recovery_seek()
    assert consumer._new_offset(tp) == 141
    assert (consumer._acked[tp], consumer._acked_index[tp], len(consumer._gap[tp])) == ([], set(), 0)


def test_faust_own_commit_after_a_recovery_seek_moves_one_offset_per_commit():
    # why _new_offset is replaced: the gap's offsets, counted a second time, end every run after two offsets
    consumer, tp = _after_a_recovery_seek()
    commits = []
    for _ in range(3):
        commits.append(consumer_fixes._original_new_offset(consumer, tp))
        consumer._committed_offset[tp] = commits[-1]  # what Faust's commit does once the broker took it
    assert commits == [86, 87, 88]


def test_a_gap_counts_as_done_only_up_to_the_highest_acknowledged_offset():
    # 101-129 were delivered to the agent's queue before the seek, and not applied yet
    faust_consumer, faust_tp = _after_a_recovery_seek(applied_to=100)
    commits = []
    for _ in range(40):  # Faust crawls through its duplicates, then commits past what was not applied
        commits.append(consumer_fixes._original_new_offset(faust_consumer, faust_tp))
        faust_consumer._committed_offset[faust_tp] = commits[-1] or faust_consumer._committed_offset[faust_tp]
    assert commits[:3] == [86, 87, 88] and max(c or 0 for c in commits) == 130
    consumer, tp = _after_a_recovery_seek(applied_to=100)
    assert consumer._new_offset(tp) == 101
    consumer._committed_offset[tp] = 101
    assert sorted((i.begin, i.end) for i in consumer._gap[tp]) == [(101, 130)]  # the rest waits
    consumer._acked[tp].extend(range(101, 116))  # the agent applies 101-115
    assert consumer._new_offset(tp) == 116
    consumer._committed_offset[tp] = 116
    consumer._acked[tp].extend(range(116, 131))
    assert consumer._new_offset(tp) == 131
    assert len(consumer._gap[tp]) == 0


def test_a_hole_in_the_topic_counts_as_done_once_the_message_after_it_is_acknowledged():
    consumer = _worker_consumer()
    tp = TopicPartition("kv-events-by-ownership", 0)
    consumer._committed_offset[tp] = 10
    asyncio.run(consumer._add_gap(tp, 11, 13))  # read offset 10, then message 13: 11-12 were compacted away
    assert consumer._new_offset(tp) is None  # nothing acknowledged yet: 13 is being applied
    consumer._acked[tp].append(13)
    assert consumer._new_offset(tp) == 14
    consumer._committed_offset[tp] = 14
    consumer._acked[tp].extend([15, 16, 18])  # 14 not acknowledged, 17 neither: Faust's tolerance of one, then
    assert consumer._new_offset(tp) == 17     # the run stops at the missing 17
    assert consumer._acked[tp] == [18]


@contextlib.contextmanager
def _consumer_in_this_loop():
    """:func:`_worker_consumer`, made in the running loop (mode's ``wait_first`` makes its tasks on the consumer's
    loop); the event loop of its never-started thread is closed on exit."""
    consumer = _worker_consumer()
    try:
        yield consumer
    finally:
        consumer._thread.thread_loop.close()


class _HandOff:
    """A stand-in for Faust's conductor call on one message: it runs to its end at once, or waits for
    :attr:`room` first (a full queue), and records what became of it."""

    def __init__(self) -> None:
        self.room: asyncio.Future | None = None
        self.ended: list[str] = []

    async def __call__(self, message: str, wait: bool = False) -> str:
        try:
            if wait:
                self.room = asyncio.get_running_loop().create_future()
                await self.room
            return f"queued {message}"
        except asyncio.CancelledError:
            self.ended.append(f"cancelled {message}")
            raise
        finally:
            self.ended.append(f"ended {message}")


def test_a_hand_off_that_finishes_at_once_gives_wait_first_result_without_a_task():
    hand_off = _HandOff()

    async def scenario():
        with _consumer_in_this_loop() as consumer:
            tasks_before = len(asyncio.all_tasks())
            result = await consumer.wait_first(hand_off("m1"), consumer.suspend_flow.wait())
            return result, len(asyncio.all_tasks()) - tasks_before

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unawaited suspend_flow.wait() would warn
        (winners, results, stopped), new_tasks = asyncio.run(scenario())
    assert (len(winners), results, stopped, new_tasks) == (1, ["queued m1"], False, 0)
    assert hand_off.ended == ["ended m1"]


def test_a_hand_off_that_waits_goes_on_from_where_it_stopped_until_it_finishes():
    hand_off = _HandOff()

    async def scenario():
        with _consumer_in_this_loop() as consumer:
            waiting = asyncio.ensure_future(consumer.wait_first(hand_off("m2", wait=True),
                                                                consumer.suspend_flow.wait()))
            await asyncio.sleep(0.01)
            assert not waiting.done() and hand_off.ended == []
            hand_off.room.set_result(None)
            return await asyncio.wait_for(waiting, WAIT_S)

    winners, results, stopped = asyncio.run(scenario())
    assert (len(winners), results, stopped) == (1, ["queued m2"], False)
    assert hand_off.ended == ["ended m2"]


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "mode's own"])
def test_a_rebalance_abandons_a_waiting_hand_off_as_faust_own_wait_does(fixed):
    hand_off = _HandOff()

    async def scenario():
        with _consumer_in_this_loop() as consumer:
            wait_first = consumer.wait_first if fixed else partial(consumer_fixes._original_wait_first, consumer)
            waiting = asyncio.ensure_future(wait_first(hand_off("m3", wait=True), consumer.suspend_flow.wait()))
            await asyncio.sleep(0.01)
            consumer.stop_flow()  # what Faust's rebalance does first: suspend_flow is set
            result = await asyncio.wait_for(waiting, WAIT_S)
            await asyncio.sleep(0)  # the cancellation reaches the hand-off
            return result

    winners, results, stopped = asyncio.run(scenario())
    assert (len(winners), results, stopped) == (1, [True], False)  # the flow's event won
    assert hand_off.ended == ["cancelled m3", "ended m3"]


def test_a_hand_off_error_reaches_the_drain_loop_and_a_suspended_flow_takes_faust_own_path():
    async def refuse(message: str) -> None:
        raise ValueError(f"cannot decode {message}")

    async def scenario():
        with _consumer_in_this_loop() as consumer:
            with pytest.raises(ValueError, match="cannot decode m4"):
                await consumer.wait_first(refuse("m4"), consumer.suspend_flow.wait())
            consumer.stop_flow()
            hand_off = _HandOff()
            # suspended: mode's own wait_first, where the suspended flow's event is a winner too
            _, results, _ = await consumer.wait_first(hand_off("m5", wait=True), consumer.suspend_flow.wait())
            await asyncio.sleep(0)
            return results, hand_off.ended

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unawaited suspend_flow.wait() would warn
        assert asyncio.run(scenario()) == ([True], ["cancelled m5", "ended m5"])


@pytest.mark.parametrize("seed", range(20))
def test_without_duplicates_or_a_gap_past_the_acknowledged_offsets_the_commit_is_faust_own(seed):
    states = []
    for _ in range(2):
        rng_copy = random.Random(seed)
        consumer = _worker_consumer()
        tp = TopicPartition("kv-events-by-ownership", 0)
        committed = rng_copy.randrange(0, 5)
        consumer._committed_offset[tp] = committed or None
        offsets = sorted(rng_copy.sample(range(committed, committed + 40), 25))
        holes = [o for o in range(committed + 1, max(offsets)) if o not in offsets]
        gap = sorted(rng_copy.sample(holes, min(len(holes), 6)))
        consumer._acked[tp].extend(rng_copy.sample(offsets, len(offsets)))  # acknowledged in any order
        consumer._acked_index[tp].update(offsets)
        for offset in gap:
            consumer._gap[tp].addi(offset, offset + 1)
        consumer._gap[tp].merge_overlaps()
        states.append((consumer, tp))
    answers = []
    for (consumer, tp), new_offset in zip(states, (consumer_fixes._original_new_offset, consumer_fixes._new_offset)):
        answers.append((new_offset(consumer, tp), sorted(consumer._acked[tp]), consumer._acked_index[tp],
                        sorted((i.begin, i.end) for i in consumer._gap[tp])))
    assert answers[0] == answers[1]


# -- the driver's corrections, on the session's broker ---------------------------------------------------------


@contextlib.asynccontextmanager
async def _worker_thread(bootstrap: str, partitions: int = 2):
    """A started consumer thread of a new worker app with one table, assigned every partition of a new topic
    (``partitions`` of them) and of the table's changelog topic (one), all read from their beginning.

    Yields ``(thread, stream, changelog)``: the ``AIOKafkaConsumerThread``, the topic's partitions in order, and
    the changelog's partition. The thread is stopped on exit.
    """
    consumer_fixes.install()
    app = faust.App(f"kvstream-test-fixes-{uuid.uuid4().hex}", broker=f"kafka://{bootstrap}")
    app.Table("residency", default=int)
    (changelog_topic,) = app.tables.changelog_topics
    topic = f"kvstream-test-fixes-{uuid.uuid4().hex}"
    ensure_topics(bootstrap, {topic: partitions, changelog_topic: 1})
    stream = [TopicPartition(topic, p) for p in range(partitions)]
    changelog = TopicPartition(changelog_topic, 0)
    thread = app.consumer._thread
    await thread.start()
    try:
        consumer = thread._ensure_consumer()
        # in the thread's loop: aiokafka starts its commit-refresh task in the loop that assigns
        await thread.call_thread(consumer.assign, [*stream, changelog])
        await thread.seek_to_beginning(*stream, changelog)
        yield thread, stream, changelog
    finally:
        await thread.stop()


def _produce(bootstrap: str, *partitions: TopicPartition) -> None:
    """One message on each of ``partitions``, acknowledged by the broker."""
    producer = Producer(client_config(bootstrap))
    for tp in partitions:
        producer.produce(tp.topic, b"a row", partition=tp.partition)
    assert producer.flush(WAIT_S) == 0


async def _until(condition, what: str) -> None:
    """Wait (up to :data:`WAIT_S`) until ``condition()`` is true; fails the test with ``what`` otherwise."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not condition():
        if loop.time() > deadline:
            pytest.fail(f"{what} not within {WAIT_S} s")
        await asyncio.sleep(0.01)


def _buffered(thread: AIOKafkaConsumerThread, tp: TopicPartition):
    """A condition: aiokafka's fetcher holds records of ``tp`` that no fetch has taken yet."""
    return lambda: tp in thread._ensure_consumer()._fetcher._records


async def _read(thread: AIOKafkaConsumerThread, tps: set[TopicPartition], count: int) -> int:
    """Fetch (through Faust's ``getmany``) until ``count`` messages of ``tps`` came; returns how many came."""
    loop = asyncio.get_running_loop()
    deadline, read = loop.time() + WAIT_S, 0
    while read < count and loop.time() < deadline:
        batch = await thread.getmany(set(tps), timeout=1.0)
        read += sum(len(records) for records in batch.values())
    return read


@pytest.mark.integration
def test_a_fetch_while_no_partition_is_active_takes_no_message(kafka_bootstrap):
    async def scenario():
        async with _worker_thread(kafka_bootstrap) as (thread, (_, other), _):
            _produce(kafka_bootstrap, other)
            await _until(_buffered(thread, other), "aiokafka fetching the message")
            # Faust's set of active partitions, empty a moment at the end of a recovery
            fetched = await thread.getmany(set(), timeout=0)
            position = await thread.position(other)
            return fetched, position, await _read(thread, {other}, 1)

    fetched, position, read_later = asyncio.run(scenario())
    assert fetched == {}  # aiokafka reads an empty set as every partition
    assert position == 0  # aiokafka's position did not move past the message
    assert read_later == 1


@pytest.mark.integration
def test_pausing_every_active_partition_while_a_fetch_waits_does_not_open_it_to_the_others(kafka_bootstrap):
    async def scenario():
        async with _worker_thread(kafka_bootstrap) as (thread, (active, other), _):
            fetcher = thread._ensure_consumer()._fetcher
            live = {active}  # Faust hands its own set to the fetch, and changes it as it pauses and resumes
            fetch = asyncio.create_task(thread.getmany(live, timeout=WAIT_S))
            await _until(lambda: fetcher._fetch_waiters, "the fetch waiting for records")
            live.clear()  # Faust's recovery pausing its partitions while the fetch waits
            _produce(kafka_bootstrap, other)
            await _until(lambda: _buffered(thread, other)() or fetch.done(), "aiokafka fetching the message")
            if not fetch.done():
                _produce(kafka_bootstrap, active)  # ends a fetch that kept its partitions, before its timeout
            fetched = await asyncio.wait_for(fetch, WAIT_S)
            return sorted(tp.partition for tp in fetched), await thread.position(other), await _read(thread, {other}, 1)

    fetched_partitions, position, read_later = asyncio.run(scenario())
    assert fetched_partitions == [0]  # the active one only: the fetch kept the partitions it was given
    assert position == 0
    assert read_later == 1


@pytest.mark.integration
def test_a_stream_partition_without_committed_offset_is_read_from_its_beginning_after_recovery(kafka_bootstrap):
    async def scenario():
        async with _worker_thread(kafka_bootstrap) as (thread, (never_committed, committed), changelog):
            _produce(kafka_bootstrap, never_committed, committed, committed, changelog)
            assert await _read(thread, {never_committed, committed, changelog}, 4) == 4
            await thread.call_thread(thread._ensure_consumer().commit, {committed: 1})
            offsets = await thread.seek_to_committed()  # what Faust does at the end of a recovery
            return ([offsets[tp] for tp in (never_committed, committed, changelog)],
                    [await thread.position(tp) for tp in (never_committed, committed, changelog)])

    offsets, (never_committed, committed, changelog) = asyncio.run(scenario())
    assert offsets == [None, 1, None]
    assert never_committed == 0  # read again from its beginning; Faust drops what it has already seen
    assert committed == 1
    assert changelog == 1  # a changelog's position is the table recovery's to set, not this seek's


@pytest.mark.integration
def test_the_worker_consumer_asks_the_broker_to_wait_at_most_fetch_max_wait_ms(kafka_bootstrap):
    async def scenario():
        async with _worker_thread(kafka_bootstrap) as (thread, _, _):
            # the fetcher aiokafka's start built: it puts its wait in every fetch request it sends
            return thread._ensure_consumer()._fetcher._fetch_max_wait_ms

    assert asyncio.run(scenario()) == consumer_fixes.FETCH_MAX_WAIT_MS


async def _fetched_past(thread: AIOKafkaConsumerThread, stream_tp: TopicPartition, bootstrap: str) -> None:
    """Produce to ``stream_tp`` and read it: a fetch round went by after whatever was produced before."""
    _produce(bootstrap, stream_tp)
    assert await _read(thread, {stream_tp}, 1) == 1


@pytest.mark.integration
def test_a_changelog_partition_faust_keeps_paused_is_not_fetched_until_faust_resumes_it(kafka_bootstrap):
    async def scenario():
        async with _worker_thread(kafka_bootstrap) as (thread, (stream_tp, _), changelog):
            consumer, client = thread.consumer, thread._ensure_consumer()  # Faust's, aiokafka's
            consumer.pause_partitions({changelog})  # in Faust's books, as after a recovery
            paused = await consumer_fixes.stop_fetching_paused_changelogs(
                consumer, lambda tp: tp.topic == changelog.topic)
            paused_in_aiokafka = await thread.call_thread(client.paused)
            _produce(kafka_bootstrap, changelog)
            await _fetched_past(thread, stream_tp, kafka_bootstrap)  # the stream partitions are fetched meanwhile
            consumer.resume_partitions({changelog})
            only_the_changelog = {(tp.topic, tp.partition) for tp in paused_in_aiokafka} == {tuple(changelog)}
            return paused == {changelog}, only_the_changelog, await _read(thread, {changelog}, 1)

    paused_the_changelog, only_the_changelog_in_aiokafka, read_after_resume = asyncio.run(scenario())
    assert paused_the_changelog
    assert only_the_changelog_in_aiokafka  # not in aiokafka's fetch requests; the stream partitions still are
    assert read_after_resume == 1  # Faust's resume reached aiokafka: what arrived meanwhile is read


@pytest.mark.integration
def test_a_changelog_pause_ends_with_its_assignment(kafka_bootstrap):
    async def scenario():
        async with _worker_thread(kafka_bootstrap) as (thread, stream, changelog):
            consumer = thread.consumer
            consumer.pause_partitions({changelog})
            await consumer_fixes.stop_fetching_paused_changelogs(consumer, lambda tp: tp.topic == changelog.topic)
            # a rebalance: aiokafka's new assignment starts with every partition fetched; Faust's recovery then
            # reads the changelog before it pauses it again
            client = thread._ensure_consumer()
            await thread.call_thread(client.assign, [*stream, changelog])
            await thread.seek_to_beginning(changelog)
            _produce(kafka_bootstrap, changelog)
            return await _read(thread, {changelog}, 1)

    assert asyncio.run(scenario()) == 1
