"""Avro binary readers generated for one writer schema: the materializing agent's per-event decode, in plain
Python.

fastavro's ``schemaless_reader`` is generic: per call it sets up its named-schema maps and walks the schema
tree, per field it dispatches on the type. For a ``kv_event`` (15 fields, a union of 5 records, the stored
block's 15) that is the largest single cost of the materializing agent.
:func:`compile_reader` instead writes the Python source of one function per schema, every field read in
line in the schema's order (varints, strings and unions unrolled), and compiles it once.

The readers return exactly what ``fastavro.schemaless_reader(fo, schema, None, return_record_name=True)``
returns, with ``return_record_name_override`` as :func:`compile_reader` is told (records as dicts; a
union of several records as ``(full name, dict)``; enums as their symbol), and raise :class:`ReadError`
on anything fastavro would refuse: a truncated body, a union branch or enum index out of range, a
negative length, a string that is not UTF-8, a boolean byte other than 0 or 1.
``tests/unit/test_fast_reader.py`` checks both against each other, hypothesis included.

Only the schema shapes the project uses are supported (records, enums, arrays, unions and the primitive
types); :func:`compile_reader` raises :class:`NotImplementedError` for the others (maps, fixed, logical
types), and the codec then keeps fastavro. Schema resolution (a record written with an older version)
stays with fastavro too.
"""

from __future__ import annotations

import struct
from typing import Any, Callable, Mapping

from schemas.compiled import choose

_DOUBLE = struct.Struct("<d").unpack_from
_FLOAT = struct.Struct("<f").unpack_from


class ReadError(ValueError):
    """The bytes are not a record of the schema; the message says what was wrong and where."""


def long_tail(data: bytes, pos: int, first: int) -> tuple[int, int]:
    """The rest of a zig-zag varint whose first byte ``first`` (continuation bit set) is already read."""
    result, shift = first & 0x7F, 7
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if result >> 64:
                raise ReadError(f"varint beyond 64 bits before {pos}")
            return (result >> 1) ^ -(result & 1), pos
        shift += 7
        if shift > 63:
            raise ReadError(f"varint longer than 10 bytes at {pos}")


def _fail(message: str):
    raise ReadError(message)


class _Writer:
    """Source lines of one reader function, with fresh local names."""

    def __init__(self, override_names: bool = False) -> None:
        #: fastavro's ``return_record_name_override``: a union with one record branch reads as the bare value.
        self.override_names = override_names
        self.lines: list[str] = []
        self.constants: dict[str, Any] = {}
        self._names = 0

    def name(self, prefix: str = "v") -> str:
        self._names += 1
        return f"{prefix}{self._names}"

    def constant(self, value: Any) -> str:
        name = self.name("K")
        self.constants[name] = value
        return name

    def emit(self, indent: int, line: str) -> None:
        self.lines.append("    " * indent + line)


def _emit_long(w: _Writer, indent: int, target: str) -> None:
    w.emit(indent, "b = data[pos]; pos += 1")
    w.emit(indent, "if b & 0x80:")
    w.emit(indent + 1, f"{target}, pos = _long_tail(data, pos, b)")
    w.emit(indent, "else:")
    w.emit(indent + 1, f"{target} = (b >> 1) ^ -(b & 1)")


def _emit_sized(w: _Writer, indent: int, target: str, decode: bool) -> None:
    size = w.name("n")
    _emit_long(w, indent, size)
    w.emit(indent, f"end = pos + {size}")
    w.emit(indent, f"if {size} < 0 or end > size_:")
    w.emit(indent + 1, f"_fail('bad length ' + str({size}) + ' at ' + str(pos))")
    w.emit(indent, f"{target} = data[pos:end]{'.decode()' if decode else ''}; pos = end")


def _type_of(schema: dict, named: dict) -> str:
    """The ``type`` of a schema written as a dict, its named type (record, enum) registered in ``named``.

    Raises:
        NotImplementedError: a logical type (the readers keep fastavro for those).
    """
    kind = schema["type"]
    if schema.get("logicalType"):
        raise NotImplementedError(f"logical type {schema['logicalType']}")
    if kind in ("record", "enum", "error"):
        named[schema["name"]] = schema
    return kind


def _emit(w: _Writer, indent: int, schema: Any, target: str, named: dict) -> None:
    """Lines that read one value of ``schema`` at ``pos`` into the local ``target``."""
    if isinstance(schema, str):
        if schema in named:
            return _emit(w, indent, named[schema], target, named)
        kind = schema
    elif isinstance(schema, list):
        return _emit_union(w, indent, schema, target, named)
    else:
        kind = _type_of(schema, named)
    if kind == "null":
        w.emit(indent, f"{target} = None")
    elif kind == "boolean":
        w.emit(indent, f"{target} = data[pos]; pos += 1")
        w.emit(indent, f"if {target} > 1:")
        w.emit(indent + 1, f"_fail('boolean byte ' + str({target}) + ' at ' + str(pos - 1))")
        w.emit(indent, f"{target} = {target} == 1")
    elif kind in ("int", "long"):
        _emit_long(w, indent, target)
    elif kind == "double":
        w.emit(indent, f"{target} = _DOUBLE(data, pos)[0]; pos += 8")
    elif kind == "float":
        w.emit(indent, f"{target} = _FLOAT(data, pos)[0]; pos += 4")
    elif kind == "string":
        _emit_sized(w, indent, target, decode=True)
    elif kind == "bytes":
        _emit_sized(w, indent, target, decode=False)
    elif kind == "enum":
        symbols = w.constant(tuple(schema["symbols"]))
        index = w.name("i")
        _emit_long(w, indent, index)
        w.emit(indent, f"if not 0 <= {index} < {len(schema['symbols'])}:")
        w.emit(indent + 1, f"_fail('enum index ' + str({index}) + ' at ' + str(pos))")
        w.emit(indent, f"{target} = {symbols}[{index}]")
    elif kind == "array":
        count, item = w.name("c"), w.name("v")
        w.emit(indent, f"{target} = []")
        w.emit(indent, "while True:")
        _emit_long(w, indent + 1, count)
        w.emit(indent + 1, f"if {count} == 0:")
        w.emit(indent + 2, "break")
        w.emit(indent + 1, f"if {count} < 0:")
        w.emit(indent + 2, f"{count} = -{count}")
        _emit_long(w, indent + 2, w.name("skip"))
        w.emit(indent + 1, f"for _ in range({count}):")
        _emit(w, indent + 2, schema["items"], item, named)
        w.emit(indent + 2, f"{target}.append({item})")
    elif kind in ("record", "error"):
        fields = []
        for field in schema["fields"]:
            local = w.name("f")
            _emit(w, indent, field["type"], local, named)
            fields.append(f"{field['name']!r}: {local}")
        w.emit(indent, f"{target} = {{{', '.join(fields)}}}")
    else:
        raise NotImplementedError(f"Avro type {kind!r}")


def _is_record(schema: Any, named: dict) -> bool:
    if isinstance(schema, str):
        schema = named.get(schema, schema)
    return isinstance(schema, dict) and schema.get("type") in ("record", "error")


#: fastavro's Avro type names (``fastavro.const.AVRO_TYPES``): any other string in a union is a named
#: reference, which fastavro counts as a record when it applies ``return_record_name_override``.
_AVRO_TYPE_NAMES = frozenset(("boolean", "bytes", "double", "float", "int", "long", "null", "string", "fixed",
                              "enum", "record", "error", "array", "map", "union", "request", "error_union"))


def _record_branches(branches: list) -> int:
    """Record branches of a union as fastavro counts them for ``return_record_name_override``
    (``fastavro._schema_py._get_name_and_record_counts_from_union``)."""
    return sum(1 for b in branches if (isinstance(b, dict) and b.get("type") == "record")
               or (isinstance(b, str) and b not in _AVRO_TYPE_NAMES))


def _emit_union(w: _Writer, indent: int, branches: list, target: str, named: dict) -> None:
    # The branch index is compared in its zig-zag form (branch n is the byte 2n), so the usual one-byte index
    # costs no decode; a longer (non-canonical) varint is decoded and zig-zagged back to compare the same way.
    index = w.name("u")
    w.emit(indent, f"{index} = data[pos]; pos += 1")
    w.emit(indent, f"if {index} & 0x80:")
    w.emit(indent + 1, f"{index}, pos = _long_tail(data, pos, {index})")
    w.emit(indent + 1, f"{index} = {index} << 1 if {index} >= 0 else -2 * {index} - 1")
    bare = w.override_names and _record_branches(branches) == 1
    for number, branch in enumerate(branches):
        w.emit(indent, f"{'if' if number == 0 else 'elif'} {index} == {2 * number}:")
        if not bare and _is_record(branch, named):  # return_record_name: a record branch comes as (name, dict)
            value = w.name("r")
            _emit(w, indent + 1, branch, value, named)
            name = named[branch]["name"] if isinstance(branch, str) else branch["name"]
            w.emit(indent + 1, f"{target} = ({name!r}, {value})")
        else:
            _emit(w, indent + 1, branch, target, named)
    w.emit(indent, "else:")
    w.emit(indent + 1, f"_fail('union branch ' + str(({index} >> 1) ^ -({index} & 1)) + ' at ' + str(pos))")


# Operations of a reader program (:func:`compile_program`), which the compiled module runs
# (schemas/_hotpath.pyx, ``read_program``): the numbers are shared with it.
(OP_NULL, OP_BOOLEAN, OP_LONG, OP_FLOAT, OP_DOUBLE, OP_STRING, OP_BYTES, OP_ENUM, OP_ARRAY, OP_RECORD,
 OP_UNION) = range(11)
#: The two operations of a projection program (:func:`compile_projection`), numbered after the reader's.
OP_PROJECT_RECORD, OP_PROJECT_UNION = 11, 12


def compile_program(schema: Any, override_names: bool = False, named: dict | None = None) -> tuple:
    """``schema`` as nested tuples for the compiled reader: what :func:`compile_reader`'s generated source
    does, step for step (same named types, same union and record-name rules).

    Shapes: ``(OP_NULL,)`` and the other primitives; ``(OP_ENUM, symbols)``; ``(OP_ARRAY, item program)``;
    ``(OP_RECORD, field names, field programs)``; ``(OP_UNION, ((branch program, full name or None), ...))``,
    the name given where the branch reads as ``(full name, dict)``.

    Raises:
        NotImplementedError: as :func:`compile_reader`.
    """
    if named is None:
        named = dict(schema.get("__named_schemas", {})) if isinstance(schema, dict) else {}
    if isinstance(schema, str):
        if schema in named:
            return compile_program(named[schema], override_names, named)
        kind = schema
    elif isinstance(schema, list):
        bare = override_names and _record_branches(schema) == 1
        branches = []
        for branch in schema:
            program = compile_program(branch, override_names, named)
            name = None
            if not bare and _is_record(branch, named):
                name = named[branch]["name"] if isinstance(branch, str) else branch["name"]
            branches.append((program, name))
        return (OP_UNION, tuple(branches))
    else:
        kind = _type_of(schema, named)
    primitive = {"null": OP_NULL, "boolean": OP_BOOLEAN, "int": OP_LONG, "long": OP_LONG, "float": OP_FLOAT,
                 "double": OP_DOUBLE, "string": OP_STRING, "bytes": OP_BYTES}
    if kind in primitive:
        return (primitive[kind],)
    if kind == "enum":
        return (OP_ENUM, tuple(schema["symbols"]))
    if kind == "array":
        return (OP_ARRAY, compile_program(schema["items"], override_names, named))
    if kind in ("record", "error"):
        return (OP_RECORD, tuple(f["name"] for f in schema["fields"]),
                tuple(compile_program(f["type"], override_names, named) for f in schema["fields"]))
    raise NotImplementedError(f"Avro type {kind!r}")


def compile_projection(program: tuple, slots: Mapping[str, int]) -> tuple:
    """A reader ``program`` (:func:`compile_program`) of a record schema turned into a projection: the compiled
    module's ``project_program`` runs it and gives a list of ``max(slots.values()) + 1`` values, the value of each
    field named in ``slots`` at its index, without building the records' dicts; what :func:`project` takes from
    the dict that ``program`` reads.

    ``slots`` maps field names to list indices, at any depth: a record-typed field is projected by the same
    names, and so is a record branch of a union, whose name (where the reader gives one: ``(name, dict)``) goes
    in the union field's slot; another branch's value goes there as a field's would. Fields not named are read
    past, checked as the reader checks them, and not kept.

    Shapes: ``(OP_PROJECT_RECORD, slot of each field or -1, field programs)``, and ``(OP_PROJECT_UNION,
    ((branch program, full name or None), ...))``, whose slot is its field's; a field program that is neither
    reads the field's value.

    Raises:
        ValueError: ``program`` does not read a record.
    """
    if program[0] != OP_RECORD:
        raise ValueError("a projection reads a record")
    return _project_record(program, slots)


def _project_record(program: tuple, slots: Mapping[str, int]) -> tuple:
    names, fields = program[1], program[2]
    return (OP_PROJECT_RECORD, tuple(slots.get(name, -1) for name in names),
            tuple(_project_field(field, slots) for field in fields))


def _project_field(program: tuple, slots: Mapping[str, int]) -> tuple:
    if program[0] == OP_RECORD:
        return _project_record(program, slots)
    if program[0] == OP_UNION and any(branch[0] == OP_RECORD for branch, _ in program[1]):
        return (OP_PROJECT_UNION, tuple((_project_record(branch, slots) if branch[0] == OP_RECORD else branch, name)
                                        for branch, name in program[1]))
    return program


def project(record: dict, slots: Mapping[str, int], out: list | None = None) -> list:
    """The Python twin of a projection program (:func:`compile_projection`): the values of ``record`` (as the
    reader gives it) that ``slots`` names, in a list of ``max(slots.values()) + 1`` (None where absent)."""
    if out is None:
        out = [None] * (max(slots.values()) + 1)
    for name, value in record.items():
        slot = slots.get(name, -1)
        if type(value) is dict:
            project(value, slots, out)
        elif type(value) is tuple and len(value) == 2 and type(value[1]) is dict:  # a record branch: (name, record)
            if slot >= 0:
                out[slot] = value[0]
            project(value[1], slots, out)
        elif slot >= 0:
            out[slot] = value
    return out


def compile_reader(schema: dict, override_names: bool = False,
                   compiled: bool | None = None) -> Callable[[bytes, int], tuple[Any, int]]:
    """A reader of ``schema`` (a fastavro-parsed schema): ``read(data, pos) -> (value, position after it)``.

    ``compiled`` (as :func:`schemas.compiled.choose`; None: when built): the reader runs the schema's program
    (:func:`compile_program`) in the compiled module, several times faster, and hands any bytes it refuses to
    the generated one, so the value or the error is always the generated reader's.

    ``override_names`` reads as fastavro's ``return_record_name_override=True`` does: a union with exactly one
    record branch (``["null", record]``) gives the record dict itself, not ``(name, dict)``.

    Raises:
        NotImplementedError: the schema uses a type these readers do not support (keep fastavro).

    The reader raises :class:`ReadError` for bytes that are not a value of the schema, and
    ``IndexError``/``struct.error`` when they end too soon (the codec turns every one into its
    ``DecodeError``).
    """
    w = _Writer(override_names)
    w.emit(0, "def read(data, pos):")
    w.emit(1, "size_ = len(data)")
    named: dict = {}
    if isinstance(schema, dict):
        named.update({name: value for name, value in schema.get("__named_schemas", {}).items()})
    _emit(w, 1, schema, "value", named)
    w.emit(1, "return value, pos")
    namespace = {"_long_tail": long_tail, "_fail": _fail, "_DOUBLE": _DOUBLE, "_FLOAT": _FLOAT, **w.constants}
    title = schema.get("name", "schema") if isinstance(schema, dict) else schema
    exec(compile("\n".join(w.lines), f"<avro reader of {title}>", "exec"), namespace)
    read_python = namespace["read"]
    hotpath = choose(compiled)
    if hotpath is None:
        return read_python
    program, read_program = compile_program(schema, override_names), hotpath.read_program

    def read(data: bytes, pos: int) -> tuple[Any, int]:
        try:
            return read_program(program, data, pos)
        except Exception:  # noqa: BLE001 - whatever the fault, the generated reader names it, or reads the bytes
            return read_python(data, pos)

    return read
