"""The engine bridge against publishers that follow vLLM's ZMQ protocol (harness/vllm_publisher.py)."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
import uuid

import msgspec
import pytest
from confluent_kafka import Consumer

from harness.payloads import VLLM_PAYLOAD
from harness.vllm_publisher import BlockRemoved, BlockStored, FakeVllmPublisher
from kafka_io.admin import ensure_topics
from kafka_io.config import client_config
from kafka_io.reader import messages_to_end
from kvstream.broker import free_port_range, free_ports
from producers.bridge import (
    Bridge,
    BridgeMetrics,
    KafkaBatchSink,
    PublisherEndpoint,
    data_parallel_endpoints,
    offset_endpoint,
)
from producers.kafka_sink import KvEventProducer
from producers.split import rebuild_event
from schemas import SOURCE_HEARTBEAT, AvroCodec
from schemas.topics import KV_EVENTS_DEAD_LETTER


class CollectingSink:
    """Records every batch the bridge delivers, in order; heartbeats apart from the other source events (when they
    come depends on the test's pace)."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, int, int, bytes]] = []  # (instance/dp, epoch, seq, payload)
        self.source_events: list[tuple[str, dict]] = []
        self.heartbeats: list[tuple[int, int, dict]] = []  # (epoch, seq, body)

    def batch(self, endpoint, publisher, seq, payload) -> None:
        self.batches.append((f"{publisher.instance_id}/{publisher.data_parallel_rank}", publisher.publisher_epoch,
                             seq, payload))

    def source_event(self, publisher, kind, body, seq) -> None:
        if kind == SOURCE_HEARTBEAT:
            self.heartbeats.append((publisher.publisher_epoch, seq, body))
            return
        self.source_events.append((kind.rsplit(".", 1)[-1], body))

    def flush(self) -> None:
        """Everything is kept in memory as it arrives: nothing to wait for."""

    def seqs(self) -> list[int]:
        return [b[2] for b in self.batches]


def _pump(bridge: Bridge, done, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "bridge did not receive the expected batches"
        bridge.poll(50)


def _stored(h: int, medium: str = "GPU") -> BlockStored:
    return BlockStored([h], None, [1, 2, 3, 4], 4, None, medium, None, group_idx=0)


@pytest.fixture
def publisher_and_bridge():
    made = []

    def make(buffer_steps=10_000, replay=True, sink=None, engine="vllm"):
        port, replay_port = free_ports(2)
        publisher = FakeVllmPublisher(port, replay_port if replay else None, buffer_steps=buffer_steps)
        endpoint = PublisherEndpoint(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}" if replay else None,
                                     "engine-a", engine=engine)
        bridge = Bridge([endpoint], sink or CollectingSink(), replay_timeout_s=2)
        made.append((publisher, bridge))
        time.sleep(0.3)  # ZMQ slow joiner: let the SUB connection settle before publishing
        return publisher, bridge, endpoint

    yield make
    for publisher, bridge in made:
        bridge.close()
        publisher.close()


def test_live_batches_arrive_in_order(publisher_and_bridge):
    publisher, bridge, _ = publisher_and_bridge()
    for h in range(5):
        publisher.publish([_stored(h)])
    _pump(bridge, lambda: len(bridge.sink.batches) == 5)
    assert bridge.sink.seqs() == [0, 1, 2, 3, 4]
    assert not bridge.state[bridge.endpoints[0]].stale


class RecordingKafkaSink(KafkaBatchSink):
    """The bridge's Kafka sink that also remembers the seqs it was handed."""

    def __init__(self, producer) -> None:
        super().__init__(producer, BridgeMetrics())
        self.batches: list = []

    def batch(self, endpoint, publisher, seq, payload) -> None:
        self.batches.append(seq)
        super().batch(endpoint, publisher, seq, payload)

    def seqs(self) -> list[int]:
        return list(self.batches)


@pytest.mark.integration
def test_a_gap_is_recovered_from_the_replay_socket_complete_in_order_without_duplicates(
        publisher_and_bridge, kafka_bootstrap):
    topic = f"bridge-gap-{uuid.uuid4().hex[:8]}"
    ensure_topics(kafka_bootstrap, {topic: 1, KV_EVENTS_DEAD_LETTER: 1})  # one partition: Kafka order = seq order
    producer = KvEventProducer(kafka_bootstrap, topic)
    publisher, bridge, _ = publisher_and_bridge(sink=RecordingKafkaSink(producer))
    for h in range(3):
        publisher.publish([_stored(h)])
    _pump(bridge, lambda: len(bridge.sink.batches) == 3)
    publisher.publish([_stored(3)], send_live=False)  # lost on the way (e.g. PUB high-water mark)
    publisher.publish([_stored(4)], send_live=False)
    publisher.publish([_stored(5)])
    _pump(bridge, lambda: len(bridge.sink.batches) == 6)
    time.sleep(0.2)
    bridge.poll(50)
    assert bridge.sink.seqs() == [0, 1, 2, 3, 4, 5]
    metrics = bridge.metrics
    assert metrics.gaps_found.labels("engine-a", "0")._value.get() == 1
    assert metrics.batches_replayed.labels("engine-a", "0")._value.get() == 2
    assert metrics.gaps_unrecovered.labels("engine-a", "0")._value.get() == 0
    producer.flush(30)
    records = [AvroCodec("kv_event").decode(m.value()) for m in _consume(kafka_bootstrap, topic, 6)]
    assert [(r["seq"], int.from_bytes(r["block_hash"], "big")) for r in records] == [(i, i) for i in range(6)]


def test_a_gap_older_than_the_replay_buffer_marks_the_source_stale(publisher_and_bridge):
    publisher, bridge, endpoint = publisher_and_bridge(buffer_steps=3)
    publisher.publish([_stored(0)])
    _pump(bridge, lambda: len(bridge.sink.batches) == 1)
    for h in range(1, 9):
        publisher.publish([_stored(h)], send_live=False)
    publisher.publish([_stored(9)])  # buffer now holds 7, 8, 9
    _pump(bridge, lambda: bridge.sink.seqs()[-1:] == [9])
    assert bridge.sink.seqs() == [0, 7, 8, 9]
    assert bridge.state[endpoint].stale
    assert bridge.sink.source_events == [("SourceStale", {"first_lost_seq": 1, "last_lost_seq": 6})]
    assert bridge.metrics.gaps_unrecovered.labels("engine-a", "0")._value.get() == 1


def test_first_contact_replays_what_the_publisher_still_holds(publisher_and_bridge):
    port, replay_port = free_ports(2)
    publisher = FakeVllmPublisher(port, replay_port)
    try:
        for h in range(4):
            publisher.publish([_stored(h)])  # published before the bridge exists: only the replay buffer has them
        endpoint = PublisherEndpoint(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", "engine-b")
        bridge = Bridge([endpoint], CollectingSink(), replay_timeout_s=2)
        time.sleep(0.3)
        publisher.publish([_stored(4)])
        _pump(bridge, lambda: len(bridge.sink.batches) == 5)
        assert bridge.sink.seqs() == [0, 1, 2, 3, 4] and not bridge.state[endpoint].stale
        bridge.close()
    finally:
        publisher.close()


def test_a_publisher_restart_begins_a_new_epoch(publisher_and_bridge):
    publisher, bridge, endpoint = publisher_and_bridge()
    for h in range(3):
        publisher.publish([_stored(h)])
    _pump(bridge, lambda: len(bridge.sink.batches) == 3)
    first_epoch = bridge.state[endpoint].epoch
    publisher.seq = 0  # the engine restarted: a new process counts from 0 again
    publisher.buffer.clear()
    publisher.publish([_stored(10)])
    _pump(bridge, lambda: len(bridge.sink.batches) == 4)
    name, epoch, seq, _ = bridge.sink.batches[-1]
    assert seq == 0 and epoch > first_epoch
    assert bridge.sink.source_events == [("PublisherRestarted", {"previous_epoch": first_epoch})]
    assert bridge.metrics.restarts.labels("engine-a", "0")._value.get() == 1


def test_data_parallel_ranks_follow_vllms_port_offset_rule():
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://10.0.0.1:0", 2) == "tcp://10.0.0.1:0"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    with pytest.raises(ValueError, match="inproc' or 'tcp"):
        offset_endpoint("ipc:///tmp/kv", 1)
    base, replay_base = free_port_range(2), None
    publishers = []
    try:
        # ranks bind base+rank, as vLLM's publisher of each DP rank does
        for rank in range(2):
            publishers.append(FakeVllmPublisher(base + rank, None, data_parallel_rank=rank))
        endpoints = data_parallel_endpoints(f"tcp://127.0.0.1:{base}", replay_base, "engine-dp", 2)
        bridge = Bridge(endpoints, CollectingSink())
        time.sleep(0.3)
        publishers[0].publish([_stored(0x61)])
        publishers[1].publish([_stored(0x62)])
        _pump(bridge, lambda: len(bridge.sink.batches) == 2)
        assert sorted(b[0] for b in bridge.sink.batches) == ["engine-dp/0", "engine-dp/1"]
        bridge.close()
    finally:
        for p in publishers:
            p.close()


@pytest.fixture
def kafka_topic(kafka_bootstrap):
    topic = f"bridge-events-{uuid.uuid4().hex[:8]}"
    ensure_topics(kafka_bootstrap, {topic: 2, KV_EVENTS_DEAD_LETTER: 1})
    return topic


def _consume(bootstrap: str, topic: str, count: int, timeout_s: float = 30) -> list:
    consumer = Consumer(client_config(bootstrap, **{"group.id": f"t-{uuid.uuid4()}", "auto.offset.reset": "earliest"}))
    consumer.subscribe([topic])
    messages, deadline = [], time.monotonic() + timeout_s
    try:
        while len(messages) < count and time.monotonic() < deadline:
            messages += [m for m in consumer.consume(1000, timeout=0.5) if not m.error()]
    finally:
        consumer.close()
    return messages


@pytest.mark.integration
def test_events_arrive_in_kafka_losslessly_and_bad_input_is_dead_lettered(publisher_and_bridge, kafka_bootstrap,
                                                                        kafka_topic):
    producer = KvEventProducer(kafka_bootstrap, kafka_topic)
    publisher, bridge, _ = publisher_and_bridge(sink=KafkaBatchSink(producer, BridgeMetrics()))
    sglang_batch = msgspec.msgpack.encode([1767225601.0, [
        {"type": "BlockStored", "block_hashes": [-7, 2**63 - 1], "parent_block_hash": -1, "token_ids": [1, 2],
         "block_size": 1, "lora_id": None, "medium": "CPU_PINNED", "cache_salt": "x"},
        {"type": "BlockRemoved", "block_hashes": [-7], "medium": "CPU_PINNED"}], 1])
    old_vllm_batch = msgspec.msgpack.encode([1767225602.0, [
        ["BlockStored", [5, 6], None, [1, 2, 3, 4], 2, None, "GPU"], ["BlockRemoved", [5], "GPU"]]])
    with_unknown = msgspec.msgpack.encode([1767225603.0, [{"type": "TierBlocksCleared", "medium": "CPU"},
                                                          {"type": "AllBlocksCleared"}], 0])
    payloads = [VLLM_PAYLOAD, msgspec.msgpack.encode(
        [1767225600.5, [BlockStored([bytes(31) + b"\x2a"], None, [], 0, None, "STORAGE", None, ownership="kvcr"),
                        BlockRemoved([2**64 - 1], "GPU", group_idx=0)], 0]),
                sglang_batch, old_vllm_batch, with_unknown, b"\x93not msgpack at all"]
    for payload in payloads:
        publisher.publish_payload(payload)
    endpoint = bridge.endpoints[0]
    _pump(bridge, lambda: endpoint in bridge.state and bridge.state[endpoint].last_seq == len(payloads) - 1)
    producer.flush(30)

    codec = AvroCodec("kv_event")
    # blocks per event per payload; a clear is one message per partition (2); the SGLang-shaped batch (signed
    # hashes) sent to this vLLM bridge is dead-lettered: vLLM's hashes are unsigned
    expected_records = (2 + 1 + 2) + (1 + 1) + (2 + 1) + 2
    records = [codec.decode(m.value()) for m in _consume(kafka_bootstrap, kafka_topic, expected_records)]
    assert len(records) == expected_records
    by_event: dict[tuple, list] = {}
    for r in records:
        by_event.setdefault((r["seq"], r["batch_index"], r["event"][0]), []).append(r)
    originals = {}
    for seq, payload in enumerate(payloads[:5]):
        for index, event in enumerate(msgspec.msgpack.decode(payload)[1]):
            originals[(seq, index)] = event
    rebuilt = {}
    for (seq, index, kind), group in by_event.items():
        if kind.endswith("AllBlocksCleared"):
            group = group[:1]  # one copy per partition
        rebuilt[(seq, index)] = rebuild_event(group)
    expected = {k: v for k, v in originals.items() if not (isinstance(v, dict) and v.get("type") == "TierBlocksCleared")
                and k[0] != 2}
    # older vLLM's positional events come back in map form
    expected[(3, 0)] = {"type": "BlockStored", "block_hashes": [5, 6], "parent_block_hash": None,
                        "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU",
                        "lora_name": None}
    expected[(3, 1)] = {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}
    assert rebuilt == expected

    dead = _consume(kafka_bootstrap, KV_EVENTS_DEAD_LETTER, 100, timeout_s=5)
    reasons = {dict(m.headers())["kvstream-error"].decode() for m in dead
               if dict(m.headers())["kvstream-source"].decode().startswith(bridge.endpoints[0].endpoint)}
    assert "unknown event type 'TierBlocksCleared'" in reasons
    assert "block hash -7 is negative; vllm publishes unsigned 64-bit hashes" in reasons
    assert any(r.startswith("not a msgpack KV event batch") for r in reasons)


def test_an_sglang_bridge_keeps_signed_hashes_cache_salt_and_eagle_pairs(publisher_and_bridge, kafka_bootstrap,
                                                                       kafka_topic):
    producer = KvEventProducer(kafka_bootstrap, kafka_topic)
    publisher, bridge, endpoint = publisher_and_bridge(sink=KafkaBatchSink(producer, BridgeMetrics()), engine="sglang")
    events = [{"type": "BlockStored", "block_hashes": [-7, 2**63 - 1], "parent_block_hash": -1, "token_ids": [1, 2],
               "block_size": 1, "lora_id": None, "medium": "CPU_PINNED", "cache_salt": "x"},
              {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None,
               "token_ids": [[11, 12], [12, 13]], "block_size": 2, "lora_id": None},  # EAGLE: bigram positions
              {"type": "BlockRemoved", "block_hashes": [-7], "medium": "CPU_PINNED"}]
    publisher.publish_payload(msgspec.msgpack.encode([1767225601.0, events, 1]))  # SGLang's attn_dp_rank 1
    _pump(bridge, lambda: endpoint in bridge.state and bridge.state[endpoint].last_seq == 0)
    producer.flush(30)
    codec = AvroCodec("kv_event")
    records = [codec.decode(m.value()) for m in _consume(kafka_bootstrap, kafka_topic, 4)]
    assert {r["hash_encoding"] for r in records} == {"INT64"} and {r["data_parallel_rank"] for r in records} == {1}
    by_index: dict[int, list] = {}
    for r in records:
        by_index.setdefault(r["batch_index"], []).append(r)
    assert [rebuild_event(by_index[i]) for i in range(3)] == events


def test_capture_file_round_trips_every_batch_and_keeps_undecodable_events(publisher_and_bridge, tmp_path):
    from producers.capture import CaptureSink, read_capture
    from producers.engine_decode import decode_batch

    path = tmp_path / "capture.jsonl"
    with open(path, "w") as out:
        publisher, bridge, _ = publisher_and_bridge(sink=CaptureSink(out))
        payloads = [VLLM_PAYLOAD,
                    msgspec.msgpack.encode([1.5, [{"type": "BlockStored", "block_hashes": [bytes(32), -3],
                                                   "parent_block_hash": None, "token_ids": [], "block_size": 0,
                                                   "lora_id": None, "medium": "DISK", "lora_name": None,
                                                   "extra_keys": [[b"\x01\x02", "salt"], None]},
                                                  {"type": "Bogus"}], 2]),
                    b"\xc1 garbage"]
        for payload in payloads:
            publisher.publish_payload(payload)
        _pump(bridge, lambda: bridge.sink.batches == 3)
    lines = [__import__("json").loads(line) for line in path.read_text().splitlines()]
    assert [line["seq"] for line in lines] == [0, 1, 2]
    assert lines[1]["events"][0]["block_hashes"] == ["00" * 32, -3] and lines[1]["data_parallel_rank"] == 2
    assert lines[1]["undecodable"][0]["reason"] == "unknown event type 'Bogus'"
    replayed = list(read_capture(path))
    original = decode_batch(payloads[0])
    again = decode_batch(replayed[0][2])
    assert [e for _, e, _ in again.events] == [e for _, e, _ in original.events] and again.ts == original.ts
    second = decode_batch(replayed[1][2])
    assert second.events[0][1]["block_hashes"] == [bytes(32), -3]
    assert [f.raw for f in second.failures] == [msgspec.msgpack.encode({"type": "Bogus"})]
    assert replayed[2][2] == payloads[2]  # not a batch at all: its bytes come back as they were


@pytest.mark.integration
def test_produce_jsonl_publishes_a_capture_through_the_bridge_path(kafka_bootstrap, kafka_topic, tmp_path):
    from producers.bridge import BridgeMetrics, KafkaBatchSink
    from producers.capture import produce_capture

    path = tmp_path / "capture.jsonl"
    lines = [{"instance_id": "cap", "data_parallel_rank": 0, "seq": 0, "ts": 1.0,
              "events": [{"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                          "token_ids": [1, 2], "block_size": 1, "lora_id": None, "medium": "GPU",
                          "lora_name": None}]},
             {"instance_id": "cap", "data_parallel_rank": 0, "seq": 1, "ts": 2.0, "worker_rank": 1, "world_size": 2,
              "aggregation": "REPLICATED", "events": [{"type": "BlockRemoved", "block_hashes": ["ff" * 8],
                                                       "medium": "CPU"}]},
             {"instance_id": "cap", "data_parallel_rank": 0, "seq": 1, "ts": 2.5, "events": []},
             {"instance_id": "cap", "data_parallel_rank": 0, "seq": 0, "ts": 3.0,  # below 1: the engine restarted
              "events": [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}]}]
    path.write_text("".join(__import__("json").dumps(line) + "\n" for line in lines))
    producer = KvEventProducer(kafka_bootstrap, kafka_topic)
    metrics = BridgeMetrics()
    produce_capture(path, KafkaBatchSink(producer, metrics), metrics)
    producer.flush(30)
    # 4 block records; PublisherRestarted and SourceStale (the worker's stream starts at seq 1) on both partitions
    messages = _consume(kafka_bootstrap, kafka_topic, 8)
    records = sorted((AvroCodec("kv_event").decode(m.value()) for m in messages),
                     key=lambda r: (r["publisher_epoch"], r["seq"], r["block_index"]))
    blocks = [r for r in records if r["block_hash"] is not None]
    assert [(r["seq"], r["block_hash"].hex(), r["worker_rank"]) for r in blocks] == [
        (0, "0000000000000001", None), (0, "0000000000000002", None), (1, "ff" * 8, 1), (0, "0000000000000001", None)]
    assert blocks[3]["publisher_epoch"] > blocks[0]["publisher_epoch"]  # a new epoch after the restart
    bridge_events = sorted((r["event"][0].rsplit(".", 1)[-1], r["worker_rank"], r["publisher_epoch"])
                           for r in records if r["block_hash"] is None)
    assert bridge_events == sorted([("PublisherRestarted", None, blocks[3]["publisher_epoch"])] * 2
                                   + [("SourceStale", 1, blocks[2]["publisher_epoch"])] * 2)
    assert metrics.restarts.labels("cap", "0")._value.get() == 1


def test_a_restarted_bridge_continues_the_epoch_from_its_state_file(tmp_path):
    """The bridge goes away and comes back: it replays what it missed in the same epoch, no restart event."""
    port, replay_port = free_ports(2)
    publisher = FakeVllmPublisher(port, replay_port)
    endpoint = PublisherEndpoint(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", "engine-c")
    state_file = tmp_path / "bridge-state.json"
    try:
        first = Bridge([endpoint], CollectingSink(), replay_timeout_s=2, state_file=state_file)
        time.sleep(0.3)
        for h in range(3):
            publisher.publish([_stored(h)])
        _pump(first, lambda: len(first.sink.batches) == 3)
        epoch = first.state[endpoint].epoch
        first.close()  # the bridge stops; the engine goes on publishing
        for h in range(3, 5):
            publisher.publish([_stored(h)])
        second = Bridge([endpoint], CollectingSink(), replay_timeout_s=2, state_file=state_file)
        time.sleep(0.3)
        publisher.publish([_stored(5)])
        _pump(second, lambda: len(second.sink.batches) == 3)
        assert second.sink.seqs() == [3, 4, 5] and {b[1] for b in second.sink.batches} == {epoch}
        assert second.sink.source_events == [] and not second.state[endpoint].stale
        second.close()

        publisher.seq, publisher.buffer = 0, type(publisher.buffer)(maxlen=publisher.buffer.maxlen)
        third = Bridge([endpoint], CollectingSink(), replay_timeout_s=2, state_file=state_file)
        time.sleep(0.3)
        publisher.publish([_stored(9)])  # the engine restarted while no bridge was running
        _pump(third, lambda: len(third.sink.batches) == 1)
        assert third.sink.source_events == [("PublisherRestarted", {"previous_epoch": epoch})]
        assert third.sink.batches[0][1] > epoch
        third.close()
    finally:
        publisher.close()


# ---------------------------------------------------------------------- heartbeats and replay on connect (issue 26)

INTERVAL_S, PROBE_TIMEOUT_S = 1.0, 0.5


def _engine_process(port: int, replay_port: int, batches: int) -> subprocess.Popen:
    """An engine in its own process (harness/vllm_publisher.py): publishes ``batches`` batches, then idles serving
    its replay socket until killed."""
    engine = subprocess.Popen([sys.executable, "-m", "harness.vllm_publisher", "--port", str(port), "--replay-port",
                               str(replay_port), "--batches", str(batches)], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert engine.stdout.readline().strip() == "ready"
    return engine


def _kafka_bridge(bootstrap: str, topic: str, endpoint: PublisherEndpoint) -> tuple[Bridge, KvEventProducer]:
    producer = KvEventProducer(bootstrap, topic)
    bridge = Bridge([endpoint], KafkaBatchSink(producer, BridgeMetrics()), replay_timeout_s=2,
                    heartbeat_interval_s=INTERVAL_S, probe_timeout_s=PROBE_TIMEOUT_S)
    return bridge, producer


def _run(bridge: Bridge, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        bridge.poll(50)


def _records(bootstrap: str, topic: str) -> list[dict]:
    """Every record of the topic's partition 0 (source-wide events are on every partition), in order."""
    codec = AvroCodec("kv_event")
    return [codec.decode(m.value()) for m in messages_to_end(bootstrap, topic, 30) if m.partition() == 0]


def _heartbeats(records: list[dict]) -> list[dict]:
    return [r for r in records if r["event"][0] == SOURCE_HEARTBEAT]


@pytest.mark.integration
def test_an_idle_engine_keeps_getting_heartbeats(kafka_bootstrap, kafka_topic):
    port, replay_port = free_ports(2)
    publisher = FakeVllmPublisher(port, replay_port)
    endpoint = PublisherEndpoint(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", "engine-idle")
    bridge, producer = _kafka_bridge(kafka_bootstrap, kafka_topic, endpoint)
    try:
        _run(bridge, 0.3)
        publisher.publish([_stored(1)])
        publisher.publish([_stored(2)])
        _pump(bridge, lambda: endpoint in bridge.state and bridge.state[endpoint].last_seq == 1)
        idle_from = time.time()
        _run(bridge, 4.6 * INTERVAL_S)  # connected, publishing nothing, serving replay
        producer.flush(30)
        epoch = bridge.state[endpoint].epoch
    finally:
        bridge.close()
        publisher.close()
    beats = [r for r in _heartbeats(_records(kafka_bootstrap, kafka_topic)) if r["ts"] > idle_from + 0.1]
    # the first interval had the batches ('events'), every later one the replay socket's answer to a probe
    evidence = [r["event"][1]["evidence"] for r in beats]
    assert evidence[0] in ("events", "replay") and evidence[1:] == ["replay"] * (len(beats) - 1)
    assert evidence.count("replay") >= 3, evidence
    assert {(r["instance_id"], r["publisher_epoch"], r["seq"]) for r in beats} == {("engine-idle", epoch, 1)}
    gaps = [b["ts"] - a["ts"] for a, b in itertools.pairwise(beats)]
    assert all(0.7 * INTERVAL_S < gap < 1.5 * INTERVAL_S for gap in gaps), gaps


@pytest.mark.integration
def test_a_killed_engines_heartbeats_stop_within_an_interval_and_the_probe_timeout(kafka_bootstrap, kafka_topic):
    port, replay_port = free_ports(2)
    engine = _engine_process(port, replay_port, 2)
    endpoint = PublisherEndpoint(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", "engine-killed")
    bridge, producer = _kafka_bridge(kafka_bootstrap, kafka_topic, endpoint)
    try:
        _run(bridge, 2.5 * INTERVAL_S)
        engine.send_signal(signal.SIGKILL)
        engine.wait(10)
        killed_at = time.time()
        _run(bridge, 3 * INTERVAL_S)
        producer.flush(30)
    finally:
        bridge.close()
        if engine.poll() is None:
            engine.kill()
    beats = _heartbeats(_records(kafka_bootstrap, kafka_topic))
    assert [r for r in beats if r["ts"] < killed_at], "the engine had heartbeats while it lived"
    assert max(r["ts"] for r in beats) <= killed_at + INTERVAL_S + PROBE_TIMEOUT_S + 0.2
    assert bridge.metrics.heartbeats_skipped.labels("engine-killed", "0")._value.get() >= 2


@pytest.mark.integration
def test_a_bridge_started_after_its_engine_went_idle_delivers_its_batches_within_seconds(kafka_bootstrap,
                                                                                       kafka_topic):
    port, replay_port = free_ports(2)
    engine = _engine_process(port, replay_port, 5)  # publishes 5 batches before any bridge exists, then nothing
    endpoint = PublisherEndpoint(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", "engine-early")
    bridge, producer = _kafka_bridge(kafka_bootstrap, kafka_topic, endpoint)
    try:
        started = time.monotonic()
        _pump(bridge, lambda: endpoint in bridge.state and bridge.state[endpoint].last_seq == 4, timeout_s=5)
        assert time.monotonic() - started < 3
        producer.flush(30)
        assert bridge.metrics.batches_received.labels("engine-early", "0")._value.get() == 0  # not one live batch
    finally:
        bridge.close()
        engine.kill()
        engine.wait(10)
    blocks = [r for r in _records(kafka_bootstrap, kafka_topic) if r["block_hash"] is not None]
    # one partition's share of the 5 blocks, in seq order, all of one epoch; no SourceStale: the buffer had them all
    assert [r["seq"] for r in blocks] == sorted(r["seq"] for r in blocks)
    everything = [AvroCodec("kv_event").decode(m.value()) for m in messages_to_end(kafka_bootstrap, kafka_topic, 30)]
    assert sorted((r["seq"], int.from_bytes(r["block_hash"], "big")) for r in everything if r["block_hash"]) == [
        (i, i) for i in range(5)]
    assert not [r for r in everything if r["event"][0].endswith("SourceStale")]
    assert len({r["publisher_epoch"] for r in everything}) == 1


@pytest.mark.integration
def test_produce_ends_with_a_heartbeat_of_each_source(kafka_bootstrap, tmp_path, capsys):
    import json

    from kvstream.cli import main

    prefix = f"produce-beat-{uuid.uuid4().hex[:8]}."
    path = tmp_path / "capture.jsonl"
    stored = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1],
              "block_size": 1, "lora_id": None, "medium": "GPU", "lora_name": None}
    lines = [{"instance_id": name, "data_parallel_rank": 0, "seq": seq, "ts": 1.0, "events": [stored]}
             for name, seqs in (("cap-a", (0, 1, 2)), ("cap-b", (0,))) for seq in seqs]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    started = time.time()
    assert main(["produce", f"--jsonl={path}", f"--bootstrap-servers={kafka_bootstrap}", f"--topic-prefix={prefix}",
                 "--partitions=2"]) == 0
    out = capsys.readouterr().out
    assert f"produced 4 messages to {prefix}kv-events" in out and "a heartbeat of each of its 2 sources" in out
    records = [AvroCodec("kv_event").decode(m.value()) for m in messages_to_end(kafka_bootstrap, f"{prefix}kv-events")]
    beats = sorted((r["instance_id"], r["seq"], r["event"][1]["evidence"]) for r in _heartbeats(records))
    assert beats == [("cap-a", 2, "producing")] * 2 + [("cap-b", 0, "producing")] * 2  # on each partition
    assert all(r["ts"] >= started for r in _heartbeats(records))  # the load's time, not the capture's
