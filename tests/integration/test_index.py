"""The fleet index end to end on the real broker: vLLM-shaped stores with tokens -> three workers and a
``kvstream index`` replica -> the router APIs by tokens and by engine hashes, equal on every process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import msgspec
import pytest

from kafka_io.admin import ensure_topics
from kvstream.broker import free_port
from kvstream.client import IndexClient
from kvstream.worker import spawn_worker, stop_worker, wait_until_consumed
from producers.kafka_sink import KvEventProducer
from producers.split import Publisher, split_event
from schemas.topics import KV_EVENTS, TopicNames
from stream_apps.settings import WorkerSettings

pytestmark = pytest.mark.integration

PARTITIONS = 4
#: Topics of their own: kv-events is shared by the session's other tests, which must not see these sources.
PREFIX = "index-test."
APP_ID = "kvstream-index-test"
BLOCK = 4
TOKENS = list(range(1000, 1016))  # four blocks of four tokens
OTHER = list(range(2000, 2016))


def _hashes(seed: int, n: int = 4) -> list[int]:
    return [(seed << 32) + i + 1 for i in range(n)]


def _stored(hashes, tokens, parent=None, medium="GPU", extra_keys=None, lora_name=None):
    """A GPU store as vLLM 0.33's block pool sends it: ``extra_keys`` with an entry per block (None: no keys); a
    store without tokens (the CPU tier's) sends none, as its offloading connector does."""
    if extra_keys is None and tokens:
        extra_keys = [None] * len(hashes)
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BLOCK, "lora_id": None, "medium": medium, "lora_name": lora_name, "group_idx": 0,
            **({"extra_keys": extra_keys} if extra_keys is not None else {})}


def _publish(bootstrap: str) -> None:
    """As vLLM 0.33's publisher shapes them: a plain chain, a LoRA chain (``[['adapter-1']] * n``), a salted chain
    (``[['tenant-1'], None, ...]``), and a chain whose GPU copies were evicted after a tokenless CPU store."""
    producer = KvEventProducer(bootstrap, PREFIX + KV_EVENTS)
    seqs: dict = {}

    def send(publisher: Publisher, *events: dict) -> None:
        seq = seqs[publisher] = seqs.get(publisher, -1) + 1
        for index, event in enumerate(events):
            for record in split_event(publisher, seq, time.time(), index, event):
                producer.send(record)

    send(Publisher("plain"), _stored(_hashes(1), TOKENS))
    send(Publisher("lora"), _stored(_hashes(2), TOKENS, extra_keys=[["adapter-1"]] * 4, lora_name="adapter-1"))
    send(Publisher("salted"), _stored(_hashes(3), TOKENS, extra_keys=[["tenant-1"], None, None, None]))
    offload = Publisher("offload")
    send(offload, _stored(_hashes(4), OTHER))
    send(offload, _stored(_hashes(4), [], medium="CPU"))  # the CPU tier's store carries no tokens
    send(offload, {"type": "BlockRemoved", "block_hashes": _hashes(4), "medium": "GPU", "group_idx": 0})
    producer.flush(30)


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _wait_ready(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready in {timeout_s} s")


@pytest.fixture(scope="module")
def fleet(kafka_bootstrap, tmp_path_factory):
    ensure_topics(kafka_bootstrap, {PREFIX + KV_EVENTS: PARTITIONS})
    _publish(kafka_bootstrap)
    work = tmp_path_factory.mktemp("index-fleet")
    workers, urls = [], []
    for i in range(3):
        settings = WorkerSettings(bootstrap_servers=kafka_bootstrap, web_port=free_port(), data_dir=work / f"w{i}",
                                  partitions=PARTITIONS, app_id=APP_ID, topic_prefix=PREFIX, store="memory://")
        workers.append(spawn_worker(settings, work / f"worker-{i}.log"))
        urls.append(f"http://127.0.0.1:{settings.web_port}")
    index_port = free_port()
    with open(work / "index.log", "ab") as log:
        index = subprocess.Popen([sys.executable, "-m", "kvstream.cli", "index", "--bootstrap-servers",
                                  kafka_bootstrap, "--app-id", APP_ID, "--topic-prefix", PREFIX, "--web-port",
                                  str(index_port), "--default-block-size", str(BLOCK)], stdout=log,
                                 stderr=subprocess.STDOUT)
    try:
        wait_until_consumed(kafka_bootstrap, TopicNames(APP_ID, PREFIX), workers[0], timeout_s=300)
        index_url = f"http://127.0.0.1:{index_port}"
        for url in [*urls, index_url]:
            _wait_ready(url)
        # the workers' own indexes answer with the default block size of 16: register ours, with one process;
        # kv-instances brings the registrations to every other
        for port, instance in enumerate(("plain", "lora", "salted", "offload"), 5600):
            assert _post(f"{urls[0]}/register", _registration(instance, endpoint=f"tcp://10.0.0.5:{port}"))[0] == 200
        for url in [*urls, index_url]:
            assert _eventually(lambda url=url: _registered(url), dict.fromkeys(INSTANCES, BLOCK)) == dict.fromkeys(
                INSTANCES, BLOCK), url
        yield {"workers": urls, "index": index_url, "all": [*urls, index_url]}
    except Exception:
        for log in sorted(work.glob("*.log")):
            print(log.name, log.read_text()[-3000:])
        raise
    finally:
        index.terminate()
        index.wait(30)
        for process in workers:
            stop_worker(process)


INSTANCES = ("plain", "lora", "salted", "offload")
PROFILE = {"strategy": "vllm_v1", "algorithm": "sha256_cbor", "python_hash_seed": "0", "index_projection": "low64_be"}


def _registration(instance: str, **fields) -> dict:
    """A whole ``POST /register`` body, as Mooncake's conductor takes it (its cache-aware proxy sends every field)."""
    return {"endpoint": "tcp://10.0.0.1:5557", "type": "vLLM", "modelname": "m", "instance_id": instance,
            "block_size": BLOCK, "dp_rank": 0, "tenant_id": "default", "lora_name": "", "hash_profile": PROFILE,
            **fields}


def _registered(url: str) -> dict[str, int | None]:
    """instance -> registered block size, of the instances ``GET /workers`` says are registered."""
    with urllib.request.urlopen(f"{url}/workers", timeout=30) as response:
        workers = json.loads(response.read())["workers"]
    return {w["instance_id"]: w["block_size"] for w in workers if w.get("registered")}


def _ranks(url: str, instance: str) -> list[int]:
    """The data-parallel ranks ``GET /workers`` lists for ``instance``."""
    with urllib.request.urlopen(f"{url}/workers", timeout=30) as response:
        return sorted(w["data_parallel_rank"] for w in json.loads(response.read())["workers"]
                      if w["instance_id"] == instance)


def _eventually(read, expected, timeout_s: float = 30):
    """The index follows the changelog, which the workers write every --changelog-interval-s: poll a little."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if value == expected or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def _longest(url: str, **body) -> dict:
    """instance -> ``longest_matched`` of the instances the query hits (the registered others are answered with 0)."""
    status, answer = _post(f"{url}/query", {"token_ids": TOKENS, **body})
    assert status == 200, answer
    return {instance: a["longest_matched"] for instance, a in answer["instances"].items() if a["longest_matched"]}


def test_a_query_by_tokens_equals_the_query_by_engine_hashes_on_every_process(fleet):
    for url in fleet["all"]:
        assert _eventually(lambda url=url: _longest(url), {"plain": 16}) == {"plain": 16}
        assert _longest(url, lora_name="adapter-1") == {"lora": 16}
        assert _longest(url, cache_salt="tenant-1") == {"salted": 16}
        for seed, instance in ((1, "plain"), (2, "lora"), (3, "salted")):
            status, by_hash = _post(f"{url}/query_by_hash", {"seq_hashes": _hashes(seed)})
            assert status == 200 and by_hash["instances"][instance]["longest_matched"] == 16


def test_a_salt_never_used_matches_nothing_and_names_every_registered_instance_with_0(fleet):
    for url in fleet["all"]:
        assert _longest(url, cache_salt="never-used") == {}
        status, answer = _post(f"{url}/query", {"token_ids": TOKENS, "cache_salt": "never-used"})
        assert status == 200 and {i: a["longest_matched"] for i, a in answer["instances"].items()
                                  if i in INSTANCES} == dict.fromkeys(INSTANCES, 0)


def test_a_tokenless_cpu_copy_is_found_by_its_tokens_after_the_gpu_copy_left(fleet):
    for url in fleet["all"]:
        status, answer = _post(f"{url}/query", {"token_ids": OTHER})
        assert status == 200
        # the GPU phase misses at block 0, the CPU phase reads all four blocks (the older API's names beside)
        assert answer["instances"]["offload"] == {
            "longest_matched": 16, "gpu": 0, "cpu": 16, "disk": 16, "dp": {"0": 0},
            "rank_matches": {"0": {"gpu": 0, "cpu": 16, "disk": 16}}, "GPU": 0, "CPU": 16, "DISK": 16, "DP": {"0": 0}}


def test_every_process_answers_every_query_the_same(fleet):
    bodies = [{"token_ids": TOKENS}, {"token_ids": OTHER}, {"token_ids": TOKENS, "lora_name": "adapter-1"},
              {"token_ids": TOKENS[:8] + OTHER[8:]}]
    answers = [[_post(f"{url}/query", body)[1]["instances"] for body in bodies] for url in fleet["all"]]
    assert all(a == answers[0] for a in answers)
    chain = [h.to_bytes(8, "big").hex() for h in _hashes(1)]
    matches = [_post(f"{url}/prefix-match/", {"block_hashes": chain})[1]["matches"] for url in fleet["all"]]
    assert matches[0] == [{"instance_id": "plain", "data_parallel_rank": 0, "matched_blocks": 4,
                           "prefix_blocks": {"GPU": 4}, "score": 4.0}]
    assert all(m == matches[0] for m in matches)


def test_a_registration_with_one_process_reaches_every_process_and_so_does_its_unregistration(fleet):
    body = _registration("late", modelname="llama-3", block_size=32, dp_rank=1, endpoint="tcp://10.0.0.9:5558")
    assert _post(f"{fleet['index']}/register", body)[0] == 200
    # ranks accumulate in the process asked: once the first registration has reached it (the latest record wins)
    assert _eventually(lambda: _ranks(fleet["workers"][1], "late"), [1]) == [1]
    assert _post(f"{fleet['workers'][1]}/register", {**body, "dp_rank": 0, "endpoint": "tcp://10.0.0.9:5557"})[0] \
        == 200
    for url in fleet["all"]:
        assert _eventually(lambda url=url: _registered(url).get("late"), 32) == 32, url
        assert _eventually(lambda url=url: _ranks(url, "late"), [0, 1]) == [0, 1], url
    # one rank at a time, by its service key, with any process once the last change has reached it
    status, answer = _post(f"{fleet['workers'][2]}/unregister", {"instance_id": "late", "dp_rank": 1})
    assert (status, answer) == (200, {"status": "unregistered successfully", "removed_instances": ["late|default|1"]})
    for url in fleet["all"]:
        assert _eventually(lambda url=url: _ranks(url, "late"), [0]) == [0], url
    status, answer = _post(f"{fleet['index']}/unregister", {"instance_id": "late", "dp_rank": 0})
    assert (status, answer) == (200, {"status": "unregistered successfully", "removed_instances": ["late|default|0"]})
    for url in fleet["all"]:
        assert _eventually(lambda url=url: "late" in _registered(url), False) is False, url
        assert _post(f"{url}/unregister", {"instance_id": "late", "dp_rank": 0}) == (
            404, {"error": "service not found: late|default|0"}), url


def test_a_producers_registration_keeps_what_a_router_registered(fleet, kafka_bootstrap):
    """kvstream bridge --model-name/--block-size and kvstream simulate register their sources merged into what a
    router registered: the router's hash profile and ranks stay, the producer's model and block size are added."""
    from stream_apps.index.fleet_index import SourceInfo
    from stream_apps.index.registrations import read_registrations, register_sources

    profile = {"strategy": "vllm_v1", "algorithm": "sha256_cbor", "python_hash_seed": "0",
               "index_projection": "low64_be"}
    assert _post(f"{fleet['workers'][0]}/register", _registration(
        "bridged", dp_rank=1, hash_profile=profile, modelname="qwen-2", block_size=32,
        endpoint="tcp://10.0.0.7:5558"))[0] == 200
    topic = TopicNames(APP_ID, PREFIX).instances
    assert _eventually(lambda: "bridged" in read_registrations(kafka_bootstrap, topic), True) is True
    written = register_sources(kafka_bootstrap, topic, [
        SourceInfo("bridged", model_name="qwen-2", block_size=32, endpoint="tcp://10.0.0.7:5557", dp_ranks={0}),
        SourceInfo("bridged", model_name="qwen-2", block_size=32, endpoint="tcp://10.0.0.7:5557", dp_ranks={2})])
    assert [(w.instance_id, w.dp_ranks, w.hash_profile) for w in written] == [("bridged", {0, 1, 2}, profile)]
    found = read_registrations(kafka_bootstrap, topic)["bridged"]
    assert (found.model_name, found.block_size, found.dp_ranks, found.hash_profile) == ("qwen-2", 32, {0, 1, 2},
                                                                                        profile)
    for url in fleet["all"]:
        assert _eventually(lambda url=url: _registered(url).get("bridged"), 32) == 32, url


def test_the_python_client_speaks_msgpack_to_the_index(fleet):
    with IndexClient(fleet["index"], timeout_s=10) as client:
        assert client.query(TOKENS)["instances"]["plain"]["longest_matched"] == 16
        hits = client.query(TOKENS, cache_salt="tenant-1")["instances"]
        assert {instance for instance, row in hits.items() if row["longest_matched"]} == {"salted"}
        workers = {w["instance_id"]: w["blocks"] for w in client.workers()["workers"]}
        assert workers["offload"] == {"CPU": 4} and workers["plain"] == {"GPU": 4}


def test_dump_streams_every_block_as_json_lines(fleet):
    with urllib.request.urlopen(f"{fleet['index']}/dump", timeout=30) as response:
        blocks = [msgspec.json.decode(line) for line in response.read().splitlines()]
    assert {b["block_hash"] for b in blocks} >= {h.to_bytes(8, "big").hex() for h in _hashes(1)}


def test_paths_without_the_trailing_slash_answer_too(fleet):
    chain = [h.to_bytes(8, "big").hex() for h in _hashes(1)]
    for url in (fleet["workers"][0], fleet["index"]):
        status, answer = _post(f"{url}/prefix-match", {"block_hashes": chain})
        assert status == 200 and answer["matches"][0]["matched_blocks"] == 4
    with urllib.request.urlopen(f"{fleet['workers'][0]}/residency/{chain[0]}", timeout=30) as response:
        assert json.loads(response.read())["rows"][0]["instance_id"] == "plain"


def test_a_registrations_feed_waits_for_its_topic_with_one_consumer_and_then_reads_it(kafka_bootstrap, monkeypatch):
    """Until kv-instances exists the feed looks for it every TOPIC_LOOK_S with the same consumer (a new client per
    look started threads and connections every second); once it exists that consumer reads it from the start."""
    from stream_apps.index import compacted_feed
    from stream_apps.index.registrations import RegistrationsFeed, RegistrationWriter
    from stream_apps.index.sources import SourceInfo

    monkeypatch.setattr(compacted_feed, "TOPIC_LOOK_S", 0.0)
    topic = TopicNames(f"look-{int(time.time() * 1000)}").instances
    applied = []
    feed = RegistrationsFeed(kafka_bootstrap, topic, lambda key, info: applied.append((key, info)))
    try:
        assert feed.poll() == 0 and feed.poll() == 0
        looking = feed._look.consumer
        assert looking is not None and feed._consumer is None
        assert feed.poll() == 0 and feed._look.consumer is looking  # the third look: still the same client
        writer = RegistrationWriter(kafka_bootstrap, topic)
        writer.write(SourceInfo("late-engine", model_name="llama-3", block_size=16))
        writer.close()
        deadline = time.monotonic() + 30
        while not applied and time.monotonic() < deadline:
            feed.poll(0.2)
        assert feed._consumer is looking and feed._look.consumer is None
        assert [(key, info.model_name, info.block_size) for key, info in applied] == [("late-engine", "llama-3", 16)]
    finally:
        feed.close()


def _msgpack_post(url: str, body: dict, method: str = "POST") -> tuple[int, dict, str]:
    """``(status, decoded msgpack answer, content type)``, as Mooncake's cache-aware proxy sends and reads them."""
    request = urllib.request.Request(url, data=None if body is None else msgspec.msgpack.encode(body), method=method,
                                     headers={"Content-Type": "application/msgpack"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, msgspec.msgpack.decode(response.read()), response.headers["Content-Type"]
    except urllib.error.HTTPError as exc:
        return exc.code, msgspec.msgpack.decode(exc.read()), exc.headers["Content-Type"]


def _services(url: str) -> dict:
    status, services, content_type = _msgpack_post(f"{url}/services", None, "GET")
    assert (status, content_type) == (200, "application/msgpack")
    return services


def test_a_wrong_method_answers_the_conductors_405_on_every_process(fleet):
    """GET on /register, /unregister, /query; POST on /services, /global_view: 405 ``Method not allowed``, a
    msgpack map (issue 49: aiohttp's and Faust's plain-text 405 before)."""
    for url in fleet["all"]:
        for method, path in (("GET", "/register"), ("GET", "/unregister"), ("GET", "/query"), ("GET", "/query/"),
                             ("POST", "/services"), ("POST", "/global_view")):
            assert _msgpack_post(f"{url}{path}", None if method == "GET" else {}, method) == (
                405, {"error": "Method not allowed"}, "application/msgpack"), (url, method, path)


def test_mooncakes_proxy_registers_queries_and_unregisters_in_msgpack(fleet):
    """What Mooncake's cache-aware proxy sends (mooncake-conductor/example/cache_aware_disagg_proxy.py), over HTTP:
    a msgpack registration per rank, the same again at its next start, a msgpack query with the tokens as a bin of
    little-endian int32, ``instances[id].longest_matched`` read from a msgpack map; then a conflicting registration
    and an unknown service key, refused by every process as the conductor refuses them."""
    import struct

    ranks = {0: "tcp://10.0.0.8:5557", 1: "tcp://10.0.0.8:5558"}
    for _ in range(2):  # a restarted proxy registers again: the same success, nothing new
        for rank, endpoint in ranks.items():
            assert _msgpack_post(f"{fleet['index']}/register", _registration("proxy-a", dp_rank=rank,
                                                                             endpoint=endpoint)) == (
                200, {"status": "registered successfully", "instance_id": "proxy-a"}, "application/msgpack")
    for url in fleet["all"]:
        assert _eventually(lambda url=url: [(s["DPRank"], s["Endpoint"]) for s in _services(url)["services"]
                                            if s["InstanceID"] == "proxy-a"], list(ranks.items())) == list(
            ranks.items()), url
        status, answer, content_type = _msgpack_post(f"{url}/query", {
            "model": "m", "block_size": BLOCK, "token_ids": struct.pack(f"<{len(TOKENS)}i", *TOKENS),
            "tenant_id": "default", "lora_name": ""})
        assert (status, content_type) == (200, "application/msgpack")
        assert answer["instances"]["plain"]["longest_matched"] == 16
        assert answer["instances"]["proxy-a"]["rank_matches"] == {"0": {"gpu": 0, "cpu": 0, "disk": 0},
                                                                  "1": {"gpu": 0, "cpu": 0, "disk": 0}}
        status, refused, _ = _msgpack_post(f"{url}/register", _registration("proxy-a", modelname="other-model",
                                                                            endpoint=ranks[0]))
        assert (status, refused["reason"], refused["field"]) == (400, "invalid_registration", "modelname"), url
        status, refused, _ = _msgpack_post(f"{url}/register", _registration("proxy-b", endpoint=ranks[1]))
        assert (status, refused["reason"], refused["field"]) == (400, "invalid_registration", "endpoint"), url
        assert _msgpack_post(f"{url}/unregister", {"instance_id": "proxy-a", "dp_rank": 7})[:2] == (
            404, {"error": "service not found: proxy-a|default|7"})
    status, view, _ = _msgpack_post(f"{fleet['workers'][0]}/global_view", None, "GET")
    [context] = [c for c in view["contexts"] if "proxy-a" in c["instances"]]
    assert (context["model_name"], context["block_size"], context["instances"]["proxy-a"], context["hash_profile"][
        "root_digest"]) == ("m", BLOCK, [0, 1], "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e")
    assert context["prefix_count"] >= 4  # plain's four blocks, among the others of the context
    # one rank after the other, each once the last change has reached every process (the latest record of an
    # instance is its registration: docs/querying.md)
    for rank in ranks:
        assert _msgpack_post(f"{fleet['workers'][rank]}/unregister", {"instance_id": "proxy-a", "dp_rank": rank}) == (
            200, {"status": "unregistered successfully", "removed_instances": [f"proxy-a|default|{rank}"]},
            "application/msgpack")
        left = [r for r in ranks if r > rank]
        for url in fleet["all"]:
            assert _eventually(lambda url=url: [s["DPRank"] for s in _services(url)["services"]
                                                if s["InstanceID"] == "proxy-a"], left) == left, url


def test_kvstream_unregister_removes_the_registration_and_refuses_an_unknown_instance(fleet, kafka_bootstrap,
                                                                                       capsys):
    """Issue 49 item 5: after ``kvstream unregister`` the instance still showed ``registered: true``. It now also
    removes the registration from kv-instances, and refuses an instance neither registered nor known from its
    events, as ``POST /unregister`` answers 404."""
    from kvstream.cli import main

    assert _post(f"{fleet['workers'][0]}/register", _registration("cli-a", endpoint="tcp://10.0.0.6:5557"))[0] == 200
    flags = ["--bootstrap-servers", kafka_bootstrap, "--app-id", APP_ID, "--topic-prefix", PREFIX]
    deadline = time.monotonic() + 30
    while main(["unregister", "cli-a", *flags]) != 0 and time.monotonic() < deadline:
        time.sleep(0.5)  # until the registration is in kv-instances
    assert "unregistered cli-a (every rank: cli-a|default|0)" in capsys.readouterr().err
    for url in fleet["all"]:
        assert _eventually(lambda url=url: "cli-a" in _registered(url), False) is False, url
    assert main(["unregister", "nobody", "--dp-rank", "3", *flags]) == 1
    err = capsys.readouterr().err
    assert "kvstream unregister: error: service not found: nobody|default|3" in err and "nothing written" in err
