"""The index step's freshness part: from an engine's batch to the index's answer, beside a floor in the same run.

A vLLM-protocol publisher (``harness.vllm_publisher``, in a process of its own) publishes BlockStored events at a
steady rate, and, a few seconds later, the BlockRemoved of each block, so the fleet holds a steady number. Two
subscribers read the same PUB socket:

* ``kvstream bridge`` into ``kv-events``, then a worker (``kvstream worker``) and an index replica (a
  :class:`~stream_apps.index.fleet_index.FleetIndex` with both of ``kvstream index``'s feeds, in the replica
  process): the replica notes when each block event was applied;
* the floor, in the replica process: a minimal SUB socket that reads the batches into a dict.

Both delays are measured from the batch's timestamp (the publisher's wall clock when it sent the batch) on one
machine: publish → visible in the index, and publish → in the floor's dict. The ratio of the two is the figure
that does not move with the machine. The worker's own index is measured by its ``GET /metrics`` freshness
histogram (the same definition, bucketed).

``python -m bench.freshness publish ...`` is the publisher process.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

#: Block events per second of the two runs (the issue's rates), and their seconds of warm-up and measure.
RATES = (2000, 10_000)
WARMUP_S, MEASURE_S, QUICK_MEASURE_S = 5.0, 20.0, 6.0
#: Blocks per BlockStored (one request's new blocks) and tokens per block.
BLOCKS_PER_EVENT, BLOCK_TOKENS = 16, 16
#: Seconds a block stays stored before the publisher removes it.
HOLD_S = 3.0
_U64 = (1 << 64) - 1

#: Figures of the part (merged into bench.run.DEFINITIONS through bench.index_bench).
FRESHNESS_DEFINITIONS: dict[str, dict] = {
    "index_freshness_p50_ms": {
        "unit": "ms", "target": 10, "better": "lower", "baseline": "index_freshness_floor_p50_ms",
        "definition": "2,000 block events/s from a vLLM-protocol ZMQ publisher (BlockStored of 16 blocks, each "
                      "removed 3 s later) through kvstream bridge into kv-events, with a worker running: per block "
                      "event of the measured window, the wall time an index replica (FleetIndex with kvstream "
                      "index's changelog and kv-events feeds, in another process) applied it, minus the batch's "
                      "timestamp (the publisher's clock at send). Median."},
    "index_freshness_p99_ms": {
        "unit": "ms", "target": 50, "better": "lower", "baseline": "index_freshness_floor_p99_ms",
        "definition": "99th percentile of index_freshness_p50_ms's delays."},
    "index_freshness_floor_p50_ms": {
        "unit": "ms", "target": None, "better": "lower", "baseline": None,
        "definition": "The floor of index_freshness_p50_ms, same run: a minimal SUB socket on the same publisher, "
                      "in the replica's process, reading each batch into a dict: its receive time minus the "
                      "batch's timestamp. Median."},
    "index_freshness_floor_p99_ms": {
        "unit": "ms", "target": None, "better": "lower", "baseline": None,
        "definition": "99th percentile of index_freshness_floor_p50_ms's delays."},
    "index_freshness_10k_p99_ms": {
        "unit": "ms", "target": 100, "better": "lower", "baseline": "index_freshness_10k_floor_p99_ms",
        "definition": "As index_freshness_p99_ms at 10,000 block events/s. details: p50, and the worker's."},
    "index_freshness_10k_floor_p99_ms": {
        "unit": "ms", "target": None, "better": "lower", "baseline": None,
        "definition": "As index_freshness_floor_p99_ms at 10,000 block events/s."},
    "index_freshness_vs_floor_p99": {
        "unit": "ratio", "target": None, "better": "lower", "baseline": None,
        "definition": "index_freshness_p99_ms / index_freshness_floor_p99_ms (2,000 events/s)."},
}


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(delays: list[float]) -> dict:
    ordered = sorted(delays)
    return {"samples": len(ordered), "p50_ms": round(_percentile(ordered, 0.5) * 1000, 2),
            "p99_ms": round(_percentile(ordered, 0.99) * 1000, 2), "max_ms": round(ordered[-1] * 1000, 2)}


# --------------------------------------------------------------------------- the publisher process

def publish(port: int, replay_port: int, rate: int, seconds: float, start_at: float) -> None:
    """Publish ``rate`` block events/s for ``seconds`` from ``start_at`` (wall clock): BlockStored of
    :data:`BLOCKS_PER_EVENT` blocks, each removed :data:`HOLD_S` later; each batch stamped with its send time."""
    from harness.vllm_publisher import BlockRemoved, BlockStored, FakeVllmPublisher

    publisher = FakeVllmPublisher(port, replay_port)
    rng = random.Random(port)
    held: list[tuple[float, list[int]]] = []
    per_s = rate / BLOCKS_PER_EVENT / 2  # a store and, later, its removal per event
    time.sleep(max(0.0, start_at - time.time()))
    began = time.perf_counter()
    sent = 0
    while time.perf_counter() - began < seconds:
        due = int((time.perf_counter() - began) * per_s)
        while sent < due:
            hashes = [rng.getrandbits(64) for _ in range(BLOCKS_PER_EVENT)]
            tokens = [rng.randrange(1, 50_000) for _ in range(BLOCKS_PER_EVENT * BLOCK_TOKENS)]
            events = [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens,
                                  block_size=BLOCK_TOKENS, lora_id=None, medium="GPU", lora_name=None)]
            now = time.time()
            if held and held[0][0] <= now:
                events.append(BlockRemoved(block_hashes=held.pop(0)[1], medium="GPU"))
            held.append((now + HOLD_S, hashes))
            publisher.publish(events, ts=time.time())
            sent += 1
        time.sleep(0.001)
    time.sleep(2.0)
    publisher.close()


# --------------------------------------------------------------------------- the replica and the floor

def replica(bootstrap: str, app_id: str, prefix: str, pub_port: int, measure_from: float, connection) -> None:
    """The replica process: the floor's SUB socket and the index with both feeds; "ready" once caught up, then,
    on "stop", the delays (s) of both for the block events stamped from ``measure_from`` on."""
    import msgspec
    import zmq

    from schemas.topics import TopicNames
    from stream_apps.index.fleet_index import FleetIndex
    from stream_apps.index.liveness import SourceLeases
    from stream_apps.index.server import open_events_feed, open_feed

    floor: dict[int, float] = {}
    floor_delays: list[float] = []
    stop = threading.Event()

    def subscribe() -> None:
        socket = zmq.Context.instance().socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.setsockopt(zmq.RCVTIMEO, 100)
        socket.connect(f"tcp://127.0.0.1:{pub_port}")
        while not stop.is_set():
            try:
                _, _, payload = socket.recv_multipart()
            except zmq.Again:
                continue
            received = time.time()
            ts, events = msgspec.msgpack.decode(payload)[:2]
            for event in events:
                for block_hash in event.get("block_hashes") or ():
                    floor[block_hash] = received
                    if ts >= measure_from:
                        floor_delays.append(received - ts)
        socket.close(0)

    topics = TopicNames(app_id, prefix)
    # a second baseline: a bare librdkafka consumer of the same kv-events, the Kafka hop without kvstream's code
    kafka_delays: list[float] = []
    bridge_delays: list[float] = []

    def consume_bare() -> None:
        from confluent_kafka import OFFSET_END, Consumer, TopicPartition

        from kafka_io.config import client_config
        from kafka_io.reader import take_available
        from schemas import AvroCodec

        codec = AvroCodec("kv_event")
        consumer = Consumer(client_config(bootstrap, **{"group.id": "bench-fresh-bare", "enable.auto.commit": False}))
        partitions = consumer.list_topics(topics.kv_events, timeout=10).topics[topics.kv_events].partitions
        consumer.assign([TopicPartition(topics.kv_events, p, OFFSET_END) for p in partitions])
        while not stop.is_set():
            for message in take_available(consumer, 1000, 0.1):
                if message.error() is not None:
                    continue
                received = time.time()
                ts = codec.decode(message.value())["ts"]
                if ts >= measure_from:
                    produced = message.timestamp()[1] / 1000
                    bridge_delays.append(produced - ts)
                    kafka_delays.append(received - produced)
        consumer.close()

    index = FleetIndex()
    index.leases = SourceLeases(86400.0)
    feed = open_feed(index, bootstrap, topics)
    events = open_events_feed(index, bootstrap, topics)
    index_delays: list[float] = []
    events.on_applied = lambda now, stamps: index_delays.extend(now - ts for ts in stamps if ts >= measure_from)
    threading.Thread(target=subscribe, daemon=True).start()
    threading.Thread(target=consume_bare, daemon=True).start()
    feed.start_thread()
    events.start_thread()
    connection.send("ready" if feed.wait_caught_up(300) else "; ".join(feed.not_ready()))
    connection.recv()
    stop.set()
    events.close()
    feed.close()
    connection.send({"index": index_delays, "floor": floor_delays, "fresh": vars(index.fresh.counters),
                     "records": events.records, "bridge": bridge_delays, "kafka": kafka_delays})


# --------------------------------------------------------------------------- the part

def _worker_freshness(base: str) -> dict | None:
    """The worker's freshness histogram from its ``GET /metrics`` (``kvstream_index_freshness_seconds``)."""
    try:
        text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    except OSError:
        return None
    buckets, count = [], 0.0
    for line in text.splitlines():
        if line.startswith("kvstream_index_freshness_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
        elif line.startswith("kvstream_index_freshness_seconds_count "):
            count = float(line.rsplit(" ", 1)[1])
    if not count:
        return None

    def quantile(q: float) -> float:
        for le, cumulative in buckets:
            if cumulative >= q * count:
                return le * 1000
        return float("inf")
    return {"samples": int(count), "p50_ms_at_most": quantile(0.5), "p99_ms_at_most": quantile(0.99)}


def _run_rate(bench, say, rate: int, measure_s: float) -> dict:
    from kafka_io.admin import ensure_topics
    from kvstream.broker import free_port
    from schemas.topics import TopicNames

    prefix, app_id = f"fresh{rate}.", f"bench-fresh-{rate}"
    topics = TopicNames(app_id, prefix)
    ensure_topics(bench.bootstrap, {topics.kv_events: bench.o.partitions})
    group = bench._workers(app_id, bench.work, store="memory://", partitions=bench.o.partitions, topic_prefix=prefix)
    group.start(1)
    pub_port, replay_port = free_port(), free_port()
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    bridge = publisher = child = None
    log = Path(bench.work) / f"bridge-fresh-{rate}.log"
    try:
        group.wait_ready(bench.o.timeout_s)
        start_at = time.time() + 8.0  # the bridge and the floor subscribe first (ZMQ's slow joiner)
        measure_from = start_at + WARMUP_S
        child = context.Process(target=replica, args=(bench.bootstrap, app_id, prefix, pub_port, measure_from,
                                                      theirs), daemon=True)
        child.start()
        publisher = subprocess.Popen([sys.executable, "-m", "bench.freshness", "publish", "--port", str(pub_port),
                                      "--replay-port", str(replay_port), "--rate", str(rate),
                                      "--seconds", str(WARMUP_S + measure_s), "--start-at", str(start_at)])
        with open(log, "wb") as out:
            bridge = subprocess.Popen([sys.executable, "-m", "kvstream.cli", "bridge", "--bootstrap-servers",
                                       bench.bootstrap, "--topic-prefix", prefix, "--partitions",
                                       str(bench.o.partitions), "--endpoint", f"tcp://127.0.0.1:{pub_port}",
                                       "--replay-endpoint", f"tcp://127.0.0.1:{replay_port}",
                                       "--instance-id", f"fresh-{rate}"], stdout=out, stderr=subprocess.STDOUT)
        answer = ours.recv() if ours.poll(300) else "no answer within 300 s"
        if answer != "ready":
            raise RuntimeError(f"the index replica did not catch up: {answer}")
        publisher.wait(timeout=WARMUP_S + measure_s + 120)
        time.sleep(1.0)
        worker = _worker_freshness(f"http://127.0.0.1:{group.ports[0]}")
        ours.send("stop")
        seen = ours.recv() if ours.poll(120) else None
        if not seen or not seen["index"] or not seen["floor"]:
            raise RuntimeError(f"no block event measured at {rate}/s (bridge log: {log})")
        index, floor = _summary(seen["index"]), _summary(seen["floor"])
        hops = {name: _summary(seen[name]) for name in ("bridge", "kafka") if seen[name]}
        say(f"      {rate:,} block events/s: index p50 {index['p50_ms']} ms, p99 {index['p99_ms']} ms "
            f"({index['samples']:,} events); floor p50 {floor['p50_ms']} ms, p99 {floor['p99_ms']} ms; "
            f"a bare consumer's hops: publish to the bridge's produce {hops.get('bridge')}, produce to consumed "
            f"{hops.get('kafka')}; the worker's index {worker}")
        return {"index": index, "floor": floor, "worker": worker, "fresh": seen["fresh"], **hops}
    finally:
        for process in (bridge, publisher):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(30)
        if child is not None and child.is_alive():
            child.terminate()
        group.stop()


def freshness_part(bench, say) -> None:
    """The part: both rates, one after the other, each with its own topics, worker and replica."""
    measure_s = QUICK_MEASURE_S if bench.o.quick else MEASURE_S
    runs = {rate: _run_rate(bench, say, rate, measure_s) for rate in RATES}
    low, high = runs[RATES[0]], runs[RATES[1]]
    bench._set("index_freshness_p50_ms", low["index"]["p50_ms"], runs={str(r): v for r, v in runs.items()})
    bench._set("index_freshness_p99_ms", low["index"]["p99_ms"])
    bench._set("index_freshness_floor_p50_ms", low["floor"]["p50_ms"])
    bench._set("index_freshness_floor_p99_ms", low["floor"]["p99_ms"])
    bench._set("index_freshness_10k_p99_ms", high["index"]["p99_ms"])
    bench._set("index_freshness_10k_floor_p99_ms", high["floor"]["p99_ms"])
    bench._set("index_freshness_vs_floor_p99", low["index"]["p99_ms"] / max(low["floor"]["p99_ms"], 1e-3))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.freshness", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("publish", help="the publisher process: a steady rate of block events over ZMQ")
    run.add_argument("--port", type=int, required=True, help="PUB port")
    run.add_argument("--replay-port", type=int, required=True, help="ROUTER replay port")
    run.add_argument("--rate", type=int, required=True, help="block events per second")
    run.add_argument("--seconds", type=float, required=True, help="how long to publish")
    run.add_argument("--start-at", type=float, required=True, help="wall clock (s since the epoch) of the first")
    args = parser.parse_args(argv)
    publish(args.port, args.replay_port, args.rate, args.seconds, args.start_at)
    return 0


if __name__ == "__main__":
    sys.exit(main())
