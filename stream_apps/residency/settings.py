"""Per-source settings of the residency rules: which tiers a source's clear removes (``--clear-scope``), how its
workers' reports aggregate when its events do not say (``--aggregation``), and the prefix-match score's tier
weights (``KVSTREAM_TIER_WEIGHTS``)."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Tiers an AllBlocksCleared removes by default: vLLM emits it on a GPU prefix-cache reset, and offloaded
#: copies survive it (docs/residency.md, "Clears").
DEFAULT_CLEAR_TIERS = frozenset({"GPU"})
#: Tiers removed with clear scope ``all``.
ALL_TIERS = frozenset({"GPU", "CPU", "STORAGE", "EXTERNAL", "UNKNOWN"})


@dataclass(frozen=True)
class SourceSettings:
    """Per-source configuration of the stream app (``kvstream worker --clear-scope / --aggregation``).

    ``clear_scopes``: instance -> tiers an AllBlocksCleared of that instance removes (others:
    ``default_clear_tiers``). ``aggregation``: instance -> (world_size, mode), used when the events do
    not declare them in the envelope.
    """

    default_clear_tiers: frozenset = DEFAULT_CLEAR_TIERS
    clear_scopes: dict = field(default_factory=dict)
    aggregation: dict = field(default_factory=dict)

    def clear_tiers(self, instance_id: str) -> frozenset:
        """Tiers an AllBlocksCleared of ``instance_id`` removes."""
        return self.clear_scopes.get(instance_id, self.default_clear_tiers)

    @classmethod
    def parse(cls, clear_scope: str = "gpu", aggregation: str = "") -> "SourceSettings":
        """Parse ``gpu|all[,INSTANCE=gpu|all...]`` and ``INSTANCE=WORLD_SIZE[:REPLICATED|SHARDED][,...]``.

        Raises:
            ValueError: a malformed entry, with the entry in the message.
        """
        scopes = {"gpu": DEFAULT_CLEAR_TIERS, "all": ALL_TIERS}
        default, overrides = DEFAULT_CLEAR_TIERS, {}
        for item in filter(None, (p.strip() for p in clear_scope.split(","))):
            instance, _, scope = item.rpartition("=")
            if scope.lower() not in scopes:
                raise ValueError(f"clear scope {item!r}: expected gpu or all, optionally after INSTANCE=")
            if instance:
                overrides[instance] = scopes[scope.lower()]
            else:
                default = scopes[scope.lower()]
        declared = {}
        for item in filter(None, (p.strip() for p in aggregation.split(","))):
            instance, _, spec = item.rpartition("=")
            size, _, mode = spec.partition(":")
            mode = (mode or "REPLICATED").upper()
            if not instance or not size.isdigit() or int(size) < 1 or mode not in ("REPLICATED", "SHARDED"):
                raise ValueError(f"aggregation {item!r}: expected INSTANCE=WORLD_SIZE[:REPLICATED|SHARDED]")
            declared[instance] = (int(size), mode)
        return cls(default, overrides, declared)


#: Default tier weights of the prefix-match score (llm-d's defaults for GPU and CPU); tiers not named weigh
#: ``stream_apps.index.scoring.OTHER_TIER_WEIGHT`` (0.25).
DEFAULT_TIER_WEIGHTS = {"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5}


def parse_tier_weights(text: str) -> dict[str, float]:
    """Parse ``GPU=1.0,CPU=0.8,...`` (the ``KVSTREAM_TIER_WEIGHTS`` setting) over the defaults.

    Raises:
        ValueError: an entry that is not ``TIER=number`` or names no known tier.
    """
    from schemas import TIERS

    weights = dict(DEFAULT_TIER_WEIGHTS)
    for item in filter(None, (part.strip() for part in text.split(","))):
        tier, _, number = item.partition("=")
        if tier.upper() not in TIERS:
            raise ValueError(f"unknown tier {tier!r} in tier weights (tiers: {', '.join(TIERS)})")
        weights[tier.upper()] = float(number)
    return weights
