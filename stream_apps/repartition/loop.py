"""The repartition stage's consumer loop (:class:`Repartitioner`): read a batch of ``kv-events``, re-key it, then run
the checkpoint (:class:`stream_apps.checkpoint.Checkpoint`: produce, flush, commit; the package docstring says how)."""

from __future__ import annotations

import gc
import logging
import os
import time
from functools import partial

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition

from kafka_io.config import client_config, producer_config
from kafka_io.produce import produce_waiting
from kafka_io.schema_registry import reader_codec
from schemas import ALL_BLOCKS_CLEARED, BLOCK_REMOVED, BLOCK_STORED, SOURCE_WIDE_EVENTS, AvroCodec, DecodeError
from schemas.avro_writers import encode_clear_mark, encode_ownership_batch
from schemas.block_event import (
    R_AGGREGATION,
    R_BLOCK_HASH,
    R_CONTENT_HASH,
    R_DP_RANK,
    R_INSTANCE,
    R_KIND,
    R_OWNERSHIP,
    R_TIER,
    R_WORKER_RANK,
    R_WORLD_SIZE,
    ROUTE_SLOTS,
    block_route,
)
from schemas.clear_position import NO_CLEAR
from schemas.compiled import choose
from schemas.content_hash import record_engine, stored_content_hash
from schemas.topics import ERROR_HEADER, SOURCE_HEADER, TopicNames
from stream_apps.checkpoint import Checkpoint
from stream_apps.repartition.batches import PartitionBatch, partition_batches
from stream_apps.repartition.clear_history import ClearHistory
from stream_apps.residency import AGREEMENT_FIELDS, block_key, content_digest, needs_content, source_aggregation

log = logging.getLogger(__name__)

#: In :class:`stream_apps.agent_progress.AgentProgress`, a partition whose progress does not hold the next batch
#: back: this worker's agent does not read it (another worker does, or it is not assigned yet).
NOT_READ_HERE = 1 << 62
#: How often a batch that waits for the agent to finish the previous one checks again (seconds).
AGENT_CHECK_S = 0.002
#: How long the checkpoint after a batch waits for the broker's acknowledgements at most (seconds): past
#: librdkafka's message timeout (``message.timeout.ms``, 300 s by default), every record is either acknowledged
#: or refused, so this bound only ends the wait of a producer that hangs. This process has no event loop to block.
FLUSH_TIMEOUT_S = 330.0
#: The kinds whose events are re-keyed by block hash (the others are source-wide: :meth:`Repartitioner._source_wide`).
_BLOCK_KINDS = frozenset((BLOCK_STORED, BLOCK_REMOVED))
#: A store's fields its content digest is made of (:func:`stream_apps.residency.content_digest`), by name -> position
#: in the list the second projection reads them into, then the record's ``hash_encoding``: the engine whose rule says
#: whether its tokens give its content hash (:func:`schemas.content_hash.record_engine`).
AGREEMENT_SLOTS = {**{name: i for i, name in enumerate(AGREEMENT_FIELDS)}, "hash_encoding": len(AGREEMENT_FIELDS)}


def repartition_group(app_id: str) -> str:
    """Consumer group of the repartition stage (kv-events): ``<app id>-repartition``."""
    return f"{app_id}-repartition"


class Repartitioner:
    """The repartition stage's consumer loop (:meth:`run`; :class:`RepartitionProcess` runs it in a process).

    After every batch it runs its :attr:`checkpoint` (:class:`stream_apps.checkpoint.Checkpoint`, whose docstring
    has the order and why): step 1 produces the batch's re-keyed messages and changed clear histories, step 2
    waits for every acknowledgement (dead letters included), step 4 commits the batch's ``kv-events`` offsets
    asynchronously (the next batch does not wait for the commit; a lost commit only means a redelivery).

    Args:
        bootstrap_servers: Kafka bootstrap servers.
        topics: the stream app's topic names (the consumer group is ``<scoped app id>-repartition``).
        partitions: partitions of the re-keyed topic (the app's partition count).
        counters: a mapping whose ``repartitioned`` and ``dead_lettered`` counts move here.
        batch_size: messages read per batch (one flush and one commit each).
        within_s: how long a read waits for a batch to fill while the input is backlogged, and for the first
            message while none arrives (seconds).
        linger_s: otherwise, a batch takes what arrived within this many seconds of the previous read, and,
            with ``agent_progress``, longer while the agent has not finished the previous batch.
        agent_progress: per re-keyed partition, the offset of the last message this worker's agent finished
            (:class:`stream_apps.agent_progress.AgentProgress`); None: batches do not wait for the agent.
        stop_event: set to stop the loop after the batch in hand (anything with ``is_set()``).
        schema_registry_url: the registry that resolves Confluent-framed records' schema ids; empty: none
            (writer schemas this version does not ship are then looked up in the schemas topic).
        aggregation: the worker's configured aggregation, instance -> (world_size, mode)
            (:attr:`stream_apps.residency.SourceSettings.aggregation`).
        consumer, producer: the confluent-kafka consumer of ``kv-events`` and producer of the outputs; None (the
            default): :meth:`run` creates them. Tests give their own.
    """

    def __init__(self, bootstrap_servers: str, topics: TopicNames, partitions: int, counters, *,
                 batch_size: int = 10_000, within_s: float = 0.1, linger_s: float = 0.02, stop_event,
                 schema_registry_url: str = "", agent_progress=None, aggregation: dict | None = None,
                 consumer: Consumer | None = None, producer: Producer | None = None) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.topics = topics
        self.app_id = topics.scoped_app_id
        self.partitions = partitions
        self.counters = counters
        self.batch_size = batch_size
        self.within_s = within_s
        self.linger_s = linger_s
        self.agent_progress = agent_progress
        #: Re-keyed partition -> offset of the last ownership_batch message acknowledged there (the delivery
        #: reports keep it; a batch read waits for the agent to reach it, see :meth:`_read`).
        self.written: dict[int, int] = {}
        self.output_topic = topics.by_ownership
        self.clears_topic = topics.source_clears
        self._event_codec = reader_codec("kv_event", bootstrap_servers, schema_registry_url, topics.schemas)
        self._batch_codec = AvroCodec("ownership_batch")
        self._clears_codec = AvroCodec("source_clears")
        self._read_own_version = self._event_codec.own_version_reader()
        #: The compiled read of a block event's route fields from its bytes (None without the compiled module):
        #: most events need no more, and those that do are decoded (:meth:`_decoded`).
        self._project = self._event_codec.own_version_projection(ROUTE_SLOTS)
        self._project_agreement = self._event_codec.own_version_projection(AGREEMENT_SLOTS)
        compiled = choose(None)
        #: (partition, UTF-8 key) of a block event: stream_apps.residency.block_key or its compiled twin.
        self._block_key = block_key if compiled is None else compiled.block_key
        #: The compiled loop over a batch (None: every message goes through :meth:`_rekey_one`), and the batches
        #: it adds to: stream_apps.repartition.batches.partition_batches of the same implementation.
        self._rekey_block_events = None if compiled is None else compiled.rekey_block_events
        self._new_batches = partial(partition_batches, compiled is not None)
        #: Instance -> configured (world_size, mode) of the worker (``--aggregation``): a store of a REPLICATED
        #: source gets its content digest here (stream_apps.residency.needs_content). Fixed for the process.
        self.aggregation = dict(aggregation or {})
        #: Source (as :meth:`_needs_digest` takes it) -> whether its stores need their content digest: a fleet has
        #: few sources, and the answer is asked for every store.
        self._digest_needed: dict[tuple, bool] = {}
        #: (kv-events partition, instance, dp rank) -> clear history, for the assigned partitions.
        self._histories: dict[tuple[int, str, int], ClearHistory] = {}
        #: kv-events partitions assigned to this consumer now (the rebalance callbacks keep it), and how many
        #: assignments and revocations it has seen (a batch read across one must not keep messages of a
        #: partition that left: see _read).
        self.assigned: set[int] = set()
        self._rebalances = 0
        self._delivery_errors: list[str] = []
        self._stop = stop_event
        self._consumer = consumer
        self._producer = producer
        #: The batch's outgoing messages per destination partition and its changed clear histories, re-keyed
        #: and not yet produced (the checkpoint's step 1 produces them).
        self._outgoing: dict[int, PartitionBatch] = {}
        self._changed: dict[tuple[int, str, int], ClearHistory] = {}
        #: The commit protocol after every batch.
        self.checkpoint = Checkpoint(self, produce=[self._produce_buffered], commit_offsets=self._commit_offsets,
                                     flush_timeout_s=FLUSH_TIMEOUT_S, freeze_gc=False)

    def run(self) -> None:
        """Consume, re-key, checkpoint, until the stop event is set.

        Raises:
            stream_apps.checkpoint.CheckpointError: an output could not be produced or was not acknowledged.
        """
        # BROKER_SESSION_TIMEOUT (seconds), the variable Faust reads for the agent's consumer: when it is set,
        # both stages get their partitions back after the same wait after a crash. Unset, the two differ:
        # Faust's default is 60 s, this one librdkafka's 45 s (docs/configuration.md)
        session_ms = int(float(os.environ.get("BROKER_SESSION_TIMEOUT", "45")) * 1000)
        config = client_config(self.bootstrap_servers, **{
            "group.id": repartition_group(self.app_id), "enable.auto.commit": False,
            "auto.offset.reset": "earliest", "enable.partition.eof": False, "client.id": "kvstream-repartition",
            "session.timeout.ms": session_ms, "heartbeat.interval.ms": min(3000, session_ms // 3),
            "on_commit": self._on_commit})
        if self._consumer is None:
            self._consumer = Consumer(config)
        if self._producer is None:
            self._producer = Producer(producer_config(self.bootstrap_servers, **{
                "client.id": "kvstream-repartition", "partitioner": "murmur2_random", "linger.ms": 5,
                "message.max.bytes": 8 << 20}))
        self._consumer.subscribe([self.topics.kv_events], on_assign=self._on_assign, on_revoke=self._on_revoke,
                                 on_lost=self._on_revoke)
        # What exists now (modules, schemas, codecs) lives as long as the process: out of the collector's
        # sight, a full collection scans only what came later instead of stopping a batch for every module
        gc.freeze()
        backlogged, last_read = True, time.monotonic()
        try:
            while not self._stop.is_set():
                messages = self._read(backlogged, last_read)
                if messages:
                    last_read = time.monotonic()
                    backlogged = self._backlogged(self.process(messages))
        finally:
            self._consumer.close()

    def _read(self, backlogged: bool, last_read: float) -> list:
        """The next batch: up to ``batch_size`` messages.

        Backlogged, it waits up to ``within_s`` for a whole batch (few, large messages for the agent). Otherwise
        it takes what arrived within ``linger_s`` of the previous read (the flush and commit of that batch
        overlap the wait), so an event waits about ``linger_s`` here instead of ``within_s``; but while the
        agent has not finished the previous batch, and for at most ``within_s``, the batch keeps growing. The
        agent pays a fixed cost per message: batches cut faster than it finishes them would multiply its
        messages until it falls behind for good, whereas this way they grow to whatever size it keeps up
        with. With nothing arrived, it waits up to ``within_s`` for the first message and takes it with
        whatever came with it.
        """
        rebalances = self._rebalances
        if backlogged:
            timeout = self.within_s
        else:
            timeout = max(0.0, last_read + self.linger_s - time.monotonic())
        messages = self._consumer.consume(self.batch_size, timeout)
        if not backlogged:
            deadline = last_read + self.within_s
            while (messages and len(messages) < self.batch_size and not self._agent_done()
                   and time.monotonic() < deadline and not self._stop.is_set() and self._rebalances == rebalances):
                messages += self._consumer.consume(self.batch_size - len(messages), AGENT_CHECK_S)
        if not messages and not self._stop.is_set():
            messages = self._consumer.consume(1, self.within_s)
            if messages and self.batch_size > 1:
                messages += self._consumer.consume(self.batch_size - 1, 0)
        if self._rebalances != rebalances:
            # A later consume() ran a revocation: messages read before it from a partition that left have lost
            # their clear history (a block event would be re-keyed with no clear mark) and belong to the new
            # owner, which reads them again from the committed offset. They are neither re-keyed nor committed.
            assigned = self.assigned
            messages = [m for m in messages if m.error() is not None or m.partition() in assigned]
        return messages

    def _agent_done(self) -> bool:
        """Whether this worker's agent has finished every batch message written to the partitions it reads."""
        progress = self.agent_progress
        if progress is None:
            return True
        for partition, offset in self.written.items():
            if progress[partition] < offset:
                return False
        return True

    def _backlogged(self, next_offsets: dict[int, int]) -> bool:
        """Whether another whole batch already waits on the broker behind ``next_offsets`` (kv-events partition
        -> next offset), by the high watermarks of the latest fetch responses (no request to the broker)."""
        waiting = 0
        for partition, offset in next_offsets.items():
            try:
                _, high = self._consumer.get_watermark_offsets(TopicPartition(self.topics.kv_events, partition),
                                                              cached=True)
            except KafkaException:  # e.g. the partition was revoked meanwhile
                continue
            if high > offset:
                waiting += high - offset
        return waiting >= self.batch_size

    def _on_commit(self, error, partitions) -> None:
        # offsets are committed asynchronously (after the flush: at least once either way); a commit that fails,
        # e.g. because a rebalance took the partitions, only means the batch is read again
        if error is not None:
            log.warning("repartition commit failed (%s); the batch will be redelivered", error)

    # -- what the checkpoint plugs in (stream_apps.checkpoint.Checkpoint) -------------------------------------

    def _produce_buffered(self) -> int:
        """Step 1: produce the batch's re-keyed messages and changed clear histories; returns how many."""
        outgoing, changed = self._outgoing, self._changed
        if not outgoing and not changed:
            return 0
        self._outgoing, self._changed = {}, {}
        return self._produce(outgoing, changed)

    def acknowledge(self, timeout_s: float) -> int:
        """Step 2: flush the producer for at most ``timeout_s``; returns how many records are unacknowledged
        (:class:`stream_apps.checkpoint.Acknowledging`)."""
        return self._producer.flush(timeout_s)

    def take_delivery_errors(self) -> list[str]:
        """The records the broker refused since the last call, forgotten here."""
        errors, self._delivery_errors = self._delivery_errors, []
        return errors

    def _commit_offsets(self, offsets: dict[int, int]) -> None:
        """Step 4: commit ``{kv-events partition: next offset}``, asynchronously."""
        try:
            self._consumer.commit(offsets=[TopicPartition(self.topics.kv_events, p, o) for p, o in offsets.items()],
                                  asynchronous=True)
        except KafkaException as exc:  # e.g. no partitions assigned any more: they are read again elsewhere
            log.warning("repartition commit failed (%s); the batch will be redelivered", exc)

    # -- assignment: clear histories follow their partitions ---------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        assigned = {tp.partition for tp in partitions}
        self._histories.update(self._load_histories(assigned))
        self.assigned |= assigned
        self._rebalances += 1
        log.info("repartition stage assigned kv-events partitions %s", sorted(assigned))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        revoked = {tp.partition for tp in partitions}
        for key in [k for k in self._histories if k[0] in revoked]:
            del self._histories[key]
        self.assigned -= revoked
        self._rebalances += 1

    def _load_histories(self, partitions: set[int]) -> dict[tuple[int, str, int], ClearHistory]:
        """Read the clear-history topic's records of these kv-events partitions (it is small and compacted)."""
        reader = Consumer(client_config(self.bootstrap_servers, **{
            "group.id": f"{self.app_id}-repartition-restore", "enable.auto.commit": False,
            "client.id": "kvstream-repartition-restore"}))
        found: dict[tuple[int, str, int], ClearHistory] = {}
        try:
            ends = {}
            for p in partitions:
                low, high = reader.get_watermark_offsets(TopicPartition(self.clears_topic, p), timeout=10)
                if high > low:
                    ends[p] = high
            if not ends:
                return found
            reader.assign([TopicPartition(self.clears_topic, p, OFFSET_BEGINNING) for p in ends])
            done: set[int] = set()
            deadline = time.monotonic() + 120
            while len(done) < len(ends):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"could not read {self.clears_topic} partitions {sorted(set(ends) - done)} "
                                       "to their end within 120 s")
                for message in reader.consume(1000, 1.0):
                    if message.error():
                        raise KafkaException(message.error())
                    if message.offset() + 1 >= ends[message.partition()]:
                        done.add(message.partition())
                    if message.value() is None:
                        continue
                    history = ClearHistory.from_record(self._clears_codec.decode(message.value()))
                    found[(history.partition, history.instance_id, history.data_parallel_rank)] = history
        finally:
            reader.close()
        return found

    # -- the hot path -----------------------------------------------------------------------------------------

    def process(self, messages: list) -> dict[int, int]:
        """Re-key one batch, then run the checkpoint (:attr:`checkpoint`): produce the batch, wait for the broker's
        acks, commit its offsets.

        Returns:
            kv-events partition -> the offset after the batch's last message on it.

        Raises:
            stream_apps.checkpoint.CheckpointError: the broker did not acknowledge every output (the offsets are not
                committed, so the batch is read again after the worker restarts).
        """
        outgoing = self._new_batches()
        changed_histories: dict[tuple[int, str, int], ClearHistory] = {}
        next_offsets: dict[int, int] = {}

        def rekey_one(message) -> None:
            self._rekey_one(message, outgoing, changed_histories, next_offsets)

        if self._rekey_block_events is not None and self._project is not None:
            self._rekey_block_events(messages, self._project, self._histories, self.partitions, self.aggregation,
                                     outgoing, next_offsets, self._settle_store, rekey_one, BLOCK_REMOVED,
                                     BLOCK_STORED)
        else:
            for message in messages:
                rekey_one(message)
        self._outgoing, self._changed = outgoing, changed_histories
        checkpoint = self.checkpoint
        checkpoint.store_offsets(next_offsets)
        checkpoint.commit()
        self.counters["repartitioned"] += len(messages)
        return next_offsets

    def _rekey_one(self, message, outgoing: dict, changed: dict[tuple[int, str, int], ClearHistory],
                   next_offsets: dict[int, int]) -> None:
        """Re-key one ``kv-events`` message into ``outgoing`` (destination partition -> its batch), a clear's
        history into ``changed``, its offset into ``next_offsets``; a record that cannot be re-keyed goes to
        the dead-letter topic. The reference for every message: the compiled loop
        (``schemas._hotpath.rekey_block_events``) does the same for the common block events, and hands every
        other message here."""
        if message.error():
            if message.error().code() != KafkaError._PARTITION_EOF:
                log.warning("kv-events read error: %s", message.error())
            return
        partition, offset, value = message.partition(), message.offset(), message.value()
        next_offsets[partition] = offset + 1
        try:
            project = self._project
            route = project(value) if project is not None and value else None
            content = None
            settled = (route is not None and route[R_KIND] in _BLOCK_KINDS and route[R_BLOCK_HASH] is not None
                       and route[R_TIER] is not None)
            if settled and route[R_KIND] == BLOCK_STORED and (
                    route[R_CONTENT_HASH] is None or route[R_WORLD_SIZE] or route[R_INSTANCE] in self.aggregation):
                settled, content = self._settle_store(route, value)
            if not settled:
                decoded = self._decoded(message, value, outgoing, changed)
                if decoded is None:
                    return
                route, content = decoded
            history = self._histories.get((partition, route[R_INSTANCE], route[R_DP_RANK]))
            destination, key = self._block_key(route[R_OWNERSHIP], route[R_BLOCK_HASH], self.partitions)
            mark = b"\x00" if history is None else history.encoded_mark_before(offset)
            outgoing[destination].add_block(key, mark, value, route, content)
        except DecodeError as exc:
            self._dead_letter(message, str(exc))

    def _settle_store(self, route: list, value: bytes) -> tuple[bool, int | None]:
        """For a store read by the projection that has no content hash or whose source may be replicated: whether
        the projection settles it, and its content digest (None where its source needs none:
        :func:`needs_content`). A second projection reads the store's :data:`AGREEMENT_SLOTS`, from which the
        digest and a missing content hash (:func:`schemas.content_hash.stored_content_hash`, into ``route``)
        are computed as from the decoded record."""
        needs_digest = self._needs_digest(BLOCK_STORED, (route[R_INSTANCE], route[R_DP_RANK], route[R_WORKER_RANK],
                                                         route[R_WORLD_SIZE], route[R_AGGREGATION]))
        if route[R_CONTENT_HASH] is not None and not needs_digest:
            return True, None
        values = self._project_agreement(value)
        if values is None:
            return False, None
        body = dict(zip(AGREEMENT_FIELDS, values))
        engine = record_engine(values[-1])
        if route[R_CONTENT_HASH] is None:
            route[R_CONTENT_HASH] = stored_content_hash(body, engine)
        return True, content_digest(body, engine) if needs_digest else None

    def _decoded(self, message, value: bytes | None, outgoing: dict[int, PartitionBatch],
                 changed: dict[tuple[int, str, int], ClearHistory]) -> tuple[list, int | None] | None:
        """A record the projection left to the decoder: another version's, a source-wide event's (handled here:
        None), or a block event's whose store has no content hash or may be replicated, whose
        :func:`schemas.block_event.block_route` and replica content digest (or None) it gives.

        Raises:
            DecodeError: the record cannot be decoded, or is a block event without block hash or tier.
        """
        record = (value and self._read_own_version(value, 0, len(value))) or self._event_codec.decode(value)
        kind, body = record["event"]
        instance = record["instance_id"]
        source = (message.partition(), instance, record["data_parallel_rank"])
        if kind in SOURCE_WIDE_EVENTS:
            self._source_wide(message, record, kind, source, self._histories.get(source), outgoing, changed)
            return None
        if record["block_hash"] is None or record["tier"] is None:
            raise DecodeError(f"{kind.rsplit('.', 1)[-1]} without block_hash or tier")
        digest = self._needs_digest(kind, (instance, source[2], record["worker_rank"], record["world_size"],
                                           record["aggregation"]))
        return block_route(record), content_digest(body, record_engine(record.get("hash_encoding"))) if digest else None

    def _needs_digest(self, kind: str, source: tuple) -> bool:
        """Whether a ``kind`` event of ``source`` (instance, dp rank, worker rank, world size, aggregation mode, as
        ``kv_event`` carries them) needs its content digest: a store of a replicated source
        (:func:`needs_content`), with the worker's ``--aggregation`` for a source that declares none."""
        if kind != BLOCK_STORED:
            return False
        needed = self._digest_needed.get(source)
        if needed is None:
            instance = source[0]
            needed = self._digest_needed[source] = bool(source[3] or instance in self.aggregation) and needs_content(
                kind, source_aggregation(source, self.aggregation.get(instance)))
        return needed

    def _source_wide(self, message, record: dict, kind: str, source: tuple[int, str, int],
                     history: ClearHistory | None, outgoing: dict[int, PartitionBatch],
                     changed: dict[tuple[int, str, int], ClearHistory]) -> None:
        """A clear (recorded in the source's history), or another source-wide event (PublisherRestarted, SourceStale,
        SourceHeartbeat, SourceUnregistered, SourceDisconnected): same partition number, stamped with the source's
        latest clear before it."""
        partition, offset = source[0], message.offset()
        if kind == ALL_BLOCKS_CLEARED:
            if history is None:
                history = self._histories[source] = ClearHistory(source[1], source[2], partition)
            mark = (record["publisher_epoch"], record["seq"], record["batch_index"])
            if history.add(offset, mark):
                changed[source] = history
        else:
            mark = NO_CLEAR if history is None else history.mark_before(offset)
        name = kind.rsplit(".", 1)[-1]
        outgoing[partition].add(f"{name}/{record['instance_id']}/{record['data_parallel_rank']}",
                                encode_clear_mark(mark), message.value())

    def _produce(self, outgoing: dict[int, PartitionBatch], changed: dict[tuple[int, str, int], ClearHistory]) -> int:
        produce = self._producer.produce
        header = self._batch_codec.header
        produced = 0
        for partition, batch in outgoing.items():
            for tables, items in batch.messages():
                self._send(produce, self.output_topic, None, encode_ownership_batch(header, items, tables), partition)
                produced += 1
        for (partition, instance, dp_rank), history in changed.items():
            self._send(produce, self.clears_topic, f"{partition}/{instance}/{dp_rank}".encode(),
                       self._clears_codec.encode(history.to_record()), partition)
            produced += 1
        return produced

    def _send(self, produce, topic: str, key: bytes | None, value: bytes, partition: int) -> None:
        produce_waiting(self._producer, topic, value, key, partition=partition, on_delivery=self._on_delivery)

    def _on_delivery(self, error, message) -> None:
        if error is not None:
            self._delivery_errors.append(f"{message.topic()}[{message.partition()}]: {error}")
        elif message.topic() == self.output_topic:
            self.written[message.partition()] = message.offset()

    def _dead_letter(self, message, reason: str) -> None:
        """Send a record's original key and bytes to the dead-letter topic with the reason; move the counter."""
        self.counters["dead_lettered"] += 1
        log.warning("dead-lettering %s[%s]@%s: %s", message.topic(), message.partition(), message.offset(), reason)
        headers = [(ERROR_HEADER, reason.encode()[:1000]),
                   (SOURCE_HEADER, f"{message.topic()}/{message.partition()}/{message.offset()}".encode())]
        produce_waiting(self._producer, self.topics.dead_letter, message.value(), message.key(), headers=headers,
                        on_delivery=self._on_delivery)
