"""The read path's content keys end to end on the real broker: producers -> kv-events -> a worker -> the residency
entries read back from ``<app>-residency-changelog`` (stream_apps/snapshot.py) with their ``content_hash`` and
``parent_block_hash`` (residency v3).

One worker of its own app, under a topic prefix of its own, consumes:

- a vLLM-shaped engine: a GPU store of three blocks with tokens (through the bridge's path, split and encoded in
  one step), the offload connector's tokenless CPU store of the middle block, then the GPU removal of that block;
- a store written by a producer of before kv_event v4 (no content hash), which the repartition process gives one, and
  one without ``extra_keys``, which does not say its extra keys and gets none;
- a slice of the Mooncake trace through the simulator, whose GPU stores carry content hashes without tokens.
"""

from __future__ import annotations

import pytest
from confluent_kafka import Producer

from kafka_io.admin import ensure_topics
from kafka_io.config import client_config
from kvstream.broker import free_port
from kvstream.worker import spawn_worker, stop_worker, wait_until_consumed
from producers.kafka_sink import KvEventProducer
from producers.simulator import FleetConfig, block_hash_of, load_trace, replay_to_kafka, trace_block_content_hash
from producers.split import Publisher, split_event
from schemas import BLOCK_STORED, AvroCodec
from schemas.content_hash import block_content_hashes, content_hash
from schemas.topics import TopicNames
from stream_apps.settings import WorkerSettings
from stream_apps.snapshot import read_table

pytestmark = pytest.mark.integration

PARTITIONS = 2
PREFIX = "content-keys."
APP_ID = "content-keys"
#: The vLLM engine's blocks: a chain 0xC0 -> 0xC1 -> 0xC2 -> 0xC3, of which it stores the last three.
PARENT, FIRST, MIDDLE, LAST = 0xC0, 0xC1, 0xC2, 0xC3
TOKENS = list(range(1000, 1012))
#: Blocks stored by a producer that wrote kv_event v3 (no content_hash field): a vLLM 0.33 GPU store, and one without
#: ``extra_keys`` (a salted or LoRA block for all anyone knows).
OLD_BLOCK, UNSAID_BLOCK, OLD_TOKENS = 0xD1, 0xD2, [7, 7, 7, 7]


def _h(block: int) -> bytes:
    return block.to_bytes(8, "big")


def _publish(bootstrap: str, topics: TopicNames) -> None:
    producer = KvEventProducer(bootstrap, topics.kv_events, dead_letter_topic=topics.dead_letter)
    engine = Publisher("vllm-e", 0, publisher_epoch=1767230000000)
    gpu_store = {"type": "BlockStored", "block_hashes": [FIRST, MIDDLE, LAST], "parent_block_hash": PARENT,
                 "token_ids": TOKENS, "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None,
                 "extra_keys": [None, None, None], "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    cpu_store = {"type": "BlockStored", "block_hashes": [MIDDLE], "parent_block_hash": None, "token_ids": [],
                 "block_size": 0, "lora_id": None, "medium": "CPU", "lora_name": None, "group_idx": 0}
    gpu_removal = {"type": "BlockRemoved", "block_hashes": [MIDDLE], "medium": "GPU", "group_idx": 0}
    for seq, event in enumerate([gpu_store, cpu_store, gpu_removal]):
        producer.send_event(engine, seq, 1767230000.0 + seq, 0, event)
    replay_to_kafka(load_trace(limit=80), producer, FleetConfig(gpu_blocks=500, cpu_blocks=100, kvcr_blocks=5000,
                                                                clear_instance=None))
    producer.flush(60)
    # records as a v3 producer wrote them: the same stores, without content_hash
    old = Producer(client_config(bootstrap))
    store = {"type": "BlockStored", "block_hashes": [OLD_BLOCK], "parent_block_hash": None, "token_ids": OLD_TOKENS,
             "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None}
    for seq, event in enumerate([{**store, "extra_keys": [None]}, {**store, "block_hashes": [UNSAID_BLOCK]}]):
        record = split_event(Publisher("old-producer"), seq, 1767230000.0, 0, event)[0]
        body = {k: v for k, v in record["event"][1].items() if k != "content_hash"}
        old.produce(topics.kv_events, key=record["block_hash"], partition=0,
                    value=AvroCodec("kv_event", 3).encode({**record, "event": (BLOCK_STORED, body)}))
    old.flush(30)


@pytest.fixture(scope="module")
def table(kafka_bootstrap, tmp_path_factory):
    topics = TopicNames(APP_ID, prefix=PREFIX)
    ensure_topics(kafka_bootstrap, {topics.kv_events: PARTITIONS})
    _publish(kafka_bootstrap, topics)
    work = tmp_path_factory.mktemp("content-keys")
    options = WorkerSettings(bootstrap_servers=kafka_bootstrap, web_port=free_port(), data_dir=work / "data",
                             partitions=PARTITIONS, app_id=APP_ID, topic_prefix=PREFIX)
    process = spawn_worker(options, work / "worker.log")
    try:
        wait_until_consumed(kafka_bootstrap, topics, process, timeout_s=300)
        yield read_table(kafka_bootstrap, topics.changelog("residency"), "residency")
    except Exception:
        print((work / "worker.log").read_text()[-5000:])
        raise
    finally:
        stop_worker(process)


def _entry(table: dict, block: int, ownership: str = "primary") -> dict:
    return table[f"{ownership}/{_h(block).hex()}"]


def test_a_vllm_store_with_tokens_gives_each_entry_its_content_hash_and_parent(table):
    hashes = block_content_hashes(TOKENS, 4)
    for block, parent, content in [(FIRST, PARENT, hashes[0]), (MIDDLE, FIRST, hashes[1]), (LAST, MIDDLE, hashes[2])]:
        entry = _entry(table, block)
        assert (entry["parent_block_hash"], entry["content_hash"]) == (_h(parent), content), hex(block)
    assert [row["tier"] for row in _entry(table, LAST)["rows"]] == ["GPU"]


def test_an_entry_whose_gpu_copy_was_removed_keeps_the_content_of_its_tokenless_cpu_copy(table):
    entry = _entry(table, MIDDLE)
    assert [(row["tier"], row["copies"]) for row in entry["rows"]] == [("CPU", 1)]
    assert (entry["parent_block_hash"], entry["content_hash"]) == (_h(FIRST), content_hash(TOKENS[4:8]))


def test_a_store_of_an_older_producer_gets_its_content_hash_in_the_repartition_process(table):
    entry = _entry(table, OLD_BLOCK)
    assert (entry["parent_block_hash"], entry["content_hash"]) == (None, content_hash(OLD_TOKENS))
    unsaid = _entry(table, UNSAID_BLOCK)  # no extra_keys: its tokens alone may be another namespace's content
    assert (unsaid["parent_block_hash"], unsaid["content_hash"]) == (None, None)


def test_simulated_entries_carry_the_content_hashes_of_their_trace_blocks_tokens(table):
    """The simulator publishes no tokens, only each GPU store's content hash: every entry of a trace block has it,
    also one whose GPU copy was evicted to the CPU tier; the KVCR tier's placeholder stores give none."""
    by_hash = {_h(block_hash_of(i)): i for request in load_trace(limit=80) for i in request.hash_ids}
    primary = {key: e for key, e in table.items() if key.startswith("primary/") and e["block_hash"] in by_hash}
    assert len(primary) > 1000
    for entry in primary.values():
        assert entry["content_hash"] == trace_block_content_hash(by_hash[entry["block_hash"]])
    assert any({row["tier"] for row in e["rows"]} == {"CPU"} for e in primary.values())  # evicted from the GPU
    kvcr = [e for key, e in table.items() if key.startswith("kvcr/")]
    assert kvcr and all(e["content_hash"] is None and e["parent_block_hash"] is None for e in kvcr)
