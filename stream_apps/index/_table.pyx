# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""The compiled block table of the fleet index: :class:`BlockTable`, the twin of
:class:`stream_apps.index.table.PyBlockTable` (the reference: every method gives what it gives; the tests compare
the two on random sequences of operations). :mod:`stream_apps.index.table` documents the semantics and chooses
between the two; this module documents the layout.

Layout (all plain C arrays, grown by 1.5x, never by a Python object per block):

- ``_recs``: one 40-byte :c:type:`Rec` per block (key, parent, content, links, flags). Freed records are chained
  on a free list and reused, so a record's index is stable for the block's life.
- ``_blocks``: open addressing (linear probing, backward-shift deletion) from the block key to its record; a
  slot is 8 bytes: the record index and 32 bits of the key's hash, which place the slot (so growing and
  deleting never read a record) and filter the key comparisons.
- ``_content``: the same kind of table from (parent or ROOT, content) to records, one slot per block that has
  a content; equal keys (blocks of equal content under one parent, or at the root under several engine hash
  seeds) are all found in the probe run that starts at their common home slot.
- a block's links (``holder << 32 | scope``, sorted, so a holder's scopes are adjacent and ``holders_at`` only
  skips repeats) sit in the record itself when there is one, else in a segment of ``_pool`` of 2**k slots;
  free segments are kept on one free list per size class.
- ``_holders``: holder id -> blocks it holds, for ``holder_blocks`` (a handful of holders: a small open table).
- ``_info``: holder id -> (group, tier) of ``set_holder``, and ``_gstate``: group id -> the run of the group in
  the current scored lookup (``chain_runs``, ``content_runs``), both arrays indexed by id (ids below 2**24):
  the scoring reads them once per (depth, holder) with no hashing. A call stamps the group states it uses
  rather than clearing them, so a lookup costs its own groups, not the fleet's.

Bytes for a block of one holder: 40 (record) + 8 / load (block slot) + 8 / load (content slot), the tables'
loads between 0.47 and 0.7, and the record array up to a third unused after a growth: 63 to 94 bytes (73.6 at
10M blocks); each further holder adds 8 to 16 bytes of pool (31 bytes a link at 2.5M blocks of 4 holders).
Freed records and segments are reused, by any block and by blocks of their size class; the arrays never shrink
(``clear()`` frees them).

A table of millions of blocks is far larger than the caches, so a lookup costs its memory loads: the queries
run in stages that prefetch the next stage's slots, records and link segments for every block of the call at
once (``holders_at``) or every candidate of a depth (the content walk, whose depths depend on each other), and
arrays of 4 MiB or more ask Linux for transparent huge pages, so those loads rarely miss the TLB as well.
The scored lookups (``chain_runs``, ``content_runs``) take the same walks, gather each depth's distinct holders
into one array and score them there, so a router's whole lookup costs the walk and one Python object per
group answered.
``python -m bench.index_table`` measures the bytes and the times.

``boundscheck=False``: every index here is below a length or capacity checked by the code beside it.
"""

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, qsort, realloc
from libc.string cimport memcpy, memmove, memset
from cpython.float cimport PyFloat_AsDouble
from cpython.long cimport PyLong_FromUnsignedLong, PyLong_FromUnsignedLongLong
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.number cimport PyNumber_Index
from cpython.ref cimport Py_INCREF
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.list cimport PyList_New, PyList_SET_ITEM

from stream_apps.index.table_keys import block_key as _block_key, residency_key_block as _residency_key_block

#: A content hash (a signed 64-bit Avro long) as the table's u64: ``content & _U64_MASK``.
_U64_MASK = (1 << 64) - 1

cdef extern from *:
    """
    #if defined(__GNUC__) || defined(__clang__)
    #define KVSTREAM_PREFETCH(p) __builtin_prefetch(p)
    #else
    #define KVSTREAM_PREFETCH(p) ((void)0)
    #endif
    """
    #: Starts loading the cache line at ``p`` (a hint: no effect on results; nothing without GCC or Clang).
    void _prefetch "KVSTREAM_PREFETCH"(const void* p) noexcept nogil

cdef extern from *:
    """
    #if defined(__linux__)
    #include <sys/mman.h>
    #endif
    static void kvstream_advise_huge(void* p, size_t bytes) {
    #if defined(__linux__) && defined(MADV_HUGEPAGE)
        /* the 2 MiB-aligned interior of an array of 4 MiB or more; an error only means small pages */
        const size_t huge = (size_t)2 << 20;
        uintptr_t start = ((uintptr_t)p + huge - 1) & ~(uintptr_t)(huge - 1);
        uintptr_t end = ((uintptr_t)p + bytes) & ~(uintptr_t)(huge - 1);
        if (bytes >= 2 * huge && end > start)
            (void)madvise((void*)start, end - start, MADV_HUGEPAGE);
    #else
        (void)p; (void)bytes;
    #endif
    }
    """
    #: Asks for transparent huge pages on a large array (Linux): a lookup in a table of hundreds of MiB then
    #: misses the TLB far less often. A hint: no effect on results.
    void _advise_huge "kvstream_advise_huge"(void* p, size_t bytes) noexcept nogil

# ---------------------------------------------------------------------------------------------------------
# Layout

#: An empty slot's record index, and the end of the record free list.
cdef uint32_t NONE = 0xFFFFFFFF
#: The end of a segment free list.
cdef uint64_t NO_SEG = 0xFFFFFFFFFFFFFFFFULL
#: At most this many blocks (2**31): the record indices must stay below NONE and the tables' capacities below
#: 2**32, which the 32-bit slot hashes address.
cdef uint64_t MAX_BLOCKS = 2147483648
cdef enum:
    #: Size classes of pool segments: 2**1 .. 2**31 links (class 0 is the link in the record).
    CLASSES = 32
#: Mixed into the content hash of a block without parent, so (ROOT, c) and (p, c) hash apart.
cdef uint64_t ROOT_SALT = 0x243F6A8885A308D3ULL

#: Holder and group ids of set_holder are below this: their metadata and state are arrays indexed by id
#: (table.MAX_INFO_ID).
cdef uint32_t MAX_INFO_ID = 1 << 24
cdef enum:
    #: Tier indices of the holder metadata (schemas.TIERS: GPU, CPU, STORAGE, EXTERNAL, UNKNOWN).
    NTIERS = 5
    #: Ordered boundaries of the runs (scoring.PHASES: gpu, cpu, disk).
    NCLASSES = 3
    #: ``HInfo.tier`` of a holder id never given to set_holder.
    NO_TIER = 0xFF
#: Tier index -> bit i set when phase i of the ordered walk reads the tier: GPU the gpu phase, CPU the cpu phase,
#: STORAGE and EXTERNAL the disk phase, UNKNOWN none (scoring._PHASE_BITS; the differential tests compare the two).
cdef uint8_t TIER_PHASE_BITS[5]
TIER_PHASE_BITS[:] = [1, 2, 4, 4, 0]

cdef enum:
    #: The block has a parent.
    F_PARENT = 1
    #: The block has a content (and so a slot in ``_content``).
    F_CONTENT = 2
    #: The record is free (its ``link`` is the next free record).
    F_DEAD = 4


ctypedef struct Rec:
    # the block key
    uint64_t key
    # the parent's block key (meaningful with F_PARENT)
    uint64_t parent
    # the content key (meaningful with F_CONTENT)
    uint64_t content
    # cls 0: the one link itself (holder << 32 | scope); cls k > 0: the offset of the block's segment of 2**k
    # links in _pool; F_DEAD: the next free record
    uint64_t link
    # links: (scope, holder) pairs, sorted as u64 ``holder << 32 | scope``
    uint32_t n
    # F_PARENT | F_CONTENT | F_DEAD
    uint8_t flags
    # the size class of the links' storage: n <= 2**cls (0: in the record)
    uint8_t cls
    uint16_t _pad


ctypedef struct Slot:
    # the record index, NONE when the slot is empty
    uint32_t rec
    # the high 32 bits of the key's 64-bit hash: place the slot (fastrange) and filter comparisons
    uint32_t tag


ctypedef struct HTab:
    # cap slots
    Slot* slots
    size_t cap
    # used slots
    size_t count


ctypedef struct HEnt:
    # blocks the holder holds now
    uint64_t count
    uint32_t holder
    # 1 when the entry is taken (entries are never removed: holders are few)
    uint32_t used


ctypedef struct HInfo:
    # the holder's group (set_holder)
    uint32_t group
    # its tier index, NO_TIER when never set
    uint32_t tier


ctypedef struct GState:
    # the scored lookup (its stamp) that last used the group; _runs[run] is its run when that is this one
    uint32_t stamp
    uint32_t run


ctypedef struct Run:
    # the sum of the best tier weight of each block of the run
    double score
    uint32_t group
    # the run on any tier
    uint32_t any
    uint32_t tiers[NTIERS]
    uint32_t classes[NCLASSES]
    # depth + 1 of the last depth the group was seen at, and the tiers (bits) holding that depth
    uint32_t mark
    uint32_t mask


cdef inline uint64_t _mix(uint64_t x) noexcept nogil:
    """SplitMix64's finalizer: a bijection whose high bits depend on every input bit (caller keys may be
    small consecutive integers)."""
    x ^= x >> 30
    x *= 0xBF58476D1CE4E5B9ULL
    x ^= x >> 27
    x *= 0x94D049BB133111EBULL
    x ^= x >> 31
    return x


cdef inline uint32_t _block_tag(uint64_t key) noexcept nogil:
    return <uint32_t>(_mix(key) >> 32)


cdef inline uint32_t _content_tag(bint has_parent, uint64_t parent, uint64_t content) noexcept nogil:
    if has_parent:
        return <uint32_t>(_mix(content ^ _mix(parent)) >> 32)
    return <uint32_t>(_mix(content ^ ROOT_SALT) >> 32)


cdef inline uint32_t _rec_content_tag(Rec* rec) noexcept nogil:
    return _content_tag(rec.flags & F_PARENT, rec.parent, rec.content)


cdef inline size_t _home(uint32_t tag, size_t cap) noexcept nogil:
    """The tag's home slot, ``tag * cap / 2**32``: any capacity, not only powers of two, so a table grows by
    1.5x and its load stays between 0.47 and 0.7."""
    return <size_t>((<uint64_t>tag * cap) >> 32)


cdef inline uint8_t _cls_for(uint32_t n) noexcept nogil:
    """The smallest size class that holds ``n`` links (0: in the record)."""
    cdef uint8_t cls = 0
    while (<uint64_t>1 << cls) < n:
        cls += 1
    return cls


cdef int _cmp_u64(const void* a, const void* b) noexcept nogil:
    cdef uint64_t x = (<const uint64_t*>a)[0]
    cdef uint64_t y = (<const uint64_t*>b)[0]
    return (x > y) - (x < y)


cdef int _cmp_u32(const void* a, const void* b) noexcept nogil:
    cdef uint32_t x = (<const uint32_t*>a)[0]
    cdef uint32_t y = (<const uint32_t*>b)[0]
    return (x > y) - (x < y)


cdef void _sort_u64(uint64_t* v, size_t n) noexcept nogil:
    """Sorts ``v`` ascending: insertion sort below 17 values (the usual handful), qsort above."""
    cdef size_t i, j
    cdef uint64_t x
    if n > 16:
        qsort(v, n, sizeof(uint64_t), _cmp_u64)
        return
    for i in range(1, n):
        x = v[i]
        j = i
        while j > 0 and v[j - 1] > x:
            v[j] = v[j - 1]
            j -= 1
        v[j] = x


cdef void _sort_u32(uint32_t* v, size_t n) noexcept nogil:
    cdef size_t i, j
    cdef uint32_t x
    if n > 16:
        qsort(v, n, sizeof(uint32_t), _cmp_u32)
        return
    for i in range(1, n):
        x = v[i]
        j = i
        while j > 0 and v[j - 1] > x:
            v[j] = v[j - 1]
            j -= 1
        v[j] = x


cdef int _reserve(void** p, size_t* cap, size_t need, size_t size, size_t minimum) except -1:
    """Grows the array ``*p`` of ``*cap`` items of ``size`` bytes to hold ``need`` items (by 1.5x at least, so
    appends are amortized O(1) while the slack stays at most half). Raises MemoryError."""
    cdef size_t new_cap
    cdef void* q
    if need <= cap[0]:
        return 0
    new_cap = cap[0] + cap[0] // 2
    if new_cap < need:
        new_cap = need
    if new_cap < minimum:
        new_cap = minimum
    q = realloc(p[0], new_cap * size)
    if q == NULL:
        raise MemoryError(f"BlockTable: cannot allocate {new_cap * size} bytes")
    p[0] = q
    cap[0] = new_cap
    _advise_huge(q, new_cap * size)
    return 0


cdef inline uint64_t _u64(object value) except? 0xFFFFFFFFFFFFFFFFULL:
    """``value`` as a u64: OverflowError out of range, TypeError for a non-integer (Cython alone would
    truncate a float, where the Python twin refuses it)."""
    if type(value) is not int:
        value = PyNumber_Index(value)
    return value


cdef inline uint32_t _u32(object value) except? 0xFFFFFFFF:
    if type(value) is not int:
        value = PyNumber_Index(value)
    return value


# -- the open tables (_blocks, _content) -------------------------------------------------------------------

cdef int _ht_alloc(HTab* t, size_t cap) except -1:
    cdef Slot* slots = <Slot*>malloc(cap * sizeof(Slot))
    if slots == NULL:
        raise MemoryError(f"BlockTable: cannot allocate {cap * sizeof(Slot)} bytes")
    _advise_huge(slots, cap * sizeof(Slot))
    memset(slots, 0xFF, cap * sizeof(Slot))  # every rec NONE
    t.slots = slots
    t.cap = cap
    t.count = 0
    return 0


cdef inline void _ht_put(HTab* t, uint32_t tag, uint32_t rec) noexcept nogil:
    """Adds a slot (the caller made room with :func:`_ht_room`); equal keys may be there already."""
    cdef size_t i = _home(tag, t.cap)
    while t.slots[i].rec != NONE:
        i += 1
        if i == t.cap:
            i = 0
    t.slots[i].rec = rec
    t.slots[i].tag = tag
    t.count += 1


cdef int _ht_room(HTab* t, size_t more) except -1:
    """Makes the table hold ``more`` more slots at a load of at most 0.7, rehashing into a 1.5x larger array
    (tags only: no record is read)."""
    cdef HTab old = t[0]
    cdef size_t cap, i
    if (t.count + more) * 10 <= t.cap * 7:
        return 0
    cap = t.cap + t.cap // 2
    if cap < (t.count + more) * 10 // 7 + 1:
        cap = (t.count + more) * 10 // 7 + 1
    if cap < 16:
        cap = 16
    if cap > (<size_t>1 << 32):
        raise MemoryError("BlockTable: more than 2**32 slots")
    _ht_alloc(t, cap)
    for i in range(old.cap):
        if old.slots[i].rec != NONE:
            _ht_put(t, old.slots[i].tag, old.slots[i].rec)
    free(old.slots)
    return 0


cdef void _ht_del_at(HTab* t, size_t i) noexcept nogil:
    """Empties slot ``i`` and shifts the slots after it back (linear probing's deletion without tombstones):
    each slot stays reachable from its home, and probes stay short after many deletions."""
    cdef size_t j = i
    cdef size_t k
    cdef size_t cap = t.cap
    while True:
        j += 1
        if j == cap:
            j = 0
        if t.slots[j].rec == NONE:
            break
        k = _home(t.slots[j].tag, cap)
        # slot j may move to i only if its home is not in the cyclic range (i, j]
        if (k <= i or k > j) if i <= j else (k <= i and k > j):
            t.slots[i] = t.slots[j]
            i = j
    t.slots[i].rec = NONE
    t.count -= 1


cdef void _ht_del_rec(HTab* t, uint32_t tag, uint32_t rec) noexcept nogil:
    """Removes the slot of record ``rec``, whose key hashes to ``tag`` (it is in the table)."""
    cdef size_t i = _home(tag, t.cap)
    while t.slots[i].rec != rec:
        i += 1
        if i == t.cap:
            i = 0
    _ht_del_at(t, i)


cdef inline uint64_t _hash_block_key(object canonical_hash) except? 0xFFFFFFFFFFFFFFFFULL:
    """``table_keys.block_key(canonical_hash)``: an 8-byte ``bytes`` read in C, anything else by the
    reference."""
    cdef const unsigned char* p
    if type(canonical_hash) is bytes and PyBytes_GET_SIZE(canonical_hash) == 8:
        p = <const unsigned char*>PyBytes_AS_STRING(canonical_hash)
        return ((<uint64_t>p[0] << 56) | (<uint64_t>p[1] << 48) | (<uint64_t>p[2] << 40) | (<uint64_t>p[3] << 32)
                | (<uint64_t>p[4] << 24) | (<uint64_t>p[5] << 16) | (<uint64_t>p[6] << 8) | <uint64_t>p[7])
    return _u64(_block_key(canonical_hash))


def block_keys(hashes):
    """``[table.block_key(h) for h in hashes]``, the 8-byte ``bytes`` read in C (a lookup's chain is 27 of them,
    and the Python loop took several times the walk's own time). Same errors as ``block_key``."""
    cdef Py_ssize_t i, n
    cdef list out
    if type(hashes) is not list and type(hashes) is not tuple:
        hashes = list(hashes)
    n = len(hashes)
    out = PyList_New(n)
    for i in range(n):
        key = PyLong_FromUnsignedLongLong(_hash_block_key(hashes[i]))
        Py_INCREF(key)
        PyList_SET_ITEM(out, i, key)
    return out


cdef int _load_weights(weights, double* w) except -1:
    """The 5 tier weights into ``w``: ValueError unless 5, TypeError for a non-number (a str is refused, not
    parsed: ``table._tier_weights``), ValueError for NaN (a block's best weight would depend on the order of
    the comparisons)."""
    cdef Py_ssize_t i
    cdef tuple ws = tuple(weights)
    if len(ws) != NTIERS:
        raise ValueError(f"weights: {NTIERS} tier weights expected (schemas.TIERS order), got {len(ws)}")
    for i in range(NTIERS):
        x = ws[i]
        if isinstance(x, (str, bytes, bytearray)):
            raise TypeError(f"weights: a tier weight must be a number, not {type(x).__name__}")
        w[i] = PyFloat_AsDouble(x)
        if w[i] != w[i]:
            raise ValueError("weights: a tier weight is NaN (the best weight of a block would be undefined)")
    return 0


cdef object _holder_filter(allowed):
    """``allowed`` of a scored lookup: None, a callable, or a buffer read as unsigned bytes
    (``memoryview(allowed).cast("B")``: TypeError for anything else), as ``table._holder_filter``."""
    if allowed is None or callable(allowed):
        return allowed
    return memoryview(allowed).cast("B")


# ---------------------------------------------------------------------------------------------------------
# The table


cdef inline int _hex_digit(unsigned char c) noexcept nogil:
    if 48 <= c <= 57:
        return c - 48
    if 97 <= c <= 102:
        return c - 87
    if 65 <= c <= 70:
        return c - 55
    return -1


cdef object _key_block(bytes key, uint64_t* block):
    """:func:`residency_key_block` without the block key's Python int: returns the ownership (None for
    ``primary``) and stores the block key in ``block``. Same results and errors."""
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(key)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(key), slash = n - 1, i
    cdef uint64_t v = 0
    cdef int d
    while slash >= 0 and p[slash] != 47:  # '/'
        slash -= 1
    if n - slash - 1 == 16:
        for i in range(slash + 1, n):
            d = _hex_digit(p[i])
            if d < 0:
                break
            v = (v << 4) | <uint64_t>d
        else:
            text = key.decode()  # the whole key, as the reference decodes it (its error for bytes not UTF-8)
            ownership = text[:len(text) - 17] if slash >= 0 else ""  # before "/" and the 16 ASCII digits
            block[0] = v
            return None if ownership == "primary" else ownership
    ownership, reference = _residency_key_block(key)
    block[0] = _u64(reference)
    return ownership


def residency_key_block(bytes key not None):
    """``table.residency_key_block(key)``: ``(ownership or None, block key)`` of a residency table key, the 16
    hex digits of an 8-byte hash read in C (the feed parses one per changelog record). Anything else (another
    hash length, spaces ``bytes.fromhex`` allows) goes to the Python reference, so results and errors are
    its."""
    cdef uint64_t block = 0
    ownership = _key_block(key, &block)
    return ownership, PyLong_FromUnsignedLongLong(block)


cdef class BlockTable:
    """Every resident (block, scope, holder) of the fleet, with each block's parent and content: see
    :class:`stream_apps.index.table.PyBlockTable` for the methods' semantics, shapes and errors (identical
    here), and this module's docstring for the layout and its bytes.

    Not thread-safe (every method runs under the GIL, none releases it). Raises MemoryError when an allocation
    fails or the table would pass 2**31 blocks; the table is unchanged then.
    """

    #: one record per block ever used (live, or free on the free list); _nrecs records are initialized
    cdef Rec* _recs
    cdef size_t _rec_cap
    cdef size_t _nrecs
    #: head of the free record list (NONE: empty)
    cdef uint32_t _free_rec
    #: block key -> record
    cdef HTab _blocks
    #: (parent or ROOT, content) -> record, for blocks with a content
    cdef HTab _content
    #: link segments; _pool_len slots handed out so far, of _pool_cap
    cdef uint64_t* _pool
    cdef size_t _pool_cap
    cdef size_t _pool_len
    #: per size class, the first free segment's offset (NO_SEG: none); a free segment's first slot links on
    cdef uint64_t _free_seg[CLASSES]
    #: holder -> blocks held
    cdef HEnt* _holders
    cdef size_t _h_cap
    cdef size_t _h_count
    #: live blocks and (block, scope, holder) links
    cdef size_t _nblocks
    cdef size_t _nlinks
    #: bumped by every change, so items() notices a table changed under it
    cdef uint64_t _version
    # scratch, kept between calls so a call allocates nothing in the steady state:
    #: a call's keys (chain, contents) or sorted holders (replace)
    cdef uint64_t* _keys
    cdef size_t _keys_cap
    cdef uint32_t* _hbuf
    cdef size_t _hbuf_cap
    #: replace's merged links; content_walk's holders or block keys of a depth; items()'s sorted links
    cdef uint64_t* _out
    cdef size_t _out_cap
    #: holders_at's records; content_walk's candidates of every depth, and where each depth's end
    cdef uint32_t* _cand
    cdef size_t _cand_cap
    cdef size_t* _ends
    cdef size_t _ends_cap
    #: content_walk's tags of one depth's probes, and the slots whose tag matched (probe << 32 | record)
    cdef uint32_t* _tags
    cdef size_t _tags_cap
    cdef uint64_t* _match
    cdef size_t _match_cap
    #: holder -> (group, tier): _info_n entries initialized (1 + the highest holder set)
    cdef HInfo* _info
    cdef size_t _info_cap
    cdef size_t _info_n
    #: group -> its run in the current scored lookup, when its stamp is _stamp: _gstate_n entries initialized
    cdef GState* _gstate
    cdef size_t _gstate_cap
    cdef size_t _gstate_n
    cdef uint32_t _stamp
    # scored lookups' scratch: the runs, the runs present at one depth, the walk's holders of every depth
    # (distinct per depth) and each depth's end in them
    cdef Run* _runs
    cdef size_t _runs_cap
    cdef uint32_t* _present
    cdef size_t _present_cap
    cdef uint32_t* _hold
    cdef size_t _hold_cap
    cdef size_t* _hends
    cdef size_t _hends_cap

    def __cinit__(self):
        self._init()

    def __dealloc__(self):
        self._free_all()

    cdef int _init(self) except -1:
        cdef int c
        self._recs = NULL
        self._rec_cap = 0
        self._nrecs = 0
        self._free_rec = NONE
        self._blocks.slots = NULL
        self._content.slots = NULL
        self._pool = NULL
        self._pool_cap = 0
        self._pool_len = 0
        for c in range(CLASSES):
            self._free_seg[c] = NO_SEG
        self._holders = NULL
        self._h_cap = 0
        self._h_count = 0
        self._nblocks = 0
        self._nlinks = 0
        self._keys = NULL
        self._keys_cap = 0
        self._hbuf = NULL
        self._hbuf_cap = 0
        self._out = NULL
        self._out_cap = 0
        self._cand = NULL
        self._cand_cap = 0
        self._ends = NULL
        self._ends_cap = 0
        self._tags = NULL
        self._tags_cap = 0
        self._match = NULL
        self._match_cap = 0
        self._info = NULL
        self._info_cap = 0
        self._info_n = 0
        self._gstate = NULL
        self._gstate_cap = 0
        self._gstate_n = 0
        self._stamp = 0
        self._runs = NULL
        self._runs_cap = 0
        self._present = NULL
        self._present_cap = 0
        self._hold = NULL
        self._hold_cap = 0
        self._hends = NULL
        self._hends_cap = 0
        _ht_alloc(&self._blocks, 16)
        _ht_alloc(&self._content, 16)
        self._h_cap = 16
        self._holders = <HEnt*>malloc(self._h_cap * sizeof(HEnt))
        if self._holders == NULL:
            raise MemoryError()
        memset(self._holders, 0, self._h_cap * sizeof(HEnt))
        return 0

    cdef void _free_all(self) noexcept:
        free(self._recs)
        free(self._blocks.slots)
        free(self._content.slots)
        free(self._pool)
        free(self._holders)
        free(self._keys)
        free(self._hbuf)
        free(self._out)
        free(self._cand)
        free(self._ends)
        free(self._tags)
        free(self._match)
        free(self._info)
        free(self._gstate)
        free(self._runs)
        free(self._present)
        free(self._hold)
        free(self._hends)
        self._info = NULL
        self._gstate = NULL
        self._runs = NULL
        self._present = NULL
        self._hold = NULL
        self._hends = NULL
        self._recs = NULL
        self._blocks.slots = NULL
        self._content.slots = NULL
        self._pool = NULL
        self._holders = NULL
        self._keys = NULL
        self._hbuf = NULL
        self._out = NULL
        self._cand = NULL
        self._ends = NULL
        self._tags = NULL
        self._match = NULL

    # -- pieces -------------------------------------------------------------------------------------------

    cdef inline uint64_t* _links(self, Rec* rec) noexcept:
        if rec.cls == 0:
            return &rec.link
        return self._pool + rec.link

    cdef inline size_t _find_slot(self, uint64_t key) noexcept:
        """The slot of ``key`` in ``_blocks``, or ``_blocks.cap`` when it is absent."""
        cdef uint32_t tag = _block_tag(key)
        cdef size_t cap = self._blocks.cap
        cdef size_t i = _home(tag, cap)
        cdef Slot* slots = self._blocks.slots
        while slots[i].rec != NONE:
            if slots[i].tag == tag and self._recs[slots[i].rec].key == key:
                return i
            i += 1
            if i == cap:
                i = 0
        return cap

    cdef inline uint32_t _find(self, uint64_t key) noexcept:
        cdef size_t i = self._find_slot(key)
        if i == self._blocks.cap:
            return NONE
        return self._blocks.slots[i].rec

    cdef int _rec_room(self) except -1:
        if self._nblocks >= MAX_BLOCKS:
            raise MemoryError(f"BlockTable holds at most {MAX_BLOCKS} blocks")
        if self._free_rec == NONE:
            _reserve(<void**>&self._recs, &self._rec_cap, self._nrecs + 1, sizeof(Rec), 64)
        return 0

    cdef inline uint32_t _rec_take(self) noexcept:
        """A record (room made by :meth:`_rec_room`)."""
        cdef uint32_t r = self._free_rec
        if r != NONE:
            self._free_rec = <uint32_t>self._recs[r].link
            return r
        r = <uint32_t>self._nrecs
        self._nrecs += 1
        return r

    cdef int _seg_room(self, uint8_t cls) except -1:
        if cls == 0 or self._free_seg[cls] != NO_SEG:
            return 0
        _reserve(<void**>&self._pool, &self._pool_cap, self._pool_len + (<size_t>1 << cls), sizeof(uint64_t), 1024)
        return 0

    cdef inline uint64_t _seg_take(self, uint8_t cls) noexcept:
        """A segment of 2**cls links (cls > 0; room made by :meth:`_seg_room`)."""
        cdef uint64_t off = self._free_seg[cls]
        if off != NO_SEG:
            self._free_seg[cls] = self._pool[off]
            return off
        off = self._pool_len
        self._pool_len += <size_t>1 << cls
        return off

    cdef inline void _seg_free(self, uint64_t off, uint8_t cls) noexcept:
        self._pool[off] = self._free_seg[cls]
        self._free_seg[cls] = off

    cdef int _holder_room(self, size_t more) except -1:
        """Room for ``more`` new holders in ``_holders`` at a load of at most 0.5."""
        cdef HEnt* old = self._holders
        cdef size_t old_cap = self._h_cap
        cdef size_t cap, i
        if (self._h_count + more) * 2 <= self._h_cap:
            return 0
        cap = self._h_cap * 2
        while cap < (self._h_count + more) * 2:
            cap *= 2
        self._holders = <HEnt*>malloc(cap * sizeof(HEnt))
        if self._holders == NULL:
            self._holders = old
            raise MemoryError()
        memset(self._holders, 0, cap * sizeof(HEnt))
        self._h_cap = cap
        self._h_count = 0
        for i in range(old_cap):
            if old[i].used:
                self._holder_entry(old[i].holder).count = old[i].count
        free(old)
        return 0

    cdef inline HEnt* _holder_entry(self, uint32_t holder) noexcept:
        """The holder's entry, taken if new (room made by :meth:`_holder_room`)."""
        cdef size_t i = _home(<uint32_t>(_mix(holder) >> 32), self._h_cap)
        while self._holders[i].used:
            if self._holders[i].holder == holder:
                return &self._holders[i]
            i += 1
            if i == self._h_cap:
                i = 0
        self._holders[i].used = 1
        self._holders[i].holder = holder
        self._holders[i].count = 0
        self._h_count += 1
        return &self._holders[i]

    cdef void _drop(self, uint32_t r, size_t slot) noexcept:
        """Removes block ``r`` (at ``slot`` of ``_blocks``) with its content slot; its links are already gone
        from the counts."""
        cdef Rec* rec = &self._recs[r]
        if rec.flags & F_CONTENT:
            _ht_del_rec(&self._content, _rec_content_tag(rec), r)
        _ht_del_at(&self._blocks, slot)
        if rec.cls:
            self._seg_free(rec.link, rec.cls)
        rec.flags = F_DEAD
        rec.n = 0
        rec.cls = 0
        rec.link = self._free_rec
        self._free_rec = r
        self._nblocks -= 1

    cdef Py_ssize_t _load_u64(self, keys) except -1:
        """``keys`` (a sequence of ints) into ``_keys``; raises OverflowError/TypeError before any work."""
        cdef Py_ssize_t i = 0
        if type(keys) is not list and type(keys) is not tuple:
            keys = list(keys)
        _reserve(<void**>&self._keys, &self._keys_cap, len(keys), sizeof(uint64_t), 64)
        for key in keys:
            self._keys[i] = _u64(key)
            i += 1
        return i

    cdef Py_ssize_t _load_holders(self, holders) except -1:
        """``holders`` into ``_hbuf``, sorted, repeats dropped; returns how many."""
        cdef Py_ssize_t i = 0
        if type(holders) is not list and type(holders) is not tuple:
            holders = list(holders)
        _reserve(<void**>&self._hbuf, &self._hbuf_cap, len(holders), sizeof(uint32_t), 64)
        for h in holders:
            self._hbuf[i] = _u32(h)
            i += 1
        return self._sorted_holders(i)

    cdef Py_ssize_t _sorted_holders(self, Py_ssize_t m) except -1:
        """The first ``m`` ids of ``_hbuf`` sorted, repeats dropped; returns how many are left."""
        cdef Py_ssize_t i, j
        for j in range(1, m):
            if self._hbuf[j] <= self._hbuf[j - 1]:
                break
        else:
            return m  # already strictly increasing: the usual case for ids the caller keeps sorted
        _sort_u32(self._hbuf, m)
        i = 0
        for j in range(m):
            if i == 0 or self._hbuf[j] != self._hbuf[i - 1]:
                self._hbuf[i] = self._hbuf[j]
                i += 1
        return i

    cdef tuple _holder_tuple(self, Rec* rec):
        """The distinct holder ids of ``rec``'s links, ascending (links are sorted by holder first)."""
        cdef uint64_t* links = self._links(rec)
        cdef uint32_t n = rec.n
        cdef uint32_t i, k = 1
        cdef tuple out
        if n == 1:
            out = PyTuple_New(1)
            h = PyLong_FromUnsignedLong(<uint32_t>(links[0] >> 32))
            Py_INCREF(h)
            PyTuple_SET_ITEM(out, 0, h)
            return out
        for i in range(1, n):
            if (links[i] >> 32) != (links[i - 1] >> 32):
                k += 1
        out = PyTuple_New(k)
        k = 0
        for i in range(n):
            if i == 0 or (links[i] >> 32) != (links[i - 1] >> 32):
                h = PyLong_FromUnsignedLong(<uint32_t>(links[i] >> 32))
                Py_INCREF(h)
                PyTuple_SET_ITEM(out, k, h)
                k += 1
        return out

    # -- changes ------------------------------------------------------------------------------------------

    def replace(self, block, scope, holders, parent=None, content=None):
        """Makes ``holders`` exactly the holders of (``block``, ``scope``); see ``PyBlockTable.replace``.

        O(n + m) for a block of n links and m new holders (a merge of two sorted runs; m log m more when the
        holders come unsorted), amortized O(1) in n + m for the growth of the arrays.
        """
        cdef uint64_t key = _u64(block)
        cdef uint32_t s = _u32(scope)
        cdef uint64_t par = 0, con = 0
        cdef bint set_par = parent is not None
        cdef bint set_con = content is not None
        cdef Py_ssize_t m
        if set_par:
            par = _u64(parent)
        if set_con:
            con = _u64(content)
        m = self._load_holders(holders)
        self._replace(key, s, <size_t>m, set_par, par, set_con, con)

    cdef int _replace(self, uint64_t key, uint32_t s, size_t m, bint set_par, uint64_t par, bint set_con,
                      uint64_t con) except -1:
        cdef size_t slot = self._find_slot(key)
        cdef uint32_t r
        cdef Rec* rec
        cdef uint64_t* links
        cdef uint64_t* out
        cdef uint64_t sv = s
        cdef uint64_t nv = 0
        cdef size_t n, i, j, k
        cdef uint64_t ho, hn
        cdef uint8_t cls
        cdef uint64_t off
        cdef uint8_t flags
        cdef uint64_t new_par, new_con
        if slot == self._blocks.cap:
            if m == 0:
                return 0  # nothing held, nothing to forget: parent and content go with no block
            # every allocation first, so a MemoryError leaves the table as it was
            self._holder_room(m)
            _ht_room(&self._blocks, 1)
            if set_con:
                _ht_room(&self._content, 1)
            self._rec_room()
            cls = _cls_for(<uint32_t>m)
            self._seg_room(cls)
            r = self._rec_take()
            rec = &self._recs[r]
            rec.key = key
            rec.parent = par
            rec.content = con
            rec.flags = (F_PARENT if set_par else 0) | (F_CONTENT if set_con else 0)
            rec.n = <uint32_t>m
            rec.cls = cls
            rec._pad = 0
            if cls:
                rec.link = self._seg_take(cls)
            links = self._links(rec)
            for i in range(m):  # hbuf is sorted, so the links are
                links[i] = (<uint64_t>self._hbuf[i] << 32) | sv
                self._holder_entry(self._hbuf[i]).count += 1
            _ht_put(&self._blocks, _block_tag(key), r)
            if set_con:
                _ht_put(&self._content, _rec_content_tag(rec), r)
            self._nblocks += 1
            self._nlinks += m
            self._version += 1
            return 0

        r = self._blocks.slots[slot].rec
        n = self._recs[r].n
        self._holder_room(m)
        _reserve(<void**>&self._out, &self._out_cap, n + m, sizeof(uint64_t), 64)
        if set_con:
            _ht_room(&self._content, 1)
        # merge the block's links without scope s with the new (holder, s) links: both runs are sorted
        rec = &self._recs[r]
        links = self._links(rec)
        out = self._out
        i = j = k = 0
        while i < n or j < m:
            if i < n and <uint32_t>links[i] == s:
                i += 1  # the scope's old link: replaced by the new holders
                continue
            if j < m:
                nv = (<uint64_t>self._hbuf[j] << 32) | sv
            if i < n and (j >= m or links[i] < nv):
                out[k] = links[i]
                i += 1
            else:
                out[k] = nv
                j += 1
            k += 1
        cls = _cls_for(<uint32_t>k)
        if k and cls != rec.cls:
            self._seg_room(cls)  # may move the pool: links are found again below
        rec = &self._recs[r]
        links = self._links(rec)
        # counts: a holder gains a block when it appears in the merged links and was in none of the old ones,
        # and loses it the other way round (its other scopes keep it)
        i = j = 0
        while i < n or j < k:
            ho = links[i] >> 32 if i < n else 0
            hn = out[j] >> 32 if j < k else 0
            if j >= k or (i < n and ho < hn):
                self._holder_entry(<uint32_t>ho).count -= 1
                while i < n and (links[i] >> 32) == ho:
                    i += 1
            elif i >= n or hn < ho:
                self._holder_entry(<uint32_t>hn).count += 1
                while j < k and (out[j] >> 32) == hn:
                    j += 1
            else:
                while i < n and (links[i] >> 32) == ho:
                    i += 1
                while j < k and (out[j] >> 32) == hn:
                    j += 1
        self._nlinks = self._nlinks - n + k
        self._version += 1
        if k == 0:
            self._drop(r, slot)
            return 0
        if cls != rec.cls:
            if rec.cls:
                self._seg_free(rec.link, rec.cls)
            if cls:
                rec.link = self._seg_take(cls)
            rec.cls = cls
        memcpy(self._links(rec), out, k * sizeof(uint64_t))
        rec.n = <uint32_t>k
        if not set_par and not set_con:
            return 0
        flags = rec.flags | (F_PARENT if set_par else 0) | (F_CONTENT if set_con else 0)
        new_par = par if set_par else rec.parent
        new_con = con if set_con else rec.content
        if flags == rec.flags and new_par == rec.parent and new_con == rec.content:
            return 0
        if rec.flags & F_CONTENT:  # its content slot is placed by the old (parent, content): move it
            _ht_del_rec(&self._content, _rec_content_tag(rec), r)
        rec.flags = flags
        rec.parent = new_par
        rec.content = new_con
        if flags & F_CONTENT:
            _ht_put(&self._content, _rec_content_tag(rec), r)
        return 0

    def apply_messages(self, messages, dict positions not None, read, dict scopes not None,
                       dict row_holders not None, new_scope, new_holder):
        """The fleet index's feed step over one ``consume()`` of the residency changelog, in C: what
        ``FleetIndex._apply_messages_python`` does with the same arguments, with the same results and errors
        (the tests compare the two). ``FleetIndex.apply_messages`` documents the step; this method is its loop,
        given the index's own look-ups.

        Args:
            messages: confluent-kafka ``Message`` objects (or any with its ``error``, ``partition``, ``offset``,
                ``key`` and ``value`` methods).
            positions: partition -> next offset, set for every message without an error.
            read: ``value -> (rows, parent, content)`` (``IndexEntryReader.read_index_entry``).
            scopes: ownership -> scope id; ``new_scope(ownership)`` gives one it lacks (and stores it).
            row_holders: ownership -> {(instance_id, data_parallel_rank, tier): holder id}; the inner dict is
                made here when missing, and ``new_holder(ownership, row)`` gives an id it lacks (and stores it).

        Returns:
            ``(applied, failures, errors)``: how many records were applied, ``(message, error)`` of each record
            refused (ValueError, KeyError, TypeError, OverflowError), and the messages that carry an error.
        """
        cdef list failures = [], errors = []
        cdef Py_ssize_t applied = 0, i, m
        cdef uint64_t block = 0, par = 0, con = 0
        cdef uint32_t scope
        cdef bint set_par, set_con
        cdef dict known
        for message in messages:
            if message.error() is not None:
                errors.append(message)
                continue
            positions[message.partition()] = message.offset() + 1
            key = message.key()
            if key is None:
                continue
            try:
                if type(key) is bytes:
                    ownership = _key_block(key, &block)
                else:  # not what confluent-kafka gives: the reference's errors
                    ownership, reference = _residency_key_block(key)
                    block = _u64(reference)
                value = message.value()
                if value:
                    rows, parent, content = read(value)
                else:
                    rows = None
                found = scopes.get(ownership)
                scope = _u32(new_scope(ownership) if found is None else found)
                if rows is None:
                    self._replace(block, scope, 0, False, 0, False, 0)
                    applied += 1
                    continue
                known = row_holders.get(ownership)
                if known is None:
                    known = row_holders[ownership] = {}
                if type(rows) is not list and type(rows) is not tuple:
                    rows = list(rows)
                _reserve(<void**>&self._hbuf, &self._hbuf_cap, len(rows), sizeof(uint32_t), 64)
                i = 0
                for row in rows:
                    holder = known.get(row)
                    self._hbuf[i] = _u32(new_holder(ownership, row) if holder is None else holder)
                    i += 1
                m = self._sorted_holders(i)
                set_par = parent is not None
                if set_par:
                    par = _hash_block_key(parent)
                set_con = content is not None
                if set_con:
                    con = _u64(content & _U64_MASK)
                self._replace(block, scope, <size_t>m, set_par, par, set_con, con)
                applied += 1
            except (ValueError, KeyError, TypeError, OverflowError) as exc:  # DecodeError is a ValueError
                failures.append((message, exc))
        return applied, failures, errors

    def remove_holder(self, holder):
        """Drops ``holder`` from every block; see ``PyBlockTable.remove_holder``. O(blocks + links): one pass
        over the records (an instance leaving the fleet is rare; a per-holder index would cost bytes per
        link)."""
        cdef uint32_t h = _u32(holder)
        cdef size_t r, lo, hi, mid, end
        cdef Rec* rec
        cdef uint64_t* links
        cdef uint64_t first = <uint64_t>h << 32
        cdef size_t affected = 0
        cdef size_t i = _home(<uint32_t>(_mix(h) >> 32), self._h_cap)
        for r in range(self._nrecs):
            rec = &self._recs[r]
            if rec.flags & F_DEAD:
                continue
            links = self._links(rec)
            lo = 0  # the first link >= (h, 0): links are sorted by holder first
            hi = rec.n
            while lo < hi:
                mid = (lo + hi) // 2
                if links[mid] < first:
                    lo = mid + 1
                else:
                    hi = mid
            end = lo
            while end < rec.n and (links[end] >> 32) == h:
                end += 1
            if end == lo:
                continue
            affected += 1
            memmove(links + lo, links + end, (rec.n - end) * sizeof(uint64_t))
            self._nlinks -= end - lo
            rec.n -= <uint32_t>(end - lo)
            if rec.n == 0:
                self._drop(<uint32_t>r, self._find_slot(rec.key))
            # a block left with fewer links keeps its segment (n <= 2**cls still holds); replace re-sizes it
        while self._holders[i].used:  # a holder never seen has no entry to reset
            if self._holders[i].holder == h:
                self._holders[i].count = 0
                break
            i += 1
            if i == self._h_cap:
                i = 0
        if affected:
            self._version += 1
        return affected

    def clear(self):
        """Forgets every block and holder; the arrays go back to their initial sizes."""
        self._free_all()
        self._init()
        self._version += 1

    # -- queries ------------------------------------------------------------------------------------------

    def holders_at(self, chain):
        """Per block key of ``chain``, the tuple of holder ids holding it, ascending, up to the first absent
        block; see ``PyBlockTable.holders_at``. O(len(chain) + links found).

        Four passes over the chain, each prefetching what the next one reads (its slot, its record, its link
        segment), so a long chain in a table far larger than the cache waits for about three memory round
        trips rather than three per block.
        """
        cdef Py_ssize_t found = self._chain(chain)
        cdef Py_ssize_t i
        cdef list out = []
        for i in range(found):
            out.append(self._holder_tuple(&self._recs[self._cand[i]]))
        return out

    cdef Py_ssize_t _chain(self, chain) except -1:
        """The first three passes of :meth:`holders_at`: ``_cand[i]`` is the record of ``chain[i]`` for each
        i below the returned count, the blocks up to the first absent one, their link segments prefetched."""
        cdef Py_ssize_t n = self._load_u64(chain)
        cdef Py_ssize_t i, found
        cdef uint32_t r, tag
        cdef size_t cap = self._blocks.cap
        cdef size_t slot
        cdef Slot* slots = self._blocks.slots
        cdef Rec* rec
        _reserve(<void**>&self._cand, &self._cand_cap, n, sizeof(uint32_t), 64)
        for i in range(n):
            _prefetch(&slots[_home(_block_tag(self._keys[i]), cap)])
        # the slot of each key by its tag alone (no record read), its record prefetched
        for i in range(n):
            tag = _block_tag(self._keys[i])
            slot = _home(tag, cap)
            while slots[slot].rec != NONE and slots[slot].tag != tag:
                slot += 1
                if slot == cap:
                    slot = 0
            r = slots[slot].rec
            self._cand[i] = r
            if r != NONE:
                _prefetch(&self._recs[r])
        # the keys checked (a tag shared by another key: probe on), the link segments prefetched
        found = n
        for i in range(n):
            r = self._cand[i]
            if r != NONE and self._recs[r].key != self._keys[i]:
                r = self._find(self._keys[i])
                self._cand[i] = r
            if r == NONE:
                found = i
                break
            rec = &self._recs[r]
            if rec.cls:
                _prefetch(self._pool + rec.link)
        return found

    def content_walk(self, contents):
        """Per depth of the token path ``contents``, the holders of the depth's candidate blocks, ascending;
        see ``PyBlockTable.content_walk``."""
        return self._walk(contents, False)

    def content_walk_blocks(self, contents):
        """Per depth of the token path ``contents``, the candidate block keys, ascending; see
        ``PyBlockTable.content_walk_blocks``."""
        return self._walk(contents, True)

    def content_mixed(self, contents):
        """Whether a depth of the token path ``contents`` has more than one candidate block; see
        ``PyBlockTable.content_mixed``."""
        cdef Py_ssize_t reached = self._candidates(contents)
        cdef Py_ssize_t d
        cdef size_t begin = 0
        for d in range(reached):
            if self._ends[d] - begin > 1:
                return True
            begin = self._ends[d]
        return False

    cdef size_t _depth(self, Py_ssize_t d, size_t begin, size_t end) except? 0:
        """Appends depth ``d``'s candidates to ``_cand`` (after ``end``): the records of key (parent, content
        ``_keys[d]``) for each parent among the candidates ``[begin, end)``, or of (ROOT, ``_keys[0]``) at
        depth 0. Returns the new end.

        Three stages, each prefetching what the next reads, so a depth of several candidates (engines of
        different hash seeds) waits for one slot load and one record load rather than one each per
        candidate: the home slots; the runs from them, where equal keys all are (they share their home), by
        tag alone; the records of the tags that match, checked.
        """
        cdef uint64_t content = self._keys[d]
        cdef size_t probes = 1 if d == 0 else end - begin
        cdef size_t cap = self._content.cap
        cdef Slot* slots = self._content.slots
        cdef size_t p, i, matches = 0, count = end
        cdef uint32_t tag, r
        cdef Rec* rec
        cdef uint64_t parent = 0
        _reserve(<void**>&self._tags, &self._tags_cap, probes, sizeof(uint32_t), 64)
        for p in range(probes):
            if d == 0:
                tag = _content_tag(False, 0, content)
            else:
                tag = _content_tag(True, self._recs[self._cand[begin + p]].key, content)
            self._tags[p] = tag
            _prefetch(&slots[_home(tag, cap)])
        for p in range(probes):
            tag = self._tags[p]
            i = _home(tag, cap)
            while slots[i].rec != NONE:
                if slots[i].tag == tag:
                    if matches == self._match_cap:
                        _reserve(<void**>&self._match, &self._match_cap, matches + 1, sizeof(uint64_t), 64)
                    self._match[matches] = (<uint64_t>p << 32) | slots[i].rec
                    matches += 1
                    _prefetch(&self._recs[slots[i].rec])
                i += 1
                if i == cap:
                    i = 0
        for i in range(matches):
            p = self._match[i] >> 32
            r = <uint32_t>self._match[i]
            rec = &self._recs[r]
            if rec.content != content:
                continue
            if d == 0:
                if rec.flags & F_PARENT:
                    continue
            else:
                parent = self._recs[self._cand[begin + p]].key
                if not rec.flags & F_PARENT or rec.parent != parent:
                    continue
            if count == self._cand_cap:
                _reserve(<void**>&self._cand, &self._cand_cap, count + 1, sizeof(uint32_t), 64)
            self._cand[count] = r
            count += 1
            if rec.cls:  # the rows are built after the walk: the segment is in the cache by then
                _prefetch(self._pool + rec.link)
        return count

    cdef Py_ssize_t _candidates(self, contents) except -1:
        """The content walk's candidates: every depth's, appended to ``_cand`` (depth d's end at ``_ends[d]``),
        up to the first depth without one; returns how many depths have some."""
        cdef Py_ssize_t depths = self._load_u64(contents)
        cdef Py_ssize_t d, reached = 0
        cdef size_t begin = 0, end = 0, count = 0
        _reserve(<void**>&self._ends, &self._ends_cap, depths, sizeof(size_t), 64)
        for d in range(depths):
            count = self._depth(d, begin, end)
            if count == end:
                break  # no candidate at this depth
            begin = end
            end = count
            self._ends[d] = end
            reached = d + 1
        return reached

    cdef size_t _row(self, size_t begin, size_t end, bint blocks) except? 0:
        """One depth's row of the content walk, in ``_out``, ascending and distinct: the keys of the candidates
        ``_cand[begin:end]``, or their links' holders; returns its length."""
        cdef size_t total = end - begin
        cdef size_t c, i, k = 0
        cdef Rec* rec
        cdef uint64_t* links
        cdef uint32_t l
        if not blocks:
            total = 0
            for c in range(begin, end):
                total += self._recs[self._cand[c]].n
        _reserve(<void**>&self._out, &self._out_cap, total, sizeof(uint64_t), 64)
        for c in range(begin, end):
            rec = &self._recs[self._cand[c]]
            if blocks:
                self._out[k] = rec.key
                k += 1
            else:
                links = self._links(rec)
                for l in range(rec.n):
                    self._out[k] = links[l] >> 32
                    k += 1
        if end - begin > 1:  # one candidate's links are sorted by holder already
            _sort_u64(self._out, k)
        total = 0
        for i in range(k):
            if i == 0 or self._out[i] != self._out[total - 1]:
                self._out[total] = self._out[i]
                total += 1
        return total

    cdef list _walk(self, contents, bint blocks):
        """The content walk: every depth's candidates first (:meth:`_candidates`), then the rows, so the
        candidates' link segments load while the walk goes on."""
        cdef Py_ssize_t reached = self._candidates(contents)
        cdef Py_ssize_t d
        cdef size_t begin = 0, end, total, i
        cdef tuple row
        cdef list out = []
        for d in range(reached):
            end = self._ends[d]
            total = self._row(begin, end, blocks)
            row = PyTuple_New(total)
            for i in range(total):
                v = PyLong_FromUnsignedLongLong(self._out[i])
                Py_INCREF(v)
                PyTuple_SET_ITEM(row, i, v)
            out.append(row)
            begin = end
        return out

    # -- scored lookups -----------------------------------------------------------------------------------

    def set_holder(self, holder, group, tier):
        """Registers the group and tier index of ``holder`` for :meth:`chain_runs`; see
        ``PyBlockTable.set_holder`` (same errors). O(1), amortized for the arrays' growth to the ids."""
        cdef uint32_t h = _u32(holder)
        cdef uint32_t g = _u32(group)
        tier = PyNumber_Index(tier)
        if h >= MAX_INFO_ID:
            raise OverflowError(f"holder {h} is not below 2**24 (holder metadata is indexed by id)")
        if g >= MAX_INFO_ID:
            raise OverflowError(f"group {g} is not below 2**24 (group state is indexed by id)")
        if not 0 <= tier < NTIERS:
            raise ValueError(f"tier {tier} is not a tier index (0..{NTIERS - 1}, schemas.TIERS)")
        # both arrays grown before either is written, so a MemoryError changes nothing
        _reserve(<void**>&self._info, &self._info_cap, <size_t>h + 1, sizeof(HInfo), 64)
        _reserve(<void**>&self._gstate, &self._gstate_cap, <size_t>g + 1, sizeof(GState), 64)
        while self._info_n <= h:
            self._info[self._info_n].tier = NO_TIER
            self._info[self._info_n].group = 0
            self._info_n += 1
        while self._gstate_n <= g:
            self._gstate[self._gstate_n].stamp = 0  # no call has stamp 0
            self._gstate[self._gstate_n].run = 0
            self._gstate_n += 1
        self._info[h].group = g
        self._info[h].tier = <uint32_t>tier

    def holder_info(self, holder):
        """``(group, tier)`` of ``holder`` as :meth:`set_holder` registered it, or None."""
        cdef uint32_t h = _u32(holder)
        if h >= self._info_n or self._info[h].tier == NO_TIER:
            return None
        return (self._info[h].group, self._info[h].tier)

    @property
    def holder_info_end(self):
        """1 + the highest holder id given to :meth:`set_holder` since the table was made or cleared; 0 if
        none."""
        return self._info_n

    def chain_runs(self, chain, weights, allowed=None):
        """The prefix runs of each group holding the chain's block 0: :meth:`holders_at`'s walk and the scoring
        of ``scoring.prefix_runs`` in one call; see ``PyBlockTable.chain_runs`` (same answer and errors).

        O(len(chain) + links walked + groups of block 0) in C; Python objects only for the answer (and the
        calls of a callable ``allowed``). Returns ``[(group, any, score, (5 tier runs), (3 ordered boundaries:
        gpu, cpu, disk))]``.
        """
        cdef double w[NTIERS]
        cdef Py_ssize_t depths
        _load_weights(weights, w)
        allowed = _holder_filter(allowed)
        depths = self._gather_chain(chain)
        return self._scored(depths, w, allowed)

    def content_runs(self, contents, weights, allowed=None):
        """:meth:`chain_runs` over the depths of the token path ``contents`` (:meth:`content_walk`); see
        ``PyBlockTable.content_runs``."""
        cdef double w[NTIERS]
        cdef Py_ssize_t depths
        _load_weights(weights, w)
        allowed = _holder_filter(allowed)
        depths = self._gather_content(contents)
        return self._scored(depths, w, allowed)

    cdef Py_ssize_t _gather_chain(self, chain) except -1:
        """The chain's walk into ``_hold``: the distinct holders of block i (its links' holders, adjacent
        repeats skipped: links are sorted by holder) at ``_hold[_hends[i-1]:_hends[i]]``; returns the blocks
        found."""
        cdef Py_ssize_t found = self._chain(chain)
        cdef Py_ssize_t i
        cdef size_t total = 0
        cdef uint32_t l, h
        cdef Rec* rec
        cdef uint64_t* links
        _reserve(<void**>&self._hends, &self._hends_cap, found, sizeof(size_t), 64)
        for i in range(found):
            rec = &self._recs[self._cand[i]]
            _reserve(<void**>&self._hold, &self._hold_cap, total + rec.n, sizeof(uint32_t), 256)
            links = self._links(rec)
            for l in range(rec.n):
                h = <uint32_t>(links[l] >> 32)
                if l == 0 or h != <uint32_t>(links[l - 1] >> 32):
                    self._hold[total] = h
                    total += 1
            self._hends[i] = total
        return found

    cdef Py_ssize_t _gather_content(self, contents) except -1:
        """The content walk into ``_hold`` as :meth:`_gather_chain` (a depth's holders: those of any of its
        candidates, ascending and distinct); returns the depths with candidates."""
        cdef Py_ssize_t reached = self._candidates(contents)
        cdef Py_ssize_t d
        cdef size_t begin = 0, end, k, i, total = 0
        _reserve(<void**>&self._hends, &self._hends_cap, reached, sizeof(size_t), 64)
        for d in range(reached):
            end = self._ends[d]
            k = self._row(begin, end, False)
            _reserve(<void**>&self._hold, &self._hold_cap, total + k, sizeof(uint32_t), 256)
            for i in range(k):
                self._hold[total + i] = <uint32_t>self._out[i]
            total += k
            self._hends[d] = total
            begin = end
        return reached

    cdef list _scored(self, Py_ssize_t depths, double* w, allowed):
        """The runs of the walk in ``_hold`` / ``_hends``, under ``allowed`` (None, a callable or a byte
        memoryview: :func:`_holder_filter`)."""
        cdef const uint8_t[::1] view
        cdef size_t total = self._hends[depths - 1] if depths else 0
        cdef uint32_t* hold = NULL
        cdef size_t* ends = NULL
        cdef uint32_t* distinct = NULL
        cdef size_t i, n
        cdef bytearray verdicts
        if allowed is None:
            return self._score(self._hold, self._hends, depths, NULL, 0, False, w)
        if not callable(allowed):
            view = allowed
            return self._score(self._hold, self._hends, depths, &view[0] if view.shape[0] else NULL,
                               view.shape[0], True, w)
        # The callable runs Python code, which may query or change this table and so reuse its scratch: the
        # walk is copied out first, and the scoring (no Python code) runs on the copy once every verdict is in.
        hold = <uint32_t*>malloc((total + 1) * sizeof(uint32_t))
        ends = <size_t*>malloc((depths + 1) * sizeof(size_t))
        distinct = <uint32_t*>malloc((total + 1) * sizeof(uint32_t))
        try:
            if hold == NULL or ends == NULL or distinct == NULL:
                raise MemoryError()
            memcpy(hold, self._hold, total * sizeof(uint32_t))
            memcpy(ends, self._hends, depths * sizeof(size_t))
            memcpy(distinct, self._hold, total * sizeof(uint32_t))
            _sort_u32(distinct, total)
            n = 0
            for i in range(total):
                if n == 0 or distinct[i] != distinct[n - 1]:
                    distinct[n] = distinct[i]
                    n += 1
            # holders from MAX_INFO_ID on never have metadata (the scoring raises KeyError on reaching one,
            # before it reads a verdict): the verdicts stop there, whatever ids the table's links hold
            verdicts = bytearray(min(distinct[n - 1] + 1, MAX_INFO_ID) if n else 0)
            for i in range(n):
                if allowed(distinct[i]) and distinct[i] < MAX_INFO_ID:
                    verdicts[distinct[i]] = 1
            view = verdicts
            return self._score(hold, ends, depths, &view[0] if view.shape[0] else NULL, view.shape[0], True, w)
        finally:
            free(hold)
            free(ends)
            free(distinct)

    cdef uint32_t _next_stamp(self) noexcept:
        """A stamp no group state has: the previous one + 1, the states reset when the counter wraps."""
        cdef size_t g
        self._stamp += 1
        if self._stamp == 0:
            for g in range(self._gstate_n):
                self._gstate[g].stamp = 0
            self._stamp = 1
        return self._stamp

    cdef list _score(self, const uint32_t* hold, const size_t* ends, Py_ssize_t depths, const uint8_t* mask,
                     size_t mask_len, bint masked, double* w):
        """``scoring.runs_by_group``'s loop over a walk: per depth, the allowed holders mark their groups present
        (the tiers holding the block ORed per group), then each present group whose run reached this depth
        extends it; the first depth that extends none ends the loop. Runs are made at depth 0 only, in the
        order of their first holder (the holders are ascending), so the answer's order is the reference's."""
        cdef uint32_t stamp = self._next_stamp()
        cdef size_t nruns = 0, npresent, begin = 0, i
        cdef uint32_t h, g, d, bits, classes
        cdef int t
        cdef double best = 0
        cdef bint first
        cdef GState* gs
        cdef Run* run
        cdef list out
        for d in range(<uint32_t>depths):
            npresent = 0
            for i in range(begin, ends[d]):
                h = hold[i]
                if h >= self._info_n or self._info[h].tier == NO_TIER:
                    raise KeyError(f"holder {h} has no metadata: set_holder({h}, group, tier) first")
                if masked and (h >= mask_len or mask[h] == 0):
                    continue
                g = self._info[h].group
                gs = &self._gstate[g]
                if gs.stamp != stamp:
                    if d:
                        continue  # did not hold block 0: nothing it holds later counts
                    _reserve(<void**>&self._runs, &self._runs_cap, nruns + 1, sizeof(Run), 16)
                    _reserve(<void**>&self._present, &self._present_cap, nruns + 1, sizeof(uint32_t), 16)
                    gs.stamp = stamp
                    gs.run = <uint32_t>nruns
                    run = &self._runs[nruns]
                    memset(run, 0, sizeof(Run))
                    run.group = g
                    nruns += 1
                run = &self._runs[gs.run]
                if run.any != d:
                    continue  # its run ended earlier
                if run.mark != d + 1:
                    run.mark = d + 1
                    run.mask = 0
                    self._present[npresent] = gs.run
                    npresent += 1
                run.mask |= 1u << self._info[h].tier
            if npresent == 0:
                break  # every run has ended: deeper blocks change nothing
            for i in range(npresent):
                run = &self._runs[self._present[i]]
                run.any = d + 1
                bits = run.mask
                first = True
                classes = 0
                for t in range(NTIERS):
                    if bits >> t & 1:
                        # the largest weight of the tiers holding the block (bits is never 0); no NaN, which
                        # _load_weights refuses, so the order of the comparisons does not matter
                        if first or w[t] > best:
                            best = w[t]
                            first = False
                        classes |= TIER_PHASE_BITS[t]
                        if run.tiers[t] == d:
                            run.tiers[t] = d + 1
                run.score += best
                # scoring.advance_phases: GPU, then CPU, then disk, never back; a block the walk cannot read ends it
                if run.classes[2] == d:
                    if run.classes[0] == d and classes & 1:
                        run.classes[0] = run.classes[1] = run.classes[2] = d + 1
                    elif run.classes[1] == d and classes & 2:
                        run.classes[1] = run.classes[2] = d + 1
                    elif classes & 4:
                        run.classes[2] = d + 1
            begin = ends[d]
        out = []
        for i in range(nruns):
            run = &self._runs[i]
            out.append((run.group, run.any, run.score,
                        (run.tiers[0], run.tiers[1], run.tiers[2], run.tiers[3], run.tiers[4]),
                        (run.classes[0], run.classes[1], run.classes[2])))
        return out

    def holder_blocks(self, holder):
        """Blocks ``holder`` holds now (in any scope); 0 for a holder never seen. O(1)."""
        cdef uint32_t h = _u32(holder)
        cdef size_t i = _home(<uint32_t>(_mix(h) >> 32), self._h_cap)
        while self._holders[i].used:
            if self._holders[i].holder == h:
                return self._holders[i].count
            i += 1
            if i == self._h_cap:
                i = 0
        return 0

    def __len__(self):
        return self._nblocks

    @property
    def links(self):
        """Resident (block, scope, holder) links: a holder in two scopes of one block counts twice."""
        return self._nlinks

    def memory_bytes(self):
        """Bytes the table's arrays take (allocated capacity, scratch buffers included)."""
        return (self._rec_cap * sizeof(Rec) + (self._blocks.cap + self._content.cap) * sizeof(Slot)
                + self._pool_cap * sizeof(uint64_t) + self._h_cap * sizeof(HEnt)
                + (self._keys_cap + self._out_cap + self._match_cap) * sizeof(uint64_t)
                + (self._hbuf_cap + self._cand_cap + self._tags_cap + self._present_cap + self._hold_cap)
                * sizeof(uint32_t) + (self._ends_cap + self._hends_cap) * sizeof(size_t)
                + self._info_cap * sizeof(HInfo) + self._gstate_cap * sizeof(GState) + self._runs_cap * sizeof(Run))

    cdef tuple _item(self, size_t r):
        """Record ``r`` as ``items()`` gives it, its links sorted by (scope, holder)."""
        cdef Rec* rec = &self._recs[r]
        cdef uint64_t* links
        cdef uint32_t i, n = rec.n
        cdef tuple pairs
        _reserve(<void**>&self._out, &self._out_cap, n, sizeof(uint64_t), 64)
        rec = &self._recs[r]
        links = self._links(rec)
        for i in range(n):  # (scope, holder) order: swap the halves and sort
            self._out[i] = (links[i] << 32) | (links[i] >> 32)
        _sort_u64(self._out, n)
        pairs = PyTuple_New(n)
        for i in range(n):
            pair = (PyLong_FromUnsignedLong(<uint32_t>(self._out[i] >> 32)),
                    PyLong_FromUnsignedLong(<uint32_t>self._out[i]))
            Py_INCREF(pair)
            PyTuple_SET_ITEM(pairs, i, pair)
        return (rec.key, rec.parent if rec.flags & F_PARENT else None,
                rec.content if rec.flags & F_CONTENT else None, pairs)

    def items(self):
        """Every block as ``(block, parent | None, content | None, ((scope, holder), ...))``, its links sorted,
        the blocks in no particular order. Raises RuntimeError when the table changes during the iteration."""
        cdef uint64_t version = self._version
        cdef size_t r = 0
        while True:
            if self._version != version:
                raise RuntimeError("BlockTable changed during items()")
            if r >= self._nrecs:
                return
            if not self._recs[r].flags & F_DEAD:
                yield self._item(r)
            r += 1

    def __repr__(self):
        return f"BlockTable(blocks={self._nblocks}, links={self._nlinks})"
