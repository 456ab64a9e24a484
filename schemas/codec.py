"""Avro codec for the project's records: fastavro with single-object framing.

Framing (docs/contract.md, "Framing"):

* Avro single-object encoding, the default: ``C3 01`` + the writer schema's
  8-byte CRC-64-AVRO fingerprint (little-endian, as fastavro's ``fingerprint``
  hex gives it) + the Avro body. Needs no registry: every schema version lives in
  ``schemas/`` and is found by its fingerprint.
* Confluent wire format, when a schema registry is configured: ``00`` + 4-byte
  big-endian schema id + body.

Readers accept both and resolve the writer's schema to the newest version of
the family (Avro schema resolution), so old data reads with the new schema.
"""

from __future__ import annotations

import io
import json
import re
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

from schemas.fast_reader import ReadError, compile_reader

SCHEMA_DIR = Path(__file__).resolve().parent
SINGLE_OBJECT_MAGIC = b"\xc3\x01"
CONFLUENT_MAGIC = b"\x00"
_HEADER_LEN = 10
_SCHEMA_FILE = re.compile(r"^(?P<family>[a-z_]+)_v(?P<version>\d+)\.avsc$")


class DecodeError(ValueError):
    """Bytes that are not a readable record: the message says why (goes to the dead-letter topic as the reason)."""


@dataclass(frozen=True)
class SchemaVersion:
    """One ``schemas/<family>_v<version>.avsc`` file, parsed."""

    #: Schema family, e.g. ``kv_event`` (file-name prefix).
    family: str
    #: Version number from the file name, from 1.
    version: int
    #: fastavro-parsed schema.
    parsed: Any
    #: 8-byte CRC-64-AVRO fingerprint of the parsing canonical form, in single-object order.
    fingerprint: bytes
    #: The fingerprint records of this version written before the file was self-contained carry
    #: (:data:`LEGACY_FINGERPRINTS`); None if it never changed.
    legacy_fingerprint: bytes | None = None


#: Fingerprints that four schema files had while they referred to named types defined in other files
#: (Tier, AggregationMode, ClearMark), before every file became self-contained. fastavro fingerprinted
#: those references as bare names, so records written then carry these ids; readers still accept them for
#: the same schema. Family -> version -> fingerprint (hex).
LEGACY_FINGERPRINTS = {
    "residency": {1: "9cfcc1b4ee9a104a"},
    "ownership_batch": {1: "2c279608765e0395"},
    "residency_change": {1: "ae5f6f4a1531c1a5"},
    "tier_occupancy": {1: "834eaa8b4b293144"},
}


def find_named_type(schema: Any, full_name: str) -> dict:
    """The definition of the named type ``full_name`` (e.g. ``kvstream.v1.Tier``) inside a parsed schema.

    Raises:
        KeyError: the schema defines no such type.
    """
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if node.get("name") == full_name and node.get("type") in ("record", "enum", "fixed"):
                return node
            stack.extend(v for k, v in node.items() if k in ("type", "items", "values", "fields"))
    raise KeyError(f"no named type {full_name} in the schema")


def _has_nullable_record(schema: Any) -> bool:
    """Whether a parsed schema holds a union of null and exactly one record (read differently with the override)."""
    if isinstance(schema, list):
        branches = [b for b in schema if b != "null"]
        if len(schema) == 2 and "null" in schema and _is_record(branches[0]):
            return True
        return any(_has_nullable_record(b) for b in schema)
    if isinstance(schema, dict):
        kind = schema.get("type")
        if kind == "record":
            return any(_has_nullable_record(f["type"]) for f in schema["fields"])
        if kind == "array":
            return _has_nullable_record(schema["items"])
        if kind == "map":
            return _has_nullable_record(schema["values"])
    return False


def _is_record(schema: Any) -> bool:
    # a named reference (string other than a primitive) may name a record, enum or fixed: treat it as a record
    primitives = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}
    return (isinstance(schema, dict) and schema.get("type") == "record") or (
        isinstance(schema, str) and schema not in primitives)


def _record_unions(schema: dict) -> dict[str, tuple[str, ...]]:
    """Top-level fields whose type is a union of two or more named records -> the records' full names."""
    found = {}
    for field in schema.get("fields", []):
        kind = field["type"]
        if isinstance(kind, list):
            names = tuple(branch["name"] for branch in kind if isinstance(branch, dict) and branch.get("type") == "record")
            if len(names) >= 2:
                found[field["name"]] = names
    return found


@lru_cache(maxsize=None)
def schema_versions(family: str) -> tuple[SchemaVersion, ...]:
    """All versions of a schema family found in ``schemas/``, oldest first.

    Raises:
        KeyError: no ``<family>_v*.avsc`` file exists.
    """
    found = []
    for path in SCHEMA_DIR.glob(f"{family}_v*.avsc"):
        m = _SCHEMA_FILE.match(path.name)
        if not m or m["family"] != family:
            continue
        parsed = fastavro.parse_schema(json.loads(path.read_text()))
        fp = bytes.fromhex(fingerprint(to_parsing_canonical_form(parsed), "CRC-64-AVRO"))
        version = int(m["version"])
        legacy = LEGACY_FINGERPRINTS.get(family, {}).get(version)
        found.append(SchemaVersion(family, version, parsed, fp, bytes.fromhex(legacy) if legacy else None))
    if not found:
        raise KeyError(f"no schema files {family}_v*.avsc in {SCHEMA_DIR}")
    return tuple(sorted(found, key=lambda v: v.version))


class AvroCodec:
    """Encode and decode one schema family's records.

    Args:
        family: schema family (file-name prefix in ``schemas/``), e.g. ``kv_event``.
        version: the version to write and to read into; default the newest.
        registry_url: a schema registry URL (``mock://...`` for tests). When set,
            :meth:`encode` writes the Confluent wire format under ``subject``;
            :meth:`decode` always accepts both framings.
        subject: registry subject for encoding (e.g. ``kv-events-value``).

    Records are dicts as fastavro reads them. A union of several records (the
    event union) comes back as a ``(full name, dict)`` tuple, and writers pass the
    same tuple to pick the branch explicitly; ``["null", record]`` comes back as
    the dict or None.
    """

    def __init__(self, family: str, version: int | None = None, *, registry_url: str | None = None,
                 subject: str | None = None) -> None:
        versions = schema_versions(family)
        chosen = versions[-1] if version is None else next((v for v in versions if v.version == version), None)
        if chosen is None:
            raise KeyError(f"schema {family}_v{version}.avsc not found in {SCHEMA_DIR}")
        self.family = family
        self.schema = chosen
        self._by_fingerprint = {v.fingerprint: v.parsed for v in versions}
        self._by_fingerprint.update((v.legacy_fingerprint, v.parsed) for v in versions if v.legacy_fingerprint)
        #: fastavro's record-name override (a ``["null", record]`` union read as the dict, not a tuple) costs a
        #: quarter of the decode time; only families with such a union need it (kv_event has none).
        self._override_names = any(_has_nullable_record(v.parsed) for v in versions)
        self._header = SINGLE_OBJECT_MAGIC + chosen.fingerprint
        self._registry_url = registry_url
        self._subject = subject
        self._registry = None
        self._registry_ids: dict[int, Any] = {}
        if registry_url:
            if not subject:
                raise ValueError("a schema registry needs a subject to register the writer schema under")
            registry = self._registry_client()
            from confluent_kafka.schema_registry import Schema

            schema_id = registry.register_schema(subject, Schema(json.dumps(self.schema.parsed), "AVRO"))
            self._header = CONFLUENT_MAGIC + struct.pack(">I", schema_id)
            self._registry_ids[schema_id] = self.schema.parsed
        #: Generated reader of this version's own records (schemas.fast_reader), about twice as fast as
        #: fastavro's; None for a schema with a type the generator does not support.
        self._fast_read = None
        try:
            self._fast_read = compile_reader(chosen.parsed, override_names=self._override_names)
        except NotImplementedError:
            pass
        #: Field -> branch names of each top-level union of several records (kv_event's ``event``): a value
        #: for it must name its branch, as ``(full name, record)``.
        self._record_unions = _record_unions(chosen.parsed)
        #: Reused output buffer of :meth:`encode`: the header, written once, then the last body.
        self._out = io.BytesIO()
        self._out.write(self._header)

    def _registry_client(self):
        if self._registry is None:
            from confluent_kafka.schema_registry import SchemaRegistryClient

            if not self._registry_url:
                raise DecodeError("Confluent wire-format record but no schema registry is configured")
            self._registry = SchemaRegistryClient.new_client({"url": self._registry_url})
        return self._registry

    @property
    def header(self) -> bytes:
        """The framing bytes before every body: ``C3 01`` + fingerprint (10 bytes), or ``00`` + schema id (5)."""
        return self._header

    def encode(self, record: dict) -> bytes:
        """Serialize one record with this codec's framing.

        Raises:
            ValueError: the record does not match the schema (fastavro's message), or a union of several
                records gets a bare dict, whose branch fastavro would guess (e.g. ``{}`` written as the first
                branch whose fields it happens to satisfy).
        """
        for name, branches in self._record_unions.items():
            value = record.get(name) if isinstance(record, dict) else None
            if not (isinstance(value, tuple) and len(value) == 2 and value[0] in branches):
                raise ValueError(f"field {name!r} is a union of records: give (branch, record) with branch one of "
                                 f"{', '.join(branches)}, e.g. ({branches[0]!r}, {{...}}); got {value!r:.80}")
        out = self._out
        out.seek(len(self._header))
        out.truncate()
        fastavro.schemaless_writer(out, self.schema.parsed, record)
        return out.getvalue()

    def decode(self, data: bytes) -> dict:
        """Deserialize one record written with any known version of the family.

        Raises:
            DecodeError: unknown framing, unknown schema fingerprint or id, or a
                truncated/corrupt body. The message is the reason.
        """
        if data is None or len(data) < 5:
            raise DecodeError(f"record of {0 if data is None else len(data)} bytes is too short for an Avro header")
        if data[:2] == SINGLE_OBJECT_MAGIC:
            if len(data) < _HEADER_LEN:
                raise DecodeError("single-object record shorter than its 10-byte header")
            writer = self._by_fingerprint.get(data[2:_HEADER_LEN])
            if writer is None:
                raise DecodeError(f"unknown {self.family} schema fingerprint {data[2:_HEADER_LEN].hex()}")
            start = _HEADER_LEN
        elif data[:1] == CONFLUENT_MAGIC:
            schema_id = struct.unpack(">I", data[1:5])[0]
            writer = self._writer_for_registry_id(schema_id)
            start = 5
        else:
            raise DecodeError(f"unknown framing {data[:2].hex()} (expected c301 single-object or 00 Confluent)")
        if writer is self.schema.parsed and self._fast_read is not None:
            try:
                record, end = self._fast_read(data, start)
            except (ReadError, IndexError, struct.error, UnicodeDecodeError) as exc:
                raise DecodeError(f"corrupt {self.family} Avro body: {type(exc).__name__}: {exc}") from None
        else:
            reader = None if writer is self.schema.parsed else self.schema.parsed
            stream = io.BytesIO(data)
            stream.seek(start)
            try:
                record = fastavro.schemaless_reader(stream, writer, reader, return_record_name=True,
                                                    return_record_name_override=self._override_names)
            except Exception as exc:  # fastavro raises EOFError, ValueError, IndexError, ... on corrupt bodies
                raise DecodeError(f"corrupt {self.family} Avro body: {type(exc).__name__}: {exc}") from None
            end = stream.tell()
        if end != len(data):
            raise DecodeError(f"{len(data) - end} trailing bytes after the {self.family} record")
        return record

    def _writer_for_registry_id(self, schema_id: int):
        writer = self._registry_ids.get(schema_id)
        if writer is None:
            try:
                registered = self._registry_client().get_schema(schema_id)
            except DecodeError:
                raise
            except Exception as exc:
                raise DecodeError(f"schema id {schema_id} not found in the registry: {exc}") from None
            writer = fastavro.parse_schema(json.loads(registered.schema_str))
            self._registry_ids[schema_id] = writer
        return writer
