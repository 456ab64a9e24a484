"""``make chaos``: the fault scenarios, each against a real embedded Kafka broker.

Every run starts a fresh one-node broker (its own data directory under the work
directory, a free port) and a fresh app id, because the stream app's input topic
``kv-events`` is a fixed name: runs never see each other's data. Each run ends by
reading the residency table back from its changelog topic
(:mod:`stream_apps.snapshot`) and comparing it, row by row and copy count by copy
count, with the ground truth of what was published.

Scenarios (:data:`SCENARIOS`):

``crash``
    A trace slice is replayed, partly before and partly while a worker runs; the
    worker is SIGKILLed (its whole process group) once the live producer has sent a
    seeded random fraction of its records, restarted on the same app id and data
    directory (``rocksdb://`` and ``memory://`` stores alternate), and left to finish.
``rebalance``
    Two workers share the partitions; one is stopped (SIGTERM) mid-stream and
    later restarted. A thread asks ``GET /residency/{hex}/`` of the running
    workers for known blocks throughout and counts answers, 503 retries and failures.
``broker-outage``
    While the producer (idempotent, ``acks=all``) publishes, the broker is stopped
    for ``outage_s`` seconds and started again on the same port and data directory.
    The producer's acknowledged count must equal the messages in ``kv-events``.
``bridge-restart``
    A vLLM-protocol publisher (:class:`harness.vllm_publisher.FakeVllmPublisher`)
    publishes one simulated instance's batches; the bridge (``kvstream bridge``
    with a state file, a child process) is SIGKILLed mid-stream, publishing goes on,
    and the bridge is restarted. Two runs: a replay buffer that covers the outage
    (everything recovered) and one too small for it (the rest is a reported gap:
    ``SourceStale``, ``GET /sources/`` stale).
``table-recovery``
    After a run has finished, its worker is stopped and a new worker with an empty
    data directory (and another web port) starts on the same app id; it rebuilds
    its tables from the changelogs and must answer a sample of residency lookups
    and ``GET /occupancy/`` exactly as the first worker did.
``engine-crash``
    Three engines (:class:`harness.vllm_publisher.FakeVllmPublisher`, each one simulated instance's batches)
    publish through one ``kvstream bridge`` (heartbeats every 0.5 s) into two workers and a ``kvstream index``
    whose sources hold a 3 s lease (:data:`ENGINE_LEASE_S`: the other scenarios keep a day's). While events flow,
    one engine is killed (its sockets closed at once) and comes back 10 s later as a new process, one is killed for
    good, the third runs throughout. A thread asks every answerer ``GET /workers``, ``POST /prefix-match/``,
    ``POST /query_by_hash`` and ``POST /query`` (token ids) about the dead engines' blocks: with the bridge alive,
    every answer must be free of a killed engine within 1 s of its kill (the bridge's ``SourceDisconnected``; p99
    over the answers, the max reported). The third engine's connection then drops for a moment (a blip) and its
    blocks must answer again within 3 s. At the end every worker's answers (``POST /prefix-match/`` of every block
    ever stored, ``GET /workers``' ``live``) must name exactly what the engines alive at the end hold, and the
    residency table must keep the dead engine's rows and have retired the restarted engine's old ones. Last the
    bridge is killed, then the third engine: only the lease takes it out, within the lease + 5 s (the backstop).
``broker-bounce``
    On a three-node cluster (every topic 3 replicas, min.insync.replicas 2), two workers, a ``kvstream index``
    and a producer whose steady stream outlasts the failures;
    per run one case of :data:`chaos.broker_bounce.CASES`: the leader of a kv-events (re-keyed, changelog)
    partition killed or stopped cleanly and brought back, two brokers down together, a rolling restart, 5 bounces
    chasing the leader. Reports the seconds from each failure to the first event applied after it and the share
    of lookups answered while a broker was down.

:func:`run_chaos` runs the chosen scenarios, prints progress and a summary table,
and writes the results (shape: :data:`DEFINITIONS`) to a JSON file.
"""

from __future__ import annotations

import json
import random
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from chaos.bridge_restart import BridgeRestart
from chaos.broker_bounce import BrokerBounce
from chaos.checks import compare_residency  # noqa: F401 (re-exported: tests/chaos/test_chaos.py)
from chaos.engine_crash import ENGINE_LEASE_S, EngineCrash  # noqa: F401 (re-exported: named by the docstring)
from chaos.engines import percentile
from chaos.env import SESSION_TIMEOUT_S, RunEnv, _consume, produce_now  # noqa: F401 (re-exported: tests)
from chaos.fleet_faults import FleetFaults
from chaos.workload import CHAOS_FLEET, Workload, naive_residency, simulate_workload  # noqa: F401 (re-exported)
from kvstream import broker

#: Scenario names, in the order they run.
SCENARIOS = ("crash", "rebalance", "broker-outage", "bridge-restart", "table-recovery", "engine-crash",
             "broker-bounce")

#: What the numbers of the results file mean (written into it as ``definitions``).
DEFINITIONS = {
    "runs": "runs of the scenario; each on a fresh broker data dir and a fresh app id",
    "runs_matching_truth": "runs whose final residency table (read back from <app id>-residency-changelog) "
                           "equals the ground truth row for row and copy count for copy count. engine-crash: the "
                           "truth is the engines' residency as far as it reached kv-events (the dead engine's rows "
                           "kept, the restarted engine's killed process retired), and every worker's final answers "
                           "must also name exactly what the engines alive at the end hold ('final_answers')",
    "runs_passed": "runs matching the truth whose scenario checks also held (see each run's 'checks')",
    "events_produced": "Kafka messages the producer (or bridge) reported acknowledged into kv-events; a clear "
                       "counts once per partition. bridge-restart, engine-crash: messages of every batch the "
                       "engines published",
    "messages_in_topic": "sum over the partitions of kv-events of (end offset - start offset); engine-crash: the "
                         "messages of engine batches only (the bridge's own, per kind, are in 'source_events')",
    "events_lost": "messages acknowledged but missing from kv-events (max(0, produced - in topic); "
                   "bridge-restart: records of batches outside the reported gap that are not in kv-events; "
                   "engine-crash: records of batches not in kv-events but for a killed engine's tail) "
                   "+ residency rows of the truth that are missing from the table or hold fewer copies than the "
                   "truth. Mixed units on purpose: any non-zero value is a loss",
    "duplicates_applied": "residency rows holding more copies than the truth, plus resident rows the truth does "
                          "not have (a store applied more often than its removals; a lost removal would also "
                          "show here). Redelivered messages that the tables ignored are not counted: see "
                          "'duplicates_ignored' (the final workers' /stats/ 'duplicates' counter)",
    "events_in_reported_gap": "bridge-restart: records of the batches the engine's replay buffer no longer held "
                              "when the bridge came back, reported as lost (SourceStale, GET /sources/ stale)",
    "topic_surplus": "messages in kv-events beyond one copy of each (bridge-restart: batches the restarted "
                     "bridge produced again because its state file lagged); the tables must ignore them",
    "kill": "crash: the moment of the SIGKILL: the seeded fraction of the live records (those produced while "
            "the worker runs) sent when it comes, what the worker's /stats/ showed at its last poll before the "
            "kill, seconds since the worker started, whether the live producer was still producing, and the "
            "offsets of kv-events the group had committed",
    "restart_consumed_s": "crash: seconds from the live producer's end until the restarted worker's groups had "
                          "committed all of kv-events and of the re-keyed topic. Correct runs can still be slow "
                          "here: a commit that lagged what the worker had applied (Faust's, before "
                          "stream_apps/consumer_fixes.py counted each offset once) took 140-200 s",
    "differences_by_source": "differing rows per <instance>/<tier>/<missing|extra|below|above>",
    "worker_view": "in 'differences': the copies the (restarted or surviving) worker itself answers for the row "
                   "over GET /residency/{hex}/ (its local table) while the changelog says 'actual'",
    "rekey": "for a run that differs: distinct kv-events payloads, items and distinct payloads in "
             "<app id>-kv-events-by-ownership, and kv-events payloads never re-keyed (lost by the repartition process)",
    "dead_engine_free_after_s": "engine-crash, with the bridge alive: per kill and per answer (an API of an "
                                "answerer: GET /workers giving it live true, POST /prefix-match/, /query_by_hash of "
                                "a block it held at the kill or POST /query of the tokens of one naming it; 2 "
                                "workers and a kvstream index), the seconds after the kill of the last answer that "
                                "named the engine while it was dead (0: none did): from then on that answer was "
                                "free of it. Each answer timed when it came back",
    "dead_engine_free_p99_s": "engine-crash: the p99 (nearest rank) of dead_engine_free_after_s over the run's "
                              "answers; dead_engine_free_max_s their max. scenario entry: the same over every "
                              "run's answers",
    "dead_engine_named_s": "engine-crash: the longest time, in seconds after its kill, that any answer named an "
                           "engine while it was dead (the max of dead_engine_free_after_s). scenario entry: "
                           "dead_engine_named_max_s, the max over the runs",
    "dead_engine_bound_s": "engine-crash: the most dead_engine_free_p99_s may be with the bridge alive: 1 s (issue "
                           "49); the bridge heartbeats every 0.5 s, its probes time out after 0.5 s",
    "backstop": "engine-crash: the bridge killed (SIGKILL), then the engine that ran throughout: only its lease can "
                "take it out. The kill's entry as in 'kills'; named_for_s must not exceed backstop_bound_s, the "
                "workers' --source-lease-s (3 s) + 5 s (issue 26), and named_after_kill must hold (the lease, not "
                "anything faster, took it out). scenario entry: backstop_named_max_s",
    "blip": "engine-crash: the engine that ran throughout, idle at the end, has its connection dropped for a moment "
            "(its PUB socket closed and bound again, the process and replay buffer untouched). Every answerer's GET "
            "/workers and POST /prefix-match/ of blocks it holds are asked for 6 s: left_answers (an answer left it "
            "out), out_first_s, back_s (seconds after the drop from which every answer named it again; must be "
            "at most 3 s; null: not back by the end)",
    "said_down_after_s": "engine-crash: in each kill (and the blip): seconds from the kill to the CreateTime of the "
                         "bridge's first SourceDisconnected of the engine after it, the bridge's part of "
                         "dead_engine_free_after_s (the rest: the broker, the indexes' read, the watch's turn)",
    "named_before_kill": "engine-crash: per killed engine and API (POST /prefix-match/, POST /query), whether an "
                         "answer named it just before its kill: the watch's questions can see it",
    "kills": "engine-crash: per kill: engine, restarted_after_s (null: killed for good), named_for_s and named_by "
             "(the answer that named it last: API and answerer), free_after_s (per answer: see "
             "dead_engine_free_after_s), named_after_kill (the watch saw it named after its kill), watched_for_s "
             "(how long after the kill it was still asked about; must exceed the lease + 5 s), down_seen_s (per "
             "answerer, when GET /workers first said live false), held_blocks, asked; old_blocks, old_asked, "
             "old_named_s: after the restart, POST /prefix-match/ of the blocks the killed process held (old_blocks "
             "of them) that the new process had not stored yet when asked, and the latest answer naming the engine "
             "for one (seconds after the restart; null: none)",
    "final_answers": "engine-crash: GET /workers of every worker until each engine's blocks per tier equal the "
                     "table's and its live flag is right (alive at the end: live true; killed for good: false), "
                     "then POST /prefix-match/ of every block any engine process stored, one per request, on every "
                     "worker: the holders and their tiers must be exactly what the engines alive at the end hold; "
                     "retried for 30 s. blocks_asked, wrong_blocks (with examples), rounds, seconds; counts_equal "
                     "and workers_view: the last GET /workers (blocks per tier, live flags)",
    "watch": "engine-crash: lookups the watch asked, and those that got no answer (a 503 or an error: not counted "
             "as an answer)",
    "old_blocks_named_after_restart_s": "engine-crash: the kill's old_named_s for the restarted engine",
    "epochs": "engine-crash: publisher epochs per engine in kv-events; one per engine process (the bridge found the "
              "restart and took nothing else for one)",
    "tail_lost_with_engine": "engine-crash: messages of the batches a killed engine published after the last one "
                             "that reached kv-events: still queued in its PUB socket when it died, they died with it "
                             "(a crashed vLLM loses them too); not counted in events_lost",
    "case": "broker-bounce: the run's case (chaos/broker_bounce.py, CASES): which partition's leader ('topic', "
            "partition 0) and which 'fault': hard (SIGKILL), clean (SIGTERM), two-down (the leader and another node "
            "SIGKILLed together), rolling (each node in turn, SIGTERM), hard-/clean-bounces (5, each of the leader "
            "then); 'faults' lists each failure's nodes and its seconds (at, back_at) after the first",
    "first_applied_after_s": "broker-bounce: per failure, seconds from it to the first event the workers applied "
                             "after it (their /stats/ materialized, sampled every ~0.1 s; null: none before the end)",
    "answered_during_failure": "broker-bounce: the share of lookups of known blocks (GET /residency/{hex}/ of both "
                               "workers, POST /prefix-match/ of the index, in turn, no retry) answered 200 between "
                               "the first failure and the last node back (failure_s seconds); lookups_during_failure: "
                               "how many were asked. "
                               "scenario entry: its minimum over the runs, and first_applied_after_max_s. "
                               "answered_during_failure_by: the same per answerer (worker-1, worker-2, and the "
                               "kvstream index's POST /prefix-match/)",
    "queries": "rebalance: GET /residency/{hex}/ lookups of known blocks; 'answered' got 200 (possibly after "
               "retries), 'retried' counts 503 answers (rebalancing: retry) that were retried, 'failed' never got a "
               "200 within 30 s or got another error",
}


@dataclass
class ChaosOptions:
    """Options of ``make chaos`` (see its ``--help``)."""

    #: Scenarios to run, names from :data:`SCENARIOS`.
    scenarios: tuple[str, ...] = SCENARIOS
    #: Runs of the crash scenario.
    crash_runs: int = 10
    #: Runs of the rebalance scenario; even runs have no standby replicas, odd runs one (both must hold).
    rebalance_runs: int = 6
    #: Runs of the engine-crash scenario; the store alternates (even runs memory://, odd runs rocksdb://).
    engine_crash_runs: int = 2
    #: Requests of the Mooncake trace replayed per run (the first N).
    requests: int = 300
    #: Results file (JSON); None: do not write one.
    output: Path | None = Path("chaos/results.json")
    #: Brokers, worker data dirs and logs; emptied at start.
    work_dir: Path = Path(".kvstream/chaos")
    #: Seed of every random choice (kill moments, split points); a run's choices depend on it and the run number.
    seed: int = 5
    #: Partitions of kv-events and of the app's topics.
    partitions: int = 4
    #: Seconds the broker stays down in the broker-outage scenario.
    outage_s: float = 10.0
    #: Runs of the broker-bounce scenario: run i is case i of chaos.broker_bounce.CASES (modulo their number).
    broker_bounce_runs: int = 4
    #: Names of chaos.broker_bounce.CASES that the broker-bounce runs take in turn; empty: all, in their order.
    broker_bounce_cases: tuple[str, ...] = ()
    #: Seconds any single wait (consumption, web server, recovery) may take before the run fails.
    timeout_s: float = 300.0
    #: Seconds over which the live producers spread the records they publish while a worker runs.
    live_s: float = 8.0


# --------------------------------------------------------------------------- scenarios
# (the scenario families are the mixins': chaos/fleet_faults.py, chaos/bridge_restart.py, chaos/engine_crash.py)

class Chaos(FleetFaults, BridgeRestart, EngineCrash, BrokerBounce):
    """Runs the scenarios with one set of :class:`ChaosOptions`; ``log`` prints progress."""

    def __init__(self, options: ChaosOptions, log=print) -> None:
        self.options = options
        self.log = log
        self.work = options.work_dir.resolve()
        self._workload: Workload | None = None

    @property
    def workload(self) -> Workload:
        """The trace slice every fleet scenario replays (simulated once)."""
        if self._workload is None:
            self._workload = simulate_workload(self.options.requests, CHAOS_FLEET, self.options.partitions)
        return self._workload

    def env(self, name: str) -> RunEnv:
        """A fresh broker for one run, in ``<work dir>/<name>``."""
        return RunEnv(self.work / name, self.options.partitions, self.log)

    def rng(self, scenario: str, run: int) -> random.Random:
        """The seeded random source of one run."""
        return random.Random(f"{self.options.seed}/{scenario}/{run}")

    # ----------------------------------------------------------------- driver

    def run(self) -> dict:
        """Run every chosen scenario; returns the results (see :data:`DEFINITIONS`)."""
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        plan = {"crash": (self.crash, self.options.crash_runs),
                "rebalance": (self.rebalance, self.options.rebalance_runs),
                "broker-outage": (self.broker_outage, 1), "bridge-restart": (self.bridge_restart, 2),
                "table-recovery": (self.table_recovery, 1),
                "engine-crash": (self.engine_crash, self.options.engine_crash_runs),
                "broker-bounce": (self.broker_bounce, self.options.broker_bounce_runs)}
        results: dict = {}
        for number, name in enumerate(self.options.scenarios, 1):
            method, runs = plan[name]
            self.log(f"[{number}/{len(self.options.scenarios)}] {name}: {runs} run{'s' * (runs > 1)}")
            entries = []
            for run in range(runs):
                t0 = time.monotonic()
                try:
                    entry = method(run)
                except Exception as exc:  # a failed run is a result, not the end of the chaos run
                    entry = {"run": run, "matches_truth": False, "passed": False, "events_produced": 0,
                             "events_lost": 0, "duplicates_applied": 0, "seconds": round(time.monotonic() - t0, 1),
                             "error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc(limit=-6)}
                entries.append(entry)
                verdict = "matches truth" if entry["matches_truth"] else "DIFFERS from truth"
                failed = [c for c, ok in entry.get("checks", {}).items() if not ok]
                self.log(f"    run {run + 1}/{runs}: {verdict}; {entry['events_produced']:,} produced, "
                         f"{entry['events_lost']} lost, {entry['duplicates_applied']} duplicates applied, "
                         f"{entry['seconds']}s" + (f"; failed checks: {failed}" if failed else "")
                         + (f"; error: {entry['error']}" if "error" in entry else ""))
                for difference in entry.get("differences", [])[:3]:
                    self.log(f"      {difference}")
            results[name] = summarize(entries)
        return results


def summarize(entries: list[dict]) -> dict:
    """A scenario's entry of the results file: totals over its runs, and the runs themselves."""
    return {"runs": len(entries),
            "runs_matching_truth": sum(1 for e in entries if e["matches_truth"]),
            "runs_passed": sum(1 for e in entries if e["passed"]),
            "events_produced": sum(e["events_produced"] for e in entries),
            "events_lost": sum(e["events_lost"] for e in entries),
            "duplicates_applied": sum(e["duplicates_applied"] for e in entries),
            "seconds": round(sum(e["seconds"] for e in entries), 1),
            **(_dead_engine_summary(entries) if any("dead_engine_bound_s" in e for e in entries) else {}),
            **(_bounce_summary(entries) if any("case" in e for e in entries) else {}),
            "run_details": entries}


def _bounce_summary(entries: list[dict]) -> dict:
    """broker-bounce's figures over its runs: the longest wait for the first event applied after a failure, and
    the smallest share of lookups answered during one."""
    waits = [s for e in entries for s in e.get("first_applied_after_s", ()) if s is not None]
    shares = [e["answered_during_failure"] for e in entries if e.get("answered_during_failure") is not None]
    return {"first_applied_after_max_s": max(waits, default=None),
            "answered_during_failure_min": min(shares, default=None)}


def _dead_engine_summary(entries: list[dict]) -> dict:
    """engine-crash's figures over its runs: the p99 and max of every answer's time to be free of a killed engine
    (bridge alive), the longest any named one, and the longest the backstop (bridge killed too) took."""
    free = [s for e in entries for s in e.get("dead_engine_free_after_s", ())]
    return {"dead_engine_free_p99_s": percentile(free, 0.99), "dead_engine_free_max_s": max(free, default=None),
            "dead_engine_free_answers": len(free),
            "dead_engine_named_max_s": max((e["dead_engine_named_s"] for e in entries
                                            if e.get("dead_engine_named_s") is not None), default=None),
            "dead_engine_bound_s": next(e["dead_engine_bound_s"] for e in entries if "dead_engine_bound_s" in e),
            "backstop_named_max_s": max((e["backstop"]["named_for_s"] for e in entries if e.get("backstop")),
                                        default=None),
            "backstop_bound_s": next((e["backstop_bound_s"] for e in entries if "backstop_bound_s" in e), None),
            "blip_back_max_s": max((e["blip"]["back_s"] for e in entries
                                    if e.get("blip") and e["blip"]["back_s"] is not None), default=None)}


def print_summary(results: dict, log=print) -> None:
    """Print one line per scenario: runs, matching, passed, produced, lost, duplicates, seconds; then engine-crash's
    longest dead-engine answer against its bound."""
    log(f"\n{'scenario':<16}{'runs':>5}{'match':>7}{'passed':>8}{'produced':>11}{'lost':>6}{'dups':>6}{'seconds':>9}")
    for name, s in results.items():
        log(f"{name:<16}{s['runs']:>5}{s['runs_matching_truth']:>7}{s['runs_passed']:>8}{s['events_produced']:>11,}"
            f"{s['events_lost']:>6}{s['duplicates_applied']:>6}{s['seconds']:>9}")
    for name, s in results.items():
        if "dead_engine_bound_s" in s:
            log(f"{name}: with the bridge alive, every answer free of a killed engine {s['dead_engine_free_p99_s']}s "
                f"after its kill (p99; max {s['dead_engine_free_max_s']}s over {s['dead_engine_free_answers']} "
                f"answers; bound {s['dead_engine_bound_s']:g}s); with the bridge killed too, named up to "
                f"{s['backstop_named_max_s']}s (bound {s['backstop_bound_s']:g}s); a blip's blocks back after "
                f"{s['blip_back_max_s']}s at most")


def run_chaos(options: ChaosOptions, log=print) -> int:
    """Run the scenarios, print a summary, write ``options.output``; returns 0 when every run passed, else 1.

    Raises:
        ValueError: an unknown scenario name.
        kvstream.broker.BrokerError: Java or the Kafka jars are missing.
    """
    from chaos.broker_bounce import CASES

    unknown_cases = [c for c in options.broker_bounce_cases if c not in {case[0] for case in CASES}]
    if unknown_cases:
        raise ValueError(f"unknown broker-bounce case(s) {unknown_cases}; choose from "
                         f"{', '.join(case[0] for case in CASES)}")
    unknown = [s for s in options.scenarios if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    started = time.monotonic()
    chaos = Chaos(options, log)
    log(f"make chaos: {', '.join(options.scenarios)}; trace slice of {options.requests} requests, "
        f"{options.partitions} partitions, seed {options.seed}; work dir {chaos.work}")
    results = chaos.run()
    print_summary(results, log)
    passed = all(s["runs_passed"] == s["runs"] for s in results.values())
    document = {"kafka_version": broker.KAFKA_VERSION,
                "generated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "options": {"scenarios": list(options.scenarios), "crash_runs": options.crash_runs,
                            "rebalance_runs": options.rebalance_runs, "engine_crash_runs": options.engine_crash_runs,
                            "broker_bounce_runs": options.broker_bounce_runs,
                            "broker_bounce_cases": list(options.broker_bounce_cases),
                            "requests": options.requests, "partitions": options.partitions, "seed": options.seed,
                            "outage_s": options.outage_s, "live_s": options.live_s,
                            "worker_session_timeout_s": SESSION_TIMEOUT_S},
                "seconds": round(time.monotonic() - started, 1), "all_passed": passed,
                "definitions": DEFINITIONS, "scenarios": results}
    if options.output is not None:
        options.output.parent.mkdir(parents=True, exist_ok=True)
        options.output.write_text(json.dumps(document, indent=1, default=str) + "\n")
        log(f"results: {options.output}")
    log("all runs passed" if passed else "SOME RUNS FAILED")
    return 0 if passed else 1
