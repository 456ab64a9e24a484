"""The web port's credentials on a real fleet (issue 50): two workers and a ``kvstream index`` bound to 0.0.0.0 with
a token file and HTTPS (the workers with mutual TLS and tokens for reads too). From a second process with no token
every state-changing endpoint refuses and the fleet's answers are unchanged; with the token it works; a rotated-out
token stops working without a restart; the workers forward lookups to each other over mutual TLS with their token;
a malformed body to the worker's Faust web server is a 4xx, never a 500."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kafka_io.admin import ensure_topics
from kvstream.broker import free_port
from kvstream.client import IndexClient
from kvstream.tls import generate_tls_material
from kvstream.worker import spawn_worker, stop_worker, wait_until_consumed
from producers.kafka_sink import KvEventProducer
from producers.split import Publisher, split_event
from schemas.topics import KV_EVENTS, TopicNames
from stream_apps.settings import WorkerSettings

pytestmark = pytest.mark.integration

PARTITIONS = 4
PREFIX = "webaccess-test."
APP_ID = "kvstream-webaccess-test"
PROFILE = {"strategy": "vllm_v1", "algorithm": "sha256_cbor", "python_hash_seed": "0", "index_projection": "low64_be"}
REGISTRATION = {"endpoint": "tcp://10.0.0.1:5557", "type": "vLLM", "modelname": "m", "instance_id": "engine-9",
                "block_size": 4, "dp_rank": 0, "tenant_id": "default", "lora_name": "", "hash_profile": PROFILE}
HASHES = [(7 << 32) + i for i in range(1, 9)]

_SECOND_PROCESS = """
import json, sys
from kvstream.client import IndexClient, IndexQueryError
url, token, ca, cert, key, password = sys.argv[1:7]
registration = json.loads(sys.argv[7])
client = IndexClient(url, timeout_s=20, token=token or None, ca_file=ca, cert_file=cert or None, key_file=key or None,
                     key_password=password or None)
out = {}
for name, call in (("register", lambda: client.register(**registration)),
                   ("unregister", lambda: client.unregister(registration["instance_id"], 0))):
    try:
        out[name] = [200, call()]
    except IndexQueryError as exc:
        out[name] = [exc.status, exc.code]
print(json.dumps(out))
"""


def _replace(path: Path, text: str) -> None:
    temporary = path.with_suffix(".new")
    temporary.write_text(text)
    os.replace(temporary, path)


@pytest.fixture(scope="module")
def fleet(kafka_bootstrap, tmp_path_factory):
    work = tmp_path_factory.mktemp("web-access")
    tls = generate_tls_material(work / "tls")
    tokens = work / "tokens"
    _replace(tokens, "fleet s3cret-fleet\nrouter s3cret-router\n")
    ensure_topics(kafka_bootstrap, {PREFIX + KV_EVENTS: PARTITIONS})
    producer = KvEventProducer(kafka_bootstrap, PREFIX + KV_EVENTS)
    stored = {"type": "BlockStored", "block_hashes": HASHES, "parent_block_hash": None, "token_ids": list(range(32)),
              "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
              "extra_keys": [None] * len(HASHES)}
    for record in split_event(Publisher("engine-1"), 0, time.time(), 0, stored):
        producer.send(record)
    producer.flush(30)
    workers, urls = [], []
    for i in range(2):
        settings = WorkerSettings(bootstrap_servers=kafka_bootstrap, web_port=free_port(), web_bind="0.0.0.0",
                                  web_host="localhost", data_dir=work / f"w{i}", partitions=PARTITIONS, app_id=APP_ID,
                                  topic_prefix=PREFIX, store="memory://", api_token_file=tokens,
                                  read_requires_token=True, web_tls_cert=tls.broker_certificate,
                                  web_tls_key=tls.broker_key, web_tls_client_ca=tls.ca_certificate)
        workers.append(spawn_worker(settings, work / f"worker-{i}.log"))
        urls.append(f"https://localhost:{settings.web_port}")
    index_port = free_port()
    with open(work / "index.log", "ab") as log:
        index = subprocess.Popen([sys.executable, "-m", "kvstream.cli", "index", "--bootstrap-servers",
                                  kafka_bootstrap, "--app-id", APP_ID, "--topic-prefix", PREFIX, "--web-port",
                                  str(index_port), "--web-bind", "0.0.0.0", "--api-token-file", str(tokens),
                                  "--web-tls-cert", str(tls.broker_certificate), "--web-tls-key", str(tls.broker_key)],
                                 stdout=log, stderr=subprocess.STDOUT)
    client_tls = {"ca_file": tls.ca_certificate, "cert_file": tls.client_certificate, "key_file": tls.client_key,
                  "key_password": tls.client_key_password}
    try:
        wait_until_consumed(kafka_bootstrap, TopicNames(APP_ID, PREFIX), workers[0], timeout_s=300)
        index_url = f"https://localhost:{index_port}"
        deadline = time.monotonic() + 180
        for url in [*urls, index_url]:
            while True:
                try:
                    with IndexClient(url, timeout_s=5, token="s3cret-fleet", **client_tls) as client:
                        if client.workers().get("ready"):
                            break
                except (OSError, RuntimeError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} not ready")
                time.sleep(0.5)
        yield {"workers": urls, "index": index_url, "tls": tls, "tokens": tokens, "client_tls": client_tls,
               "work": work}
    except Exception:
        for log in sorted(work.glob("*.log")):
            print(log.name, log.read_text()[-3000:])
        raise
    finally:
        index.terminate()
        index.wait(30)
        for process in workers:
            stop_worker(process)


def _second(fleet, url: str, token: str = "") -> dict:
    tls = fleet["tls"]
    done = subprocess.run([sys.executable, "-c", _SECOND_PROCESS, url, token, str(tls.ca_certificate),
                           str(tls.client_certificate), str(tls.client_key), tls.client_key_password,
                           json.dumps(REGISTRATION)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _fleet_answers(fleet) -> list:
    answers = []
    for url in [*fleet["workers"], fleet["index"]]:
        with IndexClient(url, timeout_s=20, token="s3cret-fleet", **fleet["client_tls"]) as client:
            answers.append(sorted((w["instance_id"], w["data_parallel_rank"], bool(w.get("registered")))
                                  for w in client.workers()["workers"]))
    return answers


def _eventually(read, expected, timeout_s: float = 30):
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if value == expected or time.monotonic() > deadline:
            return value
        time.sleep(0.3)


def test_without_a_token_every_change_is_refused_on_every_process_and_the_answers_are_unchanged(fleet):
    before = _fleet_answers(fleet)
    for url in [*fleet["workers"], fleet["index"]]:
        refused = _second(fleet, url)
        assert refused["register"] == [401, "unauthorized"] and refused["unregister"] == [401, "unauthorized"], url
        wrong = _second(fleet, url, "s3cret-guess")
        assert wrong["register"] == [403, "forbidden"] and wrong["unregister"] == [403, "forbidden"], url
    time.sleep(2)  # a write would have reached the other processes through kv-instances by now
    assert _fleet_answers(fleet) == before


def test_with_the_token_a_change_works_and_a_rotated_out_token_stops_working_without_a_restart(fleet):
    worker, index = fleet["workers"][0], fleet["index"]
    allowed = _second(fleet, worker, "s3cret-router")
    assert allowed["register"][0] == 200 and allowed["unregister"][0] == 200, allowed
    _replace(fleet["tokens"], "fleet s3cret-fleet\nrouter2 s3cret-router-2\n")
    for url in (worker, index):
        assert _second(fleet, url, "s3cret-router")["register"] == [403, "forbidden"], url
    assert _second(fleet, index, "s3cret-router-2")["register"][0] == 200
    # a registration with the new token reaches every process through kv-instances
    with IndexClient(index, timeout_s=20, token="s3cret-router-2", **fleet["client_tls"]) as client:
        client.register(**REGISTRATION)
    expected = [[("engine-9", 0, True)]] * 3
    assert _eventually(lambda: [[w for w in answer if w[0] == "engine-9"] for answer in _fleet_answers(fleet)],
                       expected) == expected
    with IndexClient(worker, timeout_s=20, token="s3cret-fleet", **fleet["client_tls"]) as client:
        client.unregister("engine-9", 0)


def test_reads_need_the_token_on_the_workers_and_lookups_are_forwarded_over_mutual_tls(fleet):
    tls = fleet["tls"]
    with IndexClient(fleet["workers"][0], timeout_s=20, **fleet["client_tls"]) as client:
        with pytest.raises(RuntimeError, match="401"):
            client.workers()
    token_file = fleet["work"] / "client-token"
    token_file.write_text("s3cret-fleet\n")
    common = ["--api-token-file", str(token_file), "--web-ca", str(tls.ca_certificate), "--web-client-cert",
              str(tls.client_certificate), "--web-client-key", str(tls.client_key),
              "--web-client-key-password-file", str(tls.client_key_password_file)]
    for url in fleet["workers"]:  # each holds some of the blocks' keys: the others' are forwarded to the other
        for block in HASHES:
            done = subprocess.run([sys.executable, "-m", "kvstream.cli", "query", "residency", str(block),
                                   "--worker-url", url, *common], capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            assert [row["instance_id"] for row in json.loads(done.stdout)["rows"]] == ["engine-1"]
    done = subprocess.run([sys.executable, "-m", "kvstream.cli", "query", "tokens", *map(str, range(32)),
                           "--block-size", "4", "--worker-url", fleet["index"], "--web-ca", str(tls.ca_certificate)],
                          capture_output=True, text=True, timeout=60)  # the index's reads are open
    assert done.returncode == 0, done.stderr
    assert "instances" in json.loads(done.stdout)  # (engine-1 may be down by now: it sends no heartbeats)


def test_mutual_tls_refuses_a_client_without_a_certificate(fleet):
    tls = fleet["tls"]
    with pytest.raises(OSError):
        with IndexClient(fleet["workers"][0], timeout_s=20, token="s3cret-fleet", ca_file=tls.ca_certificate) as c:
            c.workers()


@pytest.mark.parametrize("path", ["/query", "/query_by_hash", "/prefix-match/", "/register", "/unregister"])
def test_malformed_bodies_to_a_worker_answer_4xx_never_500(fleet, path):
    import ssl

    context = ssl.create_default_context(cafile=str(fleet["tls"].ca_certificate))
    context.load_cert_chain(str(fleet["tls"].client_certificate), str(fleet["tls"].client_key),
                            password=fleet["tls"].client_key_password)
    port = int(fleet["workers"][0].rsplit(":", 1)[1])
    bodies = [(b'{"a":' * 5000 + b"1" + b"}" * 5000, "application/json"), (b"\x91" * 3000 + b"\x01",
                                                                            "application/msgpack"),
              (b"\xc1\xff", "application/msgpack"), (b"{nope", "application/json")]
    for body, content_type in bodies:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
            with context.wrap_socket(raw, server_hostname="localhost") as sock:
                sock.sendall(f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: {content_type}\r\n"
                             f"Authorization: Bearer s3cret-fleet\r\nContent-Length: {len(body)}\r\n"
                             "Connection: close\r\n\r\n".encode() + body)
                answer = sock.recv(65536)
        status = int(answer.split(b" ", 2)[1])
        assert 400 <= status < 500, (path, content_type, answer[:300])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         f"Authorization: Bearer s3cret-fleet\r\nContent-Length: {100 << 20}\r\n\r\n".encode())
            assert sock.recv(65536).startswith(b"HTTP/1.1 413")
