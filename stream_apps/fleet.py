"""Fleet-wide views of the tables: occupancy, ownerships and publisher status over every partition.

They read the global tables (``tier-occupancy``, ``sources``), which every worker holds whole.
"""

from __future__ import annotations

import time
from collections import defaultdict

from stream_apps.tables import Tables


def occupancy_rows(tables: Tables) -> list[dict]:
    """Resident blocks per (ownership, tier, instance), summed over partitions, sorted."""
    totals: dict[tuple, int] = defaultdict(int)
    for value in tables.tier_occupancy.values():
        totals[(value["ownership"] or "", value["tier"], value["instance_id"])] += value["resident_blocks"]
    return [{"ownership": own or None, "tier": tier, "instance_id": inst, "resident_blocks": n}
            for (own, tier, inst), n in sorted(totals.items()) if n]


def known_ownerships(tables: Tables) -> set[str | None]:
    """Ownerships with resident blocks anywhere (None = primary), from the global occupancy table."""
    return {None} | {value["ownership"] for value in tables.tier_occupancy.values()}


def source_rows(tables: Tables, now: float | None = None) -> list[dict]:
    """One status per publisher, merged over partitions, sorted.

    Source-wide facts (epoch, restarts, stale) come from the partition copy with the newest epoch and most
    restarts; ``events_applied`` is the sum over partitions, ``last_event_ts`` and ``last_seq`` the newest.
    ``lag_s`` is ``now`` minus ``last_event_ts`` (the engine's clock against this worker's).
    """
    now = time.time() if now is None else now
    groups: dict[tuple, list[dict]] = defaultdict(list)
    # in key order, so that ties (several partitions' copies with the same epoch) resolve alike on every worker,
    # whatever order its copy of the table was filled in
    for _, status in sorted(tables.sources.items()):
        groups[(status["instance_id"], status["data_parallel_rank"], status["worker_rank"])].append(status)
    rows = []
    for _, copies in sorted(groups.items()):
        facts = max(copies, key=lambda c: (c["publisher_epoch"], c["restarts"]))
        newest = max(copies, key=lambda c: c["last_event_ts"] or 0.0)
        last_ts = newest["last_event_ts"]
        rows.append({**facts, "worker_rank": None if facts["worker_rank"] < 0 else facts["worker_rank"],
                     "events_applied": sum(c["events_applied"] for c in copies), "last_event_ts": last_ts,
                     "last_seq": newest["last_seq"], "lag_s": None if last_ts is None else round(now - last_ts, 3)})
    return rows
