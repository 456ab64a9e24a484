"""Any body, no harm: every POST endpoint of the router APIs, JSON and msgpack, answers every body with a 4xx and a
reason (or a 2xx/404 when the body happens to be a valid request), never a 500, and the server stays up.

Two parts: property-based bodies (hypothesis) to the API in process, the same handlers both servers call
(:class:`stream_apps.index.api.IndexAPI`); and a handful of real-HTTP cases to the index's web application (its
middlewares: body limits, half-way bodies, a slow client) on a real socket. What every body got is counted per
endpoint and written to ``.kvstream/fuzz-counts.json`` (printed at the module's end with ``-s``).
"""

from __future__ import annotations

import json
import resource
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stream_apps.index.api import MAX_NESTING_DEPTH, IndexAPI
from stream_apps.index.fleet_index import FleetIndex
from tests.web_fixture import serve_index

#: Bounded, so that ``make test`` stays quick: examples per (endpoint, format) and strategy family (four families:
#: 200 bodies per endpoint and format).
FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), database=None)

ENDPOINTS = {
    "query": ("token_ids", "model", "model_name", "lora_name", "cache_salt", "block_size", "tenant_id",
              "instance_id"),
    "query_by_hash": ("seq_hashes", "block_hashes", "model_name", "model", "tenant_id", "instance_id"),
    "prefix_match": ("block_hashes",),
    "register": ("endpoint", "type", "modelname", "instance_id", "block_size", "dp_rank", "hash_profile",
                 "replay_endpoint", "lora_name", "tenant_id", "cache_group"),
    "unregister": ("instance_id", "dp_rank", "tenant_id"),
}
FORMATS = {"json": "application/json", "msgpack": "application/msgpack"}
#: (endpoint, format, status) -> bodies.
COUNTS: Counter = Counter()

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**64), max_value=2**64 - 1) | st.floats()
           | st.text(max_size=24) | st.binary(max_size=24))
values = st.recursive(scalars, lambda children: st.lists(children, max_size=6)
                      | st.dictionaries(st.text(max_size=10), children, max_size=6), max_leaves=40)
out_of_range_ids = st.lists(st.one_of(st.integers(max_value=-(2**31) - 1), st.integers(min_value=2**32)),
                            min_size=1, max_size=8)


def _encode(value, fmt: str) -> bytes:
    if fmt == "json":
        return json.dumps(value, default=lambda v: v.hex() if isinstance(v, bytes) else str(v)).encode()
    return msgspec.msgpack.encode(_msgpack_range(value))


def _msgpack_range(value):
    """msgpack has no integer beyond [-2**63, 2**64): such a value is sent as a float, as a sloppy client would."""
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        return float(value)
    if isinstance(value, list):
        return [_msgpack_range(v) for v in value]
    if isinstance(value, dict):
        return {k: _msgpack_range(v) for k, v in value.items()}
    return value


def _nested(depth: int, fmt: str, kind: str) -> bytes:
    """A body nested ``depth`` deep, built as bytes (no encoder recursion): arrays, or maps of one key."""
    if fmt == "json":
        opening, closing = (b"[", b"]") if kind == "array" else (b'{"block_hashes":', b"}")
        return opening * depth + b"1" + closing * depth
    opening = b"\x91" if kind == "array" else b"\x81\xacblock_hashes"
    return opening * depth + b"\x01"


def _api() -> IndexAPI:
    index = FleetIndex()
    writes: list = []

    class Registrations:
        def write(self, info):
            writes.append(info)

        def remove(self, instance):
            writes.append(instance)
    return IndexAPI(index, lambda: [], registrations=Registrations(),
                    on_unregister=lambda instance, rank, reason: writes.append((instance, rank)))


API = _api()


def _check(endpoint: str, fmt: str, body: bytes) -> None:
    reply = getattr(API, endpoint)(body, FORMATS[fmt], None)
    COUNTS[(endpoint, fmt, reply.status)] += 1
    assert reply.status < 500, (endpoint, fmt, body[:200], reply)
    if reply.status >= 400:
        answer = msgspec.msgpack.decode(reply.body) if fmt == "msgpack" else json.loads(reply.body)
        assert isinstance(answer.get("error"), str) and answer["error"], answer


def _field_bodies(endpoint: str):
    """Maps of the endpoint's own fields (and a stranger) with values of any type: wrong types, out of range."""
    names = st.sampled_from(ENDPOINTS[endpoint] + ("stranger",))
    special = values | out_of_range_ids | st.lists(st.integers(), max_size=70_000).filter(lambda v: len(v) < 9 or
                                                                                       len(v) > 60_000)
    return st.dictionaries(names, special, max_size=6)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    table = {}
    for (endpoint, fmt, status), n in sorted(COUNTS.items()):
        table.setdefault(f"{endpoint} {fmt}", {})[str(status)] = n
    out = Path(".kvstream") / "fuzz-counts.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(table, indent=1, sort_keys=True))
    print("\nfuzz bodies per endpoint and format -> statuses:")
    for name, statuses in table.items():
        print(f"  {name}: {sum(statuses.values())} bodies: {statuses}")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
class TestEveryBody:
    @FUZZ
    @given(body=st.binary(max_size=300))
    def test_malformed_bytes(self, endpoint, fmt, body):
        _check(endpoint, fmt, body)

    @FUZZ
    @given(value=values)
    def test_any_value(self, endpoint, fmt, value):
        _check(endpoint, fmt, _encode(value, fmt))

    @FUZZ
    @given(data=st.data())
    def test_the_endpoints_fields_with_wrong_types_and_huge_arrays(self, endpoint, fmt, data):
        _check(endpoint, fmt, _encode(data.draw(_field_bodies(endpoint)), fmt))

    @FUZZ
    @given(depth=st.integers(min_value=MAX_NESTING_DEPTH - 2, max_value=6000),
           kind=st.sampled_from(["array", "map"]), cut=st.booleans())
    def test_deep_nesting_and_bodies_that_stop_half_way(self, endpoint, fmt, depth, kind, cut):
        body = _nested(depth, fmt, kind)
        _check(endpoint, fmt, body[: len(body) // 2] if cut else body)


def test_the_deep_bodies_of_the_issue_answer_400_too_deep_on_every_endpoint():
    for endpoint in ENDPOINTS:
        for body, fmt in ((b'{"a":' * 5000 + b"1" + b"}" * 5000, "json"), (b"\x91" * 3000 + b"\x01", "msgpack")):
            reply = getattr(API, endpoint)(body, FORMATS[fmt], None)
            assert reply.status == 400, (endpoint, fmt, reply)


# -- real HTTP: the web application's own limits ------------------------------------------------------------------

def _raw(port: int, head: bytes, send_body, read_timeout: float = 30) -> bytes:
    """Send ``head``, then what ``send_body(sock)`` sends; the status line and headers of the answer (b'' when the
    server closed the connection without one)."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as sock:
        sock.sendall(head)
        try:
            send_body(sock)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before the body's end: the answer is what counts
        answer = b""
        try:
            while b"\r\n\r\n" not in answer:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
        except (ConnectionResetError, socket.timeout):
            pass
        return answer


def _query_ok(url: str) -> float:
    started = time.perf_counter()
    request = urllib.request.Request(url + "/query", data=b'{"token_ids":[1,2,3]}',
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
    return time.perf_counter() - started


@pytest.fixture(scope="module")
def served():
    with serve_index(host="127.0.0.1") as served:
        yield served


def _port(served) -> int:
    return int(served.url.rsplit(":", 1)[1])


@pytest.mark.parametrize("path", ["/query", "/query_by_hash", "/prefix-match/", "/register", "/unregister"])
def test_a_100_mb_body_is_refused_before_it_is_read_and_memory_stays_bounded(served, path):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    chunk = b"[" * (1 << 20)

    def send(sock):
        for _ in range(100):
            sock.sendall(chunk)
    answer = _raw(_port(served), f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 f"Content-Length: {100 << 20}\r\n\r\n".encode(), send)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50 << 10  # KiB: less than 50 MB more
    assert _query_ok(served.url) < 5


def test_a_chunked_body_over_the_limit_is_cut_at_the_limit_and_refused(served):
    piece = b"1," * (1 << 19)

    def send(sock):
        sock.sendall(b'e\r\n{"token_ids":[\r\n')
        for _ in range(10):  # 10 MiB, over the 8 MiB limit
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        sock.sendall(b"0\r\n\r\n")
    answer = _raw(_port(served), b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n", send)
    assert answer.startswith(b"HTTP/1.1 400") or answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert _query_ok(served.url) < 5


def test_a_body_that_stops_half_way_harms_nothing(served):
    def send(sock):
        sock.sendall(b'{"token_ids":[1,2,')
        sock.shutdown(socket.SHUT_WR)
    answer = _raw(_port(served), b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 1000\r\n\r\n", send, read_timeout=10)
    assert answer == b"" or answer.split(b" ")[1].startswith(b"4"), answer[:200]
    assert _query_ok(served.url) < 5


def test_a_slow_client_wedges_nothing(served):
    body = b'{"token_ids":[1,2,3,4,5,6,7,8]}'
    done = threading.Event()
    answers = []

    def slow():
        def send(sock):
            for byte in body:
                sock.sendall(bytes([byte]))
                time.sleep(0.1)
        answers.append(_raw(_port(served), b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                           + f"Content-Length: {len(body)}\r\n\r\n".encode(), send))
        done.set()
    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.3)
    waits = [_query_ok(served.url) for _ in range(5)]  # answered while the slow body trickles in
    assert not done.is_set() and max(waits) < 2
    thread.join(30)
    assert answers and answers[0].startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("path", ["/query", "/query_by_hash", "/prefix-match/", "/register", "/unregister"])
def test_deep_bodies_over_http_answer_400_with_a_reason(served, path, fmt):
    body = b'{"a":' * 5000 + b"1" + b"}" * 5000 if fmt == "json" else b"\x91" * 3000 + b"\x01"
    request = urllib.request.Request(served.url + path, data=body, headers={"Content-Type": FORMATS[fmt],
                                                                              "Accept": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=10)
        raise AssertionError("accepted")
    except urllib.error.HTTPError as exc:
        assert exc.code == 400 and json.loads(exc.read())["error"]
