"""Hand-written Avro encoders (schemas.codec): byte for byte what fastavro writes, or a refusal."""

from __future__ import annotations

import dataclasses
import io

import fastavro
import pytest

from schemas import BLOCK_REMOVED, BLOCK_STORED, AvroCodec
from schemas.avro_writers import avro_long
from tests.conftest import HOTPATHS, record_module

LONG_MIN, LONG_MAX = -(1 << 63), (1 << 63) - 1
#: Around every power of two, both signs: every varint length from 1 to 10 bytes and its boundaries.
LONGS = sorted(n for n in {sign * ((1 << bits) + delta) for bits in range(64) for delta in (-1, 0, 1)
                           for sign in (1, -1)} | {0, -1024, -1025, 4095, 4096, LONG_MIN, LONG_MAX}
               if LONG_MIN <= n <= LONG_MAX)


def _fastavro_long(n: int) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema("long"), n)
    return out.getvalue()


def test_avro_long_writes_fastavros_bytes_for_every_varint_length():
    assert [avro_long(n) for n in LONGS] == [_fastavro_long(n) for n in LONGS]


# --------------------------------------------------------------------------- residency entries

INT_MIN, INT_MAX = -(1 << 31), (1 << 31) - 1
TIERS = ["GPU", "CPU", "STORAGE", "EXTERNAL", "UNKNOWN"]


def _worker(rank=-1, count=1, epoch=0, seq=7, batch_index=2, block_index=0, content=None) -> dict:
    return {"worker_rank": rank, "count": count, "publisher_epoch": epoch, "seq": seq, "batch_index": batch_index,
            "block_index": block_index, "content": content}


def _row(**fields) -> dict:
    row = {"instance_id": "sim-0", "data_parallel_rank": 0, "tier": "GPU", "medium": "GPU", "locality": None,
           "group_idx": None, "world_size": 1, "aggregation": "REPLICATED", "workers": [_worker()], "copies": 1,
           "since": 1767225600.25, "last_ts": 1767225600.5, "clear_mark": None}
    row.update(fields)
    return row


def _entry(rows, block_hash=b"\x00" * 7 + b"\x2a", ownership=None, parent_block_hash=None, content_hash=None) -> dict:
    return {"block_hash": block_hash, "ownership": ownership, "rows": rows, "parent_block_hash": parent_block_hash,
            "content_hash": content_hash}


ENTRIES = {
    "typical": _entry([_row()]),
    "with content keys": _entry([_row()], parent_block_hash=b"\x01" * 8, content_hash=-8_141_230_954_287_003_614),
    "content hash, first of its chain": _entry([_row(), _row(tier="CPU")], content_hash=LONG_MAX),
    "no rows": _entry([]),
    "row without workers": _entry([_row(workers=[], copies=0, since=None)]),
    # every optional field set, unicode strings, the extremes of int and long
    "everything set": _entry([_row(
        instance_id="sím-0/ünïcode ✓ 🚀", data_parallel_rank=INT_MAX, medium="CPU_PINNED ✓", locality="LOCAL",
        group_idx=INT_MIN, world_size=INT_MAX, aggregation="SHARDED",
        workers=[_worker(INT_MIN, INT_MAX, LONG_MIN, LONG_MAX, INT_MIN, INT_MAX, LONG_MAX),
                 _worker(0, 0, LONG_MAX, LONG_MIN, INT_MAX, INT_MIN, LONG_MIN)],
        copies=INT_MIN, since=-0.0, last_ts=1e308,
        clear_mark={"publisher_epoch": LONG_MIN, "seq": LONG_MAX, "batch_index": INT_MIN})],
        block_hash=bytes(range(32)), ownership="kvcr-ø", parent_block_hash=bytes(range(64)), content_hash=LONG_MIN),
    "empty strings and hash": _entry([_row(instance_id="", medium="", locality="", group_idx=0, since=0.0,
                                           clear_mark={"publisher_epoch": 0, "seq": 0, "batch_index": 0})],
                                     block_hash=b"", ownership="", parent_block_hash=b"", content_hash=0),
    # negative numbers around the varint boundaries, millisecond epochs, big seqs
    "negative and large": _entry([_row(data_parallel_rank=-1, group_idx=-65, workers=[
        _worker(-1, -1, -1, -1, -1, -1, -1), _worker(1, 8192, 1767225600123, 1 << 40, 4096, -1025, 64),
        _worker(2, -8193, -1767225600123, -(1 << 40), -4096, 1025)], copies=-64, since=-1.5, last_ts=-2.25,
        clear_mark={"publisher_epoch": 1767225600123, "seq": -5000, "batch_index": 63})]),
    # every tier and aggregation symbol, one row each, with mixed optionals
    "every enum symbol": _entry([
        _row(instance_id=f"sim-{i}", tier=tier, aggregation=("REPLICATED", "SHARDED")[i % 2],
             medium=None if i % 2 else tier, locality=("LOCAL", None, "REMOTE")[i % 3],
             group_idx=None if i % 3 else i, since=None if i % 2 else float(i),
             clear_mark=None if i % 2 else {"publisher_epoch": i, "seq": i * 1000, "batch_index": i},
             workers=[_worker(rank, i, i, i * 10_000, i, rank) for rank in range(i)])
        for i, tier in enumerate(TIERS)], ownership="kvcr"),
}


class _RecordWriter:
    """The compiled record's writer (stream_apps/residency/_record.pyx) given the dicts: each entry is made a
    record first."""

    def __init__(self, codec: AvroCodec) -> None:
        from stream_apps.residency.records import EntryCodec

        self.record = record_module("compiled")
        self.entries = EntryCodec(codec, compiled=True)

    def encode(self, entry: dict) -> bytes:
        return self.entries.encode(self.record.from_dict(entry))


@pytest.fixture(scope="module", params=HOTPATHS)
def residency(request):
    """The residency codec and a writer, once per implementation (tests/conftest.py): the reference writer of the
    dicts, and the compiled record's."""
    from schemas.avro_writers import ResidencyWriter

    codec = AvroCodec("residency")
    return codec, ResidencyWriter(codec) if request.param == "python" else _RecordWriter(codec)


@pytest.mark.parametrize("entry", ENTRIES.values(), ids=ENTRIES.keys())
def test_residency_writer_writes_fastavros_bytes(residency, entry):
    codec, writer = residency
    assert writer.encode(entry) == codec.encode(entry)
    assert writer.encode(entry) == codec.encode(entry)  # again, from the writer's caches
    assert codec.decode(writer.encode(entry)) == entry


def test_residency_writer_writes_apply_block_events_entries_and_the_codecs_decoded_ones(residency):
    from schemas.clear_position import NO_CLEAR
    from stream_apps.residency import ApplyStats, apply_block_event

    codec, writer = residency
    entry = None
    for seq, kind, tier, worker in [(1, BLOCK_STORED, "GPU", None), (2, BLOCK_STORED, "CPU", 0),
                                    (3, BLOCK_STORED, "CPU", 1), (4, BLOCK_REMOVED, "GPU", None)]:
        record = {"instance_id": "sim-0", "data_parallel_rank": 0, "worker_rank": worker, "world_size": None,
                  "aggregation": None, "publisher_epoch": 1767225600123, "seq": seq, "batch_index": 0,
                  "block_index": 0, "ts": 100.0 + seq, "block_hash": b"\x01" * 8, "tier": tier,
                  "event": (kind, {"medium": tier, "locality": None, "group_idx": None, "ownership": None})}
        entry, _, _ = apply_block_event(entry, record, (0, seq, 0), NO_CLEAR, frozenset({"GPU"}), ApplyStats())
        assert writer.encode(entry) == codec.encode(entry)
        assert writer.encode(codec.decode(writer.encode(entry))) == codec.encode(entry)


def test_residency_writer_caches_do_not_mix_up_entries(residency):
    """The writer caches row identities, optional strings, large longs and clear marks by value: entries that
    differ in one of them only must still get their own bytes, in whatever order they come."""
    codec, writer = residency
    identities = [dict(zip(("instance_id", "data_parallel_rank", "tier", "medium", "locality", "group_idx",
                            "world_size", "aggregation"), values))
                  for values in [("a", 0, "GPU", None, None, None, 1, "REPLICATED"),
                                 ("a", 1, "GPU", None, None, None, 1, "REPLICATED"),
                                 ("a", 1, "CPU", None, None, None, 1, "REPLICATED"),
                                 ("a", 1, "CPU", "CPU", None, None, 1, "REPLICATED"),
                                 ("a", 1, "CPU", None, "CPU", None, 1, "REPLICATED"),
                                 ("a", 1, "CPU", None, None, 0, 1, "REPLICATED"),
                                 ("a", 1, "CPU", None, None, 0, 2, "REPLICATED"),
                                 ("a", 1, "CPU", None, None, 0, 2, "SHARDED"),
                                 ("b", 1, "CPU", None, None, 0, 2, "SHARDED")]]
    marks = [None, {"publisher_epoch": 1767225600123, "seq": 5, "batch_index": 0},
             {"publisher_epoch": 1767225600123, "seq": 5, "batch_index": 1},
             {"publisher_epoch": 1767225600124, "seq": 5, "batch_index": 1}]
    seen = [_entry([_row(**identity, clear_mark=mark, workers=[_worker(epoch=epoch, content=content)])],
                   ownership=ownership, parent_block_hash=parent, content_hash=content_hash)
            for identity in identities for mark in marks
            for epoch, content in [(1767225600123, None), (1767225600124, -(1 << 62)), (1767225600124, 1 << 62)]
            for ownership in (None, "kvcr", "CPU")
            # content hashes equal to a content digest or an epoch share the long cache: still their own bytes
            for parent, content_hash in [(None, None), (b"\x07" * 8, 1 << 62), (None, 1767225600124)]]
    for entry in seen * 2:
        assert writer.encode(entry) == codec.encode(entry)


# --------------------------------------------------------------------------- residency changes

def _change(**fields) -> dict:
    change = {"block_hash": b"\x01" * 8, "ownership": None, "instance_id": "sim-0", "data_parallel_rank": 0,
              "tier": "GPU", "medium": "GPU", "locality": None, "group_idx": None, "resident": True, "copies": 1,
              "ts": 1767225600.25, "cause": "BlockStored"}
    change.update(fields)
    return change


CHANGES = {
    "became resident": _change(),
    "stopped, clear": _change(medium=None, resident=False, copies=0, cause="AllBlocksCleared"),
    "everything set": _change(block_hash=bytes(range(32)), ownership="kvcr-ø", instance_id="sím-0 🚀",
                              data_parallel_rank=INT_MAX, tier="UNKNOWN", medium="nvme ✓", locality="REMOTE",
                              group_idx=INT_MIN, copies=INT_MAX, ts=-0.0, cause="PublisherRestarted ✓"),
    "empty and negative": _change(block_hash=b"", ownership="", instance_id="", data_parallel_rank=-1,
                                  medium="", locality="", group_idx=-1, resident=False, copies=-8193, ts=1e-300,
                                  cause=""),
    **{f"tier {tier}": _change(tier=tier, group_idx=i, copies=i * 5000) for i, tier in enumerate(TIERS)},
}


@pytest.fixture(scope="module")
def changes():
    from schemas.avro_writers import ResidencyChangeWriter

    codec = AvroCodec("residency_change")
    return codec, ResidencyChangeWriter(codec)


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_residency_change_writer_writes_fastavros_bytes(changes, change):
    codec, writer = changes
    expected = codec.encode(change)
    assert writer.encode(change) == expected
    assert writer.change(*change.values()) == expected  # the fields in the schema's order, from the caches
    assert codec.decode(expected) == change


def test_change_writer_caches_do_not_mix_up_records(changes):
    codec, writer = changes
    seen = [_change(**dict(zip(("instance_id", "tier", "medium", "locality", "group_idx", "cause"), values)))
            for values in [("a", "GPU", None, None, None, "x"), ("a", "CPU", None, None, None, "y"),
                           ("a", "CPU", "CPU", None, None, "x"), ("a", "CPU", "CPU", "LOCAL", None, "x"),
                           ("a", "CPU", "CPU", "LOCAL", 0, "x"), ("b", "CPU", "CPU", "LOCAL", 0, "x")]]
    seen += [{**change, "ownership": ownership} for change in seen for ownership in ("kvcr", "a", "")]
    for change in seen * 2:
        assert writer.encode(change) == codec.encode(change)


# --------------------------------------------------------------------------- framing and refusals

def test_writers_reuse_a_registry_codecs_confluent_header():
    from schemas.avro_writers import ResidencyChangeWriter, ResidencyWriter

    for family, writer_class, record in [("residency", ResidencyWriter, ENTRIES["everything set"]),
                                         ("residency_change", ResidencyChangeWriter, CHANGES["everything set"])]:
        codec = AvroCodec(family, registry_url="mock://writers-test", subject=f"{family}-value")
        data = writer_class(codec).encode(record)
        assert data[:1] == b"\x00" and data == codec.encode(record)


@pytest.mark.parametrize("family, version", [("residency", 3), ("residency_change", 1)])
def test_writers_refuse_any_other_writer_schema(family, version):
    from schemas.avro_writers import ResidencyChangeWriter, ResidencyWriter

    writer_class = {"residency": ResidencyWriter, "residency_change": ResidencyChangeWriter}[family]
    writer_class(AvroCodec(family, version))
    other = "residency_change" if family == "residency" else "residency"
    with pytest.raises(ValueError, match=f"encodes {family} v{version}"):
        writer_class(AvroCodec(other))
    if version > 1:  # the older version of the same family
        with pytest.raises(ValueError, match=f"not {family} v{version - 1}"):
            writer_class(AvroCodec(family, version - 1))
    # a new version, or the same file edited so that its bytes change (e.g. a Tier symbol added): both change
    # the schema the codec writes
    for changed in ({"version": version + 1}, {"fingerprint": b"\x00" * 8}):
        codec = AvroCodec(family)
        codec.schema = dataclasses.replace(codec.schema, **changed)
        with pytest.raises(ValueError, match="use AvroCodec.encode or update the writer"):
            writer_class(codec)


def test_writers_fingerprints_are_those_of_the_schema_files():
    from schemas.avro_writers import ResidencyChangeWriter, ResidencyWriter
    from schemas.codec import schema_versions

    for writer_class in (ResidencyWriter, ResidencyChangeWriter):
        version = next(v for v in schema_versions(writer_class.FAMILY) if v.version == writer_class.VERSION)
        assert version.fingerprint == writer_class.FINGERPRINT


def test_writers_reject_unknown_enum_symbols(residency, changes):
    with pytest.raises(KeyError):
        residency[1].encode(_entry([_row(tier="HBM")]))
    with pytest.raises(KeyError):
        residency[1].encode(_entry([_row(aggregation="MEAN")]))
    with pytest.raises(KeyError):
        changes[1].encode(_change(tier="HBM"))


# --------------------------------------------------------------------------- property test

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ints = st.integers(INT_MIN, INT_MAX) | st.sampled_from([-1, 0, 1, 63, 64, -65, 4095, 4096, 8192])
longs = st.integers(LONG_MIN, LONG_MAX) | ints | st.integers(1_600_000_000_000, 1_900_000_000_000)
doubles = st.floats(allow_nan=True, allow_infinity=True)
texts = st.text(max_size=12) | st.sampled_from(["GPU", "CPU", "LOCAL", "REMOTE", "sim-0"])
workers = st.fixed_dictionaries({"worker_rank": ints, "count": ints, "publisher_epoch": longs, "seq": longs,
                                 "batch_index": ints, "block_index": ints, "content": st.none() | longs})
rows = st.fixed_dictionaries({
    "instance_id": texts, "data_parallel_rank": ints, "tier": st.sampled_from(TIERS), "medium": st.none() | texts,
    "locality": st.none() | texts, "group_idx": st.none() | ints, "world_size": ints,
    "aggregation": st.sampled_from(["REPLICATED", "SHARDED"]), "workers": st.lists(workers, max_size=4),
    "copies": ints, "since": st.none() | doubles, "last_ts": doubles,
    "clear_mark": st.none() | st.fixed_dictionaries({"publisher_epoch": longs, "seq": longs, "batch_index": ints})})
content_keys = {"parent_block_hash": st.none() | st.binary(max_size=64), "content_hash": st.none() | longs}
entries = st.fixed_dictionaries({"block_hash": st.binary(max_size=40), "ownership": st.none() | texts,
                                 "rows": st.lists(rows, max_size=4), **content_keys})
change_records = st.fixed_dictionaries({
    "block_hash": st.binary(max_size=40), "ownership": st.none() | texts, "instance_id": texts,
    "data_parallel_rank": ints, "tier": st.sampled_from(TIERS), "medium": st.none() | texts,
    "locality": st.none() | texts, "group_idx": st.none() | ints, "resident": st.booleans(), "copies": ints,
    "ts": doubles, "cause": texts})
PROPERTY = settings(max_examples=300, deadline=None)


@PROPERTY
@given(entries)
def test_residency_writer_matches_fastavro_on_any_entry(residency, entry):
    codec, writer = residency
    assert writer.encode(entry) == codec.encode(entry)


#: Ints around the small-int table's bounds (-1024..4095, encoded in line) and the varint lengths' bounds.
edge_ints = st.sampled_from([-1025, -1024, -1023, -65, -64, -1, 0, 63, 64, 4094, 4095, 4096, 8191, 8192,
                             (1 << 20) - 1, 1 << 20, INT_MAX, INT_MIN]) | ints
one_worker_rows = rows.map(dict).flatmap(lambda row: st.builds(
    lambda worker, **ints: {**row, **ints, "workers": [worker]},
    st.fixed_dictionaries({"worker_rank": edge_ints, "count": edge_ints, "publisher_epoch": longs | edge_ints,
                           "seq": longs | edge_ints, "batch_index": edge_ints, "block_index": edge_ints,
                           "content": st.none() | longs}),
    data_parallel_rank=edge_ints, group_idx=st.none() | edge_ints, world_size=edge_ints, copies=edge_ints))


@PROPERTY
@given(st.fixed_dictionaries({"block_hash": st.binary(max_size=40), "ownership": st.none() | texts,
                              "rows": st.lists(one_worker_rows, min_size=1, max_size=1), **content_keys}))
def test_residency_writer_matches_fastavro_on_any_one_row_one_worker_entry(residency, entry):
    """The shape most entries have, which the writer encodes without its loops."""
    codec, writer = residency
    assert writer.encode(entry) == codec.encode(entry)


@PROPERTY
@given(change_records)
def test_residency_change_writer_matches_fastavro_on_any_change(changes, change):
    codec, writer = changes
    assert writer.encode(change) == codec.encode(change)


# --------------------------------------------------------------------------- the stream app's use

def test_stream_app_encodes_with_the_writers_and_falls_back_to_fastavro_when_one_refuses(caplog):
    from schemas.topics import TopicNames
    from stream_apps.outputs import CHANGE_FIELDS, OutputTopics
    from stream_apps.residency.records import EntryCodec
    from stream_apps.store import value_encoder

    assert isinstance(value_encoder(AvroCodec("residency")).__self__, EntryCodec)
    change = CHANGES["everything set"]
    fields = [change[name] for name in CHANGE_FIELDS]
    outputs = OutputTopics("127.0.0.1:9", TopicNames())  # no producer is made until a record is sent
    assert outputs._encode_change(*fields) == AvroCodec("residency_change").encode(change)
    with caplog.at_level("WARNING"):
        codec = AvroCodec("residency")
        codec.schema = dataclasses.replace(codec.schema, version=codec.schema.version + 1)
        encode = value_encoder(codec)
    entry = ENTRIES["everything set"]
    assert encode(entry) == codec.encode(entry) and not encode.__self__.compiled
    assert "encoding residency entries with fastavro" in caplog.text


#: Values of other types than the agent writes, where an int or a double belongs: the compiled encoder hands
#: such entries back to the Python one, so both must give the same bytes or the same refusal.
odd_numbers = st.sampled_from([True, False, 1.0, 2.5, float("nan"), 1 << 63, -(1 << 63) - 1, 1 << 70, "1", None, b"1"])


def _encoded_or_refusal(writer, entry):
    try:
        return writer.encode(entry)
    except Exception as exc:  # noqa: BLE001 - the refusal itself is compared
        return type(exc).__name__


@PROPERTY
@given(st.fixed_dictionaries({"block_hash": st.binary(max_size=40) | st.sampled_from(["text", None]),
                              "ownership": st.none() | texts,
                              "rows": st.lists(one_worker_rows, max_size=2), **content_keys}),
       st.lists(st.tuples(st.sampled_from(["copies", "since", "last_ts", "data_parallel_rank", "group_idx",
                                           "world_size", "medium", "tier", "aggregation", "clear_mark",
                                           "parent_block_hash", "content_hash"]),
                          odd_numbers | st.sampled_from([bytearray(b"12"), "12"])), max_size=2))
def test_the_compiled_residency_encoder_agrees_with_the_python_one_on_odd_values(entry, odd):
    """A record holds some odd values (in its fields of any Python type: strings, doubles, the content keys); what
    its writer refuses goes to the Python writer, so both give the same bytes or the same refusal."""
    from schemas.avro_writers import ResidencyWriter

    codec = AvroCodec("residency")
    for field, value in odd:
        if field in ("parent_block_hash", "content_hash"):  # the entry's own fields
            entry[field] = value
        for row in entry["rows"]:
            row[field] = value
    try:
        record = record_module("compiled").from_dict(entry)
    except (TypeError, OverflowError):
        # an int field of the record holds only an int of 32 bits (a long one of 64), a row's times only a number
        assume(False)
    assert _encoded_or_refusal(_RecordWriter(codec).entries, record) == _encoded_or_refusal(
        ResidencyWriter(codec), entry)
