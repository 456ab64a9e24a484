"""The producers' side of source leases (issue 26): the bridge's heartbeats and replay on connect, the simulator's
and ``produce``'s heartbeats. No Kafka: a sink that records what it is handed, publishers that follow vLLM's ZMQ
protocol (harness/vllm_publisher.py) on localhost, and a fake clock for the heartbeat intervals, so each interval
is ended by the test, not by waiting."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from harness.vllm_publisher import BlockStored, FakeVllmPublisher
from kvstream.broker import free_ports
from producers.bridge import (
    CONNECTED,
    DISCONNECTED,
    EVENTS,
    PROBE,
    REPLAY,
    REPLAY_SILENT,
    Bridge,
    PublisherEndpoint,
    heartbeat_evidence,
)
from producers.bridge_endpoints import state_key
from producers.bridge_sequence import read_state_file


class Clock:
    """The bridge's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class SourceEvent:
    kind: str
    body: dict
    seq: int
    epoch: int


class RecordingSink:
    """Every batch and source event the bridge hands over, in order."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, int]] = []  # (epoch, seq)
        self.events: list[SourceEvent] = []
        #: Both, in the order handed over: ("batch", seq) and (event kind, seq).
        self.order: list[tuple[str, int]] = []

    def batch(self, endpoint, publisher, seq, payload) -> None:
        self.batches.append((publisher.publisher_epoch, seq))
        self.order.append(("batch", seq))

    def source_event(self, publisher, kind, body, seq) -> None:
        self.events.append(SourceEvent(kind.rsplit(".", 1)[-1], body, seq, publisher.publisher_epoch))
        self.order.append((kind.rsplit(".", 1)[-1], seq))

    def flush(self) -> None:
        """Nothing is buffered."""

    def heartbeats(self) -> list[SourceEvent]:
        return [e for e in self.events if e.kind == "SourceHeartbeat"]

    def others(self) -> list[tuple[str, dict]]:
        return [(e.kind, e.body) for e in self.events if e.kind != "SourceHeartbeat"]

    def seqs(self) -> list[int]:
        return [seq for _, seq in self.batches]


def _stored(h: int) -> BlockStored:
    return BlockStored([h], None, [1, 2, 3, 4], 4, None, "GPU", None, group_idx=0)


def _pump(bridge: Bridge, done, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the bridge did not get there in time"
        bridge.poll(20)


def _settle(bridge: Bridge, seconds: float = 0.3) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        bridge.poll(20)


@pytest.fixture
def engines():
    """``make(replay=True, buffer_steps=...)`` -> (publisher, endpoint); ``bridge(endpoint, ...)`` -> a Bridge on a
    fake clock, connected; everything is closed at the end."""
    made: list = []

    class Factory:
        def make(self, replay: bool = True, buffer_steps: int = 10_000, ports=None):
            port, replay_port = ports or free_ports(2)
            publisher = FakeVllmPublisher(port, replay_port if replay else None, buffer_steps=buffer_steps)
            made.append(publisher)
            endpoint = PublisherEndpoint(f"tcp://127.0.0.1:{port}",
                                         f"tcp://127.0.0.1:{replay_port}" if replay else None, "engine-a")
            return publisher, endpoint

        def bridge(self, endpoint, clock=None, interval=1.0, probe_timeout=0.5, **kwargs):
            bridge = Bridge([endpoint], RecordingSink(), replay_timeout_s=2, heartbeat_interval_s=interval,
                            probe_timeout_s=probe_timeout, monotonic=clock or Clock(), **kwargs)
            made.append(bridge)
            # connected, and the replay on connect answered
            _pump(bridge, lambda: bridge.links[endpoint].connected and bridge.links[endpoint].probe is None)
            _settle(bridge, 0.2)  # ZMQ's slow joiner: the subscription reaches the PUB socket a moment later
            return bridge

    yield Factory()
    for thing in reversed(made):
        thing.close()


def _end_interval(bridge: Bridge, clock: Clock, wait_s: float = 0.3) -> None:
    """End the current heartbeat interval and let probes be answered (the fake clock stands still meanwhile)."""
    clock.t += bridge.heartbeat_interval_s
    _settle(bridge, wait_s)


# ---------------------------------------------------------------------- the rule


@pytest.mark.parametrize("contacted, live, replayed, connected, has_replay, expected", [
    (False, True, True, True, True, None),        # no epoch to name before first contact
    (True, True, False, False, True, EVENTS),     # batches this interval: alive, whatever the connection says now
    (True, False, True, True, True, REPLAY),      # a replay on connect or a catch-up was answered this interval
    (True, False, False, True, True, PROBE),      # idle, with a replay socket: ask it
    (True, False, False, True, False, CONNECTED),  # idle, no replay socket: the connection is all there is
    (True, False, True, False, True, None),       # connection down: no heartbeat, whatever was answered before
    (True, False, False, False, False, None),
])
def test_heartbeat_evidence_follows_the_documented_order(contacted, live, replayed, connected, has_replay, expected):
    assert heartbeat_evidence(contacted=contacted, live_events=live, replay_answered=replayed, connected=connected,
                              has_replay=has_replay) == expected


@pytest.mark.parametrize("live, replayed, connected, has_replay, expected", [
    (True, False, True, True, EVENTS),       # batches on the connection that came back: alive
    (False, True, True, True, PROBE),        # an answer from before does not count: ask again
    (False, False, True, True, PROBE),       # reconnected: only the replay socket's answer can tell
    (False, False, True, False, None),       # reconnected, no replay socket: a connection alone is no evidence now
    (False, False, False, True, None),
])
def test_a_source_said_down_needs_batches_or_a_replay_answer_before_its_next_heartbeat(live, replayed, connected,
                                                                                       has_replay, expected):
    assert heartbeat_evidence(contacted=True, live_events=live, replay_answered=replayed, connected=connected,
                              has_replay=has_replay, down=True) == expected


# ---------------------------------------------------------------------- heartbeats


def test_an_idle_engine_with_a_replay_socket_gets_replay_heartbeats_with_its_epoch_and_last_seq(engines):
    publisher, endpoint = engines.make()
    clock = Clock()
    bridge = engines.bridge(endpoint, clock)
    for h in range(3):
        publisher.publish([_stored(h)])
    _pump(bridge, lambda: bridge.sink.seqs() == [0, 1, 2])
    epoch = bridge.state[endpoint].epoch
    _end_interval(bridge, clock)
    assert [(e.body, e.seq, e.epoch) for e in bridge.sink.heartbeats()] == [({"evidence": EVENTS}, 2, epoch)]
    requests = publisher.replay_requests
    for _ in range(3):
        _end_interval(bridge, clock)
    assert [(e.body["evidence"], e.seq, e.epoch) for e in bridge.sink.heartbeats()[1:]] == [(REPLAY, 2, epoch)] * 3
    assert publisher.replay_requests == requests + 3  # one probe per interval
    assert bridge.sink.seqs() == [0, 1, 2] and bridge.sink.others() == []  # a probe's copy of seq 2 is dropped


def test_an_engine_without_a_replay_socket_gets_connected_heartbeats_until_it_goes_away(engines):
    publisher, endpoint = engines.make(replay=False)
    clock = Clock()
    bridge = engines.bridge(endpoint, clock)
    publisher.publish([_stored(1)])
    _pump(bridge, lambda: bridge.sink.seqs() == [0])
    _end_interval(bridge, clock)
    _end_interval(bridge, clock)
    assert [e.body["evidence"] for e in bridge.sink.heartbeats()] == [EVENTS, CONNECTED]
    publisher.kill()
    _pump(bridge, lambda: not bridge.links[endpoint].connected)
    _end_interval(bridge, clock)
    _end_interval(bridge, clock)
    assert len(bridge.sink.heartbeats()) == 2
    assert bridge.metrics.heartbeats_skipped.labels("engine-a", "0")._value.get() == 2


def test_a_source_never_contacted_gets_no_heartbeat(engines):
    publisher, endpoint = engines.make()
    clock = Clock()
    bridge = engines.bridge(endpoint, clock)  # connected, its replay socket answers, but it has published nothing
    for _ in range(3):
        _end_interval(bridge, clock)
    assert bridge.sink.events == [] and endpoint not in bridge.state
    assert publisher.replay_requests >= 3  # first contact is asked for again each interval
    publisher.publish([_stored(7)], send_live=False)
    _end_interval(bridge, clock)  # ... and found: a batch only the replay buffer has
    assert bridge.sink.seqs() == [0] and endpoint in bridge.state


def test_a_hung_replay_socket_gives_no_heartbeat_and_does_not_block_the_live_loop(engines):
    publisher, endpoint = engines.make()
    clock = Clock()
    bridge = engines.bridge(endpoint, clock, interval=2.0, probe_timeout=1.0)
    publisher.publish([_stored(1)])
    _pump(bridge, lambda: bridge.sink.seqs() == [0])
    _end_interval(bridge, clock)  # events
    publisher.answer_replay.clear()  # the engine hangs; the kernel keeps its connections open
    clock.t += bridge.heartbeat_interval_s
    started = time.monotonic()
    bridge.poll(0)  # sends the probe
    assert time.monotonic() - started < 0.2, "the probe must not wait for its answer"
    assert bridge.links[endpoint].probe is not None
    _settle(bridge, 0.3)
    first = bridge.links[endpoint].probe
    clock.t += bridge.probe_timeout_s  # the probe's deadline passes
    bridge.poll(0)
    # no heartbeat; and one slow answer is not silence yet: a second probe goes out at once
    assert bridge.links[endpoint].probe not in (None, first) and bridge.sink.others() == []
    assert [e.body["evidence"] for e in bridge.sink.heartbeats()] == [EVENTS]
    assert bridge.metrics.heartbeats_skipped.labels("engine-a", "0")._value.get() == 1
    _settle(bridge, 0.2)
    clock.t += bridge.probe_timeout_s  # the second one's passes too: the source is said down
    bridge.poll(0)  # (the interval ends too: while down, each interval probes again)
    assert bridge.links[endpoint].down == REPLAY_SILENT
    assert bridge.sink.others() == [("SourceDisconnected", {"reason": REPLAY_SILENT})]
    assert bridge.metrics.heartbeats_skipped.labels("engine-a", "0")._value.get() == 2
    publisher.answer_replay.set()
    _end_interval(bridge, clock)
    assert [e.body["evidence"] for e in bridge.sink.heartbeats()] == [EVENTS, REPLAY]


def test_heartbeats_can_be_turned_off(engines):
    publisher, endpoint = engines.make()
    clock = Clock()
    bridge = engines.bridge(endpoint, clock, interval=0)
    publisher.publish([_stored(1)])
    _pump(bridge, lambda: bridge.sink.seqs() == [0])
    clock.t += 100
    _settle(bridge)
    assert bridge.sink.events == []


# ---------------------------------------------------------------------- replay on connect


def test_an_engine_idle_before_the_bridge_starts_is_known_without_a_live_batch(engines):
    publisher, endpoint = engines.make(buffer_steps=4)
    for h in range(6):
        publisher.publish([_stored(h)])  # nobody listens: the buffer keeps 2..5
    bridge = engines.bridge(endpoint)
    _pump(bridge, lambda: bridge.sink.seqs() == [2, 3, 4, 5])
    epoch = bridge.state[endpoint].epoch
    # first contact: what the buffer no longer held is lost, as for a first live batch
    assert bridge.sink.others() == [("SourceStale", {"first_lost_seq": 0, "last_lost_seq": 1})]
    assert {e for e, _ in bridge.sink.batches} == {epoch}
    publisher.publish([_stored(6)])
    _pump(bridge, lambda: bridge.sink.seqs()[-1] == 6)
    assert bridge.sink.seqs() == [2, 3, 4, 5, 6]


def test_a_restarted_bridge_continues_the_epoch_of_an_idle_engine(engines, tmp_path):
    publisher, endpoint = engines.make()
    state_file = tmp_path / "state.json"
    first = engines.bridge(endpoint, state_file=state_file)
    for h in range(3):
        publisher.publish([_stored(h)])
    _pump(first, lambda: first.sink.seqs() == [0, 1, 2])
    epoch = first.state[endpoint].epoch
    first.close()
    for h in range(3, 5):
        publisher.publish([_stored(h)])  # while no bridge runs; then the engine goes idle
    second = engines.bridge(endpoint, state_file=state_file)
    _pump(second, lambda: second.sink.seqs() == [3, 4])
    assert {e for e, _ in second.sink.batches} == {epoch} and second.sink.others() == []
    second.close()
    third = engines.bridge(endpoint, state_file=state_file)  # nothing new: the saved seq is all it gets back
    _pump(third, lambda: endpoint in third.state)
    assert third.sink.batches == [] and third.sink.others() == [] and third.state[endpoint].epoch == epoch


def test_an_engine_that_restarted_while_the_bridge_was_down_is_found_without_a_live_batch(engines, tmp_path):
    ports = free_ports(2)
    publisher, endpoint = engines.make(ports=ports)
    state_file = tmp_path / "state.json"
    first = engines.bridge(endpoint, state_file=state_file)
    for h in range(5):
        publisher.publish([_stored(h)])
    _pump(first, lambda: first.sink.seqs() == [0, 1, 2, 3, 4])
    epoch = first.state[endpoint].epoch
    first.close()
    publisher.kill()
    restarted, _ = engines.make(ports=ports)  # a new process: seq from 0 again
    restarted.publish([_stored(10)])
    restarted.publish([_stored(11)])
    second = engines.bridge(endpoint, state_file=state_file)
    _pump(second, lambda: second.sink.seqs() == [0, 1])
    assert second.sink.others() == [("PublisherRestarted", {"previous_epoch": epoch})]
    assert ({e for e, _ in second.sink.batches} == {second.state[endpoint].epoch}
            and second.state[endpoint].epoch > epoch)
    assert second.metrics.restarts.labels("engine-a", "0")._value.get() == 1


def test_an_idle_engine_that_restarts_is_found_on_reconnect_and_its_old_epoch_retired(engines):
    ports = free_ports(2)
    publisher, endpoint = engines.make(ports=ports)
    clock = Clock()
    bridge = engines.bridge(endpoint, clock)
    for h in range(4):
        publisher.publish([_stored(h)])
    _pump(bridge, lambda: bridge.sink.seqs() == [0, 1, 2, 3])
    epoch = bridge.state[endpoint].epoch
    publisher.kill()
    _pump(bridge, lambda: not bridge.links[endpoint].connected)
    engines.make(ports=ports)  # back, empty and idle
    _pump(bridge, lambda: len(bridge.sink.others()) == 2)
    assert bridge.sink.others() == [("SourceDisconnected", {"reason": DISCONNECTED}),
                                    ("PublisherRestarted", {"previous_epoch": epoch})]
    new_epoch = bridge.state[endpoint].epoch
    assert new_epoch > epoch and bridge.state[endpoint].last_seq is None
    _end_interval(bridge, clock)
    _end_interval(bridge, clock)
    # the new epoch is alive, with no batch yet (seq -1)
    assert [(e.body["evidence"], e.seq, e.epoch) for e in bridge.sink.heartbeats()][-1] == (REPLAY, -1, new_epoch)


def test_batches_published_during_a_connection_drop_arrive_on_reconnect_without_a_live_batch(engines):
    publisher, endpoint = engines.make()
    bridge = engines.bridge(endpoint)
    publisher.publish([_stored(0)])
    _pump(bridge, lambda: bridge.sink.seqs() == [0])
    publisher.drop_connections()
    for h in range(1, 4):
        publisher.publish([_stored(h)], send_live=False)  # nobody is connected to get them live
    _pump(bridge, lambda: bridge.sink.seqs() == [0, 1, 2, 3])
    assert bridge.sink.others() == [("SourceDisconnected", {"reason": DISCONNECTED})]
    assert len({e for e, _ in bridge.sink.batches}) == 1
    publisher.publish([_stored(4)])
    _pump(bridge, lambda: bridge.sink.seqs()[-1] == 4)
    assert bridge.sink.seqs() == [0, 1, 2, 3, 4]


def test_a_probe_delivers_what_live_lost_in_order(engines):
    publisher, endpoint = engines.make()
    clock = Clock()
    bridge = engines.bridge(endpoint, clock)
    publisher.publish([_stored(0)])
    _pump(bridge, lambda: bridge.sink.seqs() == [0])
    _end_interval(bridge, clock)
    publisher.publish([_stored(1)], send_live=False)  # lost live (e.g. the high-water mark), then idle
    publisher.publish([_stored(2)], send_live=False)
    _end_interval(bridge, clock)
    assert bridge.sink.seqs() == [0, 1, 2] and bridge.sink.others() == []
    assert [(e.body["evidence"], e.seq) for e in bridge.sink.heartbeats()] == [(EVENTS, 0), (REPLAY, 2)]


# ---------------------------------------------------------------------- down at once (issue 49)


def test_a_killed_engine_is_said_down_at_once_and_gets_no_heartbeat_after(engines):
    publisher, endpoint = engines.make()
    clock = Clock()
    bridge = engines.bridge(endpoint, clock)
    for h in range(3):
        publisher.publish([_stored(h)])
    _pump(bridge, lambda: bridge.sink.seqs() == [0, 1, 2])
    epoch = bridge.state[endpoint].epoch
    _end_interval(bridge, clock)
    assert [e.body["evidence"] for e in bridge.sink.heartbeats()] == [EVENTS]
    publisher.kill()
    started = time.monotonic()
    # no interval ends meanwhile (the fake clock stands still): the socket monitor's event alone says it
    _pump(bridge, lambda: bridge.sink.others() != [], timeout_s=2.0)
    print(f"SourceDisconnected {time.monotonic() - started:.3f} s after the kill")
    (event,) = [e for e in bridge.sink.events if e.kind == "SourceDisconnected"]
    assert (event.body, event.seq, event.epoch) == ({"reason": DISCONNECTED}, 2, epoch)
    assert bridge.metrics.disconnects.labels("engine-a", "0", DISCONNECTED)._value.get() == 1
    for _ in range(4):
        _end_interval(bridge, clock)
    assert len(bridge.sink.heartbeats()) == 1 and len(bridge.sink.others()) == 1  # said once, nothing since
    assert bridge.metrics.heartbeats_skipped.labels("engine-a", "0")._value.get() == 4


class SlowBrokerSink(RecordingSink):
    """A sink whose broker acknowledges slowly once ``slow`` is set: ``flush_some`` says "not yet", each call
    waiting its timeout as librdkafka's flush does, until the sink has had a ``SourceDisconnected`` and two more
    calls (or 100 calls: a test that fails does not hang)."""

    def __init__(self) -> None:
        super().__init__()
        self.slow = False
        self.pending_calls = 0

    def flush_some(self, timeout_s: float) -> bool:
        if not self.slow:
            return True
        said = [kind for kind, _ in self.order].count("SourceDisconnected")
        if self.pending_calls >= 100 or (said and self.order[-2:] == [("flush pending", -1)] * 2):
            self.slow = False
            return True
        self.pending_calls += 1
        time.sleep(timeout_s)
        self.order.append(("flush pending", -1))
        return False


def test_an_engine_that_dies_while_the_state_file_waits_for_the_broker_is_said_down_at_once(engines, tmp_path):
    """Saving the state file waits for the broker's acknowledgements (a second or more on a loaded broker): the
    bridge keeps serving its socket monitors meanwhile, so the disconnect is not held up by the flush."""
    publisher, endpoint = engines.make()
    bridge = engines.bridge(endpoint, state_file=tmp_path / "state.json")
    bridge.sink = sink = SlowBrokerSink()
    publisher.publish([_stored(0)])
    _pump(bridge, lambda: sink.seqs() == [0])
    time.sleep(1.1)  # the next batch saves the state file
    sink.slow = True
    killer = threading.Timer(0.3, publisher.kill)  # dies while the save's flush waits
    publisher.publish([_stored(1)])
    killer.start()
    _pump(bridge, lambda: sink.others() != [], timeout_s=10.0)
    killer.join()
    kinds = [kind for kind, _ in sink.order]
    said = kinds.index("SourceDisconnected")
    # said while the flush was still waiting, after the engine's last batch, within a few of its waits
    assert sink.order[said] == ("SourceDisconnected", 1) and kinds[:said].count("batch") == 2
    assert 0 < kinds[:said].count("flush pending") <= 0.3 / 0.05 + 4, kinds
    assert sink.pending_calls < 100 and not bridge._saving  # the save completed once the broker caught up
    assert read_state_file(tmp_path / "state.json") == {state_key(endpoint): {"epoch": bridge.state[endpoint].epoch,
                                                                              "last_seq": 1}}


def test_batches_received_before_the_disconnect_precede_it(engines):
    publisher, endpoint = engines.make()
    bridge = engines.bridge(endpoint)
    publisher.publish([_stored(0)])
    _pump(bridge, lambda: bridge.sink.seqs() == [0])
    for h in range(1, 6):
        publisher.publish([_stored(h)])
    time.sleep(0.2)  # they reach the bridge's socket; the bridge has not read them yet
    publisher.kill()
    time.sleep(0.2)  # the monitor's event too
    _pump(bridge, lambda: bridge.sink.others() != [])
    assert bridge.sink.order[-1] == ("SourceDisconnected", 5)
    assert [seq for kind, seq in bridge.sink.order if kind == "batch"] == [0, 1, 2, 3, 4, 5]


def test_an_engine_whose_connection_drops_for_a_moment_is_back_with_its_replay_as_the_same_epoch(engines):
    publisher, endpoint = engines.make()
    clock = Clock()
    bridge = engines.bridge(endpoint, clock)
    for h in range(3):
        publisher.publish([_stored(h)])
    _pump(bridge, lambda: bridge.sink.seqs() == [0, 1, 2])
    epoch = bridge.state[endpoint].epoch
    _end_interval(bridge, clock)
    publisher.drop_connections()  # a network blip: the process goes on, its subscribers reconnect
    publisher.publish([_stored(3)], send_live=False)  # meanwhile: only its replay buffer has it
    # down at once, and back at once with the replay on reconnect, without waiting for an interval
    _pump(bridge, lambda: [e.kind for e in bridge.sink.events][-1:] == ["SourceHeartbeat"]
          and len(bridge.sink.heartbeats()) == 2)
    assert bridge.sink.others() == [("SourceDisconnected", {"reason": DISCONNECTED})]
    assert [(e.body["evidence"], e.seq, e.epoch) for e in bridge.sink.heartbeats()] == [(EVENTS, 2, epoch),
                                                                                       (REPLAY, 3, epoch)]
    assert bridge.sink.order[-3:] == [("SourceDisconnected", 2), ("batch", 3), ("SourceHeartbeat", 3)]
    assert bridge.state[endpoint].epoch == epoch and bridge.links[endpoint].down is None
    _end_interval(bridge, clock)
    assert bridge.sink.heartbeats()[-1].body["evidence"] == REPLAY  # the usual probes again


def test_a_reconnect_alone_is_no_evidence_for_an_engine_without_a_replay_socket(engines):
    publisher, endpoint = engines.make(replay=False)
    clock = Clock()
    bridge = engines.bridge(endpoint, clock)
    publisher.publish([_stored(1)])
    _pump(bridge, lambda: bridge.sink.seqs() == [0])
    _end_interval(bridge, clock)
    publisher.drop_connections()
    _pump(bridge, lambda: bridge.sink.others() != [])
    _pump(bridge, lambda: bridge.links[endpoint].connected)  # ZMQ reconnected
    _settle(bridge, 0.2)
    for _ in range(2):
        _end_interval(bridge, clock)
    assert [e.body["evidence"] for e in bridge.sink.heartbeats()] == [EVENTS]  # no 'connected' heartbeat now
    publisher.publish([_stored(2)])  # a batch of the same run: back
    _pump(bridge, lambda: bridge.sink.seqs() == [0, 1])
    _end_interval(bridge, clock)
    _end_interval(bridge, clock)
    assert [e.body["evidence"] for e in bridge.sink.heartbeats()] == [EVENTS, EVENTS, CONNECTED]
    assert bridge.sink.others() == [("SourceDisconnected", {"reason": DISCONNECTED})]


def test_one_slow_probe_answer_is_not_silence(engines):
    publisher, endpoint = engines.make()
    clock = Clock()
    bridge = engines.bridge(endpoint, clock, interval=2.0, probe_timeout=1.0)
    publisher.publish([_stored(1)])
    _pump(bridge, lambda: bridge.sink.seqs() == [0])
    _end_interval(bridge, clock)  # events
    publisher.answer_replay.clear()
    clock.t += bridge.heartbeat_interval_s
    _settle(bridge, 0.2)  # the probe is sent
    publisher.answer_replay.set()  # ... and would be answered late: given up first
    clock.t += bridge.probe_timeout_s
    bridge.poll(0)
    _settle(bridge, 0.3)  # the second probe, sent at once, is answered
    assert bridge.sink.others() == [] and bridge.links[endpoint].down is None
    assert [e.body["evidence"] for e in bridge.sink.heartbeats()] == [EVENTS, REPLAY]


def test_a_replay_socket_that_stops_answering_says_the_source_down_once_until_it_answers_again(engines):
    publisher, endpoint = engines.make()
    clock = Clock()
    bridge = engines.bridge(endpoint, clock, interval=2.0, probe_timeout=1.0)
    publisher.publish([_stored(1)])
    _pump(bridge, lambda: bridge.sink.seqs() == [0])
    epoch = bridge.state[endpoint].epoch
    _end_interval(bridge, clock)  # events
    publisher.answer_replay.clear()  # the engine hangs; its connections stay open
    for _ in range(3):
        clock.t += bridge.heartbeat_interval_s
        _settle(bridge, 0.2)  # the probe is sent
        clock.t += bridge.probe_timeout_s  # and given up
        _settle(bridge, 0.1)
    assert bridge.sink.others() == [("SourceDisconnected", {"reason": REPLAY_SILENT})]
    assert bridge.sink.events[-1].seq == 0 and bridge.sink.events[-1].epoch == epoch
    assert [e.body["evidence"] for e in bridge.sink.heartbeats()] == [EVENTS]
    publisher.answer_replay.set()
    _end_interval(bridge, clock)  # the next probe is answered: back, the same run (the connection never dropped)
    assert [e.body["evidence"] for e in bridge.sink.heartbeats()] == [EVENTS, REPLAY]
    assert bridge.links[endpoint].down is None and bridge.sink.others() == [
        ("SourceDisconnected", {"reason": REPLAY_SILENT})]


def test_an_engine_back_as_a_new_process_is_retired_before_its_first_heartbeat(engines):
    ports = free_ports(2)
    publisher, endpoint = engines.make(ports=ports)
    clock = Clock()
    bridge = engines.bridge(endpoint, clock)
    for h in range(3):
        publisher.publish([_stored(h)])
    _pump(bridge, lambda: bridge.sink.seqs() == [0, 1, 2])
    epoch = bridge.state[endpoint].epoch
    publisher.kill()
    _pump(bridge, lambda: bridge.sink.others() != [])
    engines.make(ports=ports)  # back on the same ports: seq from 0, an empty buffer, idle
    _pump(bridge, lambda: bridge.sink.heartbeats() != [])
    new_epoch = bridge.state[endpoint].epoch
    assert [kind for kind, _ in bridge.sink.order[-3:]] == ["SourceDisconnected", "PublisherRestarted",
                                                            "SourceHeartbeat"]
    assert [(e.body, e.seq, e.epoch) for e in bridge.sink.heartbeats()] == [({"evidence": REPLAY}, -1, new_epoch)]
    assert new_epoch > epoch


# ---------------------------------------------------------------------- produce and the simulator


def test_send_heartbeats_names_each_source_with_its_epoch_and_last_seq(tmp_path):
    import json

    from producers.capture import produce_capture

    path = tmp_path / "capture.jsonl"
    lines = [{"instance_id": name, "data_parallel_rank": 0, "seq": seq, "ts": 1.0, "events": []}
             for name, seqs in (("a", (0, 1, 2)), ("b", (0,))) for seq in seqs]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    sink = RecordingSink()
    bridge = produce_capture(path, sink)
    assert bridge.send_heartbeats() == 2
    assert [(e.body, e.seq) for e in sink.heartbeats()] == [({"evidence": "producing"}, 2),
                                                            ({"evidence": "producing"}, 0)]


class FakeProducer:
    """What replay_to_kafka needs of a producer: ``send``, ``flush`` and ``stats``."""

    def __init__(self, clock: Clock, step_s: float) -> None:
        self.records: list[dict] = []
        self.clock, self.step_s = clock, step_s

    def send(self, record: dict) -> None:
        self.records.append(record)
        if record["block_hash"] is not None:
            self.clock.t += self.step_s  # the wall clock moves as records are produced

    def flush(self):
        return type("Stats", (), {"acked": len(self.records)})()


def test_the_simulator_heartbeats_every_publisher_each_interval_and_at_its_end():
    from producers.simulator import ClusterSimulator, FleetConfig, load_trace, replay_to_kafka

    requests = load_trace(limit=30)
    fleet = FleetConfig(gpu_blocks=600, cpu_blocks=900, kvcr_blocks=1200)
    blocks = sum(1 for batch in ClusterSimulator(fleet).run(requests) for event in batch.events
                 if event["type"] != "AllBlocksCleared" for _ in event["block_hashes"])
    clock = Clock()
    producer = FakeProducer(clock, 0.01)
    result = replay_to_kafka(requests, producer, fleet, heartbeat_interval_s=blocks * 0.01 / 3.5, monotonic=clock)
    heartbeats = [r for r in producer.records if r["event"][0].endswith("SourceHeartbeat")]
    assert result.heartbeats == len(heartbeats) > 0
    by_publisher: dict[tuple, list] = {}
    for r in heartbeats:
        assert r["event"][1] == {"evidence": "producing"} and r["block_hash"] is None
        by_publisher.setdefault((r["instance_id"], r["worker_rank"]), []).append(r)
    last_seq: dict[tuple, int] = {}
    for r in producer.records:
        if r["batch_index"] >= 0:  # an engine event's record (a clear has no block hash either)
            last_seq[(r["instance_id"], r["worker_rank"])] = r["seq"]
    assert set(by_publisher) == set(last_seq)  # every publisher that published, and no other
    assert {len(v) for v in by_publisher.values()} <= {3, 4}  # about 3 intervals, and one at the end
    assert max(len(v) for v in by_publisher.values()) == 4
    assert producer.records[-len(by_publisher):] == heartbeats[-len(by_publisher):]  # the end's come last
    assert {key: v[-1]["seq"] for key, v in by_publisher.items()} == last_seq


def test_the_simulator_sends_no_heartbeat_with_an_interval_of_0():
    from producers.simulator import FleetConfig, load_trace, replay_to_kafka

    producer = FakeProducer(Clock(), 1.0)
    result = replay_to_kafka(load_trace(limit=5), producer, FleetConfig(gpu_blocks=600), heartbeat_interval_s=0)
    assert result.heartbeats == 0
    assert not [r for r in producer.records if r["event"][0].endswith("SourceHeartbeat")]


def test_an_engine_without_a_replay_buffer_is_not_taken_for_restarted_while_its_connection_holds(engines):
    publisher, endpoint = engines.make(buffer_steps=0)  # vLLM buffer_steps 0: every replay answer is empty
    clock = Clock()
    bridge = engines.bridge(endpoint, clock)
    publisher.publish([_stored(1)])
    _pump(bridge, lambda: bridge.sink.seqs() == [0])
    _end_interval(bridge, clock)
    _end_interval(bridge, clock)
    _end_interval(bridge, clock)
    assert bridge.sink.others() == [] and bridge.metrics.restarts.labels("engine-a", "0")._value.get() == 0
    assert [e.body["evidence"] for e in bridge.sink.heartbeats()] == [EVENTS, REPLAY, REPLAY]
