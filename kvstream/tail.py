"""``kvstream tail``: print the decoded messages of a pipeline topic as JSON lines.

The schema is chosen by topic: ``kv-events`` holds ``kv_event`` records,
``<app id>-kv-events-by-ownership`` holds ``ownership_batch`` messages (their items'
events are decoded too), ``<app>-<table>-changelog`` holds the table's values,
and ``kv-events-dead-letter`` holds original bytes with the reason in a header.
Bytes are shown as hex.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from typing import Any, TextIO

from confluent_kafka import Consumer, KafkaException

from kafka_io.config import client_config, unreachable
from schemas import AvroCodec, DecodeError
from schemas.topics import topic_family


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if len(value) == 2 and isinstance(value[0], str) and value[0].startswith("kvstream.v1."):
            return {"type": value[0].rsplit(".", 1)[-1], **_jsonable(value[1])}  # an event union branch
        return [_jsonable(v) for v in value]
    return value


def decode_message(topic: str, key: bytes | None, value: bytes | None, headers, codecs: dict) -> dict:
    """One message as a JSON-ready dict: ``key``, ``value`` (decoded, or hex with ``error``) and ``headers``."""
    family = topic_family(topic)
    # changelog and occupancy keys are UTF-8; block hashes and dead-letter keys are not
    text_keys = family not in (None, "kv_event", "residency_change")
    out: dict[str, Any] = {"key": None if key is None else key.decode(errors="replace") if text_keys else key.hex()}
    if value is None:
        out["value"] = None  # a tombstone
    elif family is None:
        out["value"] = value.hex()
    else:
        codec = codecs.get(family) or codecs.setdefault(family, AvroCodec(family))  # one codec per family
        try:
            decoded = codec.decode(value)
            if family == "ownership_batch":
                events = codecs.get("kv_event") or codecs.setdefault("kv_event", AvroCodec("kv_event"))
                for item in decoded["events"]:
                    item["event"] = events.decode(item["event"])
            out["value"] = _jsonable(decoded)
        except DecodeError as exc:
            out["value"], out["error"] = value.hex(), str(exc)
    if headers:
        out["headers"] = {k: v.decode(errors="replace") if isinstance(v, bytes) else v for k, v in headers}
    return out


def tail(bootstrap_servers: str, topic: str, *, from_beginning: bool, max_messages: int | None,
         idle_timeout_s: float | None, out: TextIO = sys.stdout) -> int:
    """Print a topic's messages as JSON lines until ``max_messages`` or ``idle_timeout_s`` without a message.

    Returns:
        The number of messages printed.

    Raises:
        RuntimeError: the topic does not exist or the broker did not answer.
    """
    consumer = Consumer(client_config(bootstrap_servers, **{
        "group.id": f"kvstream-tail-{uuid.uuid4()}", "enable.auto.commit": False,
        "auto.offset.reset": "earliest" if from_beginning else "latest"}))
    codecs: dict = {}
    printed = 0
    try:
        try:
            metadata = consumer.list_topics(topic, timeout=10)
        except KafkaException as exc:
            raise unreachable(consumer, bootstrap_servers, exc) from None
        if topic not in metadata.topics or metadata.topics[topic].error:
            raise RuntimeError(f"topic {topic} does not exist on {bootstrap_servers}")
        consumer.subscribe([topic])
        last_message = time.monotonic()
        while max_messages is None or printed < max_messages:
            message = consumer.poll(0.5)
            if message is None:
                if idle_timeout_s is not None and time.monotonic() - last_message > idle_timeout_s:
                    break
                continue
            if message.error():
                continue
            last_message = time.monotonic()
            record = {"topic": topic, "partition": message.partition(), "offset": message.offset(),
                      **decode_message(topic, message.key(), message.value(), message.headers(), codecs)}
            out.write(json.dumps(record) + "\n")
            printed += 1
        out.flush()
        return printed
    finally:
        consumer.close()

