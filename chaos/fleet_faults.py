"""The scenarios that fault a worker or the broker: crash, rebalance, broker-outage and table-recovery."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict

from chaos.checks import (
    _answers,
    _diagnose,
    _explain,
    _fleet_views,
    _http_agrees,
    _http_sample,
    _run_result,
    check_residency,
    rekey_check,
    topic_messages,
)
from chaos.env import PacedProducer, Worker, _consume, _fresh_app_id, _wait_for, http_json, produce_now
from kafka_io.admin import group_progress
from kvstream import broker
from producers.kafka_sink import ProduceError
from schemas.topics import KV_EVENTS
from stream_apps.repartition import repartition_group


class FleetFaults:
    """The crash, rebalance, broker-outage and table-recovery scenarios.

    A mixin of :class:`chaos.scenarios.Chaos`: it uses the run's options, workload, ``env`` and ``rng``.
    """

    def crash(self, run: int) -> dict:
        """SIGKILL a worker at a seeded random moment during live flow, restart it, let it finish."""
        o, w = self.options, self.workload
        rng = self.rng("crash", run)
        store = ("rocksdb://", "memory://")[run % 2]
        before = rng.uniform(0.3, 0.6)  # fraction of the records produced before the worker starts
        kill_at = rng.uniform(0.1, 0.9)  # fraction of the live records produced when the worker is killed
        app_id = _fresh_app_id("crash", run)
        started = time.monotonic()
        with self.env(f"crash-{run}") as env:
            split = int(len(w.records) * before)
            produced = produce_now(env.bootstrap, w.records[:split])
            worker = env.worker("worker", app_id, store=store)
            ready_s = worker.wait_ready(o.timeout_s)
            live = PacedProducer(env.bootstrap, w.records[split:], (len(w.records) - split) / o.live_s)
            live.start()
            target = int(kill_at * (len(w.records) - split))
            last: dict = {}

            def reached():  # the live producer is that far, and the worker is consuming
                stats = worker.stats()
                if stats:
                    last.update(stats)
                if not worker.alive():
                    raise RuntimeError(f"the worker exited before the kill:\n{worker.tail()}")
                return live.sent_records >= target and last.get("materialized", 0) > 0

            _wait_for(reached, o.timeout_s, f"the live producer did not send {target} records", poll_s=0.05)
            worker.kill()
            kill = {"target_fraction_of_live_records": round(kill_at, 3), "live_records_sent": live.sent_records,
                    "materialized": last.get("materialized"), "repartitioned": last.get("repartitioned"),
                    "seconds_after_start": round(time.monotonic() - worker.started, 2),
                    "producer_running": live.is_alive(), "records_produced_before": live.sent_records + split}
            committed = group_progress(env.bootstrap, repartition_group(app_id), [KV_EVENTS])[KV_EVENTS].committed
            kill["kv_events_committed"] = committed
            self.log(f"      killed {kill['seconds_after_start']}s after start, {live.sent_records:,} of "
                     f"{len(w.records) - split:,} live records sent, {kill['materialized']:,} of "
                     f"{w.messages:,} messages materialized ({committed:,} committed; producer "
                     f"{'running' if kill['producer_running'] else 'done'}); restarting ({store})")
            worker.start()
            live.join()
            if live.error:
                raise ProduceError(live.error)
            produced += live.stats.acked
            consumed_s = _consume(env, worker, o.timeout_s)
            self.log(f"      the restarted worker committed everything {consumed_s:.1f}s after the producer ended")
            final = worker.stats() or {}
            check = check_residency(env.bootstrap, app_id, w.ground_truth)
            _explain(worker, check)
            worker.stop()
            in_topic = topic_messages(env.bootstrap)
            rekey = None if check.matches else _diagnose(rekey_check, env.bootstrap, app_id)
        return _run_result(run, check, produced, in_topic, time.monotonic() - started,
                           checks={"all messages in kv-events": in_topic == produced == w.messages},
                           store=store, app_id=app_id, records_before_worker=split, worker_ready_s=round(ready_s, 1),
                           kill=kill,
                           restart_consumed_s=round(consumed_s, 1), rekey=rekey,
                           duplicates_ignored=final.get("duplicates"))

    def rebalance(self, run: int) -> dict:
        """Two workers; one stops mid-stream and rejoins; lookups are asked of the running workers throughout.
        Odd runs give each table partition a standby replica on the other worker. At the end every worker's
        views must equal the ground truth (occupancy, a lookup sample) and each other (sources)."""
        o, w = self.options, self.workload
        rng = self.rng("rebalance", run)
        app_id = _fresh_app_id("rebalance", run)
        standbys = run % 2
        store = ("memory://", "rocksdb://")[run // 2 % 2]
        started = time.monotonic()
        with self.env(f"rebalance-{run}") as env:
            self.log(f"      {standbys} standby replicas, store {store}")
            split = int(len(w.records) * 0.3)
            produced = produce_now(env.bootstrap, w.records[:split])
            first = env.worker("worker-1", app_id, store=store, standby_replicas=standbys)
            second = env.worker("worker-2", app_id, store=store, standby_replicas=standbys)
            first.wait_ready(o.timeout_s)
            second.wait_ready(o.timeout_s)
            known = sorted({r["block_hash"] for r in w.records[:split] if r["block_hash"] is not None})
            queries = _QueryLoad([first, second], rng.sample(known, min(200, len(known))))
            queries.start()
            live = PacedProducer(env.bootstrap, w.records[split:], (len(w.records) - split) / (3 * o.live_s))
            live.start()

            def materialized() -> int:
                return sum((x.stats() or {}).get("materialized", 0) for x in (first, second))

            stop_at = int(rng.uniform(0.35, 0.6) * w.messages)
            _wait_for(lambda: materialized() >= stop_at, o.timeout_s, f"workers did not materialize {stop_at}")
            queries.remove(second)
            stop_s = time.monotonic()
            second.stop()
            self.log(f"      worker-2 stopped (SIGTERM) at {stop_at:,} of {w.messages:,} messages materialized")
            base = (first.stats() or {}).get("materialized", 0)
            # let the survivor take over and make progress alone (or the stream end) before the rejoin
            _wait_for(lambda: (first.stats() or {}).get("materialized", 0) - base >= 0.15 * w.messages
                      or not live.is_alive(), o.timeout_s, "worker-1 did not take over", poll_s=0.3)
            down_s = time.monotonic() - stop_s
            second.start()
            second.wait_ready(o.timeout_s)
            queries.add(second)
            self.log(f"      worker-2 rejoined after {down_s:.1f}s")
            live.join()
            if live.error:
                raise ProduceError(live.error)
            produced += live.stats.acked
            _consume(env, first, o.timeout_s)
            time.sleep(2)  # a few more lookups on the settled group
            queries.stop()
            duplicates = sum((x.stats() or {}).get("duplicates", 0) for x in (first, second))
            http = {x.options.web_port: _http_sample(x.url, w.ground_truth, 100, rng) for x in (first, second)}
            views = _fleet_views([first, second], w.ground_truth)
            check = check_residency(env.bootstrap, app_id, w.ground_truth)
            _explain(first, check)
            in_topic = topic_messages(env.bootstrap)
            rekey = None if check.matches else _diagnose(rekey_check, env.bootstrap, app_id)
        counts = queries.counts
        self.log(f"      lookups: {counts['answered']:,} answered, {counts['retried']:,} 503 retries, "
                 f"{counts['failed']:,} failed")
        return _run_result(run, check, produced, in_topic, time.monotonic() - started,
                           checks={"all messages in kv-events": in_topic == produced == w.messages,
                                   "no lookup failed": counts["failed"] == 0,
                                   "both workers answer the sample as the truth": all(
                                       h["wrong"] == 0 for h in http.values()),
                                   "every worker's occupancy equals the truth": views["occupancy_equal"],
                                   "every worker answers the same sources": views["sources_equal"]},
                           app_id=app_id, standby_replicas=standbys, store=store, views=views,
                           stopped_at_materialized=stop_at, worker_2_down_s=round(down_s, 1),
                           queries=counts, query_failures=queries.failures[:5],
                           http_sample={str(port): h for port, h in http.items()}, duplicates_ignored=duplicates,
                           rekey=rekey)

    def broker_outage(self, run: int) -> dict:
        """Stop the broker for ``outage_s`` while the producer publishes; then run a worker to the end."""
        o, w = self.options, self.workload
        rng = self.rng("broker-outage", run)
        app_id = _fresh_app_id("broker-outage", run)
        started = time.monotonic()
        with self.env(f"broker-outage-{run}") as env:
            # paced so the producer is still publishing through the whole outage
            rate = len(w.records) / (o.outage_s + 8)
            live = PacedProducer(env.bootstrap, w.records, rate)
            live.start()
            stop_after = int(len(w.records) * rng.uniform(0.15, 0.3))
            _wait_for(lambda: live.sent_records >= stop_after, o.timeout_s, "the producer did not start")
            t0 = time.monotonic()
            broker.stop(env.broker_dir)
            stopped_s = time.monotonic() - t0
            down_from = time.monotonic()
            time.sleep(o.outage_s)
            sent_during = live.sent_records - stop_after
            broker.start(port=env.port, data_dir=env.broker_dir)
            down_s = time.monotonic() - down_from
            self.log(f"      broker down {down_s:.1f}s (stop took {stopped_s:.1f}s) after {stop_after:,} records; "
                     f"{sent_during:,} records sent meanwhile")
            live.join()
            stats = asdict(live.stats)
            if live.error:
                self.log(f"      producer: {live.error}")
            produced = live.stats.acked
            in_topic = topic_messages(env.bootstrap)
            worker = env.worker("worker", app_id)
            _consume(env, worker, o.timeout_s)
            final = worker.stats() or {}
            worker.stop()
            check = check_residency(env.bootstrap, app_id, w.ground_truth)
        return _run_result(run, check, produced, in_topic, time.monotonic() - started,
                           checks={"producer acknowledged everything": live.error is None
                                   and produced == w.messages,
                                   "produced equals messages in kv-events": in_topic == produced},
                           app_id=app_id, outage_s=round(down_s, 1), broker_stop_s=round(stopped_s, 1),
                           records_before_outage=stop_after, records_sent_during_outage=sent_during,
                           producer=stats, producer_error=live.error, duplicates_ignored=final.get("duplicates"),
                           topic_surplus=max(in_topic - produced, 0))

    def table_recovery(self, run: int) -> dict:
        """Finish a run, then rebuild the tables in a worker with an empty data dir and compare its answers."""
        o, w = self.options, self.workload
        rng = self.rng("table-recovery", run)
        app_id = _fresh_app_id("table-recovery", run)
        started = time.monotonic()
        with self.env(f"table-recovery-{run}") as env:
            produced = produce_now(env.bootstrap, w.records)
            first = env.worker("worker-1", app_id, store="rocksdb://")
            _consume(env, first, o.timeout_s)
            first.wait_ready(o.timeout_s)
            blocks = sorted({identity[6] for identity in w.ground_truth})
            sample = rng.sample(blocks, min(200, len(blocks)))
            gone = sorted({r["block_hash"] for r in w.records if r["block_hash"] is not None} - set(blocks))
            sample += rng.sample(gone, min(20, len(gone)))  # blocks that were resident once and are gone
            before = _answers(first.url, sample)
            first.stop()
            second = env.worker("worker-2", app_id, store="rocksdb://", data_dir=env.dir / "empty-data-dir")
            recovered_s = second.wait_ready(o.timeout_s)
            after = _answers(second.url, sample)
            final = second.stats() or {}
            second.stop()
            check = check_residency(env.bootstrap, app_id, w.ground_truth)
            in_topic = topic_messages(env.bootstrap)
        differing = [block for block in before if before[block] != after[block]]
        truth_http = _http_agrees(before, w.ground_truth)
        self.log(f"      new worker ready in {recovered_s:.1f}s; {len(before) - len(differing)} of {len(before)} "
                 f"answers identical")
        return _run_result(run, check, produced, in_topic, time.monotonic() - started,
                           checks={"identical answers after the rebuild": not differing,
                                   "answers before agree with the truth": truth_http == 0,
                                   "all messages in kv-events": in_topic == produced == w.messages},
                           app_id=app_id, queries=len(before), differing_answers=differing[:5],
                           recovered_s=round(recovered_s, 1), duplicates_ignored=final.get("duplicates"))


class _QueryLoad(threading.Thread):
    """Ask ``GET /residency/{hex}/`` of the current target workers in a loop, counting the outcomes.

    A 503 (the group is rebalancing) is retried after 0.2 s for up to 30 s; anything else that is not a 200 is
    a failure, recorded with its reason in ``failures``.
    """

    def __init__(self, workers: list[Worker], blocks: list[bytes]) -> None:
        super().__init__(daemon=True)
        self.targets = list(workers)
        self.blocks = blocks
        self.counts = {"answered": 0, "retried": 0, "failed": 0}
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._done = threading.Event()

    def add(self, worker: Worker) -> None:
        """Ask ``worker`` too from now on."""
        with self._lock:
            self.targets.append(worker)

    def remove(self, worker: Worker) -> None:
        """Stop asking ``worker`` (before it is stopped); waits for a lookup in flight to end."""
        with self._lock:
            self.targets.remove(worker)

    def stop(self) -> None:
        """End the loop and wait for it."""
        self._done.set()
        self.join(60)

    def run(self) -> None:
        index = 0
        while not self._done.is_set():
            block = self.blocks[index % len(self.blocks)]
            with self._lock:
                targets = list(self.targets)
                self._ask(targets[index % len(targets)], block)
            index += 1
            time.sleep(0.02)

    def _ask(self, worker: Worker, block: bytes) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                status, body = http_json(f"{worker.url}/residency/{block.hex()}/", timeout_s=30)
            except (OSError, ValueError) as exc:
                status, body = None, {"error": f"{type(exc).__name__}: {exc}"}
            if status == 200:
                self.counts["answered"] += 1
                return
            if status == 503 and time.monotonic() < deadline:
                self.counts["retried"] += 1
                time.sleep(0.2)
                continue
            self.counts["failed"] += 1
            if len(self.failures) < 20:
                self.failures.append(f":{worker.options.web_port} {block.hex()}: {status} {body.get('error')}")
            return
