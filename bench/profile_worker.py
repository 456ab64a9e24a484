"""A real worker under py-spy, its samples grouped by stage: ``python -m bench.profile_worker``.

Starts a broker of its own (data under ``--work-dir``, emptied first), writes the simulator's events of
``--requests`` trace requests into ``kv-events``, starts one ``kvstream worker`` (``--store``) and records it
with ``py-spy record --subprocesses`` (the repartition child too) from its first event materialized until it has
committed everything (start-up is left out).
Then it folds the stacks into the stages of bench/PROFILE.md: each sample goes to the first rule, from the
leaf up, that one of its frames matches. Prints the shares and µs per event (a stage's share of the process's
samples times that process's CPU seconds, divided by the events).

With ``--idle`` py-spy also samples threads that wait, one table per Python thread: a stage's share is of the
thread's wall time, its µs per event are wall time (the share times the run's seconds, divided by the events), and
the waits get stages of their own ("waiting: ..."). That tells a round that is slow because it works more from one
that waits more.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

#: (stage, pattern on one frame "function (file:line)"), leaf-most match wins; order breaks ties in one frame.
#: py-spy sees no frame inside compiled code: with the residency entry as a compiled record the rules, the entry's
#: read and write and the agent's loop count in the Python stage that calls them (no "residency rules" line).
STAGE_RULES = [
    ("kv_event decode", r"<avro reader of [\w.]*KvBlockEvent>"),
    ("ownership_batch read (block fields)", r"<avro reader of [\w.]*OwnershipBatch>|ownership_batch\.py"),
    ("entry decode (RocksDB miss)", r"<avro reader of [\w.]*ResidencyEntry>"),
    ("residency rules", r"apply_block|aggregate_copies|clear_mark_record|ClearPosition"),
    ("encode (entry, change record)", r"avro_writers\.py"),
    ("produce (librdkafka enqueue)", r"^produce |produce_waiting|\(outputs\.py:\d+\)$"),
    ("checkpoint: flush", r"^flush \("),
    ("checkpoint: persist (RocksDB write)", r"^persist \("),
    ("checkpoint: gc.freeze", r"_freeze_gc"),
    ("entry read (cache, RocksDB get)", r"^entry \(.*store\.py|_remember"),
    ("write-back, occupancy, sources", r"write_back|^finish \(|add_occupancy|note_applied|^write \(.*store\.py"),
    ("apply bookkeeping",
     r"^apply(_record)? \(.*applier\.py|_watermark|_retired_epoch|_publisher_keys_of|residency_key"
     r"|^apply_message \(.*materialize\.py"),
    ("ownership_batch/kv_event decode (codec)", r"^decode \(.*codec\.py"),
    # apply_all: the compiled loop, under the re-keyed topic's reader or Faust's agent (materialize_residency)
    ("materialize loop (agent)", r"materialize_residency|^apply_all \(.*applier\.py"),
    ("embedded index feed", r"_feed_index|fleet_index\.py|entry_reader\.py"),
    ("delivery reports", r"serve_delivery_reports"),
    # stream_apps/rekeyed_reader.py: its fetch thread, and its loop in the event loop (hand-off, gate, ack)
    ("re-keyed topic reader: fetch thread", r"^_fetch \(.*rekeyed_reader\.py"),
    ("re-keyed topic reader: hand-off, gate, ack", r"rekeyed_reader\.py"),
    ("GC (collection)", r"^<gc>|gc_collect"),
]
REPARTITION_RULES = [
    ("repartition: consume (librdkafka)", r"^consume \(|^_read \(.*loop\.py"),
    ("repartition: flush + commit", r"^flush \(|^commit \("),
    ("repartition: kv_event decode or projection",
     r"<avro reader of [\w.]*KvBlockEvent>|read_own_version|project_own_version|^decode \(.*codec\.py|_decoded \("),
    ("repartition: block fields", r"block_event\.py|batches\.py"),
    ("repartition: encode batches", r"encode_ownership_batch|encode_keyed_event|encode_clear_mark"),
    ("repartition: produce", r"^produce |_send \("),
    ("repartition: route (key, murmur2, content digest)",
     r"residency_key|key_partition|block_key|needs_content|content_digest|_settle_store|_needs_digest|body_of"),
    # the compiled loop (projection, key, block fields, item) runs under these frames: py-spy does not see C
    ("repartition: loop (compiled or Python)", r"^process \(.*loop\.py|^_rekey_one \(|rekey_one \("),
]


#: With ``--idle``: where a thread that does not run is. Matched on the leaf frame only, before the stage rules.
WAIT_RULES = [
    ("waiting: event loop select (nothing ready)", r"^select \(.*selectors\.py"),
    ("waiting: lock, queue or future (a thread)", r"^wait \(.*threading\.py|^_wait_for_tstate_lock|^acquire "),
    ("waiting: librdkafka call (flush, poll, consume)", r"^(flush|poll|consume|list_topics) \(<built-in>\)$"),
    ("waiting: sleep", r"^sleep "),
]


def classify(frames: list[str], rules, idle: bool = False) -> str:
    if idle:
        for stage, pattern in WAIT_RULES:
            if re.search(pattern, frames[-1]):
                return stage
    for frame in reversed(frames):  # leaf first
        for stage, pattern in rules:
            if re.search(pattern, frame):
                return stage
    return "Faust, aiokafka, event loop (other)"


#: Leaf functions of the samples no rule matched, per process (printed under the table).
OTHER_LEAVES: dict[str, Counter] = defaultdict(Counter)


def fold(raw: Path, idle: bool = False) -> dict[str, Counter]:
    """Samples per process ('worker' or 'repartition') and stage, from py-spy's raw (collapsed) output.

    With ``idle`` (a recording made with py-spy's ``--idle --threads``) the key is the process and its thread,
    e.g. ``worker MainThread``, and waits count in the ``WAIT_RULES`` stages.
    """
    out: dict[str, Counter] = defaultdict(Counter)
    for line in raw.read_text(errors="replace").splitlines():  # py-spy prints some frames undecoded
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue  # a frame name with a line break in it (py-spy prints some modules' docstrings): a fragment
        frames = stack.split(";")
        child = any("spawn_main" in f or "_run_child" in f for f in frames)
        process = "repartition" if child else "worker"
        if idle and not child and sum(f.startswith("process ") for f in frames) > 1:
            continue  # another child of the worker's (multiprocessing's resource tracker): it only waits
        if idle:
            # py-spy's thread frame is "thread (<native id>): <name>"; the child's comes after the parent's
            thread = next((f for f in reversed(frames) if f.startswith("thread (")), "thread (?): ?")
            process += " " + thread.partition("): ")[2]
        stage = classify(frames, REPARTITION_RULES if child else STAGE_RULES, idle)
        out[process][stage] += int(count)
        if stage.startswith("Faust"):
            OTHER_LEAVES[process][" < ".join(f.split(" (")[0].split(":")[0] for f in frames[-1:-4:-1])] += int(count)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile_worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=None, help="trace requests (default: the whole trace)")
    p.add_argument("--store", choices=("rocksdb://", "memory://"), default="rocksdb://",
                   help="the worker's residency store (default: %(default)s)")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second (default %(default)s)")
    p.add_argument("--work-dir", type=Path, default=Path(".kvstream/profile-worker"),
                   help="broker data, worker state and the py-spy output; emptied first (default: %(default)s)")
    p.add_argument("--raw", type=Path, default=None, help="fold this py-spy raw file instead of recording")
    p.add_argument("--events", type=int, default=None, help="with --raw: the events of the recorded run")
    p.add_argument("--cpu", default="", help="with --raw: CPU seconds per process, e.g. worker=47.2,repartition=6.0")
    p.add_argument("--idle", action="store_true",
                   help="sample waiting threads too (py-spy --idle --threads): wall-time shares per thread")
    p.add_argument("--seconds", type=float, default=None, help="with --raw --idle: the recorded run's seconds")
    args = p.parse_args(argv)
    work = args.work_dir.resolve()
    events = args.events
    seconds = args.seconds
    cpu = {k: float(v) for k, v in (item.split("=") for item in args.cpu.split(",") if item)}
    if args.raw is None:
        from bench.run import Bench, BenchOptions, _Workers
        from kafka_io.admin import ensure_topics
        from kvstream import broker
        from kvstream.broker import free_port
        from schemas.topics import KV_EVENTS

        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        status = broker.start(port=free_port(), data_dir=work / "broker")
        try:
            bench = Bench(BenchOptions(output_dir=work / "out", work_dir=work, requests=args.requests,
                                       stream_requests=args.requests))
            bench.bootstrap = status.bootstrap_servers
            ensure_topics(bench.bootstrap, {KV_EVENTS: 8})
            bench._stream_input()
            events = bench._kv_events_messages
            group = _Workers(bench.bootstrap, "profile", work, store=args.store, partitions=8)
            group.start(1)
            args.raw = work / "py-spy.raw"
            spy = None
            try:
                group.wait_first_event(600)  # the samples cover the processing only, not the start-up
                spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid",
                                        str(group.processes[0].pid), "--subprocesses", "--rate", str(args.rate),
                                        "--format", "raw", "--output", str(args.raw), "--nonblocking"]
                                       + (["--idle", "--threads"] if args.idle else []),
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                import psutil

                def per_process():
                    root = psutil.Process(group.processes[0].pid)
                    out = {"worker": root.cpu_times().user + root.cpu_times().system}
                    for c in root.children(recursive=True):
                        if "spawn_main" in " ".join(c.cmdline()) and "resource_tracker" not in " ".join(c.cmdline()):
                            out["repartition"] = c.cpu_times().user + c.cpu_times().system
                    return out

                first = per_process()
                t0 = time.perf_counter()
                group.wait_consumed(events, 3600, "profile")
                seconds = time.perf_counter() - t0
                done = per_process()
                cpu = {k: done[k] - first.get(k, 0.0) for k in done}
                print(f"{events:,} events in {seconds:.1f}s from the first: {events / seconds:,.0f} events/s; CPU s "
                      + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items()))
            finally:
                if spy is not None:
                    spy.send_signal(2)  # SIGINT: py-spy writes its output
                    spy.wait(60)
                group.stop()
        finally:
            broker.stop(work / "broker")
    folded = fold(args.raw, args.idle)
    for process, stages in sorted(folded.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(stages.values())
        if args.idle:
            print(f"\n{process}: {total:,} samples (wall time)")
        else:
            print(f"\n{process}: {total:,} samples" + (f", {cpu.get(process, 0):.1f} CPU s" if cpu else ""))
        print(f"{'stage':<56} {'share':>7} {'µs/event':>9}")
        for stage, n in stages.most_common():
            # CPU µs per event; with --idle, wall µs per event of this thread
            scale = seconds if args.idle else cpu.get(process.split(" ")[0])
            us = (n / total * scale / events * 1e6) if scale and events else float("nan")
            print(f"{stage:<56} {n / total:>7.1%} {us:>9.2f}")
        print("  unmatched samples, by leaf < caller < caller:")
        for leaves, n in OTHER_LEAVES[process].most_common(12):
            print(f"    {n / total:6.1%}  {leaves}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
