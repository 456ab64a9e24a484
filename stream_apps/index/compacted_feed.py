"""Following a small compacted topic from its beginning, with no consumer group and no commits: the base of the
read path's side feeds (the sources' leases of an index replica, :class:`~stream_apps.index.liveness.SourcesFeed`;
the registrations, :class:`~stream_apps.index.registrations.RegistrationsFeed`)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Message, TopicPartition

from kafka_io.config import client_config
from schemas import AvroCodec, DecodeError

log = logging.getLogger(__name__)

#: Seconds between looks for a topic that does not exist yet (nobody has written it).
TOPIC_LOOK_S = 1.0
#: Most records one :meth:`CompactedFeed.poll` reads.
POLL_BATCH = 500


def close_reader(look: "TopicLook", consumer: Consumer | None) -> None:
    """Close a feed's looking consumer and its reading one (None: not opened); a consumer already closed is
    left alone. The feeds call it from the thread that polled the consumer."""
    look.close()
    if consumer is not None:
        try:
            consumer.close()
        except RuntimeError:
            pass


class TopicLook:
    """Looks for ``topic`` at most every ``every_s`` seconds with one consumer, kept from look to look until the
    topic exists and :meth:`take` hands it on to read it. A new client for each look started threads and
    connections and asked the broker for its API versions every second, for as long as nobody wrote the topic
    (a fleet without registrations never writes ``kv-instances``; an index replica may start before any worker
    created the residency changelog).

    Args:
        topic: the topic looked for.
        new_consumer: builds the consumer (with the caller's settings) at the first look, and again after a
            :meth:`take`.
        every_s: least seconds between two looks.
    """

    def __init__(self, topic: str, new_consumer: Callable[[], Consumer], every_s: float) -> None:
        self.topic = topic
        self.every_s = every_s
        #: The consumer that looks (None before the first look and after :meth:`take`).
        self.consumer: Consumer | None = None
        self._new_consumer = new_consumer
        self._next_look = 0.0

    def partitions(self) -> list[int] | None:
        """The topic's partitions if it exists now; None if it does not, the broker did not answer within 10 s,
        or the previous look was less than ``every_s`` ago."""
        now = time.monotonic()
        if now < self._next_look:
            return None
        self._next_look = now + self.every_s
        if self.consumer is None:
            self.consumer = self._new_consumer()
        try:
            topic = self.consumer.list_topics(self.topic, timeout=10).topics.get(self.topic)
        except KafkaException:
            return None
        if topic is None or topic.error is not None or not topic.partitions:
            return None
        return sorted(topic.partitions)

    def take(self) -> Consumer:
        """The consumer that found the topic, now the caller's to assign and close."""
        consumer, self.consumer = self.consumer, None
        return consumer

    def close(self) -> None:
        """Close the consumer still looking, if any."""
        if self.consumer is not None:
            self.consumer.close()
            self.consumer = None


class CompactedFeed:
    """Reads ``topic`` from its beginning and hands each record to :meth:`on_record`, each tombstone to
    :meth:`on_tombstone` (subclasses say what they mean), in the topic's order per partition.

    Args:
        codec: decodes the values; a value it refuses (or that :meth:`on_record` refuses with ValueError) is
            skipped with an error in the log: it cannot be retried, and the key's next record replaces it.
        group_prefix: names the throwaway group id (which is never joined: the partitions are assigned).
    """

    def __init__(self, bootstrap_servers: str, topic: str, codec: AvroCodec, group_prefix: str) -> None:
        self.topic = topic
        #: Records read so far, tombstones included.
        self.records = 0
        self._codec = codec
        self._consumer: Consumer | None = None
        self._look = TopicLook(topic, lambda: Consumer(client_config(bootstrap_servers, **{
            "group.id": f"{group_prefix}-{uuid.uuid4().hex}", "enable.auto.commit": False,
            "auto.offset.reset": "earliest"})), TOPIC_LOOK_S)

    def on_record(self, key: str, record: dict, message: Message) -> None:
        """One decoded value of ``key``."""
        raise NotImplementedError

    def on_tombstone(self, key: str) -> None:
        """``key`` was deleted."""
        raise NotImplementedError

    def _open(self) -> bool:
        """Assigns every partition from its beginning; False while the topic does not exist, looked for again at
        most every :data:`TOPIC_LOOK_S` (:class:`TopicLook`)."""
        partitions = self._look.partitions()
        if partitions is None:
            return False
        self._consumer = self._look.take()
        self._consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in partitions])
        return True

    def poll(self, timeout_s: float = 0.0) -> int:
        """Read and hand on what has arrived (waiting up to ``timeout_s``); returns the records read."""
        if self._consumer is None and not self._open():
            return 0
        messages = self._consumer.consume(POLL_BATCH, timeout_s)
        for message in messages:
            if message.error() is not None or message.key() is None:
                continue
            key = message.key().decode()
            self.records += 1
            if not message.value():
                self.on_tombstone(key)
                continue
            try:
                self.on_record(key, self._codec.decode(message.value()), message)
            except (DecodeError, ValueError) as exc:
                log.error("skipped the record of %r in %s: %s", key, self.topic, exc)
        return len(messages)

    def close(self) -> None:
        """Close the consumer (or the one still looking for the topic)."""
        self._look.close()
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
