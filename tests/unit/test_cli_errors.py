"""Errors a new user meets first: each is refused at once with what to do, before anything is created."""

from __future__ import annotations

import socket

import pytest

from kafka_io.admin import ensure_topics
from kvstream.broker import free_port
from kvstream.cli import main


def test_a_busy_web_port_is_refused_before_any_topic_is_created(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", free_port()))
        busy.listen()
        port = busy.getsockname()[1]
        # the bootstrap address is unreachable: the worker must stop at the port, not at Kafka
        assert main(["worker", "--web-port", str(port), "--bootstrap-servers", "127.0.0.1:9"]) == 1
    assert f"port {port} on 127.0.0.1 is in use" in capsys.readouterr().err


def test_a_bootstrap_address_with_a_scheme_is_refused_by_every_command(capsys):
    for command in (["worker"], ["simulate"], ["tail", "kv-events"], ["produce", "--jsonl", "x.jsonl"]):
        assert main([*command, "--bootstrap-servers", "PLAINTEXT://broker:9092"]) == 1
        assert "has a URL scheme; give HOST:PORT, e.g. 'broker:9092'" in capsys.readouterr().err


def test_a_source_lease_the_global_changelogs_cannot_renew_is_refused(capsys, monkeypatch):
    # other workers renew a source's lease from its sources records, produced every --global-changelog-interval-s
    assert main(["worker", "--source-lease-s", "1.5", "--bootstrap-servers", "127.0.0.1:9"]) == 1
    assert ("--global-changelog-interval-s (1 s) must be at most half of --source-lease-s (1.5 s)"
            in capsys.readouterr().err)
    monkeypatch.setenv("KVSTREAM_SOURCE_LEASE_S", "1.5")  # the same rule when the lease comes from a variable
    assert main(["worker", "--global-changelog-interval-s", "0.75", "--bootstrap-servers", "127.0.0.1:9"]) == 1
    assert "must be at most half" not in capsys.readouterr().err  # 0.75 is half: refused for the unreachable broker


def test_a_refused_connection_gets_no_tls_hint(monkeypatch):
    monkeypatch.delenv("KVSTREAM_SECURITY_PROTOCOL", raising=False)
    with pytest.raises(RuntimeError, match="is a broker listening there") as error:
        ensure_topics(f"127.0.0.1:{free_port()}", {"t": 1}, timeout_s=1)
    assert "TLS" not in str(error.value)


def test_version():
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    (b"", "holds no capture line (empty)"),
    (b"{not json\n", ":1: not a capture line (JSONDecodeError"),
    (b'{"seq": 0, "ts": 1.0, "events": []}\n', ":1: not a capture line (KeyError: 'instance_id')"),
    (b"\xff\xfe\x00binary", "not a text file"),
])
def test_produce_checks_its_capture_file_before_asking_kafka(tmp_path, capsys, content, message):
    """Issue 28: a missing file printed a traceback, after waiting for Kafka. Nobody listens on port 9: had the
    command asked Kafka first, it would fail with another message, and only after seconds."""
    import time

    capture = tmp_path / "capture.jsonl"
    if content is not None:
        capture.write_bytes(content)
    started = time.monotonic()
    assert main(["produce", "--jsonl", str(capture), "--bootstrap-servers", "127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvstream produce: error: --jsonl {capture}") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert time.monotonic() - started < 2


@pytest.mark.parametrize("command", [["simulate", "--requests", "1"], ["tail", "kv-events"], ["unregister", "sim-0"],
                                     ["index"]])
def test_a_wrong_broker_address_fails_in_seconds_naming_it(capsys, monkeypatch, command):
    """Issue 28: it took 30 s (ensure_topics retried list_topics until its topic-creation timeout); unregister
    printed librdkafka's exception as a traceback after 10 s; ``kvstream index`` said it was serving and logged
    librdkafka's connection error a minute later, for ever (it now checks the brokers first, as the worker does)."""
    import logging
    import time

    from kafka_io.config import CONNECT_TIMEOUT_S

    # a command configures logging to the standard error it finds: an earlier test's captured one is closed now
    monkeypatch.setattr(logging.getLogger(), "handlers", [])

    address = f"127.0.0.1:{free_port()}"  # nobody listens there
    started = time.monotonic()
    assert main([*command, "--bootstrap-servers", address]) == 1
    assert time.monotonic() - started < CONNECT_TIMEOUT_S + 4
    err = capsys.readouterr().err
    assert f"error: Kafka at {address} did not answer within {CONNECT_TIMEOUT_S:g} s" in err
    assert "KafkaError{" not in err  # the reason's text, not the error object's repr
    assert "Traceback" not in err


def test_export_from_a_wrong_broker_address_names_the_reason_not_the_error_object(capsys, monkeypatch, tmp_path):
    import logging

    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    address = f"127.0.0.1:{free_port()}"
    assert main(["export", "kv-residency-changes", "--format", "jsonl", "--output", str(tmp_path / "c.jsonl"),
                 "--bootstrap-servers", address]) == 1
    err = capsys.readouterr().err
    assert f"kvstream export: error: Kafka at {address} did not answer while reading kvstream-kv-residency-changes: " \
        in err and "is a broker listening there?" in err
    assert "KafkaError{" not in err


@pytest.mark.parametrize("argv, prog, unknown", [
    (["query", "occupancy", "--bootstrap-servers", "x"], "kvstream query", "--bootstrap-servers x"),
    (["broker", "status", "--no-such-flag"], "kvstream broker status", "--no-such-flag"),
])
def test_an_unknown_flag_shows_the_usage_of_the_command_it_was_given_to(capsys, argv, prog, unknown):
    """It showed ``usage: kvstream [-h] [--version] COMMAND ...``, which says nothing of the command's flags."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {prog} ") and f"{prog}: error: unrecognized arguments: {unknown}\n" in err


@pytest.mark.parametrize("flags, message", [
    (["--model-name", "a", "--model-name", "b", "--model-name", "c"], "give one --model-name for every --endpoint"),
    (["--block-size", "0"], "--block-size must be at least 1"),
])
def test_the_bridges_registration_flags_are_checked_before_kafka(capsys, flags, message):
    endpoints = ["--endpoint", "tcp://127.0.0.1:5557", "--instance-id", "a", "--endpoint", "tcp://127.0.0.1:5558",
                 "--instance-id", "b"]
    assert main(["bridge", *endpoints, *flags, "--bootstrap-servers", "127.0.0.1:9"]) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("live, warned", [(False, True), (True, False)])
def test_an_empty_lookup_says_when_the_sources_are_down(capsys, live, warned):
    """Issue 28: 30 s after ``simulate`` ended the simulated sources' leases lapsed, and ``query residency`` of
    the README's by-hand steps answered ``"rows": []`` without a word. A stub worker answers here."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answers = {"/residency/e220a8397b1dcdaf/": {"block_hash": "e220a8397b1dcdaf", "rows": [], "sources": []},
               "/workers": {"workers": [{"instance_id": f"sim-{i}", "data_parallel_rank": 0, "live": live}
                                        for i in range(4)]}}

    class Worker(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(answers[self.path]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Worker)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert main(["query", "residency", "e220a8397b1dcdaf", "--worker-url", url]) == 0
    finally:
        server.shutdown()
        server.server_close()
    out, err = capsys.readouterr()
    assert json.loads(out)["rows"] == []
    assert ("the answer is empty, and 4 of 4 sources are down" in err) is warned
    assert err.count("\n") == (1 if warned else 0)


def test_query_errors_name_the_command(capsys):
    """The commands run by kvstream.options.run_command start their errors with their name; query's started with
    ``error:`` alone."""
    address = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    assert main(["query", "residency", "1a1eb4e3edd9361a", "--worker-url", address]) == 1
    assert capsys.readouterr().err.startswith(f"kvstream query: error: no stream-app worker answered at {address}: ")
    assert main(["query", "residency", "--worker-url", address]) == 2
    assert capsys.readouterr().err == "kvstream query: error: query residency needs one block hash\n"


def test_broker_and_registry_errors_name_the_command(capsys):
    """They too printed ``error:`` alone."""
    assert main(["broker", "start", "--tls-client-auth"]) == 2
    assert capsys.readouterr().err == "kvstream broker start: error: --tls-client-auth needs --tls-dir\n"
    assert main(["broker", "tool", "no-such-tool"]) == 2
    assert capsys.readouterr().err.startswith("kvstream broker tool: error: ")
