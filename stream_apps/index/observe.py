"""What an operator alerts on in the read path: how fresh the index is, how long queries take, how long since each
source was heard of. One collector, registered in both a worker's and ``kvstream index``'s ``GET /metrics``
(docs/operations.md, "Metrics").
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

#: Freshness buckets, seconds: the fresh path's milliseconds up to the changelog path's seconds.
FRESHNESS_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
#: Query latency buckets, seconds (the index answers in well under a millisecond; the HTTP hop adds more).
QUERY_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5)


class ReadPathMetrics(Collector):
    """``kvstream_index_freshness_seconds``, ``kvstream_query_seconds{view}`` and
    ``kvstream_source_seconds_since_heard{instance_id, data_parallel_rank}``.

    Args:
        leases: the index's :class:`~stream_apps.index.liveness.SourceLeases` (None: no per-source gauge).
    """

    def __init__(self, leases=None) -> None:
        self.leases = leases
        #: Seconds from an engine's batch (``kv_event.ts``) to its block event applied to the index.
        self.freshness = Histogram("kvstream_index_freshness_seconds",
                                   "Seconds from an engine's event (its batch's timestamp) to the index applying it "
                                   "(the fresh path: kv-events read by the index itself).",
                                   buckets=FRESHNESS_BUCKETS, registry=None)
        self.queries = Histogram("kvstream_query_seconds", "Seconds to answer a router query, by view "
                                 "(from the body read to the answer built, the HTTP hop not included).",
                                 labelnames=["view"], buckets=QUERY_BUCKETS, registry=None)

    def applied(self, now: float, stamps: list[float]) -> None:
        """The events feed's ``on_applied``: one observation per block event (its delay, seconds)."""
        observe = self.freshness.observe
        for ts in stamps:
            observe(max(0.0, now - ts))

    def collect(self) -> Iterator:
        """The metric families (prometheus_client's collector protocol)."""
        yield from self.freshness.collect()
        yield from self.queries.collect()
        if self.leases is None:
            return
        since = GaugeMetricFamily("kvstream_source_seconds_since_heard",
                                  "Seconds since a source's last event or heartbeat reached this process "
                                  "(alert on it: a source that stopped publishing goes down after --source-lease-s).",
                                  labels=["instance_id", "data_parallel_rank"])
        now = time.time()
        for (instance, rank), state in sorted(self.leases.states(now).items()):
            since.add_metric([instance, str(rank)], max(0.0, now - state.last_heard))
        yield since
