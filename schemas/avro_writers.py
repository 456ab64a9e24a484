"""Hand-written Avro encoders of the stream app's hot paths: byte for byte what fastavro writes, several times faster.

- :class:`ResidencyWriter`, :class:`ResidencyChangeWriter`: the residency table's changelog values and the
  ``kv-residency-changes`` records (the materializing agent).
- :func:`encode_ownership_batch`, :func:`encode_keyed_event`, :func:`encode_clear_mark`: the repartition process's
  ``ownership_batch`` messages.

Each writer refuses any writer schema but the one it encodes (family, version, fingerprint), so a new schema
version falls back to fastavro rather than writing wrong bytes.

The rest is in one module per concern, and every name other modules use is importable from here:

* :mod:`schemas.avro_primitives`: the primitives (``avro_long`` and friends), which follow the Avro
  specification's binary encoding;
* :mod:`schemas.kv_event_writer`: :class:`KvEventWriter`, ``kv_event`` records (the producers' per-block messages).

The residency writers stay in this file because ``bench/profile_worker.py`` attributes a sample to its
"encode (entry, change record)" stage by the file name ``avro_writers.py``.
"""

from __future__ import annotations

import struct

from schemas.avro_primitives import (
    AVRO_NULL,
    BRANCH_1,
    LONG_MAX,
    LONG_MIN,
    SMALL_INTS,
    avro_bytes,
    avro_double,
    avro_int_array,
    avro_long,
    avro_optional,
    avro_optional_string,
    avro_string,
)
from schemas.clear_position import NO_CLEAR
from schemas.codec import AvroCodec, find_named_type
from schemas.kv_event_writer import KvEventWriter

__all__ = [
    "LONG_MIN", "LONG_MAX", "AVRO_NULL", "avro_long", "avro_double", "avro_bytes", "avro_string", "avro_int_array",
    "avro_optional", "avro_optional_string", "KvEventWriter", "ResidencyWriter", "ResidencyChangeWriter",
    "encode_clear_mark", "encode_keyed_event", "NO_TABLES", "encode_ownership_batch",
]

# --------------------------------------------------------------------------- fast residency writers

#: ``["null", "double"]`` with a value followed by a ``double``: branch 1 (the byte 2), then both doubles.
_pack_branch_1_double_double = struct.Struct("<Bdd").pack
#: A residency entry's ``parent_block_hash`` and ``content_hash`` (v3), both null: an entry without content keys.
_NO_CONTENT_KEYS = b"\x00\x00"


def _require_writer_schema(writer: type, codec: AvroCodec) -> None:
    """Refuse a codec whose writer schema is not the one ``writer`` encodes by hand.

    Compares the family, the version and the fingerprint of the schema's parsing canonical form (which
    also covers the named types it uses, such as the ``Tier`` symbols defined in kv_event_v1), so a new
    version or an edit of the file that changes the bytes stops the hand-written writer instead of
    letting it write the old layout.
    """
    schema = codec.schema
    if (codec.family, schema.version, schema.fingerprint) != (writer.FAMILY, writer.VERSION, writer.FINGERPRINT):
        raise ValueError(f"{writer.__name__} encodes {writer.FAMILY} v{writer.VERSION} (fingerprint "
                         f"{writer.FINGERPRINT.hex()}), not {codec.family} v{schema.version} (fingerprint "
                         f"{schema.fingerprint.hex()}); use AvroCodec.encode or update the writer")


def _named_enum(codec: AvroCodec, name: str) -> dict[str, bytes]:
    """Symbol -> encoded index of the named enum ``name`` (full name) that the codec's schema refers to."""
    return {symbol: avro_long(i) for i, symbol in enumerate(find_named_type(codec.schema.parsed, name)["symbols"])}


class _TableRecordWriter:
    """Base of the materializing agent's hand-written encoders: the writer schema a subclass encodes by hand
    (``FAMILY``, ``VERSION``, ``FINGERPRINT``), checked against the codec's, and what both subclasses take from it.

    Args:
        codec: a codec writing exactly that schema (its framing header is reused).

    Raises:
        ValueError: the codec writes another family, version or schema (see
            :func:`_require_writer_schema`); use :meth:`AvroCodec.encode` then.
    """

    FAMILY: str
    #: The writer schema whose field layout the subclass encodes, and its fingerprint.
    VERSION: int
    FINGERPRINT: bytes

    def __init__(self, codec: AvroCodec) -> None:
        _require_writer_schema(type(self), codec)
        self.header = codec.header
        #: symbol -> encoded index of the Tier enum (a named type of kv_event_v1).
        self.tier = _named_enum(codec, "kvstream.v1.Tier")


class ResidencyWriter(_TableRecordWriter):
    """Hand-written encoder of ``residency`` entries (the stream app's table values and changelog records),
    byte for byte what :meth:`AvroCodec.encode` writes, framing included.

    fastavro's generic writer is slow here (it resolves each optional field's union and looks up every
    field of the nested rows and workers), and the materializing agent encodes one entry per touched key.
    This writer encodes the field layout of ``residency_v3.avsc`` directly. Checked against fastavro
    in ``tests/unit/test_writers.py`` (fixed cases and a hypothesis property) and
    ``tests/unit/test_writer_parity.py`` (edge values, refusals).

    Most entries hold one row with one worker, so that shape is encoded in a single join without a loop.
    What repeats across entries is encoded once and cached (each cache emptied when it grows past its
    bound): a row's identity fields (``instance_id`` .. ``aggregation``), optional strings, longs beyond
    the small-int table (publisher epochs, content digests, content hashes) and clear marks. A cache is keyed
    by value, so a value equal to a cached one (``1.0`` and ``1``) gets its bytes where fastavro would refuse
    the float; the agent's entries only hold ints there.

    Every field must be present in the dicts (fastavro would write a missing optional field's default;
    here it is a KeyError). ``clear_mark`` is the ClearMark dict or None, as the codec decodes it.
    Construction as :class:`_TableRecordWriter` (a ``residency`` v3 codec, or ValueError).

    This is the reference encoder of the entries' dicts. Its compiled twin encodes the entry as a compiled record
    (``encode_entry`` in ``stream_apps/residency/_record.pyx``), and hands what it refuses to this one.
    """

    FAMILY = "residency"
    VERSION = 3
    FINGERPRINT = bytes.fromhex("edf15354f4595dea")

    def __init__(self, codec: AvroCodec) -> None:
        super().__init__(codec)
        #: symbol -> encoded index of the AggregationMode enum (a named type of kv_event_v1).
        self.aggregation = _named_enum(codec, "kvstream.v1.AggregationMode")
        #: (instance_id, data_parallel_rank, tier, medium, locality, group_idx, world_size, aggregation) ->
        #: those fields encoded: one row identity per source and tier, so few.
        self._identities: dict[tuple, bytes] = {}
        #: ``["null", "string"]`` value -> encoded (``ownership``, ``medium``, ``locality``).
        self._optional_strings: dict[str | None, bytes] = {None: AVRO_NULL}
        #: long -> varint, for longs outside the small-int table: publisher epochs (milliseconds, few), content
        #: digests and content hashes (one per stored block, re-encoded at each of the block's events; 9-10 bytes).
        self._longs: dict[int, bytes] = {}
        #: (publisher_epoch, seq, batch_index) -> the encoded ``["null", ClearMark]`` branch 1: one per source clear.
        self._marks: dict[tuple[int, int, int], bytes] = {}

    def _optional_string(self, value: str) -> bytes:
        cache = self._optional_strings
        if len(cache) > 10_000:
            cache.clear()
            cache[None] = AVRO_NULL
        encoded = cache[value] = BRANCH_1 + avro_string(value)
        return encoded

    def _identity(self, key: tuple) -> bytes:
        instance_id, data_parallel_rank, tier, medium, locality, group_idx, world_size, aggregation = key
        encoded = b"".join((avro_string(instance_id), avro_long(data_parallel_rank), self.tier[tier],
                            avro_optional_string(medium), avro_optional_string(locality),
                            avro_optional(group_idx, avro_long), avro_long(world_size),
                            self.aggregation[aggregation]))
        if len(self._identities) > 10_000:
            self._identities.clear()
        self._identities[key] = encoded
        return encoded

    def _long(self, n: int) -> bytes:
        encoded = avro_long(n)  # before caching: a value fastavro refuses raises here, every time
        if len(self._longs) > 10_000:
            self._longs.clear()
        self._longs[n] = encoded
        return encoded

    def _mark(self, mark: dict) -> bytes:
        key = (mark["publisher_epoch"], mark["seq"], mark["batch_index"])
        encoded = self._marks.get(key)
        if encoded is None:
            encoded = b"".join((BRANCH_1, avro_long(key[0]), avro_long(key[1]), avro_long(key[2])))
            if len(self._marks) > 1000:
                self._marks.clear()
            self._marks[key] = encoded
        return encoded

    def encode(self, entry: dict) -> bytes:
        """Encode one entry (``block_hash``, ``ownership``, ``rows``, ``parent_block_hash``, ``content_hash``),
        framing included.

        Raises:
            KeyError, TypeError, AttributeError: a field is missing or has the wrong type (an unknown
                enum symbol is a KeyError).
            OverflowError: an int outside Avro's long range (as fastavro).
        """
        # An int field in the small-int table is one comparison and one index, in line: a call to
        # avro_long per field was most of this method's time. The index refuses a float (TypeError), as
        # fastavro does; None fails the comparison (TypeError).
        small, long_, strings, longs = SMALL_INTS, avro_long, self._optional_strings, self._longs
        block_hash, ownership, rows = entry["block_hash"], entry["ownership"], entry["rows"]
        size = len(block_hash)
        size = small[size + 1024] if size <= 4095 else long_(size)
        ownership = strings.get(ownership) or self._optional_string(ownership)
        parent, content_hash = entry["parent_block_hash"], entry["content_hash"]
        if parent is None and content_hash is None:
            content_keys = _NO_CONTENT_KEYS
        else:
            content_keys = b"".join((AVRO_NULL if parent is None else BRANCH_1 + avro_bytes(parent), AVRO_NULL
                                     if content_hash is None else BRANCH_1 + (longs.get(content_hash)
                                                                               or self._long(content_hash))))
        row = rows[0] if len(rows) == 1 else None  # len, not truth: None is refused (TypeError), as by fastavro
        workers = None if row is None else row["workers"]
        if workers is not None and len(workers) == 1:
            worker = workers[0]
            key = (row["instance_id"], row["data_parallel_rank"], row["tier"], row["medium"], row["locality"],
                   row["group_idx"], row["world_size"], row["aggregation"])
            rank, count, epoch, seq, batch_index, block_index, content = (
                worker["worker_rank"], worker["count"], worker["publisher_epoch"], worker["seq"],
                worker["batch_index"], worker["block_index"], worker["content"])
            copies, since, last_ts, mark = row["copies"], row["since"], row["last_ts"], row["clear_mark"]
            return b"".join((
                self.header, size, block_hash, ownership,
                b"\x02", self._identities.get(key) or self._identity(key), b"\x02",  # one row; its one worker:
                small[rank + 1024] if -1024 <= rank <= 4095 else long_(rank),
                small[count + 1024] if -1024 <= count <= 4095 else long_(count),
                longs.get(epoch) or self._long(epoch),
                small[seq + 1024] if -1024 <= seq <= 4095 else long_(seq),
                small[batch_index + 1024] if -1024 <= batch_index <= 4095 else long_(batch_index),
                small[block_index + 1024] if -1024 <= block_index <= 4095 else long_(block_index),
                AVRO_NULL if content is None else BRANCH_1 + (longs.get(content) or self._long(content)),
                b"\x00",  # end of workers
                small[copies + 1024] if -1024 <= copies <= 4095 else long_(copies),
                AVRO_NULL + avro_double(last_ts) if since is None
                else _pack_branch_1_double_double(2, since, last_ts),
                b"\x00\x00" if mark is None else self._mark(mark) + b"\x00",  # mark, end of rows
                content_keys))
        out = [self.header, size, block_hash, ownership]
        if rows:
            out.append(long_(len(rows)))
            for row in rows:
                key = (row["instance_id"], row["data_parallel_rank"], row["tier"], row["medium"], row["locality"],
                       row["group_idx"], row["world_size"], row["aggregation"])
                out.append(self._identities.get(key) or self._identity(key))
                workers = row["workers"]
                if len(workers):
                    out.append(long_(len(workers)))
                    for worker in workers:
                        rank, count, epoch, seq, batch_index, block_index, content = (
                            worker["worker_rank"], worker["count"], worker["publisher_epoch"], worker["seq"],
                            worker["batch_index"], worker["block_index"], worker["content"])
                        out += (small[rank + 1024] if -1024 <= rank <= 4095 else long_(rank),
                                small[count + 1024] if -1024 <= count <= 4095 else long_(count),
                                longs.get(epoch) or self._long(epoch),
                                small[seq + 1024] if -1024 <= seq <= 4095 else long_(seq),
                                small[batch_index + 1024] if -1024 <= batch_index <= 4095 else long_(batch_index),
                                small[block_index + 1024] if -1024 <= block_index <= 4095 else long_(block_index),
                                AVRO_NULL if content is None
                                else BRANCH_1 + (longs.get(content) or self._long(content)))
                copies, since, last_ts, mark = row["copies"], row["since"], row["last_ts"], row["clear_mark"]
                out += (b"\x00",  # end of workers
                        small[copies + 1024] if -1024 <= copies <= 4095 else long_(copies),
                        AVRO_NULL + avro_double(last_ts) if since is None
                        else _pack_branch_1_double_double(2, since, last_ts),
                        AVRO_NULL if mark is None else self._mark(mark))
        out += (b"\x00", content_keys)  # end of rows
        return b"".join(out)


class ResidencyChangeWriter(_TableRecordWriter):
    """Hand-written encoder of ``residency_change`` records (topic kv-residency-changes), byte for byte what
    :meth:`AvroCodec.encode` writes, framing included. The materializing agent writes one per residency
    transition.

    :meth:`change` takes the fields as arguments (no record dict to build); :meth:`encode` takes a
    record. The encoded ``ownership`` with the row identity (``instance_id`` .. ``group_idx``), and the
    cause, are cached. Checked against fastavro in ``tests/unit/test_writers.py``. Construction as
    :class:`_TableRecordWriter` (a ``residency_change`` v1 codec, or ValueError).
    """

    FAMILY = "residency_change"
    VERSION = 1
    FINGERPRINT = bytes.fromhex("4b8f4b662450e818")

    def __init__(self, codec: AvroCodec) -> None:
        super().__init__(codec)
        #: (ownership, instance_id, data_parallel_rank, tier, medium, locality, group_idx) -> encoded (the
        #: fields between ``block_hash`` and ``resident``); cause -> encoded.
        self._rows: dict[tuple, bytes] = {}
        self._causes: dict[str, bytes] = {}

    def _row(self, key: tuple) -> bytes:
        ownership, instance_id, data_parallel_rank, tier, medium, locality, group_idx = key
        encoded = b"".join((avro_optional_string(ownership), avro_string(instance_id), avro_long(data_parallel_rank),
                            self.tier[tier], avro_optional_string(medium), avro_optional_string(locality),
                            avro_optional(group_idx, avro_long)))
        if len(self._rows) > 10_000:
            self._rows.clear()
        self._rows[key] = encoded
        return encoded

    def _cause(self, cause: str) -> bytes:
        if len(self._causes) > 100:
            self._causes.clear()
        encoded = self._causes[cause] = avro_string(cause)
        return encoded

    def change(self, block_hash: bytes, ownership: str | None, instance_id: str, data_parallel_rank: int, tier: str,
               medium: str | None, locality: str | None, group_idx: int | None, resident: bool, copies: int,
               ts: float, cause: str) -> bytes:
        """Encode one transition from its fields (in the schema's order), framing included.

        Raises:
            KeyError, TypeError, AttributeError: a field has the wrong type (an unknown tier is a KeyError).
        """
        key = (ownership, instance_id, data_parallel_rank, tier, medium, locality, group_idx)
        size = len(block_hash)
        # small ints in line, as in ResidencyWriter.encode
        return b"".join((self.header, SMALL_INTS[size + 1024] if size <= 4095 else avro_long(size), block_hash,
                         self._rows.get(key) or self._row(key), b"\x01" if resident else b"\x00",
                         SMALL_INTS[copies + 1024] if -1024 <= copies <= 4095 else avro_long(copies),
                         avro_double(ts), self._causes.get(cause) or self._cause(cause)))

    def encode(self, record: dict) -> bytes:
        """Encode one ``residency_change`` record dict, framing included (every field must be present)."""
        return self.change(record["block_hash"], record["ownership"], record["instance_id"],
                           record["data_parallel_rank"], record["tier"], record["medium"], record["locality"],
                           record["group_idx"], record["resident"], record["copies"], record["ts"], record["cause"])


# --------------------------------------------------------------------------- ownership_batch (repartition)

def encode_clear_mark(mark: tuple[int, int, int]) -> bytes:
    """The Avro ``["null", ClearMark]`` union value of a clear position (branch 0 for ``NO_CLEAR``,
    schemas.clear_position)."""
    if mark == NO_CLEAR:
        return b"\x00"
    return b"\x02" + avro_long(mark[0]) + avro_long(mark[1]) + avro_long(mark[2])


def encode_keyed_event(key: str | bytes, mark: bytes, event: bytes, block: bytes | None = None) -> bytes:
    """One ``KeyedEvent`` of schemas/ownership_batch_v2.avsc in Avro binary (``key`` as text or its UTF-8 bytes,
    ``mark`` from :func:`encode_clear_mark`, ``block`` from :meth:`schemas.block_event.BlockFieldsWriter.block` or
    None).

    Written by hand because the repartition process writes one per event and fastavro's generic writer costs several
    times more; tests check the bytes against fastavro's.
    """
    raw_key = key.encode() if type(key) is str else key
    if block is None:
        return b"".join((avro_long(len(raw_key)), raw_key, mark, avro_long(len(event)), event, b"\x00"))
    return b"".join((avro_long(len(raw_key)), raw_key, mark, avro_long(len(event)), event, b"\x02",
                     avro_long(len(block)), block))


#: The ``sources`` and ``strings`` tables of a message without block fields: two empty arrays.
NO_TABLES = b"\x00\x00"


def encode_ownership_batch(header: bytes, items: list[bytes], tables: bytes = NO_TABLES) -> bytes:
    """A single-object ``OwnershipBatch`` (``header``: magic and fingerprint of version 2) of encoded KeyedEvents,
    after its ``tables`` (:meth:`schemas.block_event.BlockFieldsWriter.tables`)."""
    if not items:
        return b"".join((header, tables, b"\x00"))
    return b"".join((header, tables, avro_long(len(items)), *items, b"\x00"))
