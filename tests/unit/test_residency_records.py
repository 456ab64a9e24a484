"""The residency entry as a compiled record (stream_apps/residency/_record.pyx) against the Python reference's dicts
(stream_apps/residency/rules.py, the codec, ResidencyWriter): the same results for every event sequence, the same
bytes, the same refusals."""

from __future__ import annotations

import copy
import pickle
import sys
import weakref
from collections.abc import Mapping, MutableMapping
from dataclasses import asdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import BLOCK_REMOVED, BLOCK_STORED, BLOCK_STORED_OR_REUSED, AvroCodec
from schemas.avro_writers import ResidencyWriter
from schemas.block_event import BlockEvent
from schemas.clear_position import NO_CLEAR, ClearPosition
from schemas.codec import SINGLE_OBJECT_HEADER_LEN, DecodeError
from stream_apps.residency import ApplyStats, apply_clear, retire_epoch, rules, source_aggregation
from stream_apps.residency.records import EntryCodec, entry_form
from tests.conftest import record_module
from tests.unit.test_writers import ENTRIES

CODEC = AvroCodec("residency")
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def record():
    """The compiled record module (the test fails when it is not built, as tests/conftest.py says)."""
    return record_module("compiled")


def test_the_record_form_is_picked_where_built_and_the_dicts_when_told(record):
    assert entry_form(compiled=True).apply_block is record.apply_block and entry_form(compiled=True).compiled
    assert entry_form(compiled=False).apply_block is rules.apply_block and not entry_form(compiled=False).compiled


def test_a_record_reads_and_writes_as_the_dicts_do(record):
    entry = record.from_dict(copy.deepcopy(ENTRIES["every enum symbol"]))
    assert isinstance(entry, MutableMapping) and isinstance(entry["rows"][0], Mapping)
    assert entry == ENTRIES["every enum symbol"] and entry.as_dict() == ENTRIES["every enum symbol"]
    assert list(entry) == list(ENTRIES["every enum symbol"]) and len(entry) == 5 and "rows" in entry
    row = entry["rows"][2]
    assert row["clear_mark"] == {"publisher_epoch": 2, "seq": 2000, "batch_index": 2}
    assert row.get("no such field", "default") == "default"
    row["copies"] = 0
    row["clear_mark"] = None
    row["workers"][0]["count"] = 5
    assert (row.copies, row.has_mark, row.workers[0].count) == (0, False, 5) and row["clear_mark"] is None
    assert entry != ENTRIES["every enum symbol"]
    with pytest.raises(KeyError):
        row["no such field"]
    with pytest.raises(KeyError):
        row["no such field"] = 1
    with pytest.raises(TypeError):
        row["copies"] = 1.0  # a C int field would truncate it
    with pytest.raises(OverflowError):
        row["workers"][0]["count"] = 1 << 40
    assert copy.deepcopy(entry) == entry and pickle.loads(pickle.dumps(entry)) == entry
    assert copy.deepcopy(entry)["rows"][0] is not entry["rows"][0]


@pytest.mark.parametrize("name", list(ENTRIES))
def test_records_are_written_and_read_byte_for_byte_as_the_dicts(record, name):
    records, dicts = EntryCodec(CODEC, compiled=True), EntryCodec(CODEC, compiled=False)
    entry = ENTRIES[name]
    data = records.encode(record.from_dict(entry))
    assert data == dicts.encode(entry) == CODEC.encode(entry)
    decoded = records.decode(data)
    assert type(decoded) is record.ResidencyEntry and decoded == CODEC.decode(data) == dicts.decode(data)


def _decoded_or_refusal(codec: EntryCodec, data: bytes):
    try:
        return codec.decode(data)
    except DecodeError:
        return "DecodeError"


@PROPERTY
@given(st.sampled_from(list(ENTRIES)), st.data())
def test_damaged_bytes_are_read_as_the_codec_reads_them_or_refused_as_it_refuses_them(record, name, data):
    good = CODEC.encode(ENTRIES[name])
    damaged = bytearray(good)
    for _ in range(data.draw(st.integers(1, 3))):
        position = data.draw(st.integers(0, len(damaged) - 1))
        damaged[position] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(damaged)))
    for candidate in (bytes(damaged), bytes(damaged[:cut]), good + b"\x00"):
        expected = _decoded_or_refusal(EntryCodec(CODEC, compiled=False), candidate)
        got = _decoded_or_refusal(EntryCodec(CODEC, compiled=True), candidate)
        if got == "DecodeError" and expected != "DecodeError":
            assert _has_an_int_beyond_32_bits(expected)  # the one refusal of the records alone
        else:
            assert got == expected


#: The Avro ``int`` fields of an entry's rows and workers (the others are longs, strings, ...).
ROW_INTS = ("data_parallel_rank", "group_idx", "world_size", "copies")
WORKER_INTS = ("worker_rank", "count", "batch_index", "block_index")


def _has_an_int_beyond_32_bits(entry: dict) -> bool:
    values = [row[name] for row in entry["rows"] for name in ROW_INTS]
    values += [worker[name] for row in entry["rows"] for worker in row["workers"] for name in WORKER_INTS]
    values += [row["clear_mark"]["batch_index"] for row in entry["rows"] if row["clear_mark"]]
    return any(value is not None and not -(1 << 31) <= value < (1 << 31) for value in values)


def test_a_decoded_entry_shares_its_repeated_strings_and_holds_its_times_and_lists_at_their_size(record):
    """What makes a cached entry smaller (920 to about 680 bytes on the trace's entries): the strings every row
    repeats are one object across entries, the times are C doubles, the lists have no spare room."""
    codec = EntryCodec(CODEC, compiled=True)
    entry = copy.deepcopy(ENTRIES["every enum symbol"])
    data = codec.encode(record.from_dict(entry))
    first, second = codec.decode(data), codec.decode(data)
    assert first == second == entry
    for a, b in zip(first.rows, second.rows):
        assert a.instance_id is b.instance_id
        assert a.medium is b.medium or a.medium is None
        assert a.locality is b.locality or a.locality is None
        assert sys.getsizeof(a.workers) == sys.getsizeof([None] * len(a.workers))
    assert first.ownership is second.ownership or first.ownership is None
    assert sys.getsizeof(first.rows) == sys.getsizeof([None] * len(first.rows))
    # "inst-188" and "inst-302" take the same slot of the intern table (FNV-1a of their bytes): each is read as
    # what its bytes say whichever holds the slot
    for instances in (["inst-188", "inst-302"], ["inst-302", "inst-188", "inst-188"]):
        for instance in instances:
            other = copy.deepcopy(entry)
            other["rows"][0]["instance_id"] = instance
            assert codec.decode(codec.encode(record.from_dict(other)))["rows"][0]["instance_id"] == instance

    row = first.rows[0]
    row["since"] = None
    assert row["since"] is None and row.as_dict()["since"] is None
    row["since"], row["last_ts"] = 1767225600.5, 1767225601  # an int is held as the double fastavro writes
    assert (row["since"], row["last_ts"]) == (1767225600.5, 1767225601.0) and type(row["last_ts"]) is float
    with pytest.raises(TypeError):
        row["last_ts"] = None  # the field has no null branch
    with pytest.raises(TypeError):
        row["since"] = "yesterday"


class Held:
    """An object a test can hold a weak reference to."""


def test_the_records_and_their_lists_are_left_out_of_the_cyclic_collector(record):
    import gc

    codec = EntryCodec(CODEC, compiled=True)
    for entry in (codec.decode(codec.encode(record.from_dict(ENTRIES["every enum symbol"]))),
                  record.from_dict(copy.deepcopy(ENTRIES["every enum symbol"]))):
        rows = entry.rows
        assert not gc.is_tracked(entry) and not any(gc.is_tracked(row) for row in rows)
        assert not any(gc.is_tracked(worker) for row in rows for worker in row.workers)
        assert not gc.is_tracked(rows) and not any(gc.is_tracked(row.workers) for row in rows)
    # what the rules make is untracked too: a new entry, its rows, its row, its workers and its worker
    source = ("sim-0", 0, None, None, None)
    store = BlockEvent(BLOCK_STORED, source, 1, 0, 0, 0, 1767225600.0, b"\x07" * 8, "GPU", "GPU", None, None, None,
                       True, None, None, None)
    entry, _, _ = record.apply_block(None, store, NO_CLEAR, NO_CLEAR, frozenset({"GPU"}), ApplyStats(),
                                     source_aggregation(source, None))
    assert not gc.is_tracked(entry) and not gc.is_tracked(entry.rows) and not gc.is_tracked(entry.rows[0])
    assert not gc.is_tracked(entry.rows[0].workers) and not gc.is_tracked(entry.rows[0].workers[0])
    # a container put in a row is still freed, by reference counting
    held = Held()
    watch = weakref.ref(held)
    entry.rows[0]["medium"] = [held]  # then only the row holds it
    del held
    assert watch() is not None
    entry.rows[0]["medium"] = None
    assert watch() is None


def test_an_array_count_beyond_the_record_is_refused_as_the_codec_refuses_it(record):
    data = bytearray(CODEC.encode(ENTRIES["typical"]))
    start = SINGLE_OBJECT_HEADER_LEN
    cursor = start + 1 + data[start] // 2  # past the block hash (length varint of one byte, then its bytes)
    cursor += 1 + (1 + data[cursor + 1] // 2 if data[cursor] else 0)  # past the ownership's branch and string
    assert data[cursor] == 2 * len(ENTRIES["typical"]["rows"])  # the rows' count
    huge = bytes(data[:cursor]) + b"\xfe\xff\xff\xff\x0f" + bytes(data[cursor + 1:])  # 2**31 - 1 rows
    with pytest.raises(DecodeError):
        EntryCodec(CODEC, compiled=True).decode(huge)
    with pytest.raises(DecodeError):
        EntryCodec(CODEC, compiled=False).decode(huge)


def test_an_older_versions_bytes_are_resolved_by_the_codec_and_made_records(record):
    older = AvroCodec("residency", 2)
    entry = {key: value for key, value in ENTRIES["typical"].items() if key not in ("parent_block_hash",
                                                                                     "content_hash")}
    decoded = EntryCodec(CODEC, compiled=True).decode(older.encode(entry))
    assert type(decoded) is record.ResidencyEntry and decoded == {**entry, "parent_block_hash": None,
                                                                  "content_hash": None}


def test_a_value_the_compiled_writer_refuses_is_written_or_refused_by_the_python_writer(record):
    entry = record.from_dict(copy.deepcopy(ENTRIES["typical"]))
    entry["rows"][0]["last_ts"] = 1767225600  # an int where a double belongs: fastavro writes it as a double
    assert EntryCodec(CODEC, compiled=True).encode(entry) == ResidencyWriter(CODEC).encode(
        entry.as_dict()) == CODEC.encode(entry.as_dict())
    entry["rows"][0]["tier"] = "NVME"
    with pytest.raises(KeyError):
        EntryCodec(CODEC, compiled=True).encode(entry)


# --------------------------------------------------------------------------- the rules, event by event

SOURCES = [(instance, dp_rank, worker, world_size, mode)
           for instance in ("sim-0", "sim-1") for dp_rank in (0, 1) for worker, world_size, mode in (
               (None, None, None), (0, 2, "REPLICATED"), (1, 2, "REPLICATED"), (0, 2, "SHARDED"), (1, 2, "SHARDED"))]
POSITIONS = [NO_CLEAR, ClearPosition(1, 3, 0), ClearPosition(1, 5, 1), ClearPosition(2, 0, 0)]
CLEAR_SCOPES = [frozenset({"GPU"}), frozenset({"GPU", "CPU"}), frozenset()]

events = st.builds(
    lambda kind, source, epoch, seq, batch, block, ts, hash_byte, tier, medium, locality, group, ownership, known,
    content, parent, content_hash: BlockEvent(kind, source, epoch, seq, batch, block, ts, bytes([hash_byte]) * 8, tier,
                                              medium, locality, group, ownership,
                                              known if kind != BLOCK_REMOVED else None, content, parent, content_hash),
    st.sampled_from([BLOCK_STORED, BLOCK_STORED, BLOCK_REMOVED, BLOCK_STORED_OR_REUSED]), st.sampled_from(SOURCES),
    st.integers(1, 2), st.integers(0, 6), st.integers(0, 1), st.integers(0, 1),
    st.floats(1.7e9, 1.8e9), st.just(7), st.sampled_from(["GPU", "CPU", "UNKNOWN"]),
    st.sampled_from(["GPU", "cpu", None, "NVME"]), st.sampled_from([None, "LOCAL"]), st.sampled_from([None, 0, 1]),
    st.just(None), st.sampled_from([True, False, None]), st.sampled_from([None, 11, 12]),
    st.sampled_from([None, b"\x01" * 8]), st.sampled_from([None, -5, 1 << 62]))
steps = st.tuples(events, st.sampled_from(POSITIONS), st.sampled_from(POSITIONS), st.sampled_from(CLEAR_SCOPES),
                  st.sampled_from([None, (2, "REPLICATED"), (2, "SHARDED")]))


def _outcome(result):
    entry, delta, copies = result
    return (None if entry is None else dict(entry.as_dict() if hasattr(entry, "as_dict") else entry), delta, copies)


@PROPERTY
@given(st.lists(steps, min_size=1, max_size=25), st.booleans())
def test_the_compiled_rules_give_the_python_rules_results_event_by_event(record, sequence, start_from_dicts):
    """Every step: the same entry, delta, copies and counters; the same bytes; and the record read back from them
    is the entry. One key's events, from any of the sources, in any order, redeliveries and clears among them."""
    writer = ResidencyWriter(CODEC)
    records = EntryCodec(CODEC, compiled=True)
    python_entry = compiled_entry = None
    python_stats, compiled_stats = ApplyStats(), ApplyStats()
    for event, mark, watermark, scope, configured in sequence:
        aggregation = source_aggregation(event.source, configured)
        expected = rules.apply_block(python_entry, event, mark, watermark, scope, python_stats, aggregation)
        if start_from_dicts and compiled_entry is not None:
            compiled_entry = compiled_entry.as_dict()  # the record rules take the dicts too, and make them records
        got = record.apply_block(compiled_entry, event, mark, watermark, scope, compiled_stats, aggregation)
        assert _outcome(got) == _outcome(expected)
        assert asdict(compiled_stats) == asdict(python_stats)
        python_entry, compiled_entry = copy.deepcopy(expected[0]), got[0]
        if compiled_entry is not None:
            assert type(compiled_entry) is record.ResidencyEntry
            data = records.encode(compiled_entry)
            assert data == writer.encode(python_entry) and records.decode(data) == python_entry


@PROPERTY
@given(st.lists(steps, min_size=1, max_size=12), st.sampled_from(SOURCES), st.sampled_from(POSITIONS[1:]))
def test_clears_and_restarts_give_the_same_results_on_records_as_on_dicts(record, sequence, source, position):
    """The source-wide rules are the Python ones for both forms: they read a record as a mapping."""
    python_entry = compiled_entry = None
    for event, mark, watermark, scope, configured in sequence:
        aggregation = source_aggregation(event.source, configured)
        python_entry = rules.apply_block(python_entry, event, mark, watermark, scope, ApplyStats(), aggregation)[0]
        compiled_entry = record.apply_block(compiled_entry, event, mark, watermark, scope, ApplyStats(),
                                            aggregation)[0]
    if python_entry is None:
        return
    instance, dp_rank, worker, _, _ = source
    for rewrite in (lambda entry: apply_clear(entry, instance, dp_rank, position, frozenset({"GPU"}), ApplyStats()),
                    lambda entry: retire_epoch(entry, instance, dp_rank, worker, 2, ApplyStats())):
        expected_entry, expected_stopped, expected_changed = rewrite(copy.deepcopy(python_entry))
        got_entry, got_stopped, got_changed = rewrite(copy.deepcopy(compiled_entry))
        assert (got_entry, got_stopped, got_changed) == (expected_entry, expected_stopped, expected_changed)


# --------------------------------------------------------------------------- a batch message's loop

def test_the_compiled_loop_reads_the_block_event_fields_where_block_event_has_them(record):
    from schemas.block_event import BlockEvent

    assert {position: BlockEvent._fields[position] for position in record.EVENT_FIELDS} == record.EVENT_FIELDS


class _Outputs:
    """The output producer as the applier and the stores use it: changelog records and residency changes kept."""

    residency_changes = True
    report_successes = True

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.changes: list[tuple] = []
        self.producer = SimpleNamespace(produce=lambda *args: None)

    def change(self, *fields) -> None:
        self.changes.append(fields)


def _materializer(tmp_path, compiled: bool, name: str):
    """A Materializer over a worker's memory tables (no broker), its residency entries in the form asked for."""
    import faust

    from stream_apps.applier import Materializer
    from stream_apps.checkpoint import Checkpoint
    from stream_apps.settings import WorkerSettings
    from stream_apps.store import STORE_SCHEMES
    from stream_apps.tables import define_tables

    settings = WorkerSettings(bootstrap_servers="127.0.0.1:9", store="memory://", data_dir=tmp_path / name,
                              partitions=2, aggregation="sim-1=2:REPLICATED")
    app = faust.App(f"unit-records-{name}", broker="kafka://127.0.0.1:9", store=STORE_SCHEMES["memory://"],
                    datadir=str(tmp_path / name))
    tables = define_tables(app, settings)
    outputs = _Outputs()
    for table in tables.all():
        table.data.bind(outputs, bootstrap_servers="127.0.0.1:9", cache_entries=1000, compiled_entries=compiled)
    return Materializer(tables, outputs, Checkpoint(outputs, []), settings.sources)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.tuples(events, st.sampled_from(POSITIONS), st.booleans()), max_size=30),
                min_size=1, max_size=4))
def test_the_compiled_loop_applies_a_batch_as_the_python_loop_does(record, tmp_path_factory, batches):
    """Batch messages of block events through ``BatchApplier.apply_all``, with the record form's compiled loop and
    with the dicts' Python one: the same tables, the same residency changes, the same counters, and the same
    items handed back (records, and replicated stores without their digest)."""
    from stream_apps.applier import BatchApplier
    from stream_apps.residency import residency_key

    tmp_path = tmp_path_factory.mktemp("loop")
    results = []
    for compiled in (True, False):
        materializer = _materializer(tmp_path, compiled, "compiled" if compiled else "python")
        handed_back = []
        for batch in batches:
            items = []
            for event, mark, _ in batch:
                # a plain tuple, as the batch reader gives the block events (a BlockEvent is handed back)
                items.append((residency_key(event.ownership, event.block_hash), mark, b"", 0, 0, tuple(event)))
            if batch and batch[0][2]:
                items.append((items[0][0], NO_CLEAR, b"", 0, 0, None))  # an item without block fields
            applier = BatchApplier(materializer, 0)
            applier.apply_all(items, lambda item, error: handed_back.append(
                (item[5] is None, item[5] and item[5][5], type(error).__name__)))
            applier.finish()
        store = materializer.tables.residency_store
        entries = {key: store.lookup(key, 0) for key in store.partition_keys(0)}
        results.append(({key: _outcome((entry, 0, 0))[0] for key, entry in entries.items()},
                         dict(materializer.tables.tier_occupancy.data.data), materializer.outputs.changes,
                         asdict(materializer.stats), handed_back))
    compiled_results, python_results = results
    for got, expected in zip(compiled_results[:4], python_results[:4]):
        assert got == expected
    handed_back = compiled_results[4]
    applied_or_ignored = sum(map(len, batches)) - sum(1 for none, _, _ in handed_back if not none)
    assert compiled_results[3]["applied"] + compiled_results[3]["duplicates"] + compiled_results[3][
        "cleared_late"] + compiled_results[3]["unknown_removals"] >= applied_or_ignored - sum(
        1 for none, _, error in handed_back if none)  # every block event not handed back reached the rules
    # the compiled loop hands back the replicated stores the Python method refuses with NeedsRecord, as None
    assert [(none, index, error.replace("NeedsRecord", "NoneType")) for none, index, error in python_results[4]] == \
        compiled_results[4]


def test_the_compiled_loop_hands_back_an_event_the_record_cannot_hold_and_changes_nothing(record, tmp_path):
    from stream_apps.applier import BatchApplier
    from stream_apps.residency import residency_key

    materializer = _materializer(tmp_path, True, "odd")
    event = BlockEvent(BLOCK_STORED, SOURCES[0], 1, 0, 0, 1 << 40, 1.7e9, b"\x07" * 8, "GPU", "GPU", None, None, None,
                       True, None, None, None)  # block_index beyond the Avro int's 32 bits
    handed_back = []
    applier = BatchApplier(materializer, 0)
    applier.apply_all([(residency_key(None, event.block_hash), NO_CLEAR, b"", 0, 0, tuple(event))],
                      lambda item, error: handed_back.append(type(error)))
    applier.finish()
    assert handed_back == [OverflowError] and materializer.tables.residency_store.partition_keys(0) == []
    assert materializer.stats.applied == 0
