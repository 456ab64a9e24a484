"""The engine-crash scenario: engines killed behind one bridge, and what the answers of the workers and of a
``kvstream index`` and the workers' table say of them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from chaos.checks import _explain, _run_result, check_residency
from chaos.engines import _DeadEngineWatch, _Engine, percentile
from chaos.env import RunEnv, Worker, _fresh_app_id, _start_bridge, _wait_for, http_json
from chaos.workload import message_count, naive_residency
from kafka_io.reader import messages_to_end
from kvstream import broker
from kvstream.client import IndexClient, IndexQueryError
from producers.simulator import Batch, ClusterSimulator, FleetConfig, load_trace
from producers.split import split_event
from producers.trace import TRACE_BLOCK_SIZE, Request, block_hash_of, trace_request_tokens
from schemas import SOURCE_DISCONNECTED, AvroCodec
from schemas.topics import KV_EVENTS

#: engine-crash: the workers' ``--source-lease-s``, seconds. Short, so that a run sees leases lapse; the other
#: scenarios keep a day's lease on purpose (their sources publish once and are checked long after).
ENGINE_LEASE_S = 3.0
#: engine-crash: the bridge's ``--heartbeat-interval-s`` and ``--heartbeat-probe-timeout-s``, seconds: well below
#: the lease, so a live idle engine never lapses between two heartbeats.
ENGINE_HEARTBEAT_S = 0.5
ENGINE_PROBE_TIMEOUT_S = 0.5
#: engine-crash: how much longer than its lease an answer may still name a dead engine whose bridge died too, seconds
#: (issue 26: the lease is the backstop).
DEAD_ANSWER_SLACK_S = 5.0
#: engine-crash: how soon after its kill every answer must be free of an engine whose bridge lives, seconds (issue 49:
#: the bridge's SourceDisconnected, read by every index from kv-events), as the p99 over the answers.
FAST_DOWN_BOUND_S = 1.0
#: engine-crash: how soon after a blip (its connection dropped, the process lives on) the surviving engine's blocks
#: must answer again, seconds: a reconnect, the replay on connect and the bridge's heartbeat.
BLIP_BACK_BOUND_S = 3.0
#: engine-crash: how long the blip's answers are watched, seconds.
BLIP_WATCH_S = 6.0
#: engine-crash: blocks of the surviving engine asked about after the blip.
BLIP_BLOCKS = 20
#: engine-crash: ``POST /query`` asks by the tokens of requests at most this many blocks long.
QUERY_BLOCKS = 4


class EngineCrash:
    """The engine-crash scenario.

    A mixin of :class:`chaos.scenarios.Chaos`: it uses the run's options, workload, ``env`` and ``rng``.
    """

    def engine_crash(self, run: int) -> dict:
        """Three engines publish through ``kvstream bridge`` into two workers and a ``kvstream index`` with a short
        lease: one is killed and comes back as a new process, one is killed for good, one runs throughout. With
        their bridge alive, every answer must be free of a killed engine within :data:`FAST_DOWN_BOUND_S` of its
        kill (p99 over the answers) and stay so while it is dead; the surviving engine's connection then drops for
        a moment (a blip) and its blocks must answer again within :data:`BLIP_BACK_BOUND_S`; the final answers
        must name exactly the blocks the engines alive at the end hold. Last, the bridge is killed and then the
        surviving engine: no answer may name it longer than its lease plus :data:`DEAD_ANSWER_SLACK_S` (the
        backstop)."""
        o = self.options
        rng = self.rng("engine-crash", run)
        fleet = FleetConfig(instances=3, tp_instances=(), clear_instance=rng.randrange(3), clear_at=0.6,
                            gpu_blocks=600, cpu_blocks=900, kvcr_blocks=1200)
        requests = load_trace(limit=o.requests)
        batches_of: dict[str, list[Batch]] = {}
        for batch in ClusterSimulator(fleet).run(requests):
            batches_of.setdefault(batch.publisher.instance_id, []).append(batch)
        restarting, dying, surviving = rng.sample(sorted(batches_of), 3)
        store = ("memory://", "rocksdb://")[run % 2]
        bound_s = ENGINE_LEASE_S + DEAD_ANSWER_SLACK_S
        down_s = bound_s + 2.0  # the restarting engine stays dead past the lease's bound too
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
            index_url = _start_index(env, app_id, o.timeout_s)
            answerers = [w.url for w in workers] + [index_url]
            watch = _DeadEngineWatch(answerers, queries=token_queries(requests))
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
                       "--heartbeat-probe-timeout-s", str(ENGINE_PROBE_TIMEOUT_S),
                       "--block-size", str(TRACE_BLOCK_SIZE)]  # registered: POST /query cuts tokens in their blocks
            for name in names:
                command += ["--endpoint", f"tcp://127.0.0.1:{ports[name][0]}",
                            "--replay-endpoint", f"tcp://127.0.0.1:{ports[name][1]}", "--instance-id", name]
            self.log(f"      engines {restarting} (killed after {engines[restarting].kill_after} of "
                     f"{n[restarting]} batches, back {down_s:.0f}s later), {dying} (killed after "
                     f"{engines[dying].kill_after} of {n[dying]}), {surviving} (runs throughout, a blip at its "
                     f"end, then killed with the bridge); lease {ENGINE_LEASE_S:g}s, heartbeats every "
                     f"{ENGINE_HEARTBEAT_S:g}s; store {store}; answers of 2 workers and a kvstream index")
            backstop = None
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
                # the engine killed for good is watched past the lease's bound before the final answers are read:
                # it must not come back once it has left, whatever its lease does
                kill = watch.kill_of(dying)
                time.sleep(max(0.0, kill.killed_at + bound_s + 1.0 - time.monotonic()))
                watch.stop()
                blip = _blip(engines[surviving], answerers)
                published = {name: e.incarnations for name, e in engines.items()}
                live_truth = naive_residency([b for name in (restarting, surviving)
                                              for b in published[name][-1]])
                messages = [(m.value(), m.timestamp()[1]) for m in messages_to_end(env.bootstrap, KV_EVENTS, 120.0)]
                delivery = _engine_delivery([value for value, _ in messages], published, {dying}, o.partitions)
                said_down = _said_down(messages, [(k.engine, k.killed_wall) for k in watch.kills]
                                       + [(surviving, blip["dropped_wall"])])
                stored = {h.to_bytes(8, "big") for processes in published.values() for batches in processes
                          for b in batches for e in b.events if e["type"] == "BlockStored" for h in e["block_hashes"]}
                final = _final_answers(workers, live_truth, delivery["table_truth"],
                                       {name: name != dying for name in names}, sorted(stored), settle_s=30.0)
                check = check_residency(env.bootstrap, app_id, delivery["table_truth"])
                _explain(workers[0], check)
                backstop = _backstop(bridge, engines[surviving], answerers, watch.queries, bound_s)
            finally:
                watch.stop()
                for engine in engines.values():
                    engine.close()
            duplicates = sum((w.stats() or {}).get("duplicates", 0) for w in workers)
        kills = [{**k.summary(FAST_DOWN_BOUND_S), "said_down_after_s": s} for k, s in zip(watch.kills, said_down)]
        blip["said_down_after_s"] = said_down[-1]
        free = [s for k in watch.kills for s in k.free_after_s()]
        free_p99, free_max = percentile(free, 0.99), max(free, default=None)
        named_s = max((k["named_for_s"] for k in kills), default=None)
        old_named = watch.kill_of(restarting).old_named_s
        asked_apis = [{answer.split(" http")[0] for answer in k.answers} for k in watch.kills]
        self.log(f"      with the bridge alive, every answer free of a killed engine {free_p99}s after its kill "
                 f"(p99; max {free_max}s over {len(free)} answers; bound {FAST_DOWN_BOUND_S:g}s); the blip's "
                 f"blocks back after {blip['back_s']}s; with the bridge killed too, named up to "
                 f"{backstop['named_for_s']}s (bound {bound_s:g}s); final answers "
                 f"{'equal' if final['equal'] else 'DIFFER from'} the live truth on {final['blocks_asked']:,} "
                 f"blocks x {len(workers)} workers ({final['rounds']} rounds, {final['seconds']}s)")
        checks = {
            (f"with the bridge alive, every answer (GET /workers, POST /prefix-match/, /query_by_hash, /query of both "
             f"workers and the index) was free of a killed engine within {FAST_DOWN_BOUND_S:g} s of its kill (p99 "
             f"over the answers), and stayed so while it was dead"):
                free_p99 is not None and free_p99 <= FAST_DOWN_BOUND_S,
            "every killed engine was named just before its kill (POST /prefix-match/ and POST /query)": all(
                all(e.named_before_kill.values()) and e.named_before_kill for e in (engines[restarting],
                                                                                    engines[dying])),
            "every answerer was asked every API about every killed engine": all(
                apis == {"GET /workers", "POST /prefix-match/", "POST /query_by_hash", "POST /query"}
                and len(k.answers) == 4 * len(answerers) for apis, k in zip(asked_apis, watch.kills)),
            "every dead engine was watched past its lease + 5 s": all(k["watched_for_s"] > bound_s for k in kills),
            (f"after a blip (its connection dropped, the process lived on), the engine's blocks answered again within "
             f"{BLIP_BACK_BOUND_S:g} s"): blip["back_s"] is not None and blip["back_s"] <= BLIP_BACK_BOUND_S,
            (f"with its bridge killed too, an engine left every answer within its lease + {DEAD_ANSWER_SLACK_S:g} s "
             f"(the backstop), named until its lease lapsed"): (
                backstop["named_for_s"] <= bound_s and backstop["named_after_kill"]
                and backstop["watched_for_s"] > bound_s),
            ("after the restart, no answer named the engine for a block its killed process held and the new one "
             "had not stored (some were asked)"): old_named is None and watch.kill_of(restarting).old_asked > 0,
            "GET /workers: the engines alive at the end live, the dead one not": final["live_flags_equal"],
            "each engine process is one epoch in kv-events (the restart found, the blip not taken for one)":
                delivery["epochs_match"],
            "every kill and the blip were said down in kv-events (SourceDisconnected)":
                delivery["source_events"].get("SourceDisconnected", 0) >= 3 * o.partitions,
            "nothing but the killed engines' unsent last batches is missing from kv-events": delivery["lost"] == 0,
            "no gap reported (SourceStale)": delivery["source_events"].get("SourceStale", 0) == 0,
        }
        entry = _run_result(run, check, delivery["produced"], delivery["in_topic"], time.monotonic() - started,
                            checks=checks, lost_in_topic=delivery["lost"], app_id=app_id, store=store,
                            source_lease_s=ENGINE_LEASE_S, heartbeat_interval_s=ENGINE_HEARTBEAT_S,
                            answerers={"workers": [w.url for w in workers], "index": index_url},
                            dead_engine_free_p99_s=None if free_p99 is None else round(free_p99, 3),
                            dead_engine_free_max_s=None if free_max is None else round(free_max, 3),
                            dead_engine_free_after_s=[round(s, 3) for s in free],
                            dead_engine_named_s=named_s, dead_engine_bound_s=FAST_DOWN_BOUND_S, kills=kills,
                            named_before_kill={name: engines[name].named_before_kill for name in (restarting, dying)},
                            blip=blip, backstop=backstop, backstop_bound_s=bound_s,
                            old_blocks_named_after_restart_s=old_named,
                            engines={name: {"role": "restarted" if name == restarting else "killed"
                                            if name == dying else "survives, then killed with the bridge",
                                            "batches": n[name],
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


def token_queries(requests: list[Request], max_blocks: int = QUERY_BLOCKS) -> dict[bytes, list[int]]:
    """Canonical block hash -> the token ids of the shortest trace request prefix (at most ``max_blocks`` blocks)
    ending with it: ``POST /query`` of them names an engine that holds that prefix's chain."""
    queries: dict[bytes, list[int]] = {}
    for request in requests:
        for i, hash_id in enumerate(request.hash_ids[:max_blocks]):
            block = block_hash_of(hash_id).to_bytes(8, "big")
            if block not in queries or len(queries[block]) > (i + 1) * TRACE_BLOCK_SIZE:
                queries[block] = trace_request_tokens(request.hash_ids[:i + 1])
    return queries


def _said_down(messages: list[tuple[bytes, int]], outages: list[tuple[str, float]]) -> list[float | None]:
    """Per outage (engine, wall-clock time of its kill or blip), the seconds from it to the bridge's first
    ``SourceDisconnected`` of the engine produced after it (the record's CreateTime, the bridge's clock: the same
    host): the bridge's part of the time the answers took; None: none found."""
    codec = AvroCodec("kv_event")
    said: dict[str, list[float]] = {}
    for value, created_ms in messages:
        record = codec.decode(value)
        if record["event"][0] == SOURCE_DISCONNECTED:
            said.setdefault(record["instance_id"], []).append(created_ms / 1000)
    found = []
    for engine, at in outages:
        later = [t for t in said.get(engine, ()) if t >= at - 0.01]
        found.append(round(min(later) - at, 3) if later else None)
    return found


def _start_index(env: RunEnv, app_id: str, timeout_s: float) -> str:
    """Start ``kvstream index`` on the workers' app id with their lease, a child of ``env`` (log
    ``<run dir>/index.log``); returns its URL once it answers (it has read the changelog's end)."""
    port = broker.free_port()
    log_file = env.dir / "index.log"
    with open(log_file, "ab") as out:
        child = subprocess.Popen([sys.executable, "-m", "kvstream.cli", "index", "--bootstrap-servers", env.bootstrap,
                                  "--app-id", app_id, "--web-port", str(port), "--source-lease-s",
                                  str(ENGINE_LEASE_S)], stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    env.children.append(child)
    url = f"http://127.0.0.1:{port}"

    def ready():
        if child.poll() is not None:
            raise RuntimeError(f"kvstream index exited with code {child.returncode}:\n"
                               + Path(log_file).read_text(errors="replace")[-2000:])
        try:
            status, body = http_json(f"{url}/workers", timeout_s=5)
        except OSError:
            return False
        return status == 200 and body.get("ready", True)

    _wait_for(ready, timeout_s, "kvstream index did not answer")
    return url


def _blip(engine: _Engine, answerers: list[str]) -> dict:
    """Drop the (idle, alive) engine's connections for a moment (:meth:`FakeVllmPublisher.drop_connections`: its
    PUB socket closed and bound again, the process and its replay buffer untouched) and watch every answerer's
    ``GET /workers`` and ``POST /prefix-match/`` of :data:`BLIP_BLOCKS` blocks it holds for :data:`BLIP_WATCH_S`.

    Returns:
        ``{"engine", "blocks_asked", "asked", "left_answers", "out_first_s", "back_s", "errors"}``: whether an
        answer left it out at all, and when first; ``back_s`` the seconds after the drop from which every answer
        named it again (None: some answer still left it out at the end).
    """
    held = sorted({identity[6] for identity in naive_residency(engine.incarnations[-1])})
    step = max(1, len(held) // BLIP_BLOCKS)
    blocks = held[::step][:BLIP_BLOCKS]
    clients = {url: IndexClient(url, timeout_s=10) for url in answerers}
    dropped_at, dropped_wall = time.monotonic(), time.time()
    engine.publisher.drop_connections()
    asked = errors = 0
    out_first = last_out = None
    turn = 0
    try:
        while time.monotonic() - dropped_at < BLIP_WATCH_S:
            for url, client in clients.items():
                turn += 1
                try:
                    live = {w["instance_id"] for w in client.workers()["workers"] if w["live"]}
                    matches = client.prefix_match([blocks[turn % len(blocks)]])["matches"] if blocks else []
                except (IndexQueryError, OSError, ValueError):
                    errors += 1
                    continue
                now = time.monotonic() - dropped_at
                asked += 2
                if engine.engine not in live or (blocks and not any(m["instance_id"] == engine.engine
                                                                    for m in matches)):
                    out_first = now if out_first is None else out_first
                    last_out = now
            time.sleep(0.05)
    finally:
        for client in clients.values():
            client.close()
    back = 0.0 if last_out is None else last_out
    return {"engine": engine.engine, "blocks_asked": len(blocks), "asked": asked, "left_answers": last_out is not None,
            "out_first_s": None if out_first is None else round(out_first, 3),
            "back_s": None if last_out is not None and BLIP_WATCH_S - last_out < 1.0 else round(back, 3),
            "errors": errors, "dropped_wall": dropped_wall}


def _backstop(bridge: subprocess.Popen, engine: _Engine, answerers: list[str], queries: dict[bytes, list[int]],
              bound_s: float) -> dict:
    """Kill the bridge (SIGKILL, so it says nothing), then the engine it watched: only the lease can take the engine
    out of the answers. Watch them (:class:`_DeadEngineWatch`) past ``bound_s``; returns the kill's summary."""
    bridge.send_signal(signal.SIGKILL)
    bridge.wait(30)
    held = sorted({identity[6] for identity in naive_residency(engine.incarnations[-1])})
    watch = _DeadEngineWatch(answerers, queries=queries)
    engine.publisher.kill()
    engine.publisher = None
    watch.killed(engine.engine, time.monotonic(), held)
    watch.start()
    try:
        time.sleep(bound_s + 1.0)
    finally:
        watch.stop()
    return watch.kill_of(engine.engine).summary(bound_s)


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
