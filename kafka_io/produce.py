"""Produce with back-pressure: the one place that waits when librdkafka's local queue is full."""

from __future__ import annotations

from confluent_kafka import Producer

#: Seconds to let librdkafka drain its queue before trying a refused record again.
QUEUE_FULL_POLL_S = 0.05


def produce_waiting(producer: Producer, topic: str, value: bytes | None, key: bytes | None = None,
                    **kwargs) -> None:
    """``producer.produce(topic, value, key, **kwargs)``, waiting while the local queue is full.

    librdkafka refuses a record with ``BufferError`` when ``queue.buffering.max.messages`` or ``.kbytes``
    is reached; polling serves delivery reports and frees room. Hot paths call ``producer.produce``
    themselves and fall back to this on ``BufferError``, so the common case costs no extra call.

    Args:
        kwargs: ``partition``, ``headers``, ``on_delivery`` as confluent-kafka takes them.
    """
    while True:
        try:
            producer.produce(topic, value, key, **kwargs)
            return
        except BufferError:
            producer.poll(QUEUE_FULL_POLL_S)
