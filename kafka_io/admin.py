"""Topic administration shared by every command: create topics, read partition counts and group progress."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

from aiokafka import TopicPartition as AioTopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, OffsetSpec, ResourceType

from kafka_io.config import CONNECT_TIMEOUT_S, aiokafka_security, client_config, topic_replication, unreachable

log = logging.getLogger(__name__)


def ensure_topics(bootstrap_servers: str, topics: dict[str, int], *, timeout_s: float = 30.0,
                  configs: dict[str, dict[str, str]] | None = None,
                  connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Create the topics that do not exist yet, replicated as the cluster expects
    (:func:`kafka_io.config.topic_replication`: ``min(3, brokers)`` replicas, ``min.insync.replicas=2`` once
    that is 3; one replica and the broker's defaults on one broker).

    On a cluster of two or more brokers, each of ``topics`` that exists already with fewer replicas than that, or
    with ``min.insync.replicas`` below the one kvstream would give it (1 on a 3-replica cluster), is named in a
    warning; it is used as it is.

    Args:
        topics: topic name -> partition count.
        configs: topic name -> topic configs for created topics (e.g. ``cleanup.policy``).
        timeout_s: longest wait for the topics to be created.
        connect_timeout_s: longest wait for the brokers' first answer (at most ``timeout_s``).

    Raises:
        RuntimeError: the broker did not answer or refused to create a topic; an
            existing topic with a different partition count is an error too,
            because producers and the stream app must agree on it.
    """
    admin = AdminClient(client_config(bootstrap_servers))
    metadata = cluster_metadata(bootstrap_servers, min(timeout_s, connect_timeout_s), admin)
    for name, partitions in topics.items():
        existing = metadata.topics.get(name)
        if existing is not None and not existing.error and len(existing.partitions) != partitions:
            raise RuntimeError(
                f"topic {name} exists with {len(existing.partitions)} partitions, expected {partitions}")
    brokers = len(metadata.brokers)
    factor, min_isr = topic_replication(brokers)
    replication = {"min.insync.replicas": str(min_isr)} if min_isr is not None else {}
    missing = [NewTopic(n, p, replication_factor=factor, config={**replication, **(configs or {}).get(n, {})})
               for n, p in topics.items() if n not in metadata.topics]
    existing = [n for n in topics if n in metadata.topics and not metadata.topics[n].error]
    if brokers > 1 and existing:
        _warn_under_replicated(admin, metadata, existing, factor, min_isr)
    if not missing:
        return
    for name, future in admin.create_topics(missing, operation_timeout=timeout_s).items():
        try:
            future.result()
        except KafkaException as exc:
            if exc.args[0].name() != "TOPIC_ALREADY_EXISTS":
                raise RuntimeError(f"could not create topic {name}: {exc}") from None


def _warn_under_replicated(admin: AdminClient, metadata, names: list[str], factor: int, min_isr: int | None) -> None:
    """Log a warning per topic of ``names`` with fewer replicas than ``factor`` in a partition, or a
    ``min.insync.replicas`` below ``min_isr``."""
    for name in names:
        replicas = min((len(p.replicas) for p in metadata.topics[name].partitions.values()), default=factor)
        if replicas < factor:
            log.warning("topic %s has %d replica(s) per partition, fewer than the %d this cluster of %d brokers "
                        "gives the topics kvstream creates: a broker's loss can lose or stop it "
                        "(kafka-reassign-partitions raises the factor)", name, replicas, factor,
                        len(metadata.brokers))
    if min_isr is None:
        return
    resources = [ConfigResource(ResourceType.TOPIC, name) for name in names]
    try:
        described = admin.describe_configs(resources, request_timeout=10)
        for resource, future in described.items():
            entry = future.result().get("min.insync.replicas")
            if entry is not None and entry.value is not None and int(entry.value) < min_isr:
                log.warning("topic %s has min.insync.replicas=%s on a replicated cluster (kvstream gives its "
                            "topics %d): an acknowledged write may then live on one broker only "
                            "(kafka-configs --alter --add-config min.insync.replicas=%d)",
                            resource.name, entry.value, min_isr, min_isr)
    except KafkaException as exc:  # a check, not a precondition
        log.warning("could not read the configs of the existing topics to check min.insync.replicas: %s", exc)


def cluster_metadata(bootstrap_servers: str, wait_s: float = CONNECT_TIMEOUT_S, admin: AdminClient | None = None):
    """The cluster's metadata (confluent-kafka's ``ClusterMetadata``: brokers, topics), asked until the brokers
    answer or ``wait_s`` seconds have passed. A command that needs Kafka calls it first, so that a wrong address
    or a broker that is down is said at once, with the reason (:func:`kafka_io.config.unreachable`).

    Raises:
        RuntimeError: no answer within ``wait_s``.
    """
    admin = admin or AdminClient(client_config(bootstrap_servers))
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return admin.list_topics(timeout=max(0.5, deadline - time.monotonic()))
        except KafkaException as exc:
            if time.monotonic() >= deadline:
                raise unreachable(admin, bootstrap_servers, exc, wait_s) from None


def topic_partitions(bootstrap_servers: str, topic: str, timeout_s: float = CONNECT_TIMEOUT_S) -> int:
    """Number of partitions of ``topic``.

    Raises:
        RuntimeError: the topic does not exist or the broker did not answer.
    """
    admin = AdminClient(client_config(bootstrap_servers))
    try:
        metadata = admin.list_topics(topic, timeout=timeout_s)
    except KafkaException as exc:
        raise unreachable(admin, bootstrap_servers, exc, timeout_s) from None
    info = metadata.topics.get(topic)
    if info is None or info.error or not info.partitions:
        raise RuntimeError(f"topic {topic} does not exist on {bootstrap_servers}")
    return len(info.partitions)


@dataclass
class GroupProgress:
    """Committed offsets of a consumer group against the end offsets of its topics, in messages."""

    committed: int
    end: int

    @property
    def lag(self) -> int:
        """Messages not yet committed."""
        return self.end - self.committed


#: Seconds a :class:`GroupProgressReader` keeps a topic list's partitions before it asks for them again.
PARTITIONS_REFRESH_S = 30.0
#: Seconds of disuse after which a :class:`GroupProgressReader` makes its aiokafka client anew before reading: the
#: client's event loop runs only during readings, so it never sees the broker close an idle connection (Kafka's
#: ``connections.max.idle.ms``, 10 minutes by default) and would send its next request on a dead socket.
CLIENT_IDLE_S = 300.0


class GroupProgressReader:
    """Reads consumer groups' progress again and again over the same two clients.

    A poll that made its clients anew each time (a librdkafka admin client, an aiokafka admin client with its
    bootstrap, ApiVersions and Metadata requests) cost the broker about 10-30 ms of CPU per group read, several
    times a second in a wait loop: on a small host that is CPU the stream app being waited for does not get.
    Here the clients are made once and kept: the librdkafka one for metadata and offsets, the aiokafka one, started
    once on an event loop of the reader's own, for the committed offsets (see :meth:`partition_progress`).

    Blocking (from a coroutine, call it in a thread). Readings from several threads take turns: a worker shares
    one reader between its lag metric and its fleet views, whose reads run in the event loop's executor and may
    outlive a cancelled request. Close it when done (or use it as a context manager).

    Args:
        bootstrap_servers: Kafka bootstrap servers.
        admin: a librdkafka admin client to share, instead of one of the reader's own.
    """

    def __init__(self, bootstrap_servers: str, admin: AdminClient | None = None) -> None:
        self.bootstrap_servers = bootstrap_servers
        #: The librdkafka client, made at the first reading (as the aiokafka one): a reader costs no connection
        #: until it is used.
        self._admin_client = admin
        self._loop = asyncio.new_event_loop()
        #: One reading at a time: the clients and the loop are not for concurrent use.
        self._lock = threading.Lock()
        self._offsets_client: AIOKafkaAdminClient | None = None
        #: time.monotonic() of the aiokafka client's last reading.
        self._offsets_used_at = 0.0
        #: (topic, ...) -> (monotonic time read, their partitions), once every one of them exists; read again after
        #: :data:`PARTITIONS_REFRESH_S`, so that a reader kept for a process's life sees partitions added later.
        self._partitions: dict[tuple[str, ...], tuple[float, list[TopicPartition]]] = {}

    @property
    def _admin(self) -> AdminClient:
        if self._admin_client is None:
            self._admin_client = AdminClient(client_config(self.bootstrap_servers))
        return self._admin_client

    def __enter__(self) -> GroupProgressReader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        # a reader kept for a process's life (the fleet views') is never closed by its owner: without this its
        # aiokafka connections would be torn down with their loop already gone, each logged as an asyncio error
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a finalizer has no one to tell
            pass

    def close(self) -> None:
        """Stop the aiokafka client and the reader's event loop; the reader cannot be used afterwards. Callable
        from a thread that runs an event loop of its own (the garbage collector may call it there): the reader's
        loop is then run in a short-lived thread."""
        if self._loop.is_closed():
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop runs in this thread: the reader's can run here
            self._close_now()
            return
        closing = threading.Thread(target=self._close_now, name="kvstream-progress-reader-close", daemon=True)
        closing.start()
        closing.join(10.0)

    def _close_now(self) -> None:
        with self._lock:
            try:
                self._drop_offsets_client()
            finally:
                self._loop.close()

    def _drop_offsets_client(self) -> None:
        """Close the aiokafka client, if any; the next reading makes a new one."""
        self._loop.run_until_complete(self._close_offsets_client())

    async def _close_offsets_client(self) -> None:
        """:meth:`_drop_offsets_client` from within the reader's loop."""
        client, self._offsets_client = self._offsets_client, None
        if client is not None:
            try:
                await client.close()
            except (KafkaError, OSError):  # a broker gone meanwhile: the client is closed all the same
                pass

    def partition_progress(self, group: str, topics: list[str]) -> dict[tuple[str, int], GroupProgress]:
        """Per (topic, partition): how far ``group`` has committed, counted from the partition's start offset.

        Committed offsets come from aiokafka's admin client: librdkafka 2.16's ListConsumerGroupOffsets crashes
        the process (NULL ``rd_kafka_cgrp_op`` in ``rd_kafka_handle_OffsetFetch``) when the group coordinator
        answers with an error, e.g. while it is still loading. Topics that do not exist are left out.

        A reading that fails leaves nothing behind: the next one asks for the partitions again, over a new aiokafka
        client.

        Raises:
            RuntimeError: the broker did not answer, or the group coordinator is not ready yet.
        """
        with self._lock:
            return self._partition_progress(group, topics)

    def _partition_progress(self, group: str, topics: list[str]) -> dict[tuple[str, int], GroupProgress]:
        try:
            partitions = self._topic_partitions(topics)
            if not partitions:
                return {}
            committed = self._loop.run_until_complete(self._committed_offsets(group, partitions))
            earliest = self._admin.list_offsets({tp: OffsetSpec.earliest() for tp in partitions})
            latest = self._admin.list_offsets({tp: OffsetSpec.latest() for tp in partitions})
            progress = {}
            for tp in partitions:
                low, high = earliest[tp].result().offset, latest[tp].result().offset
                done = max(committed.get((tp.topic, tp.partition), 0) - low, 0)
                progress[(tp.topic, tp.partition)] = GroupProgress(done, high - low)
            return progress
        except (KafkaException, KafkaError) as exc:
            self._partitions.pop(tuple(topics), None)  # e.g. a topic deleted and made again
            self._drop_offsets_client()  # e.g. a connection the broker closed
            raise RuntimeError(f"could not read consumer group {group}: {exc}") from None

    def group_progress(self, group: str, topics: list[str]) -> dict[str, GroupProgress]:
        """Per topic: how far ``group`` has committed, against the topic's start and end offsets (the sum of
        :meth:`partition_progress` over each topic's partitions).

        Raises:
            RuntimeError: as :meth:`partition_progress`.
        """
        progress = {t: GroupProgress(0, 0) for t in topics}
        for (topic, _), part in self.partition_progress(group, topics).items():
            progress[topic].committed += part.committed
            progress[topic].end += part.end
        return progress

    def _topic_partitions(self, topics: list[str]) -> list[TopicPartition]:
        """The partitions of those of ``topics`` that exist (a Metadata request until all of them do, then one every
        :data:`PARTITIONS_REFRESH_S`)."""
        known = self._partitions.get(tuple(topics))
        if known is not None and time.monotonic() - known[0] < PARTITIONS_REFRESH_S:
            return known[1]
        metadata = self._admin.list_topics(timeout=10)
        partitions = [TopicPartition(t, p) for t in topics if t in metadata.topics
                      for p in metadata.topics[t].partitions]
        if all(t in metadata.topics and not metadata.topics[t].error for t in topics):
            self._partitions[tuple(topics)] = (time.monotonic(), partitions)
        return partitions

    async def _committed_offsets(self, group: str, partitions: list[TopicPartition]) -> dict[tuple[str, int], int]:
        if self._offsets_client is not None and time.monotonic() - self._offsets_used_at > CLIENT_IDLE_S:
            await self._close_offsets_client()
        if self._offsets_client is None:
            client = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap_servers, **aiokafka_security())
            try:
                await client.start()
            except BaseException:
                await client.close()
                raise
            self._offsets_client = client
        offsets = await self._offsets_client.list_consumer_group_offsets(
            group, partitions=[AioTopicPartition(tp.topic, tp.partition) for tp in partitions])
        self._offsets_used_at = time.monotonic()
        return {(tp.topic, tp.partition): meta.offset for tp, meta in offsets.items()}


def group_progress(bootstrap_servers: str, group: str, topics: list[str],
                   admin: AdminClient | None = None) -> dict[str, GroupProgress]:
    """One reading of :meth:`GroupProgressReader.group_progress` (for a loop, keep a :class:`GroupProgressReader`).

    Raises:
        RuntimeError: as :meth:`GroupProgressReader.partition_progress`.
    """
    with GroupProgressReader(bootstrap_servers, admin) as reader:
        return reader.group_progress(group, topics)


def partition_progress(bootstrap_servers: str, group: str, topics: list[str],
                       admin: AdminClient | None = None) -> dict[tuple[str, int], GroupProgress]:
    """One reading of :meth:`GroupProgressReader.partition_progress` (for a loop, keep a
    :class:`GroupProgressReader`). Blocking, with an event loop of its own: from a coroutine, run it in a thread.

    Raises:
        RuntimeError: as :meth:`GroupProgressReader.partition_progress`.
    """
    with GroupProgressReader(bootstrap_servers, admin) as reader:
        return reader.partition_progress(group, topics)
