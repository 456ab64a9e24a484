"""Where the bridge hands its batches, and what it counts: the sink protocol, the Kafka sink, the metrics.

Every batch is decoded event by event (:mod:`producers.engine_decode`), split per block (:mod:`producers.split`)
and produced through :class:`producers.kafka_sink.KvEventProducer`; what cannot be decoded goes to the
dead-letter topic with its reason and bytes, and the rest flows (:class:`KafkaBatchSink`). ``kvstream capture``
hands batches to a sink of its own, a file (:mod:`producers.capture`).

:class:`BridgeMetrics` are the bridge's Prometheus counters (docs/ingesting.md, "Bridge metrics").
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter

from producers.bridge_endpoints import PublisherEndpoint
from producers.engine_decode import BatchDecodeError, decode_batch
from producers.kafka_sink import ProduceError
from producers.split import InvalidEvent, Publisher, source_event


class BatchSink(Protocol):
    """Where decoded batches go: Kafka (:class:`KafkaBatchSink`) or a capture file."""

    def batch(self, endpoint: PublisherEndpoint, publisher: Publisher, seq: int, payload: bytes) -> None: ...

    def source_event(self, publisher: Publisher, kind: str, body: dict, seq: int) -> None:
        """An event the bridge makes itself: ``PUBLISHER_RESTARTED``, ``SOURCE_STALE``, ``SOURCE_HEARTBEAT`` or
        ``SOURCE_DISCONNECTED`` (schemas)."""

    def flush(self) -> None:
        """Make everything handed over so far durable (Kafka: acknowledged); raises if it cannot be.

        A sink may also have ``poll()``, which the bridge calls once a heartbeat interval (:class:`KafkaBatchSink`:
        delivery reports)."""


class BridgeMetrics:
    """Prometheus counters per source (labels ``instance``, ``dp_rank``)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ("instance", "dp_rank")

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"kvstream_bridge_{name}", doc, labels, registry=self.registry)

        self.batches_received = counter("batches_received", "Batches received live from the publisher")
        self.batches_replayed = counter("batches_replayed", "Batches received from the replay socket")
        self.batches_duplicate = counter("batches_duplicate", "Batches dropped as already seen (replay/live overlap)")
        self.events_received = counter("events_received", "Engine events decoded")
        self.events_produced = counter("events_produced", "Block-level records produced to Kafka")
        self.dead_lettered = counter("dead_lettered", "Payloads or events sent to the dead-letter topic")
        self.gaps_found = counter("gaps_found", "Sequence gaps detected")
        self.gaps_unrecovered = counter("gaps_unrecovered", "Gaps (or batches) the replay buffer no longer held")
        self.restarts = counter("restarts", "Publisher restarts (seq went backwards): new publisher epochs")
        self.heartbeats = Counter("kvstream_bridge_heartbeats", "SourceHeartbeat events sent, by evidence",
                                  (*labels, "evidence"), registry=self.registry)
        self.disconnects = Counter("kvstream_bridge_disconnects", "SourceDisconnected events sent, by reason "
                                   "(connection dropped, replay socket silent)", (*labels, "reason"),
                                   registry=self.registry)
        self.heartbeats_skipped = counter("heartbeats_skipped", "Heartbeat intervals without evidence of life "
                                                                "(connection down, probe unanswered)")
        self.replay_requests = counter("replay_requests", "Requests to the replay socket (catch-ups, replays on "
                                                          "connect, probes)")
        self.replay_unanswered = counter("replay_unanswered", "Replay requests without their end marker in time")


class KafkaBatchSink:
    """Decode, split per block and produce; undecodable payloads and events go to the dead-letter topic."""

    def __init__(self, producer, metrics: BridgeMetrics) -> None:
        self.producer = producer
        self.metrics = metrics

    def source_event(self, publisher: Publisher, kind: str, body: dict, seq: int) -> None:
        self.producer.send(source_event(publisher, kind, body, seq, time.time()))

    def flush(self) -> None:
        """Wait for the broker's acknowledgements (raises :class:`producers.kafka_sink.ProduceError`)."""
        self.producer.flush()

    def flush_some(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the broker's acknowledgements: True once every message is acknowledged,
        False while some are still on their way (the bridge then serves its sockets and asks again).

        Raises:
            producers.kafka_sink.ProduceError: messages failed.
        """
        try:
            self.producer.flush(timeout_s)
        except ProduceError:
            if self.producer.stats.failed:
                raise
            return False
        return True

    def poll(self) -> None:
        """Serve librdkafka's delivery reports without waiting (the bridge calls it once an interval: an idle
        bridge sends only heartbeats, too few for the producer's own polling every 4,096 messages)."""
        self.producer.poll(0)

    def batch(self, endpoint: PublisherEndpoint, publisher: Publisher, seq: int, payload: bytes) -> None:
        labels = (publisher.instance_id, str(publisher.data_parallel_rank))
        where = f"{endpoint.endpoint} seq {seq}"
        try:
            decoded = decode_batch(payload)
        except BatchDecodeError as exc:
            self.producer.dead_letter(payload, str(exc), where)
            self.metrics.dead_lettered.labels(*labels).inc()
            return
        if decoded.data_parallel_rank is not None and decoded.data_parallel_rank != publisher.data_parallel_rank:
            publisher = replace(publisher, data_parallel_rank=decoded.data_parallel_rank)
        for failure in decoded.failures:
            self.producer.dead_letter(failure.raw, failure.reason, f"{where} event {failure.batch_index}")
            self.metrics.dead_lettered.labels(*labels).inc()
        # counters are updated once per batch: a labelled counter lookup costs about as much as encoding a block
        self.metrics.events_received.labels(*labels).inc(len(decoded.events))
        produced = 0
        try:
            for index, event, raw in decoded.events:
                try:
                    produced += self.producer.send_event(publisher, seq, decoded.ts, index, event)
                except InvalidEvent as exc:
                    self.producer.dead_letter(raw, str(exc), f"{where} event {index}")
                    self.metrics.dead_lettered.labels(*labels).inc()
        finally:
            self.metrics.events_produced.labels(*labels).inc(produced)
