"""Avro codec for the project's records: fastavro with single-object framing.

Framing (docs/contract.md, "Framing"):

* Avro single-object encoding, the default: ``C3 01`` + the writer schema's
  8-byte CRC-64-AVRO fingerprint (little-endian, as fastavro's ``fingerprint``
  hex gives it) + the Avro body. Needs no registry: every schema version lives in
  ``schemas/`` and is found by its fingerprint.
* Confluent wire format, when a schema registry is configured: ``00`` + 4-byte
  big-endian schema id + body.

Readers accept both and resolve the writer's schema to the newest version of
the family (Avro schema resolution), so old data reads with the new schema. A
writer schema the reader does not ship (a newer producer) is looked up by its
schema id in the registry, or, without a registry, by its fingerprint through a
``writer_schemas`` source (the schemas topic, :mod:`kafka_io.schema_topic`).
"""

from __future__ import annotations

import io
import json
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

from schemas.compiled import choose
from schemas.fast_reader import ReadError, compile_program, compile_projection, compile_reader

SCHEMA_DIR = Path(__file__).resolve().parent
SINGLE_OBJECT_MAGIC = b"\xc3\x01"
CONFLUENT_MAGIC = b"\x00"
#: Bytes of a single-object header: the magic and the 8-byte fingerprint.
SINGLE_OBJECT_HEADER_LEN = 10
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
    #: The schema as JSON text, as the file defines it (what a registry or the schemas topic is given).
    text: str
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
            names = tuple(branch["name"] for branch in kind
                          if isinstance(branch, dict) and branch.get("type") == "record")
            if len(names) >= 2:
                found[field["name"]] = names
    return found


def schema_fingerprint(parsed: Any) -> bytes:
    """The 8-byte CRC-64-AVRO fingerprint of a parsed schema's canonical form, in single-object order."""
    return bytes.fromhex(fingerprint(to_parsing_canonical_form(parsed), "CRC-64-AVRO"))


#: Where a reader finds a writer schema it does not ship: fingerprint -> the schema's JSON text, or None.
WriterSchemaSource = Callable[[bytes], "str | None"]


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
        text = json.dumps(json.loads(path.read_text()), separators=(",", ":"))
        parsed = fastavro.parse_schema(json.loads(text))
        version = int(m["version"])
        legacy = LEGACY_FINGERPRINTS.get(family, {}).get(version)
        found.append(SchemaVersion(family, version, parsed, text=text, fingerprint=schema_fingerprint(parsed),
                                   legacy_fingerprint=bytes.fromhex(legacy) if legacy else None))
    if not found:
        raise KeyError(f"no schema files {family}_v*.avsc in {SCHEMA_DIR}")
    return tuple(sorted(found, key=lambda v: v.version))


class AvroCodec:
    """Encode and decode one schema family's records.

    Args:
        family: schema family (file-name prefix in ``schemas/``), e.g. ``kv_event``.
        version: the version to write and to read into; default the newest.
        registry: a schema registry client's configuration (confluent-kafka ``SchemaRegistryClient``:
            ``url``, and optionally ``ssl.ca.location``, ``basic.auth.user.info``, ...). With a
            ``subject``, :meth:`encode` writes the Confluent wire format, the schema registered under the
            subject at construction; without one the registry only resolves schema ids when decoding.
        registry_url: shorthand for ``registry={"url": registry_url}`` (``mock://...`` in tests).
        subject: registry subject for encoding (e.g. ``kv-events-value``).
        writer_schemas: where :meth:`decode` looks up an unknown single-object fingerprint (a newer
            writer's schema): fingerprint -> JSON text or None. The text must have that fingerprint.

    Raises:
        KeyError: no such schema version.
        RegistryRefused: the registry refused the schema under ``subject`` (e.g. incompatible with the
            subject's latest version); the message is the registry's reason.

    Records are dicts as fastavro reads them. A union of several records (the
    event union) comes back as a ``(full name, dict)`` tuple, and writers pass the
    same tuple to pick the branch explicitly; ``["null", record]`` comes back as
    the dict or None.
    """

    def __init__(self, family: str, version: int | None = None, *, registry: dict | None = None,
                 registry_url: str | None = None, subject: str | None = None,
                 writer_schemas: WriterSchemaSource | None = None) -> None:
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
        self._registry_config = registry if registry else {"url": registry_url} if registry_url else None
        self._subject = subject
        self._registry = None
        self._registry_ids: dict[int, Any] = {}
        self._writer_schemas = writer_schemas
        #: Fingerprints the writer-schema source did not know, so each costs one lookup.
        self._unknown: set[bytes] = set()
        if self._registry_config and subject:
            schema_id = register_schema(self._registry_client(), subject, chosen)
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

            if not self._registry_config:
                raise DecodeError("Confluent wire-format record but no schema registry is configured "
                                  "(--schema-registry-url)")
            self._registry = SchemaRegistryClient.new_client(dict(self._registry_config))
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
            if len(data) < SINGLE_OBJECT_HEADER_LEN:
                raise DecodeError("single-object record shorter than its 10-byte header")
            fingerprint = data[2:SINGLE_OBJECT_HEADER_LEN]
            writer = self._by_fingerprint.get(fingerprint) or self._writer_for_fingerprint(fingerprint)
            start = SINGLE_OBJECT_HEADER_LEN
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

    def own_version_headers(self) -> frozenset[bytes]:
        """The single-object headers (``C3 01`` + fingerprint, :data:`SINGLE_OBJECT_HEADER_LEN` bytes) of records of
        this codec's own version: its fingerprint, and the legacy one where the version had another
        (:data:`LEGACY_FINGERPRINTS`). What a reader that reads this version in line recognizes it by."""
        own = self.schema.parsed
        return frozenset(SINGLE_OBJECT_MAGIC + fp for fp, parsed in self._by_fingerprint.items() if parsed is own)

    def own_version_reader(self) -> Callable[[bytes, int, int], "dict | None"]:
        """A reader of records of this codec's own version found inside a larger buffer.

        The returned ``read(data, start, end)`` reads the framed record ``data[start:end]`` and returns what
        :meth:`decode` would, or None when the record was written with another version (an older one, a
        newer one, or a registry id :meth:`decode` has not resolved yet) or is not a valid record: the caller
        then decodes ``data[start:end]`` with :meth:`decode`, which resolves the version or raises the
        :class:`DecodeError` that says why. It saves :meth:`decode`'s checks of the framing per record.

        Raises:
            NotImplementedError: the schema has a type the generated readers do not support.
        """
        read = self._fast_read
        if read is None:
            raise NotImplementedError(f"no generated reader for {self.family}")
        body_of = self._own_version_body()
        read_errors = (ReadError, IndexError, struct.error, UnicodeDecodeError)

        def read_own_version(data: bytes, start: int, end: int) -> dict | None:
            # The record is copied out rather than read in the buffer: the generated reader checks lengths
            # against the end of what it is given, and a corrupt count in the buffer would make it read on
            # through the records after this one before failing.
            data = data[start:end]
            body = body_of(data)
            if not body:
                return None
            try:
                record, pos = read(data, body)
            except read_errors:
                return None
            return record if pos == len(data) else None

        return read_own_version

    def own_version_projection(self, slots: Mapping[str, int]) -> "Callable[[bytes], list | None] | None":
        """A reader of only some fields of a whole framed record of this codec's own version, or None where the
        compiled module is not built (in Python a projection costs what :meth:`decode` does).

        The returned ``project(data)`` gives the list that :func:`schemas.fast_reader.project` takes with
        ``slots`` from what :meth:`decode` gives, read by the compiled module without building the record's
        dicts; or None when the record was written with another version or is not a valid record, as
        :meth:`own_version_reader`'s read does: the caller then decodes it.

        Raises:
            NotImplementedError: the schema has a type the generated readers do not support.
        """
        hotpath = choose(None)
        if hotpath is None:
            return None
        program = compile_projection(compile_program(self.schema.parsed, self._override_names), slots)
        # The framing is checked in the compiled module for the single-object headers (most records); a
        # registry-framed record's body is found by the same rule as the reader's
        return hotpath.FramedProjection(program, max(slots.values()) + 1, self.own_version_headers(),
                                        self._own_version_body())

    def _own_version_body(self) -> Callable[[bytes], int]:
        """``body_of(data)``: where the body of a framed record of this codec's own version starts in ``data``
        (after its single-object header, or its registry id once resolved), or 0 for any other record."""
        own = self.schema.parsed
        headers = self.own_version_headers()
        registry_ids = self._registry_ids  # the live dict: ids resolved later count too

        def body_of(data: bytes) -> int:
            if data[:SINGLE_OBJECT_HEADER_LEN] in headers:
                return SINGLE_OBJECT_HEADER_LEN
            if data[:1] == CONFLUENT_MAGIC and registry_ids.get(int.from_bytes(data[1:5], "big")) is own:
                return 5
            return 0

        return body_of

    def _writer_for_fingerprint(self, fp: bytes):
        """A writer schema this reader does not ship, from the writer-schema source; DecodeError if unknown."""
        text = None
        if self._writer_schemas is not None and fp not in self._unknown:
            try:
                text = self._writer_schemas(fp)
            except Exception as exc:  # the source is a Kafka read: say why it failed, in the dead letter
                raise DecodeError(f"unknown {self.family} schema fingerprint {fp.hex()}; looking it up failed: "
                                  f"{type(exc).__name__}: {exc}") from None
        if text is None:
            self._unknown.add(fp)
            where = " (not in the schemas topic either)" if self._writer_schemas is not None else ""
            raise DecodeError(f"unknown {self.family} schema fingerprint {fp.hex()}{where}")
        try:
            writer = fastavro.parse_schema(json.loads(text))
        except Exception as exc:
            raise DecodeError(f"the writer schema of fingerprint {fp.hex()} does not parse: {exc}") from None
        if schema_fingerprint(writer) != fp:
            raise DecodeError(f"the schema published under fingerprint {fp.hex()} has fingerprint "
                              f"{schema_fingerprint(writer).hex()}")
        self._by_fingerprint[fp] = writer
        return writer

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
            # a version this reader ships, under its registry id: the same parsed object, so records of the
            # newest version take the generated reader, as single-object ones do
            writer = self._by_fingerprint.get(schema_fingerprint(writer), writer)
            self._registry_ids[schema_id] = writer
        return writer


class RegistryRefused(RuntimeError):
    """The schema registry refused to register a schema; the message gives the registry's reason."""


def register_schema(client, subject: str, version: SchemaVersion) -> int:
    """Register ``version`` under ``subject`` (TopicNameStrategy: ``<topic>-value``) and return its schema id.

    Registering the same schema again returns the id it already has. Whether a new schema is accepted is
    the subject's compatibility (BACKWARD by default in Confluent's registry and in ``kvstream registry``).

    Raises:
        RegistryRefused: the registry refused it (e.g. 409, incompatible with the subject's latest
            version) or could not be reached; the message names the subject and gives the reason.
    """
    from confluent_kafka.schema_registry import Schema
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    try:
        return client.register_schema(subject, Schema(version.text, "AVRO"))
    except SchemaRegistryError as exc:
        raise RegistryRefused(f"the schema registry refused {version.family} v{version.version} under subject "
                              f"{subject!r} (HTTP {exc.http_status_code}): {exc.error_message}") from None
    except Exception as exc:  # connection refused, TLS, DNS: requests' and httpx's exceptions
        raise RegistryRefused(f"could not register {version.family} v{version.version} under subject {subject!r}: "
                              f"{type(exc).__name__}: {exc}") from None
