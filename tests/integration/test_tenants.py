"""Tenants kept apart end to end on the real broker (issue 49, item 3): vLLM 0.33's events for salted and LoRA requests
and their offloaded copies -> the producer's bridge path -> a worker -> ``POST /query`` by tokens.

vLLM's GPU block pool says a salted request's extra keys (``extra_keys: [['tenant-1'], None, None, None]``); its
``OffloadingEventsTracker`` stores the same block hashes on the CPU tier with their tokens, without ``extra_keys`` and
with ``lora_name`` null. One worker of its own app, under a topic prefix of its own, consumes:

- ``salted``: a salted GPU store, the tracker's CPU store of the same blocks, then the GPU removal: only the CPU copies
  remain, and they answer the query with the salt only;
- ``plain``: the same tokens without salt, on the GPU: the only answer to the query without salt;
- ``lora``: a LoRA request's GPU store, its copy on the kvcr tier (STORAGE, ownership ``kvcr``) with tokens and no
  extra keys, then the GPU removal: the kvcr copies answer the query for that adapter only;
- ``restarted``: a salted request's CPU store that its producer never saw stored on the GPU (a bridge started after
  it): its content is unknown, and it answers no query by tokens (its engine hashes still find it).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from kafka_io.admin import ensure_topics
from kvstream.broker import free_port
from kvstream.worker import spawn_worker, stop_worker, wait_until_consumed
from producers.kafka_sink import KvEventProducer
from producers.split import Publisher
from schemas.content_hash import block_content_hashes, query_extra_keys
from schemas.engine_hashes import HashProfile, engine_block_hashes
from schemas.topics import TopicNames
from stream_apps.settings import WorkerSettings
from stream_apps.snapshot import read_table

pytestmark = pytest.mark.integration

PARTITIONS = 2
PREFIX = "tenants-test."
APP_ID = "kvstream-tenants-test"
#: vLLM's default block size, which the worker's index assumes for instances that registered none.
BLOCK = 16
TOKENS = list(range(5000, 5064))  # four blocks
PROFILE = HashProfile("sha256", "0")
SALT, ADAPTER = "tenant-1", "sql-adapter"


def _hashes(lora=None, salt=None, profile=PROFILE) -> list[int]:
    return [int.from_bytes(h, "big") for h in engine_block_hashes(profile, TOKENS, BLOCK, lora, salt)]


def _gpu_store(hashes, lora=None, salt=None) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": TOKENS,
            "block_size": BLOCK, "lora_id": 3 if lora else None, "medium": "GPU", "lora_name": lora,
            "extra_keys": [query_extra_keys(i, lora, salt) for i in range(len(hashes))], "group_idx": 0,
            "kv_cache_spec_kind": "full_attention"}


def _offload_store(hashes, medium="CPU", ownership=None) -> dict:
    """The OffloadingEventsTracker's store: the block hashes and their tokens, no extra_keys field, lora_name null."""
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": TOKENS,
             "block_size": BLOCK, "lora_id": None, "medium": medium, "lora_name": None, "group_idx": 0}
    if ownership:
        event["ownership"] = ownership
    return event


def _gpu_removal(hashes) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


def _publish(bootstrap: str, topics: TopicNames) -> None:
    producer = KvEventProducer(bootstrap, topics.kv_events, dead_letter_topic=topics.dead_letter)
    salted, lora = _hashes(salt=SALT), _hashes(lora=ADAPTER)
    streams = {
        "salted": [_gpu_store(salted, salt=SALT), _offload_store(salted), _gpu_removal(salted)],
        "plain": [_gpu_store(_hashes())],
        "lora": [_gpu_store(lora, lora=ADAPTER), _offload_store(lora, "STORAGE", "kvcr"), _gpu_removal(lora)],
    }
    for instance, events in streams.items():
        publisher = Publisher(instance, 0, publisher_epoch=1767240000000)
        for seq, event in enumerate(events):
            producer.send_event(publisher, seq, time.time(), 0, event)
    producer.flush(60)
    # another producer (a bridge started after the GPU store): the CPU store's content is unknown to it
    restarted = KvEventProducer(bootstrap, topics.kv_events, dead_letter_topic=topics.dead_letter)
    restarted.send_event(Publisher("restarted", 0, publisher_epoch=1767240000000), 7, time.time(), 0,
                         _offload_store(_hashes(salt=SALT, profile=HashProfile("sha256", "1"))))
    restarted.flush(60)


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def worker(kafka_bootstrap, tmp_path_factory):
    topics = TopicNames(APP_ID, prefix=PREFIX)
    ensure_topics(kafka_bootstrap, {topics.kv_events: PARTITIONS})
    _publish(kafka_bootstrap, topics)
    work = tmp_path_factory.mktemp("tenants")
    settings = WorkerSettings(bootstrap_servers=kafka_bootstrap, web_port=free_port(), data_dir=work / "data",
                              partitions=PARTITIONS, app_id=APP_ID, topic_prefix=PREFIX, store="memory://",
                              source_lease_s=3600.0)
    process = spawn_worker(settings, work / "worker.log")
    try:
        wait_until_consumed(kafka_bootstrap, topics, process, timeout_s=300)
        url = f"http://127.0.0.1:{settings.web_port}"
        # the worker's index follows the residency changelog, written every --changelog-interval-s
        deadline = time.monotonic() + 60
        while _post(f"{url}/query_by_hash", {"seq_hashes": _hashes(salt=SALT, profile=HashProfile("sha256", "1"))}
                    )[1].get("instances", {}).get("restarted") is None:
            assert time.monotonic() < deadline, "the worker's index never held the restarted source's blocks"
            time.sleep(0.5)
        yield {"url": url, "table": read_table(kafka_bootstrap, topics.changelog("residency"), "residency")}
    except Exception:
        print((work / "worker.log").read_text()[-5000:])
        raise
    finally:
        stop_worker(process)


def _query(worker, **body) -> dict:
    """instance -> (longest prefix matched, of which on the GPU), in tokens, of every instance ``/query`` names with a
    match."""
    status, answer = _post(f"{worker['url']}/query", {"token_ids": TOKENS, **body})
    assert status == 200, answer
    return {instance: (a["longest_matched"], a["GPU"]) for instance, a in answer["instances"].items()
            if a["longest_matched"]}


def test_a_salted_blocks_cpu_copy_answers_the_query_with_its_salt_and_no_other(worker):
    assert _query(worker, cache_salt=SALT) == {"salted": (64, 0)}  # the CPU copies: the GPU ones were removed
    assert _query(worker) == {"plain": (64, 64)}  # no salt: the unsalted request's blocks only
    assert _query(worker, cache_salt="tenant-2") == {}


def test_a_lora_blocks_copy_of_another_ownership_answers_its_adapter_only(worker):
    assert _query(worker, lora_name=ADAPTER) == {"lora": (64, 0)}  # the kvcr tier's copies
    assert _query(worker, lora_name="other-adapter") == {}
    assert _query(worker, lora_name=ADAPTER, cache_salt=SALT) == {}


def test_a_store_whose_content_its_producer_did_not_know_answers_no_query_by_tokens(worker):
    for body in ({}, {"cache_salt": SALT}):
        assert "restarted" not in _query(worker, **body)
    status, answer = _post(f"{worker['url']}/query_by_hash",
                           {"seq_hashes": _hashes(salt=SALT, profile=HashProfile("sha256", "1"))})
    assert status == 200 and answer["instances"]["restarted"]["longest_matched"] == 64


def test_the_residency_entries_keep_the_content_of_their_namespace(worker):
    table = worker["table"]
    for hashes, contents, ownership in ((_hashes(salt=SALT), block_content_hashes(TOKENS, BLOCK, cache_salt=SALT),
                                         "primary"),
                                        (_hashes(lora=ADAPTER), block_content_hashes(TOKENS, BLOCK, ADAPTER), "kvcr")):
        entries = [table[f"{ownership}/{h.to_bytes(8, 'big').hex()}"] for h in hashes]
        assert [e["content_hash"] for e in entries] == contents
        assert [e["parent_block_hash"] for e in entries] == [None, *(h.to_bytes(8, "big") for h in hashes[:-1])]
    restarted = _hashes(salt=SALT, profile=HashProfile("sha256", "1"))
    assert [table[f"primary/{h.to_bytes(8, 'big').hex()}"]["content_hash"] for h in restarted] == [None] * 4
