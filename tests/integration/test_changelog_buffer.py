"""The tables' buffered changelog writes (stream_apps/store.py, stream_apps/checkpoint.py) on a real broker.

A worker's app is built (``create_app``) but not started, so no timer produces anything: each test decides
when the buffered records go out (``produce_changelogs`` or a checkpoint) and reads the changelog topics back.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections import defaultdict

import pytest

from kafka_io.admin import ensure_topics
from kafka_io.reader import messages_to_end
from producers.split import Publisher, split_event
from schemas import PUBLISHER_RESTARTED, AvroCodec
from schemas.clear_position import NO_CLEAR
from stream_apps.app import create_app
from stream_apps.checkpoint import CheckpointError, prepare_before_commits
from stream_apps.outputs import OutputTopics
from stream_apps.residency import DEFAULT_CLEAR_TIERS, ApplyStats, apply_block_event
from stream_apps.settings import WorkerSettings

pytestmark = pytest.mark.integration

_app_ids = itertools.count()


def _app(bootstrap: str, tmp_path, store: str, app_id: str | None = None):
    """A worker's app, not started, with its topics created (those that exist already are kept)."""
    settings = WorkerSettings(bootstrap_servers=bootstrap, app_id=app_id or f"changelog-buffer-{next(_app_ids)}",
                              store=store, data_dir=tmp_path / "worker", partitions=4)
    stream_app = create_app(settings)
    ensure_topics(bootstrap, {name: partitions for name, (partitions, _) in stream_app.declared_topics().items()})
    return stream_app


def _records(bootstrap: str, topic: str) -> list[tuple[int, int, str, bytes | None]]:
    """Every record of ``topic``: (partition, offset, key, value)."""
    return sorted((m.partition(), m.offset(), m.key().decode(), m.value())
                  for m in messages_to_end(bootstrap, topic, 30))


def _status(instance: str, events_applied: int) -> dict:
    return {"instance_id": instance, "data_parallel_rank": 0, "worker_rank": -1, "publisher_epoch": 1,
            "stale": False, "first_lost_seq": None, "last_lost_seq": None, "gaps": 0, "restarts": 0,
            "last_seq": events_applied, "last_event_ts": 1767230000.0 + events_applied,
            "events_applied": events_applied, "changed_ts": 1767230000.0}


def _entry(block: int, medium: str) -> dict:
    """A residency entry as the rules make it: ``block`` stored on ``medium`` by one engine."""
    event = {"type": "BlockStored", "block_hashes": [block], "parent_block_hash": None, "token_ids": [],
             "block_size": 16, "lora_id": None, "medium": medium, "lora_name": None, "group_idx": 0}
    record = split_event(Publisher("engine-a"), 1, 1767230000.0, 0, event)[0]
    entry, _, _ = apply_block_event(None, record, NO_CLEAR, NO_CLEAR, DEFAULT_CLEAR_TIERS, ApplyStats())
    return entry


def test_a_small_table_key_written_several_times_gets_one_record_with_its_latest_value(kafka_bootstrap, tmp_path):
    stream_app = _app(kafka_bootstrap, tmp_path, "memory://")
    store = stream_app.tables.sources.data
    topic = store.changelog
    status = _status("engine-a", 1)
    store.write(2, "2/engine-a/0/-1", status)
    status.update(events_applied=2, last_seq=2)  # what note_applied does: the row read back, updated, written
    store.write(2, "2/engine-a/0/-1", status)
    store.write(3, "3/engine-b/0/-1", _status("engine-b", 7))
    store.write(3, "3/engine-b/0/-1", None)

    assert store.lookup("2/engine-a/0/-1", 2)["events_applied"] == 2  # reads find a write at once
    stream_app.outputs.flush()
    assert _records(kafka_bootstrap, topic) == []  # nothing produced before produce_changelogs

    assert stream_app.checkpoint.produce_changelogs() == 2
    stream_app.outputs.flush()
    records = _records(kafka_bootstrap, topic)
    assert [(p, key) for p, _, key, _ in records] == [(2, "2/engine-a/0/-1"), (3, "3/engine-b/0/-1")]
    assert AvroCodec("source_status").decode(records[0][3]) == status
    assert records[1][3] is None  # the last write deleted the key: a tombstone
    assert stream_app.checkpoint.produce_changelogs() == 0  # produced once


def test_a_checkpoint_produces_the_buffered_records_of_every_table_before_it_persists(kafka_bootstrap, tmp_path):
    stream_app = _app(kafka_bootstrap, tmp_path, "rocksdb://")
    tables, checkpoint = stream_app.tables, stream_app.checkpoint
    residency = tables.residency_store
    first, last = _entry(1, "GPU"), _entry(1, "CPU")
    residency.write(1, "primary/01", first)
    residency.write(1, "primary/01", last)
    occupancy = {"ownership": None, "tier": "CPU", "instance_id": "engine-a", "resident_blocks": 1}
    tables.tier_occupancy.data.write(1, "1/primary/CPU/engine-a", occupancy)

    with pytest.raises(RuntimeError, match="not produced"):
        residency.persist()  # the disk must never run ahead of the changelog
    checkpoint.commit()

    records = _records(kafka_bootstrap, residency.changelog)
    assert [(p, key) for p, _, key, _ in records] == [(1, "primary/01")]
    assert records[0][3] == residency.encode(last)
    # persisted with the offset of the record it reaches: a restart reads the changelog from there
    db = residency._db_for_partition(1)
    assert db.get(b"primary/01") == residency.encode(last)
    assert int(db.get(residency.offset_key)) == records[0][1]
    occupancy_records = _records(kafka_bootstrap, tables.tier_occupancy.data.changelog)
    assert [(p, key) for p, _, key, _ in occupancy_records] == [(1, "1/primary/CPU/engine-a")]
    assert AvroCodec("tier_occupancy").decode(occupancy_records[0][3]) == occupancy


def test_the_global_tables_changelogs_wait_for_their_own_interval_and_a_commit_takes_every_table(
        kafka_bootstrap, tmp_path):
    # the worker's two timers: every --changelog-interval-s the partitioned tables' records, every
    # --global-changelog-interval-s the global tables' (every worker reads those whole)
    stream_app = _app(kafka_bootstrap, tmp_path, "memory://")
    tables, checkpoint = stream_app.tables, stream_app.checkpoint
    # every table Faust reads whole on every worker, and only those, is on the global timer
    assert [table.name for table in tables.global_tables()] == [table.name for table in tables.all() if table.is_global]
    assert not any(table.is_global for table in tables.partitioned_tables())
    residency, sources = tables.residency_store, tables.sources.data
    partitioned = [table.data for table in tables.partitioned_tables()]
    global_stores = [table.data for table in tables.global_tables()]
    residency.write(1, "primary/01", _entry(1, "GPU"))
    sources.write(1, "1/engine-a/0/-1", _status("engine-a", 1))

    assert checkpoint.produce(partitioned) == 1
    stream_app.outputs.flush()
    assert [key for _, _, key, _ in _records(kafka_bootstrap, residency.changelog)] == ["primary/01"]
    assert _records(kafka_bootstrap, sources.changelog) == []  # still buffered

    assert checkpoint.produce(global_stores) == 1
    stream_app.outputs.flush()
    assert [key for _, _, key, _ in _records(kafka_bootstrap, sources.changelog)] == ["1/engine-a/0/-1"]

    # whatever a timer has not produced yet, the commit does, before anything is committed
    residency.write(1, "primary/02", _entry(2, "GPU"))
    sources.write(1, "1/engine-a/0/-1", _status("engine-a", 2))
    checkpoint.commit()
    assert [key for _, _, key, _ in _records(kafka_bootstrap, residency.changelog)] == ["primary/01", "primary/02"]
    last = _records(kafka_bootstrap, sources.changelog)[-1]
    assert AvroCodec("source_status").decode(last[3])["events_applied"] == 2


def test_a_faust_commit_first_produces_and_waits_for_the_acknowledgements_with_the_event_loop_free(
        kafka_bootstrap, tmp_path):
    # the synchronous checkpoint holds the event loop while it flushes; the commit's awaited prepare leaves it
    # nothing to wait for (stream_apps.checkpoint.prepare_before_commits)
    stream_app = _app(kafka_bootstrap, tmp_path, "memory://")
    consumer, tables, checkpoint = stream_app.app.consumer, stream_app.tables, stream_app.checkpoint
    assert "prepare_before_commits" in consumer.commit.__qualname__  # the worker's commits are prepared
    prepare_before_commits(consumer, checkpoint, stream_app.app.crash, wait_s=30.0)  # for slow CI brokers
    tables.residency_store.write(1, "primary/01", _entry(1, "GPU"))
    tables.sources.data.write(1, "1/engine-a/0/-1", _status("engine-a", 1))
    ticks, at_checkpoint = [0], []  # (records buffered, unacknowledged, other work's turns) when it began
    synchronous_checkpoint = checkpoint.commit

    def spied() -> None:
        buffered = len(tables.residency_store._unproduced) + len(tables.sources.data._unproduced)
        at_checkpoint.append((buffered, stream_app.outputs.acknowledge(0), ticks[0]))
        synchronous_checkpoint()

    checkpoint.commit = spied

    async def commit_while_other_work_runs() -> None:
        done = asyncio.Event()

        async def other_work():  # e.g. the agent: it keeps applying while the commit waits
            while not done.is_set():
                ticks[0] += 1
                await asyncio.sleep(0)

        work = asyncio.ensure_future(other_work())
        await consumer.commit()  # Faust's own commit: no partitions assigned, so no offsets to commit
        done.set()
        await work

    asyncio.run(commit_while_other_work_runs())
    assert len(at_checkpoint) == 1
    buffered, unacknowledged, turns = at_checkpoint[0]
    assert (buffered, unacknowledged) == (0, 0)  # produced and acknowledged before the synchronous checkpoint
    assert turns > 0  # the loop ran while the commit waited
    assert [key for _, _, key, _ in _records(kafka_bootstrap, tables.residency_store.changelog)] == ["primary/01"]
    assert [key for _, _, key, _ in _records(kafka_bootstrap, tables.sources.data.changelog)] == ["1/engine-a/0/-1"]


def test_a_record_the_prepared_commit_cannot_produce_stops_the_worker_before_anything_is_committed(
        kafka_bootstrap, tmp_path):
    stream_app = _app(kafka_bootstrap, tmp_path, "memory://")
    crashes = []

    async def crash(exc: BaseException) -> None:
        crashes.append(exc)

    consumer, checkpoint = stream_app.app.consumer, stream_app.checkpoint
    prepare_before_commits(consumer, checkpoint, crash)
    synchronous_checkpoints = []
    checkpoint.commit = lambda: synchronous_checkpoints.append(1)
    stream_app.tables.sources.data.write(0, "0/engine-b/0/-1", {"instance_id": "engine-b"})  # cannot be encoded

    with pytest.raises(CheckpointError, match="could not be produced"):
        asyncio.run(consumer.commit())
    assert len(crashes) == 1 and isinstance(crashes[0], CheckpointError)
    assert synchronous_checkpoints == []  # Faust's commit never started


def test_a_publisher_restart_produces_its_epoch_and_the_sources_row_it_resets_together(kafka_bootstrap, tmp_path):
    # the publisher-epochs record marks the restart applied, and a redelivered restart is skipped by it: the
    # sources row the restart resets (stale, gaps, restarts) must not wait for the global tables' interval
    stream_app = _app(kafka_bootstrap, tmp_path, "memory://")
    tables = stream_app.tables
    restart = {"instance_id": "engine-a", "data_parallel_rank": 0, "worker_rank": None, "publisher_epoch": 2,
               "seq": -1, "batch_index": -1, "ts": 1767230000.0, "event": (PUBLISHER_RESTARTED, {})}
    stream_app.materializer.apply_source_event(1, restart, defaultdict(int))
    stream_app.outputs.flush()  # acknowledged, no checkpoint after the restart's own and no timer

    epochs = _records(kafka_bootstrap, tables.publisher_epochs.data.changelog)
    sources = _records(kafka_bootstrap, tables.sources.data.changelog)
    assert [key for _, _, key, _ in epochs] == ["1/engine-a/0/-1"]
    assert [key for _, _, key, _ in sources] == ["1/engine-a/0/-1"]
    status = AvroCodec("source_status").decode(sources[0][3])
    assert (status["publisher_epoch"], status["restarts"], status["stale"]) == (2, 1, False)


def test_the_compact_memory_store_produces_the_bytes_it_holds(kafka_bootstrap, tmp_path):
    stream_app = _app(kafka_bootstrap, tmp_path, "memory://")
    residency = stream_app.tables.residency_store
    entry = _entry(2, "GPU")
    residency.write(0, "primary/02", _entry(2, "CPU"))
    residency.write(0, "primary/02", entry)
    residency.write(0, "primary/03", _entry(3, "GPU"))
    residency.write(0, "primary/03", None)

    assert stream_app.checkpoint.produce_changelogs() == 2
    stream_app.outputs.flush()

    records = {key: value for _, _, key, value in _records(kafka_bootstrap, residency.changelog)}
    assert records == {"primary/02": residency.data["primary/02"], "primary/03": None}
    assert records["primary/02"] == residency.encode(entry)


def test_a_record_that_cannot_be_produced_stays_buffered_and_every_checkpoint_fails(kafka_bootstrap, tmp_path):
    stream_app = _app(kafka_bootstrap, tmp_path, "rocksdb://")
    tables, checkpoint = stream_app.tables, stream_app.checkpoint
    sources = tables.sources.data
    sources.write(0, "0/engine-a/0/-1", _status("engine-a", 1))
    sources.write(0, "0/engine-b/0/-1", {"instance_id": "engine-b"})  # not a source_status: cannot be encoded
    tables.residency_store.write(0, "primary/04", _entry(4, "GPU"))

    with pytest.raises(CheckpointError, match="could not be produced"):
        checkpoint.commit()

    stream_app.outputs.flush()
    # the stores go in order, residency first: what came before the bad record went out, the bad one did not
    assert [key for _, _, key, _ in _records(kafka_bootstrap, tables.residency_store.changelog)] == ["primary/04"]
    assert [key for _, _, key, _ in _records(kafka_bootstrap, sources.changelog)] == ["0/engine-a/0/-1"]
    assert tables.residency_store._db_for_partition(0).get(b"primary/04") is None  # nothing persisted
    with pytest.raises(CheckpointError, match="earlier checkpoint failed"):
        checkpoint.commit()  # e.g. Faust's commit at shutdown: nothing may be committed now
    assert list(sources._unproduced) == [(0, "0/engine-b/0/-1")]


def test_after_the_broker_refused_a_record_every_later_checkpoint_fails(kafka_bootstrap, tmp_path):
    app_id = f"changelog-buffer-{next(_app_ids)}"
    changelog = f"{app_id}-sources-changelog"
    ensure_topics(kafka_bootstrap, {changelog: 4},
                  configs={changelog: {"cleanup.policy": "compact", "max.message.bytes": "300"}})
    stream_app = _app(kafka_bootstrap, tmp_path, "memory://", app_id)
    # over the topic's limit even lz4-compressed (random hex)
    stream_app.tables.sources.data.write(1, "1/big/0/-1", _status(secrets.token_hex(2000), 1))

    with pytest.raises(CheckpointError, match="refused"):
        stream_app.checkpoint.commit()
    # the refused record is no longer queued, so a second flush would pass: the checkpoint must not
    with pytest.raises(CheckpointError, match="earlier checkpoint failed"):
        stream_app.checkpoint.commit()


def test_a_residency_changelog_record_the_broker_refused_fails_the_checkpoint_and_nothing_is_persisted(
        kafka_bootstrap, tmp_path):
    # the RocksDB store gathers its changelog's delivery reports itself (stream_apps/delivery_reports.py), not
    # through the output producer's callback: a refusal must still stop every checkpoint
    app_id = f"changelog-buffer-{next(_app_ids)}"
    changelog = f"{app_id}-residency-changelog"
    ensure_topics(kafka_bootstrap, {changelog: 4},
                  configs={changelog: {"cleanup.policy": "compact", "max.message.bytes": "300"}})
    stream_app = _app(kafka_bootstrap, tmp_path, "rocksdb://", app_id)
    residency = stream_app.tables.residency_store
    small, big = _entry(5, "GPU"), _entry(6, "GPU")
    big["rows"][0]["instance_id"] = secrets.token_hex(2000)  # over the topic's limit even lz4-compressed
    residency.write(2, "primary/05", small)
    residency.write(2, "primary/06", big)

    with pytest.raises(CheckpointError, match="refused by the broker"):
        stream_app.checkpoint.commit()
    db = residency._db_for_partition(2)
    assert db.get(b"primary/05") is None and db.get(residency.offset_key) is None
    with pytest.raises(CheckpointError, match="earlier checkpoint failed"):
        stream_app.checkpoint.commit()


def test_the_offset_persisted_is_the_last_acknowledged_record_of_each_partition(kafka_bootstrap, tmp_path):
    stream_app = _app(kafka_bootstrap, tmp_path, "rocksdb://")
    residency = stream_app.tables.residency_store
    for partition, blocks in ((0, (7, 8, 9)), (3, (10,))):
        for block in blocks:
            residency.write(partition, f"primary/{block:02x}", _entry(block, "GPU"))
    stream_app.checkpoint.commit()
    residency.write(0, "primary/0b", _entry(11, "GPU"))  # a second checkpoint moves partition 0 only
    stream_app.checkpoint.commit()

    last = {}
    for partition, offset, _, _ in _records(kafka_bootstrap, residency.changelog):
        last[partition] = max(last.get(partition, -1), offset)
    assert last == {0: 3, 3: 0}
    assert {p: int(residency._db_for_partition(p).get(residency.offset_key)) for p in (0, 3)} == last


def test_occupancy_rows_go_out_with_the_checkpoint_once_each_with_their_latest_value(kafka_bootstrap, tmp_path):
    # kv-tier-occupancy mirrors the tier-occupancy table's changelog records: latest value per key, produced by
    # the checkpoint's step 1 with the changelogs, before any offset is committed
    stream_app = _app(kafka_bootstrap, tmp_path, "memory://")
    store, topic = stream_app.tables.tier_occupancy.data, stream_app.outputs.topics.tier_occupancy

    def row(tier: str, blocks: int) -> dict:
        return {"ownership": None, "tier": tier, "instance_id": "engine-a", "resident_blocks": blocks}

    store.write(2, "2/primary/GPU/engine-a", row("GPU", 1))
    store.write(2, "2/primary/GPU/engine-a", row("GPU", 3))
    store.write(3, "3/primary/CPU/engine-a", row("CPU", 5))
    stream_app.outputs.flush()
    assert _records(kafka_bootstrap, topic) == []  # nothing produced before the checkpoint

    stream_app.checkpoint.commit()
    codec = AvroCodec("tier_occupancy")
    assert sorted((key, codec.decode(value)) for _, _, key, value in _records(kafka_bootstrap, topic)) == [
        ("2/primary/GPU/engine-a", row("GPU", 3)), ("3/primary/CPU/engine-a", row("CPU", 5))]
    assert store.produce_changelog() == 0  # produced once
    # the table's changelog got the same records
    assert sorted((key, codec.decode(value)) for _, _, key, value in _records(kafka_bootstrap, store.changelog)) == [
        ("2/primary/GPU/engine-a", row("GPU", 3)), ("3/primary/CPU/engine-a", row("CPU", 5))]


def test_an_output_the_broker_refused_fails_the_checkpoint(kafka_bootstrap, tmp_path):
    # the output producer's own delivery reports (residency changes, occupancy, dead letters) are a dict filled
    # by librdkafka's callback, not a Python function (stream_apps/outputs.py): a refusal must still be seen
    app_id = f"changelog-buffer-{next(_app_ids)}"
    occupancy = f"{app_id}-kv-tier-occupancy"
    ensure_topics(kafka_bootstrap, {occupancy: 4}, configs={occupancy: {"max.message.bytes": "300"}})
    stream_app = _app(kafka_bootstrap, tmp_path, "memory://", app_id)
    big = secrets.token_hex(2000)  # over the topic's limit even lz4-compressed
    stream_app.outputs.occupancy(f"0/primary/GPU/{big}", {"ownership": None, "tier": "GPU", "instance_id": big,
                                                          "resident_blocks": 1})

    with pytest.raises(CheckpointError, match=f"1 outputs refused by the broker, first: {occupancy}"):
        stream_app.checkpoint.commit()
    with pytest.raises(CheckpointError, match="earlier checkpoint failed"):
        stream_app.checkpoint.commit()


@pytest.mark.parametrize("store, report_successes", [("memory://", False), ("rocksdb://", True)])
def test_successful_deliveries_reach_python_only_where_a_store_persists_its_changelog_offsets(
        kafka_bootstrap, tmp_path, store, report_successes):
    # a success's report is a confluent_kafka.Message per record, about one per event: a memory worker's stores
    # only look for refusals, the RocksDB store persists the offset the successes reach
    stream_app = _app(kafka_bootstrap, tmp_path, store)
    assert stream_app.outputs.report_successes is report_successes
    residency = stream_app.tables.residency_store
    residency.write(1, "primary/0c", _entry(12, "GPU"))
    residency.write(1, "primary/0d", _entry(13, "CPU"))
    assert stream_app.checkpoint.produce_changelogs() >= 2
    assert stream_app.outputs.acknowledge(30) == 0  # both acknowledged either way

    offsets = residency._reports.take_offsets()
    assert offsets == ({1: 1} if report_successes else {})
    assert [key for _, _, key, _ in _records(kafka_bootstrap, residency.changelog)] == ["primary/0c", "primary/0d"]


def test_a_store_that_persists_changelog_offsets_refuses_an_output_producer_without_success_reports(
        kafka_bootstrap, tmp_path):
    stream_app = _app(kafka_bootstrap, tmp_path, "rocksdb://")
    quiet = OutputTopics(kafka_bootstrap, stream_app.settings.topics, report_successes=False)
    with pytest.raises(ValueError, match="persists its changelog's offsets"):
        stream_app.tables.residency_store.bind(quiet, bootstrap_servers=kafka_bootstrap)
