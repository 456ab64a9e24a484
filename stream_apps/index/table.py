"""The fleet index's block table: every resident (block, scope, holder) of the fleet, in integers only.

An entry of the residency table is keyed by (ownership, engine block hash) and lists the block's resident
holders; :meth:`~PyBlockTable.replace` applies one such entry, and the queries walk a request's chain of
blocks, by engine block hash (:meth:`~PyBlockTable.holders_at`) or by content along the token path
(:meth:`~PyBlockTable.content_walk`), so a router finds who holds the longest prefix. The layer above interns
the strings; here every value is an integer:

- **block key**: u64, a Python int in ``[0, 2**64)``: :func:`block_key` of the canonical block hash;
- **content key**: u64, a block's content hash as unsigned (``value & (2**64 - 1)`` of a signed long);
- **holder**: u32 id the caller assigns (an instance and data-parallel rank on a tier);
- **scope**: u32 id of an ownership, assigned by the caller; a block's holders are kept per scope, as the
  residency entries of its ownerships list them;
- **group** and **tier index** of a holder, for the scored lookups (:meth:`~PyBlockTable.chain_runs`,
  :meth:`~PyBlockTable.content_runs`): the caller registers each holder once with
  :meth:`~PyBlockTable.set_holder` (group: an id it interns per (instance, data-parallel rank); tier: the index
  in ``schemas.TIERS``, 0..4 for GPU, CPU, STORAGE, EXTERNAL, UNKNOWN); holder and group ids below
  :data:`MAX_INFO_ID`, as the compiled table keeps them in arrays indexed by id.

Two implementations with identical results: :class:`BlockTable` of ``_table.pyx`` (compiled by setup.py when
a C compiler is there: 40 bytes a block and 8 a further holder, plus the hash slots, module docstring there)
and :class:`PyBlockTable` here, the reference, with dicts. :data:`BlockTable` is the compiled one unless it
was not built or ``KVSTREAM_PURE_PYTHON=1`` is set (as :mod:`schemas.compiled` chooses for the codecs);
:data:`CompiledBlockTable` is the compiled class or None.

Errors, both implementations: OverflowError for a key or id outside its range (negative, or past 2**64 or
2**32), TypeError for one that is not an integer; the table is unchanged then (every argument is checked
before any change).
"""

from __future__ import annotations

import math
import operator
import os
import sys
from collections.abc import Iterator, Sequence

from schemas.compiled import PURE_PYTHON_VARIABLE
from schemas.tiers import TIERS
from stream_apps.index.scoring import runs_by_group
from stream_apps.index.table_keys import block_key, residency_key_block

#: A block's dump: ``(block, parent | None, content | None, ((scope, holder), ...))``, links sorted.
Item = tuple[int, "int | None", "int | None", tuple[tuple[int, int], ...]]
#: A group's prefix runs (:meth:`PyBlockTable.chain_runs`): ``(group, any, score, (runs per tier index: 5),
#: (the ordered boundaries gpu, cpu, disk of Mooncake's walk: 3, ``scoring.PHASES``))``, in blocks.
Run = tuple[int, int, float, tuple[int, int, int, int, int], tuple[int, int, int]]

_U64 = 1 << 64
_U32 = 1 << 32
#: Holder and group ids of :meth:`PyBlockTable.set_holder` are below this (2**24): the compiled table keeps
#: their metadata in arrays indexed by id, so ids must be dense (the fleet index's are 0, 1, 2, ...).
MAX_INFO_ID = 1 << 24
#: Tiers of the holder metadata: ``set_holder``'s tier index is an index in this (``schemas.TIERS``).
TIER_COUNT = len(TIERS)


def _block_keys(hashes: Sequence[bytes]) -> list[int]:
    """:func:`block_key` of each hash, in order (the reference of the compiled ``_table.block_keys``)."""
    return [block_key(h) for h in hashes]


def _u64(value, what: str) -> int:
    value = operator.index(value)  # TypeError for a float or a str, as the compiled conversions
    if not 0 <= value < _U64:
        raise OverflowError(f"{what} {value} is not in [0, 2**64)")
    return value


def _u32(value, what: str) -> int:
    value = operator.index(value)
    if not 0 <= value < _U32:
        raise OverflowError(f"{what} {value} is not in [0, 2**32)")
    return value


def _tier_weights(weights) -> tuple[float, ...]:
    """The 5 tier weights of a scored lookup as floats, checked: what the compiled table's conversion accepts
    (numbers; a str is refused rather than parsed)."""
    weights = tuple(weights)
    if len(weights) != TIER_COUNT:
        raise ValueError(f"weights: {TIER_COUNT} tier weights expected (schemas.TIERS order), got {len(weights)}")
    out = []
    for weight in weights:
        if isinstance(weight, (str, bytes, bytearray)):
            raise TypeError(f"weights: a tier weight must be a number, not {type(weight).__name__}")
        weight = float(weight)
        if math.isnan(weight):
            raise ValueError("weights: a tier weight is NaN (the best weight of a block would be undefined)")
        out.append(weight)
    return tuple(out)


def _holder_filter(allowed):
    """``allowed`` of a scored lookup: None, a callable, or the bytes of a buffer (``memoryview(allowed)`` as
    unsigned bytes; TypeError for anything else, as the compiled table)."""
    if allowed is None or callable(allowed):
        return allowed
    return memoryview(allowed).cast("B")


class _Block:
    """One block of :class:`PyBlockTable`."""

    __slots__ = ("content", "holders", "parent", "scopes")

    def __init__(self, parent: int | None, content: int | None) -> None:
        #: the parent's block key, or None (a root block, or a parent never told)
        self.parent = parent
        #: the content key, or None (a tokenless store that no scope has given a content yet)
        self.content = content
        #: scope -> its holders (never empty)
        self.scopes: dict[int, frozenset[int]] = {}
        #: holder -> how many scopes hold it (never 0): a holder in two scopes holds one block
        self.holders: dict[int, int] = {}


class PyBlockTable:
    """The block table in Python (the reference of the compiled :class:`BlockTable`, same results).

    A block is present while some scope of it has a holder: a block key with its parent, its content, and its
    holders per scope. Blocks with a content are also found by ``(parent or ROOT, content)`` for the content
    walk. Every method is O(its arguments and its answer) except :meth:`remove_holder` (one pass over the
    blocks) and :meth:`items`. Not thread-safe.
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forgets every block and holder (the holders' metadata of :meth:`set_holder` too)."""
        #: block key -> block
        self._blocks: dict[int, _Block] = {}
        #: (parent or None, content) -> keys of the blocks with that parent and content
        self._by_content: dict[tuple[int | None, int], set[int]] = {}
        #: holder -> blocks it holds (entries may be 0)
        self._holder_blocks: dict[int, int] = {}
        #: (block, scope, holder) links
        self._links = 0
        #: holder -> (group, tier index), from set_holder; and 1 + the highest holder in it (0: none)
        self._info: dict[int, tuple[int, int]] = {}
        self._info_end = 0
        #: bumped by every change, so items() notices a table changed under it
        self._version = getattr(self, "_version", 0) + 1

    # -- changes ------------------------------------------------------------------------------------------

    def replace(self, block: int, scope: int, holders: Sequence[int], parent: int | None = None,
                content: int | None = None) -> None:
        """Makes ``holders`` exactly the holders of (``block``, ``scope``): one residency entry applied.

        Args:
            block: the block key (u64).
            scope: the entry's ownership (u32).
            holders: holder ids (u32), in any order, repeats ignored; empty: the scope's holders go.
            parent: the parent's block key (u64) to set on the block, overwriting; None keeps what the block
                has (another scope's entry of the same block may have given it).
            content: the content key (u64) to set on the block, overwriting; None keeps what the block has (a
                tokenless offloading store inherits the content of its block's other scopes so).

        A block left with no holder in any scope is removed, with its parent and content; a block absent
        and given no holder stays absent (its ``parent`` and ``content`` are dropped).

        Raises:
            OverflowError, TypeError: an argument out of range or not an integer (nothing changes).
        """
        block = _u64(block, "block")
        scope = _u32(scope, "scope")
        new = frozenset(_u32(h, "holder") for h in holders)
        parent = None if parent is None else _u64(parent, "parent")
        content = None if content is None else _u64(content, "content")
        blk = self._blocks.get(block)
        if blk is None:
            if not new:
                return
            blk = self._blocks[block] = _Block(parent, content)
            self._index(block, blk)
            old: frozenset[int] = frozenset()
        else:
            old = blk.scopes.get(scope, frozenset())
        self._version += 1
        counts = self._holder_blocks
        for h in old - new:
            n = blk.holders[h] - 1
            if n:
                blk.holders[h] = n
            else:
                del blk.holders[h]
                counts[h] -= 1
        for h in new - old:
            n = blk.holders.get(h, 0)
            blk.holders[h] = n + 1
            if not n:
                counts[h] = counts.get(h, 0) + 1
        self._links += len(new) - len(old)
        if new:
            blk.scopes[scope] = new
        else:
            blk.scopes.pop(scope, None)
        if not blk.scopes:
            self._drop(block, blk)
            return
        new_parent = blk.parent if parent is None else parent
        new_content = blk.content if content is None else content
        if (new_parent, new_content) != (blk.parent, blk.content):
            self._unindex(block, blk)
            blk.parent, blk.content = new_parent, new_content
            self._index(block, blk)

    def remove_holder(self, holder: int) -> int:
        """Drops ``holder`` (u32) from every scope of every block (an instance left the fleet); blocks left
        with no holder go. Returns how many blocks it held. O(blocks): one pass over them."""
        holder = _u32(holder, "holder")
        affected = 0
        for block, blk in list(self._blocks.items()):
            if holder not in blk.holders:
                continue
            affected += 1
            del blk.holders[holder]
            for scope, held in list(blk.scopes.items()):
                if holder in held:
                    self._links -= 1
                    if len(held) == 1:
                        del blk.scopes[scope]
                    else:
                        blk.scopes[scope] = held - {holder}
            if not blk.scopes:
                self._drop(block, blk)
        if holder in self._holder_blocks:
            self._holder_blocks[holder] = 0
        if affected:
            self._version += 1
        return affected

    def _index(self, block: int, blk: _Block) -> None:
        if blk.content is not None:
            self._by_content.setdefault((blk.parent, blk.content), set()).add(block)

    def _unindex(self, block: int, blk: _Block) -> None:
        if blk.content is not None:
            key = (blk.parent, blk.content)
            same = self._by_content[key]
            same.discard(block)
            if not same:
                del self._by_content[key]

    def _drop(self, block: int, blk: _Block) -> None:
        self._unindex(block, blk)
        del self._blocks[block]

    def set_holder(self, holder: int, group: int, tier: int) -> None:
        """Registers the group and tier of ``holder``, which :meth:`chain_runs` and :meth:`content_runs` read;
        a holder registered again gets the new values. O(1).

        Args:
            holder: holder id (u32, below :data:`MAX_INFO_ID`).
            group: the id of what the runs are computed per (the caller's (instance, data-parallel rank)):
                u32 below :data:`MAX_INFO_ID`.
            tier: the holder's tier, an index in ``schemas.TIERS`` (0..4: GPU, CPU, STORAGE, EXTERNAL, UNKNOWN).

        Raises:
            OverflowError: holder or group outside ``[0, MAX_INFO_ID)``. ValueError: tier outside 0..4.
            TypeError: an argument that is not an integer. Nothing changes then.
        """
        holder = _u32(holder, "holder")
        group = _u32(group, "group")
        tier = operator.index(tier)
        if holder >= MAX_INFO_ID:
            raise OverflowError(f"holder {holder} is not below 2**24 (holder metadata is indexed by id)")
        if group >= MAX_INFO_ID:
            raise OverflowError(f"group {group} is not below 2**24 (group state is indexed by id)")
        if not 0 <= tier < TIER_COUNT:
            raise ValueError(f"tier {tier} is not a tier index (0..{TIER_COUNT - 1}, schemas.TIERS)")
        self._info[holder] = (group, tier)
        self._info_end = max(self._info_end, holder + 1)

    def holder_info(self, holder: int) -> tuple[int, int] | None:
        """``(group, tier)`` of ``holder`` as :meth:`set_holder` registered it, or None."""
        return self._info.get(_u32(holder, "holder"))

    @property
    def holder_info_end(self) -> int:
        """1 + the highest holder id given to :meth:`set_holder` since the table was made or cleared; 0 if
        none. A caller registering ids 0, 1, 2, ... in order reads it as how many it has registered."""
        return self._info_end

    # -- queries ------------------------------------------------------------------------------------------

    def holders_at(self, chain: Sequence[int]) -> list[tuple[int, ...]]:
        """Who holds each block of a chain, by engine block hash.

        Args:
            chain: block keys (u64), in prefix order.

        Returns:
            Per block of ``chain``, in order, the ids of the holders holding it in any scope, ascending and
            distinct, stopping before the first block that is absent (so ``len(result) <= len(chain)``, and
            every tuple is non-empty).
        """
        keys = [_u64(k, "block") for k in chain]
        out = []
        blocks = self._blocks
        for key in keys:
            blk = blocks.get(key)
            if blk is None:
                break
            out.append(tuple(sorted(blk.holders)))
        return out

    def _walk(self, contents: Sequence[int]) -> Iterator[set[int]]:
        """The candidate block keys per depth of the token path, up to the first depth with none."""
        keys = [_u64(c, "content") for c in contents]
        if not keys:
            return
        by_content = self._by_content
        candidates = set(by_content.get((None, keys[0]), ()))
        depth = 0
        while candidates:
            yield candidates
            depth += 1
            if depth == len(keys):
                return
            following: set[int] = set()
            for parent in candidates:
                following.update(by_content.get((parent, keys[depth]), ()))
            candidates = following

    def content_walk(self, contents: Sequence[int]) -> list[tuple[int, ...]]:
        """Who holds each depth of a token path, by content, over every chain of equal content.

        Depth 0's candidates are the blocks without parent whose content is ``contents[0]``; depth i's, the
        blocks whose content is ``contents[i]`` and whose parent is one of depth i-1's candidates (engines
        with different hash seeds give several chains of equal content: all are followed).

        Args:
            contents: content keys (u64), in prefix order.

        Returns:
            Per depth, the ids of the holders of any of its candidates, ascending and distinct, stopping
            before the first depth without candidate.
        """
        blocks = self._blocks
        return [tuple(sorted({h for key in candidates for h in blocks[key].holders}))
                for candidates in self._walk(contents)]

    def content_walk_blocks(self, contents: Sequence[int]) -> list[tuple[int, ...]]:
        """Per depth of :meth:`content_walk`, its candidate block keys, ascending (more than one: equal content
        under unequal engine hashes)."""
        return [tuple(sorted(candidates)) for candidates in self._walk(contents)]

    def content_mixed(self, contents: Sequence[int]) -> bool:
        """Whether a depth of :meth:`content_walk` has more than one candidate block (equal content under unequal
        engine hashes): the cheap test before :meth:`content_walk_blocks` names them."""
        return any(len(candidates) > 1 for candidates in self._walk(contents))

    def chain_runs(self, chain: Sequence[int], weights: Sequence[float], allowed=None) -> list[Run]:
        """The prefix runs of each group holding the chain's block 0: :meth:`holders_at` and the scoring of
        ``stream_apps.index.scoring.prefix_runs`` in one call, per group rather than per holder.

        A group's runs, in blocks from block 0, over its allowed holders: ``any``, the blocks held without a gap
        on some tier (each block on any of the group's tiers); ``score``, the sum over those blocks of the
        highest weight among the tiers holding the block; per tier, the blocks held without a gap on that tier;
        and the three boundaries of Mooncake's ordered walk (``scoring.advance_phases``: consecutive blocks on the
        GPU, then from the first GPU miss in CPU memory, then from the first CPU miss on STORAGE or EXTERNAL).
        The walk stops before the first absent block, the scoring at the first block that extends no run.

        Args:
            chain: block keys (u64), in prefix order (as :meth:`holders_at`).
            weights: 5 numbers, the weight of each tier index (``schemas.TIERS`` order); not NaN.
            allowed: None (every holder counts); a buffer of bytes (``bytes``, ``bytearray``, ...) over holder
                ids, a holder counting when its byte is nonzero (ids past its end do not count); or a callable
                on a holder id, whose truth says whether it counts, called once per distinct holder of the walk,
                in ascending order, before the scoring (so also for holders the runs end before: it must not
                depend on the order of calls). The callable may use the table: the walk is taken first.

        Returns:
            One :data:`Run` per group holding block 0 through an allowed holder, in the order of their smallest
            such holder id: ``(group, any, score, tier runs (5), ordered boundaries (3))``; ``any >= 1``.

        Raises:
            OverflowError, TypeError: a key out of range or not an integer; a weight that is not a number, or
            ``allowed`` neither None, a callable nor a buffer (TypeError). ValueError: not 5 weights, or NaN.
            KeyError: a holder of the walk the scoring reaches has no :meth:`set_holder` metadata. Whatever
            the callable raises.
        """
        weights = _tier_weights(weights)
        allowed = _holder_filter(allowed)
        return self._runs(self.holders_at(chain), weights, allowed)

    def content_runs(self, contents: Sequence[int], weights: Sequence[float], allowed=None) -> list[Run]:
        """:meth:`chain_runs` over the depths of the token path ``contents`` (:meth:`content_walk`): a depth's
        holders are those of any of its candidate blocks. Same arguments, answer and errors."""
        weights = _tier_weights(weights)
        allowed = _holder_filter(allowed)
        return self._runs(self.content_walk(contents), weights, allowed)

    def _runs(self, held: list[tuple[int, ...]], weights: tuple[float, ...], allowed) -> list[Run]:
        """The scoring of :meth:`chain_runs`: ``scoring.runs_by_group``, the reference loop, over the walk."""
        if allowed is None:
            counts = None
        elif callable(allowed):
            verdicts = {h: bool(allowed(h)) for h in sorted({h for row in held for h in row})}
            counts = verdicts.__getitem__
        else:
            mask = allowed

            def counts(h: int) -> bool:
                return h < len(mask) and mask[h] != 0

        info = self._info

        def identify(holder: int):
            meta = info.get(holder)
            if meta is None:
                raise KeyError(f"holder {holder} has no metadata: set_holder({holder}, group, tier) first")
            if counts is not None and not counts(holder):
                return None
            return meta[0], TIERS[meta[1]]

        runs = runs_by_group(held, identify, dict(zip(TIERS, weights)))
        return [(group, run.any, run.score, tuple(run.tiers.get(tier, 0) for tier in TIERS), tuple(run.classes))
                for group, run in runs.items()]

    def holder_blocks(self, holder: int) -> int:
        """Blocks ``holder`` (u32) holds now, in any scope; 0 for a holder never seen. O(1)."""
        return self._holder_blocks.get(_u32(holder, "holder"), 0)

    def __len__(self) -> int:
        """Blocks in the table."""
        return len(self._blocks)

    @property
    def links(self) -> int:
        """Resident (block, scope, holder) links: a holder in two scopes of one block counts twice."""
        return self._links

    def memory_bytes(self) -> int:
        """Bytes the table's objects take, by ``sys.getsizeof`` (an estimate: shared small ints are counted,
        the interpreter's allocator slack is not). O(blocks)."""
        size = sys.getsizeof
        total = size(self._blocks) + size(self._by_content) + size(self._holder_blocks) + size(self._info)
        for key, blk in self._blocks.items():
            total += size(key) + size(blk) + size(blk.scopes) + size(blk.holders)
            total += sum(size(held) for held in blk.scopes.values())
        total += sum(size(key) + size(same) for key, same in self._by_content.items())
        return total

    def items(self) -> Iterator[Item]:
        """Every block as ``(block, parent | None, content | None, ((scope, holder), ...))``, its links sorted
        by (scope, holder), the blocks in no particular order (a full dump).

        Raises:
            RuntimeError: the table changed during the iteration.
        """
        version = self._version
        for key in list(self._blocks):
            if self._version != version:
                raise RuntimeError("BlockTable changed during items()")
            blk = self._blocks[key]
            links = tuple(sorted((scope, h) for scope, held in blk.scopes.items() for h in held))
            yield key, blk.parent, blk.content, links
        if self._version != version:
            raise RuntimeError("BlockTable changed during items()")

    def __repr__(self) -> str:
        return f"PyBlockTable(blocks={len(self._blocks)}, links={self._links})"


def _compiled():
    if os.environ.get(PURE_PYTHON_VARIABLE) == "1":
        return None
    try:
        from stream_apps.index._table import BlockTable as compiled
    except ImportError:  # not built: no C compiler at install time
        return None
    return compiled


#: The compiled table class (``_table.pyx``), or None when it was not built or KVSTREAM_PURE_PYTHON=1 is set.
CompiledBlockTable = _compiled()
#: The table class to use: the compiled one where there is one, else :class:`PyBlockTable`.
BlockTable = CompiledBlockTable or PyBlockTable
#: ``hashes -> [block_key(h) for h in hashes]``: compiled with the table (8-byte hashes read in C), else
#: :func:`_block_keys`. A list of block keys for the queries, from a chain of canonical block hashes.
#: ``residency_key_block(key bytes) -> (ownership or None, block key)``: compiled with the table (the 16 hex
#: digits of an 8-byte hash read in C), else :func:`stream_apps.index.table_keys.residency_key_block`.
if CompiledBlockTable is not None:
    from stream_apps.index._table import block_keys

    try:
        from stream_apps.index._table import residency_key_block
    except ImportError:  # a module built before it had one (a checkout updated without `make install`)
        pass
else:
    block_keys = _block_keys

__all__ = ["MAX_INFO_ID", "TIER_COUNT", "BlockTable", "CompiledBlockTable", "Item", "PyBlockTable", "Run", "block_key",
           "block_keys", "residency_key_block"]
