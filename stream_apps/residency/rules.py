"""The residency rules: what one event does to a block's residency.

No Kafka and no Faust here, so tests can call these directly; the materializing
agent (:mod:`stream_apps.materialize`, :mod:`stream_apps.applier`) decodes events,
calls these and writes the tables.

The residency table is keyed by ``<ownership>/<block hash hex>`` (``primary``
for the framework's own tiers, i.e. ownership null). Its value, an *entry*, holds
one *row* per residency identity (docs/residency.md, "Residency identity"):
(instance, data-parallel rank, tier, locality, group) -- ownership and block
hash are in the key. A row keeps

* per-worker reference counts (stores minus applied removals) and the position
  ``(publisher_epoch, seq, batch_index, block_index)`` of the last event applied
  from that worker, so a redelivered event changes nothing (idempotency is per
  row, because events of one source reach a row through one upstream partition
  in order, but interleave freely across rows after re-keying). A row dropped at
  count 0 forgets its positions; that is safe because Kafka redelivers the whole
  rest of a partition in order, so a replayed store is followed by its replayed
  removal;
* ``copies``: the workers' counts aggregated by the source's mode --
  ``world_size`` 1: the count; ``REPLICATED``: the minimum over all
  ``world_size`` workers (a worker that reported nothing counts 0, so one
  worker's duplicate is not agreement), and 0 while workers stored different
  content under the hash (:data:`AGREEMENT_FIELDS`); ``SHARDED``: the sum;
* per-worker epochs: a worker's count restarts from 0 when an event of a newer
  ``publisher_epoch`` arrives (a restarted publisher's cache starts empty), and
  :func:`retire_epoch` zeroes the counts of rows the new epoch has not touched;
* ``clear_mark``: the position of the source's last ``AllBlocksCleared`` that
  preceded the row's last event upstream. The stream app stamps every event with
  its source's latest clear as seen on its upstream partition, so a row can tell
  whether a clear happened between two of its events even when the clear's copy
  reaches this partition late (see :func:`apply_block_event`).

A row is resident while ``copies > 0``; it is dropped once every worker's count
is 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from hashlib import blake2b

import schemas.compiled
from schemas import BLOCK_STORED_OR_REUSED, STORE_KINDS
from schemas.block_event import block_event_of
from schemas.clear_position import ClearPosition, clear_mark_record
from schemas.content_hash import record_engine, stored_content_hash

#: BlockStored fields on which the workers of a REPLICATED source must agree for a block to count as
#: resident: every field of the event body but ``parent_known``, which our producer derives from its own
#: view. vLLM's ``KVEventAggregator`` publishes an event only when every worker reported an equal event,
#: and its events compare every field (docs/residency.md, "Replicated agreement"). The identity fields
#: (tier, locality, group, ownership, block hash, instance, data-parallel rank) select the row, so they
#: agree by construction. ``content_hash`` (kv_event v4) is last: see :func:`content_digest`.
AGREEMENT_FIELDS = ("parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys",
                    "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "session_id", "lookahead_token_ids",
                    "cache_salt", "token_id_width", "content_hash")


#: What the digest is made of whatever the content hash: every agreement field but the content hash.
_DIGEST_FIELDS = AGREEMENT_FIELDS[:-1]


def content_digest(body: dict, engine: str = "vllm") -> int:
    """Digest of a BlockStored body's :data:`AGREEMENT_FIELDS`: a signed 64-bit int (Avro long).

    Stable across processes (a BLAKE2b digest of the fields' ``repr``, not Python's salted ``hash``),
    because it is stored in the residency changelog and compared by whichever worker recovers it. A
    field missing from an older contract version reads as None, as the Avro reader fills it.

    ``content_hash`` counts only where the other fields do not give it (a producer gave it for a store without
    tokens, or one that differs from its tokens'): the content hash a store's tokens give adds nothing to what
    they say, and leaving it out keeps the digest of such a store the one workers before kv_event v4 wrote to
    the changelog, so replicas whose stores straddle an upgrade still agree. Nor does it count for a store whose
    tokens do not give one because it does not say its extra keys (a vLLM store without ``extra_keys``,
    ``engine`` ``vllm``: :func:`schemas.content_hash.says_extra_keys`): its content hash is the one its producer
    remembered for the block (``producers.split.ParentTracker``), the producer's view, as ``parent_known`` is.

    Args:
        body: the store's body (at least the :data:`AGREEMENT_FIELDS`).
        engine: ``vllm`` or ``sglang``, :func:`schemas.content_hash.record_engine` of the record's
            ``hash_encoding``.
    """
    values = tuple(map(body.get, _DIGEST_FIELDS))
    given = body.get("content_hash")
    if given is not None:
        if not body.get("token_ids"):
            values += (given,)
        else:
            said = stored_content_hash(body, engine)
            if said is not None and given != said:
                values += (given,)
    # The same text from the compiled module, which writes the token ids' ints without a Python string each
    hotpath = schemas.compiled.HOTPATH
    text = repr(values).encode() if hotpath is None else hotpath.repr_utf8(values)
    return int.from_bytes(blake2b(text, digest_size=8).digest(), "big", signed=True)


@dataclass
class ApplyStats:
    """Counters of what :func:`apply_block_event` did, cumulative per stream app worker."""

    #: Events that changed a row.
    applied: int = 0
    #: Events ignored because that worker's row had already applied a later-or-equal position (redelivery).
    duplicates: int = 0
    #: Events ignored because a later clear of their source had already been applied on this partition.
    cleared_late: int = 0
    #: Events of a publisher epoch that a PublisherRestarted had already retired on this partition.
    retired_late: int = 0
    #: Removals of a block the worker had no count for: counted, not applied below zero.
    unknown_removals: int = 0
    #: Rows that became resident / stopped being resident.
    became_resident: int = 0
    stopped_resident: int = 0
    #: Stores whose parent block the producer had not seen stored by the source (BlockStored.parent_known
    #: false): still resident, counted (docs/residency.md, "Reference counting").
    unknown_parents: int = 0
    #: Stores of a source in full report mode (``BLOCK_STORED_OR_REUSED``) of a block its worker already counted on
    #: the row: announcements of a reused block (vLLM PR #45261), which add no copy (docs/residency.md).
    reuse_reports: int = 0
    #: Stores of a REPLICATED row (world size > 1) whose content differed from another worker's store of the
    #: row (:data:`AGREEMENT_FIELDS`): the row is not resident while they differ.
    replica_disagreements: int = 0
    #: Media that mapped to the UNKNOWN tier, by raw string.
    unknown_media: dict = field(default_factory=dict)


def aggregate_copies(workers: list[dict], world_size: int, aggregation: str) -> int:
    """Copies of a row from its per-worker counts.

    Args:
        workers: ``[{"worker_rank": r, "count": c, "content": digest or None, ...}]``; rank -1 stands for
            a publisher without worker rank.
        world_size: workers that report this source (1: pass through).
        aggregation: ``REPLICATED`` (min over ranks 0..world_size-1, absent = 0; 0 when two workers with a
            count stored different content, see :func:`content_digest`) or ``SHARDED`` (sum).
    """
    if world_size <= 1 or aggregation == "SHARDED":
        total = 0
        for worker in workers:  # a loop, not sum() over a generator: this runs per event, mostly on one worker
            total += worker["count"]
        return total
    counts, contents = {}, set()
    for worker in workers:
        counts[worker["worker_rank"]] = worker["count"]
        if worker["count"] and worker["content"] is not None:
            contents.add(worker["content"])
    if len(contents) > 1:
        return 0  # the workers hold different blocks under one hash: not agreement
    return min(counts.get(rank, 0) for rank in range(world_size))


def source_aggregation(source: tuple, configured: tuple[int, str] | None) -> tuple[int, str]:
    """``(world_size, mode)`` of ``source`` (a :class:`schemas.block_event.Source`): what its events declare,
    else ``configured`` (the worker's ``--aggregation`` for its instance), else 1 and REPLICATED."""
    configured_size, configured_mode = configured or (1, "REPLICATED")
    return source[3] or configured_size, source[4] or configured_mode


def needs_content(kind: str, aggregation: tuple[int, str]) -> bool:
    """Whether a ``kind`` event of a source of ``aggregation`` (:func:`source_aggregation`) needs its content
    digest: a store of a REPLICATED source with world size above 1, whose workers' stores are compared
    (:data:`AGREEMENT_FIELDS`)."""
    return kind in STORE_KINDS and aggregation[0] > 1 and aggregation[1] == "REPLICATED"


def apply_block_event(entry: dict | None, record: dict, clear_mark: ClearPosition,
                      clear_watermark: ClearPosition, clear_tiers: frozenset,
                      stats: ApplyStats, aggregation: tuple[int, str] | None = None) -> tuple[dict | None, int, int]:
    """:func:`apply_block` for a decoded ``kv_event`` record (a BlockStored or BlockRemoved dict), with its
    content digest when the source's aggregation needs one (:func:`needs_content`); ``aggregation`` is the
    source's configured (world_size, mode), used when the record declares none. A store's content hash is
    :func:`schemas.block_event.block_event_of`'s (computed for a record of an older producer)."""
    event = block_event_of(record)
    resolved = source_aggregation(event.source, aggregation)
    if needs_content(event.kind, resolved):
        event = event._replace(content=content_digest(record["event"][1], record_engine(record.get("hash_encoding"))))
    return apply_block(entry, event, clear_mark, clear_watermark, clear_tiers, stats, resolved)


def apply_block(entry: dict | None, event: tuple, clear_mark: ClearPosition, clear_watermark: ClearPosition,
                clear_tiers: frozenset, stats: ApplyStats,
                aggregation: tuple[int, str]) -> tuple[dict | None, int, int]:
    """Apply one BlockStored/BlockRemoved to a block's residency entry.

    Args:
        entry: the table value for the event's key, or None when absent.
        event: a :class:`schemas.block_event.BlockEvent` (or a plain tuple in its field order).
        clear_mark: position (epoch, seq, batch_index) of the source's latest
            AllBlocksCleared that preceded the event on its upstream partition
            (:data:`NO_CLEAR` if none).
        clear_watermark: the latest clear of the source already applied on this
            partition (:data:`NO_CLEAR` if none).
        clear_tiers: tiers a clear of this source removes.
        stats: counters to update.
        aggregation: the source's (world_size, mode) (:func:`source_aggregation`).

    A store with a content hash (``BlockEvent.content_hash``) that is applied sets the entry's ``content_hash``
    and ``parent_block_hash`` to its own (the parent may be None: a chain's first block); a store without one
    (tokenless, e.g. a CPU offload placeholder) leaves them, so an entry keeps its content while any of its rows
    remains. The entry is the block's in one ownership: every tier and source of it stores the same content.

    A store of kind ``BLOCK_STORED_OR_REUSED`` (a source in vLLM's full report mode, kv_event v5
    ``BlockStored.report_mode``) on a row whose worker already counts the block is an announcement of a reused
    block: its position is applied, its count is not raised (``stats.reuse_reports``). Otherwise it is a store.

    Longer than the house's 80 lines on purpose: it runs once per block event, where each Python call costs a
    noticeable part of the rules' few microseconds (a call with its arguments is about what one row lookup
    costs), so the new-row path (most events of a trace) and the general one stay in line, the new-row one first
    and self-contained. Split it only with the ``peers`` and ``stream`` figures of ``make bench`` before and after.

    Returns:
        ``(new entry or None when no row is left, change in resident rows: -1, 0 or +1, the row's copies
        after the event)``.
    """
    (kind, source, epoch, seq, batch_index, block_index, ts, block_hash, tier, medium, locality, group, ownership,
     parent_known, content, parent_block_hash, content_hash) = event
    in_clear_scope = tier in clear_tiers
    if in_clear_scope and clear_mark < clear_watermark:
        stats.cleared_late += 1
        return entry, 0, 0
    if tier == "UNKNOWN":
        stats.unknown_media[medium] = stats.unknown_media.get(medium, 0) + 1

    instance, dp_rank, worker_rank, _, _ = source
    rows = entry["rows"] if entry is not None else []
    row = None
    for candidate in rows:
        if (candidate["instance_id"] == instance and candidate["data_parallel_rank"] == dp_rank
                and candidate["tier"] == tier and candidate["locality"] == locality
                and candidate["group_idx"] == group):
            row = candidate
            break
    world_size, mode = aggregation
    if row is None:
        if kind not in STORE_KINDS:
            stats.unknown_removals += 1
            return entry, 0, 0
        # A new row (most events of a trace): its one worker's first store, written once with its final values.
        # What the general path below would do to it: no clear to account for, no duplicate, no disagreement.
        replicated = world_size > 1 and mode == "REPLICATED"
        workers = [{"worker_rank": -1 if worker_rank is None else worker_rank, "count": 1, "publisher_epoch": epoch,
                    "seq": seq, "batch_index": batch_index, "block_index": block_index,
                    "content": content if replicated else None}]
        after = aggregate_copies(workers, world_size, mode) if replicated else 1
        rows.append({"instance_id": instance, "data_parallel_rank": dp_rank, "tier": tier, "medium": medium,
                     "locality": locality, "group_idx": group, "world_size": world_size, "aggregation": mode,
                     "workers": workers, "copies": after, "since": ts if after > 0 else None, "last_ts": ts,
                     "clear_mark": clear_mark_record(clear_mark)})
        stats.applied += 1
        if parent_known is False:
            stats.unknown_parents += 1
        if after > 0:
            stats.became_resident += 1
        if entry is None:
            entry = {"block_hash": block_hash, "ownership": ownership, "rows": rows,
                     "parent_block_hash": None if content_hash is None else parent_block_hash,
                     "content_hash": content_hash}
        elif content_hash is not None:
            entry["parent_block_hash"] = parent_block_hash
            entry["content_hash"] = content_hash
        return entry, (1 if after > 0 else 0), after
    #: The row's copies before this event, and before a clear it accounts for: the delta is against this.
    before = row["copies"]
    workers = row["workers"]
    mark_record = clear_mark_record(clear_mark)  # shared per position: the same object as the row's when equal
    if (workers and in_clear_scope and row["clear_mark"] is not mark_record
            and clear_mark > ClearPosition.of(row["clear_mark"])):
        # A clear of the source came between the row's last event and this one: it emptied the row. The row's
        # own clear copy will find it newer than the clear and leave it, so the delta reported here covers both
        # (resident before, resident after: 0; the clear's -1 and the store's +1 cancel).
        for worker in workers:
            worker["count"] = 0
        row["copies"] = 0
        row["since"] = None

    if worker_rank is None:
        worker_rank = -1
    # loops rather than generator expressions here and below: this runs per event, and a generator over a
    # row's (mostly one) workers cost about as much as the rest of the lookup
    worker = None
    for candidate in workers:
        if candidate["worker_rank"] == worker_rank:
            worker = candidate
            break
    if worker is None:
        worker = {"worker_rank": worker_rank, "count": 0, "publisher_epoch": -1, "seq": -1, "batch_index": -1,
                  "block_index": -1, "content": None}
        workers.append(worker)
    elif (epoch, seq, batch_index, block_index) <= (worker["publisher_epoch"], worker["seq"], worker["batch_index"],
                                                    worker["block_index"]):
        stats.duplicates += 1
        return entry, 0, row["copies"]
    elif epoch > worker["publisher_epoch"]:
        worker["count"] = 0  # a new epoch is a restarted publisher, whose cache started empty

    row["world_size"] = world_size
    row["aggregation"] = mode
    if kind in STORE_KINDS:
        if kind == BLOCK_STORED_OR_REUSED and worker["count"] > 0:
            # full report mode: the engine announces a block it reused and stores nothing, and no removal will
            # follow; counting it would leave the row resident after the block's one removal. A real duplicate of
            # such a source is counted once too (the engine's reports cannot tell the two apart).
            stats.reuse_reports += 1
        else:
            worker["count"] += 1
        if content_hash is not None:
            entry["parent_block_hash"] = parent_block_hash
            entry["content_hash"] = content_hash
        if parent_known is False:
            stats.unknown_parents += 1
        if world_size > 1 and mode == "REPLICATED":
            worker["content"] = content
            for other in workers:
                if other is not worker and other["count"] and other["content"] not in (None, content):
                    stats.replica_disagreements += 1
                    break
    elif worker["count"] > 0:
        worker["count"] -= 1
    else:
        stats.unknown_removals += 1
    worker["publisher_epoch"] = epoch
    worker["seq"] = seq
    worker["batch_index"] = batch_index
    worker["block_index"] = block_index
    stats.applied += 1
    row["medium"] = medium
    row["last_ts"] = ts
    row["clear_mark"] = mark_record
    if len(workers) == 1 and (world_size <= 1 or mode == "SHARDED"):
        after = worker["count"]  # aggregate_copies' sum, over the one worker the row has
    else:
        after = aggregate_copies(workers, world_size, mode)
    row["copies"] = after
    delta = 0
    if after > 0 and row["since"] is None:
        row["since"] = ts  # resident anew (also after a clear emptied it)
    if before == 0 and after > 0:
        stats.became_resident += 1
        delta = 1
    elif before > 0 and after == 0:
        row["since"] = None
        stats.stopped_resident += 1
        delta = -1
    for counted in workers:
        if counted["count"]:
            break
    else:  # no worker has a count left
        rows.remove(row)
    return (entry if rows else None), delta, after


def retire_epoch(entry: dict, instance_id: str, data_parallel_rank: int, worker_rank: int | None,
                 new_epoch: int, stats: ApplyStats) -> tuple[dict | None, list[dict], bool]:
    """Apply a PublisherRestarted: zero the publisher's counts from epochs before ``new_epoch`` in one entry.

    Returns:
        ``(new entry or None when no row is left, the rows that stopped being resident, whether anything
        changed)``.
    """
    rank = -1 if worker_rank is None else worker_rank
    kept, stopped, changed = [], [], False
    for row in entry["rows"]:
        if row["instance_id"] == instance_id and row["data_parallel_rank"] == data_parallel_rank:
            for worker in row["workers"]:
                if worker["worker_rank"] == rank and worker["publisher_epoch"] < new_epoch and worker["count"]:
                    worker["count"] = 0
                    changed = True
            before = row["copies"]
            row["copies"] = aggregate_copies(row["workers"], row["world_size"], row["aggregation"])
            if before > 0 and row["copies"] == 0:
                row["since"] = None
                stopped.append(row)
                stats.stopped_resident += 1
            if not any(w["count"] for w in row["workers"]):
                continue
        kept.append(row)
    entry["rows"] = kept
    return (entry if kept else None), stopped, changed


def apply_clear(entry: dict, instance_id: str, data_parallel_rank: int, mark: ClearPosition,
                clear_tiers: frozenset, stats: ApplyStats) -> tuple[dict | None, list[dict], bool]:
    """Apply a source's AllBlocksCleared (at position ``mark``) to one entry.

    Removes the source's rows in ``clear_tiers`` whose last event preceded the
    clear (their ``clear_mark`` is older than ``mark``); rows whose last event
    came after the clear upstream have already accounted for it.

    Returns:
        ``(new entry or None when no row is left, the rows removed that were resident, whether anything
        changed)``.
    """
    return _remove_rows(entry, lambda row: row["instance_id"] == instance_id
                        and row["data_parallel_rank"] == data_parallel_rank and row["tier"] in clear_tiers
                        and ClearPosition.of(row["clear_mark"]) < mark, stats)


def _remove_rows(entry: dict, doomed, stats: ApplyStats) -> tuple[dict | None, list[dict], bool]:
    """Drop the rows of ``entry`` that ``doomed(row)`` picks: the shared step of a clear and an unregistration.

    Returns:
        ``(new entry or None when no row is left, the rows removed that were resident, whether anything
        changed)``.
    """
    kept, removed = [], []
    for row in entry["rows"]:
        if doomed(row):
            if row["copies"] > 0:
                removed.append(row)
                stats.stopped_resident += 1
        else:
            kept.append(row)
    if len(kept) == len(entry["rows"]):
        return entry, [], False
    entry["rows"] = kept
    return (entry if kept else None), removed, True


def apply_unregister(entry: dict, instance_id: str, data_parallel_rank: int | None,
                     stats: ApplyStats) -> tuple[dict | None, list[dict], bool]:
    """Apply a ``SourceUnregistered`` of ``instance_id`` to one entry: every row of the instance (of one
    data-parallel rank, or of all when ``data_parallel_rank`` is None) goes, on every tier, whatever its position.

    Unlike a clear, this is not a watermark: an unregistration comes from an operator or a lapsed lease, not from
    the source's own stream, so it has no place among the source's events. Events of the instance that follow it
    in the partition apply again (docs/residency.md, "Liveness").

    Returns:
        As :func:`apply_clear`.
    """
    return _remove_rows(entry, lambda row: row["instance_id"] == instance_id and (
        data_parallel_rank is None or row["data_parallel_rank"] == data_parallel_rank), stats)
