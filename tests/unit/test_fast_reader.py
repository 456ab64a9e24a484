"""The generated Avro readers (schemas/fast_reader.py) against fastavro, on every schema of the project, and the
compiled readers (schemas/_hotpath.pyx, ``read_program``) against the generated ones. Every test runs with both
implementations (the ``hotpath`` fixture, tests/conftest.py)."""

from __future__ import annotations

import io
import struct

import fastavro
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import AvroCodec, DecodeError, fast_reader
from schemas import compiled as compiled_module
from schemas.codec import schema_versions
from schemas.fast_reader import ReadError, compile_program, compile_reader
from tests.conftest import hotpath_module

FAMILIES = ("kv_event", "ownership_batch", "residency", "residency_change", "clear_watermark", "source_clears",
            "source_status", "tier_occupancy")

pytestmark = pytest.mark.usefixtures("hotpath")

ints = st.integers(min_value=-(2**31), max_value=2**31 - 1)
longs = st.integers(min_value=-(2**63), max_value=2**63 - 1)


def _values(schema, named: dict, return_names: bool = True):
    """A strategy of Python values of ``schema`` in fastavro's reading form (``(name, dict)`` for a record in a
    union)."""
    if isinstance(schema, str) and schema in named:
        return _values(named[schema], named, return_names)
    if isinstance(schema, list):
        options = []
        for branch in schema:
            target = named.get(branch, branch) if isinstance(branch, str) else branch
            values = _values(branch, named)
            if isinstance(target, dict) and target.get("type") == "record":
                values = values.map(lambda record, name=target["name"]: (name, record))
            options.append(values)
        return st.one_of(options)
    kind = schema if isinstance(schema, str) else schema["type"]
    if kind in ("record", "enum"):
        named[schema["name"]] = schema
    return {
        "null": lambda: st.none(), "boolean": st.booleans, "int": lambda: ints, "long": lambda: longs,
        "double": lambda: st.floats(allow_nan=False), "float": lambda: st.floats(width=32, allow_nan=False),
        "string": lambda: st.text(max_size=12), "bytes": lambda: st.binary(max_size=20),
        "enum": lambda: st.sampled_from(schema["symbols"]),
        "array": lambda: st.lists(_values(schema["items"], named), max_size=4),
        "record": lambda: st.fixed_dictionaries({f["name"]: _values(f["type"], named) for f in schema["fields"]}),
    }[kind]()


def _codec_and_strategy(family: str):
    codec = AvroCodec(family)
    return codec, _values(codec.schema.parsed, dict(codec.schema.parsed.get("__named_schemas", {})))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_schema_of_the_project_gets_a_generated_reader(family):
    assert compile_reader(AvroCodec(family).schema.parsed) is not None


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_generated_reader_reads_what_fastavro_reads(family, data):
    codec, values = _codec_and_strategy(family)
    record = data.draw(values)
    encoded = codec.encode(record)
    expected = fastavro.schemaless_reader(io.BytesIO(encoded[10:]), codec.schema.parsed, None,
                                          return_record_name=True,
                                          return_record_name_override=codec._override_names)
    assert codec._fast_read is not None  # the codec reads every family's own records with its generated reader
    assert codec.decode(encoded) == expected
    assert compile_reader(codec.schema.parsed, codec._override_names)(encoded, 10) == (expected, len(encoded))


def test_the_record_name_override_reads_a_nullable_record_bare_and_keeps_names_elsewhere():
    """fastavro's return_record_name_override, which the residency family is read with: a ["null", record]
    union gives the dict; a union of several records (kv_event.event) still gives (name, dict)."""
    named: dict = {}
    schema = fastavro.parse_schema({"type": "record", "name": "T", "fields": [
        {"name": "mark", "type": ["null", {"type": "record", "name": "M", "fields": [{"name": "x", "type": "int"}]}]},
        {"name": "either", "type": [{"type": "record", "name": "A", "fields": [{"name": "a", "type": "int"}]},
                                    {"type": "record", "name": "B", "fields": [{"name": "b", "type": "string"}]}]},
        {"name": "again", "type": ["M", "null"]}]}, named_schemas=named)
    value = {"mark": {"x": 7}, "either": ("B", {"b": "z"}), "again": {"x": -1}}
    out = io.BytesIO()
    fastavro.schemaless_writer(out, schema, value)
    expected = {"mark": {"x": 7}, "either": ("B", {"b": "z"}), "again": {"x": -1}}
    assert fastavro.schemaless_reader(io.BytesIO(out.getvalue()), schema, None, return_record_name=True,
                                      return_record_name_override=True) == expected
    assert compile_reader(schema, override_names=True)(out.getvalue(), 0) == (expected, len(out.getvalue()))
    assert compile_reader(schema)(out.getvalue(), 0)[0] == {"mark": ("M", {"x": 7}), "either": ("B", {"b": "z"}),
                                                            "again": ("M", {"x": -1})}


# the materializing agent decodes these per event / per read
@pytest.mark.parametrize("family", ("kv_event", "residency"))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_truncated_record_is_a_decode_error_at_every_length(family, data):
    codec, values = _codec_and_strategy(family)
    encoded = codec.encode(data.draw(values))
    for length in range(10, len(encoded)):
        with pytest.raises(DecodeError):
            codec.decode(encoded[:length])


@pytest.mark.parametrize("family", ("kv_event", "residency"))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_corrupted_record_is_refused_or_read_as_fastavro_reads_it(family, data):
    codec, values = _codec_and_strategy(family)
    encoded = bytearray(codec.encode(data.draw(values)))
    position = data.draw(st.integers(min_value=10, max_value=len(encoded) - 1))
    encoded[position] = data.draw(st.integers(min_value=0, max_value=255))
    try:
        ours = codec.decode(bytes(encoded))
    except DecodeError:
        return  # refusing is always allowed (stricter than fastavro on booleans)
    stream = io.BytesIO(bytes(encoded[10:]))
    theirs = fastavro.schemaless_reader(stream, codec.schema.parsed, None, return_record_name=True,
                                        return_record_name_override=codec._override_names)
    # repr: a corrupted double can be NaN, which equals nothing, not even itself
    assert repr(ours) == repr(theirs) and stream.tell() == len(encoded) - 10


def test_hand_checked_errors_name_the_problem():
    codec = AvroCodec("kv_event")
    record = {"instance_id": "a", "data_parallel_rank": 0, "worker_rank": None, "world_size": None,
              "aggregation": None, "publisher_epoch": 1, "seq": 2, "batch_index": 0, "ts": 1.5, "block_hash": b"\x01",
              "hash_encoding": schema_versions("kv_event")[-1].parsed["fields"][10]["type"]["symbols"][0],
              "block_index": 0, "block_count": 1, "tier": "GPU",
              "event": ("kvstream.v1.BlockRemoved", {"medium": "GPU", "group_idx": None, "locality": None,
                                                     "ownership": None})}
    encoded = codec.encode(record)
    assert codec.decode(encoded) == record
    # instance_id's length varint (byte 10) made negative: -1 is zig-zag 1
    with pytest.raises(DecodeError, match="bad length -1"):
        codec.decode(encoded[:10] + b"\x01" + encoded[11:])
    # the tier union index (2 = branch 1, the enum) replaced by branch 5 (there are 2)
    tier_at = encoded.index(b"\x02\x00", 20)  # tier: union branch 1, enum symbol 0 (GPU)
    with pytest.raises(DecodeError, match="union branch 5"):
        codec.decode(encoded[:tier_at] + b"\x0a" + encoded[tier_at + 1:])
    with pytest.raises(DecodeError, match="1 trailing bytes"):
        codec.decode(encoded + b"\x00")


def test_a_union_index_in_a_longer_varint_reads_as_fastavro_reads_it():
    """The readers compare a union's one-byte index without decoding it; an index written in more bytes than it
    needs (legal Avro, which fastavro accepts) takes the decoding path and must pick the same branch."""
    schema = fastavro.parse_schema({"type": "record", "name": "U", "fields": [
        {"name": "a", "type": ["null", "int"]}, {"name": "b", "type": ["null", "string", "long"]}]})
    # a: branch 1 (int 3) with its index as 0x82 0x00; b: branch 2 (long -1) as 0x84 0x80 0x00; then a
    # negative branch index (-1, zig-zag 1) written long, which both refuse
    canonical = b"\x02\x06\x04\x01"
    stretched = b"\x82\x00\x06\x84\x80\x00\x01"
    expected = fastavro.schemaless_reader(io.BytesIO(stretched), schema, None)
    assert expected == fastavro.schemaless_reader(io.BytesIO(canonical), schema, None) == {"a": 3, "b": -1}
    read = compile_reader(schema)
    assert read(stretched, 0) == (expected, len(stretched))
    with pytest.raises(ReadError, match="union branch -1"):
        read(b"\x81\x00\x00", 0)


def test_the_compiled_module_numbers_the_program_operations_as_the_program_compiler_does():
    names = ("OP_NULL", "OP_BOOLEAN", "OP_LONG", "OP_FLOAT", "OP_DOUBLE", "OP_STRING", "OP_BYTES", "OP_ENUM",
             "OP_ARRAY", "OP_RECORD", "OP_UNION", "OP_PROJECT_RECORD", "OP_PROJECT_UNION")
    assert hotpath_module("compiled").OPERATIONS == tuple(getattr(fast_reader, name) for name in names)


def _read_or_refusal(read, data: bytes):
    try:
        return repr(read(data, 10))  # repr: a NaN read from corrupted bytes equals nothing, not even itself
    except (ReadError, ValueError, IndexError, struct.error):  # UnicodeDecodeError is a ValueError
        return "refused"


def _damaged_record(family: str, data) -> tuple[AvroCodec, bytes]:
    """A codec of ``family`` and one of its records with up to three bytes changed, maybe cut short, and followed
    by up to three more bytes."""
    codec, values = _codec_and_strategy(family)
    encoded = bytearray(codec.encode(data.draw(values)))
    for _ in range(data.draw(st.integers(0, 3))):
        encoded[data.draw(st.integers(10, len(encoded) - 1))] = data.draw(st.integers(0, 255))
    encoded = bytes(encoded[:data.draw(st.integers(10, len(encoded)))] if data.draw(st.booleans()) else encoded)
    return codec, encoded + data.draw(st.binary(max_size=3))


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_compiled_program_reads_any_bytes_exactly_as_the_generated_reader(family, data):
    """read_program alone (no fallback to the generated reader) on records with up to three bytes changed,
    cut short or followed by more bytes: the same value and end position, or both refuse."""
    compiled = hotpath_module("compiled")
    codec, encoded = _damaged_record(family, data)
    schema, names = codec.schema.parsed, codec._override_names
    program = compile_program(schema, names)
    generated = compile_reader(schema, names, compiled=False)
    assert _read_or_refusal(lambda d, p: compiled.read_program(program, d, p), encoded) == _read_or_refusal(
        generated, encoded)


#: Hand-picked bytes per schema shape, at the edges of what each may read: every one must read (or be refused)
#: the same by the compiled program and the generated reader.
EDGES = {
    "boolean": [b"\x00", b"\x01", b"\x02", b"\xff", b""],
    "long": [b"\x00", b"\x01", b"\x7f", b"\x80\x01", b"\xfe\xff\xff\xff\xff\xff\xff\xff\xff\x01",
             b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\xfe\xff\xff\xff\xff\xff\xff\xff\xff\x02",
             b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x00", b"\x80", b""],
    "float": [b"\x00\x00\x80\x3f", b"\x00\x00\xc0\x7f", b"\x00\x00\x80", b""],
    "double": [b"\x00" * 7 + b"\xf0\x3f", b"\x01\x00\x00\x00\x00\x00\xf8\x7f", b"\x00" * 7],
    "string": [b"\x00", b"\x04ab", b"\x04\xc3\xa9", b"\x02\xff", b"\x04\xed\xa0", b"\x01", b"\x06ab",
               b"\xfe\xff\xff\xff\xff\xff\xff\xff\xff\x01ab"],
    "bytes": [b"\x00", b"\x04\x00\xff", b"\x01", b"\x7f", b"\xfe\xff\xff\xff\xff\xff\xff\xff\xff\x01"],
    "null": [b"", b"\x00"],
    "enum": [b"\x00", b"\x02", b"\x04", b"\x01", b"\x80\x00", b"\xfe\xff\xff\xff\xff\xff\xff\xff\xff\x01"],
    "array": [b"\x00", b"\x04\x02\x04\x00", b"\x03\x02\x02\x00", b"\x03\x02\x02", b"\x01", b"\x02",
              b"\xfe\xff\xff\xff\xff\xff\xff\xff\xff\x01\x02", b"\x01\x7f\x02\x00"],
    "union": [b"\x00", b"\x02\x06", b"\x04\x02x", b"\x06", b"\x01", b"\x82\x00\x06", b"\x81\x00", b"\x02"],
    "record": [b"\x02\x04\x00", b"\x02\x04", b"\x02\x03\x00"],
}
EDGE_SCHEMAS = {
    "enum": {"type": "enum", "name": "E", "symbols": ["A", "B"]},
    "array": {"type": "array", "items": "long"},
    "union": ["null", "long", "string"],
    "record": {"type": "record", "name": "R", "fields": [{"name": "a", "type": "long"},
                                                          {"name": "b", "type": ["null", "boolean"]}]},
}


@pytest.mark.parametrize("shape", EDGES)
def test_the_compiled_program_reads_edge_bytes_of_every_shape_as_the_generated_reader(shape):
    compiled = hotpath_module("compiled")
    schema = fastavro.parse_schema(EDGE_SCHEMAS.get(shape, shape))
    program, generated = compile_program(schema), compile_reader(schema, compiled=False)
    for raw in EDGES[shape]:
        data = b"\x00" * 10 + raw  # read from 10, as the codecs do after a single-object header
        assert _read_or_refusal(lambda d, p: compiled.read_program(program, d, p), data) == _read_or_refusal(
            generated, data), (shape, raw)


@pytest.mark.parametrize("program", [(9, ("a", "b"), ((2,),)), (7, ["x", "y"]), (), ("x",), (99,)])
def test_a_malformed_program_is_an_error_not_a_crash(program):
    """read_program is public; programs from compile_program are well formed, but others must fail cleanly (a
    second review crashed the process with these before the checks)."""
    with pytest.raises((IndexError, TypeError, ValueError)):
        hotpath_module("compiled").read_program(program, b"\x02\x00\x00\x00", 0)


def test_none_is_refused_where_bytes_are_read():
    compiled = hotpath_module("compiled")
    with pytest.raises(TypeError):
        compiled.read_program(compile_program("string"), None, 0)


def _field_names(schema, named: dict, found: list) -> list:
    """Every field name of ``schema`` at any depth, in schema order (once each)."""
    if isinstance(schema, str):
        schema = named.get(schema, schema)
    if isinstance(schema, list):
        for branch in schema:
            _field_names(branch, named, found)
    elif isinstance(schema, dict):
        if schema.get("type") in ("record", "error"):
            if schema["name"] in named and named[schema["name"]] is not schema and found:
                return found
            named[schema["name"]] = schema
            for field in schema["fields"]:
                if field["name"] not in found:
                    found.append(field["name"])
                _field_names(field["type"], named, found)
        elif schema.get("type") == "array":
            _field_names(schema["items"], named, found)
    return found


def _project_or_refusal(project, data: bytes):
    try:
        return repr(project(data))
    except (ReadError, ValueError, IndexError, struct.error):
        return "refused"


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_compiled_projection_takes_from_any_bytes_what_project_takes_from_the_generated_readers_record(family,
                                                                                                        data):
    """project_program on records with up to three bytes changed, cut short or followed by more bytes, some
    fields named at any depth: the same values and end position as fast_reader.project of the generated
    reader's record, or both refuse (a field read past is checked as the reader checks it)."""
    compiled = hotpath_module("compiled")
    codec, encoded = _damaged_record(family, data)
    schema, names = codec.schema.parsed, codec._override_names
    fields = _field_names(schema, dict(schema.get("__named_schemas", {})), [])
    chosen = data.draw(st.lists(st.sampled_from(fields), unique=True, min_size=1))
    slots = {name: i for i, name in enumerate(chosen)}
    projection = fast_reader.compile_projection(compile_program(schema, names), slots)
    generated = compile_reader(schema, names, compiled=False)

    def by_reader(raw):
        record, end = generated(raw, 10)
        return fast_reader.project(record, slots), end

    assert _project_or_refusal(lambda raw: compiled.project_program(projection, len(slots), raw, 10),
                               encoded) == _project_or_refusal(by_reader, encoded)


@pytest.mark.parametrize("shape", EDGES)
def test_a_compiled_projection_refuses_edge_bytes_of_a_field_it_keeps_or_reads_past_as_the_reader_does(shape):
    compiled = hotpath_module("compiled")
    inner = fastavro.parse_schema(EDGE_SCHEMAS.get(shape, shape))
    schema = fastavro.parse_schema({"type": "record", "name": "Outer", "fields": [
        {"name": "x", "type": EDGE_SCHEMAS.get(shape, shape)}, {"name": "after", "type": "long"}]})
    generated = compile_reader(schema, compiled=False)
    assert inner is not None
    for slots in ({"x": 0, "after": 1}, {"after": 0}):
        projection = fast_reader.compile_projection(compile_program(schema), slots)
        for raw in EDGES[shape]:
            data = b"\x00" * 10 + raw + b"\x02"

            def by_reader(raw_data):
                record, end = generated(raw_data, 10)
                return fast_reader.project(record, slots), end

            assert _project_or_refusal(lambda d: compiled.project_program(projection, len(slots), d, 10),
                                       data) == _project_or_refusal(by_reader, data), (shape, raw, slots)


def test_a_projection_names_the_branch_read_and_takes_the_fields_of_that_branch_only():
    """kv_event's ``event`` union: the slot of ``event`` gets the branch's full name, the body's fields their
    slots, and a field of another branch stays None."""
    compiled = hotpath_module("compiled")
    codec = AvroCodec("kv_event")
    record = {"instance_id": "e1", "data_parallel_rank": 2, "worker_rank": None, "world_size": None,
              "aggregation": None, "publisher_epoch": 1, "seq": 5, "batch_index": 0, "ts": 1.5, "block_hash": b"h",
              "hash_encoding": "UINT64", "block_index": 0, "block_count": 1, "tier": "GPU",
              "event": ("kvstream.v1.BlockRemoved", {"medium": "GPU", "group_idx": None, "locality": None,
                                                      "ownership": "kvcr"})}
    slots = {"event": 0, "seq": 1, "ownership": 2, "parent_block_hash": 3, "tier": 4}
    expected = ["kvstream.v1.BlockRemoved", 5, "kvcr", None, "GPU"]
    decoded = codec.decode(codec.encode(record))
    assert fast_reader.project(decoded, slots) == expected
    projection = fast_reader.compile_projection(compile_program(codec.schema.parsed), slots)
    encoded = codec.encode(record)
    assert compiled.project_program(projection, 5, encoded, 10) == (expected, len(encoded))
    project_own = codec.own_version_projection(slots)  # None where the compiled module is not used
    assert (project_own is None) == (compiled_module.HOTPATH is None)
    if project_own is not None:
        assert project_own(encoded) == expected
        assert project_own(encoded[:-1]) is None and project_own(b"\x00" + encoded[1:]) is None
        # another version's record, too short a frame, and a registry-framed one before and after its id is known
        older = AvroCodec("kv_event", 3).encode({k: v for k, v in record.items()
                                                 if k not in ("worker_rank", "world_size", "aggregation")})
        assert project_own(older) is None and project_own(b"") is None and project_own(encoded[:9]) is None
        framed = b"\x00" + (41).to_bytes(4, "big") + encoded[10:]
        assert project_own(framed) is None
        codec._registry_ids[41] = codec.schema.parsed
        assert project_own(framed) == expected and project_own(framed + b"\x00") is None
    with pytest.raises(IndexError):  # a list too short for the slots
        compiled.project_program(projection, 4, encoded, 10)
