"""End to end on the real broker: trace slice -> producer -> kv-events -> Faust worker -> residency tables.

One worker runs for the module. It consumes a slice of the Mooncake trace replayed through a fleet with small
pools (so blocks cascade GPU -> CPU -> KVCR and get evicted), a GPU reset, and one undecodable record.
"""

from __future__ import annotations

import json
import random
import socket
import time
import urllib.error
import urllib.request

import msgspec
import pytest
from aiokafka.partitioner import murmur2
from confluent_kafka import Consumer, Producer

from kvstream.kafka_config import client_config, ensure_topics
from kvstream.worker import WorkerOptions, spawn_worker, stop_worker, wait_until_consumed
from producers.kafka_sink import KvEventProducer
from producers.simulator import FleetConfig, load_trace, replay_to_kafka
from producers.bridge import Bridge, BridgeMetrics, KafkaBatchSink, PublisherEndpoint
from producers.split import Publisher, split_event
from schemas import AvroCodec
from schemas.topics import KV_EVENTS, KV_EVENTS_DEAD_LETTER, KV_RESIDENCY_CHANGES, KV_TIER_OCCUPANCY
from stream_apps.snapshot import changelog_topic, compare_rows, read_table, resident_rows

pytestmark = pytest.mark.integration

PARTITIONS = 4
GARBAGE = b"\xc3\x01not-an-avro-record"


def _batch(*events) -> bytes:
    return msgspec.msgpack.encode([1767230000.0, list(events), 0])


def _gpu(h: int, medium: str = "GPU") -> dict:
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None, "token_ids": [], "block_size": 16,
            "lora_id": None, "medium": medium, "lora_name": None, "group_idx": 0}


def _publish_bridge_scenarios(bootstrap: str) -> None:
    """Through the bridge's sequencing: engine-r restarts (its first epoch is retired); engine-s joins late (stale)."""
    sink = KafkaBatchSink(KvEventProducer(bootstrap, KV_EVENTS), BridgeMetrics())
    bridge = Bridge([], sink)
    restarting = PublisherEndpoint("file:engine-r", None, "engine-r")
    bridge.on_live(restarting, 0, _batch(_gpu(0xAA), _gpu(0xAB, "CPU")))
    bridge.on_live(restarting, 1, _batch(_gpu(0xAD)))
    bridge.on_live(restarting, 0, _batch(_gpu(0xAC)))  # seq back to 0: a new process, a new epoch
    bridge.on_live(PublisherEndpoint("file:engine-s", None, "engine-s"), 3, _batch(_gpu(0xBB)))  # 0..2 lost
    sink.producer.flush(30)


def _removal_without_hash() -> bytes:
    """Valid Avro, but a BlockRemoved without a block hash breaks the contract."""
    record = split_event(Publisher("bad"), 0, 0.0, 0, {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"})[0]
    return AvroCodec("kv_event").encode({**record, "block_hash": None})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def pipeline(kafka_bootstrap, tmp_path_factory):
    ensure_topics(kafka_bootstrap, {KV_EVENTS: PARTITIONS})
    fleet = FleetConfig(gpu_blocks=600, cpu_blocks=900, kvcr_blocks=1200, clear_instance=1, clear_at=0.6)
    result = replay_to_kafka(load_trace(limit=600), KvEventProducer(kafka_bootstrap, KV_EVENTS), fleet)
    _publish_bridge_scenarios(kafka_bootstrap)
    garbage = Producer(client_config(kafka_bootstrap))
    garbage.produce(KV_EVENTS, key=b"bad-key", value=GARBAGE, partition=0)
    garbage.produce(KV_EVENTS, key=b"no-hash", value=_removal_without_hash(), partition=0)
    garbage.flush(30)
    work = tmp_path_factory.mktemp("worker")
    options = WorkerOptions(kafka_bootstrap, web_port=_free_port(), data_dir=work / "data", partitions=PARTITIONS,
                            app_id="kvstream-test")
    process = spawn_worker(options, work / "worker.log")
    try:
        wait_until_consumed(kafka_bootstrap, options.app_id, process, timeout_s=300)
        yield {"result": result, "options": options, "url": f"http://127.0.0.1:{options.web_port}", "work": work}
    except Exception:
        print((work / "worker.log").read_text()[-5000:])
        raise
    finally:
        stop_worker(process)


def _rows_by_block(truth: dict) -> dict[bytes, dict]:
    by_block: dict[bytes, dict] = {}
    for identity, copies in truth.items():
        by_block.setdefault(identity[6], {})[identity[:6]] = copies
    return by_block


def _answer(url: str, block: bytes) -> dict:
    rows = _get(f"{url}/residency/{block.hex()}/")["rows"]
    return {(r["instance_id"], r["data_parallel_rank"], r["tier"], r["ownership"], r["locality"], r["group_idx"]):
            r["copies"] for r in rows}


def test_residency_table_equals_the_simulators_ground_truth(pipeline, kafka_bootstrap):
    truth = pipeline["result"].ground_truth
    table = read_table(kafka_bootstrap, changelog_topic(pipeline["options"].app_id, "residency"), "residency")
    simulated = {identity: copies for identity, copies in resident_rows(table).items()
                 if identity[0].startswith("sim-")}
    comparison = compare_rows(truth, simulated)
    assert comparison.differences == [] and comparison.matching == len(truth)
    assert {identity[2] for identity in truth} == {"GPU", "CPU", "STORAGE"}


def test_residency_changes_topic_replays_to_the_ground_truth(pipeline, kafka_bootstrap):
    """Last transition per row wins: the rows whose last change is 'became resident' are exactly the truth."""
    codec = AvroCodec("residency_change")
    consumer = Consumer(client_config(kafka_bootstrap, **{"group.id": "test-changes", "auto.offset.reset": "earliest",
                                                          "enable.partition.eof": True}))
    consumer.subscribe([KV_RESIDENCY_CHANGES])
    last: dict[tuple, tuple] = {}
    ended: set[int] = set()
    try:
        while len(ended) < PARTITIONS:
            for message in consumer.consume(10000, timeout=1.0):
                if message.error():
                    ended.add(message.partition())
                    continue
                c = codec.decode(message.value())
                assert message.key() == c["block_hash"]
                identity = (c["instance_id"], c["data_parallel_rank"], c["tier"], c["ownership"], c["locality"],
                            c["group_idx"], c["block_hash"])
                last[identity] = (c["resident"], c["copies"])
    finally:
        consumer.close()
    replayed = {k: copies for k, (resident, copies) in last.items() if resident and k[0].startswith("sim-")}
    assert replayed == pipeline["result"].ground_truth
    causes = {k[0] for k, (resident, _) in last.items() if not resident}
    assert "engine-r" in causes  # rows retired by the restart were published as stopped


def test_tier_occupancy_topic_sums_to_the_occupancy_view(pipeline, kafka_bootstrap):
    table = read_table(kafka_bootstrap, KV_TIER_OCCUPANCY, "tier_occupancy")
    totals: dict[tuple, int] = {}
    for value in table.values():
        key = (value["ownership"], value["tier"], value["instance_id"])
        totals[key] = totals.get(key, 0) + value["resident_blocks"]
    view = {(r["ownership"], r["tier"], r["instance_id"]): r["resident_blocks"]
            for r in _get(f"{pipeline['url']}/occupancy/")["occupancy"]}
    assert {k: v for k, v in totals.items() if v} == view


def test_http_residency_view_agrees_with_the_ground_truth(pipeline):
    by_block = _rows_by_block(pipeline["result"].ground_truth)
    for block in random.Random(3).sample(sorted(by_block), 40):
        assert _answer(pipeline["url"], block) == by_block[block]


def test_unknown_block_and_bad_hex_get_empty_rows_and_400(pipeline):
    assert _get(f"{pipeline['url']}/residency/{'ab' * 8}/")["rows"] == []
    with pytest.raises(urllib.error.HTTPError) as excinfo:
        _get(f"{pipeline['url']}/residency/not-hex/")
    assert excinfo.value.code == 400


def test_occupancy_view_counts_every_resident_row(pipeline):
    occupancy = _get(f"{pipeline['url']}/occupancy/")["occupancy"]
    truth = pipeline["result"].ground_truth
    expected = {}
    for instance, _, tier, ownership, *_ in truth:
        expected[(ownership, tier, instance)] = expected.get((ownership, tier, instance), 0) + 1
    assert {(r["ownership"], r["tier"], r["instance_id"]): r["resident_blocks"] for r in occupancy
            if r["instance_id"].startswith("sim-")} == expected


def test_keys_sit_on_the_murmur2_partition_and_clears_on_every_partition(pipeline, kafka_bootstrap):
    codec = AvroCodec("kv_event")
    consumer = Consumer(client_config(kafka_bootstrap, **{"group.id": "test-partitioning",
                                                          "auto.offset.reset": "earliest"}))
    consumer.subscribe([KV_EVENTS])
    clears, checked = set(), 0
    try:
        for _ in range(200):
            for message in consumer.consume(5000, timeout=1.0):
                if message.error() or message.key() in (b"bad-key", b"no-hash"):
                    continue
                record = codec.decode(message.value())
                if record["block_hash"] is None:
                    clears.add(message.partition())
                else:
                    assert message.key() == record["block_hash"]
                    assert message.partition() == (murmur2(message.key()) & 0x7FFFFFFF) % PARTITIONS
                    checked += 1
            if checked >= pipeline["result"].records - 1:
                break
    finally:
        consumer.close()
    assert clears == set(range(PARTITIONS)) and checked > 10000


def test_bad_records_go_to_the_dead_letter_topic_with_their_reasons(pipeline, kafka_bootstrap):
    consumer = Consumer(client_config(kafka_bootstrap, **{"group.id": "test-dead-letter",
                                                          "auto.offset.reset": "earliest"}))
    consumer.subscribe([KV_EVENTS_DEAD_LETTER])
    try:
        messages = []
        for _ in range(30):  # other tests of the session dead-letter too: keep this module's records
            messages += [m for m in consumer.consume(100, timeout=1.0)
                         if not m.error() and m.key() in (b"bad-key", b"no-hash")]
            if len(messages) >= 2:
                break
    finally:
        consumer.close()
    assert [m.key() for m in messages] == [b"bad-key", b"no-hash"]
    assert messages[0].value() == GARBAGE and messages[1].value() == _removal_without_hash()
    reasons = [dict(m.headers())["kvstream-error"] for m in messages]
    assert b"unknown kv_event schema fingerprint" in reasons[0]
    assert reasons[1] == b"BlockRemoved without block_hash or tier"
    assert _get(f"{pipeline['url']}/stats/")["dead_lettered"] == 2


def test_tail_prints_decoded_json_lines_of_events_changelog_and_dead_letters(pipeline, kafka_bootstrap):
    import io

    from kvstream.tail import tail

    def lines(topic, n=None):
        out = io.StringIO()
        printed = tail(kafka_bootstrap, topic, from_beginning=True, max_messages=n, idle_timeout_s=5, out=out)
        assert printed == n if n else printed > 0
        return [json.loads(line) for line in out.getvalue().splitlines()]

    events = lines(KV_EVENTS, 3)
    assert all(e["value"]["event"]["type"] in ("BlockStored", "BlockRemoved", "AllBlocksCleared") for e in events)
    assert all(e["key"] == e["value"]["block_hash"] for e in events if e["key"])
    entry = lines(changelog_topic(pipeline["options"].app_id, "residency"), 1)[0]
    assert entry["key"] == f"{entry['value']['ownership'] or 'primary'}/{entry['value']['block_hash']}"
    dead = [d for d in lines(KV_EVENTS_DEAD_LETTER) if d["value"] == GARBAGE.hex()]
    assert dead and "fingerprint" in dead[0]["headers"]["kvstream-error"]


def test_a_publisher_restart_retires_its_earlier_epoch_and_a_late_join_marks_the_source_stale(pipeline):
    def rows(block: int) -> list:
        return [(r["instance_id"], r["tier"], r["copies"]) for r in
                _get(f"{pipeline['url']}/residency/{block.to_bytes(8, 'big').hex()}/")["rows"]]

    assert rows(0xAA) == [] and rows(0xAB) == [] and rows(0xAD) == []  # GPU and CPU of the old epoch: retired
    assert rows(0xAC) == [("engine-r", "GPU", 1)] and rows(0xBB) == [("engine-s", "GPU", 1)]
    sources = {s["instance_id"]: s for s in _get(f"{pipeline['url']}/sources/")["sources"]}
    assert sources["engine-r"]["restarts"] == 1 and sources["engine-r"]["stale"] is False
    assert sources["engine-s"]["stale"] is True
    assert (sources["engine-s"]["first_lost_seq"], sources["engine-s"]["last_lost_seq"]) == (0, 2)


def test_two_workers_share_the_partitions_and_forward_lookups(pipeline, kafka_bootstrap):
    """A second worker joins; each then holds some partitions, and both answer every block correctly.

    Last in the module: while the group rebalances after the second worker leaves, lookups answer 503.
    """
    first = pipeline["options"]
    second = WorkerOptions(kafka_bootstrap, web_port=_free_port(), data_dir=pipeline["work"] / "data-2",
                           partitions=PARTITIONS, app_id=first.app_id)
    process = spawn_worker(second, pipeline["work"] / "worker-2.log")
    urls = [pipeline["url"], f"http://127.0.0.1:{second.web_port}"]
    by_block = _rows_by_block(pipeline["result"].ground_truth)
    sample = random.Random(5).sample(sorted(by_block), 30)
    try:
        deadline = time.monotonic() + 120
        while True:  # until the rebalance and the second worker's table recovery are done
            try:
                assignment = _get(f"{urls[1]}/router/")
                answers = [[_answer(url, block) for block in sample] for url in urls]
                if all(answer == [by_block[b] for b in sample] for answer in answers) and assignment:
                    break
            except (OSError, urllib.error.HTTPError, KeyError):
                pass
            assert time.monotonic() < deadline, (pipeline["work"] / "worker-2.log").read_text()[-3000:]
            time.sleep(2)
        hosts = {host for host, tables in assignment.items()
                 if tables.get(f"{first.app_id}-residency-changelog")}
        assert len(hosts) == 2, assignment  # both workers hold residency partitions: lookups were forwarded
    finally:
        stop_worker(process)
