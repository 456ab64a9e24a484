"""``python -m chaos`` (``make chaos``): the fault scenarios' command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvstream.options import interrupt_on_sigterm, positive_int, run_command


def _cmd_chaos(args: argparse.Namespace) -> int:
    from chaos.scenarios import ChaosOptions, run_chaos

    interrupt_on_sigterm()
    scenarios = tuple(dict.fromkeys(s.strip() for s in args.scenarios.split(",") if s.strip()))
    return run_chaos(ChaosOptions(scenarios=scenarios, crash_runs=args.runs, rebalance_runs=args.rebalance_runs,
                                  engine_crash_runs=args.engine_crash_runs,
                                  broker_bounce_runs=args.broker_bounce_runs,
                                  broker_bounce_cases=tuple(c.strip() for c in args.broker_bounce_cases.split(",")
                                                            if c.strip()), requests=args.requests,
                                  output=args.output, work_dir=args.work_dir, seed=args.seed,
                                  partitions=args.partitions, outage_s=args.outage, timeout_s=args.timeout))


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m chaos`` argument parser."""
    from chaos.scenarios import SCENARIOS, ChaosOptions

    chaos = ChaosOptions()
    p = argparse.ArgumentParser(prog="python -m chaos",
                       description="Run fault scenarios against the embedded Kafka broker. Each run starts a fresh "
                                   "broker (own data dir, free port) and a fresh app id, injects its fault, and "
                                   "compares the final residency table (read back from its changelog) with the "
                                   "ground truth row for row. Scenarios: crash (SIGKILL a worker at a seeded random "
                                   "moment during live flow, restart it), rebalance (two workers, one leaves "
                                   "mid-stream and rejoins, lookups asked throughout), broker-outage (the broker "
                                   "stops for --outage seconds while the producer publishes), bridge-restart (the "
                                   "bridge is SIGKILLed while an engine publishes; 2 runs: a replay buffer that "
                                   "covers the outage, and one that does not, which must be reported as a gap), "
                                   "table-recovery (a worker with an empty data dir rebuilds the tables from the "
                                   "changelogs and answers as before), engine-crash (three engines publish through "
                                   "the bridge into two workers and a kvstream index with a 3 s source lease; one "
                                   "is killed and restarted, one killed for good: with the bridge alive every "
                                   "answer must be free of a killed engine within 1 s (p99), a blip's blocks must "
                                   "answer again within 3 s, the final answers must name exactly what the engines "
                                   "alive at the end hold, and with the bridge killed too no answer may name a dead "
                                   "engine for more than the lease + 5 s), broker-bounce (brokers of a three-node "
                                   "cluster killed, stopped, bounced and restarted in turn under a steady stream). "
                                   "Prints progress and a summary table; writes "
                                   "the results as JSON. Exit code 1 if any run differs from the truth or fails "
                                   "a scenario check.",
                       epilog='Example: make chaos CHAOS_ARGS="--scenarios crash --runs 3 --output /tmp/crash.json"')
    p.add_argument("--scenarios", default=",".join(SCENARIOS), metavar="NAME[,NAME...]",
                   help=f"scenarios to run, comma-separated (default: all: {','.join(SCENARIOS)})")
    p.add_argument("--runs", type=positive_int, default=chaos.crash_runs,
                   help="runs of the crash scenario, each with another seeded kill moment (default: %(default)s)")
    p.add_argument("--rebalance-runs", type=positive_int, default=chaos.rebalance_runs,
                   help="runs of the rebalance scenario: even runs without standby replicas, odd runs with one; "
                        "the store alternates every two runs (default: %(default)s)")
    p.add_argument("--engine-crash-runs", type=positive_int, default=chaos.engine_crash_runs,
                   help="runs of the engine-crash scenario, each with other seeded kill moments and engine roles; "
                        "the store alternates: even runs memory://, odd runs rocksdb:// (default: %(default)s)")
    p.add_argument("--broker-bounce-runs", type=positive_int, default=chaos.broker_bounce_runs,
                   help="runs of the broker-bounce scenario on a three-node cluster, run i being case i: a "
                        "kv-events partition leader's hard kill, its clean shutdown, two brokers down, a rolling "
                        "restart, then the re-keyed and changelog leaders' hard kills, the controller's hard kill "
                        "and clean shutdown, 5 hard and 5 clean bounces, a worker's SIGTERM and SIGKILL "
                        "(12: every case) "
                        "(default: %(default)s)")
    p.add_argument("--broker-bounce-cases", default="", metavar="NAME[,NAME...]",
                   help="the broker-bounce cases its runs take in turn (chaos/broker_bounce.py, CASES), e.g. "
                        "worker-sigterm,worker-sigkill; default: all, in order")
    p.add_argument("--requests", type=positive_int, default=chaos.requests,
                   help="trace slice: the first N requests of the vendored trace per run (default: %(default)s)")
    p.add_argument("--output", type=Path, default=chaos.output, metavar="FILE",
                   help="results file (default: %(default)s)")
    p.add_argument("--work-dir", type=Path, default=chaos.work_dir,
                   help="brokers, worker data dirs and logs; emptied at start (default: %(default)s)")
    p.add_argument("--seed", type=int, default=chaos.seed, help="seed of the kill moments and split points "
                                                                "(default: %(default)s)")
    p.add_argument("--partitions", type=positive_int, default=chaos.partitions,
                   help="partitions of kv-events and the app's topics (default: %(default)s)")
    p.add_argument("--outage", type=float, default=chaos.outage_s, metavar="SECONDS",
                   help="how long the broker stays down in broker-outage (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=chaos.timeout_s, metavar="SECONDS",
                   help="longest single wait (consumption, start-up, recovery) before a run fails "
                        "(default: %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m chaos``."""
    return run_command("python -m chaos", _cmd_chaos, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
