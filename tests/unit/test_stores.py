"""The residency table's stores (stream_apps/store.py) keep every field of an entry: written, read back from their
own bytes (RocksDB's disk, the compact memory store's Avro bytes) and produced to the changelog. Entries of
residency v1 and v2, written before the content keys, read back with them null."""

from __future__ import annotations

from types import SimpleNamespace

import faust
import pytest

from schemas import AvroCodec
from stream_apps.settings import WorkerSettings
from stream_apps.store import STORE_SCHEMES
from stream_apps.tables import SMALL_TABLE_STORE, AvroFaustCodec, TableType, define_tables

KEY = "primary/0101010101010101"
ENTRY = {"block_hash": b"\x01" * 8, "ownership": None, "parent_block_hash": b"\x02" * 8,
         "content_hash": -8_141_230_954_287_003_614,
         "rows": [{"instance_id": "sim-0", "data_parallel_rank": 0, "tier": "CPU", "medium": "CPU", "locality": None,
                   "group_idx": 0, "world_size": 1, "aggregation": "REPLICATED",
                   "workers": [{"worker_rank": -1, "count": 1, "publisher_epoch": 1767225600000, "seq": 4,
                                "batch_index": 0, "block_index": 0, "content": None}],
                   "copies": 1, "since": 1767225600.5, "last_ts": 1767225600.5, "clear_mark": None}]}


class _Outputs:
    """The output producer as the stores use it, recording the changelog records: its librdkafka producer's
    ``produce(topic, value, key, partition, on_delivery)``, reporting each record delivered at once."""

    report_successes = True

    def __init__(self) -> None:
        self.records: list[tuple] = []
        self.producer = SimpleNamespace(produce=self._enqueue)

    def _enqueue(self, topic, value, key, partition, on_delivery) -> None:
        self.records.append((topic, key, value, partition))
        if on_delivery is not None:  # the RocksDB store persists what the broker acknowledged
            on_delivery(None, SimpleNamespace(partition=lambda: partition, offset=lambda: len(self.records)))


def _store(tmp_path, kind: str):
    """A bound residency store: ``rocksdb``, ``compact`` (``--store memory://``) or ``memory`` (the small tables')."""
    scheme = {"rocksdb": "rocksdb://", "compact": "memory://", "memory": "memory://"}[kind]
    app = faust.App(f"unit-stores-{kind}", broker="kafka://127.0.0.1:9", store=STORE_SCHEMES[scheme],
                    datadir=str(tmp_path / kind))
    if kind == "memory":
        table = app.Table("residency", key_type=TableType("raw"), partitions=2, store=SMALL_TABLE_STORE,
                          value_type=TableType("kvstream_residency", "residency"))
    else:
        settings = WorkerSettings(bootstrap_servers="127.0.0.1:9", store=scheme, data_dir=tmp_path / kind,
                                  partitions=2)
        table = define_tables(app, settings).residency
    store, outputs = table.data, _Outputs()
    store.bind(outputs, bootstrap_servers="127.0.0.1:9")
    return store, outputs


@pytest.mark.parametrize("kind", ["rocksdb", "compact", "memory"])
def test_every_store_keeps_an_entrys_content_keys(tmp_path, kind, hotpath):
    store, outputs = _store(tmp_path, kind)
    store.write(0, KEY, ENTRY)
    assert store.produce_changelog() == 1
    ((_, key, value, partition),) = outputs.records
    assert (key, partition) == (KEY.encode(), 0) and AvroCodec("residency").decode(value) == ENTRY
    store.persist()
    store.forget_cache()  # the next read decodes the store's own bytes (the disk, the compact store's bytes)
    assert store.entry(0, KEY) == ENTRY and store.lookup(KEY, 0) == ENTRY
    if kind == "rocksdb":
        assert AvroCodec("residency").decode(store._db_for_partition(0).get(KEY.encode())) == ENTRY


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("kind", ["rocksdb", "compact", "memory"])
def test_an_entry_written_before_residency_v3_reads_back_without_content_keys(tmp_path, kind, version, hotpath):
    old = {k: v for k, v in ENTRY.items() if k not in ("parent_block_hash", "content_hash")}
    if version == 1:
        old["rows"] = [{**row, "workers": [{k: v for k, v in w.items() if k != "content"} for w in row["workers"]]}
                       for row in old["rows"]]
    written = AvroCodec("residency", version).encode(old)
    expected = {**ENTRY, "parent_block_hash": None, "content_hash": None}
    store, _ = _store(tmp_path, kind)
    if kind == "rocksdb":  # as the changelog recovery copies a record written by an older worker
        store._db_for_partition(0).put(KEY.encode(), written)
    elif kind == "compact":
        store.data[KEY] = written
    else:  # Faust's recovery decodes the changelog value with the table's codec
        store.data[KEY] = AvroFaustCodec("residency")._loads(written)
    assert store.entry(0, KEY) == expected and store.lookup(KEY, 0) == expected
    # written again, it is a v3 entry that keeps what the old one said
    store.write(0, KEY, store.entry(0, KEY))
    store.produce_changelog()
    store.persist()
    store.forget_cache()
    assert store.entry(0, KEY) == expected


@pytest.mark.parametrize("kind", ["rocksdb", "compact", "memory"])
def test_a_changelog_record_librdkafka_has_no_room_for_goes_through_the_waiting_produce(tmp_path, kind):
    # the stores enqueue straight into librdkafka; when its queue is full (BufferError) the output producer's
    # produce waits for room (kafka_io.produce.produce_waiting): the record is neither dropped nor repeated
    store, outputs = _store(tmp_path, kind)
    waited = []
    full = iter([False, True, False])

    def enqueue(topic, value, key, partition, on_delivery):
        if next(full):
            raise BufferError("Local: Queue full")
        outputs.records.append((topic, key, value, partition))

    outputs.producer = SimpleNamespace(produce=enqueue)
    outputs.produce = lambda topic, key, value, partition, on_delivery: waited.append(key)
    for n in range(3):
        store.write(n % 2, f"primary/{n:016x}", ENTRY)

    assert store.produce_changelog() == 3
    assert [key for _, key, _, _ in outputs.records] == [b"primary/0000000000000000", b"primary/0000000000000002"]
    assert waited == [b"primary/0000000000000001"]
