# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""The residency entry as a compiled record, and the rules, the reader and the writer that work on it in place.

The Python reference keeps an entry as three levels of dicts (:mod:`stream_apps.residency.rules`). Here the
same values are three extension types whose fields are C slots: :class:`ResidencyEntry` (the table's value),
:class:`ResidencyRow` (one per residency identity) and :class:`WorkerCount` (one per worker of a row), field
for field the ``residency`` v3 Avro records of the same names (``schemas/residency_v3.avsc``). What works on
them, each the twin of a Python function with the same results:

- :func:`apply_block`: :func:`stream_apps.residency.rules.apply_block`, the per-event rule;
- ``_aggregate``, inside the rules: :func:`stream_apps.residency.rules.aggregate_copies`;
- :func:`read_entry`: the codec's decode of an entry of its own version, into records;
- :func:`encode_entry`: :meth:`schemas.avro_writers.ResidencyWriter.encode` of a record;
- :func:`apply_events`: the agent's loop over a batch message's block events with
  :meth:`stream_apps.applier.BatchApplier.apply` (:meth:`~stream_apps.applier.BatchApplier.apply_all`).

Why: every stage of the materializing agent that touches an entry (the rules, the store's decode on a cache
miss, the write-back's encode) spent most of its time building, looking up and walking the dicts, not on what
it computes (bench/PROFILE.md, "Sixth round"). A record's field is a C load, a new row one allocation instead of
five containers.

Everything else reads the records as mappings: ``entry["rows"]``, ``row["copies"] = 0`` and ``.get`` behave as
on the dicts (a record is registered as a ``MutableMapping``), so the rare source-wide rules (clears, restarts,
unregistrations), the HTTP views and the exports run unchanged on either form; :meth:`ResidencyEntry.as_dict`
gives the dicts themselves. A record compares equal to the dicts of the same values.

The records are not tracked by Python's cyclic garbage collector (``cython.no_gc``). They hold strings, bytes,
numbers, None and lists of records, so no reference cycle runs through them unless a caller puts a container
that refers back to its record in a field (it would then never be freed). A worker keeps some 10^5 of them in
its entry cache and its pending writes, and every young collection scanned and moved the ones made since the
last. Their lists of rows and of workers are left out too (``_untracked``): they hold only records. A RocksDB
worker's collector pauses over the bench's whole trace fell from about 3 s to 0.3-0.6 s
(``kvstream_gc_pause_seconds``; bench/PROFILE.md, fourteenth round).

The clear mark is kept as three integers and a flag (``ClearMark`` is a ``["null", record]``); as a mapping it
reads as :func:`schemas.clear_position.clear_mark_record` gives it. Built by setup.py next to ``schemas._hotpath``;
:mod:`stream_apps.residency.records` chooses between it and the dicts.
"""

cimport cython
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.mem cimport PyMem_Free
from libc.stdint cimport INT32_MAX, INT32_MIN, int64_t, uint8_t

cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void* op)

from schemas._avro cimport (
    Buffer,
    Cursor,
    _intern_table,
    _long_of,
    _open_buffer,
    _put,
    _put_branch,
    _put_byte,
    _put_bytes,
    _put_double,
    _put_long,
    _put_string,
    _put_symbol,
    _read_branch,
    _read_bytes,
    _read_count,
    _read_double,
    _read_interned,
    _read_long,
    _read_symbol,
)

from collections.abc import MutableMapping

from schemas import BLOCK_STORED_OR_REUSED, STORE_KINDS
from schemas.clear_position import clear_mark_record


# ---------------------------------------------------------------------------------------------------------
# The records

cdef inline list _untracked(list items):
    """``items``, left out of the cyclic collector: a record's list of rows or of workers holds only records,
    which are not tracked either, so no cycle runs through it (the module's docstring says why it matters).
    A container put in it later is still freed by reference counting; only a cycle through it would stay."""
    PyObject_GC_UnTrack(<void*>items)
    return items


cdef inline object _int(object value):
    """``value`` if it is an int (a bool is one, as in the dicts' writer); TypeError for anything else, which a C
    field would otherwise truncate silently (a float: Cython converts it as ``int()`` does) or refuse with another
    error (NaN)."""
    if not isinstance(value, int):
        raise TypeError(f"an int field holds {type(value).__name__} {value!r}")
    return value


cdef class _Record:
    """What the three records share: their fields read and written as a mapping, as the dicts' keys."""

    #: The Avro record's field names, in its order: the mapping's keys.
    FIELDS = ()
    #: The fields held in C integers, which take only an int (:func:`_int`).
    INT_FIELDS = frozenset()

    def __getitem__(self, key):
        if key in type(self).FIELDS:
            return getattr(self, key)
        raise KeyError(key)

    def __setitem__(self, key, value):
        """``record[key] = value``, as on the dicts, except that an int field takes only an int (TypeError; an
        OverflowError for one its C integer cannot hold), and a row's ``since`` and ``last_ts`` only a number (held
        as a double: TypeError for anything else, None for ``since`` aside). ``from_dict`` sets every field
        through here."""
        cls = type(self)
        if key not in cls.FIELDS:
            raise KeyError(key)
        setattr(self, key, _int(value) if key in cls.INT_FIELDS else value)

    def __delitem__(self, key):
        raise TypeError(f"{type(self).__name__} has a fixed set of fields; {key!r} cannot be deleted")

    def get(self, key, default=None):
        return getattr(self, key) if key in type(self).FIELDS else default

    def __contains__(self, key):
        return key in type(self).FIELDS

    def __iter__(self):
        return iter(type(self).FIELDS)

    def __len__(self):
        return len(type(self).FIELDS)

    def keys(self):
        return list(type(self).FIELDS)

    def values(self):
        return [getattr(self, key) for key in type(self).FIELDS]

    def items(self):
        return [(key, getattr(self, key)) for key in type(self).FIELDS]

    def as_dict(self):
        raise NotImplementedError

    def __eq__(self, other):
        if isinstance(other, _Record):
            other = other.as_dict()
        if isinstance(other, dict):
            return self.as_dict() == other
        return NotImplemented

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None

    def __repr__(self):
        return f"{type(self).__name__}({self.as_dict()!r})"

    def __copy__(self):
        return self.__deepcopy__(None)

    def __deepcopy__(self, memo):
        return type(self).from_dict(self.as_dict())

    def __reduce__(self):
        return (_from_dict_of, (type(self).__name__, self.as_dict()))


@cython.no_gc
cdef class WorkerCount(_Record):
    """One worker's view of a row (``residency`` ``WorkerCount``)."""

    FIELDS = ("worker_rank", "count", "publisher_epoch", "seq", "batch_index", "block_index", "content")
    INT_FIELDS = frozenset(FIELDS[:6])

    #: The worker's rank; -1 for a publisher without worker rank (the engine's scheduler).
    cdef public int worker_rank
    #: Stores minus applied removals reported by this worker (never below 0).
    cdef public int count
    #: Publisher epoch, batch seq, index in the batch and index in the block run of the last event applied from
    #: this worker: a redelivered event at or before it changes nothing.
    cdef public int64_t publisher_epoch
    cdef public int64_t seq
    cdef public int batch_index
    cdef public int block_index
    #: Content digest of the worker's last store (:func:`stream_apps.residency.content_digest`): an int for rows
    #: of a REPLICATED source with world size above 1, else None.
    cdef public object content

    @staticmethod
    def from_dict(dict worker):
        return _filled(WorkerCount.__new__(WorkerCount), worker)

    def as_dict(self):
        return {"worker_rank": self.worker_rank, "count": self.count, "publisher_epoch": self.publisher_epoch,
                "seq": self.seq, "batch_index": self.batch_index, "block_index": self.block_index,
                "content": self.content}


@cython.no_gc
cdef class ResidencyRow(_Record):
    """The residency of one block on one tier of one source (``residency`` ``ResidencyRow``)."""

    FIELDS = ("instance_id", "data_parallel_rank", "tier", "medium", "locality", "group_idx", "world_size",
              "aggregation", "workers", "copies", "since", "last_ts", "clear_mark")
    INT_FIELDS = frozenset({"data_parallel_rank", "world_size", "copies"})

    #: Serving instance holding the block (str).
    cdef public object instance_id
    #: Data-parallel rank of the engine core holding the block.
    cdef public int data_parallel_rank
    #: Canonical tier: one of ``schemas.TIERS``.
    cdef public object tier
    #: Raw medium string of the last event applied; None from the GPU block pool.
    cdef public object medium
    #: ``LOCAL`` or ``REMOTE`` relative to the instance; None when unspecified.
    cdef public object locality
    #: KV cache group index; None when the engine sets none.
    cdef public object group_idx
    #: Workers whose reports aggregate into :attr:`copies` (1: no aggregation).
    cdef public int world_size
    #: ``REPLICATED`` or ``SHARDED``: how the workers' counts aggregate.
    cdef public object aggregation
    #: The workers' :class:`WorkerCount` records.
    cdef public list workers
    #: Physical copies resident: the workers' counts aggregated; the row is resident while above 0.
    cdef public int copies
    #: Engine time (seconds since the Unix epoch) at which the row last became resident, if it is resident
    #: (``_has_since``); the mapping's ``since``, None while not. C doubles, not float objects: each row of a decoded
    #: entry allocates two objects and 48 bytes less.
    cdef bint _has_since
    cdef double _since
    #: Engine time (seconds since the Unix epoch) of the last event applied to the row; the mapping's ``last_ts``.
    cdef double _last_ts
    #: The source's latest AllBlocksCleared before the row's last event: whether there is one, and its
    #: ``(publisher_epoch, seq, batch_index)``. The mapping's ``clear_mark``.
    cdef public bint has_mark
    cdef public int64_t mark_epoch
    cdef public int64_t mark_seq
    cdef public int mark_batch

    @property
    def since(self):
        """Engine time (a float) at which the row last became resident; None while it is not."""
        return self._since if self._has_since else None

    @since.setter
    def since(self, value):
        if value is None:
            self._has_since = False
            self._since = 0.0
        else:
            self._since = value  # a number, or TypeError
            self._has_since = True

    @property
    def last_ts(self):
        """Engine time (a float) of the last event applied to the row."""
        return self._last_ts

    @last_ts.setter
    def last_ts(self, value):
        self._last_ts = value  # a number, or TypeError (None included: the field has no null)

    @property
    def clear_mark(self):
        """The ``ClearMark`` record (shared, :func:`schemas.clear_position.clear_mark_record`), or None."""
        if not self.has_mark:
            return None
        return clear_mark_record((self.mark_epoch, self.mark_seq, self.mark_batch))

    @clear_mark.setter
    def clear_mark(self, mark):
        if mark is None:
            self.has_mark = False
            self.mark_epoch = self.mark_seq = self.mark_batch = 0
        else:
            self.has_mark = True
            self.mark_epoch, self.mark_seq, self.mark_batch = (_int(mark["publisher_epoch"]), _int(mark["seq"]),
                                                               _int(mark["batch_index"]))

    @staticmethod
    def from_dict(dict row):
        cdef ResidencyRow record = <ResidencyRow>_filled(ResidencyRow.__new__(ResidencyRow), row, "workers")
        record.workers = _untracked([worker if type(worker) is WorkerCount else WorkerCount.from_dict(worker)
                                     for worker in row["workers"]])
        return record

    def as_dict(self):
        return {"instance_id": self.instance_id, "data_parallel_rank": self.data_parallel_rank, "tier": self.tier,
                "medium": self.medium, "locality": self.locality, "group_idx": self.group_idx,
                "world_size": self.world_size, "aggregation": self.aggregation,
                "workers": [worker.as_dict() for worker in self.workers], "copies": self.copies,
                "since": self.since, "last_ts": self.last_ts, "clear_mark": self.clear_mark}


@cython.no_gc
cdef class ResidencyEntry(_Record):
    """The residency table's value for one key, ``<ownership or primary>/<block hash hex>`` (``residency``
    ``ResidencyEntry``)."""

    FIELDS = ("block_hash", "ownership", "rows", "parent_block_hash", "content_hash")

    #: Canonical block hash (bytes).
    cdef public object block_hash
    #: Secondary offloading tier that owns the rows (vLLM PR #52067); None for the framework's own tiers.
    cdef public object ownership
    #: The :class:`ResidencyRow` records, one per residency identity holding the block.
    cdef public list rows
    #: Content keys from the latest applied store that had a content hash (bytes or None, an int or None).
    cdef public object parent_block_hash
    cdef public object content_hash

    @staticmethod
    def from_dict(dict entry):
        return from_dict(entry)

    def as_dict(self):
        return {"block_hash": self.block_hash, "ownership": self.ownership,
                "rows": [row.as_dict() for row in self.rows], "parent_block_hash": self.parent_block_hash,
                "content_hash": self.content_hash}


def from_dict(dict entry):
    """The :class:`ResidencyEntry` of a decoded ``residency`` entry (the codec's dicts; rows or workers that are
    records already are kept).

    Raises:
        KeyError: a field is missing; TypeError, OverflowError: a value that does not fit its field.
    """
    cdef ResidencyEntry record = <ResidencyEntry>_filled(ResidencyEntry.__new__(ResidencyEntry), entry, "rows")
    record.rows = _untracked([row if type(row) is ResidencyRow else ResidencyRow.from_dict(row)
                              for row in entry["rows"]])
    return record


cdef _Record _filled(_Record record, dict values, str nested=None):
    """``record`` with every field but ``nested`` (a list of records, which the caller makes) set from ``values``
    through the mapping's checks (``_Record.__setitem__``)."""
    for key in type(record).FIELDS:
        if key != nested:
            record[key] = values[key]
    return record


def _from_dict_of(str name, dict values):
    """Unpickling: the record named ``name`` from its :meth:`as_dict`."""
    return {"ResidencyEntry": ResidencyEntry, "ResidencyRow": ResidencyRow, "WorkerCount": WorkerCount}[
        name].from_dict(values)


for _type in (ResidencyEntry, ResidencyRow, WorkerCount):
    MutableMapping.register(_type)


# ---------------------------------------------------------------------------------------------------------
# The rules

cdef inline bint _before(int64_t a0, int64_t a1, int64_t a2, int64_t b0, int64_t b1, int64_t b2) noexcept:
    """``(a0, a1, a2) < (b0, b1, b2)``, as tuples compare."""
    if a0 != b0:
        return a0 < b0
    if a1 != b1:
        return a1 < b1
    return a2 < b2


cdef int _aggregate(list workers, int world_size, object mode) except? -1:
    """:func:`stream_apps.residency.rules.aggregate_copies` over :class:`WorkerCount` records."""
    cdef WorkerCount worker, other
    cdef int total = 0, rank, count, lowest
    cdef Py_ssize_t i
    if world_size <= 1 or mode == "SHARDED":
        for worker in workers:
            total += worker.count
        return total
    first_content = None
    for worker in workers:
        if worker.count and worker.content is not None:
            if first_content is None:
                first_content = worker.content
            elif worker.content != first_content:
                return 0  # the workers hold different blocks under one hash: not agreement
    lowest = 0
    for rank in range(world_size):
        count = 0
        for i in range(len(workers) - 1, -1, -1):  # the last worker of a rank counts, as a dict keeps the last
            other = <WorkerCount>workers[i]
            if other.worker_rank == rank:
                count = other.count
                break
        if rank == 0 or count < lowest:
            lowest = count
    return lowest


def apply_block(entry, event, clear_mark, clear_watermark, clear_tiers, stats, aggregation):
    """:func:`stream_apps.residency.rules.apply_block` on a :class:`ResidencyEntry`, which it changes in place:
    the same arguments (``entry`` None, a record, or the dicts, which are made a record first), the same
    ``(entry or None, delta, copies)``, the same counters in ``stats``.

    Raises:
        TypeError, OverflowError: a field of ``event`` that does not fit its record field (an Avro ``int`` beyond
            32 bits, a ``ts`` that is not a number); the entry may then be half changed, as the Python rules would
            leave it half changed by an exception.
    """
    return _apply_block(entry, event, clear_mark, clear_watermark, clear_tiers, stats, aggregation)


cdef tuple _apply_block(entry, event, clear_mark, clear_watermark, clear_tiers, stats, aggregation):
    cdef ResidencyEntry record
    cdef ResidencyRow row = None, candidate
    cdef WorkerCount worker = None, other
    cdef list rows, workers
    cdef int64_t epoch, seq, m_epoch, m_seq, w_epoch, w_seq
    cdef int batch_index, block_index, m_batch, rank, world_size, before, after, delta
    cdef int dp_rank
    cdef Py_ssize_t i
    cdef bint in_clear_scope, replicated, found
    (kind, source, epoch_object, seq_object, batch_object, block_object, ts, block_hash, tier, medium, locality,
     group, ownership, parent_known, content, parent_block_hash, content_hash) = event
    if type(entry) is dict:
        entry = from_dict(entry)
    m_epoch, m_seq, m_batch = clear_mark
    in_clear_scope = tier in clear_tiers
    if in_clear_scope:
        w_epoch, w_seq, rank = clear_watermark
        if _before(m_epoch, m_seq, m_batch, w_epoch, w_seq, rank):
            stats.cleared_late += 1
            return entry, 0, 0
    if tier == "UNKNOWN":
        stats.unknown_media[medium] = stats.unknown_media.get(medium, 0) + 1

    instance, dp_rank_object, worker_rank, _, _ = source
    dp_rank = dp_rank_object
    if entry is None:
        record = None
        rows = _untracked([])
    else:
        record = <ResidencyEntry?>entry
        rows = record.rows
    for candidate in rows:
        if (candidate.data_parallel_rank == dp_rank and candidate.tier == tier and candidate.instance_id == instance
                and candidate.locality == locality and candidate.group_idx == group):
            row = candidate
            break
    size_object, mode = aggregation
    world_size = size_object
    epoch, seq, batch_index, block_index = epoch_object, seq_object, batch_object, block_object
    if row is None:
        if kind not in STORE_KINDS:
            stats.unknown_removals += 1
            return record, 0, 0
        # A new row (most events of a trace): its one worker's first store, written once with its final values.
        replicated = world_size > 1 and mode == "REPLICATED"
        worker = WorkerCount.__new__(WorkerCount)
        worker.worker_rank = -1 if worker_rank is None else worker_rank
        worker.count = 1
        worker.publisher_epoch = epoch
        worker.seq = seq
        worker.batch_index = batch_index
        worker.block_index = block_index
        worker.content = content if replicated else None
        row = ResidencyRow.__new__(ResidencyRow)
        row.workers = _untracked([worker])
        after = _aggregate(row.workers, world_size, mode) if replicated else 1
        row.instance_id = instance
        row.data_parallel_rank = dp_rank
        row.tier = tier
        row.medium = medium
        row.locality = locality
        row.group_idx = group
        row.world_size = world_size
        row.aggregation = mode
        row.copies = after
        row._has_since = after > 0
        row._since = ts if after > 0 else 0.0
        row._last_ts = ts
        _set_mark(row, m_epoch, m_seq, m_batch)
        rows.append(row)
        stats.applied += 1
        if parent_known is False:
            stats.unknown_parents += 1
        if after > 0:
            stats.became_resident += 1
        if record is None:
            record = ResidencyEntry.__new__(ResidencyEntry)
            record.block_hash = block_hash
            record.ownership = ownership
            record.rows = rows
            record.parent_block_hash = None if content_hash is None else parent_block_hash
            record.content_hash = content_hash
        elif content_hash is not None:
            record.parent_block_hash = parent_block_hash
            record.content_hash = content_hash
        return record, (1 if after > 0 else 0), after

    before = row.copies
    workers = row.workers
    if row.has_mark:
        w_epoch, w_seq, rank = row.mark_epoch, row.mark_seq, row.mark_batch
    else:
        w_epoch = w_seq = rank = -1  # NO_CLEAR, what ClearPosition.of(None) gives
    if workers and in_clear_scope and _before(w_epoch, w_seq, rank, m_epoch, m_seq, m_batch):
        # A clear of the source came between the row's last event and this one: it emptied the row (see the
        # Python rules for why the delta reported here covers both).
        for other in workers:
            other.count = 0
        row.copies = 0
        row._has_since = False

    rank = -1 if worker_rank is None else worker_rank
    for other in workers:
        if other.worker_rank == rank:
            worker = other
            break
    if worker is None:
        worker = WorkerCount.__new__(WorkerCount)
        worker.worker_rank = rank
        worker.count = 0
        worker.publisher_epoch = worker.seq = -1
        worker.batch_index = worker.block_index = -1
        worker.content = None
        workers.append(worker)
    elif not (_before(worker.publisher_epoch, worker.seq, worker.batch_index, epoch, seq, batch_index)
              or (epoch == worker.publisher_epoch and seq == worker.seq and batch_index == worker.batch_index
                  and block_index > worker.block_index)):
        stats.duplicates += 1  # at or before the worker's last position
        return record, 0, row.copies
    elif epoch > worker.publisher_epoch:
        worker.count = 0  # a new epoch is a restarted publisher, whose cache started empty

    row.world_size = world_size
    row.aggregation = mode
    if kind in STORE_KINDS:
        if kind == BLOCK_STORED_OR_REUSED and worker.count > 0:
            stats.reuse_reports += 1  # full report mode: an announcement of a reused block, not a copy
        else:
            worker.count += 1
        if content_hash is not None:
            record.parent_block_hash = parent_block_hash
            record.content_hash = content_hash
        if parent_known is False:
            stats.unknown_parents += 1
        if world_size > 1 and mode == "REPLICATED":
            worker.content = content
            for other in workers:
                if other is not worker and other.count and other.content is not None and other.content != content:
                    stats.replica_disagreements += 1
                    break
    elif worker.count > 0:
        worker.count -= 1
    else:
        stats.unknown_removals += 1
    worker.publisher_epoch = epoch
    worker.seq = seq
    worker.batch_index = batch_index
    worker.block_index = block_index
    stats.applied += 1
    row.medium = medium
    row._last_ts = ts
    _set_mark(row, m_epoch, m_seq, m_batch)
    if len(workers) == 1 and (world_size <= 1 or mode == "SHARDED"):
        after = worker.count
    else:
        after = _aggregate(workers, world_size, mode)
    row.copies = after
    delta = 0
    if after > 0 and not row._has_since:
        row._has_since = True  # resident anew (also after a clear emptied it)
        row._since = ts
    if before == 0 and after > 0:
        stats.became_resident += 1
        delta = 1
    elif before > 0 and after == 0:
        row._has_since = False
        stats.stopped_resident += 1
        delta = -1
    found = False
    for other in workers:
        if other.count:
            found = True
            break
    if not found:  # no worker has a count left: the row goes (by identity; records compare by value)
        for i in range(len(rows)):
            if rows[i] is row:
                del rows[i]
                break
    return (record if rows else None), delta, after


cdef inline void _set_mark(ResidencyRow row, int64_t epoch, int64_t seq, int batch_index) noexcept:
    """The row's clear mark from a position; ``NO_CLEAR`` (-1, -1, -1) is no mark, as ``clear_mark_record``
    makes it None."""
    if epoch == -1 and seq == -1 and batch_index == -1:
        row.has_mark = False
        row.mark_epoch = row.mark_seq = row.mark_batch = 0
    else:
        row.has_mark = True
        row.mark_epoch = epoch
        row.mark_seq = seq
        row.mark_batch = batch_index


# ---------------------------------------------------------------------------------------------------------
# A batch message's block events

# Positions of the BlockEvent fields read here (schemas.block_event.BlockEvent; EVENT_FIELDS below, which the
# tests compare with it).
cdef enum:
    _KIND = 0
    _SOURCE = 1
    _EPOCH = 2
    _TS = 6
    _BLOCK_HASH = 7
    _TIER = 8
    _MEDIUM = 9
    _LOCALITY = 10
    _GROUP = 11
    _OWNERSHIP = 12
    _CONTENT = 14

#: The BlockEvent field at each position :func:`apply_events` reads.
EVENT_FIELDS = {_KIND: "kind", _SOURCE: "source", _EPOCH: "publisher_epoch", _TS: "ts", _BLOCK_HASH: "block_hash",
                _TIER: "tier", _MEDIUM: "medium", _LOCALITY: "locality", _GROUP: "group_idx",
                _OWNERSHIP: "ownership", _CONTENT: "content"}


def apply_events(list items not None, Py_ssize_t partition, dict sources not None, source_state, dict touched not None,
                 set new_keys not None, dict publishers not None, occupancy, store_entry, stats, outputs, dict causes,
                 apply_other):
    """The compiled twin of the agent's loop over one ``ownership_batch`` message's items with
    :meth:`stream_apps.applier.BatchApplier.apply` (see :meth:`~stream_apps.applier.BatchApplier.apply_all`, which
    passes the applier's state): every block event read with its fields is applied as that method applies it,
    with the record rules, in the items' order.

    An item it does not apply, ``apply_other(item, None)`` applies the Python way: a record (not a tuple), and a
    store of a replicated source without its content digest (``NeedsRecord`` in the Python method; nothing was
    changed). An exception in an item's apply goes to ``apply_other(item, exception)``, which dead-letters it or
    raises; what it raises ends the loop.
    """
    cdef Py_ssize_t i, n = len(items)
    cdef tuple item, event, state
    emit_changes = outputs.residency_changes
    for i in range(n):
        item = <tuple>items[i]
        key, mark, event_object = item[0], item[1], item[5]
        if type(event_object) is not tuple:
            apply_other(item, None)
            continue
        event = <tuple>event_object
        try:
            source = event[_SOURCE]
            state = sources.get(source)
            if state is None:
                state = source_state(source)
            _, publisher, watermark, retired, clear_tiers, aggregation, replicated = state
            if replicated and event[_CONTENT] is None and event[_KIND] in STORE_KINDS:
                apply_other(item, None)  # the Python method raises NeedsRecord here, and the record is applied
                continue
            if retired is not None and event[_EPOCH] < retired:
                stats.retired_late += 1
                continue
            entry = touched.get(key, touched)  # the dict itself: absent (an entry may be None, a deleted one)
            if entry is touched:
                entry = store_entry(partition, key)
                if entry is None:
                    new_keys.add(key)
            applied_before = stats.applied
            entry, delta, copies = _apply_block(entry, event, mark, watermark, clear_tiers, stats, aggregation)
            touched[key] = entry
            if stats.applied != applied_before:
                seen = publishers.get(publisher)
                if seen is None:
                    publishers[publisher] = [event, 1]
                else:
                    seen[0] = event
                    seen[1] += 1
            if delta:
                kind = event[_KIND]
                occupancy[(event[_OWNERSHIP], event[_TIER], source[0])] += delta
                if emit_changes:
                    outputs.change(event[_BLOCK_HASH], event[_OWNERSHIP], source[0], source[1], event[_TIER],
                                   event[_MEDIUM], event[_LOCALITY], event[_GROUP], delta > 0, copies, event[_TS],
                                   causes.get(kind) or kind.rpartition(".")[2])
        except Exception as exc:
            apply_other(item, exc)


# ---------------------------------------------------------------------------------------------------------
# Reading and writing the Avro bytes

cdef inline int _int_of(int64_t value, Cursor* c) except? -1:
    """An Avro ``int``: refused beyond 32 bits (a C field holds it; the codec's dicts would take it)."""
    if value < INT32_MIN or value > INT32_MAX:
        raise ValueError(f"int {value} out of range before {c.pos}")
    return <int>value


cdef inline list _sized(list items, int64_t count, Cursor* c):
    """``items``, or for an array's first block (``items`` None) a list of ``count`` Nones to fill with
    :func:`_place`. Why: a list made at its size instead of grown by appends, which leave room for more, is 24
    bytes less per list kept in the entry cache (a writer of ours writes an array as one block).

    Raises:
        ValueError: a count beyond the bytes left (every item takes some), before a list is made of it.
    """
    if items is not None:
        return items
    if count > c.size - c.pos:
        raise ValueError(f"array count {count} beyond the record at {c.pos}")
    return _untracked([None] * count)


cdef inline Py_ssize_t _place(list items, Py_ssize_t filled, object item) except -1:
    """Put ``item`` after the ``filled`` first items of a list from :func:`_sized` (appended past its size: a
    later block); returns the new ``filled``."""
    if filled < len(items):
        items[filled] = item
    else:
        items.append(item)
    return filled + 1


#: The strings an entry repeats in every row, one intern table each (``_read_interned``).
cdef list _OWNERSHIPS = _intern_table()
cdef list _INSTANCES = _intern_table()
cdef list _MEDIA = _intern_table()
cdef list _LOCALITIES = _intern_table()


def read_entry(bytes data not None, Py_ssize_t pos, tuple tiers not None, tuple aggregations not None):
    """The :class:`ResidencyEntry` of a ``residency`` v3 body that starts at ``pos`` and ends with ``data``: the
    values the codec's generated reader gives (:meth:`schemas.AvroCodec.decode`), as records.

    Every field is checked as the generated reader checks it (lengths, UTF-8, union branches, enum indices,
    varints, no trailing bytes); an ``int`` beyond 32 bits, which the dicts would hold, is refused too.
    ``tiers`` and ``aggregations``: the Tier and AggregationMode symbols, in order.

    Raises:
        ValueError (UnicodeDecodeError included), IndexError: bytes that are not such a record; the caller then
        decodes them with the codec, which names the fault or resolves another version.
    """
    cdef Cursor cursor
    cdef Cursor* c = &cursor
    cdef int64_t count, n_workers
    cdef ResidencyEntry entry = ResidencyEntry.__new__(ResidencyEntry)
    cdef ResidencyRow row
    cdef WorkerCount worker
    cdef list rows = None, workers
    cdef Py_ssize_t filled, n_filled
    if pos < 0 or pos > len(data):
        raise IndexError("start outside the data")
    c.data = <const uint8_t*><const char*>data
    c.size = len(data)
    c.pos = pos
    entry.block_hash = _read_bytes(c)
    entry.ownership = _read_interned(c, _OWNERSHIPS) if _read_branch(c) else None
    filled = 0
    while True:
        count = _read_count(c)
        if count == 0:
            break
        rows = _sized(rows, count, c)
        while count:
            count -= 1
            row = ResidencyRow.__new__(ResidencyRow)
            row.instance_id = _read_interned(c, _INSTANCES)
            row.data_parallel_rank = _int_of(_read_long(c), c)
            row.tier = _read_symbol(c, tiers)
            row.medium = _read_interned(c, _MEDIA) if _read_branch(c) else None
            row.locality = _read_interned(c, _LOCALITIES) if _read_branch(c) else None
            row.group_idx = _int_of(_read_long(c), c) if _read_branch(c) else None
            row.world_size = _int_of(_read_long(c), c)
            row.aggregation = _read_symbol(c, aggregations)
            workers = None
            n_filled = 0
            while True:
                n_workers = _read_count(c)
                if n_workers == 0:
                    break
                workers = _sized(workers, n_workers, c)
                while n_workers:
                    n_workers -= 1
                    worker = WorkerCount.__new__(WorkerCount)
                    worker.worker_rank = _int_of(_read_long(c), c)
                    worker.count = _int_of(_read_long(c), c)
                    worker.publisher_epoch = _read_long(c)
                    worker.seq = _read_long(c)
                    worker.batch_index = _int_of(_read_long(c), c)
                    worker.block_index = _int_of(_read_long(c), c)
                    worker.content = _read_long(c) if _read_branch(c) else None
                    n_filled = _place(workers, n_filled, worker)
            row.workers = _untracked([]) if workers is None else workers
            row.copies = _int_of(_read_long(c), c)
            if _read_branch(c):
                row._has_since = True
                row._since = _read_double(c)
            row._last_ts = _read_double(c)
            if _read_branch(c):
                row.has_mark = True
                row.mark_epoch = _read_long(c)
                row.mark_seq = _read_long(c)
                row.mark_batch = _int_of(_read_long(c), c)
            filled = _place(rows, filled, row)
    entry.rows = _untracked([]) if rows is None else rows
    entry.parent_block_hash = _read_bytes(c) if _read_branch(c) else None
    entry.content_hash = _read_long(c) if _read_branch(c) else None
    if c.pos != c.size:
        raise ValueError(f"{c.size - c.pos} trailing bytes")
    return entry


cdef int _put_entry(Buffer* out, ResidencyEntry entry, dict tiers, dict aggregations) except -1:
    cdef ResidencyRow row
    cdef WorkerCount worker
    _put_bytes(out, entry.block_hash)
    if _put_branch(out, entry.ownership):
        _put_string(out, entry.ownership)
    if entry.rows:
        _put_long(out, len(entry.rows))
        for row in entry.rows:
            _put_string(out, row.instance_id)
            _put_long(out, row.data_parallel_rank)
            _put_symbol(out, tiers, row.tier)
            if _put_branch(out, row.medium):
                _put_string(out, row.medium)
            if _put_branch(out, row.locality):
                _put_string(out, row.locality)
            if _put_branch(out, row.group_idx):
                _put_long(out, _long_of(row.group_idx))
            _put_long(out, row.world_size)
            _put_symbol(out, aggregations, row.aggregation)
            if row.workers:
                _put_long(out, len(row.workers))
                for worker in row.workers:
                    _put_long(out, worker.worker_rank)
                    _put_long(out, worker.count)
                    _put_long(out, worker.publisher_epoch)
                    _put_long(out, worker.seq)
                    _put_long(out, worker.batch_index)
                    _put_long(out, worker.block_index)
                    if _put_branch(out, worker.content):
                        _put_long(out, _long_of(worker.content))
            _put_byte(out, 0)  # end of workers
            _put_long(out, row.copies)
            _put_byte(out, 2 if row._has_since else 0)
            if row._has_since:
                _put_double(out, row._since)
            _put_double(out, row._last_ts)
            _put_byte(out, 2 if row.has_mark else 0)
            if row.has_mark:
                _put_long(out, row.mark_epoch)
                _put_long(out, row.mark_seq)
                _put_long(out, row.mark_batch)
    _put_byte(out, 0)  # end of rows
    if _put_branch(out, entry.parent_block_hash):
        _put_bytes(out, entry.parent_block_hash)
    if _put_branch(out, entry.content_hash):
        _put_long(out, _long_of(entry.content_hash))
    return 0


def encode_entry(ResidencyEntry entry not None, bytes header not None, dict tiers not None,
                 dict aggregations not None):
    """``entry`` as a ``residency`` v3 record with its framing ``header``, byte for byte as
    :meth:`schemas.avro_writers.ResidencyWriter.encode` writes its dicts; None when a field holds a value of
    another type than the agent writes (a bool or float where an int belongs, an unknown enum symbol, a long
    beyond 64 bits, a lone surrogate; the times are C doubles already): the caller then has the Python writer encode
    ``entry.as_dict()``, which raises what it raises.

    ``tiers`` and ``aggregations``: enum symbol -> its encoded index (``ResidencyWriter.tier`` and
    ``.aggregation``).
    """
    cdef Buffer out
    _open_buffer(&out, 256)
    try:
        _put(&out, <const char*>header, len(header))
        _put_entry(&out, entry, tiers, aggregations)
        return PyBytes_FromStringAndSize(out.data, out.size)
    except (TypeError, OverflowError, KeyError, UnicodeEncodeError):
        return None
    finally:
        PyMem_Free(out.data)
