"""A bridge whose publishers change while it runs: ``Bridge.add_endpoint`` / ``remove_endpoint``, the registration ->
publishers mapping, and ``RegistrationFollower`` (``kvstream bridge --follow-registrations``). No Kafka: a sink that
records what it is handed, and publishers that follow vLLM's ZMQ protocol (harness/vllm_publisher.py) on
localhost."""

from __future__ import annotations

import json
import logging
import time

import pytest
from confluent_kafka import KafkaError, KafkaException

from harness.vllm_publisher import BlockStored, FakeVllmPublisher
from kvstream.broker import free_port_range, free_ports
from producers.bridge import Bridge, PublisherEndpoint, RegistrationFollower, registration_endpoints
from stream_apps.index.fleet_index import SourceInfo


class Clock:
    """The bridge's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class RecordingSink:
    """Every batch and source event the bridge hands over, in order."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, int, int]] = []  # (label, epoch, seq)
        self.events: list[tuple[str, str, dict]] = []  # (instance, kind, body)

    def batch(self, endpoint, publisher, seq, payload) -> None:
        self.batches.append((endpoint.label, publisher.publisher_epoch, seq))

    def source_event(self, publisher, kind, body, seq) -> None:
        self.events.append((publisher.instance_id, kind.rsplit(".", 1)[-1], body))

    def flush(self) -> None:
        """Nothing is buffered."""

    def seqs(self, label: str) -> list[int]:
        return [seq for name, _, seq in self.batches if name == label]


def _stored(h: int) -> BlockStored:
    return BlockStored([h], None, [1, 2, 3, 4], 4, None, "GPU", None, group_idx=0)


def _pump(bridge: Bridge, done, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the bridge did not get there in time"
        bridge.poll(20)


def _until_live(bridge: Bridge, publisher: FakeVllmPublisher, endpoint: PublisherEndpoint,
                timeout_s: float = 5.0) -> None:
    """Publish batches until one arrives live: the SUB subscription has then reached the PUB socket (ZMQ's slow
    joiner), so the next live batches arrive live. A batch lost before that is recovered from the replay socket."""
    received = bridge.metrics.batches_received.labels(endpoint.instance_id, str(endpoint.data_parallel_rank))
    deadline = time.monotonic() + timeout_s
    while received._value.get() == 0:
        assert time.monotonic() < deadline, f"{endpoint.label}: no live batch arrived"
        publisher.publish([_stored(0xFFFF)])
        until = time.monotonic() + 0.05
        while time.monotonic() < until:
            bridge.poll(10)
    _pump(bridge, lambda: bridge.state[endpoint].last_seq == publisher.seq - 1)


@pytest.fixture
def engines():
    """``make(instance, replay=True)`` -> (publisher, endpoint) on free localhost ports; ``bridge(endpoints, ...)``
    -> a Bridge on a fake clock; everything made is closed at the end."""
    made: list = []

    class Factory:
        def make(self, instance: str = "engine-a", replay: bool = True, port: int | None = None):
            port, replay_port = (port, free_ports(1)[0]) if port else free_ports(2)
            publisher = FakeVllmPublisher(port, replay_port if replay else None)
            made.append(publisher)
            return publisher, PublisherEndpoint(f"tcp://127.0.0.1:{port}",
                                                f"tcp://127.0.0.1:{replay_port}" if replay else None, instance)

        def bridge(self, endpoints=(), **kwargs):
            kwargs = {"replay_timeout_s": 2, "heartbeat_interval_s": 1.0, "probe_timeout_s": 0.5,
                      "monotonic": Clock(), **kwargs}
            bridge = Bridge(list(endpoints), RecordingSink(), **kwargs)
            made.append(bridge)
            return bridge

    yield Factory()
    for thing in reversed(made):
        thing.close()


def _socket_of(bridge: Bridge, endpoint: PublisherEndpoint):
    return next(sock for sock, e in bridge._sockets.items() if e == endpoint)


# ---------------------------------------------------------------------- add_endpoint / remove_endpoint


def test_an_added_endpoint_is_followed_at_once_from_what_its_publisher_still_holds(engines):
    publisher, endpoint = engines.make()
    for h in range(3):
        publisher.publish([_stored(h)])  # before the bridge knows of it: only its replay buffer has them
    bridge = engines.bridge()
    assert bridge.endpoints == [] and bridge.links == {}
    bridge.add_endpoint(endpoint)
    assert bridge.endpoints == [endpoint] and endpoint in bridge.links
    _pump(bridge, lambda: bridge.sink.seqs(endpoint.label) == [0, 1, 2])  # the replay on connect, no live batch
    _until_live(bridge, publisher, endpoint)
    assert bridge.sink.seqs(endpoint.label) == list(range(publisher.seq))
    assert [kind for _, kind, _ in bridge.sink.events] == []  # one epoch, nothing lost


def test_a_removed_endpoint_has_its_sockets_closed_and_nothing_of_it_is_forwarded_any_more(engines):
    publisher_a, a = engines.make("engine-a")
    publisher_b, b = engines.make("engine-b")
    clock = Clock()
    bridge = engines.bridge([a, b], monotonic=clock)
    _until_live(bridge, publisher_a, a)
    _until_live(bridge, publisher_b, b)
    delivered_a = bridge.sink.seqs(a.label)
    socket_a = _socket_of(bridge, a)

    bridge.remove_endpoint(a)
    assert bridge.endpoints == [b] and set(bridge.links) == {b} and set(bridge.state) == {b}
    assert socket_a.closed and list(bridge._sockets.values()) == [b] and list(bridge._monitors.values()) == [b]
    assert [p.endpoint for p in bridge._probes.values()] in ([], [b])

    for h in range(3):
        publisher_a.publish([_stored(100 + h)])
    publisher_b.publish([_stored(200)])  # published after a's: had a been followed still, its would be in first
    _pump(bridge, lambda: bridge.state[b].last_seq == publisher_b.seq - 1)
    assert bridge.sink.seqs(a.label) == delivered_a

    clock.t += bridge.heartbeat_interval_s  # an interval ends: a heartbeat for b only
    _pump(bridge, lambda: any(kind == "SourceHeartbeat" for _, kind, _ in bridge.sink.events))
    assert {instance for instance, kind, _ in bridge.sink.events if kind == "SourceHeartbeat"} == {"engine-b"}
    assert bridge.send_heartbeats() == 1


def test_a_source_added_again_continues_its_epoch_with_what_it_published_meanwhile(engines, tmp_path):
    publisher, endpoint = engines.make()
    state_file = tmp_path / "bridge-state.json"
    bridge = engines.bridge([endpoint], state_file=state_file)
    _until_live(bridge, publisher, endpoint)
    epoch, last = bridge.state[endpoint].epoch, bridge.state[endpoint].last_seq
    bridge.remove_endpoint(endpoint)
    for h in range(2):
        publisher.publish([_stored(300 + h)])  # while nobody follows it; its replay buffer keeps them

    bridge.add_endpoint(endpoint)
    _pump(bridge, lambda: bridge.sink.seqs(endpoint.label)[-1] == last + 2)
    assert bridge.sink.seqs(endpoint.label) == list(range(last + 3))
    assert {e for _, e, _ in bridge.sink.batches} == {epoch}
    assert bridge.sink.events == []  # no PublisherRestarted, no SourceStale (and no interval ended)

    bridge.remove_endpoint(endpoint)
    bridge.close()  # the state file keeps a removed source's epoch and last seq
    saved = json.loads(state_file.read_text())
    assert list(saved.values()) == [{"epoch": epoch, "last_seq": last + 2}]


def test_removing_an_endpoint_gives_up_its_replay_request_in_flight(engines):
    publisher, endpoint = engines.make()
    publisher.answer_replay.clear()  # a hung engine: the replay on connect stays unanswered
    bridge = engines.bridge([endpoint])
    _pump(bridge, lambda: bridge.links[endpoint].probe is not None)
    probe_socket = bridge.links[endpoint].probe.socket
    bridge.remove_endpoint(endpoint)
    assert bridge._probes == {} and probe_socket.closed
    for _ in range(5):
        assert bridge.poll(10) == 0


def test_add_and_remove_refuse_what_they_cannot_do_and_leave_the_bridge_as_it_was(engines):
    _, endpoint = engines.make()
    bridge = engines.bridge([endpoint])
    with pytest.raises(ValueError, match="already subscribed"):
        bridge.add_endpoint(endpoint)
    for pub, replay in (("tcp://*:5557", None), ("tcp://127.0.0.1:5557", "tcp://*:5567"), ("tcp://nohost", None),
                        ("http://host:5557", None)):
        with pytest.raises(ValueError, match="cannot connect to"):
            bridge.add_endpoint(PublisherEndpoint(pub, replay, "engine-bad"))
    assert bridge.endpoints == [endpoint] and len(bridge._sockets) == 1 and len(bridge._monitors) == 1
    with pytest.raises(KeyError, match="not subscribed"):
        bridge.remove_endpoint(PublisherEndpoint("tcp://127.0.0.1:1", None, "engine-other"))
    bridge.close()
    with pytest.raises(ValueError, match="closed"):
        bridge.add_endpoint(PublisherEndpoint("tcp://127.0.0.1:1", None, "engine-late"))


# ---------------------------------------------------------------------- registration -> publishers


def test_a_registration_names_one_publisher_per_rank_on_vllms_offset_ports():
    info = SourceInfo("engine-0", endpoint="tcp://10.0.0.5:5557", replay_endpoint="tcp://10.0.0.5:5567",
                      engine_type="vLLM", dp_ranks={2, 0})
    assert registration_endpoints(info) == [
        PublisherEndpoint("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5567", "engine-0", 0, engine="vllm"),
        PublisherEndpoint("tcp://10.0.0.5:5559", "tcp://10.0.0.5:5569", "engine-0", 2, engine="vllm")]
    sglang = SourceInfo("engine-1", endpoint="tcp://h:6000", engine_type="SGLang")
    assert registration_endpoints(sglang, "full") == [
        PublisherEndpoint("tcp://h:6000", None, "engine-1", 0, engine="sglang", report_mode="full")]
    assert [e.engine for e in registration_endpoints(SourceInfo("m", endpoint="tcp://h:1", engine_type=None))] == [
        "vllm"]
    assert [e.engine for e in registration_endpoints(SourceInfo("m", endpoint="tcp://h:1",
                                                                engine_type="Mooncake"))] == ["vllm"]
    assert registration_endpoints(SourceInfo("engine-2", endpoint=None, dp_ranks={0})) == []
    with pytest.raises(ValueError, match="inproc' or 'tcp"):
        registration_endpoints(SourceInfo("engine-3", endpoint="ipc:///tmp/kv", dp_ranks={1}))


# ---------------------------------------------------------------------- the follower


def _registration(endpoint: PublisherEndpoint, instance: str | None = None, ranks=(0,)) -> SourceInfo:
    return SourceInfo(instance or endpoint.instance_id, endpoint=endpoint.endpoint,
                      replay_endpoint=endpoint.replay_endpoint, engine_type="vLLM", dp_ranks=set(ranks))


def test_the_follower_subscribes_a_registration_and_unsubscribes_its_tombstone(engines, caplog):
    publisher, endpoint = engines.make("engine-r")
    bridge = engines.bridge()
    follower = RegistrationFollower(bridge)
    with caplog.at_level(logging.INFO, logger="producers.bridge"):
        follower.apply("engine-r", _registration(endpoint))
        assert bridge.endpoints == [endpoint]
        _until_live(bridge, publisher, endpoint)
        socket = _socket_of(bridge, endpoint)
        follower.apply("engine-r", _registration(endpoint))  # registered again, unchanged: nothing reconnects
        assert bridge.endpoints == [endpoint] and _socket_of(bridge, endpoint) is socket
        follower.apply("engine-r", None)
    assert bridge.endpoints == [] and follower.followed == {} and follower.wanted == {}
    messages = [r.getMessage() for r in caplog.records]
    assert f"subscribed to {endpoint.endpoint} (replay: {endpoint.replay_endpoint}) as engine-r/dp0: registered " \
           f"instance engine-r" in messages
    assert f"unsubscribed from {endpoint.endpoint} as engine-r/dp0: instance engine-r unregistered" in messages


def test_a_changed_registration_moves_the_bridge_to_the_new_endpoint_and_keeps_unchanged_ranks(engines):
    base = free_port_range(2)
    rank0 = FakeVllmPublisher(base, None, data_parallel_rank=0)
    rank1 = FakeVllmPublisher(base + 1, None, data_parallel_rank=1)
    moved, moved_endpoint = engines.make("engine-m")
    bridge = engines.bridge()
    follower = RegistrationFollower(bridge)
    try:
        registered = SourceInfo("engine-m", endpoint=f"tcp://127.0.0.1:{base}", engine_type="vLLM", dp_ranks={0})
        follower.apply("engine-m", registered)
        [first] = bridge.endpoints
        socket = _socket_of(bridge, first)
        follower.apply("engine-m", SourceInfo("engine-m", endpoint=registered.endpoint, engine_type="vLLM",
                                              dp_ranks={0, 1}))  # rank 1 registered as well
        assert [e.endpoint for e in bridge.endpoints] == [f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"]
        assert _socket_of(bridge, first) is socket  # rank 0 stays connected
        _until_live(bridge, rank1, bridge.endpoints[1])

        follower.apply("engine-m", _registration(moved_endpoint))  # the instance moved: a new endpoint, rank 0
        assert bridge.endpoints == [moved_endpoint]
        assert follower.followed == {"engine-m": [moved_endpoint]}
        _until_live(bridge, moved, moved_endpoint)
        seen = len(bridge.sink.seqs("engine-m/dp1"))
        rank1.publish([_stored(7)])
        moved.publish([_stored(8)])
        _pump(bridge, lambda: bridge.state[moved_endpoint].last_seq == moved.seq - 1)
        assert len(bridge.sink.seqs("engine-m/dp1")) == seen  # the old endpoint is no longer followed
    finally:
        rank0.close()
        rank1.close()


def test_the_follower_never_follows_one_address_twice_and_takes_it_over_once_free(engines, caplog):
    _, static = engines.make("engine-s")
    _, shared = engines.make("engine-x")
    bridge = engines.bridge([static])
    follower = RegistrationFollower(bridge)
    with caplog.at_level(logging.WARNING, logger="producers.bridge"):
        follower.apply("engine-s", _registration(static))  # already an --endpoint of the bridge
        follower.apply("engine-x", _registration(shared))
        follower.apply("engine-y", _registration(shared, "engine-y"))  # the same address under another name
        follower.apply("engine-y", _registration(shared, "engine-y"))  # again: warned once
    assert [e.instance_id for e in bridge.endpoints] == ["engine-s", "engine-x"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "already follows" in warnings[1] and "engine-x/dp0" in warnings[1]
    follower.apply("engine-s", None)  # the registration goes; the bridge's own --endpoint stays
    assert [e.instance_id for e in bridge.endpoints] == ["engine-s", "engine-x"]
    follower.apply("engine-x", None)  # the address is free: engine-y, still registered, gets it
    assert [e.instance_id for e in bridge.endpoints] == ["engine-s", "engine-y"]


def test_a_registration_the_bridge_cannot_follow_is_logged_and_the_others_go_on(engines, caplog):
    _, endpoint = engines.make("engine-ok")
    bridge = engines.bridge()
    follower = RegistrationFollower(bridge)
    with caplog.at_level(logging.WARNING, logger="producers.bridge"):
        follower.apply("engine-bind", SourceInfo("engine-bind", endpoint="tcp://*:5557"))  # a bind address
        follower.apply("engine-ipc", SourceInfo("engine-ipc", endpoint="ipc:///tmp/kv", dp_ranks={0, 1}))
        follower.apply("engine-none", SourceInfo("engine-none"))  # registered without an endpoint
        follower.apply("engine-ok", _registration(endpoint))
    assert bridge.endpoints == [endpoint]
    text = caplog.text
    assert "registered instance engine-bind: not subscribed to tcp://*:5557: engine-bind/dp0: cannot connect" in text
    assert "registered instance engine-ipc: cannot follow its endpoint ipc:///tmp/kv" in text


def test_run_reads_the_feed_between_polls_and_outlives_its_errors(engines, caplog):
    _, endpoint = engines.make("engine-f")
    clock = Clock()
    bridge = engines.bridge(heartbeat_interval_s=0, monotonic=clock)
    follower = RegistrationFollower(bridge, monotonic=clock)

    class Feed:
        topic = "kv-instances"

        def __init__(self) -> None:
            self.reads = 0

        def poll(self, timeout_s: float = 0.0) -> int:
            self.reads += 1
            if self.reads == 1:
                follower.apply("engine-f", _registration(endpoint))
                return 1
            raise KafkaException(KafkaError(KafkaError._TRANSPORT))

    feed = Feed()
    loops = []

    def should_stop() -> bool:
        loops.append(1)
        clock.t += 0.2  # each loop: 0.2 s on the follower's clock, so the feed is read every third loop
        return len(loops) > 9

    with caplog.at_level(logging.WARNING, logger="producers.bridge"):
        follower.run(feed, should_stop, read_interval_s=0.5)
    assert bridge.endpoints == [endpoint]
    assert feed.reads == 3
    assert caplog.text.count("reading the registrations in kv-instances") == 2


# ---------------------------------------------------------------------- the command line


def test_the_bridge_needs_an_endpoint_or_the_registrations_and_says_so(monkeypatch, capsys):
    from kvstream.cli import main

    for name in ("KVSTREAM_ENDPOINT", "KVSTREAM_INSTANCE_ID", "KVSTREAM_REPLAY_ENDPOINT",
                 "KVSTREAM_FOLLOW_REGISTRATIONS"):
        monkeypatch.delenv(name, raising=False)
    assert main(["bridge"]) == 1
    assert "give at least one --endpoint tcp://HOST:PORT (or KVSTREAM_ENDPOINT), or --follow-registrations" in \
        capsys.readouterr().err
    assert main(["bridge", "--follow-registrations", "--instance-id=engine-0"]) == 1
    assert "--replay-endpoint and --instance-id name the --endpoints, and none is given" in capsys.readouterr().err
