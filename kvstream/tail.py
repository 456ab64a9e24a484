"""``kvstream tail``: print the decoded messages of a pipeline topic as JSON lines.

The schema is chosen by topic (:func:`schemas.topics.topic_family`): ``kv-events`` holds ``kv_event``
records, ``<app id>-kv-events-by-ownership`` holds ``ownership_batch`` messages (their items' events are
decoded too), ``<app id>-<table>-changelog`` holds the table's values, ``<app id>-repartition-source-clears``
the clear history, the two output topics their records, and ``kv-events-dead-letter`` holds original bytes
with the reason in a header. Bytes are shown as hex.

Built for speed (``make bench`` compares it with kcat on the same topic): one :class:`schemas.AvroCodec` per
schema family for the whole run, a converter to JSON-ready values built once per family from its schema,
messages consumed in batches from partitions assigned directly (no consumer group to join), JSON encoded by
msgspec and written one batch at a time.
"""

from __future__ import annotations

import sys
import time
import uuid
from typing import Any, Callable, TextIO

import msgspec
from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaException, TopicPartition

from kafka_io.config import CONNECT_TIMEOUT_S, client_config, unreachable
from schemas import AvroCodec, DecodeError
from schemas.topics import topic_family

_PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "string"})
_EVENT_NAMESPACE = "kvstream.v1."


def _jsonable(value: Any) -> Any:
    """Any decoded value made JSON-ready by walking it: bytes as hex, a ``(record name, record)`` union branch
    as the record with a ``type`` key. The generic fallback of :func:`value_converter`."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if len(value) == 2 and isinstance(value[0], str) and value[0].startswith(_EVENT_NAMESPACE):
            return {"type": value[0].rsplit(".", 1)[-1], **_jsonable(value[1])}  # an event union branch
        return [_jsonable(v) for v in value]
    return value


def _hex(value: bytes) -> str:
    return value.hex()


def _late_named(value: Any) -> Any:
    """A value of a named type defined in another schema file: an enum's symbol as is, anything else walked."""
    return value if type(value) is str else _jsonable(value)


def _converter(schema: Any, named: dict[str, Any]) -> Callable[[Any], Any] | None:
    """A function that makes a decoded value of ``schema`` JSON-ready (in place for records), or None when the
    value is JSON-ready as decoded. ``named`` collects the named types met so far (fastavro's parsed schemas name
    a type in full once, then refer to it by its full name)."""
    if isinstance(schema, str):
        if schema == "bytes":
            return _hex
        if schema in _PRIMITIVES:
            return None
        if schema not in named:  # a type defined in another schema file (e.g. the Tier enum): checked at run time
            return _late_named
        return _converter(named[schema], named)
    if isinstance(schema, list):
        return _union_converter(schema, named)
    kind = schema["type"]
    if kind in ("record", "error"):
        named[schema["name"]] = schema
        fields = [(f["name"], c) for f in schema["fields"] if (c := _converter(f["type"], named)) is not None]
        if not fields:
            return None

        def record(value: dict) -> dict:
            for name, convert in fields:
                item = value.get(name)
                if item is not None:
                    value[name] = convert(item)
            return value

        return record
    if kind in ("enum", "fixed"):
        named[schema["name"]] = schema
        return _hex if kind == "fixed" else None
    if kind == "array":
        items = _converter(schema["items"], named)
        return None if items is None else (lambda value: [items(v) for v in value])
    if kind == "map":
        values = _converter(schema["values"], named)
        return None if values is None else (lambda value: {k: values(v) for k, v in value.items()})
    return _converter(kind, named) if isinstance(kind, str) and kind != schema.get("name") else None


def _union_converter(branches: list, named: dict[str, Any]) -> Callable[[Any], Any] | None:
    """A union's value is the bare branch value, or ``(full name, record)`` for a union of records as the codec
    returns it: dispatched on the value's type at run time."""
    by_name: dict[str, Callable | None] = {}
    by_type: dict[type, Callable] = {}
    for branch in branches:
        resolved = named.get(branch, branch) if isinstance(branch, str) else branch
        convert = _converter(branch, named)
        if isinstance(resolved, dict) and resolved.get("type") in ("record", "error"):
            by_name[resolved["name"]] = convert
            if convert is not None:
                by_type[dict] = convert  # a union with one record branch reads as the bare record
        elif convert is not None:
            kind = resolved if isinstance(resolved, str) else resolved["type"]
            by_type[{"bytes": bytes, "fixed": bytes, "array": list, "map": dict}.get(kind, object)] = convert
    if not by_name and not by_type:
        return None

    def union(value: Any) -> Any:
        if type(value) is tuple:
            name, record = value
            convert = by_name.get(name)
            return {"type": name.rsplit(".", 1)[-1], **(record if convert is None else convert(record))}
        convert = by_type.get(type(value))
        return value if convert is None else convert(value)

    return union


def value_converter(codec: AvroCodec) -> Callable[[Any], Any]:
    """The function that turns ``codec.decode``'s records into JSON-ready values: bytes as hex, a union of
    records ``(full name, record)`` as the record with a ``type`` key (its short name). Built once from the
    codec's (reader) schema; records are converted in place."""
    try:
        convert = _converter(codec.schema.parsed, {})
    except (KeyError, TypeError, AttributeError):  # a schema shape the builder does not know: walk the values
        return _jsonable
    return convert or (lambda value: value)


class TopicDecoder:
    """Decodes the messages of one topic into JSON-ready dicts, reusing one codec per schema family.

    Args:
        topic: the topic; its schema family comes from :func:`schemas.topics.topic_family` (None: raw bytes,
            shown as hex).
        codecs: schema family -> codec, shared with other decoders (filled on first use).
    """

    def __init__(self, topic: str, codecs: dict[str, AvroCodec] | None = None) -> None:
        self.topic = topic
        self.family = topic_family(topic)
        self._codecs = {} if codecs is None else codecs
        # changelog and occupancy keys are UTF-8; block hashes and dead-letter keys are not
        self._text_keys = self.family not in (None, "kv_event", "residency_change")
        self._decode = self._convert = None
        if self.family is not None:
            codec = self._codec(self.family)
            self._decode, self._convert = codec.decode, value_converter(codec)
        if self.family == "ownership_batch":  # the items carry kv-events records, decoded too
            events = self._codec("kv_event")
            self._decode_event, self._convert_event = events.decode, value_converter(events)

    def _codec(self, family: str) -> AvroCodec:
        codec = self._codecs.get(family)
        if codec is None:
            codec = self._codecs[family] = AvroCodec(family)
        return codec

    def message(self, key: bytes | None, value: bytes | None, headers) -> dict:
        """One message as a JSON-ready dict: ``key`` (text, or hex), ``value`` (decoded; hex with ``error`` when
        it does not decode; None for a tombstone) and ``headers`` (text, only when there are any)."""
        out: dict[str, Any] = {"key": None if key is None else key.decode(errors="replace") if self._text_keys
                               else key.hex()}
        if value is None:
            out["value"] = None  # a tombstone
        elif self._decode is None:
            out["value"] = value.hex()
        else:
            try:
                decoded = self._decode(value)
                if self.family == "ownership_batch":
                    events = [item.pop("event") for item in decoded["events"]]
                    decoded = self._convert(decoded)
                    for item, event in zip(decoded["events"], events):
                        item["event"] = self._convert_event(self._decode_event(event))
                else:
                    decoded = self._convert(decoded)
                out["value"] = decoded
            except DecodeError as exc:
                out["value"], out["error"] = value.hex(), str(exc)
        if headers:
            out["headers"] = {k: v.decode(errors="replace") if isinstance(v, bytes) else v for k, v in headers}
        return out


def decode_message(topic: str, key: bytes | None, value: bytes | None, headers, codecs: dict) -> dict:
    """One message as a JSON-ready dict (see :meth:`TopicDecoder.message`); ``codecs`` (family -> codec) is
    reused across calls. For many messages of one topic, keep one :class:`TopicDecoder` instead."""
    return TopicDecoder(topic, codecs).message(key, value, headers)


def tail(bootstrap_servers: str, topic: str, *, from_beginning: bool, max_messages: int | None,
         idle_timeout_s: float | None, to_end: bool = False, out: TextIO | None = None,
         codecs: dict[str, AvroCodec] | None = None) -> int:
    """Print a topic's messages as JSON lines (``topic``, ``partition``, ``offset``, ``key``, ``value``,
    ``error`` and ``headers`` when there are any) until ``max_messages``, ``idle_timeout_s`` seconds without a
    message, or, with ``to_end``, the end of every partition as it was at the start (as ``kcat -e``).

    The partitions are assigned, not subscribed: no consumer group is joined and nothing is committed.
    ``codecs``: schema family -> reader, e.g. registry-aware ones (:func:`reader_codecs`); default: the schemas
    this version ships. ``out``: default, standard output as it is at the call (redirected or not).

    Returns:
        The number of messages printed.

    Raises:
        RuntimeError: the topic does not exist or the broker did not answer.
        ValueError: ``to_end`` without ``from_beginning`` (there would be nothing to read).
    """
    if to_end and not from_beginning:
        raise ValueError("--to-end stops at the end the topic has now: give --from-beginning with it")
    consumer = Consumer(client_config(bootstrap_servers, **{
        "group.id": f"kvstream-tail-{uuid.uuid4()}", "enable.auto.commit": False,
        "auto.offset.reset": "earliest" if from_beginning else "latest",
        "fetch.max.bytes": 64 << 20, "max.partition.fetch.bytes": 8 << 20}))
    decoder = TopicDecoder(topic, codecs)
    encode = msgspec.json.Encoder().encode
    out = sys.stdout if out is None else out
    binary = getattr(out, "buffer", None)
    printed = 0
    try:
        _, ends = _assign(consumer, bootstrap_servers, topic, from_beginning, to_end)
        last_message = time.monotonic()
        message_of = decoder.message
        while (max_messages is None or printed < max_messages) and (ends or not to_end):
            batch = consumer.consume(10_000 if max_messages is None else min(10_000, max_messages - printed), 0.5)
            if not batch:
                if idle_timeout_s is not None and time.monotonic() - last_message > idle_timeout_s:
                    break
                continue
            last_message = time.monotonic()
            lines = []
            append = lines.append
            for message in batch:
                if message.error():
                    continue
                p, offset = message.partition(), message.offset()
                if to_end:
                    end = ends.get(p)
                    if end is None or offset >= end:
                        continue
                    if offset + 1 >= end:
                        del ends[p]
                record = message_of(message.key(), message.value(), message.headers())
                append(encode({"topic": topic, "partition": p, "offset": offset, **record}))
            if lines:
                lines.append(b"")
                text = b"\n".join(lines)
                if binary is not None:
                    binary.write(text)
                else:
                    out.write(text.decode())
                printed += len(lines) - 1
        if binary is not None:
            binary.flush()
        out.flush()
        return printed
    finally:
        consumer.close()


def _assign(consumer: Consumer, bootstrap_servers: str, topic: str, from_beginning: bool,
            to_end: bool) -> tuple[list[int], dict[int, int]]:
    """Assign ``topic``'s partitions to ``consumer`` from their start or end; returns the partitions and, with
    ``to_end``, each non-empty partition's end offset as it is now (the partitions to read up to it).

    Raises:
        RuntimeError: the topic does not exist or the broker did not answer.
    """
    try:
        metadata = consumer.list_topics(topic, timeout=CONNECT_TIMEOUT_S)
    except KafkaException as exc:
        raise unreachable(consumer, bootstrap_servers, exc, CONNECT_TIMEOUT_S) from None
    if topic not in metadata.topics or metadata.topics[topic].error:
        raise RuntimeError(f"topic {topic} does not exist on {bootstrap_servers}")
    partitions = sorted(metadata.topics[topic].partitions)
    ends: dict[int, int] = {}
    if to_end:
        for p in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if high > low:
                ends[p] = high
        partitions = sorted(ends)
    start = OFFSET_BEGINNING if from_beginning else OFFSET_END
    consumer.assign([TopicPartition(topic, p, start) for p in partitions])
    return partitions, ends


def reader_codecs(bootstrap_servers: str, schema_registry_url: str, schemas_topic: str) -> dict[str, AvroCodec]:
    """A reader codec for every schema family of the pipeline's topics, resolving Confluent schema ids through
    ``schema_registry_url`` (empty: none) and newer single-object writers through ``schemas_topic``."""
    from kafka_io.schema_registry import reader_codec
    from schemas.topics import TABLE_FAMILIES

    families = {"kv_event", "residency_change", "tier_occupancy", "ownership_batch", "source_clears",
                *TABLE_FAMILIES.values()}
    return {family: reader_codec(family, bootstrap_servers, schema_registry_url, schemas_topic)
            for family in sorted(families)}
