"""Hand-written Avro encoders of the hot paths: byte for byte what fastavro writes, several times faster.

- :class:`KvEventWriter`: ``kv_event`` records (the producers' per-block messages).
- :class:`ResidencyWriter`, :class:`ResidencyChangeWriter`: the residency table's changelog values and the
  ``kv-residency-changes`` records (the materializing agent).

Each writer refuses any writer schema but the one it encodes (family, version, fingerprint), so a new schema
version falls back to fastavro rather than writing wrong bytes. The primitives (``avro_long`` and friends)
follow the Avro specification's binary encoding.
"""

from __future__ import annotations

import struct

from schemas.clear_position import NO_CLEAR
from schemas.codec import AvroCodec, find_named_type
from schemas.compiled import choose

#: Avro ``long``: a signed 64-bit integer.
LONG_MIN, LONG_MAX = -(1 << 63), (1 << 63) - 1


#: Varint bytes of every 14-bit chunk (both bytes with the continuation bit), and of the last 8 bits of a varint of
#: 57 to 64 bits: a 64-bit hash's varint in five lookups, about half the loop's time.
_VARINT_14 = [bytes((i & 0x7F | 0x80, i >> 7 | 0x80)) for i in range(1 << 14)]
_VARINT_TAIL = [bytes((i,)) if i < 0x80 else bytes((i & 0x7F | 0x80, i >> 7)) for i in range(256)]


def _zigzag_varint(n: int) -> bytes:
    """Avro ``int``/``long``: zig-zag, then a little-endian base-128 varint.

    Raises:
        OverflowError: ``n`` is outside Avro's long range (fastavro refuses it too; the zig-zag of a larger
            int would be a varint no reader can read back).
    """
    if not LONG_MIN <= n <= LONG_MAX:
        raise OverflowError(f"{n} is outside Avro's long range [-2**63, 2**63)")
    n = (n << 1) ^ (n >> 63)
    if n >> 56:  # 9 or 10 bytes: content hashes and digests, one per stored block; four 14-bit chunks and the rest
        return b"".join((_VARINT_14[n & 0x3FFF], _VARINT_14[n >> 14 & 0x3FFF], _VARINT_14[n >> 28 & 0x3FFF],
                         _VARINT_14[n >> 42 & 0x3FFF], _VARINT_TAIL[n >> 56]))
    # one, two and three bytes (|n| below 2**20: batch seqs, offsets) without the loop, which is slower
    if n < 0x80:
        return bytes((n,))
    if n < 0x4000:
        return bytes((n & 0x7F | 0x80, n >> 7))
    if n < 0x200000:
        return bytes((n & 0x7F | 0x80, n >> 7 & 0x7F | 0x80, n >> 14))
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


#: Encodings of the ints -1024..4095, the positions, counts and indexes most records carry
#: (ResidencyWriter.encode writes these bounds in line).
_SMALL_MIN, _SMALL_MAX = -1024, 4095
_SMALL_INTS = [_zigzag_varint(n) for n in range(_SMALL_MIN, _SMALL_MAX + 1)]
#: Avro ``double``: 8 bytes, little-endian IEEE 754.
avro_double = struct.Struct("<d").pack


def avro_long(n: int) -> bytes:
    """Avro binary encoding of an ``int`` or ``long`` (the same varint), as fastavro writes it."""
    if _SMALL_MIN <= n <= _SMALL_MAX:
        return _SMALL_INTS[n - _SMALL_MIN]
    return _zigzag_varint(n)


def avro_bytes(value: bytes) -> bytes:
    """Avro ``bytes``: length, then the bytes."""
    return avro_long(len(value)) + value


def avro_string(value: str) -> bytes:
    """Avro ``string``: length of the UTF-8 bytes, then the bytes."""
    return avro_bytes(value.encode())


def avro_int_array(values: list[int]) -> bytes:
    """Avro ``{"type": "array", "items": "int"}`` as fastavro writes it: one block of all items, then 0.

    Raises:
        TypeError: ``values`` is None or holds a non-integer (fastavro refuses both).
    """
    if not len(values):
        return b"\x00"
    return b"".join([avro_long(len(values)), *map(avro_long, values), b"\x00"])


#: ``["null", X]`` with null: union branch 0.
AVRO_NULL = b"\x00"
_BRANCH_1 = b"\x02"


def avro_optional(value, encode) -> bytes:
    """Avro ``["null", X]``: branch 0 for None, else branch 1 and ``encode(value)``."""
    return AVRO_NULL if value is None else _BRANCH_1 + encode(value)


def _enum_symbols(schema: dict, field_names: tuple[str, ...]) -> dict[str, dict[str, bytes]]:
    """Per field of a record: enum symbol -> its encoded index (the enum alone or the non-null union branch)."""
    found = {}
    for f in schema["fields"]:
        if f["name"] not in field_names:
            continue
        kind = f["type"]
        optional = isinstance(kind, list)
        enum = kind[1] if optional else kind
        found[f["name"]] = {symbol: (_BRANCH_1 if optional else b"") + avro_long(i)
                            for i, symbol in enumerate(enum["symbols"])}
    return found


class KvEventWriter:
    """Hand-written encoder of ``kv_event`` records, byte for byte what :meth:`AvroCodec.encode` writes.

    fastavro's generic writer resolves every union and looks up every field of every record; a
    producer writes hundreds of thousands of records per second that share most of their bytes. This
    writer encodes the field layout of ``kv_event_v5.avsc`` directly and gives the pieces that
    :class:`producers.split.BlockEncoder` reuses across the blocks of one engine event. The
    output is checked against fastavro in ``tests/unit/test_split.py``.

    Args:
        codec: a ``kv_event`` codec writing version 5 (its framing header is reused).

    Raises:
        ValueError: the codec writes another family or version (the field layout coded here would not
            match); use :meth:`AvroCodec.encode` then.
    """

    #: The writer schema whose field layout this class encodes.
    VERSION = 5

    def __init__(self, codec: AvroCodec) -> None:
        if codec.family != "kv_event" or codec.schema.version != self.VERSION:
            raise ValueError(f"KvEventWriter encodes kv_event v{self.VERSION}, not "
                             f"{codec.family} v{codec.schema.version}")
        parsed = codec.schema.parsed
        self.header = codec.header
        enums = _enum_symbols(parsed, ("aggregation", "hash_encoding", "tier"))
        #: symbol -> encoded enum (or ["null", enum] union branch + index) of each enum field.
        self.aggregation = {None: AVRO_NULL, **enums["aggregation"]}
        self.hash_encoding = enums["hash_encoding"]
        self.tier = {None: AVRO_NULL, **enums["tier"]}
        event_field = next(f for f in parsed["fields"] if f["name"] == "event")
        #: full branch name -> encoded union index of the event.
        self.branch = {b["name"]: avro_long(i) for i, b in enumerate(event_field["type"])}
        self._prefixes: dict[tuple, bytes] = {}
        self._middles: dict[tuple, bytes] = {}
        self._tails: dict[tuple, bytes] = {}
        self._removed: dict[tuple, bytes] = {}
        self._suffixes: dict[tuple, bytes] = {}

    def prefix(self, instance_id: str, data_parallel_rank: int, worker_rank: int | None, world_size: int | None,
               aggregation: str | None, publisher_epoch: int) -> bytes:
        """Header and the source's fields (``instance_id`` .. ``publisher_epoch``), cached per source."""
        key = (instance_id, data_parallel_rank, worker_rank, world_size, aggregation, publisher_epoch)
        cached = self._prefixes.get(key)
        if cached is None:
            cached = b"".join((self.header, avro_string(instance_id), avro_long(data_parallel_rank),
                               avro_optional(worker_rank, avro_long), avro_optional(world_size, avro_long),
                               self.aggregation[aggregation], avro_long(publisher_epoch)))
            if len(self._prefixes) > 100_000:
                self._prefixes.clear()
            self._prefixes[key] = cached
        return cached

    def stored_middle(self, body: dict) -> bytes:
        """BlockStored's ``block_size`` .. ``lora_name`` (the same for every block of an event), cached."""
        key = (body["block_size"], body["lora_id"], body["medium"], body["lora_name"])
        cached = self._middles.get(key)
        if cached is None:
            cached = self._middles[key] = self._bounded(self._middles, self._stored_middle(body))
        return cached

    def stored_tail(self, body: dict) -> bytes:
        """BlockStored's ``group_idx`` .. ``session_id`` (the same for every block of an event), cached."""
        key = (body["group_idx"], body["kv_cache_spec_kind"], body["kv_cache_spec_sliding_window"], body["locality"],
               body["ownership"], body["session_id"])
        cached = self._tails.get(key)
        if cached is None:
            cached = self._tails[key] = self._bounded(self._tails, self._stored_tail(body))
        return cached

    def stored_suffix(self, cache_salt: str | None, token_id_width: int | None) -> bytes:
        """BlockStored's fields ``cache_salt`` and ``token_id_width`` (added in v3, after ``parent_known``), cached;
        ``content_hash`` (v4), which differs per block, follows them."""
        key = (cache_salt, token_id_width)
        cached = self._suffixes.get(key)
        if cached is None:
            cached = self._suffixes[key] = self._bounded(self._suffixes, avro_optional(cache_salt, avro_string)
                                                         + avro_optional(token_id_width, avro_long))
        return cached

    @staticmethod
    def report_mode(mode: str | None) -> bytes:
        """BlockStored's ``report_mode`` (v5, the last field; the same for every store of a source)."""
        return avro_optional(mode, avro_string)

    def removed_body(self, body: dict) -> bytes:
        """A BlockRemoved body, cached."""
        key = (body["medium"], body["group_idx"], body["locality"], body["ownership"])
        cached = self._removed.get(key)
        if cached is None:
            cached = self._removed[key] = self._bounded(self._removed, self._removed_body(body))
        return cached

    @staticmethod
    def _bounded(cache: dict, value: bytes) -> bytes:
        """``value``; empties ``cache`` first when it has grown past 10,000 entries (distinct field values)."""
        if len(cache) > 10_000:
            cache.clear()
        return value

    @staticmethod
    def _stored_middle(body: dict) -> bytes:
        return b"".join((avro_long(body["block_size"]), avro_optional(body["lora_id"], avro_long),
                         avro_optional(body["medium"], avro_string), avro_optional(body["lora_name"], avro_string)))

    @staticmethod
    def _stored_tail(body: dict) -> bytes:
        return b"".join((avro_optional(body["group_idx"], avro_long),
                         avro_optional(body["kv_cache_spec_kind"], avro_string),
                         avro_optional(body["kv_cache_spec_sliding_window"], avro_long),
                         avro_optional(body["locality"], avro_string), avro_optional(body["ownership"], avro_string),
                         avro_optional(body["session_id"], avro_string)))

    @staticmethod
    def _removed_body(body: dict) -> bytes:
        return b"".join((avro_optional(body["medium"], avro_string), avro_optional(body["group_idx"], avro_long),
                         avro_optional(body["locality"], avro_string), avro_optional(body["ownership"], avro_string)))

    def encode(self, record: dict) -> bytes:
        """Encode one whole record (any event type), framing included.

        Raises:
            KeyError, TypeError, AttributeError: the record lacks a field or has one of the wrong type
                (fastavro would raise too; the producers only pass records from :mod:`producers.split`).
        """
        kind, body = record["event"]
        if kind == "kvstream.v1.BlockStored":
            pk = body.get("parent_known")
            event = b"".join((avro_optional(body["parent_block_hash"], avro_bytes), avro_int_array(body["token_ids"]),
                              self.stored_middle(body), avro_optional(body["extra_keys"], avro_bytes),
                              self.stored_tail(body), avro_optional(body["lookahead_token_ids"], avro_int_array),
                              AVRO_NULL if pk is None else (b"\x02\x01" if pk else b"\x02\x00"),
                              self.stored_suffix(body.get("cache_salt"), body.get("token_id_width")),
                              avro_optional(body.get("content_hash"), avro_long),
                              avro_optional(body.get("report_mode"), avro_string)))
        elif kind == "kvstream.v1.BlockRemoved":
            event = self.removed_body(body)
        elif kind == "kvstream.v1.AllBlocksCleared":
            event = b""
        elif kind == "kvstream.v1.PublisherRestarted":
            event = avro_optional(body.get("previous_epoch"), avro_long)
        elif kind == "kvstream.v1.SourceStale":
            event = avro_long(body["first_lost_seq"]) + avro_long(body["last_lost_seq"])
        elif kind == "kvstream.v1.SourceHeartbeat":
            event = avro_optional(body.get("evidence"), avro_string)
        elif kind == "kvstream.v1.SourceUnregistered":
            event = (b"\x01" if body.get("all_ranks", True) else b"\x00") + avro_optional(body.get("reason"),
                                                                                          avro_string)
        else:
            raise ValueError(f"{kind!r} is not a branch of the kv_event event union")
        return b"".join((
            self.prefix(record["instance_id"], record["data_parallel_rank"], record["worker_rank"],
                        record["world_size"], record["aggregation"], record["publisher_epoch"]),
            avro_long(record["seq"]), avro_long(record["batch_index"]), avro_double(record["ts"]),
            avro_optional(record["block_hash"], avro_bytes), self.hash_encoding[record["hash_encoding"]],
            avro_long(record["block_index"]), avro_long(record["block_count"]), self.tier[record["tier"]],
            self.branch[kind], event))


# --------------------------------------------------------------------------- fast residency writers

#: ``["null", "double"]`` with a value followed by a ``double``: branch 1 (the byte 2), then both doubles.
_pack_branch_1_double_double = struct.Struct("<Bdd").pack
#: A residency entry's ``parent_block_hash`` and ``content_hash`` (v3), both null: an entry without content keys.
_NO_CONTENT_KEYS = b"\x00\x00"


def avro_optional_string(value: str | None) -> bytes:
    """Avro ``["null", "string"]``: :func:`avro_optional` with :func:`avro_string`, in one call."""
    return AVRO_NULL if value is None else _BRANCH_1 + avro_string(value)


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
    Construction as :class:`_TableRecordWriter` (a ``residency`` v3 codec, or ValueError); ``compiled`` picks
    the compiled encoder (:func:`schemas._hotpath.encode_residency`) as :func:`schemas.compiled.choose` does
    (None: when built). The compiled one gives the same bytes; an entry of an unusual shape (a float where an
    int belongs, and the like) it hands back to the Python code here.
    """

    FAMILY = "residency"
    VERSION = 3
    FINGERPRINT = bytes.fromhex("edf15354f4595dea")

    def __init__(self, codec: AvroCodec, compiled: bool | None = None) -> None:
        super().__init__(codec)
        #: symbol -> encoded index of the AggregationMode enum (a named type of kv_event_v1).
        self.aggregation = _named_enum(codec, "kvstream.v1.AggregationMode")
        hotpath = choose(compiled)
        #: The compiled encoder (schemas/_hotpath.pyx), or None.
        self._encode_compiled = None if hotpath is None else hotpath.encode_residency
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
        encoded = cache[value] = _BRANCH_1 + avro_string(value)
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
            encoded = b"".join((_BRANCH_1, avro_long(key[0]), avro_long(key[1]), avro_long(key[2])))
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
        if self._encode_compiled is not None:
            encoded = self._encode_compiled(entry, self.header, self.tier, self.aggregation)
            if encoded is not None:
                return encoded
        return self._encode_python(entry)

    def _encode_python(self, entry: dict) -> bytes:
        # An int field in the small-int table is one comparison and one index, in line: a call to
        # avro_long per field was most of this method's time. The index refuses a float (TypeError), as
        # fastavro does; None fails the comparison (TypeError).
        small, long_, strings, longs = _SMALL_INTS, avro_long, self._optional_strings, self._longs
        block_hash, ownership, rows = entry["block_hash"], entry["ownership"], entry["rows"]
        size = len(block_hash)
        size = small[size + 1024] if size <= 4095 else long_(size)
        ownership = strings.get(ownership) or self._optional_string(ownership)
        parent, content_hash = entry["parent_block_hash"], entry["content_hash"]
        if parent is None and content_hash is None:
            content_keys = _NO_CONTENT_KEYS
        else:
            content_keys = b"".join((AVRO_NULL if parent is None else _BRANCH_1 + avro_bytes(parent), AVRO_NULL
                                     if content_hash is None else _BRANCH_1 + (longs.get(content_hash)
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
                AVRO_NULL if content is None else _BRANCH_1 + (longs.get(content) or self._long(content)),
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
                                else _BRANCH_1 + (longs.get(content) or self._long(content)))
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
        return b"".join((self.header, _SMALL_INTS[size + 1024] if size <= 4095 else avro_long(size), block_hash,
                         self._rows.get(key) or self._row(key), b"\x01" if resident else b"\x00",
                         _SMALL_INTS[copies + 1024] if -1024 <= copies <= 4095 else avro_long(copies),
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


def encode_keyed_event(key: str, mark: bytes, event: bytes, block: bytes | None = None) -> bytes:
    """One ``KeyedEvent`` of schemas/ownership_batch_v2.avsc in Avro binary (``mark`` from :func:`encode_clear_mark`,
    ``block`` from :meth:`schemas.block_event.BlockFieldsWriter.block` or None).

    Written by hand because the repartition process writes one per event and fastavro's generic writer costs several
    times more; tests check the bytes against fastavro's.
    """
    raw_key = key.encode()
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
