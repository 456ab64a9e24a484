"""How writer schemas reach readers: a Confluent-compatible schema registry, or, without one, the schemas topic.

Registry mode (``--schema-registry-url`` / ``KVSTREAM_SCHEMA_REGISTRY_URL``): every topic the pipeline writes
for others carries the Confluent wire format, its schema registered under the ``<topic>-value`` subject
(TopicNameStrategy), so Kafka Connect, ksqlDB, Flink, Spark, ClickHouse and ``kcat -s value=avro`` read it.
The registry's TLS and basic-auth settings come from the environment only (:data:`REGISTRY_ENVIRONMENT`),
as the broker's security settings do (:mod:`kafka_io.config`): they never reach a command line or a log.

Without a registry, records carry Avro single-object framing, whose fingerprint names the writer schema. A
reader knows the versions in ``schemas/``; for a newer producer's schema, each writer publishes its schema
to the compacted schemas topic (``<prefix>kvstream-schemas``, keyed by the fingerprint in hex) before its
first record, and readers look an unknown fingerprint up there (:class:`SchemasTopicReader`), so a
producer upgraded before its workers loses nothing (docs/contract.md, "Versions and compatibility").
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Annotated

from confluent_kafka import Producer
from pydantic import AfterValidator, Field

from kafka_io.admin import ensure_topics
from kafka_io.config import producer_config
from kafka_io.reader import messages_to_end
from schemas.codec import AvroCodec, SchemaVersion, WriterSchemaSource

log = logging.getLogger(__name__)

#: Environment variable -> confluent-kafka ``SchemaRegistryClient`` setting.
REGISTRY_ENVIRONMENT = {
    "KVSTREAM_SCHEMA_REGISTRY_SSL_CA_LOCATION": "ssl.ca.location",
    "KVSTREAM_SCHEMA_REGISTRY_SSL_CERTIFICATE_LOCATION": "ssl.certificate.location",
    "KVSTREAM_SCHEMA_REGISTRY_SSL_KEY_LOCATION": "ssl.key.location",
    #: ``USER:PASSWORD`` for HTTP basic authentication.
    "KVSTREAM_SCHEMA_REGISTRY_BASIC_AUTH_USER_INFO": "basic.auth.user.info",
}
#: Topic config of the schemas topic: compacted, so it keeps one record per schema for ever.
SCHEMAS_TOPIC_CONFIG = {"cleanup.policy": "compact"}
_URL = re.compile(r"^(https?://[^/\s]+(/\S*)?|mock://\S+)$")


def check_registry_url(url: str) -> str:
    """``url`` if empty (no registry) or an ``http(s)://HOST[:PORT][/PATH]`` URL (``mock://`` for tests).

    Raises:
        ValueError: anything else; the message shows the accepted form.
    """
    url = url.strip()
    if url and not _URL.match(url):
        raise ValueError(f"schema registry URL {url!r} is not http(s)://HOST[:PORT][/PATH], e.g. "
                         "http://127.0.0.1:8081 (Confluent) or http://127.0.0.1:8081/apis/ccompat/v7 (Apicurio)")
    return url.rstrip("/")


#: The type of a settings field holding a registry URL: checked by :func:`check_registry_url`.
RegistryUrl = Annotated[str, AfterValidator(check_registry_url)]


def schema_registry_field(reads_only: bool = False):
    """The ``schema_registry_url`` field every command's settings share (flags ``--schema-registry-url`` and
    ``--schema-registry``, variable ``KVSTREAM_SCHEMA_REGISTRY_URL``); ``reads_only`` for a command that writes
    no records (tail, export), whose help says what the registry is for there."""
    use = ("resolve the schema ids of Confluent-framed records; empty: no registry (single-object framing, writer "
           "schemas from the schemas topic)"
           if reads_only else "write the Confluent wire format; empty: single-object framing, no registry")
    return Field("", description=f"schema registry URL (Confluent API, e.g. Apicurio's .../apis/ccompat/v7): {use}",
                 json_schema_extra={"flag_aliases": ["--schema-registry"]})


def registry_config(url: str) -> dict | None:
    """The ``SchemaRegistryClient`` configuration for ``url`` with the environment's TLS and basic auth; None
    for no registry (an empty URL)."""
    if not url:
        return None
    config = {"url": url}
    for variable, setting in REGISTRY_ENVIRONMENT.items():
        value = os.environ.get(variable)
        if value:
            config[setting] = value
    return config


def publish_schema(bootstrap_servers: str, topic: str, *versions: SchemaVersion, timeout_s: float = 30.0) -> None:
    """Write each of ``versions``' schemas to the schemas ``topic`` (created compacted if absent), keyed by its
    fingerprint in hex, and wait for the broker's acknowledgements: one topic check and one producer for all.

    Raises:
        RuntimeError: the topic could not be created or a record was not acknowledged in ``timeout_s``.
    """
    ensure_topics(bootstrap_servers, {topic: 1}, configs={topic: SCHEMAS_TOPIC_CONFIG})
    errors: list[str] = []

    def delivered(err, _message) -> None:
        if err is not None:
            errors.append(str(err))

    producer = Producer(producer_config(bootstrap_servers))
    for version in versions:
        producer.produce(topic, key=version.fingerprint.hex().encode(), value=version.text.encode(),
                         on_delivery=delivered)
    if producer.flush(timeout_s) or errors:
        names = ", ".join(f"{v.family} v{v.version}" for v in versions)
        raise RuntimeError(f"could not publish the schemas of {names} to {topic}: "
                           f"{errors[0] if errors else 'not acknowledged in time'}")


class SchemasTopicReader:
    """A :data:`schemas.codec.WriterSchemaSource` backed by the schemas topic: fingerprint -> schema JSON.

    The topic is read to its end on the first lookup of a fingerprint it has not seen, at most once per
    ``min_interval_s`` (a record with a garbage fingerprint must not cost a read each time). Reads block for
    up to ``timeout_s``; they happen once per new writer schema, not per record.
    """

    def __init__(self, bootstrap_servers: str, topic: str, min_interval_s: float = 5.0,
                 timeout_s: float = 30.0) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.min_interval_s = min_interval_s
        self.timeout_s = timeout_s
        self._schemas: dict[bytes, str] = {}
        self._read_at = float("-inf")

    def __call__(self, fingerprint: bytes) -> str | None:
        """The JSON text published under ``fingerprint``, or None."""
        if fingerprint not in self._schemas and time.monotonic() - self._read_at >= self.min_interval_s:
            self._read_at = time.monotonic()
            for message in messages_to_end(self.bootstrap_servers, self.topic, timeout_s=self.timeout_s):
                key, value = message.key(), message.value()
                try:
                    self._schemas[bytes.fromhex(key.decode())] = value.decode()
                except (AttributeError, ValueError):
                    log.warning("ignoring a record of %s that is not fingerprint -> schema", self.topic)
            log.info("read %d writer schemas from %s", len(self._schemas), self.topic)
        return self._schemas.get(fingerprint)


def writer_codec(family: str, bootstrap_servers: str, topic: str, registry_url: str, schemas_topic: str,
                 version: int | None = None, publish: bool = True) -> AvroCodec:
    """The codec that writes ``family`` records to ``topic``: Confluent wire format with the schema registered
    under ``<topic>-value`` when ``registry_url`` is set, else single-object framing with the schema published
    to ``schemas_topic`` (now, or, with ``publish`` false, by the caller with :func:`publish_schema` before
    its first record).

    Raises:
        schemas.codec.RegistryRefused: the registry refused the schema (e.g. not BACKWARD compatible).
        RuntimeError: the schemas topic could not be written.
    """
    config = registry_config(registry_url)
    if config:
        return AvroCodec(family, version, registry=config, subject=f"{topic}-value")
    codec = AvroCodec(family, version)
    if publish:
        publish_schema(bootstrap_servers, schemas_topic, codec.schema)
    return codec


def reader_codec(family: str, bootstrap_servers: str, registry_url: str, schemas_topic: str) -> AvroCodec:
    """A codec that reads ``family`` records in either framing, written with any schema version it ships or
    that the registry (by schema id) or the schemas topic (by fingerprint) holds."""
    source: WriterSchemaSource = SchemasTopicReader(bootstrap_servers, schemas_topic)
    return AvroCodec(family, registry=registry_config(registry_url), writer_schemas=source)
