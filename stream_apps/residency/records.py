"""Which form a residency entry takes in this process: a compiled record, or the Python reference's dicts.

Two implementations of the per-event residency work, with identical results:

- the **reference**: the entry as the codec's dicts (:mod:`stream_apps.residency.rules`, the codec's decode,
  :class:`schemas.avro_writers.ResidencyWriter`);
- the **compiled record** (``stream_apps/residency/_record.pyx``): :class:`ResidencyEntry`, its rows and worker
  counts as extension types, with the rules, the decode and the encode working on them in place. Built by
  setup.py where a C compiler is there; not used when ``KVSTREAM_PURE_PYTHON=1`` is set.

:func:`entry_form` picks one for a process (the worker's stores and its materializing agent take the same one,
so an entry the store decodes is one the rules take). Code that reads entries outside the hot path (views,
clears, exports) reads either form as a mapping: ``entry["rows"][0]["copies"]``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from schemas.avro_writers import ResidencyWriter
from schemas.codec import SINGLE_OBJECT_HEADER_LEN, AvroCodec, DecodeError, find_named_type
from schemas.compiled import choose_compiled, load_compiled
from stream_apps.residency import rules

log = logging.getLogger(__name__)

#: The compiled module's import name (what ``/metrics`` and the worker's log line name).
COMPILED_MODULE = "stream_apps.residency._record"
#: The compiled record module, or None (not built, or ``KVSTREAM_PURE_PYTHON=1``).
RECORD_MODULE = load_compiled(COMPILED_MODULE)


def _module(compiled: bool | None) -> ModuleType | None:
    return choose_compiled(compiled, COMPILED_MODULE, RECORD_MODULE)


@dataclass(frozen=True)
class EntryForm:
    """The residency rules and codec of one form of entry.

    Attributes:
        compiled: the compiled record (True) or the reference's dicts (False).
        apply_block: :func:`stream_apps.residency.rules.apply_block` or its compiled twin; takes and returns
            entries of this form.
    """

    compiled: bool
    apply_block: Callable[..., tuple[Any, int, int]]
    #: The compiled loop over a batch message's block events (:meth:`stream_apps.applier.BatchApplier.apply_all`);
    #: None for the dicts, whose loop is the Python one.
    apply_events: Callable[..., None] | None = None


def entry_form(compiled: bool | None = None) -> EntryForm:
    """The form of entry to use: ``compiled`` None picks the compiled record where it is built (and
    ``KVSTREAM_PURE_PYTHON`` is not 1), False the dicts, True the record.

    Raises:
        ImportError: ``compiled`` is True and ``stream_apps/residency/_record.pyx`` is not built.
    """
    module = _module(compiled)
    if module is None:
        return EntryForm(False, rules.apply_block)
    return EntryForm(True, module.apply_block, module.apply_events)


class EntryCodec:
    """Residency entries to and from their Avro bytes (``codec``'s framing), in one :class:`EntryForm`.

    The dicts: the codec's decode, and :class:`ResidencyWriter` where it knows the codec's schema, fastavro
    otherwise. The records: read in place when the bytes are of the codec's own version (``residency`` v3, the
    one the records mirror), else decoded by the codec and made records; written by the compiled writer, or, for a
    value it refuses, by the Python writer from the record's dicts (whose error then names the field).
    """

    def __init__(self, codec: AvroCodec, compiled: bool | None = None) -> None:
        self.codec = codec
        module = _module(compiled)
        try:
            writer = ResidencyWriter(codec)
        except ValueError as exc:  # a schema version the writer does not know: correct, only slower
            log.warning("%s; encoding residency entries with fastavro (slower)", exc)
            writer, module = None, None  # the records mirror the writer's version only
        self._encode_dicts = codec.encode if writer is None else writer.encode
        self._module = module
        #: The record class this codec writes in C (None: the dicts' form).
        self._record_type = None if module is None else module.ResidencyEntry
        self.compiled = module is not None
        if module is not None:
            self._headers = codec.own_version_headers()
            self._header = writer.header
            self._tiers = writer.tier
            self._aggregation_codes = writer.aggregation
            self._tier_symbols = tuple(find_named_type(codec.schema.parsed, "kvstream.v1.Tier")["symbols"])
            self._aggregation_symbols = tuple(
                find_named_type(codec.schema.parsed, "kvstream.v1.AggregationMode")["symbols"])

    def decode(self, data: bytes) -> Any:
        """The entry in ``data`` (framing included), in this codec's form.

        Raises:
            schemas.codec.DecodeError: bytes the codec cannot decode (the reason is its message); in the record
                form also an Avro ``int`` beyond 32 bits, which the dicts would hold (no writer of ours writes one).
        """
        module = self._module
        if module is None:
            return self.codec.decode(data)
        if data[:SINGLE_OBJECT_HEADER_LEN] in self._headers:
            try:
                return module.read_entry(data, SINGLE_OBJECT_HEADER_LEN, self._tier_symbols,
                                         self._aggregation_symbols)
            except (ValueError, IndexError):
                pass  # the codec names the fault, or reads what the record reader refuses (an int beyond 32 bits)
        decoded = self.codec.decode(data)
        try:
            return module.from_dict(decoded)
        except (OverflowError, TypeError) as exc:
            raise DecodeError(f"residency entry with an int beyond 32 bits where the schema has an int: {exc}") \
                from None

    def encode(self, entry: Any) -> bytes:
        """``entry`` (either form) as Avro bytes with the codec's framing.

        Raises:
            KeyError, TypeError, AttributeError, OverflowError, ValueError: a value the schema does not allow, as
                :meth:`ResidencyWriter.encode` or fastavro raise it.
        """
        if type(entry) is self._record_type:  # once per key written: the class is looked up at construction
            encoded = self._module.encode_entry(entry, self._header, self._tiers, self._aggregation_codes)
            if encoded is not None:
                return encoded
            entry = entry.as_dict()
        return self._encode_dicts(entry)
