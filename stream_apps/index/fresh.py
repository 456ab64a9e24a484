"""The index's fresh layer: the engines' block events applied as they arrive, over the residency changelog.

The residency changelog is the index's recovery point and its check, but it follows the events by the whole
pipeline (repartition, the agent, a changelog interval): hundreds of milliseconds. Dynamo's and Mooncake's
indexers apply the engines' events themselves; so does this layer, for the events whose effect on the index's
holder sets is clear from the event alone (docs/architecture.md, "The index's fresh layer"):

* a ``BlockStored`` of a source with one publisher (``world_size`` null or 1) makes its (instance, data-parallel
  rank, tier, ownership) a holder of the block, with the store's content keys;
* a ``BlockRemoved`` of such a source, in KV cache group 0, removes that holder;
* a source-wide event (clear, publisher restart, unregistration) removes the source's holders in its scope at
  once, and keeps the overrides of the source's events that came after it.

Every such change is kept as an **override** of (block, ownership, holder) for ``window_s`` seconds. A changelog
record of the block applied later replaces the block's holders with what the table said when the record was
written, which may be older than the event; the overrides are then laid over it again. An override goes as soon
as a changelog record agrees with it (the table has caught up), or after ``window_s`` (the backstop for what the
event alone cannot tell: a second physical copy, another KV cache group, an event the table's rules ignored), so
the index equals the table once the pipeline has caught up, at most ``window_s`` later.

All methods are called with the index's lock held (:class:`~stream_apps.index.fleet_index.FleetIndex`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from schemas.tiers import TIERS
from stream_apps.index.scoring import HolderInfo
from stream_apps.index.table_keys import block_key, residency_key_block

_U64 = (1 << 64) - 1
#: Default seconds an override outlives a changelog record that disagrees with it: past the pipeline's p99 lag
#: at the rates the bench runs (docs/architecture.md), short enough that a wrong guess heals within it.
DEFAULT_WINDOW_S = 2.0
#: Position of an event among its source's events: ``(publisher_epoch, seq, batch_index)`` (docs/contract.md,
#: "Source identity, epochs and order").
Position = tuple[int, int, int]


class Override(NamedTuple):
    """What one event said of one holder of one block, until the changelog agrees."""

    #: True: the holder holds the block (a store); False: it does not (a removal).
    present: bool
    #: ``time.monotonic()`` after which the override is dropped whatever the changelog says.
    expires: float
    #: The event's position; a retirement (clear, restart) keeps only the overrides after its own.
    position: Position
    #: The store's parent block key and content key (u64), or None: keep the block's.
    parent: int | None
    content: int | None


@dataclass
class FreshCounters:
    """What the fresh layer did (``GET /metrics``, ``GET /workers``)."""

    #: Block events applied as overrides.
    applied: int = 0
    #: Block events left to the changelog (a source with several publishers, a KV cache group above 0).
    left_to_changelog: int = 0
    #: Overrides dropped because a changelog record agreed with them.
    confirmed: int = 0
    #: Overrides dropped after the window while the changelog still disagreed.
    expired: int = 0
    #: Source-wide events applied (clears, restarts, unregistrations; each once, not once per partition).
    retirements: int = 0


class FreshLayer:
    """The overrides of one :class:`~stream_apps.index.fleet_index.FleetIndex` (module docstring).

    Args:
        table: the index's block table (``replace``, ``holders_at``, ``remove_holder``).
        scope_of: ownership -> the table's scope id (made on first use).
        owner_of: scope id -> its ownership.
        holder_of: :class:`HolderInfo` -> holder id (made on first use).
        holders: the holder ids' :class:`HolderInfo`, indexed by id (the index's own list, read only).
        window_s: seconds an override outlives a changelog record that disagrees with it.
    """

    def __init__(self, table, scope_of: Callable[[str | None], int], owner_of: Callable[[int], str | None],
                 holder_of: Callable[[HolderInfo], int], holders: list[HolderInfo],
                 window_s: float = DEFAULT_WINDOW_S) -> None:
        self._table, self._scope_of, self._owner_of = table, scope_of, owner_of
        self._holder_of, self._holders = holder_of, holders
        self.window_s = window_s
        self.counters = FreshCounters()
        #: (block key, scope) -> holder id -> its override.
        self._overrides: dict[tuple[int, int], dict[int, Override]] = {}
        #: (expires, block key, scope) in the order made: what :meth:`expire` looks at.
        self._expiry: deque[tuple[float, int, int]] = deque()
        #: The source-wide events applied: (kind, instance, rank, position), so each applies once, not once per
        #: copy (one copy per partition of kv-events).
        self._retired: deque[tuple] = deque(maxlen=4096)
        self._retired_set: set[tuple] = set()

    def __len__(self) -> int:
        """Blocks (per scope) with at least one override."""
        return len(self._overrides)

    # -- block events ----------------------------------------------------------------------------------------

    def block_event(self, stored: bool, ownership: str | None, block_hash: bytes, instance_id: str,
                    data_parallel_rank: int, tier: str, position: Position, parent_hash: bytes | None = None,
                    content_hash: int | None = None, now: float | None = None) -> None:
        """Apply one ``BlockStored`` (``stored``) or ``BlockRemoved`` of a source with one publisher.

        Args:
            ownership: the event's ownership (vLLM PR #52067), None for the framework's tiers.
            block_hash: canonical block hash bytes (``kv_event.block_hash``).
            tier: canonical tier (``schemas.TIERS``).
            position: the event's ``(publisher_epoch, seq, batch_index)``.
            parent_hash, content_hash: a store's content keys (``BlockStored.parent_block_hash``, canonical
                bytes, and ``BlockStored.content_hash``, signed 64-bit); None: keep the block's.
            now: ``time.monotonic()`` (tests pass their own).
        """
        now = time.monotonic() if now is None else now
        block, scope = block_key(block_hash), self._scope_of(ownership)
        holder = self._holder_of(HolderInfo(instance_id, data_parallel_rank, tier, ownership))
        parent = None if parent_hash is None else block_key(parent_hash)
        content = None if content_hash is None else content_hash & _U64
        override = Override(stored, now + self.window_s, position, parent, content)
        self._overrides.setdefault((block, scope), {})[holder] = override
        self._expiry.append((override.expires, block, scope))
        self.counters.applied += 1
        held = self._table.holders_at((block,))
        if held and holder in held[0]:
            if stored and content is None:
                return  # a store of what the table has: nothing to change
        elif not stored:
            return  # a removal of what the table does not have
        self._lay(block, scope, {holder: override})

    def _lay(self, block: int, scope: int, overrides: dict[int, Override]) -> None:
        """Make the table's holders of (block, scope) say what ``overrides`` say."""
        held, ownership = self._table.holders_at([block]), self._owner_of(scope)
        current = {h for h in held[0] if self._holders[h].ownership == ownership} if held else set()
        wanted = set(current)
        parent = content = None
        for holder, override in overrides.items():
            if override.present:
                wanted.add(holder)
                if override.content is not None:
                    parent, content = override.parent, override.content
            else:
                wanted.discard(holder)
        if wanted != current or content is not None:
            self._table.replace(block, scope, sorted(wanted), parent, content)

    # -- changelog records ---------------------------------------------------------------------------------

    def after_changelog(self, keys: Iterable[bytes | None], scopes: dict[str | None, int],
                        now: float | None = None) -> None:
        """Lay the overrides over the blocks of changelog records just applied (their keys, ``<ownership or
        primary>/<hex>`` bytes; None for a record without a key), dropping those the records agree with."""
        if not self._overrides:
            return
        now = time.monotonic() if now is None else now
        overrides = self._overrides
        for key in keys:
            if key is None:
                continue
            try:
                ownership, block = residency_key_block(key)
            except ValueError:
                continue
            scope = scopes.get(ownership)
            pending = overrides.get((block, scope))
            if pending is None:
                continue
            held = self._table.holders_at([block])
            current = set(held[0]) if held else set()
            for holder, override in list(pending.items()):
                if override.expires <= now:
                    del pending[holder]
                    self.counters.expired += 1
                elif (holder in current) == override.present:
                    del pending[holder]  # the table has caught up with the event
                    self.counters.confirmed += 1
            if pending:
                self._lay(block, scope, pending)
            else:
                del overrides[(block, scope)]

    def expire(self, now: float | None = None) -> None:
        """Drop the overrides past their window (a changelog record that agrees may never come: an event the
        table's rules ignored)."""
        now = time.monotonic() if now is None else now
        expiry, overrides = self._expiry, self._overrides
        while expiry and expiry[0][0] <= now:
            _, block, scope = expiry.popleft()
            pending = overrides.get((block, scope))
            if pending is None:
                continue
            for holder, override in list(pending.items()):
                if override.expires <= now:
                    del pending[holder]
                    self.counters.expired += 1
            if not pending:
                del overrides[(block, scope)]

    # -- source-wide events --------------------------------------------------------------------------------

    def retire(self, kind: str, instance_id: str, data_parallel_rank: int | None, tiers: frozenset[str] | None,
               position: Position | None, written_at: float = 0.0) -> bool:
        """A source's holders leave the index at once: a clear (``tiers``: the tiers in its scope), a publisher
        restart or an unregistration (``tiers`` None: every tier and ownership). ``data_parallel_rank`` None: every
        rank of the instance. The overrides of the source's events after ``position`` stay (and are laid again):
        on another partition of kv-events they may have been read before this copy. ``written_at`` is the
        record's ``ts``, the same in every copy, so a later unregistration of the same instance (whose position is
        None) is not taken for a copy of an earlier one. Returns False for a copy already applied."""
        mark = (kind, instance_id, data_parallel_rank, position, written_at)
        if mark in self._retired_set:
            return False
        if len(self._retired) == self._retired.maxlen:
            self._retired_set.discard(self._retired[0])
        self._retired.append(mark)
        self._retired_set.add(mark)
        self.counters.retirements += 1
        for holder, info in enumerate(self._holders):
            if info.instance_id != instance_id or (data_parallel_rank is not None
                                                   and info.data_parallel_rank != data_parallel_rank):
                continue
            if tiers is None or info.tier in tiers:
                self._table.remove_holder(holder)
        # the overrides live one window at most, so a scan of them all is bounded (and retirements are rare)
        for (block, scope), pending in list(self._overrides.items()):
            kept = False
            for holder, override in list(pending.items()):
                info = self._holders[holder]
                if info.instance_id == instance_id and (
                        data_parallel_rank is None or info.data_parallel_rank == data_parallel_rank) and (
                        tiers is None or info.tier in tiers):
                    if position is None or override.position <= position:
                        del pending[holder]  # the event came before the retirement: it goes with it
                    else:
                        kept = True  # after it, read first on another partition: laid again below
            if not pending:
                del self._overrides[(block, scope)]
            elif kept:
                self._lay(block, scope, pending)
        return True


#: The tiers a clear removes by default (``kvstream worker --clear-scope gpu``): vLLM emits AllBlocksCleared on a
#: GPU prefix-cache reset, and offloaded copies survive it (docs/residency.md, "Clears").
CLEAR_TIERS = frozenset({"GPU"})
assert CLEAR_TIERS <= set(TIERS)
