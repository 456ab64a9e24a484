"""The bridge-restart scenario: the bridge SIGKILLed mid-stream and restarted, with a replay buffer that covers the
outage and one too small for it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter

import msgspec

from chaos.checks import _run_result, check_residency, read_topic
from chaos.env import _consume, _fresh_app_id, _kill_group, _start_bridge, http_json
from chaos.workload import message_count, naive_residency
from harness.vllm_publisher import FakeVllmPublisher
from kvstream import broker
from producers.simulator import Batch, ClusterSimulator, FleetConfig, load_trace
from producers.split import split_event
from schemas import AvroCodec


class BridgeRestart:
    """The bridge-restart scenario.

    A mixin of :class:`chaos.scenarios.Chaos`: it uses the run's options, workload, ``env`` and ``rng``.
    """

    def bridge_restart(self, run: int) -> dict:
        """Kill the bridge mid-stream while the engine keeps publishing; restart it from its state file.

        Run 0 gives the publisher a replay buffer that covers the outage, run 1 one that does not.
        """
        o = self.options
        rng = self.rng("bridge-restart", run)
        fleet = FleetConfig(instances=1, tp_instances=(), clear_instance=0, clear_at=0.5, gpu_blocks=600,
                            cpu_blocks=900, kvcr_blocks=1200)
        sim = ClusterSimulator(fleet)
        batches = list(sim.run(load_trace(limit=o.requests)))
        if naive_residency(batches) != sim.ground_truth():
            raise AssertionError("naive replay of the one-instance simulation differs from its ground truth")
        instance = batches[0].publisher.instance_id
        records_of = {b.seq: [r for i, e in enumerate(b.events) for r in split_event(b.publisher, b.seq, b.ts, i, e)]
                      for b in batches}
        small_buffer = run % 2 == 1
        down_batches = 60
        buffer_steps = 20 if small_buffer else 10_000
        kill_after = rng.randint(len(batches) // 5, len(batches) // 2)
        pace_s = 0.01
        app_id = _fresh_app_id("bridge-restart", run)
        started = time.monotonic()
        with self.env(f"bridge-restart-{run}") as env:
            port, replay_port = broker.free_port(), broker.free_port()
            publisher = FakeVllmPublisher(port, replay_port, buffer_steps=buffer_steps)
            state_file = env.dir / "bridge-state.json"
            log_file = env.dir / "bridge.log"
            command = [sys.executable, "-m", "kvstream.cli", "bridge", "--bootstrap-servers", env.bootstrap,
                       "--endpoint", f"tcp://127.0.0.1:{port}", "--replay-endpoint",
                       f"tcp://127.0.0.1:{replay_port}", "--instance-id", instance, "--partitions",
                       str(o.partitions), "--state-file", str(state_file)]

            def start_bridge() -> subprocess.Popen:
                return _start_bridge(env, command, log_file, o.timeout_s)

            def publish(batch: Batch) -> None:
                publisher.publish_payload(msgspec.msgpack.encode([batch.ts, batch.events, 0]))
                time.sleep(pace_s)

            try:
                bridge = start_bridge()
                for batch in batches[:kill_after]:
                    publish(batch)
                time.sleep(rng.uniform(0.0, 0.5))
                _kill_group(bridge, signal.SIGKILL)
                saved = json.loads(state_file.read_text()) if state_file.exists() else {}
                saved_last = max((s["last_seq"] for s in saved.values()), default=None)
                for batch in batches[kill_after:kill_after + down_batches]:
                    publish(batch)
                oldest_at_restart = publisher.oldest_buffered_seq()
                published_at_restart = publisher.seq
                self.log(f"      bridge killed after {kill_after} batches (state file: last seq {saved_last}); "
                         f"{down_batches} published while down; buffer {buffer_steps} batches, oldest held "
                         f"{oldest_at_restart}; restarting")
                bridge = start_bridge()
                for batch in batches[kill_after + down_batches:]:
                    publish(batch)
                time.sleep(2.0)
                bridge.send_signal(signal.SIGTERM)
                bridge.wait(60)
            finally:
                publisher.close()
            values = read_topic(env.bootstrap)
            worker = env.worker("worker", app_id)
            _consume(env, worker, o.timeout_s)
            final = worker.stats() or {}
            sources = http_json(f"{worker.url}/sources/")[1].get("sources", [])
            worker.stop()
            source = next((s for s in sources if s["instance_id"] == instance), {})
            lost = set()
            if source.get("stale"):
                lost = set(range(source["first_lost_seq"], source["last_lost_seq"] + 1))
            # per seq: records in kv-events against the records of the batch (clears once per partition)
            codec = AvroCodec("kv_event")
            got = Counter()
            source_events = 0
            for value in values:
                record = codec.decode(value)
                kind = record["event"][0].rsplit(".", 1)[-1]
                if record["seq"] in records_of and kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
                    got[record["seq"]] += 1
                else:
                    source_events += 1
            want = {seq: message_count(records, o.partitions) for seq, records in records_of.items()}
            delivered = {seq for seq in want if got[seq] >= want[seq]}
            partial = sorted(seq for seq in want if 0 < got[seq] < want[seq])
            # the truth: every batch that reached kv-events (a batch of the reported gap may have been produced
            # before the kill, while the state file still named an older seq)
            truth = naive_residency(batches, set(want) - delivered)
            check = check_residency(env.bootstrap, app_id, truth)
        missing = sum(max(want[s] - got[s], 0) for s in want if s not in lost)
        surplus = sum(max(got[s] - want[s], 0) for s in want)
        in_gap = sum(want[s] - got[s] for s in lost if s not in delivered)
        recoverable = set(range(saved_last + 1 if saved_last is not None else 0, oldest_at_restart or 0))
        checks = {
            "everything outside the reported gap is in kv-events": missing == 0,
            "a gap is reported exactly when the buffer could not cover the outage":
                bool(lost) == bool(recoverable) and bool(lost) == small_buffer,
            "no batch is in kv-events only in part": not partial,
        }
        if lost:
            checks["the gap starts right after the bridge's saved seq"] = min(lost) == saved_last + 1
            checks["the gap ends before what the buffer held at the restart"] = max(lost) + 1 >= oldest_at_restart
            checks["nothing published after the restart is in the gap"] = max(lost) < published_at_restart
            checks["GET /sources/ marks the source stale with one gap"] = bool(source.get("stale")) and \
                source.get("gaps") == 1
        produced = sum(want.values())
        return _run_result(run, check, produced, len(values), time.monotonic() - started, checks=checks,
                           lost_in_topic=missing, app_id=app_id, buffer_steps=buffer_steps, batches=len(batches),
                           killed_after_batches=kill_after, state_file_last_seq=saved_last,
                           published_while_down=down_batches, oldest_buffered_at_restart=oldest_at_restart,
                           reported_gap=[min(lost), max(lost)] if lost else None, events_in_reported_gap=in_gap,
                           gap_batches_in_kv_events=sorted(lost & delivered), partial_batches=partial[:10],
                           topic_surplus=surplus, source_events=source_events,
                           source={k: source.get(k) for k in ("stale", "first_lost_seq", "last_lost_seq", "gaps",
                                                              "restarts", "publisher_epoch", "last_seq")},
                           duplicates_ignored=final.get("duplicates"))
