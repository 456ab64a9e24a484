"""The fleet index's lean read of residency changelog values (stream_apps/index/entry_reader.py) against the
codec's full decode, and the feed that uses it (stream_apps/index/feed.py) against the one that decoded every
value. Every test runs with the pure-Python lean reader and the compiled one (the ``hotpath`` fixture,
tests/conftest.py), and the tests that compare the two run both explicitly."""

from __future__ import annotations

import random

import pytest
from confluent_kafka import KafkaError, TopicPartition
from confluent_kafka.admin import ClusterMetadata, PartitionMetadata, TopicMetadata
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import AvroCodec, DecodeError
from schemas.avro_writers import ResidencyWriter
from schemas.codec import schema_versions
from stream_apps.index.entry_reader import LAYOUT_FINGERPRINT, IndexEntryReader, index_entry_of
from stream_apps.index.feed import ChangelogFeed
from stream_apps.index.fleet_index import FleetIndex
from stream_apps.index.table import PyBlockTable
from tests.conftest import compiled_module, hotpath_module
from tests.unit.test_fast_reader import _values

pytestmark = pytest.mark.usefixtures("hotpath")

CODEC = AvroCodec("residency")
V2 = AvroCodec("residency", version=2)
V1 = AvroCodec("residency", version=1)
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _entries(codec: AvroCodec):
    """Random entries of ``codec``'s version, every field drawn over its whole type (any string, long, double,
    union branch, array length), each row's ``copies`` then redrawn so that 0, negative and positive all come up
    often (rows of 0 copies must be skipped)."""
    schema = codec.schema.parsed
    any_entry = _values(schema, dict(schema.get("__named_schemas", {})))

    @st.composite
    def entries(draw):
        entry = draw(any_entry)
        for row in entry["rows"]:
            row["copies"] = draw(st.one_of(st.sampled_from([0, 0, 1, 2, -1]), st.integers(-(2**31), 2**31 - 1)))
        return entry
    return entries()


def _full(value: bytes):
    """What the index got before the lean reader: the codec's decode, cut to the index's part."""
    return index_entry_of(CODEC.decode(value))


def _outcome(read, value: bytes) -> str:
    try:
        return repr(read(value))  # repr: equal tuples, and never NaN (the index keeps no double)
    except DecodeError as exc:
        return f"DecodeError: {exc}"


def _readers() -> list[IndexEntryReader]:
    """The Python lean reader and the compiled one."""
    hotpath_module("compiled")  # fails (or skips, with KVSTREAM_PURE_PYTHON=1) when the module is not built
    return [IndexEntryReader(CODEC, compiled=False), IndexEntryReader(CODEC, compiled=True)]


def test_the_lean_layout_is_residency_v3_the_codecs_own_version():
    """Both lean readers walk residency_v3.avsc's fields by hand; the codec's newest version must be that one, or
    the readers must learn the new layout (until then they read nothing lean: see the next test)."""
    v3 = next(v for v in schema_versions("residency") if v.version == 3)
    assert LAYOUT_FINGERPRINT == v3.fingerprint == ResidencyWriter.FINGERPRINT
    assert CODEC.schema.fingerprint == LAYOUT_FINGERPRINT


def test_a_codec_of_another_own_version_reads_nothing_lean_and_still_gives_the_codecs_answer():
    reader = IndexEntryReader(V2)
    value = V2.encode({"block_hash": b"\x07", "ownership": None, "rows": []})
    assert reader.read_lean(value) is None
    assert reader.read_index_entry(value) == ([], None, None)


@SETTINGS
@given(data=st.data())
def test_an_entry_of_the_codecs_own_version_is_read_lean_as_the_full_decode_reads_it(data):
    entry = data.draw(_entries(CODEC))
    value = CODEC.encode(entry)
    expected = _full(value)
    assert expected == ([(r["instance_id"], r["data_parallel_rank"], r["tier"]) for r in entry["rows"]
                         if r["copies"] > 0], entry["parent_block_hash"], entry["content_hash"])
    for reader in _readers():
        assert reader.read_lean(value) == expected  # read lean, not left to the codec
        assert reader.read_index_entry(value) == expected
    assert IndexEntryReader(CODEC).read_index_entry(value) == expected  # the fixture's choice


def test_rows_of_zero_or_negative_copies_are_skipped_and_the_others_kept_in_order():
    row = {"instance_id": "e1", "data_parallel_rank": 0, "tier": "GPU", "medium": "GPU", "locality": None,
           "group_idx": 0, "world_size": 1, "aggregation": "REPLICATED",
           "workers": [{"worker_rank": -1, "count": 1, "publisher_epoch": 1_767_225_601_000, "seq": 123_456,
                        "batch_index": 3, "block_index": 2, "content": None}],
           "copies": 1, "since": 1.5, "last_ts": 2.5, "clear_mark": None}
    entry = {"block_hash": b"\x01" * 8, "ownership": "kvcr", "parent_block_hash": b"\x02" * 8,
             "content_hash": -(2**63), "rows": [
                 {**row, "instance_id": "waiting", "copies": 0},
                 {**row, "instance_id": "cpu", "tier": "CPU", "data_parallel_rank": 3, "copies": 2},
                 {**row, "instance_id": "gone", "copies": -1, "since": None},
                 {**row, "instance_id": "gpu", "clear_mark": {"publisher_epoch": 9, "seq": 8, "batch_index": 7}}]}
    value = ResidencyWriter(CODEC).encode(entry)  # the workers' encoder: the bytes a changelog holds
    assert value == CODEC.encode(entry)
    for reader in _readers():
        assert reader.read_lean(value) == ([("cpu", 3, "CPU"), ("gpu", 0, "GPU")], b"\x02" * 8, -(2**63))


@pytest.mark.parametrize("writer", [V2, V1], ids=["v2", "v1"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_an_entry_written_by_an_older_version_goes_to_the_codec_which_resolves_it(writer, data):
    value = writer.encode(data.draw(_entries(writer)))
    expected = _full(value)
    assert expected[1:] == (None, None)  # v1 and v2 have no parent_block_hash or content_hash: their defaults
    for reader in _readers():
        assert reader.read_lean(value) is None
        assert reader.read_index_entry(value) == expected


def test_a_confluent_framed_entry_goes_to_the_codec():
    """Registry framing of the codec's own version, under the id it registered (so its decode reads it in place):
    the lean readers take single-object framing only."""
    codec = AvroCodec("residency", registry_url="mock://index-entry-reader", subject="residency-changelog-value")
    entry = {"block_hash": b"\x07", "ownership": None, "rows": [], "parent_block_hash": b"\x06",
             "content_hash": 5}
    value = codec.encode(entry)
    assert value[:1] == b"\x00"
    for compiled in (False, True):
        hotpath_module("compiled")
        reader = IndexEntryReader(codec, compiled=compiled)
        assert reader.read_lean(value) is None
        assert reader.read_index_entry(value) == ([], b"\x06", 5) == index_entry_of(codec.decode(value))


def test_bytes_the_codec_refuses_raise_its_decode_error():
    value = CODEC.encode({"block_hash": b"\x07", "ownership": None, "rows": [], "parent_block_hash": None,
                          "content_hash": None})
    for reader in _readers():
        for broken in (value[:-1], value + b"\x00", b"\xc3\x01" + b"\x00" * 8 + value[10:], b"\x01\x02",
                       value[:10] + b"\x01" + value[11:]):
            with pytest.raises(DecodeError) as refused:
                reader.read_index_entry(broken)
            with pytest.raises(DecodeError) as expected:
                CODEC.decode(broken)
            assert str(refused.value) == str(expected.value)


#: One row's fields as raw Avro bytes, in the schema's order: instance 'e', rank 0, GPU, medium 'GPU', no locality,
#: group 0, world size 1, REPLICATED, one worker (rank -1, count 1, epoch 1,767,225,601,000, seq 123,456, indices 3
#: and 2, no content), 1 copy, since and last_ts 1.5, no clear mark.
ROW_FIELDS = {"instance_id": b"\x02e", "data_parallel_rank": b"\x00", "tier": b"\x00", "medium": b"\x02\x06GPU",
              "locality": b"\x00", "group_idx": b"\x02\x00", "world_size": b"\x02", "aggregation": b"\x00",
              "workers": b"\x02" + b"\x01\x02\xd0\xaf\xd5\xed\xee\x66\x80\x89\x0f\x06\x04\x00" + b"\x00",
              "copies": b"\x02", "since": b"\x02" + b"\x00" * 6 + b"\xf8\x3f", "last_ts": b"\x00" * 6 + b"\xf8\x3f",
              "clear_mark": b"\x00"}


def _row_bytes(medium_utf8: bytes | None = None, **fields: bytes) -> bytes:
    """One row encoded by hand (:data:`ROW_FIELDS`), the medium string given as its bytes (``medium_utf8``) and
    any field as its raw encoding."""
    if medium_utf8 is not None:
        fields["medium"] = b"\x02" + bytes([2 * len(medium_utf8)]) + medium_utf8
    return b"".join(fields.get(name, value) for name, value in ROW_FIELDS.items())


def _entry_bytes(*rows: bytes) -> bytes:
    """An entry of block 07, ownership null, ``rows``, no parent or content hash."""
    return CODEC.header + b"\x02\x07" + b"\x00" + (bytes([2 * len(rows)]) if rows else b"") + b"".join(rows) + (
        b"\x00" + b"\x00\x00")


def test_the_hand_built_row_is_what_the_codec_writes():
    row = {"instance_id": "e", "data_parallel_rank": 0, "tier": "GPU", "medium": "GPU", "locality": None,
           "group_idx": 0, "world_size": 1, "aggregation": "REPLICATED",
           "workers": [{"worker_rank": -1, "count": 1, "publisher_epoch": 1_767_225_601_000, "seq": 123_456,
                        "batch_index": 3, "block_index": 2, "content": None}],
           "copies": 1, "since": 1.5, "last_ts": 1.5, "clear_mark": None}
    assert _entry_bytes(_row_bytes()) == CODEC.encode({"block_hash": b"\x07", "ownership": None, "rows": [row],
                                                       "parent_block_hash": None, "content_hash": None})


#: Fields of a row replaced by bytes the codec refuses (refused) or reads (read), each once.
FIELD_CASES = {
    "tier index 5 of 5 symbols": ("tier", b"\x0a", True),
    "tier index -1": ("tier", b"\x01", True),
    "tier index 4": ("tier", b"\x08", False),
    "aggregation index 2 of 2 symbols": ("aggregation", b"\x04", True),
    "aggregation index 1": ("aggregation", b"\x02", False),
    "medium union branch 2": ("medium", b"\x04", True),
    "group_idx union branch -1": ("group_idx", b"\x01", True),
    "clear_mark": ("clear_mark", b"\x02\x02\x04\x06", False),
    "clear_mark cut short": ("clear_mark", b"\x02\x02\x04", True),
    "a worker's epoch of 10 bytes past bit 64": (
        "workers", b"\x02\x01\x02" + b"\xff" * 9 + b"\x02" + b"\x02\x06\x04\x00\x00", True),
    "a worker's epoch of 10 bytes up to bit 64": (
        "workers", b"\x02\x01\x02" + b"\xff" * 9 + b"\x01" + b"\x02\x06\x04\x00\x00", False),
    "a worker's seq of 11 bytes": (
        "workers", b"\x02\x01\x02\x02" + b"\x80" * 10 + b"\x00" + b"\x06\x04\x00\x00", True),
    "a worker's content": ("workers", b"\x02\x01\x02\x02\x02\x06\x04\x02\x7f\x00", False),
    "a worker's content union branch 2": ("workers", b"\x02\x01\x02\x02\x02\x06\x04\x04\x7f\x00", True),
    "a worker block giving its byte size": ("workers", b"\x01\x10\x01\x02\x02\x02\x06\x04\x00\x00", False),
    "two workers": ("workers", b"\x04" + b"\x01\x02\x02\x02\x06\x04\x00" * 2 + b"\x00", False),
    "copies 0": ("copies", b"\x00", False),
    "copies of 10 bytes up to bit 64": ("copies", b"\xfe" + b"\xff" * 8 + b"\x01", False),
    "since null": ("since", b"\x00", False),
    "since union branch 2": ("since", b"\x04" + b"\x00" * 6 + b"\xf8\x3f", True),
}


@pytest.mark.parametrize("field, raw, refused", FIELD_CASES.values(), ids=FIELD_CASES.keys())
def test_every_field_is_checked_as_the_codec_checks_it(field, raw, refused):
    value = _entry_bytes(_row_bytes(), _row_bytes(**{field: raw}))
    expected = _outcome(_full, value)
    assert expected.startswith("DecodeError") == refused
    for reader in _readers():
        assert _outcome(reader.read_index_entry, value) == expected
        assert (reader.read_lean(value) is None) == refused


@pytest.mark.parametrize("medium, refused", [(b"GPU", False), ("Grafikkarte\u00e9".encode(), False),
                                             (b"\xff", True), (b"\xed\xa0\x80", True), (b"\xc0\x80", True)])
def test_a_string_the_index_does_not_keep_is_still_checked_for_utf8_as_the_codec_checks_it(medium, refused):
    value = _entry_bytes(_row_bytes(medium))
    for reader in _readers():
        assert _outcome(reader.read_index_entry, value) == _outcome(_full, value)
        assert (reader.read_lean(value) is None) == refused
    if refused:
        with pytest.raises(DecodeError, match="UnicodeDecodeError"):
            _full(value)
    else:
        assert _full(value) == ([("e", 0, "GPU")], None, None)


def test_long_forms_the_codec_accepts_read_the_same():
    """A union index written in more bytes than it needs and an array block that gives its byte size (a negative
    count): legal Avro, which the codec reads; the lean readers read them, and to the same values."""
    row = _row_bytes(b"GPU")
    canonical = CODEC.header + b"\x02\x07" + b"\x00" + b"\x02" + row + b"\x00" + b"\x02\x02\x09" + b"\x02\x04"
    stretched = (CODEC.header + b"\x02\x07" + b"\x80\x00" + b"\x01" + bytes([2 * len(row)]) + row + b"\x00"
                 + b"\x82\x00\x02\x09" + b"\x82\x80\x00\x04")
    assert _full(canonical) == _full(stretched) == ([("e", 0, "GPU")], b"\x09", 2)
    for reader in _readers():
        assert reader.read_lean(canonical) == reader.read_lean(stretched) == _full(canonical)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupted_bytes_are_read_as_the_codec_reads_them_or_refused_with_its_error(data):
    """Up to three bytes changed, cut short or followed by more bytes: both lean readers give what the full
    decode gives (the index's part of it, or its DecodeError), and agree on what they read lean."""
    value = bytearray(CODEC.encode(data.draw(_entries(CODEC))))
    for _ in range(data.draw(st.integers(0, 3))):
        value[data.draw(st.integers(10, len(value) - 1))] = data.draw(st.integers(0, 255))
    value = bytes(value[:data.draw(st.integers(10, len(value)))] if data.draw(st.booleans()) else value)
    value += data.draw(st.binary(max_size=3))
    python, compiled = _readers()
    expected = _outcome(_full, value)
    assert _outcome(python.read_index_entry, value) == expected
    assert _outcome(compiled.read_index_entry, value) == expected
    assert repr(python.read_lean(value)) == repr(compiled.read_lean(value))


def test_a_varint_past_64_bits_is_refused_as_the_codec_refuses_it():
    # the first row's instance_id length as a 10-byte varint whose last byte is 2 (bit 64), then as one of 11 bytes
    head = CODEC.header + b"\x02\x07" + b"\x00" + b"\x02"
    for length in (b"\xff" * 9 + b"\x02", b"\xff" * 10 + b"\x00", b"\x80" * 9 + b"\x01"):
        value = head + length + b"e" * 8
        for reader in _readers():
            assert reader.read_lean(value) is None
            assert _outcome(reader.read_index_entry, value) == _outcome(_full, value)
            assert _outcome(_full, value).startswith("DecodeError")


# -- the index and the feed ------------------------------------------------------------------------------------


def _key(entry: dict) -> str:
    return f"{entry['ownership'] or 'primary'}/{entry['block_hash'].hex()}"


def _state(index: FleetIndex) -> tuple:
    # the dump lists the blocks "in no particular order" (BlockTable.items): a block removed and stored again
    # comes last from the Python table's dict and in its old slot from the compiled table's hash table
    dump = sorted(index.dump(), key=lambda block: block["block_hash"])
    return dump, index.stats(), index.workers(), index._holders


def _index_entries(blocks: list[bytes]):
    """Entries as far as the index reads them (block, ownership, rows' holders and copies, parent, content), over
    ``blocks``, three instances, two ranks and two tiers, so that records collide on blocks and holders."""
    rows = st.lists(st.fixed_dictionaries({"instance_id": st.sampled_from(["e1", "e2", "e3"]),
                                           "data_parallel_rank": st.integers(0, 1),
                                           "tier": st.sampled_from(["GPU", "CPU"]),
                                           "copies": st.integers(-1, 2)}), max_size=4)
    return st.fixed_dictionaries({"block_hash": st.sampled_from(blocks),
                                  "ownership": st.sampled_from([None, "kvcr"]), "rows": rows,
                                  "parent_block_hash": st.one_of(st.none(), st.sampled_from(blocks)),
                                  "content_hash": st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1))})


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_apply_rows_of_the_lean_tuple_builds_the_index_apply_entry_builds(data):
    entries = _index_entries([bytes([b]) * 8 for b in range(1, 6)])
    records = data.draw(st.lists(st.one_of(entries, entries.map(lambda e: (_key(e), None))), max_size=30))
    by_entry, by_rows = FleetIndex(table=PyBlockTable()), FleetIndex(table=PyBlockTable())
    for record in records:
        key, entry = record if isinstance(record, tuple) else (_key(record), record)
        by_entry.apply_entry(key, entry)
        if entry is None:
            by_rows.apply_rows(key, None)
        else:
            by_rows.apply_rows(key, *index_entry_of(entry))
    assert _state(by_rows) == _state(by_entry)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_apply_changelog_of_a_batch_builds_the_index_apply_rows_builds_and_names_each_record_it_refused(data):
    entries = _index_entries([bytes([b]) * 8 for b in range(1, 6)] + [bytes([7]) * 32])  # a sha256-sized hash too
    # a record: an entry, a tombstone of one, a key that is no residency key, or a value the reader refuses
    records = data.draw(st.lists(st.one_of(
        entries.map(lambda e: ("entry", e)), entries.map(lambda e: ("tombstone", e)),
        st.sampled_from([b"primary/zz", b"kvcr/01g2", b"\xff/00"]).map(lambda k: ("bad key", k)),
        entries.map(lambda e: ("bad value", e))), max_size=30))
    values = {}

    def read(value: bytes) -> tuple:
        if value == b"refused":
            raise DecodeError("a value the reader refuses")
        return index_entry_of(values[value])

    batch, expected_failures, one_by_one = [], [], FleetIndex(table=PyBlockTable())
    for position, (kind, item) in enumerate(records):
        if kind == "bad key":
            batch.append((item, b"x"))
            expected_failures.append(position)
            continue
        key = _key(item).encode()
        if kind == "bad value":
            batch.append((key, b"refused"))
            expected_failures.append(position)
        elif kind == "tombstone":
            batch.append((key, None if position % 2 else b""))
            one_by_one.apply_rows(key.decode(), None)
        else:
            values[str(position).encode()] = item
            batch.append((key, str(position).encode()))
            one_by_one.apply_rows(key.decode(), *index_entry_of(item))
    batched = FleetIndex(table=PyBlockTable())

    failures = batched.apply_changelog(batch, read)

    assert [position for position, _ in failures] == expected_failures
    assert all(isinstance(error, ValueError) for _, error in failures)
    assert _state(batched) == _state(one_by_one)


class _Message:
    """A consumed message as confluent-kafka's ``Message`` shows it to the feed; ``error`` one it carries."""

    def __init__(self, key: bytes | None, value: bytes | None, offset: int, partition: int = 0,
                 error: KafkaError | None = None) -> None:
        self._key, self._value, self._offset, self._partition, self._error = key, value, offset, partition, error

    def error(self):
        return self._error

    def key(self):
        return self._key

    def value(self):
        return self._value

    def partition(self):
        return self._partition

    def offset(self):
        return self._offset


def _compiled_table():
    table = compiled_module("stream_apps.index._table", "stream_apps/index/_table.pyx")
    return table.BlockTable()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_compiled_feed_loop_applies_a_consume_as_the_python_loop_does(data):
    """``BlockTable.apply_messages`` (C) against ``FleetIndex._apply_messages_python`` on one consume of
    random messages: entries (lean and v2, which the codec resolves), tombstones (None and empty), keys that
    are not residency keys (or not UTF-8), values the reader refuses, messages with no key or with an error,
    over three partitions."""
    entries = _index_entries([bytes([b]) * 8 for b in range(1, 6)] + [bytes([7]) * 32])
    kinds = st.one_of(entries.map(lambda e: ("entry", e)), entries.map(lambda e: ("v2", e)),
                      entries.map(lambda e: ("tombstone", e)), entries.map(lambda e: ("refused", e)),
                      st.sampled_from([b"primary/zz", b"kvcr/01g2", b"\xff/00", b"primary/" + b"0" * 15 + b"g",
                                       "primary/0101010101010101".encode("utf-16")]).map(lambda k: ("bad key", k)),
                      st.just(("no key", None)), st.just(("error", None)))
    drawn = data.draw(st.lists(st.tuples(kinds, st.integers(0, 2)), max_size=40))
    messages = []
    for offset, ((kind, item), partition) in enumerate(drawn):
        if kind == "bad key":
            message = _Message(item, b"x", offset, partition)
        elif kind == "no key":
            message = _Message(None, b"", offset, partition)
        elif kind == "error":
            message = _Message(None, None, offset, partition, KafkaError(KafkaError._PARTITION_EOF))
        else:
            key = _key(item).encode()
            value = {"entry": lambda e: CODEC.encode(_complete(e)), "tombstone": lambda e: None if offset % 2 else b"",
                     "v2": lambda e: V2.encode(_complete(e, version=2)), "refused": lambda e: BROKEN[offset % 2]}[kind]
            message = _Message(key, value(item), offset, partition)
        messages.append(message)
    read = IndexEntryReader(CODEC).read_index_entry
    answers = []
    for table in (PyBlockTable(), _compiled_table()):
        index, positions = FleetIndex(table=table), {}
        failures, errors = index.apply_messages(messages, positions, read)
        dump, stats, workers, holders = _state(index)
        stats.pop("memory_bytes")  # each table's own layout
        answers.append(((dump, stats, workers, holders), positions, index.counters.entries_applied,
                        [(message._offset, type(exc), str(exc)) for message, exc in failures],
                        [message._offset for message in errors]))
    assert answers[0] == answers[1]


def _complete(entry: dict, version: int = 3) -> dict:
    """An entry of :func:`_index_entries` with every other field of ``residency`` v``version`` filled in."""
    rows = [{"medium": None, "locality": None, "group_idx": None, "world_size": 1, "aggregation": "REPLICATED",
             "workers": [], "since": None, "last_ts": 1.0, "clear_mark": None, **row} for row in entry["rows"]]
    if version == 2:
        return {"block_hash": entry["block_hash"], "ownership": entry["ownership"], "rows": rows}
    return {**entry, "rows": rows}


class _Consumer:
    """A one-partition changelog for ChangelogFeed, as confluent-kafka's consumer shows it: ``messages`` (offsets
    0 to n-1) are all there is, served in order by ``consume``."""

    def __init__(self, topic: str, messages: list[_Message]) -> None:
        self.topic, self.messages, self.end = topic, messages, len(messages)

    def list_topics(self, topic: str, timeout: float) -> ClusterMetadata:
        metadata, topic_metadata = ClusterMetadata(), TopicMetadata()
        topic_metadata.topic, topic_metadata.partitions = self.topic, {0: PartitionMetadata()}
        metadata.topics = {self.topic: topic_metadata}
        return metadata

    def get_watermark_offsets(self, partition: TopicPartition, timeout: float | None = None,
                              cached: bool = False) -> tuple[int, int]:
        return 0, self.end

    def assign(self, partitions: list[TopicPartition]) -> None:
        assert [(tp.topic, tp.partition) for tp in partitions] == [(self.topic, 0)]

    def consume(self, count: int, timeout_s: float) -> list[_Message]:
        taken, self.messages = self.messages[:count], self.messages[count:]
        return taken

    def close(self) -> None:
        pass


class _EntryOnly:
    """An index wrapper with apply_entry only (as the bench's freshness replica): fed decoded entries."""

    def __init__(self, index: FleetIndex) -> None:
        self.index, self.lock, self.applied = index, index.lock, 0

    def apply_entry(self, key: str, entry) -> None:
        self.applied += 1
        self.index.apply_entry(key, entry)

    def stats(self) -> dict:
        return self.index.stats()


def _feed(index, messages: list[_Message]) -> ChangelogFeed:
    topic = "kvstream-residency-changelog"
    feed = ChangelogFeed(index, "unused:9092", topic, CODEC, consumer_factory=lambda config: _Consumer(topic, messages))
    while feed.poll(0):
        pass
    return feed


#: Values no codec reads: too short for a header, and the codec's own header before a body that is not an entry.
BROKEN = (b"\xc3\x01broken", CODEC.header + b"\x02\x07\x00\x09")


def test_the_feed_reads_a_changelog_into_the_index_the_full_decode_built():
    rng = random.Random(5)
    rows = [{"instance_id": f"e{i}", "data_parallel_rank": i % 2, "tier": ("GPU", "CPU")[i % 2], "medium": None,
             "locality": None, "group_idx": None, "world_size": 1, "aggregation": "REPLICATED", "workers": [],
             "copies": i % 3, "since": None, "last_ts": 1.0, "clear_mark": None} for i in range(6)]
    values = []
    for n in range(1200):  # more than one poll's batch (POLL_BATCH)
        block = rng.randrange(300).to_bytes(8, "big")
        entry = {"block_hash": block, "ownership": rng.choice([None, "kvcr"]), "rows": rng.sample(rows, 3),
                 "parent_block_hash": rng.choice([None, rng.randrange(300).to_bytes(8, "big")]),
                 "content_hash": rng.choice([None, rng.randrange(-(2**63), 2**63)])}
        kind = rng.random()
        value = (None if kind < 0.1 else V2.encode({k: v for k, v in entry.items() if k in ("block_hash", "ownership")}
                                                   | {"rows": [{**r, "workers": []} for r in entry["rows"]]})
                 if kind < 0.2 else BROKEN[n % 2] if kind < 0.22 else CODEC.encode(entry))
        values.append((_key(entry).encode(), value))
    messages = [_Message(key, value, offset) for offset, (key, value) in enumerate(values)]
    messages.append(_Message(None, b"", len(messages)))  # no key: skipped, as before
    messages.append(_Message(b"not a key", CODEC.encode(entry), len(messages)))  # ValueError: counted, skipped
    lean = FleetIndex(table=PyBlockTable())
    feed = _feed(lean, messages)
    decoded = _EntryOnly(FleetIndex(table=PyBlockTable()))
    old_feed = _feed(decoded, messages)
    broken = sum(1 for _, value in values if value in BROKEN)
    assert broken and any(value is None for _, value in values)  # tombstones
    assert decoded.applied == len(messages) - 1 - broken  # the wrapper was fed decoded entries, through apply_entry
    assert feed.records == old_feed.records == len(messages)
    assert feed.undecodable == old_feed.undecodable == broken + 1
    assert feed.caught_up and lean.stats()["blocks"] > 0
    assert _state(lean) == _state(decoded.index)


class _LateTopic(_Consumer):
    """A changelog that exists only from the third look at it (an index replica started before any worker)."""

    def __init__(self, topic: str, messages: list[_Message]) -> None:
        super().__init__(topic, messages)
        self.looks = 0

    def list_topics(self, topic: str, timeout: float) -> ClusterMetadata:
        self.looks += 1
        if self.looks < 3:
            metadata = ClusterMetadata()
            metadata.topics = {}
            return metadata
        return super().list_topics(topic, timeout)


def test_the_feed_looks_for_a_missing_changelog_with_one_consumer_then_reads_it():
    topic = "kvstream-residency-changelog"
    made = []
    messages = [_Message(None, b"", 0)]  # a record without a key: read and skipped

    def factory(config):
        made.append(_LateTopic(topic, messages))
        return made[-1]

    feed = ChangelogFeed(FleetIndex(), "unused:9092", topic, CODEC, consumer_factory=factory)
    feed._look.every_s = 0.0  # a look at every poll (TOPIC_RETRY_S apart otherwise)
    assert feed.poll(0) == 0 and feed.poll(0) == 0 and not feed.caught_up
    assert feed.poll(0) == 1 and feed.caught_up
    assert len(made) == 1 and made[0].looks == 3
