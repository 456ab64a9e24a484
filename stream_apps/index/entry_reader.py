"""The fleet index's read of a residency changelog value: only what the index keeps, not the whole entry.

A residency entry (schemas/residency_v3.avsc) holds, per row, eleven fields and an array of per-worker counts;
the index keeps, per row with ``copies > 0``, three of them (``instance_id``, ``data_parallel_rank``, ``tier``),
and of the entry its ``parent_block_hash`` and ``content_hash``. Ownership and block hash come from the record's
key (``<ownership or primary>/<hash hex>``). Decoding every value into dicts (the codec's full decode) was about
two thirds of a fresh replica's catch-up on the changelog, so :class:`IndexEntryReader` reads the entry's bytes
in one pass that builds only those values and skips the rest.

It reads one layout only: the codec's own residency version (v3) in single-object framing, with the header
checked against the codec's fingerprints. Anything else goes to the codec's full decode, whose result is then
cut down to the same shape (:func:`index_entry_of`): a record written with another version (v1, v2: resolved by
the codec, their parent and content hash None), the Confluent wire format, an unknown fingerprint, bytes the
lean pass refuses (the codec then names the fault in its ``DecodeError``). So the answer is always the codec's.

Two implementations give the same results: the compiled one (``schemas._hotpath.read_index_entry``) where the
module is built, and :func:`_read_python` (``compiled`` as :func:`schemas.compiled.choose`);
``tests/unit/test_index_entry_reader.py`` compares both with the full decode, on random and corrupted entries.
"""

from __future__ import annotations

import re
import struct

from schemas.codec import SINGLE_OBJECT_HEADER_LEN, AvroCodec, find_named_type
from schemas.compiled import choose
from schemas.fast_reader import long_tail as _long_tail

#: One resident row as the index keeps it: ``(instance_id, data_parallel_rank, tier)``, tier a ``schemas.TIERS``
#: symbol.
IndexRow = tuple[str, int, str]
#: What the index keeps of one entry: ``(rows with copies > 0 in the entry's order, parent_block_hash or None,
#: content_hash or None)``; the parent is the canonical hash's bytes, the content hash a signed 64-bit int.
IndexEntry = tuple[list[IndexRow], "bytes | None", "int | None"]

#: Fingerprint of residency_v3.avsc, the layout both lean readers walk field by field. A codec whose own version
#: has another (a v4) gets no lean reading at all: every value then takes the full decode, correct and slower,
#: until the readers learn the new layout.
LAYOUT_FINGERPRINT = bytes.fromhex("edf15354f4595dea")

#: What the Python lean reader raises on bytes it does not read (UnicodeDecodeError is a ValueError); the
#: compiled one raises IndexError or ValueError.
_REFUSALS = (IndexError, ValueError, struct.error)


def index_entry_of(entry: dict) -> IndexEntry:
    """The index's part of a decoded ``residency`` entry (any version, as the codec decodes it into its own).

    Raises:
        KeyError, TypeError: ``entry`` is not shaped as a residency record.
    """
    rows = [(row["instance_id"], row["data_parallel_rank"], row["tier"]) for row in entry["rows"] if row["copies"] > 0]
    return rows, entry.get("parent_block_hash"), entry.get("content_hash")


def _long(data: bytes, pos: int) -> tuple[int, int]:
    """The zig-zag varint at ``pos`` and the position after it (schemas.fast_reader's limits: 10 bytes, 64 bits)."""
    b = data[pos]
    if b & 0x80:
        return _long_tail(data, pos + 1, b)
    return (b >> 1) ^ -(b & 1), pos + 1


#: One varint as schemas.fast_reader accepts it: up to nine bytes (up to eight with the continuation bit, then one
#: without), or ten whose last is 0 or 1 (more would pass 64 bits).
_VARINT = rb"(?:[\x80-\xff]{0,8}[\x00-\x7f]|[\x80-\xff]{9}[\x00\x01])"
#: Six varints in a row (a worker count's six longs), matched in one call: skipping them one by one in Python took
#: more than half of the lean reader's time.
_SIX_LONGS = re.compile(_VARINT * 6).match


def _branch_tail(data: bytes, pos: int, b: int) -> tuple[bool, int]:
    """A ``["null", X]`` union's branch whose first byte ``b`` (at ``pos - 1``) is neither 0 nor 2: a longer
    varint of 0 or 1 (legal Avro, which the generated readers accept), else refused."""
    if b & 0x80:
        index, pos = _long_tail(data, pos, b)
    else:
        index = (b >> 1) ^ -(b & 1)
    if index not in (0, 1):
        raise ValueError(f"union branch {index} at {pos}")
    return index == 1, pos


def _read_python(data: bytes, pos: int, tiers: tuple, aggregations: int) -> IndexEntry:
    """The pure-Python twin of ``schemas._hotpath.read_index_entry``: the index's part of the ``residency`` v3
    body at ``data[pos:]``, reading and checking every field as the generated reader does (lengths, UTF-8, union
    branches, enum indices, varints, no trailing bytes), keeping only what the index needs.

    Written out field by field, the one-byte varint (most of them) in line, as schemas.fast_reader generates its
    readers: a helper call per field would cost more than the dicts it saves. That is also why it is one function
    of some 200 lines, over the house's 80: it is a generated reader's shape, unrolled by hand.

    Raises:
        IndexError, ValueError (UnicodeDecodeError included), struct.error: bytes that are not such a record.
    """
    size = len(data)
    long_tail, branch_tail, six_longs = _long_tail, _branch_tail, _SIX_LONGS
    # block_hash: the key has it
    b = data[pos]
    pos += 1
    if b & 0x80:
        n, pos = long_tail(data, pos, b)
    else:
        n = (b >> 1) ^ -(b & 1)
    end = pos + n
    if n < 0 or end > size:
        raise ValueError(f"bad length {n} at {pos}")
    pos = end
    # ownership: the key has it, but a value that is not UTF-8 must still be refused
    b = data[pos]
    pos += 1
    present = b == 2
    if b != 0 and b != 2:
        present, pos = branch_tail(data, pos, b)
    if present:
        b = data[pos]
        pos += 1
        if b & 0x80:
            n, pos = long_tail(data, pos, b)
        else:
            n = (b >> 1) ^ -(b & 1)
        end = pos + n
        if n < 0 or end > size:
            raise ValueError(f"bad length {n} at {pos}")
        data[pos:end].decode()
        pos = end
    n_tiers = len(tiers)
    rows = []
    while True:
        b = data[pos]
        pos += 1
        if b & 0x80:
            count, pos = long_tail(data, pos, b)
        else:
            count = (b >> 1) ^ -(b & 1)
        if count == 0:
            break
        if count < 0:  # a block that gives its byte size, which a one-pass reader does not need
            count = -count
            _, pos = _long(data, pos)
        for _ in range(count):
            b = data[pos]  # instance_id
            pos += 1
            if b & 0x80:
                n, pos = long_tail(data, pos, b)
            else:
                n = (b >> 1) ^ -(b & 1)
            end = pos + n
            if n < 0 or end > size:
                raise ValueError(f"bad length {n} at {pos}")
            instance_id = data[pos:end].decode()
            pos = end
            b = data[pos]  # data_parallel_rank
            pos += 1
            if b & 0x80:
                rank, pos = long_tail(data, pos, b)
            else:
                rank = (b >> 1) ^ -(b & 1)
            b = data[pos]  # tier
            pos += 1
            if b & 0x80:
                tier, pos = long_tail(data, pos, b)
            else:
                tier = (b >> 1) ^ -(b & 1)
            if not 0 <= tier < n_tiers:
                raise ValueError(f"enum index {tier} at {pos}")
            for _field in range(2):  # medium, locality: checked, not kept
                b = data[pos]
                pos += 1
                if b == 0:
                    continue
                if b != 2:
                    present, pos = branch_tail(data, pos, b)
                    if not present:
                        continue
                b = data[pos]
                pos += 1
                if b & 0x80:
                    n, pos = long_tail(data, pos, b)
                else:
                    n = (b >> 1) ^ -(b & 1)
                end = pos + n
                if n < 0 or end > size:
                    raise ValueError(f"bad length {n} at {pos}")
                if not data[pos:end].isascii():  # ASCII is UTF-8: only another string needs decoding to tell
                    data[pos:end].decode()
                pos = end
            b = data[pos]  # group_idx
            pos += 1
            if b != 0:
                present = True
                if b != 2:
                    present, pos = branch_tail(data, pos, b)
                if present:
                    b = data[pos]
                    pos += 1
                    if b & 0x80:
                        _, pos = long_tail(data, pos, b)
            b = data[pos]  # world_size
            pos += 1
            if b & 0x80:
                _, pos = long_tail(data, pos, b)
            b = data[pos]  # aggregation
            pos += 1
            if b & 0x80:
                aggregation, pos = long_tail(data, pos, b)
            else:
                aggregation = (b >> 1) ^ -(b & 1)
            if not 0 <= aggregation < aggregations:
                raise ValueError(f"enum index {aggregation} at {pos}")
            while True:  # workers
                b = data[pos]
                pos += 1
                if b & 0x80:
                    workers, pos = long_tail(data, pos, b)
                else:
                    workers = (b >> 1) ^ -(b & 1)
                if workers == 0:
                    break
                if workers < 0:
                    workers = -workers
                    _, pos = _long(data, pos)
                for _ in range(workers):
                    # worker_rank, count, publisher_epoch, seq, batch_index, block_index: skipped in one match
                    # (the epoch and seq are several bytes each), then content's branch
                    skipped = six_longs(data, pos)
                    if skipped is None:
                        raise ValueError(f"bad varint in a worker count at {pos}")
                    pos = skipped.end()
                    b = data[pos]
                    pos += 1
                    if b != 0:
                        present = True
                        if b != 2:
                            present, pos = branch_tail(data, pos, b)
                        if present:
                            b = data[pos]
                            pos += 1
                            if b & 0x80:
                                _, pos = long_tail(data, pos, b)
            b = data[pos]  # copies
            pos += 1
            if b & 0x80:
                copies, pos = long_tail(data, pos, b)
            else:
                copies = (b >> 1) ^ -(b & 1)
            b = data[pos]  # since's branch, then since (if set) and last_ts: any 8 bytes are a double
            pos += 1
            present = b == 2
            if b != 0 and b != 2:
                present, pos = branch_tail(data, pos, b)
            pos += 16 if present else 8
            if pos >= size:  # the clear_mark's branch follows
                raise IndexError("double past the end of the record")
            b = data[pos]  # clear_mark: publisher_epoch, seq, batch_index
            pos += 1
            if b != 0:
                present = True
                if b != 2:
                    present, pos = branch_tail(data, pos, b)
                if present:
                    for _field in range(3):
                        b = data[pos]
                        pos += 1
                        if b & 0x80:
                            _, pos = long_tail(data, pos, b)
            if copies > 0:
                rows.append((instance_id, rank, tiers[tier]))
    parent = content = None
    b = data[pos]  # parent_block_hash
    pos += 1
    present = b == 2
    if b != 0 and b != 2:
        present, pos = branch_tail(data, pos, b)
    if present:
        b = data[pos]
        pos += 1
        if b & 0x80:
            n, pos = long_tail(data, pos, b)
        else:
            n = (b >> 1) ^ -(b & 1)
        end = pos + n
        if n < 0 or end > size:
            raise ValueError(f"bad length {n} at {pos}")
        parent = data[pos:end]
        pos = end
    b = data[pos]  # content_hash
    pos += 1
    present = b == 2
    if b != 0 and b != 2:
        present, pos = branch_tail(data, pos, b)
    if present:
        b = data[pos]
        pos += 1
        if b & 0x80:
            content, pos = long_tail(data, pos, b)
        else:
            content = (b >> 1) ^ -(b & 1)
    if pos != size:
        raise ValueError(f"{size - pos} trailing bytes")
    return rows, parent, content


class IndexEntryReader:
    """Reads residency changelog values into :data:`IndexEntry` tuples (module docstring).

    Args:
        codec: the feed's residency codec (``kafka_io.schema_registry.reader_codec("residency", ...)``): its own
            version's single-object records are read lean, everything else is decoded by it.
        compiled: use the compiled lean reader (``schemas._hotpath.read_index_entry``): None when it is built
            (:mod:`schemas.compiled`), True always (ImportError if not built), False never. Both give the same
            results.
    """

    def __init__(self, codec: AvroCodec, compiled: bool | None = None) -> None:
        self._decode = codec.decode
        own = codec.schema.parsed
        #: Headers of records the lean readers walk: the codec's own version's fingerprints (a version's legacy
        #: one too), and none when that version is not the layout they were written for.
        self._headers = (codec.own_version_headers() if codec.schema.fingerprint == LAYOUT_FINGERPRINT
                         else frozenset())
        #: The Tier enum's symbols in index order, and how many AggregationMode symbols there are (from the
        #: schema, not restated here, so an index means what the codec reads it as).
        self._tiers = tuple(find_named_type(own, "kvstream.v1.Tier")["symbols"])
        self._aggregations = len(find_named_type(own, "kvstream.v1.AggregationMode")["symbols"])
        hotpath = choose(compiled)
        self._read_lean = _read_python if hotpath is None else hotpath.read_index_entry

    def read_lean(self, value: bytes) -> IndexEntry | None:
        """The lean read alone: :data:`IndexEntry` for a record of the codec's own version in single-object
        framing that the lean reader reads, else None (for the tests; :meth:`read_index_entry` then decodes)."""
        # type(): the compiled reader takes bytes, not a subclass
        if type(value) is not bytes or value[:SINGLE_OBJECT_HEADER_LEN] not in self._headers:
            return None
        try:
            return self._read_lean(value, SINGLE_OBJECT_HEADER_LEN, self._tiers, self._aggregations)
        except _REFUSALS:
            return None

    def read_index_entry(self, value: bytes) -> IndexEntry:
        """What the index keeps of one changelog value (not a tombstone: the feed handles empty values):
        ``(rows, parent_block_hash, content_hash)`` (:data:`IndexEntry`), exactly what :func:`index_entry_of` of
        the codec's decode gives.

        Raises:
            DecodeError: the codec's, for a value it cannot decode (unknown framing or fingerprint, a corrupt or
                truncated body, trailing bytes).
        """
        if type(value) is bytes and value[:SINGLE_OBJECT_HEADER_LEN] in self._headers:
            try:
                return self._read_lean(value, SINGLE_OBJECT_HEADER_LEN, self._tiers, self._aggregations)
            except _REFUSALS:
                pass  # the codec decodes it below and raises the DecodeError that names the fault
        return index_entry_of(self._decode(value))
