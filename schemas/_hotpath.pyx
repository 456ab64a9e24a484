# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""The compiled hot path: the worker's codecs that cost the most per event in Python.

- :func:`walk_items`: the item loop of :meth:`schemas.ownership_batch.OwnershipBatchReader._walk`;
- :func:`block_key` and :class:`BlockItemEncoder`: the repartition process's write of the items that walk reads
  (``stream_apps.residency.keys.block_key``, :meth:`schemas.block_event.BlockFieldsWriter.keyed_item`);
- :func:`rekey_block_events` and :class:`BlockBatch`: the repartition process's loop over a batch for the common
  block events, and the batches it writes them to (``stream_apps.repartition.Repartitioner._rekey_one``,
  ``stream_apps.repartition.batches.PartitionBatch``);
- :func:`read_program`: any schema's generated reader (:func:`schemas.fast_reader.compile_reader`): the codecs'
  decode of their own version's records (``kv_event`` in the repartition process, the batch messages' tables,
  residency entries where they are dicts);
- :func:`project_program`: the same programs as projections (:func:`schemas.fast_reader.compile_projection`): a
  record's named fields into a list, without its dicts (the repartition process's read of a block event);
- :func:`read_index_entry`: the fleet index's lean read of a residency entry
  (:class:`stream_apps.index.entry_reader.IndexEntryReader`): the rows' holders and the entry's parent and
  content hash, without the entry's dicts;
- :func:`json_query_token_ids` and :func:`json_token_bytes`: a ``POST /query``'s JSON ``token_ids`` array as
  little-endian u32 bytes, without a Python int per token (``stream_apps.index.api.read_json_query``).

The residency entry's own read, write and rules are compiled with the entry itself, as a record
(``stream_apps/residency/_record.pyx``). The Avro primitives both modules read and write with are in
``schemas/_avro.pxd``.

This module is optional. ``setup.py`` builds it with Cython when a C compiler is there; the pure-Python
versions are used when it is absent, or when ``KVSTREAM_PURE_PYTHON=1`` is set. Each function gives exactly
what its Python twin gives; where it refuses the bytes or the values, its caller hands them to the Python
twin, whose result or error is then the answer (the tests run both and compare them). ``boundscheck=False``:
every index into a tuple or list here is checked against its length first, by hand, or comes from a program
built by schemas.fast_reader.
"""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.unicode cimport PyUnicode_AsUTF8AndSize, PyUnicode_DecodeUTF8
from libc.stdint cimport INT64_MIN, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memchr, memcmp, memcpy

from schemas._avro cimport (
    Buffer,
    Cursor,
    _intern_table,
    _le,
    _open_buffer,
    _put,
    _read_branch,
    _read_bytes,
    _read_count,
    _read_double,
    _read_interned,
    _read_long,
    _read_string,
    _read_symbol,
    _skip_double,
    _skip_string,
)

# ---------------------------------------------------------------------------------------------------------
# The ownership_batch walk


#: The block fields this walk reads: name -> ``struct`` code. Their offsets come from the caller's layout
#: (``schemas.block_event.BLOCK_LAYOUT``), checked field by field against these codes (:func:`_use_layout`).
_BLOCK_CODES = {"kind": "B", "source": "H", "publisher_epoch": "q", "seq": "q", "batch_index": "i",
                "block_index": "i", "ts": "d", "tier": "B", "medium": "H", "locality": "H", "group": "I",
                "ownership": "H", "parent_known": "B", "has_content": "B", "content": "q", "parent_size": "B",
                "has_content_hash": "B", "content_hash": "q"}
_STRUCT_SIZES = {"B": 1, "H": 2, "I": 4, "i": 4, "q": 8, "d": 8}

cdef enum:
    F_KIND, F_SOURCE, F_EPOCH, F_SEQ, F_BATCH, F_BLOCK, F_TS, F_TIER, F_MEDIUM, F_LOCALITY, F_GROUP, F_OWNERSHIP, \
        F_KNOWN, F_HAS_CONTENT, F_CONTENT, F_PARENT_SIZE, F_HAS_CONTENT_HASH, F_CONTENT_HASH, F_COUNT

_FIELD_INDEX = {name: i for i, name in enumerate(_BLOCK_CODES)}
cdef Py_ssize_t _offsets[F_COUNT]
cdef Py_ssize_t _fields_size = 0
cdef object _layout_in_use = None


cdef int _use_layout(tuple layout) except -1:
    """Takes the offsets of the block fields from ``layout`` ((name, struct code) pairs, packed little-endian),
    once per layout object.

    Raises:
        ValueError: a field this walk reads is missing, or has another type than it reads (rebuild
            schemas/_hotpath.pyx after changing the layout's types), or the layout names a field it does not
            know (its bytes would be skipped unread).
    """
    global _fields_size, _layout_in_use
    cdef Py_ssize_t offset = 0
    seen = set()
    for name, code in layout:
        expected = _BLOCK_CODES.get(name)
        if expected is None:
            raise ValueError(f"block field {name!r} is not one the compiled walk reads: rebuild schemas/_hotpath.pyx")
        if code != expected:
            raise ValueError(f"block field {name!r} is {code!r} in the layout, {expected!r} in the compiled walk: "
                             "rebuild schemas/_hotpath.pyx")
        _offsets[_FIELD_INDEX[name]] = offset
        offset += _STRUCT_SIZES[code]
        seen.add(name)
    missing = set(_BLOCK_CODES) - seen
    if missing:
        raise ValueError(f"block fields {sorted(missing)} are missing from the layout")
    _fields_size = offset
    _layout_in_use = layout
    return 0


def check_block_layout(tuple layout not None):
    """The size in bytes of ``layout`` (``schemas.block_event.BLOCK_LAYOUT``) as this walk reads it.

    Raises:
        ValueError: as :func:`walk_items` for a layout it cannot read.
    """
    _use_layout(layout)
    return _fields_size


def walk_items(bytes data not None, Py_ssize_t pos, list items not None, list sources not None,
               tuple strings not None, tuple kinds not None, tuple tiers not None, tuple parent_known not None,
               read_event, clear_position, no_clear, tuple layout not None):
    """Append the items of an ``ownership_batch`` message's ``events`` array, which starts at ``pos``, to
    ``items`` (:data:`schemas.ownership_batch.BatchItem` tuples), as ``OwnershipBatchReader._walk`` does.

    ``sources`` and ``strings`` are the message's tables as the walk reads them (``strings`` with None first);
    ``kinds``, ``tiers`` and ``parent_known`` the layout's symbol tuples (:mod:`schemas.block_event`; a kind
    byte whose entry in ``kinds`` is None, the first layout's, is refused);
    ``read_event(data, start, end)`` reads an item without block fields; ``clear_position`` is
    :class:`schemas.clear_position.ClearPosition` and ``no_clear`` its ``NO_CLEAR``; ``layout`` is
    ``schemas.block_event.BLOCK_LAYOUT``, whose fields' offsets the walk reads (checked once per layout object).

    Returns:
        The position after the array (the caller checks it is the message's end).

    Raises:
        IndexError, ValueError (UnicodeDecodeError included): a message this walk does not read; the caller
        then decodes it with its codec.
    """
    if layout is not _layout_in_use:
        _use_layout(layout)
    cdef Py_ssize_t fields_size = _fields_size
    cdef const Py_ssize_t* off = _offsets
    cdef Cursor cursor
    cdef Cursor* c = &cursor
    c.data = <const uint8_t*>PyBytes_AS_STRING(data)
    c.size = PyBytes_GET_SIZE(data)
    if pos < 0 or pos > c.size:
        raise IndexError("start outside the message")
    c.pos = pos
    cdef int64_t count, n, i, epoch, seq, index
    cdef Py_ssize_t start, end, fields, parent_end
    cdef const uint8_t* p
    cdef uint8_t b
    cdef int64_t f_epoch, f_seq, content, content_hash
    cdef int32_t f_batch, f_block
    cdef uint32_t group
    cdef double ts
    cdef uint64_t bits
    cdef Py_ssize_t kind, source, tier, medium, locality, ownership, known, n_sources, n_strings, parent_size
    cdef object key, mark, kind_name, parent
    n_sources = len(sources)
    n_strings = len(strings)
    while True:
        count = _read_long(c)
        if count == 0:
            break
        if count < 0:  # a block that gives its byte size, which a one-pass reader does not need
            if count == INT64_MIN:  # -count would stay negative; Python reads 2**63 items and runs out of bytes
                raise ValueError("array block count out of range")
            count = -count
            _read_long(c)
        for i in range(count):
            n = _read_long(c)
            if n < 0 or n > c.size - c.pos:  # not c.pos + n: a length near 2**63 would wrap past the check
                raise ValueError("bad key length")
            end = c.pos + n
            key = PyUnicode_DecodeUTF8(<const char*>c.data + c.pos, n, NULL)
            if end >= c.size:
                raise IndexError("clear_mark past the end of the message")
            b = c.data[end]
            c.pos = end + 1
            if b == 0:
                mark = no_clear
            elif b == 2:
                epoch = _read_long(c)
                seq = _read_long(c)
                index = _read_long(c)
                mark = tuple.__new__(clear_position, (epoch, seq, index))
            else:
                raise ValueError("clear_mark union index")
            n = _read_long(c)
            start = c.pos
            if n < 0 or n > c.size - start:
                raise ValueError("bad event length")
            end = start + n
            c.pos = end
            if c.pos >= c.size:
                raise IndexError("block past the end of the message")
            b = c.data[c.pos]
            c.pos += 1
            if b == 0:
                items.append((key, mark, data, start, end, read_event(data, start, end)))
                continue
            if b != 2:
                raise ValueError("block union index")
            n = _read_long(c)
            fields = c.pos + fields_size
            if n < fields_size or n > c.size - c.pos:
                raise ValueError("bad block length")
            p = c.data + c.pos
            kind = p[off[F_KIND]]
            source = <Py_ssize_t>_le(p + off[F_SOURCE], 2)
            f_epoch = <int64_t>_le(p + off[F_EPOCH], 8)
            f_seq = <int64_t>_le(p + off[F_SEQ], 8)
            f_batch = <int32_t>_le(p + off[F_BATCH], 4)
            f_block = <int32_t>_le(p + off[F_BLOCK], 4)
            bits = _le(p + off[F_TS], 8)
            memcpy(&ts, &bits, 8)  # the double's bits, read as the little-endian integer they are
            tier = p[off[F_TIER]]
            medium = <Py_ssize_t>_le(p + off[F_MEDIUM], 2)
            locality = <Py_ssize_t>_le(p + off[F_LOCALITY], 2)
            group = <uint32_t>_le(p + off[F_GROUP], 4)
            ownership = <Py_ssize_t>_le(p + off[F_OWNERSHIP], 2)
            known = p[off[F_KNOWN]]
            content = <int64_t>_le(p + off[F_CONTENT], 8)
            parent_size = p[off[F_PARENT_SIZE]]
            content_hash = <int64_t>_le(p + off[F_CONTENT_HASH], 8)
            if (kind >= len(kinds) or source >= n_sources or tier >= len(tiers) or medium >= n_strings
                    or locality >= n_strings or ownership >= n_strings or known >= len(parent_known)):
                raise IndexError("a block field's index is outside its table")
            kind_name = kinds[kind]
            if kind_name is None:
                raise ValueError("block fields of the first layout")
            c.pos += n
            if parent_size:
                parent_end = fields + parent_size - 1
                if parent_end > c.pos:
                    raise ValueError("parent block hash past the block fields")
                parent = PyBytes_FromStringAndSize(<const char*>c.data + fields, parent_end - fields)
            else:
                parent, parent_end = None, fields
            items.append((key, mark, data, start, end, (
                kind_name, sources[source], f_epoch, f_seq, f_batch, f_block, ts,
                PyBytes_FromStringAndSize(<const char*>c.data + parent_end, c.pos - parent_end),
                tiers[tier], strings[medium], strings[locality], (group - 1) if group else None, strings[ownership],
                parent_known[known], content if p[off[F_HAS_CONTENT]] else None, parent,
                content_hash if p[off[F_HAS_CONTENT_HASH]] else None)))
    return c.pos


# ---------------------------------------------------------------------------------------------------------
# The repartition stage's keyed items (the write side of the walk above)


cdef uint32_t _murmur2(const uint8_t* data, Py_ssize_t length) noexcept:
    """Kafka's murmur2 (``org.apache.kafka.common.utils.Utils.murmur2``, seed 0x9747b28c): what Kafka's default
    partitioner and Faust's router hash a key with."""
    cdef uint32_t m = 0x5BD1E995
    cdef uint32_t h = 0x9747B28C
    cdef uint32_t k
    cdef Py_ssize_t i, whole = length & ~(<Py_ssize_t>3)
    h ^= <uint32_t>length
    for i in range(0, whole, 4):
        k = data[i] | (<uint32_t>data[i + 1] << 8) | (<uint32_t>data[i + 2] << 16) | (<uint32_t>data[i + 3] << 24)
        k *= m
        k ^= k >> 24
        k *= m
        h *= m
        h ^= k
    i = length & 3
    if i == 3:
        h ^= <uint32_t>data[whole + 2] << 16
    if i >= 2:
        h ^= <uint32_t>data[whole + 1] << 8
    if i >= 1:
        h ^= data[whole]
        h *= m
    h ^= h >> 13
    h *= m
    h ^= h >> 15
    return h


cdef const char* _HEX = b"0123456789abcdef"


def block_key(ownership, bytes block_hash not None, Py_ssize_t partitions):
    """:func:`_block_key` (the Python name)."""
    return _block_key(ownership, block_hash, partitions)


cdef tuple _block_key(object ownership, bytes block_hash, Py_ssize_t partitions):
    """``(partition, key)`` of a block event, as ``stream_apps.residency.keys.block_key`` gives them: the residency
    key ``<ownership or 'primary'>/<block hash hex>`` in UTF-8 and its partition of ``partitions`` by Kafka's
    murmur2 (positive, then modulo).

    Raises:
        TypeError: ``ownership`` is neither None nor a str. ValueError: ``partitions`` is not positive.
    """
    cdef const char* prefix = b"primary"
    cdef Py_ssize_t prefix_size = 7
    cdef Py_ssize_t hash_size = PyBytes_GET_SIZE(block_hash)
    cdef Py_ssize_t i
    cdef const uint8_t* raw = <const uint8_t*>PyBytes_AS_STRING(block_hash)
    cdef char* out
    if partitions <= 0:
        raise ValueError("partitions must be positive")
    if ownership is not None:
        if type(ownership) is not str:
            raise TypeError(f"ownership is {type(ownership).__name__}, not str")
        if ownership:  # the empty string is the framework's own, as None (``ownership or 'primary'``)
            prefix = PyUnicode_AsUTF8AndSize(ownership, &prefix_size)
    key = PyBytes_FromStringAndSize(NULL, prefix_size + 1 + 2 * hash_size)
    out = PyBytes_AS_STRING(key)
    memcpy(out, prefix, prefix_size)
    out[prefix_size] = b"/"
    out += prefix_size + 1
    for i in range(hash_size):
        out[2 * i] = _HEX[raw[i] >> 4]
        out[2 * i + 1] = _HEX[raw[i] & 15]
    return (_murmur2(<const uint8_t*>PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key)) & 0x7FFFFFFF) % partitions, key


cdef inline Py_ssize_t _long_size(int64_t value) noexcept:
    """Bytes of an Avro long (zig-zag varint)."""
    cdef uint64_t n = (<uint64_t>value << 1) ^ <uint64_t>(value >> 63)
    cdef Py_ssize_t size = 1
    while n > 0x7F:
        n >>= 7
        size += 1
    return size


cdef inline char* _write_long(char* p, int64_t value) noexcept:
    cdef uint64_t n = (<uint64_t>value << 1) ^ <uint64_t>(value >> 63)
    while n > 0x7F:
        p[0] = <char>((n & 0x7F) | 0x80)
        p += 1
        n >>= 7
    p[0] = <char>n
    return p + 1


cdef inline void _write_le(char* p, uint64_t value, int size) noexcept:
    cdef int i
    for i in range(size):
        p[i] = <char>((value >> (8 * i)) & 0xFF)


#: Route fields the encoder reads (schemas.block_event.ROUTE_FIELDS' order; checked by BlockItemEncoder).
cdef enum:
    R_KIND, R_INSTANCE, R_DP_RANK, R_WORKER_RANK, R_WORLD_SIZE, R_AGGREGATION, R_EPOCH, R_SEQ, R_BATCH_INDEX, \
        R_BLOCK_INDEX, R_TS, R_BLOCK_HASH, R_TIER, R_MEDIUM, R_LOCALITY, R_GROUP_IDX, R_OWNERSHIP, R_PARENT_KNOWN, \
        R_PARENT, R_CONTENT_HASH, R_REPORT_MODE, R_COUNT

_ROUTE_NAMES = ("event", "instance_id", "data_parallel_rank", "worker_rank", "world_size", "aggregation",
                "publisher_epoch", "seq", "batch_index", "block_index", "ts", "block_hash", "tier", "medium",
                "locality", "group_idx", "ownership", "parent_known", "parent_block_hash", "content_hash",
                "report_mode")


cdef inline bint _is_long(object value) noexcept:
    return type(value) is int and -0x8000000000000000 <= value <= 0x7FFFFFFFFFFFFFFF


cdef inline bint _is_int32(object value) noexcept:
    return type(value) is int and -0x80000000 <= value <= 0x7FFFFFFF


cdef class BlockItemEncoder:
    """The compiled twin of ``schemas.block_event.BlockFieldsWriter.keyed_item``: one ``KeyedEvent`` with its block
    fields in ``layout`` (``schemas.block_event.BLOCK_LAYOUT``, the walk's), the message's tables kept in the
    writer's dicts exactly as the Python writer keeps them.

    Args:
        layout: ``BLOCK_LAYOUT`` (its offsets are taken as :func:`walk_items` takes them).
        route_fields: ``schemas.block_event.ROUTE_FIELDS``, checked against the order this encoder reads.
        kind_index, tier_index: kind -> layout kind byte, tier -> tier byte (``schemas.block_event``).
        stored, stored_or_reused, full_report_mode: ``schemas.BLOCK_STORED``, ``BLOCK_STORED_OR_REUSED`` and
            ``FULL_REPORT_MODE`` (a store in full report mode is written as ``stored_or_reused``).
        max_table: the largest index a table reference holds.

    Raises:
        ValueError: the layout or the route fields are not those this module was built for.
    """

    cdef Py_ssize_t offsets[F_COUNT]
    cdef Py_ssize_t fields_size
    cdef dict kind_index, tier_index
    cdef object stored, stored_or_reused, full_report_mode
    cdef Py_ssize_t max_table

    def __init__(self, tuple layout not None, tuple route_fields not None, dict kind_index not None,
                 dict tier_index not None, stored, stored_or_reused, full_report_mode, Py_ssize_t max_table):
        cdef int i
        if route_fields != _ROUTE_NAMES:
            raise ValueError("the route fields are not those schemas/_hotpath.pyx reads: rebuild it")
        _use_layout(layout)
        for i in range(F_COUNT):
            self.offsets[i] = _offsets[i]
        self.fields_size = _fields_size
        self.kind_index, self.tier_index = kind_index, tier_index
        self.stored, self.stored_or_reused, self.full_report_mode = stored, stored_or_reused, full_report_mode
        self.max_table = max_table

    def item(self, dict sources not None, dict strings not None, bytes key not None, bytes mark not None,
             bytes value not None, list route not None, content):
        """:meth:`encode` (the Python name)."""
        return self.encode(sources, strings, key, mark, value, route, content)

    cdef tuple encode(self, dict sources, dict strings, bytes key, bytes mark, bytes value, list route, content):
        """``(item, table bytes added)``: the ``KeyedEvent`` (Avro binary) of a block event's ``route`` (a list of
        the route fields) with key ``key`` (UTF-8), clear mark ``mark`` and record ``value``, and its block fields,
        having added its source and strings to ``sources`` and ``strings`` as ``BlockFieldsWriter.block_of``
        does. None, with nothing added: a value this encoder leaves to the Python writer (a type or a range the
        layout does not hold, a table nearly full), whose answer is then the item."""
        cdef Py_ssize_t medium_index, locality_index, ownership_index, source_index, added = 0
        cdef Py_ssize_t parent_size = 0, hash_size, block_size, n, item_size
        cdef char* p
        cdef char* fields
        cdef const Py_ssize_t* off = self.offsets
        cdef double ts
        cdef uint64_t ts_bits
        if len(route) != R_COUNT:
            return None
        kind = route[R_KIND]
        if kind == self.stored:
            if route[R_REPORT_MODE] == self.full_report_mode:
                kind = self.stored_or_reused
            parent, content_hash = route[R_PARENT], route[R_CONTENT_HASH]
        else:
            parent = content_hash = None
        kind_byte = self.kind_index.get(kind)
        tier_byte = self.tier_index.get(route[R_TIER])
        group = route[R_GROUP_IDX]
        instance, aggregation, block_hash = route[R_INSTANCE], route[R_AGGREGATION], route[R_BLOCK_HASH]
        medium, locality, ownership = route[R_MEDIUM], route[R_LOCALITY], route[R_OWNERSHIP]
        known = route[R_PARENT_KNOWN]
        # Everything the Python writer could refuse or raise on is checked before anything is added
        if (kind_byte is None or tier_byte is None or type(route[R_TS]) is not float
                or not (_is_long(route[R_EPOCH]) and _is_long(route[R_SEQ]) and _is_int32(route[R_BATCH_INDEX])
                        and _is_int32(route[R_BLOCK_INDEX]))
                or not (group is None or (type(group) is int and 0 <= group <= 0xFFFFFFFE))
                or not (content is None or _is_long(content))
                or not (content_hash is None or _is_long(content_hash))
                or not (parent is None or (type(parent) is bytes and PyBytes_GET_SIZE(parent) <= 254))
                or type(block_hash) is not bytes or type(instance) is not str
                or not (aggregation is None or type(aggregation) is str)
                or not (medium is None or type(medium) is str) or not (locality is None or type(locality) is str)
                or not (ownership is None or type(ownership) is str)
                or not (known is None or known is True or known is False)
                or len(strings) > self.max_table - 3 or len(sources) > self.max_table - 1):
            return None
        source = (instance, route[R_DP_RANK], route[R_WORKER_RANK], route[R_WORLD_SIZE], aggregation)
        found = sources.get(source)
        if found is None:
            source_index = len(sources)
            sources[source] = source_index
            PyUnicode_AsUTF8AndSize(instance, &n)
            added += _long_size(n) + n + (0 if aggregation is None else len(<str>aggregation)) + 40
        else:
            source_index = found
        medium_index = self._string(strings, medium, &added)
        locality_index = self._string(strings, locality, &added)
        ownership_index = self._string(strings, ownership, &added)
        if parent is not None:
            parent_size = PyBytes_GET_SIZE(parent)
        hash_size = PyBytes_GET_SIZE(block_hash)
        block_size = self.fields_size + parent_size + hash_size
        item_size = (_long_size(PyBytes_GET_SIZE(key)) + PyBytes_GET_SIZE(key) + PyBytes_GET_SIZE(mark)
                     + _long_size(PyBytes_GET_SIZE(value)) + PyBytes_GET_SIZE(value) + 1 + _long_size(block_size)
                     + block_size)
        item = PyBytes_FromStringAndSize(NULL, item_size)
        p = PyBytes_AS_STRING(item)
        p = _write_long(p, PyBytes_GET_SIZE(key))
        memcpy(p, PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key))
        p += PyBytes_GET_SIZE(key)
        memcpy(p, PyBytes_AS_STRING(mark), PyBytes_GET_SIZE(mark))
        p += PyBytes_GET_SIZE(mark)
        p = _write_long(p, PyBytes_GET_SIZE(value))
        memcpy(p, PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value))
        p += PyBytes_GET_SIZE(value)
        p[0] = 2  # the union's second branch: block fields follow
        p = _write_long(p + 1, block_size)
        fields = p
        _write_le(fields + off[F_KIND], <int64_t>kind_byte, 1)
        _write_le(fields + off[F_SOURCE], source_index, 2)
        _write_le(fields + off[F_EPOCH], <int64_t>route[R_EPOCH], 8)
        _write_le(fields + off[F_SEQ], <int64_t>route[R_SEQ], 8)
        _write_le(fields + off[F_BATCH], <int64_t>route[R_BATCH_INDEX], 4)
        _write_le(fields + off[F_BLOCK], <int64_t>route[R_BLOCK_INDEX], 4)
        ts = route[R_TS]
        memcpy(&ts_bits, &ts, 8)
        _write_le(fields + off[F_TS], ts_bits, 8)
        _write_le(fields + off[F_TIER], <int64_t>tier_byte, 1)
        _write_le(fields + off[F_MEDIUM], medium_index, 2)
        _write_le(fields + off[F_LOCALITY], locality_index, 2)
        _write_le(fields + off[F_GROUP], 0 if group is None else <int64_t>group + 1, 4)
        _write_le(fields + off[F_OWNERSHIP], ownership_index, 2)
        _write_le(fields + off[F_KNOWN], 0 if known is None else (2 if known else 1), 1)
        _write_le(fields + off[F_HAS_CONTENT], content is not None, 1)
        _write_le(fields + off[F_CONTENT], 0 if content is None else <int64_t>content, 8)
        _write_le(fields + off[F_PARENT_SIZE], 0 if parent is None else parent_size + 1, 1)
        _write_le(fields + off[F_HAS_CONTENT_HASH], content_hash is not None, 1)
        _write_le(fields + off[F_CONTENT_HASH], 0 if content_hash is None else <int64_t>content_hash, 8)
        p = fields + self.fields_size
        if parent_size:
            memcpy(p, PyBytes_AS_STRING(parent), parent_size)
            p += parent_size
        memcpy(p, PyBytes_AS_STRING(block_hash), hash_size)
        return item, added

    cdef Py_ssize_t _string(self, dict strings, object value, Py_ssize_t* added) except -1:
        """``value``'s index in the strings table plus one (0: None), added to it as the Python writer adds it."""
        cdef Py_ssize_t n, size
        if value is None:
            return 0
        found = strings.get(value)
        if found is not None:
            return found
        n = len(strings) + 1
        strings[value] = n
        PyUnicode_AsUTF8AndSize(value, &size)
        added[0] += _long_size(size) + size
        return n


# ---------------------------------------------------------------------------------------------------------
# Reading values of a schema


# The programs of schemas.fast_reader.compile_program

# the operation numbers of schemas.fast_reader (OP_NULL ... OP_UNION), in its order: OPERATIONS below
cdef enum:
    OP_NULL, OP_BOOLEAN, OP_LONG, OP_FLOAT, OP_DOUBLE, OP_STRING, OP_BYTES, OP_ENUM, OP_ARRAY, OP_RECORD, OP_UNION,
    OP_PROJECT_RECORD, OP_PROJECT_UNION


@cython.boundscheck(True)  # a program is trusted (compile_program builds it), but read_program is public
cdef object _run(tuple program, Cursor* c):
    cdef int op = program[0]
    cdef int64_t index, count
    cdef uint32_t bits32
    cdef float single
    cdef uint8_t byte
    cdef tuple symbols, names, fields, branches, branch
    cdef list items
    cdef dict record
    cdef Py_ssize_t i
    if op == OP_LONG:
        return _read_long(c)
    if op == OP_STRING:
        return _read_string(c)
    if op == OP_UNION:
        branches = <tuple?>program[1]
        index = _read_long(c)
        if not 0 <= index < len(branches):
            raise ValueError(f"union branch {index} at {c.pos}")
        branch = <tuple?>branches[index]
        value = _run(<tuple?>branch[0], c)
        name = branch[1]
        return value if name is None else (name, value)
    if op == OP_NULL:
        return None
    if op == OP_RECORD:
        names = <tuple?>program[1]
        fields = <tuple?>program[2]
        record = {}
        for i in range(len(names)):
            record[names[i]] = _run(<tuple?>fields[i], c)
        return record
    if op == OP_DOUBLE:
        return _read_double(c)
    if op == OP_BYTES:
        return _read_bytes(c)
    if op == OP_ENUM:
        return _read_symbol(c, <tuple?>program[1])
    if op == OP_ARRAY:
        items = []
        while True:
            count = _read_count(c)
            if count == 0:
                return items
            while count:
                count -= 1
                items.append(_run(<tuple?>program[1], c))
    if op == OP_BOOLEAN:
        if c.pos >= c.size:
            raise IndexError("boolean past the end")
        byte = c.data[c.pos]
        c.pos += 1
        if byte > 1:
            raise ValueError(f"boolean byte {byte} at {c.pos - 1}")
        return byte == 1
    if op == OP_FLOAT:
        if c.pos + 4 > c.size:
            raise IndexError("float past the end")
        bits32 = <uint32_t>_le(c.data + c.pos, 4)
        memcpy(&single, &bits32, 4)
        c.pos += 4
        return <double>single
    raise ValueError(f"unknown reader operation {op}")


def read_program(tuple program not None, bytes data not None, Py_ssize_t pos):
    """``(value, position after it)`` of the value at ``pos`` in ``data``, read by ``program``
    (:func:`schemas.fast_reader.compile_program`): what the generated reader of the same schema gives.

    Raises:
        ValueError (UnicodeDecodeError included), IndexError: bytes that are not a value of the schema; the
        caller then has the generated reader name the fault.
    """
    cdef Cursor cursor
    cdef Cursor* c = &cursor
    if pos < 0 or pos > PyBytes_GET_SIZE(data):
        raise IndexError("start outside the data")
    c.data = <const uint8_t*>PyBytes_AS_STRING(data)
    c.size = PyBytes_GET_SIZE(data)
    c.pos = pos
    value = _run(program, c)
    return value, c.pos


@cython.boundscheck(True)
cdef int _skip(tuple program, Cursor* c) except -1:
    """Past the value ``program`` reads, refusing what :func:`_run` refuses, building nothing."""
    cdef int op = program[0]
    cdef int64_t index, count
    cdef tuple branches, fields
    cdef Py_ssize_t i
    if op == OP_LONG:
        _read_long(c)
    elif op == OP_STRING:
        _skip_string(c)
    elif op == OP_UNION:
        branches = <tuple?>program[1]
        index = _read_long(c)
        if not 0 <= index < len(branches):
            raise ValueError(f"union branch {index} at {c.pos}")
        _skip(<tuple?>(<tuple?>branches[index])[0], c)
    elif op == OP_RECORD:
        fields = <tuple?>program[2]
        for i in range(len(fields)):
            _skip(<tuple?>fields[i], c)
    elif op == OP_DOUBLE:
        _skip_double(c)
    elif op == OP_BYTES:
        count = _read_long(c)
        if count < 0 or count > c.size - c.pos:
            raise ValueError(f"bad length {count} at {c.pos}")
        c.pos += count
    elif op == OP_ENUM:
        _read_symbol(c, <tuple?>program[1])
    elif op == OP_ARRAY:
        while True:
            count = _read_count(c)
            if count == 0:
                break
            while count:
                count -= 1
                _skip(<tuple?>program[1], c)
    elif op == OP_BOOLEAN:
        if c.pos >= c.size:
            raise IndexError("boolean past the end")
        if c.data[c.pos] > 1:
            raise ValueError(f"boolean byte {c.data[c.pos]} at {c.pos}")
        c.pos += 1
    elif op == OP_FLOAT:
        if c.pos + 4 > c.size:
            raise IndexError("float past the end")
        c.pos += 4
    elif op != OP_NULL:
        raise ValueError(f"unknown reader operation {op}")
    return 0


@cython.boundscheck(True)
cdef int _project(tuple program, Cursor* c, list out) except -1:
    """Run a projection program (:func:`schemas.fast_reader.compile_projection`) at the cursor into ``out``."""
    cdef tuple slots = <tuple?>program[1]
    cdef tuple fields = <tuple?>program[2]
    cdef tuple field, branches, branch
    cdef Py_ssize_t i, slot
    cdef int op
    cdef int64_t index
    for i in range(len(fields)):
        field = <tuple?>fields[i]
        slot = slots[i]
        op = field[0]
        if op == OP_PROJECT_RECORD:
            _project(field, c, out)
        elif op == OP_PROJECT_UNION:
            branches = <tuple?>field[1]
            index = _read_long(c)
            if not 0 <= index < len(branches):
                raise ValueError(f"union branch {index} at {c.pos}")
            branch = <tuple?>branches[index]
            if (<tuple?>branch[0])[0] == OP_PROJECT_RECORD:
                if branch[1] is not None and slot >= 0:
                    out[slot] = branch[1]
                _project(<tuple?>branch[0], c, out)
            elif slot >= 0:
                out[slot] = _run(<tuple?>branch[0], c)
            else:
                _skip(<tuple?>branch[0], c)
        elif slot >= 0:
            out[slot] = _run(field, c)
        else:
            _skip(field, c)
    return 0


def project_program(tuple program not None, Py_ssize_t size, bytes data not None, Py_ssize_t pos):
    """``(values, position after the record)`` of the record at ``pos`` in ``data``, read by the projection
    ``program`` (:func:`schemas.fast_reader.compile_projection`) into a list of ``size`` values: what
    :func:`schemas.fast_reader.project` takes from the record the reader of the same schema gives.

    Raises:
        ValueError (UnicodeDecodeError included), IndexError: bytes that are not a record of the schema (the
        caller then reads them with the reader, which names the fault); a ``size`` too small for a slot.
    """
    cdef Cursor cursor
    cdef Cursor* c = &cursor
    if pos < 0 or pos > PyBytes_GET_SIZE(data):
        raise IndexError("start outside the data")
    if program[0] != OP_PROJECT_RECORD:
        raise ValueError("not a projection program")
    c.data = <const uint8_t*>PyBytes_AS_STRING(data)
    c.size = PyBytes_GET_SIZE(data)
    c.pos = pos
    out = [None] * size
    _project(program, c, out)
    return out, c.pos


cdef class FramedProjection:
    """``projection(data)``: :func:`project_program`'s values of a whole framed record, or None when it is not a
    whole valid record of the program's version: what ``schemas.codec.AvroCodec.own_version_projection`` returns,
    with the framing checked here for the single-object headers.

    Args:
        program, size: as :func:`project_program` takes them.
        headers: the single-object headers (10 bytes each) whose records the program reads; their body starts
            after them.
        body_of: ``body_of(data)`` for a record with none of them: where its body starts (a registry-framed
            record's, once its id is resolved), or 0 for a record of another version.
    """

    cdef tuple program
    cdef Py_ssize_t size
    cdef tuple headers
    cdef object body_of

    def __init__(self, tuple program not None, Py_ssize_t size, headers, body_of):
        if program[0] != OP_PROJECT_RECORD:
            raise ValueError("not a projection program")
        self.headers = tuple(headers)
        for header in self.headers:
            if type(header) is not bytes or PyBytes_GET_SIZE(header) != 10:
                raise ValueError("a single-object header is 10 bytes")
        self.program, self.size, self.body_of = program, size, body_of

    def __call__(self, bytes data not None):
        return self.read(data)

    cdef list read(self, bytes data):
        cdef Cursor cursor
        cdef Cursor* c = &cursor
        cdef Py_ssize_t body = 0
        cdef const char* raw = PyBytes_AS_STRING(data)
        if PyBytes_GET_SIZE(data) >= 10:
            for header in self.headers:
                if memcmp(raw, PyBytes_AS_STRING(<bytes>header), 10) == 0:
                    body = 10
                    break
        if not body:
            body = self.body_of(data)
            if not (0 < body <= PyBytes_GET_SIZE(data)):
                return None
        c.data = <const uint8_t*>raw
        c.size = PyBytes_GET_SIZE(data)
        c.pos = body
        out = [None] * self.size
        try:
            _project(self.program, c, out)
        except (ValueError, IndexError):  # UnicodeDecodeError is a ValueError
            return None
        return out if c.pos == c.size else None


#: The operation numbers above, in order, for the test that compares them with schemas.fast_reader's.
OPERATIONS = (OP_NULL, OP_BOOLEAN, OP_LONG, OP_FLOAT, OP_DOUBLE, OP_STRING, OP_BYTES, OP_ENUM, OP_ARRAY, OP_RECORD,
              OP_UNION, OP_PROJECT_RECORD, OP_PROJECT_UNION)


# ---------------------------------------------------------------------------------------------------------
# The repartition process's loop over a batch of kv-events messages


cdef class BlockBatch:
    """The compiled twin of ``stream_apps.repartition.batches.PartitionBatch`` (same methods, same messages): the
    ``ownership_batch`` messages of one destination partition in one batch, each at most ``max_bytes``.

    Args:
        writer_type: ``schemas.block_event.BlockFieldsWriter``: one per message, which keeps the message's tables
            and answers for the items the encoder leaves to Python.
        encoder: the :class:`BlockItemEncoder` of the items.
        encode_item: ``schemas.avro_writers.encode_keyed_event`` (items without block fields).
        max_bytes, item_overhead: ``MAX_BATCH_BYTES`` and ``_ITEM_OVERHEAD`` of the Python batch.
    """

    cdef object writer_type, writer, encode_item
    cdef BlockItemEncoder encoder
    cdef dict sources, strings
    cdef list done, items
    cdef Py_ssize_t size, max_bytes, item_overhead

    def __init__(self, writer_type, BlockItemEncoder encoder not None, encode_item, Py_ssize_t max_bytes,
                 Py_ssize_t item_overhead):
        self.writer_type, self.encoder, self.encode_item = writer_type, encoder, encode_item
        self.max_bytes, self.item_overhead = max_bytes, item_overhead
        self.done = []
        self._start()

    cdef int _start(self) except -1:
        self.writer = self.writer_type(False)  # the Python writer: the encoder here is this batch's
        self.sources, self.strings = self.writer._sources, self.writer._strings
        self.items = []
        self.size = 0
        return 0

    cdef int _room(self, Py_ssize_t extra) except -1:
        """As ``PartitionBatch._room``: a new message unless this one holds ``extra`` more bytes and its tables."""
        cdef Py_ssize_t table_bytes
        if self.items:
            table_bytes = self.writer.table_bytes
            if self.size + table_bytes + extra + self.item_overhead > self.max_bytes:
                self.done.append((self.writer.tables(), self.items))
                self._start()
        return 0

    def add(self, key, bytes mark not None, bytes value not None):
        """One item without block fields (``PartitionBatch.add``)."""
        self._room(2 * PyBytes_GET_SIZE(value) + len(key) + PyBytes_GET_SIZE(mark))
        item = self.encode_item(key, mark, value)
        self.items.append(item)
        self.size += len(item)

    def add_block(self, bytes key not None, bytes mark not None, bytes value not None, list route not None,
                  content=None):
        """One block event's item (``PartitionBatch.add_block``)."""
        self._add_block(key, mark, value, route, content)

    cdef int _add_block(self, bytes key, bytes mark, bytes value, list route, content) except -1:
        if self.encoder is None:  # a batch whose __init__ did not run: its cdef calls below would crash
            raise TypeError("BlockBatch is not initialised")
        self._room(2 * PyBytes_GET_SIZE(value) + PyBytes_GET_SIZE(key) + PyBytes_GET_SIZE(mark))
        done = self.encoder.encode(self.sources, self.strings, key, mark, value, route, content)
        if done is None:
            item = self.writer.keyed_item(key, mark, value, route, content)
        else:
            item = done[0]
            self.writer.table_bytes += done[1]
        self.items.append(item)
        self.size += PyBytes_GET_SIZE(item)
        return 0

    def messages(self):
        """``(tables, encoded items)`` of each message, in order (``PartitionBatch.messages``)."""
        return [*self.done, (self.writer.tables(), self.items)] if self.items else self.done


def rekey_block_events(list messages not None, FramedProjection project not None, dict histories not None,
                       Py_ssize_t partitions, aggregation, outgoing, dict next_offsets not None, settle_store,
                       rekey_one, removed, stored):
    """Re-key a batch of ``kv-events`` messages as ``stream_apps.repartition.Repartitioner`` does one by one
    (``_rekey_one``, the reference), in C for the common case: a block event of the projection's version, which
    ``project`` reads whole, with its block hash and tier, and whose store ``settle_store`` settles.

    Every other message (an error, another version, a source-wide event, what the projection refuses) goes to
    ``rekey_one(message)`` whole, which then does everything for it, as it does for every message without the
    compiled module. ``outgoing`` maps a destination partition to its :class:`BlockBatch` (a ``defaultdict``);
    ``next_offsets`` gets each kv-events partition's offset after its last message; ``removed`` and ``stored``
    are ``schemas.BLOCK_REMOVED`` and ``schemas.BLOCK_STORED``.
    """
    cdef list route
    cdef BlockBatch batch
    if project.size < R_COUNT:
        raise ValueError("not the projection of the route fields")
    for message in messages:
        if message.error():
            rekey_one(message)
            continue
        value = message.value()
        route = project.read(value) if type(value) is bytes and value else None
        if route is None:
            rekey_one(message)
            continue
        kind = route[R_KIND]
        if not (kind == stored or kind == removed) or route[R_BLOCK_HASH] is None or route[R_TIER] is None:
            rekey_one(message)
            continue
        content = None
        if kind == stored and (route[R_CONTENT_HASH] is None or route[R_WORLD_SIZE]
                               or route[R_INSTANCE] in aggregation):
            try:
                settled, content = settle_store(route, value)
            except Exception:  # rekey_one does it again, and answers for it as without this loop
                settled = False
            if not settled:
                rekey_one(message)
                continue
        partition, offset = message.partition(), message.offset()
        next_offsets[partition] = offset + 1
        history = histories.get((partition, route[R_INSTANCE], route[R_DP_RANK]))
        destination, key = _block_key(route[R_OWNERSHIP], route[R_BLOCK_HASH], partitions)
        mark = b"\x00" if history is None else history.encoded_mark_before(offset)
        batch = outgoing[destination]
        batch._add_block(key, mark, value, route, content)


# ---------------------------------------------------------------------------------------------------------
# The replica content digest's text


cdef int _put_repr(Buffer* out, object value) except -1:
    """``repr(value)`` in UTF-8, as ``str.encode`` gives it."""
    cdef Py_ssize_t n
    cdef const char* utf8
    text = repr(value)
    utf8 = PyUnicode_AsUTF8AndSize(text, &n)
    _put(out, utf8, n)
    return 0


cdef int _put_int_list_repr(Buffer* out, list values) except -1:
    """``repr(values)`` of a list, each int of 64 bits written here in decimal (any other item by ``repr``)."""
    cdef Py_ssize_t i = 0
    cdef int64_t number
    cdef uint64_t magnitude
    cdef char digits[20]
    cdef int count
    cdef int overflow
    _put(out, "[", 1)
    while i < len(values):  # checked each time: an item's repr could change the list
        if i:
            _put(out, ", ", 2)
        item = values[i]
        i += 1
        if type(item) is not int:
            _put_repr(out, item)
            continue
        number = PyLong_AsLongLongAndOverflow(item, &overflow)
        if overflow:
            _put_repr(out, item)
            continue
        if number < 0:
            _put(out, "-", 1)
            magnitude = <uint64_t>0 - <uint64_t>number
        else:
            magnitude = <uint64_t>number
        count = 0
        while True:
            digits[19 - count] = <char>(48 + magnitude % 10)
            count += 1
            magnitude //= 10
            if magnitude == 0:
                break
        _put(out, digits + 20 - count, count)
    _put(out, "]", 1)
    return 0


def repr_utf8(tuple values not None):
    """``repr(values).encode()`` of a tuple, its lists written without a Python string per int: the text of
    ``stream_apps.residency.content_digest`` (a store's token ids are a list of 16 to 512 ints, whose ``repr``
    was most of the digest's cost). Any item that is not a list, and any list item that is not an int of 64 bits,
    is written by ``repr`` itself. A list that holds itself is written one level deeper than ``repr`` writes it
    (no agreement field holds one)."""
    cdef Buffer out
    cdef Py_ssize_t i, n = len(values)
    _open_buffer(&out, 1024)
    try:
        _put(&out, "(", 1)
        for i in range(n):
            if i:
                _put(&out, ", ", 2)
            item = values[i]
            if type(item) is list:
                _put_int_list_repr(&out, <list>item)
            else:
                _put_repr(&out, item)
        if n == 1:
            _put(&out, ",", 1)
        _put(&out, ")", 1)
        return PyBytes_FromStringAndSize(out.data, out.size)
    finally:
        PyMem_Free(out.data)


# ---------------------------------------------------------------------------------------------------------
# The fleet index's lean read of a residency entry


#: The instance ids of the entries read (``_read_interned``): the index holds one object per instance, not one
#: per row.
cdef list _INSTANCES = _intern_table()


def read_index_entry(bytes data not None, Py_ssize_t pos, tuple tiers not None, Py_ssize_t aggregations):
    """What the fleet index keeps of a ``residency`` v3 entry whose body starts at ``pos`` and ends with
    ``data``: ``(rows, parent_block_hash, content_hash)``, ``rows`` the ``(instance_id, data_parallel_rank,
    tier)`` tuples of the rows with ``copies > 0`` in the entry's order, the two others None when null.

    The twin of ``stream_apps.index.entry_reader._read_python``. Every field is read and checked as the
    generated reader checks it (lengths, UTF-8, union branches, enum indices, varints, no trailing bytes), so
    bytes it returns a value for are bytes the codec decodes to the same entry; the fields the index does not
    keep are only skipped.

    ``tiers``: the Tier enum's symbols, in order; ``aggregations``: how many AggregationMode symbols there are.

    Raises:
        ValueError (UnicodeDecodeError included), IndexError: bytes that are not such a record; the caller then
        has the codec decode them (it names the fault, or resolves another layout).
    """
    cdef Cursor cursor
    cdef Cursor* c = &cursor
    if pos < 0 or pos > PyBytes_GET_SIZE(data):
        raise IndexError("start outside the data")
    c.data = <const uint8_t*>PyBytes_AS_STRING(data)
    c.size = PyBytes_GET_SIZE(data)
    c.pos = pos
    cdef int64_t n, count, workers, rank, tier, copies, aggregation
    cdef Py_ssize_t n_tiers = len(tiers)
    cdef list rows = []
    cdef object instance_id, parent, content
    n = _read_long(c)  # block_hash: the key has it
    if n < 0 or n > c.size - c.pos:
        raise ValueError(f"bad length {n} at {c.pos}")
    c.pos += n
    if _read_branch(c):  # ownership: the key has it
        _skip_string(c)
    while True:
        count = _read_count(c)
        if count == 0:
            break
        while count:
            count -= 1
            instance_id = _read_interned(c, _INSTANCES)
            rank = _read_long(c)
            tier = _read_long(c)
            if not 0 <= tier < n_tiers:
                raise ValueError(f"enum index {tier} at {c.pos}")
            if _read_branch(c):  # medium
                _skip_string(c)
            if _read_branch(c):  # locality
                _skip_string(c)
            if _read_branch(c):  # group_idx
                _read_long(c)
            _read_long(c)  # world_size
            aggregation = _read_long(c)
            if not 0 <= aggregation < aggregations:
                raise ValueError(f"enum index {aggregation} at {c.pos}")
            while True:
                workers = _read_count(c)
                if workers == 0:
                    break
                while workers:
                    workers -= 1
                    _read_long(c)  # worker_rank
                    _read_long(c)  # count
                    _read_long(c)  # publisher_epoch
                    _read_long(c)  # seq
                    _read_long(c)  # batch_index
                    _read_long(c)  # block_index
                    if _read_branch(c):  # content
                        _read_long(c)
            copies = _read_long(c)
            if _read_branch(c):  # since
                _skip_double(c)
            _skip_double(c)  # last_ts
            if _read_branch(c):  # clear_mark
                _read_long(c)
                _read_long(c)
                _read_long(c)
            if copies > 0:
                rows.append((instance_id, rank, tiers[tier]))
    parent = _read_bytes(c) if _read_branch(c) else None
    content = _read_long(c) if _read_branch(c) else None
    if c.pos != c.size:
        raise ValueError(f"{c.size - c.pos} trailing bytes")
    return rows, parent, content


# ---------------------------------------------------------------------------------------------------------
# The index's query bodies


cdef inline bint _json_space(uint8_t b) noexcept nogil:
    return b == 0x20 or b == 0x0A or b == 0x0D or b == 0x09


cdef Py_ssize_t _json_skip_space(const uint8_t* p, Py_ssize_t n, Py_ssize_t i) noexcept nogil:
    while i < n and _json_space(p[i]):
        i += 1
    return i


cdef Py_ssize_t _json_token_array(const uint8_t* p, Py_ssize_t n, Py_ssize_t i, uint32_t* ids,
                                  Py_ssize_t* count) noexcept nogil:
    """Reads the array of token ids starting at ``p[i]`` (its ``[``) into ``ids`` (little-endian u32),
    adding to ``count``; returns the position after its ``]``, or -1 for anything but plain integers in
    [-2**31, 2**32) separated by commas and JSON whitespace. ``ids`` has room for (n - i) // 2 + 1 ids."""
    cdef Py_ssize_t first
    cdef uint8_t b
    cdef bint negative
    cdef uint64_t value
    cdef uint8_t* out
    if i >= n or p[i] != 0x5B:  # [
        return -1
    i = _json_skip_space(p, n, i + 1)
    if i < n and p[i] == 0x5D:  # ]: an empty array
        return i + 1
    while True:
        negative = i < n and p[i] == 0x2D  # -
        if negative:
            i += 1
        first = i
        value = 0
        while i < n and 0x30 <= p[i] <= 0x39 and i - first < 11:
            value = value * 10 + (p[i] - 0x30)
            i += 1
        if i == first or i - first > 10 or (i - first > 1 and p[first] == 0x30):
            return -1  # no digits, beyond 2**32 whatever they are, or a leading zero (not JSON)
        if negative:
            if value > 2147483648ULL:
                return -1
            value = (4294967296ULL - value) & 0xFFFFFFFFULL
        elif value > 4294967295ULL:
            return -1
        out = <uint8_t*>&ids[count[0]]  # little-endian, whatever the machine's order
        out[0] = <uint8_t>value
        out[1] = <uint8_t>(value >> 8)
        out[2] = <uint8_t>(value >> 16)
        out[3] = <uint8_t>(value >> 24)
        count[0] += 1
        i = _json_skip_space(p, n, i)
        if i == n:
            return -1
        b = p[i]
        i += 1
        if b == 0x5D:  # ]
            return i
        if b != 0x2C:  # ,
            return -1
        i = _json_skip_space(p, n, i)


cdef Py_ssize_t _json_skip_string(const uint8_t* p, Py_ssize_t n, Py_ssize_t i) noexcept nogil:
    """The position after the JSON string opening at ``p[i]``, or -1 if it does not end."""
    i += 1
    while i < n:
        if p[i] == 0x22:  # "
            return i + 1
        i += 2 if p[i] == 0x5C else 1  # a backslash escapes the next byte (\u's digits need no care)
    return -1


cdef Py_ssize_t _json_skip_value(const uint8_t* p, Py_ssize_t n, Py_ssize_t i) noexcept nogil:
    """The position after the JSON value starting at ``p[i]``, or -1. Only its extent is found: the caller
    has msgspec check the values skipped here."""
    cdef Py_ssize_t depth = 0, start = i
    cdef uint8_t b
    if i >= n:
        return -1
    b = p[i]
    if b == 0x22:
        return _json_skip_string(p, n, i)
    if b == 0x7B or b == 0x5B:  # { [
        while i < n:
            b = p[i]
            if b == 0x22:
                i = _json_skip_string(p, n, i)
                if i < 0:
                    return -1
                continue
            if b == 0x7B or b == 0x5B:
                depth += 1
            elif b == 0x7D or b == 0x5D:  # } ]
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return -1
    while i < n and not (_json_space(p[i]) or p[i] == 0x2C or p[i] == 0x7D or p[i] == 0x5D):
        i += 1
    return i if i > start else -1


def json_query_token_ids(const uint8_t[::1] body):
    """Finds the ``token_ids`` array of a JSON ``POST /query`` body and reads it as little-endian u32 bytes, in
    one pass over the body: the twin of ``stream_apps.index.api._read_json_query_python``.

    Returns ``(token bytes, start, end)``, ``body[start:end]`` being the array's text (so the caller can have
    msgspec decode and check the rest of the body with the array cut out), or None: no top-level
    ``token_ids``, twice, a key written with an escape, ids that are not plain integers in [-2**31, 2**32)
    (:func:`json_token_bytes`), or a body that is not one JSON object. The caller then decodes the body in
    Python, whose error names the fault. Never raises for bad input.
    """
    cdef Py_ssize_t n = body.shape[0]
    if n == 0:
        return None
    cdef const uint8_t* p = &body[0]
    cdef Py_ssize_t i, key_start, key_end, start = -1, end = -1, count = 0
    cdef uint32_t* ids = <uint32_t*>PyMem_Malloc((n // 2 + 1) * sizeof(uint32_t))
    if ids == NULL:
        raise MemoryError()
    try:
        i = _json_skip_space(p, n, 0)
        if i == n or p[i] != 0x7B:  # {
            return None
        i = _json_skip_space(p, n, i + 1)
        if i < n and p[i] == 0x7D:  # }: an empty object
            i += 1
        else:
            while True:
                if i >= n or p[i] != 0x22:
                    return None
                key_start = i + 1
                i = _json_skip_string(p, n, i)
                if i < 0:
                    return None
                key_end = i - 1
                if memchr(p + key_start, 0x5C, key_end - key_start) != NULL:
                    return None  # an escaped key might spell token_ids: let msgspec read it
                i = _json_skip_space(p, n, i)
                if i >= n or p[i] != 0x3A:  # :
                    return None
                i = _json_skip_space(p, n, i + 1)
                if key_end - key_start == 9 and memcmp(p + key_start, b"token_ids", 9) == 0:
                    if start >= 0:
                        return None  # twice
                    start = i
                    i = _json_token_array(p, n, i, ids, &count)
                    end = i
                else:
                    i = _json_skip_value(p, n, i)
                if i < 0:
                    return None
                i = _json_skip_space(p, n, i)
                if i >= n:
                    return None
                if p[i] == 0x7D:
                    i += 1
                    break
                if p[i] != 0x2C:
                    return None
                i = _json_skip_space(p, n, i + 1)
        if start < 0 or _json_skip_space(p, n, i) != n:
            return None
        return PyBytes_FromStringAndSize(<char*>ids, 4 * count), start, end
    finally:
        PyMem_Free(ids)


def json_token_bytes(const uint8_t[::1] raw):
    """A JSON array of token ids (``raw``: the array's text, as ``msgspec.Raw`` gives it) as little-endian u32
    bytes, 4 per token: the twin of ``stream_apps.index.api._token_bytes_python``.

    Takes only plain integers in [-2**31, 2**32) (a negative id wraps to its u32 bits, as the engines' int32 ids
    do) separated by commas and JSON whitespace. Returns None for anything else (a float, an exponent, a
    leading zero, a string, an id out of range, a malformed array): the caller then has the Python twin decode
    it, whose error names the fault. Never raises for bad input.
    """
    cdef Py_ssize_t n = raw.shape[0]
    if n == 0:
        return None
    cdef const uint8_t* p = &raw[0]
    cdef Py_ssize_t i, count = 0
    # every id but the last takes at least 2 bytes (a digit and a comma): n // 2 + 1 ids at most
    cdef uint32_t* ids = <uint32_t*>PyMem_Malloc((n // 2 + 1) * sizeof(uint32_t))
    if ids == NULL:
        raise MemoryError()
    try:
        i = _json_token_array(p, n, _json_skip_space(p, n, 0), ids, &count)
        if i < 0 or _json_skip_space(p, n, i) != n:
            return None
        return PyBytes_FromStringAndSize(<char*>ids, 4 * count)
    finally:
        PyMem_Free(ids)
