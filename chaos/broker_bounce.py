"""The broker-bounce scenario: brokers of a three-node cluster fail under a steady stream, as Kafka Streams' own
``streams_broker_bounce_test.py`` (apache/kafka, tests/kafkatest/tests/streams) runs them.

Each run is one case of :data:`CASES`: a fresh three-node cluster (:func:`kvstream.broker.start_cluster`), two
workers, a ``kvstream index``, a paced producer of engine events and a thread that asks both workers
``GET /residency/{hex}/`` and the index ``POST /prefix-match/`` of known blocks throughout; the case's fault is
injected once the workers apply events, and the run ends with the residency table (read back from its
changelog), every worker's ``/occupancy/`` and a lookup sample equal to the ground truth.
Reported per run: ``first_applied_after_s`` (seconds from the failure to the first event applied after it) and
``answered_during_failure`` (the share of lookups answered 200 at once while a broker was down).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from confluent_kafka.admin import AdminClient

from chaos.checks import _explain, _fleet_views, _http_sample, _run_result, check_residency, topic_messages
from chaos.env import PacedProducer, RunEnv, Worker, _consume, _fresh_app_id, _wait_for, http_json, produce_now
from kvstream import broker
from kvstream.client import IndexClient
from producers.kafka_sink import ProduceError
from schemas.topics import KV_EVENTS, TopicNames

#: The cases, in run order: (name, the topic whose partition 0's leader is failed, or ``controller`` for the
#: active KRaft controller, the fault). Faults: ``hard``
#: (SIGKILL, back after the outage), ``clean`` (SIGTERM: Kafka's controlled shutdown), ``two-down`` (the leader
#: and another node SIGKILLed together: one broker left, below min.insync.replicas, so producers must wait),
#: ``rolling`` (every node in turn stopped cleanly and restarted), ``hard-bounces`` / ``clean-bounces`` (5
#: bounces, each of the partition's leader at that moment); ``worker-term`` / ``worker-kill``: no broker fails,
#: worker-2 is stopped with SIGTERM or SIGKILL and restarted after the outage, and worker-1, the survivor, must
#: answer every lookup it is asked meanwhile (a router must never get a 503 from it because another worker left).
CASES = (
    ("kv-events-leader-hard-kill", "kv-events", "hard"),
    ("kv-events-leader-clean-shutdown", "kv-events", "clean"),
    ("two-brokers-down", "kv-events", "two-down"),
    ("rolling-restart", "kv-events", "rolling"),
    ("rekeyed-leader-hard-kill", "rekeyed", "hard"),
    ("changelog-leader-hard-kill", "changelog", "hard"),
    ("controller-hard-kill", "controller", "hard"),
    ("controller-clean-shutdown", "controller", "clean"),
    ("kv-events-leader-hard-bounces", "kv-events", "hard-bounces"),
    ("kv-events-leader-clean-bounces", "kv-events", "clean-bounces"),
    ("worker-sigterm", "worker", "worker-term"),
    ("worker-sigkill", "worker", "worker-kill"),
)

#: Nodes of the cluster every broker-bounce run starts.
NODES = 3
#: Seconds over which the live producer spreads its records; it hurries through the rest once the failures are
#: over, so the stream only has to outlast them.
STREAM_S = 300.0


def partition_leader(bootstrap: str, topic: str, partition: int = 0) -> int:
    """The node id leading ``topic``'s ``partition`` now (-1: none)."""
    metadata = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=10)
    return metadata.topics[topic].partitions[partition].leader


def start_index(env: RunEnv, app_id: str, timeout_s: float) -> str:
    """Start ``kvstream index`` on ``app_id`` (a day's source lease: the workload's sources publish once), a child
    of ``env`` (log ``<run dir>/index.log``); returns its URL once ``GET /workers`` answers."""
    port = broker.free_port()
    log_file = env.dir / "index.log"
    with open(log_file, "ab") as out:
        child = subprocess.Popen([sys.executable, "-m", "kvstream.cli", "index", "--bootstrap-servers", env.bootstrap,
                                  "--app-id", app_id, "--web-port", str(port), "--source-lease-s", "86400"],
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
    env.children.append(child)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if child.poll() is not None:
            raise RuntimeError(f"kvstream index exited with code {child.returncode}:\n"
                               + log_file.read_text(errors="replace")[-2000:])
        try:
            status, _ = http_json(f"{url}/workers", timeout_s=5)
        except OSError:
            return False
        return status == 200

    _wait_for(ready, timeout_s, "kvstream index did not answer")
    return url


class _Monitor(threading.Thread):
    """Samples the workers' applied-event counts (``/stats/`` ``materialized``) and asks each worker
    (``GET /residency/{hex}/``) and the index (``POST /prefix-match/``) a lookup in turn, recording every outcome
    with its time; a 503 or an error counts as not answered (no retry)."""

    def __init__(self, workers: list[Worker], blocks: list[bytes], index_url: str | None = None) -> None:
        super().__init__(daemon=True)
        self.workers, self.blocks = workers, blocks
        self.index = IndexClient(index_url, timeout_s=5) if index_url else None
        #: (monotonic time, total materialized) samples.
        self.applied: list[tuple[float, int]] = []
        #: (monotonic time, answered 200, answerer) per lookup.
        self.lookups: list[tuple[float, bool, str]] = []
        self._done = threading.Event()

    def stop(self) -> None:
        """End the loop and wait for it."""
        self._done.set()
        self.join(60)

    def run(self) -> None:
        index = 0
        answerers = len(self.workers) + (self.index is not None)
        while not self._done.is_set():
            if self.blocks:
                block = self.blocks[index % len(self.blocks)]
                turn = index % answerers
                if turn < len(self.workers):
                    try:
                        status, _ = http_json(f"{self.workers[turn].url}/residency/{block.hex()}/", timeout_s=5)
                    except (OSError, ValueError):
                        status = None
                    self.lookups.append((time.monotonic(), status == 200, f"worker-{turn + 1}"))
                else:
                    try:
                        self.index.prefix_match([block])
                        ok = True
                    except Exception:  # noqa: BLE001 - any failure is a lookup not answered
                        ok = False
                    self.lookups.append((time.monotonic(), ok, "index"))
            if index % 2 == 0:
                total = sum((x.stats() or {}).get("materialized", 0) for x in self.workers)
                self.applied.append((time.monotonic(), total))
            index += 1
            time.sleep(0.05)

    def first_applied_after(self, t0: float) -> float | None:
        """Seconds from ``t0`` to the first sample whose count exceeds the last one before ``t0``."""
        before = max((n for t, n in self.applied if t <= t0), default=0)
        return next((round(t - t0, 2) for t, n in self.applied if t > t0 and n > before), None)

    def answered_share(self, start: float, end: float, answerer: str | None = None) -> tuple[float | None, int]:
        """(share of the lookups between ``start`` and ``end`` answered 200, how many were asked), of every
        answerer or of ``answerer`` (``worker-1``, ``worker-2``, ``index``)."""
        during = [ok for t, ok, who in self.lookups if start <= t <= end and answerer in (None, who)]
        return (round(sum(during) / len(during), 3) if during else None), len(during)


class BrokerBounce:
    """The broker-bounce scenario. A mixin of :class:`chaos.scenarios.Chaos`: it uses the run's options, workload
    and ``rng``."""

    def broker_bounce(self, run: int) -> dict:
        """Run case ``run`` of :data:`CASES` (of those named by ``broker_bounce_cases`` if any; modulo their
        number) on a fresh three-node cluster."""
        o, w = self.options, self.workload
        rng = self.rng("broker-bounce", run)
        chosen = [c for c in CASES if c[0] in o.broker_bounce_cases] if o.broker_bounce_cases else list(CASES)
        case, target, fault = chosen[run % len(chosen)]
        app_id = _fresh_app_id("broker-bounce", run)
        names = TopicNames(app_id)
        topic = {"kv-events": KV_EVENTS, "rekeyed": names.by_ownership,
                 "changelog": f"{names.scoped_app_id}-residency-changelog", "controller": "controller",
                 "worker": "worker-2"}[target]
        started = time.monotonic()
        self.log(f"      case {case}: {fault} of " + {"controller": "the active controller", "worker": "worker-2"}.get(
            target, f"the leader of {topic}[0]"))
        with RunEnv(self.work / f"broker-bounce-{run}", o.partitions, self.log, nodes=NODES) as env:
            split = int(len(w.records) * 0.3)
            produced = produce_now(env.bootstrap, w.records[:split])
            first = env.worker("worker-1", app_id)
            second = env.worker("worker-2", app_id)
            first.wait_ready(o.timeout_s)
            second.wait_ready(o.timeout_s)
            known = sorted({r["block_hash"] for r in w.records[:split] if r["block_hash"] is not None})
            index_url = start_index(env, app_id, o.timeout_s)
            monitor = _Monitor([first, second], rng.sample(known, min(200, len(known))), index_url)
            monitor.start()
            # a steady stream that outlasts the failures (a node's restart takes up to a minute and more on a busy
            # host), then the rest at full speed once the last node is back
            live = PacedProducer(env.bootstrap, w.records[split:], (len(w.records) - split) / STREAM_S)
            live.start()

            def total() -> int:
                return sum((x.stats() or {}).get("materialized", 0) for x in (first, second))

            base = total()
            _wait_for(lambda: total() > base, o.timeout_s, "the workers did not apply live events")
            if target == "worker":
                faults = [self._fail_worker(second, fault == "worker-kill", o.outage_s, o.timeout_s)]
            else:
                faults = self._inject(env, topic, fault, o.outage_s)
            fault_start, fault_end = faults[0]["at"], faults[-1]["back_at"]
            streamed_through = live.is_alive()
            live.rate = None
            live.join()
            if live.error:
                raise ProduceError(live.error)
            produced += live.stats.acked
            _consume(env, first, o.timeout_s)
            monitor.stop()
            first_applied = [monitor.first_applied_after(f["at"]) for f in faults]
            share, asked = monitor.answered_share(fault_start, fault_end)
            by_answerer = {who: monitor.answered_share(fault_start, fault_end, who)[0]
                           for who in ("worker-1", "worker-2", "index")}
            duplicates = sum((x.stats() or {}).get("duplicates", 0) for x in (first, second))
            http = {x.options.web_port: _http_sample(x.url, w.ground_truth, 100, rng) for x in (first, second)}
            views = _fleet_views([first, second], w.ground_truth)
            check = check_residency(env.bootstrap, app_id, w.ground_truth)
            _explain(first, check)
            in_topic = topic_messages(env.bootstrap)
            alive = first.alive() and second.alive()
        for f in faults:
            f["at"] = round(f["at"] - fault_start, 2)
            f["back_at"] = round(f["back_at"] - fault_start, 2)
        self.log(f"      first event applied {first_applied} s after each failure; {share} of {asked} lookups "
                 f"answered during the failure")
        survivor = {"the surviving worker answered every lookup": by_answerer["worker-1"] == 1.0} \
            if target == "worker" else {}
        return _run_result(run, check, produced, in_topic, time.monotonic() - started,
                           checks={**survivor, "all messages in kv-events": in_topic == produced == w.messages,
                                   "both workers ran throughout": alive,
                                   "events were produced throughout the failures": streamed_through,
                                   "both workers answer the sample as the truth": all(
                                       h["wrong"] == 0 for h in http.values()),
                                   "every worker's occupancy equals the truth": views["occupancy_equal"]},
                           case=case, fault=fault, topic=topic, app_id=app_id, faults=faults,
                           first_applied_after_s=first_applied,
                           answered_during_failure=share, lookups_during_failure=asked,
                           answered_during_failure_by=by_answerer,
                           failure_s=round(fault_end - fault_start, 1), views=views,
                           http_sample={str(port): h for port, h in http.items()}, duplicates_ignored=duplicates)

    def _fail_worker(self, worker: Worker, kill: bool, outage_s: float, timeout_s: float) -> dict:
        """Stop ``worker`` (SIGKILL with ``kill``, else SIGTERM), start it again after ``outage_s`` (more than the
        session timeout, so a killed worker's partitions move), and wait until it is ready."""
        at = time.monotonic()
        if kill:
            worker.kill()
        else:
            worker.stop()
        self.log(f"      worker-2 {'killed (SIGKILL)' if kill else 'stopped (SIGTERM)'}")
        time.sleep(outage_s)
        worker.start()
        worker.wait_ready(timeout_s)
        back = time.monotonic()
        self.log(f"      worker-2 back after {back - at:.1f}s")
        return {"nodes": [], "worker": "worker-2", "clean": not kill, "at": at, "back_at": back}

    def _inject(self, env: RunEnv, topic: str, fault: str, outage_s: float) -> list[dict]:
        """Fail brokers as ``fault`` says; returns one entry per failure: nodes, kind, ``at`` and ``back_at``
        (monotonic times of the failure and of the last node answering again)."""
        d = env.broker_dir

        def bounce(nodes: list[int], clean: bool, down_s: float) -> dict:
            at = time.monotonic()
            for node in nodes:
                broker.kill_node(d, node, clean=clean)
            self.log(f"      node(s) {nodes} {'stopped (SIGTERM)' if clean else 'killed (SIGKILL)'}")
            time.sleep(down_s)
            for node in nodes:
                broker.restart_node(d, node, timeout_s=240, wait_registered=node == nodes[-1])
            back = time.monotonic()
            self.log(f"      node(s) {nodes} back after {back - at:.1f}s")
            return {"nodes": nodes, "clean": clean, "at": at, "back_at": back}

        def leader_now() -> int:
            if topic == "controller":
                node = broker.controller_leader(env.bootstrap)
                if node is None:
                    raise RuntimeError("kafka-metadata-quorum named no controller leader")
                return node
            return partition_leader(env.bootstrap, topic)

        leader = leader_now()
        if fault in ("hard", "clean"):
            return [bounce([leader], fault == "clean", outage_s)]
        if fault == "two-down":
            other = next(n for n in range(1, NODES + 1) if n != leader)
            return [bounce([leader, other], False, outage_s)]
        if fault == "rolling":
            return [bounce([node], True, 2.0) for node in range(1, NODES + 1)]
        entries = []  # hard-bounces / clean-bounces: 5 bounces chasing the leader
        for _ in range(5):
            entries.append(bounce([leader_now()], fault == "clean-bounces", 2.0))
            time.sleep(3.0)
        return entries
