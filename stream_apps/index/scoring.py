"""Scoring a prefix lookup: from the holders of each block of a request to the answers routers read.

A lookup walks a request's blocks in prefix order and gets, per depth, the holders of that block (a holder is
one (instance, data-parallel rank, tier, ownership)). :func:`prefix_runs` turns that into, per (instance,
data-parallel rank), how far from block 0 the request is held without a gap: on any tier, on each tier, and the
three ordered boundaries of Mooncake's conductor (an engine's load order, :data:`PHASES`). The two answer shapes
are built from it:

* :func:`prefix_match_rows`: kvstream's own ``POST /prefix-match/`` (blocks per tier and an llm-d-style score:
  the sum over the matched blocks of the best weight among the tiers holding each, llm-d's
  ``pkg/kvcache/backend.go`` convention);
* :func:`instances_answer`: Mooncake's and Dynamo's ``/query`` answer, in tokens (docs/querying.md, "For router
  authors").

Two ways to the runs, with identical results: :func:`prefix_runs` (the reference, in Python, over the holders
of each depth) and :func:`table_prefix_runs`, which has the block table walk the chain and score it in one call
(``BlockTable.chain_runs`` / ``content_runs``: compiled in ``_table.pyx``, the reference's loop in
``PyBlockTable``), given each holder's group (its (instance, data-parallel rank)) and tier, registered once.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import NamedTuple

from schemas.tiers import TIERS

#: Weight of a tier the weights do not name (``POST /prefix-match/``'s score).
OTHER_TIER_WEIGHT = 0.25

#: The three phases of Mooncake's conductor's walk (its ``indexer-api-design.md``, "Result fields"), and the
#: kvstream tiers each phase reads: per (instance, rank), a run of consecutive blocks on the GPU; at the first GPU
#: miss, the same block and the next ones in CPU memory; at the first CPU miss, the same block and the next ones
#: on disk (kvstream's ``STORAGE``, and ``EXTERNAL``, a secondary tier outside the engine such as a remote KV
#: store); the first disk miss ends the walk, which never goes back to a higher tier. ``UNKNOWN`` is in no phase.
#: The boundaries are cumulative: ``gpu <= cpu <= disk <= longest prefix on any tier``.
PHASES: dict[str, tuple[str, ...]] = {
    "gpu": ("GPU",),
    "cpu": ("CPU",),
    "disk": ("STORAGE", "EXTERNAL"),
}
_PHASE_NAMES = tuple(PHASES)
assert _PHASE_NAMES == ("gpu", "cpu", "disk"), "instances_answer names the three boundaries"
#: tier -> bit mask of the phases that read it (bit 0 gpu, 1 cpu, 2 disk); ``_table.pyx``'s TIER_PHASE_BITS.
_PHASE_BITS = {tier: sum(1 << i for i, name in enumerate(_PHASE_NAMES) if tier in PHASES[name]) for tier in TIERS}
#: tier -> its index in the block table's holder metadata (``set_holder``'s ``tier``): ``schemas.TIERS``'s order.
TIER_INDEX = {tier: i for i, tier in enumerate(TIERS)}
#: (tier, index) in tier-name order: a table run's per-tier runs become a dict already in the order in which
#: the answers list the tiers.
_TIERS_BY_NAME = tuple(sorted(TIER_INDEX.items()))


class HolderInfo(NamedTuple):
    """Who holds a block, and where: the identity of one holder of the index."""

    #: Serving instance (``kv_event.instance_id``); the router's target.
    instance_id: str
    #: Data-parallel rank of the engine core holding the block (vLLM ``KVEventBatch.data_parallel_rank``).
    data_parallel_rank: int
    #: Canonical tier (``schemas.TIERS``).
    tier: str
    #: Ownership (vLLM PR #52067): None for the framework's own tiers, else the secondary tier's name.
    ownership: str | None


class PrefixRun:
    """How far one (instance, data-parallel rank) holds a request from block 0, in blocks."""

    __slots__ = ("any", "classes", "score", "tiers")

    def __init__(self, any: int = 0, score: float = 0.0, tiers: dict[str, int] | None = None,
                 classes: list[int] | None = None) -> None:
        #: Longest consecutive prefix held on any tier.
        self.any = any
        #: Sum over those blocks of the best tier weight among the tiers holding each.
        self.score = score
        #: tier -> longest consecutive prefix held on that tier alone (tiers of 0 absent).
        self.tiers: dict[str, int] = {} if tiers is None else tiers
        #: The ordered boundaries of :data:`PHASES` in blocks, ``[gpu, cpu, disk]``: where the engine's load order
        #: (GPU, then CPU, then disk, never back) ends for this rank (:func:`advance_phases`).
        self.classes = [0] * len(_PHASE_NAMES) if classes is None else classes


def advance_phases(bounds: list[int], depth: int, bits: int) -> None:
    """One block of Mooncake's ordered walk: ``bounds`` (``[gpu, cpu, disk]`` in blocks, cumulative) after block
    ``depth``, held on the phases of ``bits`` (:data:`PHASES`: bit 0 GPU, 1 CPU, 2 disk), changed in place.

    The walk is at ``depth`` while ``disk == depth``. Still in the GPU phase (``gpu == depth``), a block on the
    GPU moves all three boundaries; else, still in the GPU or CPU phase (``cpu == depth``), a block in CPU memory
    moves ``cpu`` and ``disk``; else a block on disk moves ``disk``; a block on none of the tiers the walk may
    still read ends it (the later blocks leave every boundary where it is)."""
    if bounds[2] != depth:
        return  # the walk ended earlier
    if bounds[0] == depth and bits & 1:
        bounds[0] = bounds[1] = bounds[2] = depth + 1
    elif bounds[1] == depth and bits & 2:
        bounds[1] = bounds[2] = depth + 1
    elif bits & 4:
        bounds[2] = depth + 1


def prefix_runs(holders_per_depth: Sequence[Sequence[int]], holders: Sequence[HolderInfo],
                weights: Mapping[str, float], allowed=None) -> dict[tuple[str, int], PrefixRun]:
    """The prefix runs of every (instance, data-parallel rank) that holds the request's block 0.

    Args:
        holders_per_depth: per block of the request, in prefix order, the holder ids holding it (what
            ``BlockTable.holders_at`` and ``content_walk`` give; it ends at the first block nobody holds).
        holders: holder id -> :class:`HolderInfo`.
        weights: tier -> weight of the score (others :data:`OTHER_TIER_WEIGHT`).
        allowed: None, or a predicate on a :class:`HolderInfo`: holders it refuses are left out (a model or
            tenant filter, a down source).

    Returns:
        (instance_id, data_parallel_rank) -> :class:`PrefixRun`; only keys holding block 0 appear, since a run
        that misses block 0 is empty.

    Raises:
        IndexError, KeyError: a holder id that ``holders`` does not have.
    """
    def identify(holder_id: int):
        info = holders[holder_id]
        if allowed is not None and not allowed(info):
            return None
        return (info.instance_id, info.data_parallel_rank), info.tier
    return runs_by_group(holders_per_depth, identify, weights)


def runs_by_group(holders_per_depth: Sequence[Sequence[int]], identify: Callable[[int], tuple | None],
                  weights: Mapping[str, float]) -> dict[Hashable, PrefixRun]:
    """:func:`prefix_runs` over any grouping of holders: the reference loop, which ``PyBlockTable.chain_runs``
    runs as it is and ``_table.pyx`` runs compiled.

    Args:
        holders_per_depth: as :func:`prefix_runs`'s.
        identify: holder id -> ``(group, tier)``, or None for a holder left out; called for each holder of each
            depth, in order, until the runs end (its exceptions propagate).
        weights: tier -> weight (others :data:`OTHER_TIER_WEIGHT`).

    Returns:
        group -> :class:`PrefixRun`, for the groups holding block 0, in the order they first appear there.
    """
    runs: dict[Hashable, PrefixRun] = {}
    for depth, held in enumerate(holders_per_depth):
        present: dict[Hashable, list] = {}
        for holder_id in held:
            who = identify(holder_id)
            if who is None:
                continue
            key, tier = who
            if depth and key not in runs:
                continue  # did not hold block 0: nothing it holds later counts
            seen = present.get(key)
            if seen is None:
                present[key] = [{tier}, _PHASE_BITS.get(tier, 0)]
            else:
                seen[0].add(tier)
                seen[1] |= _PHASE_BITS.get(tier, 0)
        extended = False
        for key, (tiers, mask) in present.items():
            run = runs.get(key)
            if run is None:
                run = runs[key] = PrefixRun()
            if run.any != depth:
                continue  # its run ended earlier
            extended = True
            run.any += 1
            run.score += max(weights.get(t, OTHER_TIER_WEIGHT) for t in tiers)
            for tier in tiers:
                if run.tiers.get(tier, 0) == depth:
                    run.tiers[tier] = depth + 1
            advance_phases(run.classes, depth, mask)
        if not extended:
            break  # every run has ended: deeper blocks change nothing
    return runs


def _register_holders(table, holders: Sequence[HolderInfo]) -> bool:
    """Gives the table the group and tier of every holder it has not been given yet (holder ids are registered
    in order, so the table's ``holder_info_end`` is how many it has). A holder's group is the smallest holder
    id of its (instance, data-parallel rank): so group -> key is ``holders[group]``, and no other state is
    kept. False when a holder's tier is not one of ``schemas.TIERS`` (the table has five tier slots): the
    caller then scores in Python, the reference handling any tier string."""
    start = table.holder_info_end
    if start >= len(holders):
        return True
    if holders[start].tier not in TIER_INDEX:
        return False  # checked before the groups are rebuilt: every later call stops here at O(1)
    groups: dict[tuple[str, int], int] = {}
    for holder_id in range(start):
        info = holders[holder_id]
        groups.setdefault((info.instance_id, info.data_parallel_rank), holder_id)
    for holder_id in range(start, len(holders)):
        info = holders[holder_id]
        tier = TIER_INDEX.get(info.tier)
        if tier is None:
            return False
        table.set_holder(holder_id, groups.setdefault((info.instance_id, info.data_parallel_rank), holder_id),
                         tier)
    return True


def table_prefix_runs(table, keys: Sequence[int], holders: Sequence[HolderInfo], weights: Mapping[str, float],
                      allowed=None, *, by_content: bool = False) -> dict[tuple[str, int], PrefixRun]:
    """:func:`prefix_runs` of the table's walk of ``keys``, walked and scored by the table in one call.

    Equal to ``prefix_runs(table.holders_at(keys), holders, weights, allowed)`` (``content_walk`` with
    ``by_content``), run by ``table.chain_runs`` (``content_runs``): the compiled table does it in C.

    Args:
        table: a ``BlockTable`` or ``PyBlockTable`` whose holder ids index ``holders``. The table keeps each
            holder's group and tier (``set_holder``, given here for the holders it lacks, so a holder added to
            ``holders`` since the last call is registered on this one); its ``clear()`` forgets them and they
            are given again. One ``holders`` per table.
        keys: block keys (u64) in prefix order, or with ``by_content`` the content keys of the token path.
        holders: holder id -> :class:`HolderInfo`; append-only (a holder id never changes its identity).
        weights: tier -> weight (others :data:`OTHER_TIER_WEIGHT`); taken as floats, NaN refused.
        allowed: None; a predicate on a :class:`HolderInfo`, pure (called once per distinct holder of the
            walk, possibly for holders the runs end before); or a buffer of one byte per holder id, non-zero
            for a holder that counts (ids past its end do not): the compiled table reads it without a call back.
        by_content: walk ``keys`` as a token path (``content_walk``) rather than a chain (``holders_at``).

    Returns:
        As :func:`prefix_runs`: (instance_id, data_parallel_rank) -> :class:`PrefixRun`.

    Raises:
        OverflowError, TypeError: a key out of range or not an integer. ValueError: a NaN weight.
    """
    if not _register_holders(table, holders):
        walk = table.content_walk if by_content else table.holders_at
        if allowed is not None and not callable(allowed):  # the reference takes a predicate on HolderInfo
            flags = memoryview(allowed).cast("B")
            ids = {info: i for i, info in enumerate(holders)}  # holders are distinct: ids[holders[i]] == i

            def allowed(info: HolderInfo) -> bool:
                return ids[info] < len(flags) and flags[ids[info]] != 0
        return prefix_runs(walk(keys), holders, weights, allowed)
    tier_weights = [weights.get(tier, OTHER_TIER_WEIGHT) for tier in TIERS]
    verdict = allowed if allowed is None or not callable(allowed) else (
        lambda holder_id: allowed(holders[holder_id]))
    rows = (table.content_runs if by_content else table.chain_runs)(keys, tier_weights, verdict)
    runs: dict[tuple[str, int], PrefixRun] = {}
    for group, matched, score, tiers, classes in rows:
        info = holders[group]
        runs[(info.instance_id, info.data_parallel_rank)] = PrefixRun(
            matched, score, {tier: tiers[i] for tier, i in _TIERS_BY_NAME if tiers[i]}, list(classes))
    return runs


def prefix_match_rows(runs: Mapping[tuple[str, int], PrefixRun]) -> list[dict]:
    """``POST /prefix-match/``'s ``matches``: best first, ``{"instance_id", "data_parallel_rank",
    "matched_blocks", "prefix_blocks": {tier: n}, "score"}`` (docs/querying.md)."""
    # ranked on tuples, then the dicts made in order (a sort keyed by a lambda over the dicts cost as much as
    # the lookup); (instance, rank) is unique, so no comparison reaches the run
    ranked = sorted((-round(run.score, 6), -run.any, instance, rank, run)
                    for (instance, rank), run in runs.items() if run.any)
    return [{"instance_id": instance, "data_parallel_rank": rank, "matched_blocks": run.any,
             "prefix_blocks": {tier: n for tier, n in sorted(run.tiers.items()) if n}, "score": -score}
            for score, _, instance, rank, run in ranked]


def _boundaries(gpu: int, cpu: int, disk: int) -> dict[str, int]:
    return {"gpu": gpu, "cpu": cpu, "disk": disk}


def instance_row(ranks: Mapping[str, dict[str, int]]) -> dict:
    """One instance of Mooncake's ``instances`` from its ranks' boundaries (``{rank: {"gpu", "cpu", "disk"}}``, in
    tokens, ranks as decimal strings): ``longest_matched`` (the instance's ``disk``), ``gpu``, ``cpu`` and ``disk``
    (each the best rank's), ``dp`` (each rank's ``gpu``) and ``rank_matches`` (the ranks' boundaries), as the
    conductor's ``indexer-api-design.md`` defines them; then the same figures under the names of its older API
    (``GPU``, ``CPU``, ``DISK``, ``DP``), which older clients read (docs/querying.md)."""
    gpu = max((r["gpu"] for r in ranks.values()), default=0)
    cpu = max((r["cpu"] for r in ranks.values()), default=0)
    disk = max((r["disk"] for r in ranks.values()), default=0)
    dp = {rank: r["gpu"] for rank, r in ranks.items()}
    return {"longest_matched": disk, "gpu": gpu, "cpu": cpu, "disk": disk, "dp": dp,
            "rank_matches": {rank: dict(r) for rank, r in ranks.items()},
            "GPU": gpu, "CPU": cpu, "DISK": disk, "DP": dict(dp)}


def instances_answer(runs: Mapping[tuple[str, int], PrefixRun], block_size_of) -> dict:
    """Mooncake's and Dynamo's ``/query`` answer from prefix runs, in tokens.

    Args:
        block_size_of: instance id -> tokens per block of that instance.

    Returns:
        ``{"instances": {instance: row}, "scores": {instance: {rank: tokens}}, "kvstream": {"ranks": {instance:
        {rank: {"matched_blocks", "block_size", "prefix_blocks", "score"}}}}}``: ``row`` is :func:`instance_row` of
        the instance's ranks' ordered boundaries (:data:`PHASES`); ``scores`` is Dynamo's per-rank map, each rank's
        longest prefix on any tier; ``kvstream`` is kvstream's own breakdown in blocks (the longest prefix on any
        tier, on each tier, and the tier-weighted score of ``/prefix-match/``). Ranks are decimal strings, as JSON
        keys are. Every (instance, rank) of ``runs`` is named, even with boundaries of 0 (a run on ``UNKNOWN``).
    """
    ranks: dict[str, dict] = {}
    scores: dict[str, dict] = {}
    detail: dict[str, dict] = {}
    # (instance, rank) is unique, so sorting the keys orders the runs as sorting the items did
    for key in sorted(runs):
        run = runs[key]
        matched = run.any
        if not matched:
            continue
        instance, rank = key
        size = block_size_of(instance)
        gpu, cpu, disk = run.classes
        rank_key = str(rank)
        tiers = run.tiers
        rank_detail = {"matched_blocks": matched, "block_size": size,
                       "prefix_blocks": {tier: tiers[tier] for tier in sorted(tiers) if tiers[tier]},
                       "score": round(run.score, 6)}
        bounds = _boundaries(gpu * size, cpu * size, disk * size)
        if instance not in ranks:
            ranks[instance], scores[instance], detail[instance] = {}, {}, {}
        ranks[instance][rank_key] = bounds
        scores[instance][rank_key] = matched * size
        detail[instance][rank_key] = rank_detail
    return {"instances": {instance: instance_row(by_rank) for instance, by_rank in ranks.items()},
            "scores": scores, "kvstream": {"ranks": detail}}
