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

Every such change is kept as an **override** of (block, ownership, holder), laid over the holders the changelog
last gave the block (its base). A changelog record of the block applied later replaces the base with what the
table said when the record was written, which may be older than the event; the overrides are then laid over it
again. An override goes as soon as a changelog record agrees with it (the table has caught up), or after
``window_s``, and the block then gets its base back: the backstop for what the event alone cannot tell (a second
physical copy, another KV cache group, an event the table's rules ignored). So the index equals the table once
the pipeline has caught up, at most ``window_s`` later. A source's events at or before its last clear (on the
cleared tiers) or restart, read late from another partition, are ignored, as the workers ignore them.

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
#: Seconds after a clear, restart or unregistration during which changelog records are taken without the holders
#: it retired (unless stored again since): the workers apply it, and write its removals, within the pipeline's lag.
RETIRING_S = 5.0
#: Below every position.
_BOTTOM: Position = (-(1 << 63), -(1 << 63), -(1 << 31))


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
    #: Block events ignored: at or before their source's last clear (on its tiers) or restart, read late.
    retired_late: int = 0
    #: Retired holders kept out of changelog records written before the workers applied the retirement.
    held_out: int = 0


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
        #: (block key, scope) with overrides -> the holders the changelog gave it (the base the overrides lie on):
        #: what the block gets back when its last override expires.
        self._base: dict[tuple[int, int], frozenset[int]] = {}
        #: (instance, data-parallel rank) -> tier (None: every tier) -> the position of its last clear or restart:
        #: its events at or before it, read late from another partition, are ignored.
        self._floors: dict[tuple[str, int], dict[str | None, Position]] = {}
        #: holder id -> ``time.monotonic()`` until which changelog records are taken without it: the holders a
        #: clear, restart or unregistration retired, which records the workers wrote before they applied it
        #: still carry. (block key, scope, holder) in ``_renewed``: stored again since, so kept.
        self._retiring: dict[int, float] = {}
        self._renewed: set[tuple[int, int, int]] = set()

    def __len__(self) -> int:
        """Blocks (per scope) with at least one override."""
        return len(self._overrides)

    @property
    def wants_changelog(self) -> bool:
        """Whether :meth:`after_changelog` has anything to do: overrides to lay, or retired holders to keep out."""
        return bool(self._overrides or self._retiring)

    # -- block events ----------------------------------------------------------------------------------------

    def block_event(self, stored: bool, ownership: str | None, block_hash: bytes, instance_id: str,
                    data_parallel_rank: int, tier: str, position: Position, parent_hash: bytes | None = None,
                    content_hash: int | None = None, now: float | None = None) -> bool:
        """Apply one ``BlockStored`` (``stored``) or ``BlockRemoved`` of a source with one publisher; False for
        one the source's last clear or restart already retired (read late, from another partition: the workers
        ignore it too, as ``cleared_late`` or ``retired_late``).

        Args:
            ownership: the event's ownership (vLLM PR #52067), None for the framework's tiers.
            block_hash: canonical block hash bytes (``kv_event.block_hash``).
            tier: canonical tier (``schemas.TIERS``).
            position: the event's ``(publisher_epoch, seq, batch_index)``.
            parent_hash, content_hash: a store's content keys (``BlockStored.parent_block_hash``, canonical
                bytes, and ``BlockStored.content_hash``, signed 64-bit); None: keep the block's.
            now: ``time.monotonic()`` (tests pass their own).
        """
        floors = self._floors.get((instance_id, data_parallel_rank))
        if floors is not None:
            floor = max(floors.get(tier, _BOTTOM), floors.get(None, _BOTTOM))
            if position <= floor:
                self.counters.retired_late += 1
                return False
        now = time.monotonic() if now is None else now
        block, scope = block_key(block_hash), self._scope_of(ownership)
        holder = self._holder_of(HolderInfo(instance_id, data_parallel_rank, tier, ownership))
        parent = None if parent_hash is None else block_key(parent_hash)
        content = None if content_hash is None else content_hash & _U64
        override = Override(stored, now + self.window_s, position, parent, content)
        key = (block, scope)
        pending = self._overrides.get(key)
        if pending is None:
            pending = self._overrides[key] = {}
            self._base[key] = self._in_scope(block, scope)  # what the changelog said, before any override
        pending[holder] = override
        self._expiry.append((override.expires, block, scope))
        self.counters.applied += 1
        if holder in self._retiring:
            if stored:
                self._renewed.add((block, scope, holder))
            else:
                self._renewed.discard((block, scope, holder))
        self._lay(block, scope, pending)
        return True

    def _in_scope(self, block: int, scope: int) -> frozenset[int]:
        """The table's holders of (block, scope) now."""
        held = self._table.holders_at((block,))
        if not held:
            return frozenset()
        ownership, holders = self._owner_of(scope), self._holders
        return frozenset(h for h in held[0] if holders[h].ownership == ownership)

    def _lay(self, block: int, scope: int, pending: dict[int, Override]) -> None:
        """Make the table's holders of (block, scope) the changelog's (the base) with ``pending`` laid over."""
        wanted = set(self._base.get((block, scope), ()))
        parent = content = None
        for holder, override in pending.items():
            if override.present:
                wanted.add(holder)
                if override.content is not None:
                    parent, content = override.parent, override.content
            else:
                wanted.discard(holder)
        if content is not None or wanted != self._in_scope(block, scope):
            self._table.replace(block, scope, sorted(wanted), parent, content)

    # -- changelog records ---------------------------------------------------------------------------------

    def after_changelog(self, keys: Iterable[bytes | None], scopes: dict[str | None, int],
                        now: float | None = None) -> None:
        """Lay the overrides over the blocks of changelog records just applied (their keys, ``<ownership or
        primary>/<hex>`` bytes; None for a record without a key), dropping those the records agree with."""
        if not self.wants_changelog:
            return
        now = time.monotonic() if now is None else now
        overrides, retiring, renewed = self._overrides, self._retiring, self._renewed
        if retiring:
            for holder in [h for h, until in retiring.items() if until <= now]:
                del retiring[holder]
            if not retiring:
                renewed.clear()
        for key in keys:
            if key is None:
                continue
            try:
                ownership, block = residency_key_block(key)
            except ValueError:
                continue
            scope = scopes.get(ownership)
            pending = overrides.get((block, scope))
            if pending is None and not retiring:
                continue
            base = self._in_scope(block, scope)  # the record just applied
            if retiring:
                stale = {h for h in base if h in retiring and (block, scope, h) not in renewed}
                if stale:  # written before the workers applied the retirement
                    base -= stale
                    self.counters.held_out += len(stale)
                    if pending is None:
                        self._table.replace(block, scope, sorted(base), None, None)
                        continue
                if pending is None:
                    continue
            self._base[(block, scope)] = base
            for holder, override in list(pending.items()):
                if override.expires <= now:
                    del pending[holder]
                    self.counters.expired += 1
                elif (holder in base) == override.present:
                    del pending[holder]  # the table has caught up with the event
                    self.counters.confirmed += 1
            if pending:
                self._lay(block, scope, pending)
            else:
                del overrides[(block, scope)], self._base[(block, scope)]

    def expire(self, now: float | None = None) -> None:
        """Drop the overrides past their window, and give their blocks back what the changelog said (a record
        that agrees may never come: an event the table's rules ignored, a second physical copy)."""
        now = time.monotonic() if now is None else now
        expiry, overrides = self._expiry, self._overrides
        while expiry and expiry[0][0] <= now:
            _, block, scope = expiry.popleft()
            pending = overrides.get((block, scope))
            if pending is None:
                continue
            expired = [holder for holder, override in pending.items() if override.expires <= now]
            if not expired:
                continue
            for holder in expired:
                del pending[holder]
            self.counters.expired += len(expired)
            self._lay(block, scope, pending)
            if not pending:
                del overrides[(block, scope)], self._base[(block, scope)]

    # -- source-wide events --------------------------------------------------------------------------------

    def retire(self, kind: str, instance_id: str, data_parallel_rank: int | None, tiers: frozenset[str] | None,
               position: Position | None, written_at: float = 0.0) -> bool:
        """A source's holders leave the index at once: a clear (``tiers``: the tiers in its scope), a publisher
        restart or an unregistration (``tiers`` None: every tier and ownership). ``data_parallel_rank`` None: every
        rank of the instance. The overrides of the source's events after ``position`` stay (and are laid again):
        on another partition of kv-events they may have been read before this copy; its events at or before
        ``position`` read later are ignored (a clear's or a restart's; an unregistration has no position, and
        the events after it apply again). ``written_at`` is the record's ``ts``, the same in every copy, so a later
        unregistration of the same instance is not taken for a copy of an earlier one. Returns False for a copy
        already applied."""
        mark = (kind, instance_id, data_parallel_rank, position, written_at)
        if mark in self._retired_set:
            return False
        if len(self._retired) == self._retired.maxlen:
            self._retired_set.discard(self._retired[0])
        self._retired.append(mark)
        self._retired_set.add(mark)
        self.counters.retirements += 1
        if position is not None and data_parallel_rank is not None:
            floors = self._floors.setdefault((instance_id, data_parallel_rank), {})
            for tier in (None,) if tiers is None else tiers:
                floors[tier] = max(floors.get(tier, _BOTTOM), position)

        def retired(info: HolderInfo) -> bool:
            return info.instance_id == instance_id and (
                data_parallel_rank is None or info.data_parallel_rank == data_parallel_rank) and (
                tiers is None or info.tier in tiers)

        gone = {holder for holder, info in enumerate(self._holders) if retired(info)}
        until = time.monotonic() + RETIRING_S
        for holder in gone:
            self._table.remove_holder(holder)
            self._retiring[holder] = until
        self._renewed = {(b, sc, h) for b, sc, h in self._renewed if h not in gone}
        # the overrides live one window at most, so a scan of them all is bounded (and retirements are rare)
        for key, pending in list(self._overrides.items()):
            self._base[key] = self._base[key] - gone
            kept = False
            for holder, override in list(pending.items()):
                if holder in gone:
                    if position is None or override.position <= position:
                        del pending[holder]  # the event came before the retirement: it goes with it
                    else:
                        kept = True  # after it, read first on another partition: laid again below
            if not pending:
                del self._overrides[key], self._base[key]
            elif kept:
                self._lay(*key, pending)
        return True


#: The tiers a clear removes by default (``kvstream worker --clear-scope gpu``): vLLM emits AllBlocksCleared on a
#: GPU prefix-cache reset, and offloaded copies survive it (docs/residency.md, "Clears").
CLEAR_TIERS = frozenset({"GPU"})
assert CLEAR_TIERS <= set(TIERS)
