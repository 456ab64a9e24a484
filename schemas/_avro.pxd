# cython: language_level=3
"""Avro's binary encoding, the primitives the compiled modules share (``cimport``, no module of its own).

Byte for byte what the Avro specification's binary encoding says, and what :mod:`schemas.avro_primitives` writes
and :mod:`schemas.fast_reader` reads in Python: zig-zag varints of at most 10 bytes and 64 bits, little-endian
IEEE 754 doubles, strings and bytes as a length then the bytes, ``["null", X]`` unions as the branch index.
``schemas/_hotpath.pyx`` (the codecs) and ``stream_apps/residency/_record.pyx`` (the residency entry as a
compiled record) both read and write through these, so a rule of the encoding is written once.

Readers take a :c:type:`Cursor` and raise ``IndexError`` (past the end) or ``ValueError`` (a value the encoding
does not allow), as the generated readers do. Writers append to a :c:type:`Buffer`; the ones that take Python
values raise ``TypeError`` for a value of another type than the schema's, ``OverflowError`` for an int out of
range and ``KeyError`` for an unknown enum symbol, so a caller can hand such values to a Python writer, whose
error then names the field.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.list cimport PyList_GET_ITEM
from cpython.mem cimport PyMem_Malloc, PyMem_Realloc
from cpython.unicode cimport PyUnicode_AsUTF8AndSize, PyUnicode_DecodeUTF8
from libc.stdint cimport INT64_MIN, int64_t, uint8_t, uint64_t
from libc.string cimport memcmp, memcpy


# ---------------------------------------------------------------------------------------------------------
# Reading

cdef struct Cursor:
    # The bytes being read, a read position in them, and their size (the end no read may pass).
    const uint8_t* data
    Py_ssize_t pos
    Py_ssize_t size


cdef inline int64_t _read_long(Cursor* c) except? -1:
    """The zig-zag varint at the cursor (at most 10 bytes and 64 bits, as schemas.fast_reader reads it)."""
    cdef uint64_t result = 0
    cdef uint64_t byte
    cdef int shift = 0
    while True:
        if c.pos >= c.size:
            raise IndexError("varint past the end of the message")
        byte = c.data[c.pos]
        c.pos += 1
        if shift == 63 and (byte & 0x7E):
            raise ValueError(f"varint beyond 64 bits before {c.pos}")
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return <int64_t>((result >> 1) ^ (0 - (result & 1)))
        shift += 7
        if shift > 63:
            raise ValueError(f"varint longer than 10 bytes at {c.pos}")


cdef inline uint64_t _le(const uint8_t* p, int n) noexcept:
    """``n`` bytes at ``p`` as a little-endian unsigned integer (any host byte order)."""
    cdef uint64_t value = 0
    cdef int i
    for i in range(n - 1, -1, -1):
        value = (value << 8) | p[i]
    return value


cdef inline object _read_string(Cursor* c):
    cdef int64_t n = _read_long(c)
    if n < 0 or n > c.size - c.pos:  # not c.pos + n: a length near 2**63 would wrap past the check
        raise ValueError(f"bad length {n} at {c.pos}")
    value = PyUnicode_DecodeUTF8(<const char*>c.data + c.pos, n, NULL)
    c.pos += n
    return value


cdef enum:
    # Slots of an intern table (:func:`_read_interned`): a power of two.
    _INTERN_SLOTS = 1024


cdef inline list _intern_table():
    """A new, empty intern table for :func:`_read_interned` (a module keeps one per kind of string)."""
    return [None] * _INTERN_SLOTS


cdef inline object _read_interned(Cursor* c, list table):
    """The string at the cursor, as :func:`_read_string` reads it, but the same ``str`` object as the last one
    read with the same bytes through ``table`` (:func:`_intern_table`), when it is still in its slot.

    Why: the residency entries a worker holds repeat a few values in every row (instance ids, media, ownership);
    one shared object each instead of one per row is about 150 bytes less per decoded entry and three fewer
    allocations per decode. The slot is picked by an FNV-1a hash of the bytes and checked byte for byte, so a
    collision only costs a decode. A hit needs no UTF-8 check: the bytes are those of a string decoded before.
    Strings over 64 bytes are decoded as they are (not worth a slot)."""
    cdef int64_t n = _read_long(c)
    cdef const uint8_t* p
    cdef uint64_t h = 14695981039346656037ULL
    cdef Py_ssize_t i
    cdef object held
    if n < 0 or n > c.size - c.pos:  # not c.pos + n: a length near 2**63 would wrap past the check
        raise ValueError(f"bad length {n} at {c.pos}")
    p = c.data + c.pos
    if n > 64:
        value = PyUnicode_DecodeUTF8(<const char*>p, n, NULL)
        c.pos += n
        return value
    for i in range(n):
        h = (h ^ p[i]) * 1099511628211ULL
    i = <Py_ssize_t>(h & (_INTERN_SLOTS - 1))
    held = <object>PyList_GET_ITEM(table, i)
    if held is not None:
        key = (<tuple>held)[0]
        if PyBytes_GET_SIZE(key) == n and memcmp(PyBytes_AS_STRING(key), p, n) == 0:
            c.pos += n
            return (<tuple>held)[1]
    value = PyUnicode_DecodeUTF8(<const char*>p, n, NULL)
    table[i] = (PyBytes_FromStringAndSize(<const char*>p, n), value)
    c.pos += n
    return value


cdef inline object _read_bytes(Cursor* c):
    cdef int64_t n = _read_long(c)
    if n < 0 or n > c.size - c.pos:
        raise ValueError(f"bad length {n} at {c.pos}")
    value = PyBytes_FromStringAndSize(<const char*>c.data + c.pos, n)
    c.pos += n
    return value


cdef inline double _read_double(Cursor* c) except? -1.0:
    cdef uint64_t bits
    cdef double value
    if c.pos + 8 > c.size:
        raise IndexError("double past the end of the record")
    bits = _le(c.data + c.pos, 8)
    memcpy(&value, &bits, 8)
    c.pos += 8
    return value


cdef inline object _read_symbol(Cursor* c, tuple symbols):
    cdef int64_t index = _read_long(c)
    if not 0 <= index < len(symbols):
        raise ValueError(f"enum index {index} at {c.pos}")
    return symbols[index]


cdef inline int64_t _read_count(Cursor* c) except? -1:
    """An array block's item count; the block's byte size, when given (a negative count), is skipped."""
    cdef int64_t count = _read_long(c)
    if count < 0:
        if count == INT64_MIN:  # -count would stay negative; Python reads 2**63 items and runs out of bytes
            raise ValueError("array block count out of range")
        count = -count
        _read_long(c)
    return count


cdef inline bint _read_branch(Cursor* c) except -1:
    """A ``["null", X]`` union's branch: False for null, True when X follows (any varint form of 0 or 1, as the
    generated readers accept)."""
    cdef int64_t index = _read_long(c)
    if index == 1:
        return True
    if index != 0:
        raise ValueError(f"union branch {index} at {c.pos}")
    return False


cdef inline int _skip_string(Cursor* c) except -1:
    """Past a string that is not kept, checked as the generated reader checks it: its length, and that it is
    UTF-8 (an ASCII string, the usual medium or locality, needs no decoding to tell)."""
    cdef int64_t n = _read_long(c)
    cdef Py_ssize_t i
    if n < 0 or n > c.size - c.pos:  # not c.pos + n: a length near 2**63 would wrap past the check
        raise ValueError(f"bad length {n} at {c.pos}")
    for i in range(c.pos, c.pos + n):
        if c.data[i] & 0x80:
            # decoded only to refuse what str.decode() refuses (UnicodeDecodeError), by the same rules
            PyUnicode_DecodeUTF8(<const char*>c.data + c.pos, n, NULL)
            break
    c.pos += n
    return 0


cdef inline int _skip_double(Cursor* c) except -1:
    if c.size - c.pos < 8:
        raise IndexError("double past the end of the record")
    c.pos += 8
    return 0


# ---------------------------------------------------------------------------------------------------------
# Writing

cdef struct Buffer:
    # Bytes written so far (PyMem_Malloc'd by the caller, which frees them), how many, and the room allocated.
    char* data
    Py_ssize_t size
    Py_ssize_t capacity


cdef inline int _open_buffer(Buffer* out, Py_ssize_t capacity) except -1:
    """Room for ``capacity`` bytes in an empty ``out``; the caller frees ``out.data`` (``PyMem_Free``) when done."""
    out.data = <char*>PyMem_Malloc(capacity)
    if out.data == NULL:
        raise MemoryError()
    out.size = 0
    out.capacity = capacity
    return 0


cdef inline int _reserve(Buffer* out, Py_ssize_t extra) except -1:
    cdef Py_ssize_t capacity
    cdef char* grown
    if out.size + extra <= out.capacity:
        return 0
    capacity = max(out.capacity * 2, out.size + extra)
    grown = <char*>PyMem_Realloc(out.data, capacity)
    if grown == NULL:
        raise MemoryError()
    out.data = grown
    out.capacity = capacity
    return 0


cdef inline int _put(Buffer* out, const char* data, Py_ssize_t n) except -1:
    _reserve(out, n)
    memcpy(out.data + out.size, data, n)
    out.size += n
    return 0


cdef inline int _put_byte(Buffer* out, uint8_t byte) except -1:
    _reserve(out, 1)
    out.data[out.size] = <char>byte
    out.size += 1
    return 0


cdef inline int _put_long(Buffer* out, int64_t value) except -1:
    """Avro ``long``: zig-zag, then a little-endian base-128 varint (at most 10 bytes)."""
    cdef uint64_t n = (<uint64_t>value << 1) ^ <uint64_t>(value >> 63)
    _reserve(out, 10)
    while n > 0x7F:
        out.data[out.size] = <char>((n & 0x7F) | 0x80)
        out.size += 1
        n >>= 7
    out.data[out.size] = <char>n
    out.size += 1
    return 0


cdef inline int _put_double(Buffer* out, double value) except -1:
    """Avro ``double``: 8 bytes, little-endian IEEE 754 (any host byte order)."""
    cdef uint64_t bits
    cdef int i
    memcpy(&bits, &value, 8)
    _reserve(out, 8)
    for i in range(8):
        out.data[out.size + i] = <char>((bits >> (8 * i)) & 0xFF)
    out.size += 8
    return 0


cdef inline int64_t _long_of(object value) except? -1:
    """``value`` as an Avro int or long: an ``int`` (not a bool) in 64 bits, else TypeError or OverflowError."""
    if type(value) is not int:
        raise TypeError(type(value).__name__)
    return value  # OverflowError beyond 64 bits


cdef inline int _put_string(Buffer* out, object value) except -1:
    cdef Py_ssize_t n
    cdef const char* utf8
    if type(value) is not str:
        raise TypeError(type(value).__name__)
    utf8 = PyUnicode_AsUTF8AndSize(value, &n)  # UnicodeEncodeError for a lone surrogate, as str.encode()
    _put_long(out, n)
    _put(out, utf8, n)
    return 0


cdef inline int _put_bytes(Buffer* out, object value) except -1:
    if type(value) is not bytes:
        raise TypeError(type(value).__name__)
    _put_long(out, PyBytes_GET_SIZE(value))
    _put(out, PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value))
    return 0


cdef inline bint _put_branch(Buffer* out, object value) except -1:
    """A ``["null", X]`` union's branch index: 0 for None, else 2 (branch 1, zig-zag); True when X follows."""
    _put_byte(out, 0 if value is None else 2)
    return value is not None


cdef inline int _put_symbol(Buffer* out, dict symbols, object symbol) except -1:
    """An enum symbol, given ``symbols`` (symbol -> its encoded index); KeyError for another value."""
    encoded = symbols.get(symbol) if type(symbol) is str else None
    if encoded is None:
        raise KeyError(symbol)
    _put(out, PyBytes_AS_STRING(encoded), PyBytes_GET_SIZE(encoded))
    return 0
