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
    ``lag_s`` is ``now`` minus ``last_event_ts`` (the engine's clock against this worker's). ``applied_ts`` is
    when a worker last applied an event of the publisher (its clock, as the ``sources`` store keeps it per key,
    :attr:`stream_apps.store.MemoryTableStore.written_at`; None where the store keeps none) and
    ``arrival_lag_s`` is ``now`` minus that: the workers' clock only, so it means the same for replayed data.
    """
    now = time.time() if now is None else now
    written_at = getattr(tables.sources.data, "written_at", {})
    groups: dict[tuple, list[tuple[str, dict]]] = defaultdict(list)
    # in key order, so that ties (several partitions' copies with the same epoch) resolve alike on every worker,
    # whatever order its copy of the table was filled in
    for key, status in sorted(tables.sources.items()):
        groups[(status["instance_id"], status["data_parallel_rank"], status["worker_rank"])].append((key, status))
    rows = []
    for _, keyed in sorted(groups.items()):
        copies = [status for _, status in keyed]
        facts = max(copies, key=lambda c: (c["publisher_epoch"], c["restarts"]))
        newest = max(copies, key=lambda c: c["last_event_ts"] or 0.0)
        last_ts = newest["last_event_ts"]
        applied = [written_at[key] for key, _ in keyed if key in written_at]
        applied_ts = max(applied) if applied else None
        rows.append({**facts, "worker_rank": None if facts["worker_rank"] < 0 else facts["worker_rank"],
                     "events_applied": sum(c["events_applied"] for c in copies), "last_event_ts": last_ts,
                     "last_seq": newest["last_seq"], "lag_s": None if last_ts is None else round(now - last_ts, 3),
                     "applied_ts": applied_ts,
                     "arrival_lag_s": None if applied_ts is None else round(max(now - applied_ts, 0.0), 3)})
    return rows
