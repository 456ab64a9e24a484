"""Applies re-keyed events to the tables: one :class:`BatchApplier` per ``ownership_batch`` message.

The residency rules themselves are pure functions (:mod:`stream_apps.residency`); this module reads the rows
they need, writes back what changed, keeps ``tier-occupancy`` and ``sources`` in step and publishes every
residency transition. Source-wide events (``AllBlocksCleared``, ``PublisherRestarted``, ``SourceStale``,
``SourceUnregistered``) are rare and scan the partition's rows; ``SourceHeartbeat`` renews a source's lease in
``sources``, and ``SourceDisconnected`` changes nothing here (the indexes read it from kv-events).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from schemas import (
    ALL_BLOCKS_CLEARED,
    BLOCK_STORED,
    BLOCK_STORED_OR_REUSED,
    SOURCE_DISCONNECTED,
    SOURCE_HEARTBEAT,
    SOURCE_STALE,
    SOURCE_UNREGISTERED,
    SOURCE_WIDE_EVENTS,
    STORE_KINDS,
)
from schemas.block_event import BlockEvent, block_event_of
from schemas.clear_position import ClearPosition
from schemas.content_hash import record_engine
from stream_apps.checkpoint import Checkpoint
from stream_apps.outputs import OutputTopics
from stream_apps.residency import (
    PRIMARY,
    ApplyStats,
    SourceSettings,
    apply_clear,
    apply_unregister,
    content_digest,
    needs_content,
    residency_key,
    retire_epoch,
    source_aggregation,
)
from stream_apps.tables import Tables

log = logging.getLogger(__name__)


class InvalidRecord(ValueError):
    """A decodable kv_event that cannot be applied as routed (the message says why; it is dead-lettered)."""


class NeedsRecord(Exception):
    """A block event's fields lack what this worker needs to apply it; the caller applies the decoded record."""


#: ``residency_change.cause`` of a block event kind that is not an Avro branch: a full report mode store is a
#: BlockStored to the changes' readers.
_CAUSES = {BLOCK_STORED_OR_REUSED: "BlockStored"}
#: Positions of the :class:`~schemas.block_event.BlockEvent` fields read here: block events arrive as plain tuples
#: (a NamedTuple's attribute costs more per event than the rules' use of it), so they are indexed by these.
_KIND, _SOURCE, _EPOCH, _SEQ, _TS, _CONTENT = (BlockEvent._fields.index(name) for name in (
    "kind", "source", "publisher_epoch", "seq", "ts", "content"))

def occupancy_key(partition: int, ownership: str | None, tier: str, instance_id: str) -> str:
    """Key of a ``tier-occupancy`` row: ``<partition>/<ownership or primary>/<tier>/<instance>``."""
    return f"{partition}/{ownership or PRIMARY}/{tier}/{instance_id}"


def publisher_key(partition: int, record: dict) -> str:
    """Key of a publisher's ``sources`` and ``publisher-epochs`` rows on one partition."""
    worker = -1 if record["worker_rank"] is None else record["worker_rank"]
    return f"{partition}/{record['instance_id']}/{record['data_parallel_rank']}/{worker}"


def _watermark_record(record: dict) -> dict:
    """The ``clear_watermark`` value that marks ``record`` (a clear or a restart) applied."""
    return {"instance_id": record["instance_id"], "data_parallel_rank": record["data_parallel_rank"],
            "publisher_epoch": record["publisher_epoch"], "seq": record["seq"], "batch_index": record["batch_index"]}


@dataclass
class Materializer:
    """What every batch of a worker is applied with: the tables, the outputs, the checkpoint and the rules'
    settings. The HTTP views read :attr:`stats` and :attr:`materialized`."""

    tables: Tables
    outputs: OutputTopics
    checkpoint: Checkpoint
    sources: SourceSettings
    #: Outcome counters of the residency rules (:class:`stream_apps.residency.ApplyStats`).
    stats: ApplyStats = field(default_factory=ApplyStats)
    #: Events this worker took from the re-keyed topic, redeliveries included (counted per batch message by
    #: the agent).
    materialized: int = 0

    def write_small_table(self, table, partition: int, key: str, value: dict) -> None:
        """``table[key] = value`` for one of the small tables, its changelog record buffered for ``partition``."""
        table.data.write(partition, key, value)

    def add_occupancy(self, partition: int, deltas: dict[tuple, int]) -> None:
        """Fold ``{(ownership, tier, instance): change of resident blocks}`` into ``tier-occupancy``; its store
        mirrors the table's changelog records to ``kv-tier-occupancy``."""
        table = self.tables.tier_occupancy
        for (ownership, tier, instance_id), delta in deltas.items():
            if not delta:
                continue
            key = occupancy_key(partition, ownership, tier, instance_id)
            current = table.data.lookup(key, partition)
            blocks = (current["resident_blocks"] if current else 0) + delta
            value = {"ownership": ownership, "tier": tier, "instance_id": instance_id, "resident_blocks": blocks}
            table.data.write(partition, key, value)

    def source_status(self, partition: int, key: str, record: dict) -> dict:
        """The ``sources`` row under ``key`` (on ``partition``), or a new one for ``record``'s publisher."""
        return self.tables.sources.data.lookup(key, partition) or {
            "instance_id": record["instance_id"], "data_parallel_rank": record["data_parallel_rank"],
            "worker_rank": -1 if record["worker_rank"] is None else record["worker_rank"],
            "publisher_epoch": record["publisher_epoch"], "stale": False, "first_lost_seq": None,
            "last_lost_seq": None, "gaps": 0, "restarts": 0, "last_seq": None, "last_event_ts": None,
            "events_applied": 0, "changed_ts": record["ts"]}

    def note_applied(self, partition: int, seen: dict[str, list]) -> None:
        """Fold a batch's per-publisher activity (``{publisher key: [newest BlockEvent, events applied]}``) into
        ``sources``."""
        for key, (event, count) in seen.items():
            instance, dp_rank, worker_rank, _, _ = event[_SOURCE]
            epoch, ts = event[_EPOCH], event[_TS]
            status = self.source_status(partition, key, {
                "instance_id": instance, "data_parallel_rank": dp_rank, "worker_rank": worker_rank,
                "publisher_epoch": epoch, "ts": ts})
            status.update(publisher_epoch=max(status["publisher_epoch"], epoch), last_seq=event[_SEQ],
                          last_event_ts=ts, events_applied=status["events_applied"] + count)
            self.write_small_table(self.tables.sources, partition, key, status)

    def rewrite_partition(self, partition: int, instance: str, occupancy: dict[tuple, int], rewrite, ts: float,
                          cause: str) -> int:
        """Rewrite every residency entry of ``partition`` with ``rewrite(entry) -> (entry, stopped rows,
        changed)``; only changed entries are written. Returns the rows that stopped being resident."""
        store = self.tables.residency_store
        stopped_total = 0
        for key in store.partition_keys(partition):
            entry = store.entry(partition, key)
            if entry is None:
                continue
            new_entry, stopped, changed = rewrite(entry)
            if new_entry is None or changed:
                store.write(partition, key, new_entry)
            for row in stopped:
                stopped_total += 1
                occupancy[(entry["ownership"], row["tier"], instance)] -= 1
                self.outputs.change(entry["block_hash"], entry["ownership"], row["instance_id"],
                                    row["data_parallel_rank"], row["tier"], None, row["locality"], row["group_idx"],
                                    False, 0, ts, cause)
        return stopped_total

    def apply_clear(self, partition: int, record: dict, mark: ClearPosition, occupancy: dict[tuple, int]) -> None:
        """``AllBlocksCleared``: remove the source's rows in its clear scope on ``partition``, then mark it
        applied (after a checkpoint: the removals reach the changelog first)."""
        instance, dp_rank = record["instance_id"], record["data_parallel_rank"]
        clear_tiers = self.sources.clear_tiers(instance)
        cleared = self.rewrite_partition(partition, instance, occupancy, lambda entry: apply_clear(
            entry, instance, dp_rank, mark, clear_tiers, self.stats), record["ts"], "AllBlocksCleared")
        self.checkpoint.commit()
        source = f"{partition}/{instance}/{dp_rank}"
        self.write_small_table(self.tables.clear_watermarks, partition, source, _watermark_record(record))
        log.info("AllBlocksCleared from %s/%s applied on partition %d: %d resident rows removed", instance,
                 dp_rank, partition, cleared)

    def apply_unregister(self, partition: int, record: dict, occupancy: dict[tuple, int]) -> None:
        """``SourceUnregistered``: remove every row of the instance (one rank, or all) on ``partition``, every
        tier, and its ``sources`` rows there (after a checkpoint: the removals reach the changelog first)."""
        instance, body = record["instance_id"], record["event"][1]
        rank = None if body.get("all_ranks", True) else record["data_parallel_rank"]
        removed = self.rewrite_partition(partition, instance, occupancy, lambda entry: apply_unregister(
            entry, instance, rank, self.stats), record["ts"], "SourceUnregistered")
        self.checkpoint.commit()
        sources = self.tables.sources
        prefix = f"{partition}/"
        for key, status in list(sources.items()):
            if key.startswith(prefix) and status["instance_id"] == instance and (
                    rank is None or status["data_parallel_rank"] == rank):
                self.write_small_table(sources, partition, key, None)
        log.info("instance %s%s unregistered (%s): %d resident rows removed on partition %d", instance,
                 "" if rank is None else f" rank {rank}", body.get("reason") or "no reason given", removed, partition)

    def apply_source_event(self, partition: int, record: dict, occupancy: dict[tuple, int]) -> None:
        """``PublisherRestarted``: retire the earlier epochs' rows on ``partition``; ``SourceStale``: mark the
        source stale (both reported by the bridge); ``SourceHeartbeat``: renew the source's lease (its ``sources``
        row is written again, which is when the workers' clock says it was last heard of); ``SourceDisconnected``
        (the bridge lost its engine): nothing. It removes no row, and it must not renew the lease as a write of
        the ``sources`` row would: the indexes read it from kv-events themselves and take the source out of their
        answers at once (``stream_apps.index.liveness.SourceLeases.mark_down``)."""
        kind, body = record["event"]
        if kind == SOURCE_DISCONNECTED:
            return
        if kind == SOURCE_UNREGISTERED:
            self.apply_unregister(partition, record, occupancy)
            return
        key = publisher_key(partition, record)
        status = self.source_status(partition, key, record)
        if kind == SOURCE_HEARTBEAT:
            if record["publisher_epoch"] >= status["publisher_epoch"]:  # a late heartbeat of an ended epoch: not
                self.write_small_table(self.tables.sources, partition, key, status)  # evidence of the new one
            return
        if kind == SOURCE_STALE:
            if record["publisher_epoch"] < status["publisher_epoch"]:
                return  # a loss in an epoch that has since ended
            status.update(stale=True, first_lost_seq=body["first_lost_seq"], last_lost_seq=body["last_lost_seq"],
                          publisher_epoch=record["publisher_epoch"], gaps=status["gaps"] + 1,
                          changed_ts=record["ts"])
            self.write_small_table(self.tables.sources, partition, key, status)
            return
        new_epoch = record["publisher_epoch"]
        known = self.tables.publisher_epochs.data.lookup(key, partition)
        if known is not None and new_epoch <= known["publisher_epoch"]:
            self.stats.duplicates += 1
            return
        instance, dp_rank = record["instance_id"], record["data_parallel_rank"]
        retired = self.rewrite_partition(partition, instance, occupancy, lambda entry: retire_epoch(
            entry, instance, dp_rank, record["worker_rank"], new_epoch, self.stats), record["ts"],
            "PublisherRestarted")
        self.checkpoint.commit()  # the retired rows reach the changelog before the epoch that marks them done
        self.write_small_table(self.tables.publisher_epochs, partition, key, _watermark_record(record))
        status.update(stale=False, first_lost_seq=None, last_lost_seq=None, publisher_epoch=new_epoch, gaps=0,
                      restarts=status["restarts"] + 1, changed_ts=record["ts"])
        self.write_small_table(self.tables.sources, partition, key, status)
        # The epoch marks the restart applied, and a redelivered restart is skipped by it, the sources row's reset
        # included: both records go out together now, not each with its own table's interval (the sources row is
        # a global table's, produced every --global-changelog-interval-s)
        self.checkpoint.produce()
        log.info("publisher %s restarted (epoch %d): %d resident rows retired on partition %d", key, new_epoch,
                 retired, partition)


class BatchApplier:
    """Applies one ``ownership_batch`` message (one partition) and writes each touched key once at the end.

    A per-source cache (:meth:`_source_state`) spares the table lookups and settings per event: keys, clear
    watermark, retired epoch, clear tiers and aggregation (watermarks and epochs change only through
    source-wide events, which are applied in order here and empty it).
    """

    def __init__(self, materializer: Materializer, partition: int) -> None:
        self.m = materializer
        self.store = materializer.tables.residency_store
        #: The rules for the form of entry the store holds (:mod:`stream_apps.residency.records`), and the compiled
        #: loop of :meth:`apply_all` with them (None: the dicts' form, whose loop is Python).
        self._apply_block = self.store.entry_form.apply_block
        self._apply_events = self.store.entry_form.apply_events
        self.partition = partition
        #: Residency key -> entry (None: deleted), written back at :meth:`finish` or before a source-wide event.
        self.touched: dict[str, dict | None] = {}
        #: (ownership, tier, instance) -> change of resident blocks.
        self.occupancy: dict[tuple, int] = defaultdict(int)
        #: Publisher key -> [newest BlockEvent applied, events applied].
        self.publishers: dict[str, list] = {}
        #: Touched keys that were absent from the store: deleting one again writes nothing (no tombstone).
        self.new_keys: set[str] = set()
        #: Source (:class:`schemas.block_event.Source`) -> what applying its events needs (:meth:`_source_state`).
        #: Watermarks and retired epochs change only through source-wide events, which empty it.
        self._sources: dict[tuple, tuple] = {}

    def _source_state(self, source: tuple) -> tuple:
        """``(source key, publisher key, clear watermark, retired epoch or None, clear tiers, (world_size, mode),
        whether its stores need a content digest)`` of ``source``, kept for the rest of the batch message. The
        source key is ``<partition>/<instance>/<dp rank>``, the publisher key the source key + ``/<worker rank
        or -1>``."""
        instance, dp_rank, worker, _, _ = source
        source_key = f"{self.partition}/{instance}/{dp_rank}"
        publisher = f"{source_key}/{-1 if worker is None else worker}"
        tables, settings = self.m.tables, self.m.sources
        known = tables.publisher_epochs.data.lookup(publisher, self.partition)
        aggregation = source_aggregation(source, settings.aggregation.get(instance))
        state = self._sources[source] = (
            source_key, publisher, ClearPosition.of(tables.clear_watermarks.data.lookup(source_key, self.partition)),
            None if known is None else known["publisher_epoch"], settings.clear_tiers(instance), aggregation,
            needs_content(BLOCK_STORED, aggregation))
        return state

    def write_back(self) -> None:
        """Write every touched entry to the store (each key's changelog record is buffered by the store)."""
        new_keys, write, partition = self.new_keys, self.store.write, self.partition
        for key, entry in self.touched.items():
            if entry is not None or key not in new_keys:
                write(partition, key, entry)
        self.touched.clear()
        new_keys.clear()

    def finish(self) -> None:
        """Write the batch's entries, occupancy changes and per-publisher activity."""
        self.write_back()
        self.m.add_occupancy(self.partition, self.occupancy)
        self.m.note_applied(self.partition, self.publishers)

    def apply_record(self, key: str, mark: ClearPosition, record: dict) -> None:
        """Apply one re-keyed event given as a decoded ``kv_event`` record: a source-wide event, or a block
        event the repartition stage wrote without block fields (then checked against the key it was routed by).
        A store of an older producer gets its content hash here, as the repartition stage gives it
        (:func:`schemas.block_event.block_event_of`): these records are the few that come without block fields.

        Raises:
            InvalidRecord: a block event without block hash or tier, or one that contradicts the key it was
                routed by.
        """
        kind, body = record["event"]
        source = (record["instance_id"], record["data_parallel_rank"], record["worker_rank"], record["world_size"],
                  record["aggregation"])
        _, _, watermark, retired, _, _, needs_digest = self._sources.get(source) or self._source_state(source)
        if kind not in SOURCE_WIDE_EVENTS:
            if retired is not None and record["publisher_epoch"] < retired:
                self.m.stats.retired_late += 1  # as before any other check, whatever the record holds
                return
            block_hash = record["block_hash"]
            if block_hash is None or record["tier"] is None:
                raise InvalidRecord(f"{kind.rsplit('.', 1)[-1]} without block_hash or tier")
            if key != residency_key(body["ownership"], block_hash):
                # an older repartition stage routed by the kvstream-ownership header, which the record may contradict
                raise InvalidRecord(f"routed as {key!r}, but the record's ownership is {body['ownership']!r} and "
                                    f"its block hash {block_hash.hex()}")
            event = block_event_of(record)
            if needs_digest and kind == BLOCK_STORED:
                event = event._replace(content=content_digest(body, record_engine(record.get("hash_encoding"))))
            self.apply(key, mark, event)
            return
        m = self.m
        partition = self.partition
        self.write_back()  # source-wide events scan the stored entries
        self._sources.clear()
        if kind == ALL_BLOCKS_CLEARED:
            if mark <= watermark:
                m.stats.duplicates += 1
                return
            m.apply_clear(partition, record, mark, self.occupancy)
        else:
            m.apply_source_event(partition, record, self.occupancy)

    def apply_all(self, items: list, apply_other: Callable[[tuple, Exception | None], None]) -> None:
        """Apply a batch message's items (:data:`schemas.ownership_batch.BatchItem` tuples) in order: each block
        event read with its fields as :meth:`apply` applies it; ``apply_other(item, None)`` for every other item
        and for one :meth:`apply` would refuse with :class:`NeedsRecord`, ``apply_other(item, exception)`` for one
        whose apply raised. What ``apply_other`` raises ends the loop.

        With the compiled record form this is its module's ``apply_events``, the compiled twin of this loop and
        of :meth:`apply`; otherwise the loop below, the reference.
        """
        if self._apply_events is not None:
            m = self.m
            self._apply_events(items, self.partition, self._sources, self._source_state, self.touched, self.new_keys,
                               self.publishers, self.occupancy, self.store.entry, m.stats, m.outputs, _CAUSES,
                               apply_other)
            return
        apply = self.apply
        for item in items:
            key, mark, _, _, _, event = item
            if type(event) is not tuple:
                apply_other(item, None)
                continue
            try:
                apply(key, mark, event)
            except NeedsRecord:
                apply_other(item, None)
            except Exception as exc:  # noqa: BLE001 - apply_other dead-letters it, or raises
                apply_other(item, exc)

    def apply(self, key: str, mark: ClearPosition, event: tuple) -> None:
        """Apply one re-keyed block event: ``key`` (its residency key) and ``mark`` (its source's latest clear
        before it) from its ownership batch item, ``event`` a :class:`schemas.block_event.BlockEvent` (or a
        plain tuple in its field order) whose block hash and ownership the key was made of.

        Raises:
            NeedsRecord: the event lacks the content digest this worker's aggregation settings need (nothing
                was applied; apply the decoded record with :meth:`apply_record`).
        """
        m = self.m
        partition = self.partition
        # a batch message holds many events of few publishers: what they need is looked up once
        source = event[_SOURCE]
        _, publisher, watermark, retired, clear_tiers, aggregation, replicated = (self._sources.get(source)
                                                                                    or self._source_state(source))
        if replicated and event[_CONTENT] is None and event[_KIND] in STORE_KINDS:
            # written by a repartition process that did not know this worker's --aggregation for the source
            raise NeedsRecord(f"{key}: a store of a replicated source without its content digest")
        if retired is not None and event[_EPOCH] < retired:
            m.stats.retired_late += 1
            return
        touched = self.touched
        if key in touched:
            entry = touched[key]
        else:
            entry = self.store.entry(partition, key)
            if entry is None:
                self.new_keys.add(key)
        stats = m.stats
        applied_before = stats.applied
        entry, delta, copies = self._apply_block(entry, event, mark, watermark, clear_tiers, stats, aggregation)
        touched[key] = entry
        if stats.applied != applied_before:  # a redelivered event is counted as a duplicate only, never applied
            seen = self.publishers.get(publisher)
            if seen is None:
                self.publishers[publisher] = [event, 1]
            else:
                seen[0] = event
                seen[1] += 1
        if delta:
            (kind, _, _, _, _, _, ts, block_hash, tier, medium, locality, group, ownership, _, _, _, _) = event
            self.occupancy[(ownership, tier, source[0])] += delta
            if m.outputs.residency_changes:  # change() checks it too; here it spares the call per transition
                m.outputs.change(block_hash, ownership, source[0], source[1], tier, medium, locality, group,
                                 delta > 0, copies, ts, _CAUSES.get(kind) or kind.rsplit(".", 1)[-1])
