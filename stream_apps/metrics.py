"""The worker's Prometheus metrics (``GET /metrics``), read from the counters the worker keeps anyway.

Nothing here runs per event: a scrape reads the agent's and the repartition process's counters, the
checkpoint's timings, the occupancy table and the data directory, and asks the broker for both consumer
groups' lag (cached for :data:`LAG_CACHE_S`). docs/operations.md, "Metrics", lists every metric.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from kafka_io.admin import GroupProgressReader
from stream_apps.applier import Materializer
from stream_apps.checkpoint import GC_PAUSES, Checkpoint
from stream_apps.fleet import InputLagReader, occupancy_rows
from stream_apps.health import Readiness
from stream_apps.hotpath import Hotpath, hotpath
from stream_apps.index.observe import ReadPathMetrics
from stream_apps.repartition import RepartitionService, repartition_group
from stream_apps.settings import WorkerSettings
from stream_apps.web_access import refusals_family

log = logging.getLogger(__name__)

#: Seconds a consumer-lag reading is reused (each costs a few admin requests to the broker).
LAG_CACHE_S = 10.0
#: ApplyStats fields that are counts of events, exported as ``kvstream_events_total{outcome=...}``.
_OUTCOMES = ("applied", "duplicates", "cleared_late", "retired_late", "unknown_removals", "unknown_parents",
             "replica_disagreements", "reuse_reports")


class WorkerMetrics(Collector):
    """Collects the worker's metrics at each scrape.

    Args:
        settings: the worker's settings (bootstrap servers, topic names, data directory).
        materializer: the agent's counters and tables.
        checkpoint: the commit protocol's timings.
        repartition: the repartition process (its counters).
        readiness: the readiness conditions.
        recovering: True while Faust recovers tables.
    """

    def __init__(self, settings: WorkerSettings, materializer: Materializer, checkpoint: Checkpoint,
                 repartition: RepartitionService, readiness: Readiness, recovering: Callable[[], bool]) -> None:
        self.settings = settings
        self.materializer = materializer
        self.checkpoint = checkpoint
        self.repartition = repartition
        self.readiness = readiness
        self.recovering = recovering
        #: The fleet index's source leases (set by :func:`stream_apps.app.create_app`); None: not counted.
        self.leases = None
        #: (view, status) -> HTTP requests answered.
        self.http_requests: Counter[tuple[str, int]] = Counter()
        #: The web port's access policy (:mod:`stream_apps.web_access`), whose refusals are counted; set by
        #: :func:`stream_apps.app.create_app`.
        self.access_policy = None
        #: Rebalances this worker took part in (partition assignments received).
        self.rebalances = 0
        #: The hot path's implementation, fixed at import (:mod:`stream_apps.hotpath`).
        self.hotpath = hotpath()
        #: The re-keyed topic's librdkafka reader (:class:`stream_apps.rekeyed_reader.RekeyedReader`, set by
        #: :func:`stream_apps.app.create_app`); None: Faust's consumer reads the topic (``--rekeyed-reader faust``).
        self.rekeyed_reader = None
        self._lag: dict[tuple[str, str, int], int] = {}
        self._lag_at = 0.0
        #: The consumer groups' progress, read over one set of clients for the worker's life: the lag metric's and
        #: the fleet views' readings.
        self._progress = GroupProgressReader(settings.bootstrap_servers)
        #: The workers' lag behind their input, fresher than the metric's (1 s), for the fleet views' ``caught_up``.
        self.input_lag = InputLagReader.for_app(self._progress, settings.topics)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        #: The read path's histograms and per-source gauge (:mod:`stream_apps.index.observe`), registered here too.
        self.read_path = ReadPathMetrics()
        self.registry.register(self.read_path)

    def describe(self) -> list:
        return []  # collected at scrape time only

    async def refresh_lag(self) -> None:
        """Read both consumer groups' lag per partition (in a thread: it blocks), at most every LAG_CACHE_S."""
        if time.monotonic() - self._lag_at < LAG_CACHE_S:
            return
        names = self.settings.topics
        groups = {repartition_group(names.scoped_app_id): names.kv_events, names.scoped_app_id: names.by_ownership}
        lag = {}
        loop = asyncio.get_running_loop()
        for group, topic in groups.items():
            try:
                progress = await loop.run_in_executor(None, self._progress.partition_progress, group, [topic])
            except RuntimeError as exc:  # the broker or the group coordinator is not answering: keep the last
                log.debug("consumer lag of %s unreadable: %s", group, exc)
                return
            for (topic_name, partition), part in progress.items():
                lag[(group, topic_name, partition)] = part.lag
        self._lag, self._lag_at = lag, time.monotonic()

    def render(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)

    def collect(self) -> Iterator:
        stats = self.materializer.stats
        upstream = self.repartition.counters()
        outcomes = CounterMetricFamily("kvstream_events", "Events the materializing agent applied or ignored, by "
                                       "outcome (docs/residency.md)", labels=["outcome"])
        for name in _OUTCOMES:
            outcomes.add_metric([name], getattr(stats, name))
        yield outcomes
        yield CounterMetricFamily("kvstream_events_materialized", "Events the materializing agent took from the "
                                  "re-keyed topic, redeliveries included", value=self.materializer.materialized)
        yield CounterMetricFamily("kvstream_events_repartitioned", "Events the repartition process forwarded",
                                  value=upstream.get("repartitioned", 0))
        dead = CounterMetricFamily("kvstream_events_dead_lettered", "Records sent to the dead-letter topic",
                                   labels=["stage"])
        dead.add_metric(["repartition"], upstream.get("dead_lettered", 0))
        dead.add_metric(["materialize"], self.materializer.outputs.dead_lettered)
        yield dead
        resident = CounterMetricFamily("kvstream_residency_transitions", "Rows that became or stopped being "
                                       "resident", labels=["resident"])
        resident.add_metric(["true"], stats.became_resident)
        resident.add_metric(["false"], stats.stopped_resident)
        yield resident
        lag = GaugeMetricFamily("kvstream_consumer_lag_messages", "Messages not yet committed, per consumer group "
                                "and partition", labels=["group", "topic", "partition"])
        for (group, topic, partition), value in sorted(self._lag.items()):
            lag.add_metric([group, topic, str(partition)], value)
        yield lag
        yield CounterMetricFamily("kvstream_rebalances", "Partition assignments this worker received",
                                  value=self.rebalances)
        store = self.materializer.tables.residency_store
        yield CounterMetricFamily("kvstream_recovery_records", "Changelog records copied into RocksDB at "
                                  "rebalances", value=getattr(store, "recovered_records", 0))
        yield CounterMetricFamily("kvstream_recovery_seconds", "Seconds spent copying changelogs into RocksDB",
                                  value=getattr(store, "recovered_seconds", 0.0))
        yield GaugeMetricFamily("kvstream_recovering", "1 while the worker recovers tables from changelogs",
                                value=1 if self.recovering() else 0)
        yield GaugeMetricFamily("kvstream_ready", "1 when GET /ready answers 200", value=0 if
                                self.readiness.reasons() else 1)
        blocks = GaugeMetricFamily("kvstream_resident_blocks", "Resident blocks in the fleet, per ownership, tier "
                                   "and instance (the occupancy view)", labels=["ownership", "tier", "instance"])
        for row in occupancy_rows(self.materializer.tables):
            blocks.add_metric([row["ownership"] or "primary", row["tier"], row["instance_id"]], row["resident_blocks"])
        yield blocks
        if self.leases is not None:
            states = GaugeMetricFamily("kvstream_sources", "Sources (instance, data-parallel rank) by liveness: live, "
                                       "or down (no event or heartbeat for --source-lease-s)", labels=["state"])
            leases = self.leases.states().values()
            states.add_metric(["live"], sum(1 for state in leases if state.live))
            states.add_metric(["down"], sum(1 for state in leases if not state.live))
            yield states
        yield GaugeMetricFamily("kvstream_store_bytes", "Bytes of the worker's data directory on disk (RocksDB)",
                                value=directory_bytes(self.settings.data_dir))
        changelogs = CounterMetricFamily("kvstream_changelog_records", "Table changelog records produced (one per "
                                         "key written in each --changelog-interval-s, or "
                                         "--global-changelog-interval-s for the global tables)",
                                         labels=["table"])
        for table in self.materializer.tables.all():
            changelogs.add_metric([table.name], table.data.changelog_records)
        yield changelogs
        flush = SummaryMetricFamily("kvstream_checkpoint_seconds", "Duration of checkpoints: output flush and "
                                    "store persist before an offset commit")
        flush.add_metric([], count_value=self.checkpoint.commits, sum_value=self.checkpoint.total_seconds)
        yield flush
        pauses = SummaryMetricFamily("kvstream_gc_pause_seconds", "Collections of Python's cyclic GC in the "
                                     "worker's main process and the seconds they stopped it", labels=["generation"])
        for generation, (count, seconds) in enumerate(zip(GC_PAUSES.collections, GC_PAUSES.seconds)):
            pauses.add_metric([str(generation)], count_value=count, sum_value=seconds)
        yield pauses
        http = CounterMetricFamily("kvstream_http_requests", "HTTP requests answered, by view and status",
                                   labels=["view", "status"])
        for (view, status), count in sorted(self.http_requests.items()):
            http.add_metric([view, str(status)], count)
        yield http
        yield refusals_family(self.access_policy)
        yield hotpath_family(self.hotpath)
        yield InfoMetricFamily("kvstream_rekeyed_reader", "Which consumer reads the re-keyed topic "
                               "(--rekeyed-reader): librdkafka (the worker's own) or faust",
                               value={"reader": self.settings.rekeyed_reader})
        if self.rekeyed_reader is not None:
            yield CounterMetricFamily("kvstream_rekeyed_reader_restarts", "Times the re-keyed topic's reader "
                                      "restarted from the committed offsets: once at the end of each recovery "
                                      "after a rebalance", value=self.rekeyed_reader.generation)


def hotpath_family(current: Hotpath) -> InfoMetricFamily:
    """``kvstream_hotpath_info{implementation="compiled"|"python"|"partial"} 1``: whether the compiled modules
    run, so a scrape shows an image or an install that fell back to pure Python."""
    return InfoMetricFamily("kvstream_hotpath", "The hot path's implementation: compiled (schemas._hotpath and "
                            "stream_apps.index._table), python, or partial (only some compiled)",
                            value={"implementation": current.implementation})


def directory_bytes(path: Path) -> int:
    """Bytes of the regular files below ``path`` (0 if it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:  # a file RocksDB removed meanwhile
                pass
    return total

