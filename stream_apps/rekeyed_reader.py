"""The re-keyed topic read by a librdkafka consumer of the worker's own, for the materializing agent.

Faust reads every topic of the app through aiokafka, in a thread of its own: each fetch request is built and each
response decoded in Python, and each batch of records crosses to the event loop through mode's method queue.
At 10,000 events/s that thread alone took about a quarter of the worker's CPU (bench/PROFILE.md, "2026-12-05
afternoon"). :class:`RekeyedReader` reads ``<app id>-kv-events-by-ownership``
with confluent-kafka instead (librdkafka fetches and decodes in its own C threads) and applies each message in
the event loop with the agent's own code (:func:`stream_apps.materialize.message_applier`).

Faust's consumer stays the consumer group's member: the tables' partitions follow its assignment, its recoveries
and its commits. The reader only follows it:

- **What it reads.** At the end of each rebalance's recovery Faust resumes its stream partitions and seeks its
  consumer to the committed offsets (``Consumer.perform_seek``); the reader is then given the re-keyed topic's
  partitions assigned to this worker and those offsets (a partition without one from its beginning, as
  :func:`stream_apps.consumer_fixes._seek_to_committed` does for Faust's streams). Each such restart starts a
  new *generation*; batches fetched under an older one are dropped unapplied. Faust seeks at other times too
  (a fetch while its flow is stopped), with the stream partitions still paused in its books: those seeks
  restart nothing, and neither does a seek that a rebalance overtook (the consumer's generation changed
  while it ran, or it read the offsets of another assignment). A committed offset the log no longer holds
  reads from the log's start, as Faust's consumer would.
- **When it applies.** A rebalance begins with Faust's ``stop_flow`` (``App._on_partitions_revoked``), which shuts
  the reader's gate until the restart that ends its recovery. A message is applied only through an open gate,
  under the current generation, while Faust's flow is active (it is also active while a recovery reads the
  changelogs, hence the gate), while its partition is not paused in Faust's books (a paused one shuts the
  gate too: the fetch went past it), and before the worker begins to stop. A message is applied whole within
  one step of the event loop, so a revocation never sees one half applied.
- **What it acknowledges.** Each message applied is acknowledged to Faust's consumer (``Consumer.ack``), in offset
  order per partition, so Faust's commit, behind the checkpoint (:class:`stream_apps.checkpoint.Checkpoint`),
  commits exactly what was applied, as it did for the agent's stream. A hole in a partition's offsets is a gap
  in Faust's books, as its own fetch loop records one.
- **What aiokafka no longer fetches.** The re-keyed partitions are paused in aiokafka at every restart, and
  :func:`stream_apps.consumer_fixes._fetch_records` never hands records of a topic the reader takes to Faust's
  streams, so the agent's Faust stream stays empty.

Messages applied again after a restart (a commit not yet made when partitions moved) are the redelivery every
Kafka consumer has; the residency rules count them as duplicates and change nothing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition
from faust.types import TP

from kafka_io.config import client_config
from stream_apps.consumer_fixes import pause_fetching

log = logging.getLogger(__name__)

#: Most messages handed from the fetch thread to the event loop at once. A bulk message carries about 1,250
#: events (some 15 ms of applying), so this bounds a hand-off to well under a second of work.
HANDOFF_MESSAGES = 32
#: Hand-offs the fetch thread may have queued for the event loop before it waits: what the loop has not applied
#: yet is bounded by this times :data:`HANDOFF_MESSAGES` messages, beside librdkafka's own prefetch.
HANDOFF_QUEUE = 2
#: librdkafka's prefetch per partition and in all (``queued.max.messages.kbytes``, KiB): a few bulk messages.
PREFETCH_KBYTES = 16384
#: The event loop yields to its other tasks (HTTP views, timers, the rebalance) after applying for this long.
YIELD_AFTER_S = 0.005


class _Acknowledged:
    """What Faust's ``Consumer.ack`` reads of a message: its partition, offset and topic, and the flag it sets
    (a message of Faust's is hashable and weakly referenced in its books; so is this)."""

    __slots__ = ("acked", "tp", "offset", "topic", "__weakref__")

    def __init__(self, tp: TP, offset: int) -> None:
        self.acked, self.tp, self.offset, self.topic = False, tp, offset, tp.topic


class RekeyedReader:
    """Reads ``topic``'s partitions that Faust's consumer assigns to this worker and applies each message with
    ``apply_message`` in the event loop (the module docstring has the rules).

    Args:
        app: the worker's Faust app (its consumer is followed, acknowledged to and never replaced).
        bootstrap_servers: Kafka bootstrap servers.
        topic: the re-keyed topic (``<app id>-kv-events-by-ownership``).
        apply_message: ``await apply_message(topic, partition, offset, key, value)`` applies one
            ``ownership_batch`` message (:func:`stream_apps.materialize.message_applier`).
        progress: per partition, the offset of the last message applied, for the repartition process
            (:attr:`stream_apps.agent_progress.AgentProgress.progress`).
        consumer_factory: builds the librdkafka consumer from its settings (a dict); confluent-kafka's.
    """

    def __init__(self, app, bootstrap_servers: str, topic: str,
                 apply_message: Callable[[str, int, int, bytes | None, bytes], Awaitable[None]], progress, *,
                 consumer_factory: Callable[[dict], Consumer] = Consumer) -> None:
        self.app = app
        self.topic = topic
        self._apply_message = apply_message
        self._progress = progress
        self._settings = client_config(bootstrap_servers, **{
            # no group: Faust's consumer is the member and commits; this one only fetches what it is told
            "group.id": f"kvstream-rekeyed-{uuid.uuid4().hex}", "enable.auto.commit": False,
            "enable.auto.offset.store": False, "queued.max.messages.kbytes": PREFETCH_KBYTES,
            # a committed offset below the log start (retention) reads from the start, as Faust's consumer does
            # (consumer_auto_offset_reset="earliest"); librdkafka's default would skip to the end
            "auto.offset.reset": "earliest",
            # as Faust's consumer of this topic (stream_apps.consumer_fixes.FETCH_MAX_WAIT_MS)
            "fetch.wait.max.ms": 100})
        self._consumer_factory = consumer_factory
        #: Restarts so far, each a generation (``kvstream_rekeyed_reader_restarts_total``); 0: not started yet.
        self.generation = 0
        #: The current generation and what it reads: partition -> start offset.
        self._wanted: tuple[int, dict[int, int]] = (0, {})
        #: Partition -> the next offset expected (a hole before a message is recorded as a gap in Faust's books).
        self._next: dict[int, int] = {}
        self._room = threading.Semaphore(HANDOFF_QUEUE)
        self._stop = threading.Event()
        self._failure: BaseException | None = None
        #: Shut by :meth:`close` (a rebalance began), opened by :meth:`restart` (its recovery ended).
        self._closed = True

    # -- following Faust's consumer ------------------------------------------------------------------------

    def restart(self, partitions: dict[int, int | None]) -> None:
        """Read ``partitions`` (partition -> committed offset; None or 0: from the beginning) from now on, as a
        new generation, and open the gate :meth:`close` shut."""
        self.generation += 1
        starts = {partition: offset if offset else OFFSET_BEGINNING for partition, offset in partitions.items()}
        self._wanted = (self.generation, starts)
        self._next = {}
        self._closed = False
        log.info("rekeyed reader: generation %d reads %s partitions %s", self.generation, self.topic,
                 sorted(starts) or "none")

    def close(self) -> None:
        """Apply nothing more until the next :meth:`restart`: a rebalance has begun (Faust's ``stop_flow``)."""
        self._closed = True

    def install(self) -> None:
        """Follow Faust's consumer: its ``stop_flow`` (the first step of every revocation) shuts the reader's
        gate; its seek to the committed offsets at the end of a recovery restarts the reader; and the re-keyed
        topic is no longer fetched by aiokafka nor handed to Faust's streams."""
        consumer = self.app.consumer
        consumer._topics_read_elsewhere = frozenset({self.topic})
        seek, stop_flow = consumer.seek_to_committed, consumer.stop_flow

        def stop_flow_and_close() -> None:
            self.close()
            stop_flow()

        async def seek_to_committed():
            generation_id = self.app.consumer_generation_id
            committed = await seek()
            # read and restart in one step: no rebalance can come between the assignment and the restart
            tps = {tp for tp in consumer.assignment() if tp.topic == self.topic}
            # Faust pauses the stream partitions in its books at a revocation and resumes them just before the
            # seek that ends the recovery; its other seeks (a fetch while the flow is stopped) come in between
            # and must not open the gate. Nor may a seek that a rebalance overtook: it read the committed
            # offsets of another assignment (then not every partition assigned now is in them)
            if (self.app.consumer_generation_id == generation_id and tps <= committed.keys()
                    and not tps & consumer._paused_partitions):
                self.restart({tp.partition: committed[tp] for tp in tps})
                await pause_fetching(consumer, tps)
            return committed

        consumer.stop_flow = stop_flow_and_close
        consumer.seek_to_committed = seek_to_committed

    # -- fetching (its own thread) -------------------------------------------------------------------------

    def _fetch(self, loop: asyncio.AbstractEventLoop, handoffs: asyncio.Queue) -> None:
        """The fetch thread: follows :attr:`_wanted`, hands batches of messages to the event loop."""
        consumer = None
        generation = 0
        try:
            consumer = self._consumer_factory(self._settings)
            while not self._stop.is_set():
                wanted_generation, starts = self._wanted
                if wanted_generation != generation:
                    # librdkafka drops what it fetched for the previous assignment (its fetch versions)
                    consumer.assign([TopicPartition(self.topic, p, offset) for p, offset in starts.items()])
                    generation = wanted_generation
                if not starts:
                    self._stop.wait(0.05)
                    continue
                first = consumer.poll(0.1)
                if first is None:
                    continue
                messages = [first, *consumer.consume(HANDOFF_MESSAGES - 1, 0)]
                while not self._room.acquire(timeout=0.1):
                    if self._stop.is_set():
                        return
                loop.call_soon_threadsafe(handoffs.put_nowait, (generation, messages))
        except BaseException as exc:  # the worker must stop: nothing of the topic would be applied any more
            self._failure = exc
            loop.call_soon_threadsafe(handoffs.put_nowait, None)
        finally:
            if consumer is not None:
                consumer.close()

    # -- applying (the event loop) -------------------------------------------------------------------------

    async def run(self) -> None:
        """Start the fetch thread and apply what it hands over, until cancelled (the worker stops).

        Raises:
            RuntimeError: the fetch thread failed (its error is the cause).
        """
        loop = asyncio.get_running_loop()
        handoffs: asyncio.Queue = asyncio.Queue()
        threading.Thread(target=self._fetch, args=(loop, handoffs), name="kvstream-rekeyed-fetch",
                         daemon=True).start()
        consumer = self.app.consumer
        try:
            while True:
                handoff = await handoffs.get()
                if handoff is None:
                    raise RuntimeError(f"the reader of {self.topic} failed: {self._failure!r}") from self._failure
                self._room.release()
                generation, messages = handoff
                await self._apply(consumer, generation, messages)
        finally:
            self._stop.set()

    def _open_for(self, consumer, generation: int) -> bool:
        """Whether a message fetched under ``generation`` may be applied now (the module docstring's rules)."""
        return (generation == self.generation and not self._closed and consumer.flow_active
                and not self.app.should_stop)

    async def _apply(self, consumer, generation: int, messages: list) -> None:
        """Apply ``messages`` of ``generation`` while it is current and the flow active; each acknowledged."""
        topic, apply_message, progress, ack = self.topic, self._apply_message, self._progress, consumer.ack
        expected = self._next
        started = time.perf_counter()
        for message in messages:
            if not self._open_for(consumer, generation):
                return  # a rebalance or the worker's stop came: the next generation reads from the committed offsets
            error = message.error()
            if error is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    log.warning("rekeyed reader: %s", error)
                    if error.fatal():
                        raise RuntimeError(f"reading {topic}: {error}")
                continue
            partition, offset = message.partition(), message.offset()
            tp = TP(topic, partition)
            if tp in consumer._paused_partitions:  # paused in Faust's books: its table may be being restored
                self._closed = True  # and nothing more of this generation: the fetch went past this message
                return
            gap_from = expected.get(partition)
            if gap_from is not None and offset > gap_from:  # a hole (never expected in this topic): as Faust's
                await consumer._add_gap(tp, gap_from, offset)  # which yields to the loop: look again
                if not self._open_for(consumer, generation):
                    return
            await apply_message(topic, partition, offset, message.key(), message.value())
            ack(_Acknowledged(tp, offset))
            progress[partition] = offset
            expected[partition] = offset + 1
            if time.perf_counter() - started > YIELD_AFTER_S:
                await asyncio.sleep(0)
                started = time.perf_counter()
