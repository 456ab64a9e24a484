"""Who may change the fleet (stream_apps/web_access.py): tokens, their rotation, the register networks, the refusal
to serve a non-loopback address without a token file, HTTPS and mutual TLS, over real HTTP from a second process."""

from __future__ import annotations

import json
import logging
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvstream.client import IndexClient, IndexQueryError
from kvstream.tls import generate_tls_material
from stream_apps.index.settings import IndexSettings
from stream_apps.web_access import (
    AccessPolicy,
    TokenFile,
    check_exposure,
    client_ssl_context,
    parse_networks,
    server_ssl_context,
)
from tests.web_fixture import serve_index

PROFILE = {"strategy": "vllm_v1", "algorithm": "sha256_cbor", "python_hash_seed": "0", "index_projection": "low64_be"}
REGISTRATION = {"endpoint": "tcp://10.0.0.1:5557", "type": "vLLM", "modelname": "m", "instance_id": "engine-1",
                "block_size": 16, "dp_rank": 0, "tenant_id": "default", "lora_name": "", "hash_profile": PROFILE}
UNREGISTRATION = {"instance_id": "engine-1", "dp_rank": 0}


def _write_tokens(path: Path, text: str) -> None:
    """Replace the file as a Kubernetes secret update does: a new file renamed over the old one."""
    temporary = path.with_suffix(".new")
    temporary.write_text(text)
    os.replace(temporary, path)


@pytest.fixture
def tokens(tmp_path) -> Path:
    path = tmp_path / "tokens"
    _write_tokens(path, "# operators\nrouter s3cret-router\ns3cret-old\n")
    return path


def test_a_write_needs_a_valid_token_and_reads_stay_open(tokens):
    policy = AccessPolicy(TokenFile(tokens))
    assert policy.verdict("POST", "/query", "10.1.1.1", None).allowed
    assert policy.verdict("GET", "/residency/ab/", "10.1.1.1", None).allowed
    missing = policy.verdict("POST", "/register", "10.1.1.1", None)
    assert (missing.allowed, missing.status, missing.body["reason"]) == (False, 401, "unauthorized")
    wrong = policy.verdict("POST", "/unregister/", "10.1.1.1", "Bearer nope")
    assert (wrong.allowed, wrong.status, wrong.body["reason"]) == (False, 403, "forbidden")
    assert policy.verdict("POST", "/register", "10.1.1.1", "Basic abc").status == 401
    assert policy.verdict("POST", "/register", "10.1.1.1", "Bearer s3cret-router").who == "token router"
    assert policy.verdict("POST", "/register", "10.1.1.1", "bearer s3cret-old").allowed
    assert policy.refusals == {("/register", 401): 2, ("/unregister", 403): 1}


def test_reads_need_a_token_when_asked_but_probes_and_metrics_never(tokens):
    policy = AccessPolicy(TokenFile(tokens), read_requires_token=True)
    assert policy.verdict("POST", "/query", "10.1.1.1", None).status == 401
    assert policy.verdict("POST", "/query", "10.1.1.1", "Bearer s3cret-old").allowed
    for path in ("/health", "/ready", "/metrics"):
        assert policy.verdict("GET", path, "10.1.1.1", None).allowed


def test_a_rotated_out_token_stops_working_and_a_new_one_works_without_a_restart(tokens):
    policy = AccessPolicy(TokenFile(tokens))
    assert policy.verdict("POST", "/register", None, "Bearer s3cret-old").allowed
    _write_tokens(tokens, "router s3cret-router\nnew s3cret-new\n")
    assert policy.verdict("POST", "/register", None, "Bearer s3cret-old").status == 403
    assert policy.verdict("POST", "/register", None, "Bearer s3cret-new").allowed
    tokens.unlink()  # a file gone refuses every token rather than keep the last ones
    assert policy.verdict("POST", "/register", None, "Bearer s3cret-new").status == 403


def test_the_register_networks_let_a_proxy_register_with_no_token_and_nothing_else(tokens):
    policy = AccessPolicy(TokenFile(tokens), register_allow=parse_networks(["10.2.0.0/16, fd00::/8"]))
    assert policy.verdict("POST", "/register", "10.2.3.4", None).who.startswith("network 10.2.0.0/16")
    assert policy.verdict("POST", "/register", "::ffff:10.2.3.4", None).allowed
    assert policy.verdict("POST", "/register", "fd00::5", None).allowed
    assert policy.verdict("POST", "/register", "10.3.0.1", None).status == 401
    assert policy.verdict("POST", "/unregister", "10.2.3.4", None).status == 401  # an unregistration clears tiers
    with pytest.raises(ValueError, match="--register-allow-cidr 'ten'"):
        parse_networks(["ten"])


def test_a_non_loopback_bind_without_a_token_file_is_refused_naming_the_flag(tokens, caplog):
    with pytest.raises(ValueError, match=r"^--web-bind 0\.0\.0\.0 is not a loopback address and no "
                                         r"--api-token-file \(KVSTREAM_API_TOKEN_FILE\)"):
        check_exposure(IndexSettings(web_bind="0.0.0.0"))
    check_exposure(IndexSettings(web_bind="127.0.0.1"))
    check_exposure(IndexSettings(web_bind="::1"))
    check_exposure(IndexSettings(web_bind="0.0.0.0", api_token_file=tokens))
    with caplog.at_level(logging.WARNING):
        check_exposure(IndexSettings(web_bind="0.0.0.0", insecure_http=True))
    assert "--insecure-http" in caplog.text
    with pytest.raises(ValueError, match="--api-token-file .*: No such file"):
        check_exposure(IndexSettings(web_bind="0.0.0.0", api_token_file=tokens.parent / "absent"))


def test_kvstream_index_on_0_0_0_0_without_a_token_file_exits_with_one_line_naming_the_flag():
    done = subprocess.run([sys.executable, "-m", "kvstream.cli", "index", "--web-bind", "0.0.0.0"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "KVSTREAM_API_TOKEN_FILE": ""})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith("kvstream index: error: --web-bind 0.0.0.0") and "--api-token-file" in lines[0]


_SECOND_PROCESS = """
import json, sys, urllib.request, urllib.error
url, token = sys.argv[1], sys.argv[2]
out = {}
for path, body in (("/register", %r), ("/unregister", %r)):
    headers = {"Content-Type": "application/json", **({"Authorization": "Bearer " + token} if token else {})}
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            out[path] = [response.status, json.loads(response.read())]
    except urllib.error.HTTPError as exc:
        out[path] = [exc.code, json.loads(exc.read())]
print(json.dumps(out))
""" % (REGISTRATION, UNREGISTRATION)


def _from_second_process(url: str, token: str = "") -> dict:
    done = subprocess.run([sys.executable, "-c", _SECOND_PROCESS, url, token], capture_output=True, text=True,
                          timeout=60, check=True)
    return json.loads(done.stdout)


def _workers(url: str) -> dict:
    with urllib.request.urlopen(url + "/workers", timeout=10) as response:
        return json.loads(response.read())["workers"]


def test_from_a_second_process_a_change_without_a_token_is_refused_and_changes_nothing(tokens):
    with serve_index(AccessPolicy(TokenFile(tokens)), host="0.0.0.0") as served:
        before = _workers(served.url)
        refused = _from_second_process(served.url)
        assert refused["/register"][0] == 401 and refused["/register"][1]["reason"] == "unauthorized"
        assert refused["/unregister"][0] == 401
        assert _from_second_process(served.url, "wrong")["/register"][0] == 403
        assert served.writes == [] and _workers(served.url) == before  # the fleet's answers are unchanged
        allowed = _from_second_process(served.url, "s3cret-router")
        assert allowed["/register"] == [200, {"status": "registered successfully", "instance_id": "engine-1"}]
        assert allowed["/unregister"][0] == 200
        assert served.writes == [("register", "engine-1"), ("unregister", "engine-1", 0), ("remove", "engine-1")]
        _write_tokens(tokens, "router s3cret-rotated\n")
        assert _from_second_process(served.url, "s3cret-router")["/register"][0] == 403
        with urllib.request.urlopen(served.url + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
        assert 'kvstream_http_refusals_total{path="/register",status="401"} 1.0' in metrics


def test_every_change_is_logged_with_who_before_and_after_and_never_the_token(tokens, caplog):
    with caplog.at_level(logging.INFO), serve_index(AccessPolicy(TokenFile(tokens))) as served:
        with IndexClient(served.url, token="s3cret-router", timeout_s=10) as client:
            client.register(**REGISTRATION)
            client.unregister("engine-1", 0)
        with IndexClient(served.url, timeout_s=10) as client, pytest.raises(IndexQueryError) as refused:
            client.register(**REGISTRATION)
    assert refused.value.status == 401 and refused.value.code == "unauthorized"
    changes = [r.getMessage() for r in caplog.records if "change by" in r.getMessage()]
    assert len(changes) == 2
    assert changes[0].startswith("web access: change by token router, peer 127.0.0.1: register engine-1: "
                                 "before none, after {")
    assert "unregister engine-1|default|0" in changes[1] and changes[1].endswith("after none")
    assert "s3cret" not in caplog.text


def test_a_register_network_lets_an_unmodified_proxy_register_but_not_unregister(tokens):
    policy = AccessPolicy(TokenFile(tokens), register_allow=parse_networks(["127.0.0.0/8"]))
    with serve_index(policy) as served:
        answers = _from_second_process(served.url)
        assert answers["/register"][0] == 200 and answers["/unregister"][0] == 401
    with serve_index(AccessPolicy(TokenFile(tokens), register_allow=parse_networks(["10.0.0.0/8"]))) as served:
        assert _from_second_process(served.url)["/register"][0] == 401


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return generate_tls_material(tmp_path_factory.mktemp("web-tls"))


def test_https_end_to_end_with_the_client_and_kvstream_query(tls, tokens):
    context = server_ssl_context(tls.broker_certificate, tls.broker_key)
    with serve_index(AccessPolicy(TokenFile(tokens)), ssl_context=context) as served:
        with IndexClient(served.url, token="s3cret-router", ca_file=tls.ca_certificate, timeout_s=10) as client:
            assert client.register(**REGISTRATION)["status"] == "registered successfully"
            assert "engine-1" in client.query([1, 2, 3, 4], model_name="m")["instances"]
        with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED"):  # the system's CAs do not know the test CA
            IndexClient(served.url, timeout_s=10).workers()
        done = subprocess.run([sys.executable, "-m", "kvstream.cli", "query", "tokens", "1", "2", "3", "4",
                               "--model", "m", "--worker-url", served.url, "--web-ca", str(tls.ca_certificate)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "engine-1" in json.loads(done.stdout)["instances"]


def test_mutual_tls_refuses_a_client_without_a_certificate(tls, tokens):
    context = server_ssl_context(tls.broker_certificate, tls.broker_key, client_ca=tls.ca_certificate)
    with serve_index(AccessPolicy(TokenFile(tokens)), ssl_context=context) as served:
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            with IndexClient(served.url, ca_file=tls.ca_certificate, timeout_s=10) as client:
                client.workers()
        with IndexClient(served.url, ca_file=tls.ca_certificate, cert_file=tls.client_certificate,
                         key_file=tls.client_key, key_password=tls.client_key_password, timeout_s=10) as client:
            assert client.workers()["workers"] == []
        done = subprocess.run([sys.executable, "-m", "kvstream.cli", "query", "workers", "--worker-url", served.url,
                               "--web-ca", str(tls.ca_certificate), "--web-client-cert", str(tls.client_certificate),
                               "--web-client-key", str(tls.client_key), "--web-client-key-password-file",
                               str(tls.client_key_password_file)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        request = urllib.request.Request(served.url + "/workers")
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            urllib.request.urlopen(request, timeout=10, context=client_ssl_context(tls.ca_certificate))
