"""The latency step of ``make bench`` on two or more versions of the worker, interleaved on one broker, so that a
change is compared with the code before it in the same minutes (``python -m bench.latency_ab``).

Why interleaved: the latency step's p99 moves by a factor of two with the machine's speed alone (bench/PROFILE.md,
"Fifteenth round"), so one run of each version, an hour apart, says nothing about a change. Here every run
starts a fresh worker (its own app id) on a recreated ``kv-events``, the versions take turns in a rotated
order, and the broker's first run, always slow, is a warm-up left out of the medians.

A version is a checkout on ``PYTHONPATH`` (the worker runs ``python -m kvstream.cli worker`` from it, with this
checkout's virtual environment, and ``PYTHONSAFEPATH`` set: otherwise ``-m`` puts the current directory, where
this tool runs, ahead of ``PYTHONPATH``), plus environment variables and worker options of its own. Each version
gets only the worker options the bench sets (its store, partitions, app id...) and its own, so that every
checkout runs with its own defaults.

A checkout needs its compiled modules built in place, or its workers run the pure-Python path, which is not what
the image runs: ``--build`` compiles those it lacks (:func:`build_compiled_modules`), or ``--allow-pure`` runs it
without them. Options the bench sets that an older checkout does not know (its ``kvstream worker --help`` does not
list them) are left out for it, and the tool says which; a version's own ``--worker-arg`` that its checkout does
not know is an error.

Example (the code before a change against the working tree, five rounds)::

    git worktree add /tmp/before HEAD~1
    python -m bench.latency_ab before=/tmp/before after=. --rounds 5 --build
    python -m bench.latency_ab base=. lower=. --worker-arg lower:--repartition-linger-s=0.01
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvstream.options import interrupt_on_sigterm, positive_int, run_command

#: The figures each run gives (``row`` keys) whose medians the summary compares.
SUMMARY_FIELDS = ("p50_ms", "p99_ms", "worker_cores", "broker_cores", "idle_cores")


@dataclass
class Version:
    """One version of the worker under test.

    Attributes:
        name: how the tables name it (unique).
        checkout: the checkout the worker runs from (its root: ``PYTHONPATH``).
        env: environment variables set for its workers only (e.g. an experiment's switch).
        worker_args: ``--option=value`` items added to (or replacing) the bench's worker options.
    """

    name: str
    checkout: Path
    env: dict[str, str] = field(default_factory=dict)
    worker_args: list[str] = field(default_factory=list)


def parse_versions(specs: list[str], envs: list[str], worker_args: list[str]) -> list[Version]:
    """The versions from the command line: ``NAME=PATH`` each, ``NAME:VAR=VALUE`` environment items and
    ``NAME:--option=value`` worker options.

    Raises:
        ValueError: a malformed item, a name given twice, an item for an unknown name, a path that is not a
            checkout (no ``kvstream`` package in it), or fewer than two versions.
    """
    versions: dict[str, Version] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"a version is NAME=PATH, not {spec!r}")
        if name in versions:
            raise ValueError(f"version {name!r} is given twice")
        checkout = Path(path).resolve()
        if not (checkout / "kvstream" / "__init__.py").is_file():
            raise ValueError(f"{path} is not a kvstream checkout (no kvstream/__init__.py in it)")
        versions[name] = Version(name, checkout)
    if len(versions) < 2:
        raise ValueError("give at least two versions (NAME=PATH): there is nothing to compare otherwise")

    def owner(item: str, what: str) -> tuple[Version, str]:
        name, sep, rest = item.partition(":")
        if not sep or not rest:
            raise ValueError(f"{what} is NAME:{'VAR=VALUE' if what == '--env' else '--option=value'}, not {item!r}")
        if name not in versions:
            raise ValueError(f"{what} {item!r} names no version (versions: {', '.join(versions)})")
        return versions[name], rest

    for item in envs:
        version, rest = owner(item, "--env")
        var, sep, value = rest.partition("=")
        if not sep or not var:
            raise ValueError(f"--env is NAME:VAR=VALUE, not {item!r}")
        version.env[var] = value
    for item in worker_args:
        version, rest = owner(item, "--worker-arg")
        if not rest.startswith("--"):
            raise ValueError(f"--worker-arg is NAME:--option[=value], not {item!r}")
        version.worker_args.append(rest)
    return list(versions.values())


def missing_compiled_modules(checkout: Path) -> list[str]:
    """The ``.pyx`` sources of ``checkout`` (relative paths) with no built extension beside them."""
    missing = []
    for directory, subdirectories, files in os.walk(checkout):
        # a virtual environment, git's objects and build trees hold no module of the checkout's own
        subdirectories[:] = sorted(d for d in subdirectories if not d.startswith(".") and d != "build")
        for source in sorted(files):
            if source.endswith(".pyx") and not any(f.startswith(source[:-4] + ".") and f.endswith(".so")
                                                   for f in files):
                missing.append(str((Path(directory) / source).relative_to(checkout)))
    return missing


def build_compiled_modules(checkout: Path, sources: list[str]) -> None:
    """Compile ``sources`` (``.pyx`` paths relative to ``checkout``) with Cython and put each extension beside
    its source.

    The build runs in a scratch copy of the sources and the ``.pxd`` files beside them, not in the checkout: an
    older checkout's ``pyproject.toml`` may not parse with today's setuptools, and ``cythonize`` reads it.

    Raises:
        RuntimeError: Cython is not installed here (``pip install '.[bench]'`` brings it), or the build failed
            (its output's end in the message).
    """
    import importlib.util
    import tempfile

    if importlib.util.find_spec("Cython") is None:
        raise RuntimeError("building a checkout's compiled modules needs Cython: pip install '.[bench]' (or give "
                           "--allow-pure)")
    with tempfile.TemporaryDirectory(prefix="latency-ab-build-") as scratch:
        for source in sources:
            directory = Path(source).parent
            for part in (directory, *directory.parents):  # packages, as the checkout has them (not its root)
                if part != Path("."):
                    (Path(scratch) / part).mkdir(parents=True, exist_ok=True)
                    (Path(scratch) / part / "__init__.py").touch()
            for file in (checkout / directory).iterdir():
                if file.suffix in (".pyx", ".pxd"):
                    shutil.copy2(file, Path(scratch) / directory / file.name)
        done = subprocess.run([sys.executable, "-m", "Cython.Build.Cythonize", "-i", "-q", *sources], cwd=scratch,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building {', '.join(sources)} of {checkout} failed: "
                               f"{(done.stdout + done.stderr)[-800:]}")
        for source in sources:
            directory = Path(source).parent
            for built in (Path(scratch) / directory).glob(f"{Path(source).stem}.*.so"):
                shutil.copy2(built, checkout / directory / built.name)


def checkout_env(checkout: Path) -> dict[str, str]:
    """The environment that makes ``python -m kvstream.cli`` import ``checkout``'s code: on ``PYTHONPATH``, and
    ``PYTHONSAFEPATH`` so that the current directory does not come first (Python 3.11's ``-m`` puts it there)."""
    return {"PYTHONPATH": str(checkout), "PYTHONSAFEPATH": "1"}


def known_worker_options(checkout: Path) -> set[str]:
    """The ``--options`` that ``kvstream worker --help`` lists when run from ``checkout``.

    Raises:
        RuntimeError: the command failed (its standard error in the message) or did not answer.
    """
    try:
        done = subprocess.run([sys.executable, "-m", "kvstream.cli", "worker", "--help"], capture_output=True,
                              text=True, env={**os.environ, **checkout_env(checkout)}, timeout=120)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"'kvstream worker --help' from {checkout} did not answer within 120 s") from None
    if done.returncode != 0:
        raise RuntimeError(f"'kvstream worker --help' from {checkout} exited with {done.returncode}: "
                           f"{done.stderr[-500:]}")
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", done.stdout))


def given_options(argv: list[str], given_fields: set[str]) -> list[str]:
    """The items of ``argv`` (``kvstream.options.settings_to_argv``'s) for the settings fields in
    ``given_fields`` (``model_fields_set``: what the bench set), so that the other fields keep the defaults of
    whichever checkout runs (a boolean field's ``--no-`` form included)."""
    from kvstream.options import flag

    options = {flag(name) for name in given_fields}

    def option(item: str) -> str:
        name = item.split("=", 1)[0]
        return "--" + name[5:] if name.startswith("--no-") and "--" + name[5:] in options else name

    return [item for item in argv if option(item) in options]


def worker_argv(base: list[str], version: Version, known: set[str]) -> tuple[list[str], list[str]]:
    """The worker options of ``version``: ``base`` (the bench's, ``--option=value`` items) with its own added or
    replacing the same option, less those its checkout does not know. Returns ``(argv, left out)``."""
    argv = list(base)
    for extra in version.worker_args:
        option = extra.split("=", 1)[0]
        argv = [item for item in argv if item.split("=", 1)[0] != option] + [extra]
    kept = [item for item in argv if item.split("=", 1)[0] in known]
    return kept, [item for item in argv if item not in kept]


def rotation(names: list[str], round_index: int) -> list[str]:
    """The order of the versions in round ``round_index``: rotated by one each round, so that each version runs
    first, second... in turn (the cyclic order stays: with three, b always follows a)."""
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def summarize(rows: dict[str, list[dict]]) -> dict[str, dict]:
    """Per version: the median of each of :data:`SUMMARY_FIELDS` over its runs, and the runs' p99 in order."""
    summary = {}
    for name, runs in rows.items():
        if not runs:
            continue
        medians = {key: round(statistics.median(run[key] for run in runs), 3) for key in SUMMARY_FIELDS}
        summary[name] = {**medians, "runs": len(runs), "p99_by_run": [run["p99_ms"] for run in runs]}
    return summary


def unknown_worker_args(versions: list[Version], known: dict[str, set[str]]) -> list[str]:
    """``NAME:--option`` of each version's own worker option that its checkout's ``kvstream worker --help`` does
    not list (a typo, or an option of another version)."""
    return [f"{version.name}:{item}" for version in versions for item in version.worker_args
            if item.split("=", 1)[0] not in known[version.name]]


def _run_versions(args: argparse.Namespace, versions: list[Version], known: dict[str, set[str]]) -> dict:
    """Every run (the warm-up, then ``args.rounds`` rounds of every version); returns the report, also written to
    ``args.output`` after every run."""
    from confluent_kafka.admin import AdminClient

    import kvstream.worker as worker_module
    from bench.run import Bench, BenchOptions
    from kvstream import broker
    from kvstream.broker import free_port

    work = args.work_dir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    status = broker.start(port=free_port(), data_dir=work / "broker")
    rows: dict[str, list[dict]] = {version.name: [] for version in versions}
    warmup: list[dict] = []
    left_out: dict[str, list[str]] = {}  # version -> the options the bench sets that its checkout does not know

    def report() -> dict:
        return {"rate": args.rate, "seconds": args.seconds, "store": args.store,
                "versions": {v.name: {"checkout": str(v.checkout), "env": v.env, "worker_args": v.worker_args,
                                      "options_left_out": left_out.get(v.name, [])} for v in versions},
                "warmup": warmup, "runs": rows, "summary": summarize(rows)}

    base_env = dict(os.environ)
    original_argv = worker_module.settings_to_argv
    admin = None
    try:
        bench = Bench(BenchOptions(output_dir=work / "out", work_dir=work, latency_rate=args.rate,
                                   latency_s=args.seconds))
        bench.bootstrap, bench.broker_pid = status.bootstrap_servers, status.pid
        admin = AdminClient({"bootstrap.servers": bench.bootstrap})
        by_name = {version.name: version for version in versions}
        plan = [("warm-up", versions[0].name)]
        for round_index in range(args.rounds):
            plan += [(f"round {round_index + 1}", name) for name in rotation(list(by_name), round_index)]
        for run_index, (label, name) in enumerate(plan):
            version = by_name[name]
            _recreate(admin, bench.bootstrap)
            bench._kv_events_messages = 0

            def argv_of(settings, version=version):
                argv = given_options(original_argv(settings), set(settings.model_fields_set))
                argv, unknown = worker_argv(argv, version, known[version.name])
                if unknown and version.name not in left_out:
                    print(f"[{version.name}] options its checkout does not know, left out: {' '.join(unknown)}",
                          flush=True)
                left_out[version.name] = unknown
                return argv

            group = bench._workers(f"latab{run_index}", work, store=args.store, partitions=8,
                                   residency_changes=True)
            try:
                worker_module.settings_to_argv = argv_of
                os.environ.update({**checkout_env(version.checkout), **version.env})
                try:
                    group.start(1)
                finally:  # the worker has its environment; this process and the next version get theirs back
                    os.environ.clear()
                    os.environ.update(base_env)
                    worker_module.settings_to_argv = original_argv
                group.wait_ready(args.timeout_s)
                bench._latency(group)
            finally:
                group.stop()
                gc.collect()  # the step's producer is in a reference cycle (its delivery callback): freed now
            details = bench.results["details"]["latency_p99_ms"]
            row = {"p50_ms": bench.results["figures"]["latency_p50_ms"]["value"],
                   "p99_ms": bench.results["figures"]["latency_p99_ms"]["value"],
                   "worker_cores": details["worker_cpu_cores"],
                   "broker_cores": details["broker_cpu_cores"],
                   "idle_cores": details["machine_idle_cores"],
                   "to_repartition_topic_ms": details["to_repartition_topic_ms"],
                   "repartition_topic_to_table_ms": details["repartition_topic_to_table_ms"]}
            (warmup if label == "warm-up" else rows[name]).append({"version": name, "label": label, **row})
            args.output.write_text(json.dumps(report(), indent=2) + "\n")
            print(f"{label:>9} {name}: p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms, worker "
                  f"{row['worker_cores']:.3f} of a core, broker {row['broker_cores']:.3f}, machine idle "
                  f"{row['idle_cores']:.2f} cores{' (warm-up, left out)' if label == 'warm-up' else ''}", flush=True)
    finally:
        worker_module.settings_to_argv = original_argv
        # librdkafka's clients log every second once their broker is gone: closed first
        admin = None
        gc.collect()
        broker.stop(work / "broker")
    return report()


def _recreate(admin, bootstrap: str) -> None:
    """Delete ``kv-events`` and create it again (8 partitions), so that a fresh worker reads only its own run.

    Raises:
        RuntimeError: the broker refused the deletion.
        TimeoutError: the topic was still listed a minute after its deletion.
    """
    from confluent_kafka import KafkaException

    from kafka_io.admin import ensure_topics
    from schemas.topics import KV_EVENTS

    for future in admin.delete_topics([KV_EVENTS]).values():
        try:
            future.result()
        except KafkaException as exc:
            if "UNKNOWN_TOPIC" not in str(exc):  # the first run: no such topic yet
                raise RuntimeError(f"could not delete {KV_EVENTS}: {exc}") from None
    deadline = time.monotonic() + 60
    while KV_EVENTS in admin.list_topics(timeout=10).topics:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{KV_EVENTS} was still listed 60 s after its deletion")
        time.sleep(0.5)
    time.sleep(2)  # the controller's deletion reaches the partition leaders after the metadata
    ensure_topics(bootstrap, {KV_EVENTS: 8})


def _cmd(args: argparse.Namespace) -> int:
    interrupt_on_sigterm()
    versions = parse_versions(args.versions, args.env or [], args.worker_arg or [])
    if not args.allow_pure:
        for version in versions:
            missing = missing_compiled_modules(version.checkout)
            if missing and args.build:
                print(f"[{version.name}] building {', '.join(missing)} in {version.checkout}", flush=True)
                build_compiled_modules(version.checkout, missing)
                missing = missing_compiled_modules(version.checkout)
            if missing:
                raise ValueError(f"{version.name} ({version.checkout}) has no compiled module for "
                                 f"{', '.join(missing)}: give --build to compile them, or --allow-pure")
    known = {version.name: known_worker_options(version.checkout) for version in versions}
    unknown = unknown_worker_args(versions, known)
    if unknown:
        raise ValueError(f"worker options their checkout does not know: {', '.join(unknown)} (its 'kvstream worker "
                         "--help' lists what it takes; give values as --option=value)")
    report = _run_versions(args, versions, known)
    print(f"\nmedians over {args.rounds} rounds ({args.rate:,} events/s, {args.seconds:g} s measured each):")
    print(f"{'version':<16} {'p50 ms':>8} {'p99 ms':>8} {'worker':>8} {'broker':>8} {'idle':>6}  p99 by run")
    for name, row in report["summary"].items():
        by_run = ", ".join(f"{p99:.0f}" for p99 in row["p99_by_run"])
        print(f"{name:<16} {row['p50_ms']:>8.1f} {row['p99_ms']:>8.1f} {row['worker_cores']:>8.3f} "
              f"{row['broker_cores']:>8.3f} {row['idle_cores']:>6.2f}  {by_run}")
    print(f"every run: {args.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m bench.latency_ab`` argument parser."""
    p = argparse.ArgumentParser(prog="python -m bench.latency_ab", description=__doc__.split("\n\n")[0],
                                epilog="Each run takes about a minute (worker start, 5 s of warm-up at the rate, "
                                       "--seconds measured, the catch-up and the read of the results). Figures "
                                       "as the latency step's (bench/README.md); cores are shares of one core "
                                       "while the rate ran: the worker's processes, the broker, and the "
                                       "machine's idle time summed over its CPUs.")
    p.add_argument("versions", nargs="+", metavar="NAME=PATH",
                   help="a version: a name and the checkout its worker runs from ('.' for this one)")
    p.add_argument("--env", action="append", metavar="NAME:VAR=VALUE",
                   help="an environment variable for that version's workers only (repeatable)")
    p.add_argument("--worker-arg", action="append", metavar="NAME:--OPTION=VALUE",
                   help="a worker option for that version, added or replacing the bench's (repeatable)")
    p.add_argument("--rounds", type=positive_int, default=5, help="runs of each version (default: %(default)s)")
    p.add_argument("--rate", type=positive_int, default=10_000, metavar="EVENTS_PER_S",
                   help="steady produce rate (default: %(default)s, the latency step's)")
    p.add_argument("--seconds", type=float, default=20.0, help="measured seconds per run (default: %(default)s)")
    p.add_argument("--store", choices=("memory://", "rocksdb://"), default="memory://",
                   help="the workers' store (default: %(default)s, the latency step's)")
    p.add_argument("--build", action="store_true",
                   help="compile the modules a checkout lacks (Cython, from the bench extra) before the runs")
    p.add_argument("--allow-pure", action="store_true",
                   help="run checkouts without their compiled modules (their workers run the pure-Python path)")
    p.add_argument("--work-dir", type=Path, default=Path(".kvstream/latency-ab"),
                   help="broker and workers' data, emptied first (default: %(default)s)")
    p.add_argument("--output", type=Path, default=Path(".kvstream/latency-ab/latency_ab.json"),
                   help="every run's figures and the medians, as JSON (default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="how long a worker may take to be ready")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m bench.latency_ab``."""
    return run_command("python -m bench.latency_ab", _cmd, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
