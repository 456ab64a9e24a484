"""The residency table's fast recovery (stream_apps/changelog_recovery.py) on a real broker.

Like test_chaos.py, the module starts an embedded broker of its own (chaos.scenarios.RunEnv): the stream app
reads the fixed topic ``kv-events``, which test_pipeline.py fills on the session broker.
"""

from __future__ import annotations

import re

import pytest
from confluent_kafka import Producer

from chaos.scenarios import CHAOS_FLEET, RunEnv, _consume, produce_now, simulate_workload
from kafka_io.admin import ensure_topics
from kafka_io.config import client_config
from kafka_io.reader import messages_to_end
from schemas import AvroCodec
from schemas.topics import changelog_topic
from stream_apps.changelog_recovery import ChangelogRecoveryError, fill_from_changelog, persisted_offset
from stream_apps.snapshot import read_table

pytestmark = pytest.mark.integration

OFFSET_KEY = b"__faust\0offset__"  # faust.stores.rocksdb.Store.offset_key
PARTITIONS = 4


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with RunEnv(tmp_path_factory.mktemp("recovery") / "run", PARTITIONS, log=print) as env:
        yield env


def _open_db(path):
    """A RocksDB database opened as Faust's RocksDB store opens a partition's (raw keys and values)."""
    from faust.stores.rocksdb import RocksDBOptions

    return RocksDBOptions().open(path)


def _contents(db) -> dict[bytes, bytes]:
    return {key: value for key, value in db.items() if key != OFFSET_KEY}


def _produce(bootstrap: str, topic: str, records: list[tuple[int, bytes, bytes | None]]) -> None:
    producer = Producer(client_config(bootstrap))
    for partition, key, value in records:
        producer.produce(topic, key=key, value=value, partition=partition)
    assert producer.flush(30) == 0


def test_fill_writes_the_changelog_in_chunks_with_their_offsets_and_goes_on_from_there(env, tmp_path):
    topic = "fill-test-changelog"
    ensure_topics(env.bootstrap, {topic: 3})
    _produce(env.bootstrap, topic, [(0, b"a", b"1"), (0, b"b", b"2"), (0, b"a", None), (0, b"c", b"3"),
                                    (0, b"b", b"22"), (1, b"x", b"9"), (1, b"y", b""), (1, b"x", b"")])
    dbs = {p: _open_db(tmp_path / f"p{p}.db") for p in range(3)}

    result = fill_from_changelog(env.bootstrap, topic, dbs, OFFSET_KEY, chunk_records=2)

    assert (result.records, result.partitions) == (8, 3)
    assert _contents(dbs[0]) == {b"b": b"22", b"c": b"3"}  # a: put, then its tombstone (None)
    assert _contents(dbs[1]) == {}  # an empty value deletes too
    assert _contents(dbs[2]) == {}
    assert [persisted_offset(dbs[p], OFFSET_KEY) for p in range(3)] == [4, 2, None]

    _produce(env.bootstrap, topic, [(0, b"c", None), (0, b"d", b"4"), (2, b"z", b"5")])
    result = fill_from_changelog(env.bootstrap, topic, dbs, OFFSET_KEY)

    assert result.records == 3  # from each persisted offset + 1: partition 1 has nothing new
    assert _contents(dbs[0]) == {b"b": b"22", b"d": b"4"}
    assert _contents(dbs[2]) == {b"z": b"5"}
    assert [persisted_offset(dbs[p], OFFSET_KEY) for p in range(3)] == [6, 2, 0]


def test_fill_from_an_unreachable_broker_raises_a_clear_error(tmp_path):
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    with pytest.raises(ChangelogRecoveryError, match=r"fill-test-changelog partitions \[0\]: Kafka at .* did not "
                                                     r"answer"):
        fill_from_changelog(f"127.0.0.1:{port}", "fill-test-changelog", {0: _open_db(tmp_path / "p0.db")},
                            OFFSET_KEY)


def test_fresh_worker_fills_the_residency_table_from_the_changelog(env):
    """Worker 1 materializes a trace slice (with evictions: tombstones); worker 2 starts on the same app id with
    an empty data dir. Its RocksDB databases must hold exactly the table the changelog describes, with the
    offset of each partition's last record, filled by the fast path (Faust's recovery then reads nothing)."""
    workload = simulate_workload(150, CHAOS_FLEET, PARTITIONS)
    produce_now(env.bootstrap, workload.records)
    app_id = "recovery-test"
    first = env.worker("worker-1", app_id, store="rocksdb://")
    _consume(env, first, 240)
    first.stop()

    topic = changelog_topic(app_id, "residency")
    records = list(messages_to_end(env.bootstrap, topic))
    last_value: dict[bytes, bytes | None] = {}
    ends: dict[int, int] = {}
    for message in records:
        last_value[message.key()] = message.value()
        ends[message.partition()] = message.offset()
    deleted = {key for key, value in last_value.items() if not value}
    assert deleted, "the workload should end with some keys deleted by a tombstone"
    table = read_table(env.bootstrap, topic, "residency")

    second = env.worker("worker-2", app_id, store="rocksdb://", data_dir=env.dir / "empty-data-dir")
    second.wait_ready(240)
    log = second.log_since_start()
    second.stop()

    match = re.search(rf"changelog recovery of {topic}: (\d+) records from (\d+) partitions", log)
    assert match, log[-3000:]
    assert (int(match[1]), int(match[2])) == (len(records), PARTITIONS)
    codec = AvroCodec("residency")
    filled: dict[str, dict] = {}
    tables = list((env.dir / "empty-data-dir").rglob("residency-*.db"))
    assert len(tables) == PARTITIONS, tables
    for path in tables:
        partition = int(path.name.removesuffix(".db").rsplit("-", 1)[1])
        db = _open_db(path)
        assert persisted_offset(db, OFFSET_KEY) == ends[partition]  # Faust's recovery starts at the end
        filled.update({key.decode(): codec.decode(value) for key, value in _contents(db).items()})
        db.close()
    assert filled == table
    assert not {key.decode() for key in deleted} & filled.keys()
