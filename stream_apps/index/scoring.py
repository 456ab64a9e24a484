"""Scoring a prefix lookup: from the holders of each block of a request to the answers routers read.

A lookup walks a request's blocks in prefix order and gets, per depth, the holders of that block (a holder is
one (instance, data-parallel rank, tier, ownership)). :func:`prefix_runs` turns that into, per (instance,
data-parallel rank), how far from block 0 the request is held without a gap: on any tier, on each tier, and on
the cumulative tier classes Mooncake's and Dynamo's indexers report. The two answer shapes are built from it:

* :func:`prefix_match_rows`: kvstream's own ``POST /prefix-match/`` (blocks per tier and an llm-d-style score:
  the sum over the matched blocks of the best weight among the tiers holding each, llm-d's
  ``pkg/kvcache/backend.go`` convention);
* :func:`instances_answer`: Mooncake's and Dynamo's ``/query`` answer, in tokens (docs/querying.md, "For router
  authors").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

#: Weight of a tier the weights do not name (``POST /prefix-match/``'s score).
OTHER_TIER_WEIGHT = 0.25

#: The cumulative tier classes of Mooncake's and Dynamo's answers, and the kvstream tiers each takes in: ``GPU``
#: counts blocks on the GPU; ``CPU`` blocks on the GPU or in CPU memory; ``DISK`` blocks on any of those or on
#: a storage or external offload tier (kvstream's ``STORAGE`` is their ``DISK``; ``EXTERNAL``, a secondary tier
#: outside the engine such as a remote KV store, is farther than memory, so it counts there too). So
#: ``GPU <= CPU <= DISK <= longest_matched``; ``UNKNOWN`` counts only in ``longest_matched``.
TIER_CLASSES: dict[str, tuple[str, ...]] = {
    "GPU": ("GPU",),
    "CPU": ("GPU", "CPU"),
    "DISK": ("GPU", "CPU", "STORAGE", "EXTERNAL"),
}
_CLASS_NAMES = tuple(TIER_CLASSES)
#: tier -> bit mask of the classes it counts in.
_CLASS_MASK = {tier: sum(1 << i for i, name in enumerate(_CLASS_NAMES) if tier in TIER_CLASSES[name])
               for tier in ("GPU", "CPU", "STORAGE", "EXTERNAL", "UNKNOWN")}


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

    def __init__(self) -> None:
        #: Longest consecutive prefix held on any tier.
        self.any = 0
        #: Sum over those blocks of the best tier weight among the tiers holding each.
        self.score = 0.0
        #: tier -> longest consecutive prefix held on that tier alone.
        self.tiers: dict[str, int] = {}
        #: Longest consecutive prefix per class of :data:`TIER_CLASSES`, in its order.
        self.classes = [0] * len(_CLASS_NAMES)


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
    """
    runs: dict[tuple[str, int], PrefixRun] = {}
    for depth, held in enumerate(holders_per_depth):
        present: dict[tuple[str, int], list] = {}
        for holder_id in held:
            info = holders[holder_id]
            if allowed is not None and not allowed(info):
                continue
            key = (info.instance_id, info.data_parallel_rank)
            if depth and key not in runs:
                continue  # did not hold block 0: nothing it holds later counts
            seen = present.get(key)
            if seen is None:
                present[key] = [{info.tier}, _CLASS_MASK.get(info.tier, 0)]
            else:
                seen[0].add(info.tier)
                seen[1] |= _CLASS_MASK.get(info.tier, 0)
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
            classes = run.classes
            for i in range(len(classes)):
                if mask >> i & 1 and classes[i] == depth:
                    classes[i] = depth + 1
        if not extended:
            break  # every run has ended: deeper blocks change nothing
    return runs


def prefix_match_rows(runs: Mapping[tuple[str, int], PrefixRun]) -> list[dict]:
    """``POST /prefix-match/``'s ``matches``: best first, ``{"instance_id", "data_parallel_rank",
    "matched_blocks", "prefix_blocks": {tier: n}, "score"}`` (docs/querying.md)."""
    rows = [{"instance_id": instance, "data_parallel_rank": rank, "matched_blocks": run.any,
             "prefix_blocks": {tier: n for tier, n in sorted(run.tiers.items()) if n},
             "score": round(run.score, 6)}
            for (instance, rank), run in runs.items() if run.any]
    return sorted(rows, key=lambda r: (-r["score"], -r["matched_blocks"], r["instance_id"], r["data_parallel_rank"]))


def instances_answer(runs: Mapping[tuple[str, int], PrefixRun], block_size_of) -> dict:
    """Mooncake's and Dynamo's ``/query`` answer from prefix runs, in tokens.

    Args:
        block_size_of: instance id -> tokens per block of that instance.

    Returns:
        ``{"instances": {instance: {"longest_matched", "GPU", "CPU", "DISK", "DP": {rank: tokens}}},
        "scores": {instance: {rank: tokens}}, "kvstream": {instance: {rank: {"matched_blocks", "prefix_blocks",
        "score"}}}}``: per instance the best of its data-parallel ranks (a request goes to one rank), per rank
        its own longest match (Dynamo's ``scores``), and kvstream's breakdown in blocks. Ranks are strings, as
        JSON keys are.
    """
    instances: dict[str, dict] = {}
    scores: dict[str, dict] = {}
    detail: dict[str, dict] = {}
    for (instance, rank), run in sorted(runs.items()):
        if not run.any:
            continue
        size = block_size_of(instance)
        answer = instances.get(instance)
        if answer is None:
            answer = instances[instance] = {"longest_matched": 0, **{name: 0 for name in _CLASS_NAMES}, "DP": {}}
        answer["longest_matched"] = max(answer["longest_matched"], run.any * size)
        for name, blocks in zip(_CLASS_NAMES, run.classes):
            answer[name] = max(answer[name], blocks * size)
        answer["DP"][str(rank)] = run.any * size
        scores.setdefault(instance, {})[str(rank)] = run.any * size
        detail.setdefault(instance, {})[str(rank)] = {
            "matched_blocks": run.any, "block_size": size,
            "prefix_blocks": {tier: n for tier, n in sorted(run.tiers.items()) if n}, "score": round(run.score, 6)}
    return {"instances": instances, "scores": scores, "kvstream": detail}
