"""The engine-crash scenario: engines killed behind one bridge, and what the workers' answers and table say of them."""

from __future__ import annotations

import signal
import sys
import time
from collections import Counter

from chaos.checks import _explain, _run_result, check_residency, read_topic
from chaos.engines import _DeadEngineWatch, _Engine
from chaos.env import Worker, _fresh_app_id, _start_bridge, http_json
from chaos.workload import message_count, naive_residency
from kvstream import broker
from kvstream.client import IndexClient
from producers.simulator import Batch, ClusterSimulator, FleetConfig, load_trace
from producers.split import split_event
from schemas import AvroCodec

#: engine-crash: the workers' ``--source-lease-s``, seconds. Short, so that a run sees leases lapse; the other
#: scenarios keep a day's lease on purpose (their sources publish once and are checked long after).
ENGINE_LEASE_S = 3.0
#: engine-crash: the bridge's ``--heartbeat-interval-s`` and ``--heartbeat-probe-timeout-s``, seconds: well below
#: the lease, so a live idle engine never lapses between two heartbeats.
ENGINE_HEARTBEAT_S = 0.5
ENGINE_PROBE_TIMEOUT_S = 0.5
#: engine-crash: how much longer than its lease an answer may still name a dead engine, seconds (issue 26).
DEAD_ANSWER_SLACK_S = 5.0


class EngineCrash:
    """The engine-crash scenario.

    A mixin of :class:`chaos.scenarios.Chaos`: it uses the run's options, workload, ``env`` and ``rng``.
    """

    def engine_crash(self, run: int) -> dict:
        """Three engines publish through ``kvstream bridge`` into two workers with a short lease: one is killed and
        comes back as a new process, one is killed for good, one runs throughout. No answer may name a dead engine
        for longer than its lease plus :data:`DEAD_ANSWER_SLACK_S`, and the final answers must name exactly the
        blocks the engines alive at the end hold."""
        o = self.options
        rng = self.rng("engine-crash", run)
        fleet = FleetConfig(instances=3, tp_instances=(), clear_instance=rng.randrange(3), clear_at=0.6,
                            gpu_blocks=600, cpu_blocks=900, kvcr_blocks=1200)
        batches_of: dict[str, list[Batch]] = {}
        for batch in ClusterSimulator(fleet).run(load_trace(limit=o.requests)):
            batches_of.setdefault(batch.publisher.instance_id, []).append(batch)
        restarting, dying, surviving = rng.sample(sorted(batches_of), 3)
        store = ("memory://", "rocksdb://")[run % 2]
        bound_s = ENGINE_LEASE_S + DEAD_ANSWER_SLACK_S
        down_s = bound_s + 2.0  # the restarting engine stays dead past the bound, so the bound is tested on it too
        flow_s = 1.5 * o.live_s  # how long an engine that is never killed would take to publish its batches
        n = {name: len(b) for name, b in batches_of.items()}
        app_id = _fresh_app_id("engine-crash", run)
        started = time.monotonic()
        with self.env(f"engine-crash-{run}") as env:
            workers = [env.worker(f"worker-{i}", app_id, store=store, source_lease_s=ENGINE_LEASE_S,
                                  source_expiry_s=0.0)  # 0: never; the dead engine's rows stay for the table check
                       for i in (1, 2)]
            for worker in workers:
                worker.wait_ready(o.timeout_s)
            watch = _DeadEngineWatch([w.url for w in workers])
            ports = {name: (broker.free_port(), broker.free_port()) for name in sorted(batches_of)}
            engines = {
                restarting: _Engine(restarting, batches_of[restarting], ports[restarting], watch,
                                    pace_s=flow_s / n[restarting], down_s=down_s,
                                    kill_after=max(1, int(rng.uniform(0.25, 0.5) * n[restarting]))),
                dying: _Engine(dying, batches_of[dying], ports[dying], watch, pace_s=flow_s / n[dying],
                               kill_after=max(1, int(rng.uniform(0.3, 0.7) * n[dying]))),
                # paced to publish until the restarted engine is back and publishing: events flow throughout
                surviving: _Engine(surviving, batches_of[surviving], ports[surviving], watch,
                                   pace_s=(flow_s + down_s) / n[surviving]),
            }
            names = sorted(engines)
            log_file = env.dir / "bridge.log"
            command = [sys.executable, "-m", "kvstream.cli", "bridge", "--bootstrap-servers", env.bootstrap,
                       "--partitions", str(o.partitions), "--state-file", str(env.dir / "bridge-state.json"),
                       "--heartbeat-interval-s", str(ENGINE_HEARTBEAT_S),
                       "--heartbeat-probe-timeout-s", str(ENGINE_PROBE_TIMEOUT_S)]
            for name in names:
                command += ["--endpoint", f"tcp://127.0.0.1:{ports[name][0]}",
                            "--replay-endpoint", f"tcp://127.0.0.1:{ports[name][1]}", "--instance-id", name]
            self.log(f"      engines {restarting} (killed after {engines[restarting].kill_after} of "
                     f"{n[restarting]} batches, back {down_s:.0f}s later), {dying} (killed after "
                     f"{engines[dying].kill_after} of {n[dying]}), {surviving} (runs throughout); lease "
                     f"{ENGINE_LEASE_S:g}s, heartbeats every {ENGINE_HEARTBEAT_S:g}s; store {store}")
            try:
                for engine in engines.values():
                    engine.bind()
                bridge = _start_bridge(env, command, log_file, o.timeout_s)
                watch.start()
                for engine in engines.values():
                    engine.start()
                for engine in engines.values():
                    engine.join(o.timeout_s)
                    if engine.error:
                        raise RuntimeError(f"engine {engine.engine}: {engine.error}")
                # the engine killed for good is watched past the bound before the final answers are read
                kill = watch.kill_of(dying)
                time.sleep(max(0.0, kill.killed_at + bound_s + 1.0 - time.monotonic()))
                watch.stop()
                published = {name: e.incarnations for name, e in engines.items()}
                live_truth = naive_residency([b for name in (restarting, surviving)
                                              for b in published[name][-1]])
                delivery = _engine_delivery(read_topic(env.bootstrap), published, {dying}, o.partitions)
                stored = {h.to_bytes(8, "big") for processes in published.values() for batches in processes
                          for b in batches for e in b.events if e["type"] == "BlockStored" for h in e["block_hashes"]}
                final = _final_answers(workers, live_truth, delivery["table_truth"],
                                       {name: name != dying for name in names}, sorted(stored), settle_s=30.0)
                check = check_residency(env.bootstrap, app_id, delivery["table_truth"])
                _explain(workers[0], check)
                bridge.send_signal(signal.SIGTERM)
                bridge.wait(60)
            finally:
                watch.stop()
                for engine in engines.values():
                    engine.close()
            duplicates = sum((w.stats() or {}).get("duplicates", 0) for w in workers)
        kills = [k.summary(bound_s) for k in watch.kills]
        named_s = max((k["named_for_s"] for k in kills), default=None)
        old_named = watch.kill_of(restarting).old_named_s
        self.log(f"      dead engines named up to {named_s}s after their kill (bound {bound_s:g}s); final answers "
                 f"{'equal' if final['equal'] else 'DIFFER from'} the live truth on {final['blocks_asked']:,} "
                 f"blocks x {len(workers)} workers ({final['rounds']} rounds, {final['seconds']}s)")
        checks = {
            "no answer named a dead engine for more than its lease + 5 s": all(
                k["named_for_s"] <= bound_s for k in kills),
            "every dead engine was watched past the bound": all(k["watched_for_s"] > bound_s for k in kills),
            "every killed engine was named after its kill until its lease lapsed (the watch asks what it held)":
                all(k["named_after_kill"] for k in kills),
            ("after the restart, no answer named the engine for a block its killed process held and the new one "
             "had not stored (some were asked)"): old_named is None and watch.kill_of(restarting).old_asked > 0,
            "GET /workers: the engines alive at the end live, the dead one not": final["live_flags_equal"],
            "each engine process is one epoch in kv-events (the restart found, nothing else taken for one)":
                delivery["epochs_match"],
            "nothing but the killed engines' unsent last batches is missing from kv-events": delivery["lost"] == 0,
            "no gap reported (SourceStale)": delivery["source_events"].get("SourceStale", 0) == 0,
        }
        entry = _run_result(run, check, delivery["produced"], delivery["in_topic"], time.monotonic() - started,
                            checks=checks, lost_in_topic=delivery["lost"], app_id=app_id, store=store,
                            source_lease_s=ENGINE_LEASE_S, heartbeat_interval_s=ENGINE_HEARTBEAT_S,
                            dead_engine_named_s=named_s, dead_engine_bound_s=bound_s, kills=kills,
                            old_blocks_named_after_restart_s=old_named,
                            engines={name: {"role": "restarted" if name == restarting else "killed"
                                            if name == dying else "survives", "batches": n[name],
                                            "published_per_process": [len(i) for i in published[name]]}
                                     for name in names},
                            final_answers={k: v for k, v in final.items() if k != "equal"},
                            table_matches_truth=check.matches, tail_lost_with_engine=delivery["tail"],
                            epochs=delivery["epochs"], source_events=delivery["source_events"],
                            watch={"asked": watch.asked, "errors": watch.errors,
                                   "error_examples": watch.error_examples[:5]},
                            duplicates_ignored=duplicates)
        entry["matches_truth"] = final["equal"] and check.matches
        entry["passed"] = entry["matches_truth"] and all(checks.values())
        return entry


#: Kinds of ``kv_event`` that carry an engine batch's block events (the rest are the bridge's source events).
_BLOCK_EVENT_KINDS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


def _engine_delivery(values: list[bytes], published: dict[str, list[list[Batch]]], killed_for_good: set[str],
                     partitions: int) -> dict:
    """What of the engines' batches reached kv-events (``values``), per engine process.

    Args:
        published: engine -> per process, the batches it published (index = seq). Every process but an engine's
            last was killed (it was restarted); so was the last one of the engines in ``killed_for_good``.

    Returns:
        ``{"produced", "in_topic", "lost", "tail", "epochs", "epochs_match", "source_events", "table_truth"}``:
        messages of every published batch; block-event messages in kv-events; messages missing but for the
        ``tail`` of killed processes (batches after the last one that reached kv-events: still queued in the PUB
        socket when it closed, they died with the engine); epochs per engine; whether each engine has one epoch
        per process; the bridge's source events by kind; and the residency the tables must hold
        (:func:`naive_residency` of each engine's last process, as far as it reached kv-events: a restarted
        engine's earlier processes are retired, the dead engine's rows stay).
    """
    codec = AvroCodec("kv_event")
    got: Counter = Counter()
    epochs: dict[str, set[int]] = {}
    source_events: Counter = Counter()
    for value in values:
        record = codec.decode(value)
        kind = record["event"][0].rsplit(".", 1)[-1]
        if kind in _BLOCK_EVENT_KINDS:
            got[(record["instance_id"], record["publisher_epoch"], record["seq"])] += 1
            epochs.setdefault(record["instance_id"], set()).add(record["publisher_epoch"])
        else:
            source_events[kind] += 1
    produced = lost = tail = 0
    table_batches: list[Batch] = []
    for engine, processes in published.items():
        engine_epochs = sorted(epochs.get(engine, ()))  # epochs grow: the bridge's clock at each new process
        for number, batches in enumerate(processes):
            last_process = number == len(processes) - 1
            killed = not last_process or engine in killed_for_good
            epoch = engine_epochs[number] if number < len(engine_epochs) else None
            want = [message_count([r for i, e in enumerate(b.events)
                                   for r in split_event(b.publisher, seq, b.ts, i, e)], partitions)
                    for seq, b in enumerate(batches)]
            have = [got[(engine, epoch, seq)] for seq in range(len(batches))]
            produced += sum(want)
            last_delivered = max((seq for seq, n in enumerate(have) if n), default=-1)
            for seq, (w, h) in enumerate(zip(want, have)):
                if killed and seq > last_delivered:
                    tail += w
                else:
                    lost += max(w - h, 0)
            if last_process:
                table_batches += [b for seq, b in enumerate(batches) if have[seq]]
    return {"produced": produced, "in_topic": sum(got.values()), "lost": lost, "tail": tail,
            "epochs": {engine: len(e) for engine, e in sorted(epochs.items())},
            "epochs_match": all(len(epochs.get(engine, ())) == len(processes)
                                for engine, processes in published.items()),
            "source_events": dict(sorted(source_events.items())), "table_truth": naive_residency(table_batches)}


def _final_answers(workers: list[Worker], live_truth: dict, table_truth: dict, live: dict[str, bool],
                   blocks: list[bytes], settle_s: float) -> dict:
    """Every worker's final answers against the truth, retried for up to ``settle_s`` seconds while the last
    events reach every worker's fleet index.

    First ``GET /workers`` until, on every worker, each engine's resident blocks per tier equal ``table_truth``'s
    (the index holds what the tables hold, the dead engine's rows included) and its ``live`` flag equals
    ``live``; then ``POST /prefix-match/`` of every block any engine stored, one block per request, whose
    holders and their tiers must be exactly ``live_truth``'s (what the engines alive at the end hold).

    Args:
        live_truth, table_truth: residency as :func:`naive_residency` gives it.
        live: engine -> whether it is alive at the end.
        blocks: the canonical hashes (8 bytes) to ask about: every block any engine process stored.

    Returns:
        ``{"equal", "live_flags_equal", "counts_equal", "blocks_asked", "wrong_blocks", "examples", "rounds",
        "seconds", "workers_view"}``: ``equal`` when the live flags and every block's answer are right;
        ``counts_equal`` whether ``GET /workers``' blocks per tier equal the table truth's (said, not judged: the
        residency table is compared row by row apart); ``examples`` (up to 10) give a wrong block's worker, hash,
        expected and answered ``{instance: tiers}``; ``workers_view`` each worker's last ``live`` flags.

    Raises:
        kvstream.client.IndexQueryError: a worker answered a lookup 4xx or 5xx. OSError: a worker did not answer.
    """
    started = time.monotonic()
    deadline = started + settle_s
    expected_counts: dict[str, Counter] = {engine: Counter() for engine in live}
    # the index holds one (block, holder) per ownership and tier: locality and group are not in it
    for engine, tier, _, _ in {(i[0], i[2], i[3], i[6]) for i in table_truth}:
        expected_counts[engine][tier] += 1
    views: dict = {}
    while True:
        views = {}
        for worker in workers:
            status, body = http_json(f"{worker.url}/workers")
            rows = body.get("workers", []) if status == 200 else []
            views[worker.url] = {r["instance_id"]: {"live": r["live"], "blocks": r["blocks"]} for r in rows}
        flags_equal = all(view.get(engine, {}).get("live") == alive for view in views.values()
                          for engine, alive in live.items())
        counts_equal = all(Counter(view.get(engine, {}).get("blocks", {})) == expected_counts[engine]
                           for view in views.values() for engine in live)
        if (flags_equal and counts_equal) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    by_block: dict[bytes, dict[str, set]] = {}
    for engine, _, tier, _, _, _, block in live_truth:
        by_block.setdefault(block, {}).setdefault(engine, set()).add(tier)
    blocks = sorted(set(blocks) | {i[6] for i in table_truth} | set(by_block))
    rounds = 0
    while True:
        rounds += 1
        wrong: list[dict] = []
        for worker in workers:
            with IndexClient(worker.url, timeout_s=30) as client:
                for block in blocks:
                    matches = client.prefix_match([block])["matches"]
                    got = {m["instance_id"]: set(m["prefix_blocks"]) for m in matches}
                    if got != by_block.get(block, {}):
                        wrong.append({"worker": worker.url, "block": block.hex(),
                                      "expected": {k: sorted(v) for k, v in by_block.get(block, {}).items()},
                                      "answered": {k: sorted(v) for k, v in got.items()}})
        if not wrong or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    return {"equal": not wrong and flags_equal, "live_flags_equal": flags_equal, "counts_equal": counts_equal,
            "blocks_asked": len(blocks), "wrong_blocks": len(wrong), "examples": wrong[:10], "rounds": rounds,
            "seconds": round(time.monotonic() - started, 1),
            "workers_view": {url: {e: v.get("live") for e, v in view.items()} for url, view in views.items()}}
