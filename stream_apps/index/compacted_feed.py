"""Following a small compacted topic from its beginning, with no consumer group and no commits: the base of the
read path's side feeds (the sources' leases of an index replica, :class:`~stream_apps.index.liveness.SourcesFeed`;
the registrations, :class:`~stream_apps.index.registrations.RegistrationsFeed`)."""

from __future__ import annotations

import logging
import time
import uuid

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Message, TopicPartition

from kafka_io.config import client_config
from schemas import AvroCodec, DecodeError

log = logging.getLogger(__name__)

#: Seconds between looks for a topic that does not exist yet (nobody has written it).
TOPIC_LOOK_S = 1.0
#: Most records one :meth:`CompactedFeed.poll` reads.
POLL_BATCH = 500


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
        self._bootstrap_servers = bootstrap_servers
        self._group_prefix = group_prefix
        self._consumer: Consumer | None = None
        #: The consumer that looks for the topic until it exists; it becomes :attr:`_consumer` then.
        self._looking: Consumer | None = None
        self._next_look = 0.0

    def on_record(self, key: str, record: dict, message: Message) -> None:
        """One decoded value of ``key``."""
        raise NotImplementedError

    def on_tombstone(self, key: str) -> None:
        """``key`` was deleted."""
        raise NotImplementedError

    def _open(self) -> bool:
        """Assigns every partition from its beginning; False while the topic does not exist, looked for again at
        most every :data:`TOPIC_LOOK_S`. The consumer that looks is kept between looks: a new client for each
        one started threads and connections and asked the broker for its API versions every second, for as
        long as nobody wrote the topic (a fleet without registrations never does)."""
        if time.monotonic() < self._next_look:
            return False
        self._next_look = time.monotonic() + TOPIC_LOOK_S
        if self._looking is None:
            self._looking = Consumer(client_config(self._bootstrap_servers, **{
                "group.id": f"{self._group_prefix}-{uuid.uuid4().hex}", "enable.auto.commit": False,
                "auto.offset.reset": "earliest"}))
        try:
            topic = self._looking.list_topics(self.topic, timeout=10).topics.get(self.topic)
        except KafkaException:
            topic = None
        if topic is None or topic.error is not None or not topic.partitions:
            return False
        consumer, self._looking = self._looking, None
        consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in topic.partitions])
        self._consumer = consumer
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
        for consumer in (self._consumer, self._looking):
            if consumer is not None:
                consumer.close()
        self._consumer = self._looking = None
