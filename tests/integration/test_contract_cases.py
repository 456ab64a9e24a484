"""Contract and residency edge cases taken from engines' and indexers' bug reports, each with its right value,
through the real path: a capture file published by ``kvstream produce``'s code, the broker, and a worker.

Each case uses its own instance names, so the cases share one app, one worker and one topic prefix."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from kafka_io.admin import ensure_topics
from kafka_io.config import client_config
from kafka_io.reader import messages_to_end
from kvstream.broker import free_port
from kvstream.worker import spawn_worker, stop_worker, wait_until_consumed
from producers.bridge import BridgeMetrics, KafkaBatchSink
from producers.capture import produce_capture
from producers.kafka_sink import KvEventProducer
from producers.split import rebuild_event
from schemas import AvroCodec
from schemas.topics import ERROR_HEADER
from stream_apps.repartition import repartition_group
from stream_apps.settings import WorkerSettings

pytestmark = pytest.mark.integration

PARTITIONS = 3
TS = 1767225600.0


def _stored(hashes: list[int], parent: int | None = None, **fields) -> dict:
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
             "token_ids": list(range(2 * len(hashes))), "block_size": 2, "lora_id": None, "medium": "GPU",
             "lora_name": None}
    event.update(fields)
    return event


def _line(instance: str, seq: int, events: list[dict], **publisher) -> dict:
    return {"instance_id": instance, "data_parallel_rank": 0, "seq": seq, "ts": TS + seq, "events": events,
            **publisher}


EAGLE_STORE = {"type": "BlockStored", "block_hashes": [0x701, -0x702], "parent_block_hash": None,
               "token_ids": [[11, 12], [12, 13], [13, 14], [14, 15]], "block_size": 2, "lora_id": None,
               "cache_salt": "tenant-a"}

#: instance -> the capture lines of one case.
CASES = {
    # 1. a batch seq beyond Avro's long: refused with a reason naming the field; the next batch flows
    "range": [_line("range-e", 0, [_stored([0x101])]), _line("range-e", 2**63, [_stored([0x102])]),
              _line("range-e", 2**63 + 1, [_stored([0x103]), _stored([0x104])])],
    # 3. five stores, applied once each however often they are delivered
    "count": [_line("count-e", seq, [_stored([0x200 + seq])]) for seq in range(5)],
    # 4. seq 6, 7, then 7 again: a duplicate, not a restart
    "repeat": [_line("repeat-e7", 6, [_stored([0x306])]), _line("repeat-e7", 7, [_stored([0x307])]),
               _line("repeat-e7", 7, [_stored([0x307])])],
    # 2. a required field absent: dead-lettered naming it, never published as a default
    "missing": [_line("missing-e", 0, [{k: v for k, v in _stored([0x501]).items() if k != "parent_block_hash"},
                                       {k: v for k, v in _stored([0x502]).items() if k != "token_ids"},
                                       _stored([0x503])])],
    # 11. SGLang's hashes are signed whatever their values' signs
    "sglang": [_line("sglang-e", 0, [{"type": "BlockStored", "block_hashes": [0x601], "parent_block_hash": None,
                                      "token_ids": [1, 2], "block_size": 2, "lora_id": None}], engine="sglang")],
    # 9, 10. SGLang with EAGLE: bigram token ids; and its cache_salt: stored, and rebuilt from Kafka as sent
    "eagle": [_line("eagle-e", 0, [EAGLE_STORE], engine="sglang")],
    # 8. SHARDED: rank 1 stores a child of the block rank 0 stored: its parent is known
    "sharded": [_line("shard-e", 0, [_stored([0x401])], worker_rank=0, world_size=2, aggregation="SHARDED"),
                _line("shard-e", 0, [_stored([0x402], parent=0x401)], worker_rank=1, world_size=2,
                      aggregation="SHARDED")],
    # 5. REPLICATED, world size 2: rank 0 and rank 1 store 0x5A with different LoRA names (not agreement), and
    # 0x5B with equal content (agreement)
    "replicated": [_line("r2", 0, [_stored([0x5A], lora_name="a"), _stored([0x5B], lora_name="a")], worker_rank=0,
                         world_size=2, aggregation="REPLICATED"),
                   _line("r2", 0, [_stored([0x5A], lora_name="b"), _stored([0x5B], lora_name="a")], worker_rank=1,
                         world_size=2, aggregation="REPLICATED")],
}


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _sources(url: str) -> dict[str, dict]:
    return {s["instance_id"]: s for s in _get(f"{url}/sources/")["sources"]}


@pytest.fixture(scope="module")
def worker(kafka_bootstrap, tmp_path_factory):
    work = tmp_path_factory.mktemp("contract-cases")
    settings = WorkerSettings(bootstrap_servers=kafka_bootstrap, app_id="cases", partitions=PARTITIONS,
                              topic_prefix=f"cases{int(time.time() * 1000)}.", web_port=free_port(),
                              data_dir=work / "data")
    topics = settings.topics
    ensure_topics(kafka_bootstrap, {topics.kv_events: PARTITIONS, topics.dead_letter: 1})
    capture = work / "cases.jsonl"
    capture.write_text("".join(json.dumps(line) + "\n" for lines in CASES.values() for line in lines))
    producer = KvEventProducer(kafka_bootstrap, topics.kv_events, dead_letter_topic=topics.dead_letter)
    metrics = BridgeMetrics()
    produce_capture(capture, KafkaBatchSink(producer, metrics), metrics)
    stats = producer.flush()
    process = spawn_worker(settings, work / "worker.log")
    try:
        wait_until_consumed(kafka_bootstrap, topics, process, timeout_s=180)
        yield {"settings": settings, "process": process, "url": f"http://127.0.0.1:{settings.web_port}",
               "metrics": metrics, "produced": stats, "work": work}
    finally:
        stop_worker(process)


def _rows(url: str, block: int) -> list[tuple]:
    rows = _get(f"{url}/residency/{block:016x}/")["rows"]
    return [(r["instance_id"], r["tier"], r["copies"]) for r in rows]


def test_an_out_of_range_seq_is_dead_lettered_by_the_producer_naming_the_field(worker, kafka_bootstrap):
    topics = worker["settings"].topics
    reasons = [dict(m.headers())[ERROR_HEADER].decode() for m in messages_to_end(kafka_bootstrap, topics.dead_letter)]
    assert sum("seq=9223372036854775808" in r and "long range" in r for r in reasons) == 1
    assert sum("seq=9223372036854775809" in r for r in reasons) == 2  # both events of that batch
    assert _rows(worker["url"], 0x101) == [("range-e", "GPU", 1)]
    for block in (0x102, 0x103, 0x104):
        assert _rows(worker["url"], block) == []
    # nothing unreadable reached kv-events: the worker dead-lettered nothing of its own
    assert _get(f"{worker['url']}/stats/")["dead_lettered"] == 0


def test_a_repeated_batch_is_a_duplicate_not_a_restart(worker):
    source = _sources(worker["url"])["repeat-e7"]
    assert source["restarts"] == 0 and source["events_applied"] == 2
    assert worker["metrics"].batches_duplicate.labels("repeat-e7", "0")._value.get() == 1
    assert _rows(worker["url"], 0x307) == [("repeat-e7", "GPU", 1)]


def test_a_parent_stored_by_another_sharded_rank_is_known(worker):
    assert _get(f"{worker['url']}/stats/")["unknown_parents"] == 0
    assert _rows(worker["url"], 0x402) == [("shard-e", "GPU", 1)]


def test_an_absent_required_field_is_dead_lettered_naming_it(worker, kafka_bootstrap):
    reasons = [dict(m.headers())[ERROR_HEADER].decode()
               for m in messages_to_end(kafka_bootstrap, worker["settings"].topics.dead_letter)]
    assert sum("BlockStored from vllm lacks required field 'parent_block_hash'" in r for r in reasons) == 1
    assert sum("BlockStored from vllm lacks required field 'token_ids'" in r for r in reasons) == 1
    assert _rows(worker["url"], 0x501) == _rows(worker["url"], 0x502) == []  # not a root block, not a default
    assert _rows(worker["url"], 0x503) == [("missing-e", "GPU", 1)]  # the rest of the batch flowed


def test_an_sglang_hash_is_int64_whatever_its_sign(worker, kafka_bootstrap):
    codec = AvroCodec("kv_event")
    records = [codec.decode(m.value()) for m in messages_to_end(kafka_bootstrap, worker["settings"].topics.kv_events)]
    ours = [r for r in records if r["instance_id"] == "sglang-e"]
    assert ours and {r["hash_encoding"] for r in ours} == {"INT64"}
    assert _rows(worker["url"], 0x601) == [("sglang-e", "GPU", 1)]


def test_eagle_bigram_tokens_and_cache_salt_are_stored_and_rebuilt_as_sent(worker, kafka_bootstrap):
    codec = AvroCodec("kv_event")
    records = [codec.decode(m.value()) for m in messages_to_end(kafka_bootstrap, worker["settings"].topics.kv_events)]
    assert rebuild_event([r for r in records if r["instance_id"] == "eagle-e"]) == EAGLE_STORE
    assert _rows(worker["url"], 0x701) == [("eagle-e", "GPU", 1)]
    assert _rows(worker["url"], 2**64 - 0x702) == [("eagle-e", "GPU", 1)]  # -0x702 as SGLang's signed hash


def test_replicated_workers_that_store_different_content_under_one_hash_do_not_make_it_resident(worker):
    url = worker["url"]
    disagreeing = [(instance, tier, copies) for instance, tier, copies in _rows(url, 0x5A) if instance == "r2"]
    assert disagreeing == []  # the view lists resident rows only
    assert [row for row in _rows(url, 0x5B) if row[0] == "r2"] == [("r2", "GPU", 1)]
    assert _get(f"{url}/stats/")["replica_disagreements"] == 1
    occupancy = [r for r in _get(f"{url}/occupancy/")["occupancy"] if r["instance_id"] == "r2"]
    assert [(r["tier"], r["resident_blocks"]) for r in occupancy] == [("GPU", 1)]


def test_events_applied_counts_each_event_once_when_everything_is_delivered_again(worker, kafka_bootstrap):
    """Run last: the worker is stopped, both groups are rewound to the beginning, and a new worker reads
    everything again; the counts must not move, the redeliveries must show as duplicates."""
    before = _sources(worker["url"])
    assert before["count-e"]["events_applied"] == 5
    settings = worker["settings"]
    topics = settings.topics
    stop_worker(worker["process"])
    admin = AdminClient(client_config(kafka_bootstrap))
    rewinds = {repartition_group(topics.scoped_app_id): topics.kv_events, topics.scoped_app_id: topics.by_ownership}
    for group, topic in rewinds.items():
        partitions = [TopicPartition(topic, p, 0) for p in range(PARTITIONS)]
        admin.alter_consumer_group_offsets([ConsumerGroupTopicPartitions(group, partitions)])[group].result()
    process = spawn_worker(settings, worker["work"] / "worker-again.log")
    try:
        wait_until_consumed(kafka_bootstrap, topics, process, timeout_s=180)
        after = _sources(worker["url"])
        for instance, source in before.items():
            assert after[instance]["events_applied"] == source["events_applied"], instance
        assert _get(f"{worker['url']}/stats/")["duplicates"] >= 5
    finally:
        stop_worker(process)
