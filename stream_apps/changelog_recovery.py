"""Fast recovery of the ``residency`` table's RocksDB store: read its changelog straight into RocksDB.

Why: Faust recovers a table by consuming its changelog through its own consumer and streams machinery,
about 5,000 records/s on the 2-core development machine: a fresh worker (empty data dir) needed 251 s
for 1.28 million rows. The changelog records already hold what the RocksDB store keeps (key: the raw UTF-8
table key; value: the Avro bytes, see ``stream_apps.app._ResidencyStore``; an empty value deletes), so
they can be copied without decoding.

How: :func:`install` wraps the table's ``on_rebalance``. Faust's ``TableManager.on_rebalance`` calls each
table's ``on_rebalance`` (the RocksDB store opens the databases of the newly assigned active partitions
there) before ``Recovery.on_rebalance``, which reads each partition's persisted offset
(``store.offset_key``). In between, :func:`fill_from_changelog` reads every newly assigned active
partition of the changelog, from its persisted offset + 1 (0 for an empty database) to the partition's
end as of the start, with one plain confluent-kafka consumer for all of them
(:func:`kafka_io.reader.messages_to_end`: assigned, no consumer group, nothing committed, the
project's security settings). Each partition's records go to its database in write batches of
:data:`CHUNK_RECORDS` records, each batch also setting ``store.offset_key`` to the offset of its last
record: a worker killed mid-way leaves, per partition, a database equal to the changelog up to the offset
it holds, and the next start goes on from there. Faust's recovery then starts after that offset and finds
nothing (or only what was written since) to read.

The read runs in a thread (``loop.run_in_executor``) so the worker's event loop (web server, Faust's
timers) keeps running. It runs inside the rebalance callback, though, and aiokafka stops its heartbeat task
before a group join and starts it again only after the assignment callback has returned. A read longer
than the consumer session timeout (``BROKER_SESSION_TIMEOUT``, Faust's default 60 s) therefore gets the
worker expelled from the group, and it rejoins once the read is done: one more rebalance, whose fill (if
any partition is newly assigned then) starts at the offsets already written. Seen with a 6 s session
timeout and an 8.4 s read of 1.09 million records: the worker rejoined at once and its table was exact.
At the 130,000 to 147,000 records/s measured on the 2-core development machine, 60 s covers about 8
million records per worker; above that, raise ``BROKER_SESSION_TIMEOUT`` (a warning is logged when the read
took longer).

Not covered: standby partitions (Faust keeps them), partitions that stay assigned across a rebalance
(their database is current), and the ``memory://`` store (it persists no offset, so Faust reads its whole
changelog anyway).

Errors (the broker unreachable, the end not reached within the timeout, a database write failing) raise
:class:`ChangelogRecoveryError`; Faust's rebalance handler then crashes the worker, so a supervisor
restarts it rather than letting it serve a partial table.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Mapping

log = logging.getLogger(__name__)

#: Records per RocksDB write batch, per partition (each batch also writes the changelog offset it reaches).
CHUNK_RECORDS = 50_000
#: Longest the read of one rebalance may take, in seconds (``KVSTREAM_RECOVERY_TIMEOUT_S``).
TIMEOUT_S = float(os.environ.get("KVSTREAM_RECOVERY_TIMEOUT_S", "600"))


class ChangelogRecoveryError(RuntimeError):
    """The changelog could not be read into the store; the message says which topic, partitions and why."""


@dataclass
class FillResult:
    """What one :func:`fill_from_changelog` call did."""

    #: Changelog records written to the databases (tombstones included).
    records: int
    #: Partitions read.
    partitions: int
    #: Wall-clock seconds of the read and writes.
    seconds: float

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else 0.0


def persisted_offset(db, offset_key: bytes) -> int | None:
    """The changelog offset a partition's database holds (ASCII digits under ``offset_key``), or None."""
    raw = db.get(offset_key)
    return None if raw is None else int(raw)


def fill_from_changelog(bootstrap_servers: str, topic: str, dbs: Mapping[int, object], offset_key: bytes, *,
                        chunk_records: int = CHUNK_RECORDS, timeout_s: float = TIMEOUT_S,
                        stop: threading.Event | None = None) -> FillResult:
    """Copy changelog records into the partitions' RocksDB databases, from each one's persisted offset on.

    Blocking: run it in a thread.

    Args:
        topic: the table's changelog topic.
        dbs: partition -> open rocksdict ``Rdict`` (raw mode, as Faust's RocksDB store opens them).
        offset_key: the key under which the store keeps the changelog offset (``Store.offset_key``).
        chunk_records: records per write batch and partition.
        timeout_s: longest the whole read may take, in seconds.
        stop: when set, the read stops after the current message; what was written stays consistent.

    Returns:
        :class:`FillResult`.

    Raises:
        ChangelogRecoveryError: the broker did not answer, the end was not reached within ``timeout_s``, or
            a database write failed. The batches written before stay (each with its offset).
    """
    from confluent_kafka import KafkaException
    from rocksdict import WriteBatch

    from kafka_io.reader import messages_to_end

    started = time.perf_counter()
    starts = {}
    for partition, db in dbs.items():
        offset = persisted_offset(db, offset_key)
        starts[partition] = 0 if offset is None else offset + 1
    batches = {p: WriteBatch(raw_mode=True) for p in dbs}
    pending = dict.fromkeys(dbs, 0)
    last_offset: dict[int, int] = {}
    records = 0

    def write(partition: int) -> None:
        batch = batches[partition]
        batch.put(offset_key, str(last_offset[partition]).encode())
        dbs[partition].write(batch)
        batches[partition] = WriteBatch(raw_mode=True)
        pending[partition] = 0

    try:
        for message in messages_to_end(bootstrap_servers, topic, timeout_s, start_offsets=starts):
            partition = message.partition()
            key, value = message.key(), message.value()
            batch = batches[partition]
            if key is not None:  # a keyless record belongs to no row; its offset still counts as read
                if value:
                    batch.put(key, value)
                else:
                    batch.delete(key)
            last_offset[partition] = message.offset()
            pending[partition] += 1
            records += 1
            if pending[partition] >= chunk_records:
                write(partition)
            if stop is not None and stop.is_set():
                break
        for partition, count in pending.items():
            if count:
                write(partition)
    except TimeoutError as exc:
        raise ChangelogRecoveryError(f"{topic} partitions {sorted(dbs)}: {exc} ({records:,} records read; "
                                     f"KVSTREAM_RECOVERY_TIMEOUT_S sets the limit)") from exc
    except KafkaException as exc:
        raise ChangelogRecoveryError(f"{topic} partitions {sorted(dbs)}: Kafka at {bootstrap_servers} did not "
                                     f"answer: {exc} (if a TLS or SASL error is logged, check "
                                     f"KVSTREAM_SECURITY_PROTOCOL and the KVSTREAM_SASL_*, KVSTREAM_SSL_* settings)"
                                     ) from exc
    except Exception as exc:  # a RocksDB write (disk full, I/O error)
        raise ChangelogRecoveryError(f"{topic} partitions {sorted(dbs)}: {type(exc).__name__}: {exc}") from exc
    return FillResult(records, len(dbs), time.perf_counter() - started)


async def fill_newly_assigned(app, table, newly_assigned, bootstrap_servers: str) -> FillResult | None:
    """Fill the RocksDB databases of the table's newly assigned active changelog partitions (not standbys).

    Call it after the store's ``on_rebalance`` (which opens those databases) and before Faust's recovery
    reads the persisted offsets. Does nothing for a store other than RocksDB. Logs one INFO line.

    Returns:
        The :class:`FillResult`, or None when there was nothing to fill.

    Raises:
        ChangelogRecoveryError: as :func:`fill_from_changelog`.
    """
    import faust.stores.rocksdb

    store = table.data
    if not isinstance(store, faust.stores.rocksdb.Store):
        return None
    topic = table.changelog_topic.get_topic_name()
    standbys = app.assignor.assigned_standbys()
    partitions = sorted(tp.partition for tp in newly_assigned if tp.topic == topic and tp not in standbys)
    # the store opens each database; one it could not open (locked, and the group moved on) stays with Faust
    dbs = {p: store._dbs[p] for p in partitions if p in store._dbs}
    if not dbs:
        return None
    stop = threading.Event()
    loop = asyncio.get_running_loop()
    try:
        result = await loop.run_in_executor(None, lambda: fill_from_changelog(
            bootstrap_servers, topic, dbs, store.offset_key, stop=stop))
    except asyncio.CancelledError:
        stop.set()
        raise
    log.info("changelog recovery of %s: %d records from %d partitions %s in %.1f s (%.0f records/s)",
             topic, result.records, result.partitions, sorted(dbs), result.seconds, result.records_per_s)
    session_timeout = app.conf.broker_session_timeout
    if result.seconds > session_timeout:
        log.warning("changelog recovery took %.1f s, longer than the consumer session timeout (%.0f s, "
                    "BROKER_SESSION_TIMEOUT): the group expels this worker and rebalances once more",
                    result.seconds, session_timeout)
    return result


def install(app, table, bootstrap_servers: str) -> None:
    """Make ``table`` fill its newly assigned RocksDB partitions from its changelog on every rebalance.

    Wraps the table's ``on_rebalance`` (which Faust's TableManager calls before its recovery) on this
    instance: first the table's own (the store opens its databases), then :func:`fill_newly_assigned`.
    """
    table_on_rebalance = table.on_rebalance

    async def on_rebalance(assigned, revoked, newly_assigned, generation_id: int = 0) -> None:
        await table_on_rebalance(assigned, revoked, newly_assigned, generation_id)
        await fill_newly_assigned(app, table, newly_assigned, bootstrap_servers)

    table.on_rebalance = on_rebalance
