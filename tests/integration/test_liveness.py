"""Liveness on the real broker: sources hold a lease renewed by their events and heartbeats; a source whose lease
lapsed leaves every answer, one down for the expiry is cleared, and an unregistration removes an instance on every
worker and index (docs/residency.md, "Liveness")."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from kafka_io.admin import ensure_topics
from kafka_io.reader import messages_to_end
from kvstream.broker import free_port
from kvstream.worker import spawn_worker, stop_worker, wait_until_consumed
from producers.kafka_sink import KvEventProducer
from producers.split import Publisher, source_event, split_event
from schemas import SOURCE_HEARTBEAT
from schemas.topics import KV_EVENTS, TopicNames
from stream_apps.settings import WorkerSettings
from stream_apps.snapshot import read_table, resident_rows

pytestmark = pytest.mark.integration

PARTITIONS = 4
#: Topics of their own: kv-events is shared by the session's other tests, which must not see these sources.
PREFIX = "liveness-test."
APP_ID = "kvstream-liveness-test"
LEASE_S = 4.0
EXPIRY_S = 20.0
TOKENS = list(range(3000, 3016))


def _stored(seed: int) -> dict:
    """A GPU store as vLLM 0.33's block pool sends it, ``extra_keys`` included (a store without says no content)."""
    return {"type": "BlockStored", "block_hashes": [(seed << 32) + i for i in range(1, 5)], "parent_block_hash": None,
            "token_ids": TOKENS, "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None,
            "extra_keys": [None] * 4, "group_idx": 0}


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _matched(url: str) -> set[str]:
    """The instances a query by TOKENS hits (a registered instance that holds none of them is answered with 0)."""
    status, answer = _post(f"{url}/query", {"token_ids": TOKENS, "block_size": 4})
    assert status == 200, answer
    return {instance for instance, row in answer["instances"].items() if row["longest_matched"]}


def _until(read, expected, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if value == expected or time.monotonic() > deadline:
            return value
        time.sleep(0.3)


@pytest.fixture(scope="module")
def fleet(kafka_bootstrap, tmp_path_factory):
    ensure_topics(kafka_bootstrap, {PREFIX + KV_EVENTS: PARTITIONS})
    producer = KvEventProducer(kafka_bootstrap, PREFIX + KV_EVENTS)
    alive, dying, leaving = Publisher("alive"), Publisher("dying"), Publisher("leaving")
    for seed, publisher in enumerate((alive, dying, leaving), start=1):
        for record in split_event(publisher, 0, time.time(), 0, _stored(seed)):
            producer.send(record)
    producer.flush(30)
    stop = threading.Event()

    def beat() -> None:  # what the bridge does while it has evidence the engines are alive
        while not stop.is_set():
            for publisher in (alive, leaving):
                producer.send(source_event(publisher, SOURCE_HEARTBEAT, {"evidence": "replay"}, 0, time.time()))
            producer.flush(30)
            stop.wait(1.0)

    beater = threading.Thread(target=beat, daemon=True)
    work = tmp_path_factory.mktemp("liveness")
    workers, urls = [], []
    for i in range(2):
        settings = WorkerSettings(bootstrap_servers=kafka_bootstrap, web_port=free_port(), data_dir=work / f"w{i}",
                                  partitions=PARTITIONS, app_id=APP_ID, topic_prefix=PREFIX, store="memory://",
                                  source_lease_s=LEASE_S, source_expiry_s=EXPIRY_S)
        workers.append(spawn_worker(settings, work / f"worker-{i}.log"))
        urls.append(f"http://127.0.0.1:{settings.web_port}")
    index_port = free_port()
    with open(work / "index.log", "ab") as log:
        index = subprocess.Popen([sys.executable, "-m", "kvstream.cli", "index", "--bootstrap-servers",
                                  kafka_bootstrap, "--app-id", APP_ID, "--topic-prefix", PREFIX, "--web-port",
                                  str(index_port), "--default-block-size", "4", "--source-lease-s", str(LEASE_S)],
                                 stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_consumed(kafka_bootstrap, TopicNames(APP_ID, PREFIX), workers[0], timeout_s=300)
        beater.start()  # after: a steady stream of heartbeats would keep the group from ever being caught up
        profile = {"strategy": "vllm_v1", "algorithm": "sha256_cbor", "python_hash_seed": "0",
                   "index_projection": "low64_be"}
        for url in urls:  # Mooncake's conductor body, the same to every process
            for port, instance in enumerate(("alive", "dying", "leaving"), 5557):
                body = {"endpoint": f"tcp://10.0.0.2:{port}", "type": "vLLM", "modelname": "m", "instance_id": instance,
                        "block_size": 4, "dp_rank": 0, "hash_profile": profile}
                assert _post(f"{url}/register", body)[0] == 200
        yield {"workers": urls, "all": [*urls, f"http://127.0.0.1:{index_port}"], "bootstrap": kafka_bootstrap}
    except Exception:
        for log_file in sorted(work.glob("*.log")):
            print(log_file.name, log_file.read_text()[-3000:])
        raise
    finally:
        stop.set()
        if beater.is_alive():
            beater.join(10)
        index.terminate()
        index.wait(30)
        for process in workers:
            stop_worker(process)


def test_a_source_without_events_or_heartbeats_leaves_every_answer_within_a_lease(fleet):
    worker = fleet["workers"][0]
    assert _until(lambda: _matched(worker), {"alive", "leaving"}, 60) == {"alive", "leaving"}
    states = {w["instance_id"]: (w["live"], w["down_since"] is not None) for w in _get(f"{worker}/workers")["workers"]}
    assert states["alive"] == (True, False) and states["dying"] == (False, True)
    rows = _get(f"{worker}/residency/{((2 << 32) + 1).to_bytes(8, 'big').hex()}/")["rows"]
    assert rows == []  # dying's block: kept in the table, not answered
    with urllib.request.urlopen(f"{worker}/metrics", timeout=30) as response:
        metrics = response.read().decode()
    assert 'kvstream_sources{state="down"} 1.0' in metrics and 'kvstream_sources{state="live"} 2.0' in metrics
    occupancy = {(r["instance_id"], r["live"]) for r in _get(f"{worker}/occupancy/")["occupancy"]}
    assert ("dying", False) in occupancy and ("alive", True) in occupancy
    for url in fleet["all"]:
        assert _until(lambda url=url: _matched(url), {"alive", "leaving"}, 60) == {"alive", "leaving"}


def test_a_source_down_for_the_expiry_is_cleared_from_the_tables(fleet):
    def dying_rows() -> int:
        table = read_table(fleet["bootstrap"], TopicNames(APP_ID, PREFIX).changelog("residency"), "residency")
        return sum(1 for identity in resident_rows(table) if identity[0] == "dying")
    assert _until(dying_rows, 0, 90) == 0
    assert {identity[0] for identity in resident_rows(read_table(
        fleet["bootstrap"], TopicNames(APP_ID, PREFIX).changelog("residency"), "residency"))} == {"alive", "leaving"}


def test_unregister_removes_every_tier_of_an_instance_on_every_worker_and_index(fleet):
    # Mooncake's conductor body: the instance and its rank (never registered: known to the workers from its events)
    status, answer = _post(f"{fleet['workers'][1]}/unregister", {"instance_id": "leaving", "dp_rank": 0})
    assert status == 200 and answer == {"status": "unregistered successfully",
                                        "removed_instances": ["leaving|default|0"]}
    for url in fleet["all"]:
        assert _until(lambda url=url: _matched(url), {"alive"}, 60) == {"alive"}
    records = [m for m in messages_to_end(fleet["bootstrap"], PREFIX + KV_EVENTS) if m.key() is None]
    assert len(records) >= PARTITIONS  # a source-wide event on every partition
