"""End to end on the real broker: trace slice -> producer -> kv-events -> Faust worker -> residency tables.

One worker runs for the module. It consumes a slice of the Mooncake trace replayed through a fleet with small
pools (so blocks cascade GPU -> CPU -> KVCR and get evicted), a GPU reset, and one undecodable record.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request

import msgspec
import pytest
from aiokafka.partitioner import murmur2
from confluent_kafka import Consumer, Producer

from kafka_io.admin import ensure_topics
from kafka_io.config import client_config
from kafka_io.reader import messages_to_end
from kvstream.broker import free_port
from kvstream.worker import spawn_worker, stop_worker, wait_until_consumed
from producers.bridge import Bridge, BridgeMetrics, KafkaBatchSink, PublisherEndpoint
from producers.kafka_sink import KvEventProducer
from producers.simulator import FleetConfig, load_trace, replay_to_kafka
from producers.split import Publisher, split_event
from schemas import AvroCodec
from schemas.topics import KV_EVENTS, KV_EVENTS_DEAD_LETTER, TopicNames, changelog_topic
from stream_apps.settings import WorkerSettings
from stream_apps.snapshot import compare_rows, read_table, resident_rows

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


def _publish_residency_cases(bootstrap: str) -> None:
    """The residency cases of docs/residency.md, each on its own instances."""
    producer = KvEventProducer(bootstrap, KV_EVENTS)
    seqs: dict = {}

    def send(publisher: Publisher, *events: dict) -> None:
        seq = seqs[publisher] = seqs.get(publisher, -1) + 1
        for index, event in enumerate(events):
            for record in split_event(publisher, seq, 1767231000.0 + seq, index, event):
                producer.send(record)

    def stored(h, parent=None, medium="GPU", group=0):
        return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent, "token_ids": [],
                "block_size": 16, "lora_id": None, "medium": medium, "lora_name": None, "group_idx": group}

    def removed(h, medium="GPU", group=0):
        return {"type": "BlockRemoved", "block_hashes": [h], "medium": medium, "group_idx": group}

    w0, w1 = (Publisher("case1", worker_rank=w, world_size=2, aggregation="REPLICATED") for w in (0, 1))
    send(w0, stored(0x11), stored(0x11), stored(0x22), stored(0x22))
    send(w1, stored(0x22))
    e = Publisher("case2")
    send(e, stored(0xA1), stored(0xA2, 0xA1), stored(0xA3, 0xA2), stored(0xA3, 0xA2), stored(0xA4), stored(0xA4))
    send(e, removed(0xA3), removed(0xA4))
    send(e, removed(0xA3))
    e1, e2 = Publisher("case3-e1"), Publisher("case3-e2")
    send(e1, stored(0xC1))
    send(e2, stored(0xC1))
    send(e1, stored(0xC2, medium="CPU"))
    send(e1, {"type": "AllBlocksCleared"})
    send(e1, stored(0xC3))
    e4 = Publisher("case4")
    send(e4, stored(0xD3, 0xD2), stored(0xD4, 0xD3), stored(0xD5, 0xD4))
    e5 = Publisher("case5")
    send(e5, stored(0xE1, medium="CPU", group=1), stored(0xE1, group=0), stored(0xE2, medium=None),
         stored(0xE3, medium="CPU_PINNED"), stored(0xE4, medium="NVME_X"))
    send(e5, removed(0xE1, "CPU", 1))
    send(Publisher("case6", 0), stored(0x61))
    send(Publisher("case6", 1), stored(0x62))
    # vLLM's unsigned 2**64-1 and SGLang's signed -1 are one block (the same instance sends both here, in turn)
    e7, e7_sglang = Publisher("case7"), Publisher("case7", engine="sglang")
    send(e7, stored(42), stored(2**64 - 1), stored(bytes(31) + b"\x2a"))
    seqs[e7_sglang] = seqs[e7]
    send(e7_sglang, stored(-1), stored(-7))
    producer.flush(30)


def _removal_without_hash() -> bytes:
    """Valid Avro, but a BlockRemoved without a block hash breaks the contract."""
    record = split_event(Publisher("bad"), 0, 0.0, 0, {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"})[0]
    return AvroCodec("kv_event").encode({**record, "block_hash": None})


LIAR_HASH = bytes.fromhex("5a5a5a5a5a5a5a5a")


def _primary_store(block_hash: bytes) -> bytes:
    """A valid BlockStored of the primary tiers (ownership null)."""
    record = split_event(Publisher("liar"), 0, 0.0, 0, _gpu(int.from_bytes(block_hash, "big")))[0]
    return AvroCodec("kv_event").encode(record)


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def pipeline(kafka_bootstrap, tmp_path_factory):
    ensure_topics(kafka_bootstrap, {KV_EVENTS: PARTITIONS})
    fleet = FleetConfig(gpu_blocks=600, cpu_blocks=900, kvcr_blocks=1200, clear_instance=1, clear_at=0.6)
    result = replay_to_kafka(load_trace(limit=600), KvEventProducer(kafka_bootstrap, KV_EVENTS), fleet)
    _publish_bridge_scenarios(kafka_bootstrap)
    _publish_residency_cases(kafka_bootstrap)
    garbage = Producer(client_config(kafka_bootstrap))
    garbage.produce(KV_EVENTS, key=b"bad-key", value=GARBAGE, partition=0)
    garbage.produce(KV_EVENTS, key=b"no-hash", value=_removal_without_hash(), partition=0)
    garbage.produce(KV_EVENTS, key=LIAR_HASH, value=_primary_store(LIAR_HASH),
                    partition=(murmur2(LIAR_HASH) & 0x7FFFFFFF) % PARTITIONS,
                    headers={"kvstream-ownership": b"kvcr"})  # a header that contradicts the record: the record wins
    garbage.flush(30)
    work = tmp_path_factory.mktemp("worker")
    started = time.time()
    options = WorkerSettings(bootstrap_servers=kafka_bootstrap, web_port=free_port(), data_dir=work / "data",
                            partitions=PARTITIONS, app_id="kvstream-test", residency_changes=True,
                            aggregation="skew=2:REPLICATED")
    process = spawn_worker(options, work / "worker.log")
    try:
        wait_until_consumed(kafka_bootstrap, options.app_id, process, timeout_s=300)
        yield {"result": result, "options": options, "url": f"http://127.0.0.1:{options.web_port}", "work": work,
               "started": started}
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
    consumer.subscribe([TopicNames(pipeline["options"].app_id).residency_changes])
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
    # each event of engine-r's first epoch that was applied before the restart reached its partition made a row
    # that the restart retired and published as stopped; one that came after was retired late and made no row.
    # Which happened depends on how the partitions interleave (a run may have none of the first kind), so the
    # stopped rows are compared with the source's count: events_applied less the new epoch's one event (0xAC)
    stopped = sorted(k[6] for k, (resident, _) in last.items() if not resident and k[0] == "engine-r")
    sources = {s["instance_id"]: s for s in _get(f"{pipeline['url']}/sources/")["sources"]}
    assert len(stopped) == sources["engine-r"]["events_applied"] - 1
    assert set(stopped) <= {h.to_bytes(8, "big") for h in (0xAA, 0xAB, 0xAD)}


def test_tier_occupancy_topic_sums_to_the_occupancy_view(pipeline, kafka_bootstrap):
    table = read_table(kafka_bootstrap, TopicNames(pipeline["options"].app_id).tier_occupancy, "tier_occupancy")
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
    for bad in ("not-hex", "a1b2c3d4e5f6", "3e9"):  # 12 hex digits is no hash: refused, not an empty answer
        with pytest.raises(urllib.error.HTTPError) as excinfo:
            _get(f"{pipeline['url']}/residency/{bad}/")
        assert excinfo.value.code == 400
        assert "16 or 64 hex digits" in json.loads(excinfo.value.read())["error"]
    # the decimal form vLLM logs finds the same rows as the hex form
    assert (_get(f"{pipeline['url']}/residency/{0xA1}/")["rows"]
            == _get(f"{pipeline['url']}/residency/{0xA1:016x}/")["rows"])


def test_residency_answers_without_the_trailing_slash_too(pipeline):
    """Issue 28: routers write ``GET /residency/<hash>``; it answers as the documented path does."""
    block = (0xA1).to_bytes(8, "big").hex()
    with_slash, without = (_get(f"{pipeline['url']}/residency/{block}{end}") for end in ("/", ""))
    assert with_slash["rows"] and without["rows"] == with_slash["rows"]  # sources' lag_s moves with the clock
    assert [s["instance_id"] for s in without["sources"]] == [s["instance_id"] for s in with_slash["sources"]]
    with pytest.raises(urllib.error.HTTPError) as refused:
        _get(f"{pipeline['url']}/residency/3e9")
    assert refused.value.code == 400


def test_the_fleet_views_say_whether_the_workers_have_caught_up_with_their_input(pipeline, kafka_bootstrap, capsys):
    """Issue 28: ``query occupancy`` right after ``simulate`` answered partial figures without a word."""
    import asyncio

    from kafka_io.admin import GroupProgressReader, group_progress
    from kvstream.cli import main
    from stream_apps.fleet import InputLagReader

    url, names = pipeline["url"], TopicNames(pipeline["options"].app_id)
    deadline = time.monotonic() + 60
    while not (occupancy := _get(f"{url}/occupancy/"))["caught_up"]:  # the module's other tests may add events
        assert time.monotonic() < deadline, {k: v for k, v in occupancy.items() if k != "occupancy"}
        time.sleep(1)
    assert occupancy["lag"] == 0 and occupancy["lag_by_topic"] == {KV_EVENTS: 0, names.by_ownership: 0}
    sources = _get(f"{url}/sources/")
    assert sources["caught_up"] is True and sources["lag"] == 0 and sources["sources"]
    assert main(["query", "occupancy", "--wait-caught-up", "--worker-url", url]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["caught_up"] is True and "warning" not in err
    # an app whose workers never ran has all of kv-events to go: what a fleet view says right after simulate
    with GroupProgressReader(kafka_bootstrap) as progress:
        never = asyncio.run(InputLagReader.for_app(progress, TopicNames("never-started")).reading())
    events = group_progress(kafka_bootstrap, "never-started-repartition", [KV_EVENTS])[KV_EVENTS].end
    assert never.caught_up is False and never.lag == never.topics[KV_EVENTS] == events > 0


def test_sources_measure_arrival_lag_by_the_workers_clock(pipeline):
    """Issue 28: on the simulator's trace (engine clock 2026-01-01) lag_s is the trace's age; arrival_lag_s is how
    long ago a worker applied the source's last event."""
    before = time.time()
    sources = [s for s in _get(f"{pipeline['url']}/sources/")["sources"] if s["instance_id"].startswith("sim-")]
    after = time.time()
    assert sources
    for source in sources:
        assert pipeline["started"] <= source["applied_ts"] <= before, source
        assert before - source["applied_ts"] - 0.01 <= source["arrival_lag_s"] <= after - source["applied_ts"] + 0.01
        assert source["lag_s"] == pytest.approx(before - source["last_event_ts"], abs=after - before + 1)


def test_the_workers_log_has_no_recovery_tables_at_level_info(pipeline):
    """Issue 28: Faust's recovery tables flooded a worker's foreground output."""
    log = (pipeline["work"] / "worker.log").read_text()
    assert "[^Worker]: Ready" in log and "Highwater" not in log and "Reading Starts At" not in log


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
                if message.error() or message.key() in (b"bad-key", b"no-hash", LIAR_HASH):
                    continue
                record = codec.decode(message.value())
                if record["block_hash"] is None:
                    clears.add(message.partition())
                else:
                    assert message.key() == record["block_hash"]
                    # the ownership header the producers write for other consumers (schemas.topics.OWNERSHIP_HEADER)
                    assert message.headers() == [("kvstream-ownership",
                                                  (record["event"][1]["ownership"] or "").encode())]
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
    messages.sort(key=lambda m: [b"bad-key", b"no-hash"].index(m.key()))
    assert [m.key() for m in messages] == [b"bad-key", b"no-hash"]
    assert messages[0].value() == GARBAGE and messages[1].value() == _removal_without_hash()
    reasons = [dict(m.headers())["kvstream-error"] for m in messages]
    assert b"unknown kv_event schema fingerprint" in reasons[0]
    assert reasons[1] == b"BlockRemoved without block_hash or tier"
    assert _get(f"{pipeline['url']}/stats/")["dead_lettered"] == 2


def test_an_item_of_an_older_repartition_stage_that_contradicts_its_key_is_dead_lettered(pipeline, kafka_bootstrap):
    """ownership_batch v1 messages, from a repartition stage of before the block fields (a rolling upgrade), are
    still read; their items were routed by the ownership header, so the agent checks each record against its key."""
    from stream_apps.residency import key_partition

    app_id = pipeline["options"].app_id
    key = f"kvcr/{LIAR_HASH.hex()}"
    value = AvroCodec("ownership_batch", 1).encode({"events": [{"key": key, "clear_mark": None,
                                                                "event": _primary_store(LIAR_HASH)}]})
    producer = Producer(client_config(kafka_bootstrap))
    producer.produce(TopicNames(app_id).by_ownership, value=value, partition=key_partition(key, PARTITIONS))
    producer.flush(30)
    consumer = Consumer(client_config(kafka_bootstrap, **{"group.id": "test-dead-letter-v1",
                                                          "auto.offset.reset": "earliest"}))
    consumer.subscribe([KV_EVENTS_DEAD_LETTER])
    try:
        found = []
        for _ in range(60):
            found += [m for m in consumer.consume(100, timeout=1.0) if not m.error() and m.key() == key.encode()]
            if found:
                break
    finally:
        consumer.close()
    assert [m.value() for m in found] == [_primary_store(LIAR_HASH)]
    assert dict(found[0].headers())["kvstream-error"] == (
        f"routed as {key!r}, but the record's ownership is None and its block hash {LIAR_HASH.hex()}").encode()
    assert _rows(pipeline, LIAR_HASH) == [("liar", 0, "GPU", "GPU", 0, 1)]  # the record's own row, unchanged


def test_a_replicated_store_without_its_content_digest_is_applied_from_its_record(pipeline, kafka_bootstrap):
    """A repartition process that did not know this worker's --aggregation (started with other settings, or
    messages written before a restart that added it) writes a replicated source's stores without their content
    digest: the agent applies them from their records, so workers that stored different content still disagree."""
    from schemas.avro_writers import encode_keyed_event, encode_ownership_batch
    from schemas.block_event import BlockFieldsWriter
    from stream_apps.residency import key_partition

    block = 0x5C5C
    key = f"primary/{block:016x}"
    events, writer, items = AvroCodec("kv_event"), BlockFieldsWriter(), []
    for worker, tokens in ((0, [1, 2]), (1, [9, 9])):  # "skew" is 2:REPLICATED by the worker's settings only
        value = events.encode(split_event(Publisher("skew", worker_rank=worker), 0, 1.0, 0,
                                          {**_gpu(block), "token_ids": tokens})[0])
        items.append(encode_keyed_event(key, b"\x00", value, writer.block(events.decode(value))))  # no digest
    before = _get(f"{pipeline['url']}/stats/")["replica_disagreements"]
    producer = Producer(client_config(kafka_bootstrap))
    producer.produce(TopicNames(pipeline["options"].app_id).by_ownership, partition=key_partition(key, PARTITIONS),
                     value=encode_ownership_batch(AvroCodec("ownership_batch").header, items, writer.tables()))
    producer.flush(30)
    deadline = time.monotonic() + 60
    while _get(f"{pipeline['url']}/stats/")["replica_disagreements"] == before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _get(f"{pipeline['url']}/stats/")["replica_disagreements"] == before + 1
    assert _rows(pipeline, block) == []  # the two workers hold different blocks under one hash: not resident


def test_the_record_not_its_ownership_header_decides_the_residency_key(pipeline):
    """The kvstream-ownership header is a producer's courtesy to other consumers: the repartition stage decodes
    every record, and a header that says kvcr on a record of ownership null does not move it."""
    assert _rows(pipeline, LIAR_HASH) == [("liar", 0, "GPU", "GPU", 0, 1)]


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
    # a key stored and removed within one changelog interval is a tombstone the first time it is written (its
    # latest value), so the topic may start with one: the first entry with a value is checked, and a tombstone
    # prints as a null value
    changelog = lines(changelog_topic(pipeline["options"].app_id, "residency"), 200)
    entry = next(e for e in changelog if e["value"] is not None)
    assert entry["key"] == f"{entry['value']['ownership'] or 'primary'}/{entry['value']['block_hash']}"
    assert all(e["key"] for e in changelog)
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
    # an old-epoch event that reaches its partition after the restart's copy there is retired late, not applied;
    # which of the three do depends on how the partitions interleave, but each of the four is counted once
    retired_late = _get(f"{pipeline['url']}/stats/")["retired_late"]
    assert sources["engine-r"]["events_applied"] + retired_late == 4 and retired_late <= 3
    assert sources["engine-r"]["last_event_ts"] == 1767230000.0
    assert sources["engine-s"]["stale"] is True
    assert (sources["engine-s"]["first_lost_seq"], sources["engine-s"]["last_lost_seq"]) == (0, 2)
    assert sources["engine-s"]["gaps"] == 1 and sources["engine-r"]["gaps"] == 0
    answer = _get(f"{pipeline['url']}/residency/{(0xBB).to_bytes(8, 'big').hex()}/")
    assert [(s["instance_id"], s["stale"]) for s in answer["sources"]] == [("engine-s", True)]
    assert answer["sources"][0]["lag_s"] > 0


def _rows(pipeline, block) -> list:
    key = block.hex() if isinstance(block, bytes) else (block & (2**64 - 1)).to_bytes(8, "big").hex()
    return sorted((r["instance_id"], r["data_parallel_rank"], r["tier"], r["medium"], r["group_idx"], r["copies"])
                  for r in _get(f"{pipeline['url']}/residency/{key}/")["rows"])


def test_case1_replicated_workers_must_agree(pipeline):
    assert _rows(pipeline, 0x11) == []  # W0 twice, W1 never: one worker's duplicate is not agreement
    assert _rows(pipeline, 0x22) == [("case1", 0, "GPU", "GPU", 0, 1)]


def test_case2_reference_counting(pipeline):
    assert _rows(pipeline, 0xA4) == [("case2", 0, "GPU", "GPU", 0, 1)]  # stored twice, removed once
    assert _rows(pipeline, 0xA3) == []  # stored twice, removed twice
    assert _rows(pipeline, 0xA1) == _rows(pipeline, 0xA2) == [("case2", 0, "GPU", "GPU", 0, 1)]


def test_case3_clear_is_scoped_to_its_source_and_the_gpu_tier(pipeline):
    assert _rows(pipeline, 0xC1) == [("case3-e2", 0, "GPU", "GPU", 0, 1)]
    assert _rows(pipeline, 0xC2) == [("case3-e1", 0, "CPU", "CPU", 0, 1)]
    assert _rows(pipeline, 0xC3) == [("case3-e1", 0, "GPU", "GPU", 0, 1)]


def test_case4_stores_with_an_unseen_parent_are_resident_and_counted_once(pipeline):
    for block in (0xD3, 0xD4, 0xD5):
        assert _rows(pipeline, block) == [("case4", 0, "GPU", "GPU", 0, 1)]
    assert _get(f"{pipeline['url']}/stats/")["unknown_parents"] == 1  # 0xD2 was never seen; 0xD3, 0xD4 were


def test_case5_media_map_to_tiers_and_unknown_media_are_kept(pipeline):
    assert _rows(pipeline, 0xE1) == [("case5", 0, "GPU", "GPU", 0, 1)]
    assert _rows(pipeline, 0xE2) == [("case5", 0, "GPU", None, 0, 1)]
    assert _rows(pipeline, 0xE3) == [("case5", 0, "CPU", "CPU_PINNED", 0, 1)]
    assert _rows(pipeline, 0xE4) == [("case5", 0, "UNKNOWN", "NVME_X", 0, 1)]
    assert _get(f"{pipeline['url']}/stats/")["unknown_media"] == {"NVME_X": 1}


def test_case6_data_parallel_ranks_do_not_overwrite_each_other(pipeline):
    assert _rows(pipeline, 0x61) == [("case6", 0, "GPU", "GPU", 0, 1)]
    assert _rows(pipeline, 0x62) == [("case6", 1, "GPU", "GPU", 0, 1)]


def test_case7_unsigned_and_signed_forms_are_one_block_digests_are_others(pipeline):
    assert _rows(pipeline, 2**64 - 1) == [("case7", 0, "GPU", "GPU", 0, 2)]  # 2**64-1 and -1
    assert _rows(pipeline, 42) == [("case7", 0, "GPU", "GPU", 0, 1)]
    assert _rows(pipeline, bytes(31) + b"\x2a") == [("case7", 0, "GPU", "GPU", 0, 1)]
    assert _rows(pipeline, -7) == [("case7", 0, "GPU", "GPU", 0, 1)]


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_prefix_match_scores_each_source_by_its_consecutive_prefix(pipeline):
    hashes = [(h).to_bytes(8, "big").hex() for h in (0xA1, 0xA2, 0xA4, 0x99)]
    status, answer = _post(f"{pipeline['url']}/prefix-match/", json.dumps({"block_hashes": hashes}).encode())
    assert status == 200 and answer["block_count"] == 4
    assert answer["matches"] == [{"instance_id": "case2", "data_parallel_rank": 0, "matched_blocks": 3,
                                  "prefix_blocks": {"GPU": 3}, "score": 3.0}]


def test_query_cli_wraps_the_views(pipeline, capsys):
    from kvstream.cli import main

    hashes = [(h).to_bytes(8, "big").hex() for h in (0xA1, 0xA2)]
    assert main(["query", "prefix-match", *hashes, "--worker-url", pipeline["url"]]) == 0
    assert json.loads(capsys.readouterr().out)["matches"][0]["matched_blocks"] == 2
    assert main(["query", "residency", hashes[0], "--worker-url", pipeline["url"]]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["instance_id"] == "case2"
    assert main(["query", "residency", str(0xA1), "--worker-url", pipeline["url"]]) == 0  # vLLM's decimal form
    assert json.loads(capsys.readouterr().out)["rows"][0]["instance_id"] == "case2"
    assert main(["query", "residency", "3e9", "--worker-url", pipeline["url"]]) == 2
    assert "block hash '3e9': expected 16 or 64 hex digits" in capsys.readouterr().err


@pytest.mark.parametrize("body, reason", [
    (b"not json", "not JSON"),
    (b'{"block_hashes": []}', "at least one hash"),
    (b'{"block_hashes": ["zz"]}', "expected 16 or 64 hex digits"),
    (json.dumps({"block_hashes": ["00" * 8] * 3000}).encode(), "limit 2048"),
    (b'{"block_hashes": ["' + b"0" * 300000 + b'"]}', "limit 262144"),
])
def test_prefix_match_rejects_bad_requests_with_a_reason(pipeline, body, reason):
    status, answer = _post(f"{pipeline['url']}/prefix-match/", body)
    assert status == 400 and reason in answer["error"]


def test_two_workers_share_the_partitions_and_forward_lookups(pipeline, kafka_bootstrap):
    """A second worker joins; each then holds some partitions, and both answer every block correctly.

    Last in the module: while the group rebalances after the second worker leaves, lookups answer 503.
    """
    first = pipeline["options"]
    second = WorkerSettings(bootstrap_servers=kafka_bootstrap, web_port=free_port(),
                           data_dir=pipeline["work"] / "data-2", partitions=PARTITIONS, app_id=first.app_id,
                           residency_changes=True)
    second_started = time.time()
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
        # the second worker read the sources from their changelog: when the first applied each, not its own start
        applied = [{s["instance_id"]: s["applied_ts"] for s in _get(f"{url}/sources/")["sources"]} for url in urls]
        assert applied[0].keys() == applied[1].keys()
        for instance, applied_ts in applied[1].items():
            assert applied_ts < second_started and applied_ts == pytest.approx(applied[0][instance], abs=2), instance
    finally:
        stop_worker(process)



def test_case3_with_clear_scope_all_the_clear_also_removes_offloaded_copies(pipeline, kafka_bootstrap):
    """A second app (its own id, tables and re-keyed topic) over the same kv-events, with --clear-scope all."""
    options = WorkerSettings(bootstrap_servers=kafka_bootstrap, web_port=free_port(),
                            data_dir=pipeline["work"] / "data-all", partitions=PARTITIONS, app_id="kvstream-test-all",
                            clear_scope="all", residency_changes=True)
    process = spawn_worker(options, pipeline["work"] / "worker-all.log")
    try:
        wait_until_consumed(kafka_bootstrap, options.app_id, process, timeout_s=300)
        url = f"http://127.0.0.1:{options.web_port}"
        assert _rows({"url": url}, 0xC2) == []  # the CPU copy went with the clear
        assert _rows({"url": url}, 0xC3) == [("case3-e1", 0, "GPU", "GPU", 0, 1)]
        assert _rows({"url": url}, 0xC1) == [("case3-e2", 0, "GPU", "GPU", 0, 1)]
    finally:
        stop_worker(process)
    # each app's output topics hold its own changes only: each replays to its own table, and the tables differ
    replayed = {app_id: _replayed_changes(kafka_bootstrap, app_id) for app_id in (pipeline["options"].app_id,
                                                                                   options.app_id)}
    tables = {app_id: resident_rows(read_table(kafka_bootstrap, changelog_topic(app_id, "residency"), "residency"))
              for app_id in replayed}
    # (a change record marks a row becoming or ceasing to be resident; a copies change alone publishes none)
    for app_id in replayed:
        assert set(replayed[app_id]) == set(tables[app_id]), app_id
    assert set(tables[options.app_id]) != set(tables[pipeline["options"].app_id])


def test_faust_s_own_reader_of_the_rekeyed_topic_makes_the_same_table(pipeline, kafka_bootstrap):
    """A second app over the same kv-events whose agent reads the re-keyed topic through Faust's consumer
    (``--rekeyed-reader faust``) ends with the same residency table as the default librdkafka reader's, the
    simulator's rows equal to the ground truth, and its group committed the whole re-keyed topic."""
    options = WorkerSettings(bootstrap_servers=kafka_bootstrap, web_port=free_port(),
                            data_dir=pipeline["work"] / "data-faust-reader", partitions=PARTITIONS,
                            app_id="kvstream-test-faust-reader", aggregation="skew=2:REPLICATED",
                            rekeyed_reader="faust")
    process = spawn_worker(options, pipeline["work"] / "worker-faust-reader.log")
    try:
        wait_until_consumed(kafka_bootstrap, options.app_id, process, timeout_s=300)
    finally:
        stop_worker(process)
    assert "rekeyed reader" not in (pipeline["work"] / "worker-faust-reader.log").read_text()
    assert "rekeyed reader: generation" in (pipeline["work"] / "worker.log").read_text()
    tables = [resident_rows(read_table(kafka_bootstrap, changelog_topic(app_id, "residency"), "residency"))
              for app_id in (pipeline["options"].app_id, options.app_id)]
    assert tables[0] == tables[1]
    simulated = {identity: copies for identity, copies in tables[1].items() if identity[0].startswith("sim-")}
    assert compare_rows(pipeline["result"].ground_truth, simulated).differences == []


def _replayed_changes(bootstrap: str, app_id: str) -> dict[tuple, int]:
    """The resident rows an app's kv-residency-changes topic ends with (last change per row wins)."""
    codec = AvroCodec("residency_change")
    last = {}
    for message in messages_to_end(bootstrap, TopicNames(app_id).residency_changes):
        c = codec.decode(message.value())
        last[(c["instance_id"], c["data_parallel_rank"], c["tier"], c["ownership"], c["locality"], c["group_idx"],
              c["block_hash"])] = c["copies"] if c["resident"] else 0
    return {identity: copies for identity, copies in last.items() if copies}
