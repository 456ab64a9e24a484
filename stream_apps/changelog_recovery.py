"""Fast recovery of the ``residency`` table's RocksDB store: its changelog copied straight into RocksDB.

Why: Faust recovers a table by consuming its changelog through its own consumer and streams machinery,
several times slower than reading the records and writing them to the database. The changelog records
already hold what the RocksDB store keeps (key: the raw UTF-8 table key; value: the Avro bytes; an empty
value deletes), so they can be copied without decoding.

When: :meth:`stream_apps.store.RocksDBTableStore.on_rebalance` calls :func:`fill_from_changelog` after
Faust's own ``on_rebalance`` (which opens the databases of the newly assigned active partitions) and before
Faust's ``Recovery`` reads each partition's persisted offset (``store.offset_key``). Every newly assigned
active partition of the changelog is read from its persisted offset + 1 (0 for an empty database) to the
partition's end as of the start, with one plain confluent-kafka consumer for all of them
(:func:`kafka_io.reader.messages_to_end`: assigned, no consumer group, nothing committed). Each
partition's records go to its database in write batches of :data:`CHUNK_RECORDS` records, each batch also
setting ``store.offset_key`` to the offset of its last record: a worker killed mid-way leaves, per
partition, a database equal to the changelog up to the offset it holds, and the next start goes on from
there. Faust's recovery then starts after that offset.

Heartbeats: the copy runs in a thread, so the worker's event loop keeps running, but inside the rebalance
callback, and aiokafka sends no heartbeats until that callback returns. A copy longer than the consumer
session timeout (``BROKER_SESSION_TIMEOUT``, Faust's default 60 s) gets the worker expelled from the group;
it rejoins once the copy is done (one more rebalance, which starts at the offsets already written). A
warning is logged when that happens; docs/operations.md ("Table recovery") says when to raise the timeout.

Not covered: standby partitions (Faust keeps them), partitions that stay assigned across a rebalance (their
database is current), and the ``memory://`` store (it persists no offset, so Faust reads its whole
changelog anyway).

Errors (the broker unreachable, the end not reached within the timeout, a database write failing) raise
:class:`ChangelogRecoveryError`; Faust's rebalance handler then crashes the worker, so a supervisor
restarts it rather than letting it serve a partial table.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Mapping

log = logging.getLogger(__name__)

#: Records per RocksDB write batch, per partition (each batch also writes the changelog offset it reaches).
CHUNK_RECORDS = 50_000
#: Longest the read of one rebalance may take by default, in seconds (``kvstream worker --recovery-timeout-s``).
TIMEOUT_S = 600.0


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
