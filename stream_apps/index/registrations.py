"""Registrations shared by every process: the compacted topic ``kv-instances``.

``POST /register`` (Mooncake's conductor body) records an instance's model, block size, tenant, endpoints and
hash profile. Kept only in the process that was asked, a router registering with one replica would get other
answers from the next; so the process that was asked also writes the registration to ``kv-instances``
(Avro ``instance_registration``, keyed by instance id, a tombstone for ``POST /unregister``), and every worker,
index replica, embedded index and following bridge (``kvstream bridge --follow-registrations``) reads it from the
beginning, as Kafka Streams applications read a global table. The latest record of an instance is its
registration: the writer merges the data-parallel ranks before it writes (docs/querying.md, ``POST /register``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from confluent_kafka import Producer

from kafka_io.admin import ensure_topics
from kafka_io.config import producer_config
from kafka_io.reader import messages_to_end
from schemas import AvroCodec, DecodeError
from stream_apps.index.compacted_feed import CompactedFeed
from stream_apps.index.fleet_index import DEFAULT_TENANT, SourceInfo

log = logging.getLogger(__name__)

#: Partitions of ``kv-instances``: a handful of records per instance, read whole by every process.
INSTANCES_PARTITIONS = 1
#: Topic configs of ``kv-instances``: compacted, so it holds the latest registration of each instance.
INSTANCES_TOPIC_CONFIG = {"cleanup.policy": "compact"}


def registration_record(info: SourceInfo, now: float | None = None) -> dict:
    """The ``instance_registration`` record of ``info``."""
    return {"instance_id": info.instance_id, "model_name": info.model_name, "block_size": info.block_size,
            "tenant_id": info.tenant_id, "endpoint": info.endpoint, "replay_endpoint": info.replay_endpoint,
            "engine_type": info.engine_type, "dp_ranks": sorted(info.dp_ranks), "lora_name": info.lora_name,
            "hash_profile": None if info.hash_profile is None else json.dumps(info.hash_profile, sort_keys=True),
            "registered_at": time.time() if now is None else now}


def registration_of(record: dict) -> SourceInfo:
    """The :class:`SourceInfo` of a decoded ``instance_registration`` record.

    Raises:
        ValueError: a ``hash_profile`` that is not the JSON of a map.
    """
    profile = record["hash_profile"]
    if profile is not None:
        profile = json.loads(profile)
        if not isinstance(profile, dict):
            raise ValueError("hash_profile is not a JSON map")
    return SourceInfo(record["instance_id"], model_name=record["model_name"], block_size=record["block_size"],
                      tenant_id=record["tenant_id"] or DEFAULT_TENANT, endpoint=record["endpoint"],
                      replay_endpoint=record["replay_endpoint"], engine_type=record["engine_type"],
                      dp_ranks=set(record["dp_ranks"]), lora_name=record["lora_name"], hash_profile=profile)


def merge_registration(known: SourceInfo | None, given: SourceInfo) -> SourceInfo:
    """``given`` over ``known``: the fields ``given`` sets replace ``known``'s, the others (a router's hash profile,
    say) are kept, and the data-parallel ranks are joined. A producer that knows some of an instance's metadata
    (its model and block size) registers it without erasing what a router registered."""
    if known is None:
        return given
    return SourceInfo(
        given.instance_id, model_name=given.model_name or known.model_name,
        block_size=given.block_size or known.block_size,
        tenant_id=given.tenant_id if given.tenant_id != DEFAULT_TENANT else known.tenant_id,
        endpoint=given.endpoint or known.endpoint, replay_endpoint=given.replay_endpoint or known.replay_endpoint,
        engine_type=given.engine_type or known.engine_type, dp_ranks=given.dp_ranks | known.dp_ranks,
        lora_name=given.lora_name or known.lora_name,
        hash_profile=given.hash_profile if given.hash_profile is not None else known.hash_profile)


def reduced_registration(info: SourceInfo, rank: int) -> SourceInfo | None:
    """``info`` without data-parallel rank ``rank``, or None when no rank is left (the registration goes)."""
    ranks = (info.dp_ranks or {0}) - {rank}
    if not ranks:
        return None
    return SourceInfo(info.instance_id, model_name=info.model_name, block_size=info.block_size,
                      tenant_id=info.tenant_id, endpoint=info.endpoint, replay_endpoint=info.replay_endpoint,
                      engine_type=info.engine_type, dp_ranks=ranks, lora_name=info.lora_name,
                      hash_profile=info.hash_profile)


def read_registrations(bootstrap_servers: str, topic: str, timeout_s: float = 30.0,
                       codec: AvroCodec | None = None) -> dict[str, SourceInfo]:
    """Every instance's registration in ``topic``, read to its end as of the call (empty when the topic does not
    exist yet). Records that do not decode are skipped, as :class:`RegistrationsFeed` skips them.

    Raises:
        TimeoutError: the end was not reached within ``timeout_s``.
    """
    codec = codec or AvroCodec("instance_registration")
    found: dict[str, SourceInfo] = {}
    for message in messages_to_end(bootstrap_servers, topic, timeout_s):
        if message.key() is None:
            continue
        instance = message.key().decode()
        if not message.value():
            found.pop(instance, None)
            continue
        try:
            found[instance] = registration_of(codec.decode(message.value()))
        except (DecodeError, ValueError) as exc:
            log.error("skipped the registration of %r in %s: %s", instance, topic, exc)
    return found


def register_sources(bootstrap_servers: str, topic: str, infos: list[SourceInfo],
                     timeout_s: float = 30.0) -> list[SourceInfo]:
    """Register ``infos`` (a producer's sources: ``kvstream bridge --model-name``, ``kvstream simulate``), each
    merged into the instance's registration so far (:func:`merge_registration`); returns what was written.

    Raises:
        RuntimeError: the broker did not take a record (:meth:`RegistrationWriter.write`).
        TimeoutError: the registrations so far could not be read within ``timeout_s``.
    """
    known = read_registrations(bootstrap_servers, topic, timeout_s)
    writer = RegistrationWriter(bootstrap_servers, topic, timeout_s)
    merged: dict[str, SourceInfo] = {}
    for info in infos:  # ranks of one instance given apart (one endpoint per rank) join before the write
        merged[info.instance_id] = merge_registration(merged.get(info.instance_id) or known.get(info.instance_id),
                                                      info)
    for info in merged.values():
        writer.write(info)
    writer.close()
    return list(merged.values())


class RegistrationWriter:
    """Writes registrations to ``kv-instances`` and waits for the broker (a registration is rare, and a router
    that got "registered successfully" may ask another replica next)."""

    def __init__(self, bootstrap_servers: str, topic: str, timeout_s: float = 10.0) -> None:
        self.topic = topic
        self.timeout_s = timeout_s
        self._bootstrap_servers = bootstrap_servers
        self._codec = AvroCodec("instance_registration")
        self._producer: Producer | None = None

    def _send(self, key: str, value: bytes | None) -> None:
        if self._producer is None:
            ensure_topics(self._bootstrap_servers, {self.topic: INSTANCES_PARTITIONS},
                          configs={self.topic: INSTANCES_TOPIC_CONFIG}, timeout_s=self.timeout_s)
            self._producer = Producer(producer_config(self._bootstrap_servers))
        failures: list[str] = []
        self._producer.produce(self.topic, key=key.encode(), value=value,
                               on_delivery=lambda err, _: failures.append(str(err)) if err else None)
        if self._producer.flush(self.timeout_s) or failures:
            raise RuntimeError(f"{self.topic} did not take the record of {key!r} within {self.timeout_s:.0f} s"
                               + (f": {failures[0]}" if failures else ""))

    def write(self, info: SourceInfo) -> None:
        """Write ``info`` (the whole registration, ranks merged).

        Raises:
            RuntimeError: the broker did not acknowledge it, or the topic could not be created.
        """
        self._send(info.instance_id, self._codec.encode(registration_record(info)))

    def remove(self, instance_id: str) -> None:
        """Write the tombstone of ``instance_id``.

        Raises:
            RuntimeError: as :meth:`write`.
        """
        self._send(instance_id, None)

    def close(self) -> None:
        """Deliver what is queued (up to the timeout) and drop the producer."""
        if self._producer is not None:
            self._producer.flush(self.timeout_s)
            self._producer = None


class RegistrationsFeed(CompactedFeed):
    """Reads ``kv-instances`` from the beginning (no group, no commits) and hands each registration or
    unregistration to ``apply``.

    Args:
        apply: called with (instance id, :class:`SourceInfo` or None for a tombstone), in the topic's order.
        codec: reads ``instance_registration`` records (a :func:`kafka_io.schema_registry.reader_codec`, or the
            plain codec).
    """

    def __init__(self, bootstrap_servers: str, topic: str, apply: Callable[[str, SourceInfo | None], None],
                 codec: AvroCodec | None = None) -> None:
        super().__init__(bootstrap_servers, topic, codec or AvroCodec("instance_registration"),
                         "kvstream-registrations")
        self._apply = apply

    def on_record(self, key: str, record: dict, message) -> None:
        self._apply(key, registration_of(record))

    def on_tombstone(self, key: str) -> None:
        self._apply(key, None)
