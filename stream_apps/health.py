"""Is this worker ready to answer lookups? The reasons it is not, for ``GET /ready`` and the lookups' 503s.

A worker that has not yet recovered its tables answers a lookup with the rows it happens to hold, which a
router would take for a cache miss. So until every condition below holds, ``GET /ready`` answers 503 and so
do ``GET /residency/{hex}/`` and ``POST /prefix-match/``, each with the reasons (docs/operations.md,
"Probes").
"""

from __future__ import annotations

from typing import Callable

import faust


class Readiness:
    """The readiness conditions of one worker.

    Args:
        app: the worker's Faust app.
        repartition_alive: True while the repartition process runs.
        extra: more conditions, each a callable returning the reason it does not hold, or None.
    """

    def __init__(self, app: faust.App, repartition_alive: Callable[[], bool],
                 extra: list[Callable[[], str | None]] | None = None) -> None:
        self.app = app
        self.repartition_alive = repartition_alive
        self.extra = list(extra or [])
        #: Set once the consumer group has given this worker an assignment (Faust's on_partitions_assigned).
        self.assigned = False

    def reasons(self) -> list[str]:
        """Why the worker is not ready; empty when it is."""
        reasons = []
        if not self.assigned:
            reasons.append("no partition assignment yet (joining the consumer group)")
        elif not self.app.tables.recovery.completed.is_set() or self.app.in_recovery:
            reasons.append("recovering its tables from their changelogs")
        if self.app.rebalancing:
            reasons.append("the consumer group is rebalancing")
        if not self.repartition_alive():
            reasons.append("the repartition process is not running")
        for condition in self.extra:
            reason = condition()
            if reason:
                reasons.append(reason)
        return reasons
