"""``python -m bench`` (``make bench``): the benchmark's command line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kafka_io.config import DEFAULT_PARTITIONS
from kvstream.options import interrupt_on_sigterm, non_negative_int, positive_float, positive_int, run_command


def _cmd_bench(args: argparse.Namespace) -> int:
    from bench.run import STEPS, BenchOptions, run_bench

    interrupt_on_sigterm()
    only = None
    if args.only:
        only = tuple(name.strip() for name in args.only.split(",") if name.strip())
        unknown = [name for name in only if name not in STEPS]
        if unknown:
            raise ValueError(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(STEPS)}")
        if "latency" in only and "stream-1w" not in only:
            # the latency step runs on stream-1w's caught-up worker; alone it would measure nothing
            raise ValueError("the latency step runs on the stream-1w step's worker: add stream-1w to --only "
                             "(e.g. --only stream-1w,latency)")
    index_parts = None
    if args.index_parts:
        from bench.index_bench import PARTS

        index_parts = tuple(name.strip() for name in args.index_parts.split(",") if name.strip())
        unknown = [name for name in index_parts if name not in dict(PARTS)]
        if unknown:
            raise ValueError(f"unknown index part(s) {', '.join(unknown)}; parts: {', '.join(dict(PARTS))}")
    options = BenchOptions(output_dir=args.output_dir, work_dir=args.work_dir, quick=args.quick,
                           requests=args.requests, stream_requests=args.stream_requests, rows=args.rows,
                           rows_large=args.rows_large, latency_rate=args.latency_rate, latency_s=args.latency_seconds,
                           memory_rows=args.memory_rows, partitions=args.partitions, timeout_s=args.timeout,
                           only=only, peer_rounds=args.peer_rounds, schema_registry=args.schema_registry,
                           index_parts=index_parts)
    return run_bench(options)


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m bench`` argument parser."""
    from bench.run import STEP_HELP, STEPS

    p = argparse.ArgumentParser(prog="python -m bench",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Start a broker of its own on a free port (data under --work-dir, emptied "
                                   "first), then run each step and write its figures to "
                                   "<output-dir>/results.json as soon as they are measured, a table at the end "
                                   "and <output-dir>/results.png. Steps, in order:\n  "
                                   + "\n  ".join(f"{name:<17} {STEP_HELP[name]}" for name in STEPS),
                       epilog="Figure definitions: bench/README.md ('Figures') and results.json. A failed step "
                              "is recorded under 'errors' and the others still run (exit code 1). The full run "
                              "takes long (the 10M-row step alone writes and consumes over 10 million events); "
                              "--quick takes a few minutes.")
    p.add_argument("--schema-registry", default=os.environ.get("KVSTREAM_SCHEMA_REGISTRY_URL", ""), metavar="URL",
                   help="schema registry URL (e.g. from 'kvstream registry start'): producers and workers write the "
                        "Confluent wire format (default: $KVSTREAM_SCHEMA_REGISTRY_URL, else none)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 3000 requests for the producer and bridge, 600 for the stream app, 60,000 "
                        "rows, 5 s of latency, no 10M-row step")
    p.add_argument("--requests", type=positive_int, default=None, metavar="N",
                   help="trace requests replayed by the producer and bridge steps (default: the whole trace, "
                        "12,031)")
    p.add_argument("--stream-requests", type=positive_int, default=None, metavar="N",
                   help="trace requests written to kv-events for the plain-consumer and stream-app steps "
                        "(default: as --requests; --quick: 600)")
    p.add_argument("--rows", type=positive_int, default=1_000_000, metavar="N",
                   help="resident rows of the RSS and recovery step (default: %(default)s)")
    p.add_argument("--rows-large", type=non_negative_int, default=10_000_000, metavar="N",
                   help="resident rows of the large RSS step; 0 skips it (default: %(default)s; --quick: 0)")
    p.add_argument("--latency-rate", type=positive_int, default=10_000, metavar="EVENTS_PER_S",
                   help="steady produce rate of the latency step (default: %(default)s)")
    p.add_argument("--latency-seconds", type=positive_float, default=30.0, metavar="S",
                   help="measured duration of the latency step, after 5 s of warm-up at the same rate "
                        "(default: %(default)s)")
    p.add_argument("--memory-rows", type=positive_int, default=200_000, metavar="N",
                   help="rows of the bytes-per-row step (default: %(default)s)")
    p.add_argument("--partitions", type=positive_int, default=DEFAULT_PARTITIONS,
                   help="partitions of kv-events and the app's topics (default: %(default)s)")
    p.add_argument("--only", default=None, metavar="STEP[,STEP...]",
                   help="run only these steps (stream-1w is needed for latency)")
    p.add_argument("--index-parts", default=None, metavar="PART[,PART...]",
                   help="run only these parts of the index step: http, malformed, embedded, memory, catch-up, "
                        "changelog-freshness, freshness (default: all)")
    p.add_argument("--peer-rounds", type=positive_int, default=3, metavar="N",
                   help="runs of each contestant of the peers step, medians reported (default: %(default)s; "
                        "--quick: 1)")
    p.add_argument("--output-dir", type=Path, default=Path("bench"), metavar="DIR",
                   help="where results.json and results.png go (default: %(default)s)")
    p.add_argument("--work-dir", type=Path, default=Path(".kvstream/bench"), metavar="DIR",
                   help="broker data, worker state and logs; emptied at start (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=7200.0, metavar="S",
                   help="longest any one wait may take (default: %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench``."""
    return run_command("python -m bench", _cmd_bench, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
