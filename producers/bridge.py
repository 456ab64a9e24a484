"""Engine bridge: subscribe to vLLM/SGLang ZMQ publishers and produce their events to Kafka.

Protocol (docs/ingesting.md, "Live engines"): the publisher binds a PUB
socket and sends 3-frame messages ``(topic, seq as 8-byte big-endian, msgpack
KVEventBatch)``; ``seq`` starts at 0 per publisher and grows by one per batch.
An optional ROUTER replay socket answers ``[b"", start_seq]`` from a DEALER
with every buffered batch from ``start_seq`` on (3 frames each, 2 in older vLLM)
and then an end marker whose seq is ``ff..ff``. Requests older than the buffer
start at the oldest batch it holds, so the first replayed seq must be checked.

This module has :class:`Bridge`: its sockets, the poll loop and the set of publishers it follows. The rest is
in one module per concern, and every name other modules use is importable from here:

* :mod:`producers.bridge_endpoints`: the publishers (:class:`PublisherEndpoint`, :func:`offset_endpoint`,
  :func:`data_parallel_endpoints`, :func:`registration_endpoints`) and the replay socket's frames;
* :mod:`producers.bridge_sink`: where batches go and what is counted (:class:`BatchSink`,
  :class:`KafkaBatchSink`, :class:`BridgeMetrics`);
* :mod:`producers.bridge_sequence`: each source's batches in order (first contact, gaps, duplicates, restarts,
  replay on connect's answer) and the state file;
* :mod:`producers.bridge_liveness`: connection events, replay requests in flight, heartbeats
  (:func:`heartbeat_evidence`, :data:`EVENTS`, :data:`REPLAY`, :data:`CONNECTED`, :data:`PRODUCING`,
  :data:`PROBE`), and ``SourceDisconnected`` when an engine goes (:data:`DISCONNECTED`, :data:`REPLAY_SILENT`);
* :mod:`producers.bridge_follower`: ``--follow-registrations`` (:class:`RegistrationFollower`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import zmq

from producers.bridge_endpoints import (
    CONNECTABLE,
    END_SEQ,
    PublisherEndpoint,
    data_parallel_endpoints,
    monitorable,
    offset_endpoint,
    registration_endpoints,
    state_key,
)
from producers.bridge_follower import RegistrationFollower
from producers.bridge_liveness import (
    CONNECTED,
    DISCONNECTED,
    EVENTS,
    PROBE,
    PRODUCING,
    REPLAY,
    REPLAY_SILENT,
    ZMTP_PING_MS,
    ZMTP_TIMEOUT_MS,
    BridgeLiveness,
    Link,
    Probe,
    heartbeat_evidence,
)
from producers.bridge_sequence import BridgeSequencing, SourceState, read_state_file
from producers.bridge_sink import BatchSink, BridgeMetrics, KafkaBatchSink
from producers.split import Publisher

__all__ = [
    "END_SEQ", "EVENTS", "REPLAY", "CONNECTED", "PRODUCING", "PROBE", "DISCONNECTED", "REPLAY_SILENT", "ZMTP_PING_MS",
    "ZMTP_TIMEOUT_MS",
    "heartbeat_evidence", "PublisherEndpoint", "offset_endpoint", "data_parallel_endpoints", "registration_endpoints",
    "BatchSink", "BridgeMetrics", "KafkaBatchSink", "Bridge", "RegistrationFollower",
]

log = logging.getLogger(__name__)


class Bridge(BridgeSequencing, BridgeLiveness):
    """Subscribe to publishers and hand their batches, in seq order, to a sink; replay on connect; heartbeats.

    Args:
        endpoints: the publishers to begin with; :meth:`add_endpoint` and :meth:`remove_endpoint` change the set
            while the bridge runs (:class:`RegistrationFollower`).
        sink: where batches go (e.g. :class:`KafkaBatchSink`).
        zmq_topic: subscription prefix (vLLM ``KVEventsConfig.topic``, default empty: everything).
        replay_timeout_s: how long to wait for the end marker of a replay that recovers a gap (the live loop waits)
            or of a replay on connect (it does not), seconds.
        clock_ms: source of publisher epochs (milliseconds since the Unix epoch).
        receive_hwm: ZMQ receive high-water mark per socket (a bounded buffer: beyond it ZMQ drops, the
            bridge sees a gap and replays).
        state_file: where the bridge keeps each source's epoch and last seq (JSON, written at most once a
            second and on close). A restarted bridge then continues a publisher's epoch, replaying from
            the last seq it produced, instead of taking the publisher for restarted; a first seq at or
            below the saved one means the publisher did restart meanwhile. None: kept in memory only.
        heartbeat_interval_s: how often each contacted source gets a ``SourceHeartbeat`` while there is evidence
            that its engine is alive (:mod:`producers.bridge_liveness`), seconds; 0: none (replays on connect
            still happen).
        probe_timeout_s: how long a heartbeat's probe of the replay socket may take to reach the end marker;
            later, the interval has no evidence and no heartbeat, seconds. The probe does not block the live loop.
        monotonic: the clock of intervals and deadlines, seconds (tests give a fake one).
    """

    def __init__(self, endpoints: list[PublisherEndpoint], sink: BatchSink, *, zmq_topic: bytes = b"",
                 metrics: BridgeMetrics | None = None, replay_timeout_s: float = 5.0,
                 clock_ms: Callable[[], int] = lambda: int(time.time() * 1000), receive_hwm: int = 100_000,
                 context: zmq.Context | None = None, state_file: Path | None = None,
                 heartbeat_interval_s: float = 5.0, probe_timeout_s: float = 1.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if heartbeat_interval_s < 0 or probe_timeout_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be >= 0 and probe_timeout_s > 0, got "
                             f"{heartbeat_interval_s} and {probe_timeout_s}")
        self.endpoints = endpoints
        self.sink = sink
        self.metrics = metrics or BridgeMetrics()
        self.replay_timeout_ms = int(replay_timeout_s * 1000)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.probe_timeout_s = probe_timeout_s
        self._monotonic = monotonic
        self._next_tick = monotonic() + heartbeat_interval_s
        self._clock_ms = clock_ms
        self._context = context or zmq.Context.instance()
        self._sockets: dict[zmq.Socket, PublisherEndpoint] = {}
        self._monitors: dict[zmq.Socket, PublisherEndpoint] = {}
        self._probes: dict[zmq.Socket, Probe] = {}
        self.links: dict[PublisherEndpoint, Link] = {}
        self.state: dict[PublisherEndpoint, SourceState] = {}
        self._state_file = state_file
        self._saved: dict[str, dict] = read_state_file(state_file)
        self._saved_at = 0.0
        #: A state save is flushing the sink (it serves the socket monitors meanwhile, and saves nothing nested).
        self._saving = False
        # epochs only grow: a new one is later than every saved one, whatever the clock says
        self._last_epoch = max((s["epoch"] for s in self._saved.values()), default=0)
        self._closed = False
        self._poller = zmq.Poller()
        self._zmq_topic = zmq_topic
        self._receive_hwm = receive_hwm
        #: The publishers subscribed to now, in the order they were added (:meth:`add_endpoint`,
        #: :meth:`remove_endpoint`).
        self.endpoints: list[PublisherEndpoint] = []
        for endpoint in endpoints:
            self.add_endpoint(endpoint)

    def add_endpoint(self, endpoint: PublisherEndpoint) -> None:
        """Subscribe to one more publisher, at once (``kvstream bridge --follow-registrations`` adds the engines
        registered while it runs).

        Its SUB socket connects, and the replay on connect asks for what the bridge has not seen as soon as the
        connection is up (:mod:`producers.bridge_sequence`): from the last seq of the state file (or of an earlier
        subscription of the same source, :meth:`remove_endpoint`), else from 0.

        Raises:
            ValueError: ``endpoint`` is already subscribed, the bridge is closed, or its PUB or replay address is
                no ZMQ address a subscriber can connect to (``tcp://HOST:PORT``, ``ipc://PATH``,
                ``inproc://NAME``; a bind address such as ``tcp://*:5557`` is not). Nothing is left subscribed.
        """
        if self._closed:
            raise ValueError(f"the bridge is closed: cannot subscribe to {endpoint.endpoint}")
        if endpoint in self.endpoints:
            raise ValueError(f"{endpoint.label}: already subscribed to {endpoint.endpoint}")
        for address in (endpoint.endpoint, endpoint.replay_endpoint):
            # the replay socket is connected only once the PUB connection is up: a bad address would fail there,
            # inside the live loop, so it is refused here
            if address is not None and not CONNECTABLE.match(address):
                raise ValueError(f"{endpoint.label}: cannot connect to {address!r}: expected tcp://HOST:PORT, "
                                 "ipc://PATH or inproc://NAME")
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, self._receive_hwm)
        sock.setsockopt(zmq.SUBSCRIBE, self._zmq_topic)
        sock.setsockopt(zmq.HEARTBEAT_IVL, ZMTP_PING_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMTP_TIMEOUT_MS)
        link = Link(unconfirmed=state_key(endpoint) in self._saved)
        monitor = None
        try:
            if monitorable(endpoint.endpoint):
                # before connect, so that the first EVENT_CONNECTED is seen: it starts the replay on connect
                monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            else:
                link.connected = True
            sock.connect(endpoint.endpoint)
        except zmq.ZMQError as exc:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)
            raise ValueError(f"{endpoint.label}: cannot connect to {endpoint.endpoint!r}: {exc}") from None
        self.links[endpoint] = link
        if monitor is not None:
            self._monitors[monitor] = endpoint
            self._poller.register(monitor, zmq.POLLIN)
        self._sockets[sock] = endpoint
        self._poller.register(sock, zmq.POLLIN)
        self.endpoints.append(endpoint)
        if link.connected:  # no monitor: replay on connect now
            self._start_replay(endpoint, heartbeat=False, timeout_s=self.replay_timeout_ms / 1000)

    def remove_endpoint(self, endpoint: PublisherEndpoint) -> None:
        """Stop following a publisher: close its SUB socket, its socket monitor and any replay request in flight,
        and forget its connection. No more batches or heartbeats of it are produced from now on.

        Its epoch and last seq are kept (in memory at once, in the state file at its next write): subscribed again
        (:meth:`add_endpoint`), in this process or after a restart, the source continues its epoch and the replay
        on connect delivers what the publisher still buffers of what it sent meanwhile, as after a bridge restart;
        a publisher that restarted meanwhile begins a new epoch.

        Raises:
            KeyError: ``endpoint`` is not subscribed.
        """
        if endpoint not in self.endpoints:
            raise KeyError(f"{endpoint.label}: not subscribed to {endpoint.endpoint}")
        link = self.links[endpoint]
        if link.probe is not None:
            self._close_probe(link.probe)
        sock = next(s for s, e in self._sockets.items() if e == endpoint)
        monitor = next((m for m, e in self._monitors.items() if e == endpoint), None)
        self._poller.unregister(sock)
        del self._sockets[sock]
        if monitor is not None:
            sock.disable_monitor()
            self._poller.unregister(monitor)
            del self._monitors[monitor]
            monitor.close(linger=0)
        sock.close(linger=0)
        del self.links[endpoint]
        self.endpoints.remove(endpoint)
        state = self.state.pop(endpoint, None)
        if state is not None:
            key = state_key(endpoint)
            if state.last_seq is not None:
                self._saved[key] = {"epoch": state.epoch, "last_seq": state.last_seq}
            else:  # an epoch begun by a restart, before its first batch: the saved seq is the old process's
                self._saved.pop(key, None)
        self._maybe_save()

    def _new_epoch(self) -> int:
        self._last_epoch = max(self._clock_ms(), self._last_epoch + 1)
        return self._last_epoch

    def _publisher(self, endpoint: PublisherEndpoint, state: SourceState) -> Publisher:
        return Publisher(endpoint.instance_id, endpoint.data_parallel_rank, endpoint.worker_rank, endpoint.world_size,
                         endpoint.aggregation, state.epoch, endpoint.engine, endpoint.report_mode)

    @staticmethod
    def _labels(endpoint: PublisherEndpoint) -> tuple[str, str]:
        return endpoint.instance_id, str(endpoint.data_parallel_rank)

    def poll(self, timeout_ms: int = 100) -> int:
        """Receive what has arrived (waiting up to ``timeout_ms``, less when a deadline or an interval ends sooner):
        live batches, connection events, replay answers; then give up late replays and send the interval's
        heartbeats if it has ended. Returns the number of live messages handled."""
        handled = 0
        now = self._monotonic()
        deadlines = [probe.deadline for probe in self._probes.values()]
        if self.heartbeat_interval_s:
            deadlines.append(self._next_tick)
        if deadlines:
            timeout_ms = max(0, min(timeout_ms, int((min(deadlines) - now) * 1000) + 1))
        for sock, _ in self._poller.poll(timeout_ms):
            if sock in self._monitors:
                self._on_monitor(sock)
                continue
            if sock in self._probes:
                self._on_probe_reply(sock)
                continue
            endpoint = self._sockets.get(sock)
            if endpoint is None:  # a probe closed earlier in this round
                continue
            handled += self._receive_live(sock, endpoint)
        now = self._monotonic()
        for probe in [p for p in self._probes.values() if p.deadline <= now]:
            self._give_up(probe)
        if self.heartbeat_interval_s and now >= self._next_tick:
            self._next_tick += self.heartbeat_interval_s
            if self._next_tick <= now:  # intervals missed (a long catch-up held the loop): one heartbeat, not a burst
                self._next_tick = now + self.heartbeat_interval_s
            self._heartbeat_interval()
        return handled

    def _receive_live(self, sock: zmq.Socket, endpoint: PublisherEndpoint) -> int:
        """Handle every live message ``sock`` holds now; returns how many. Each is evidence that the engine is alive
        while its connection is up; one on a source that was down brings it back (no heartbeat needed: its events
        renew its lease)."""
        link = self.links[endpoint]
        handled = 0
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return handled
            handled += 1
            if link.down is None or link.connected:
                link.live_events = True
                link.unanswered_probes = 0
                if link.down is not None:
                    self._came_back(endpoint, EVENTS)
            if len(frames) != 3 or len(frames[1]) != 8:
                self.sink_dead_letter(endpoint, frames[-1], f"live message of {len(frames)} frames "
                                                            f"(expected topic, 8-byte seq, payload)")
                continue
            self.on_live(endpoint, int.from_bytes(frames[1], "big"), frames[2])

    def _drain_live(self, endpoint: PublisherEndpoint) -> int:
        """Handle the live messages of ``endpoint`` already received (before its ``SourceDisconnected``); returns
        how many."""
        sock = next((s for s, e in self._sockets.items() if e == endpoint), None)
        return 0 if sock is None else self._receive_live(sock, endpoint)

    def sink_dead_letter(self, endpoint: PublisherEndpoint, payload: bytes, reason: str) -> None:
        """Dead-letter a whole message that is not even a batch (only with a Kafka sink)."""
        producer = getattr(self.sink, "producer", None)
        self.metrics.dead_lettered.labels(endpoint.instance_id, str(endpoint.data_parallel_rank)).inc()
        if producer is not None:
            producer.dead_letter(payload, reason, endpoint.endpoint)
        else:
            log.warning("%s: dropped message: %s", endpoint.endpoint, reason)

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Poll until ``should_stop()`` returns True."""
        while not should_stop():
            self.poll(100)

    def close(self) -> None:
        """Save the state file and close the subscriber, monitor and replay sockets (again: nothing more)."""
        self.save_state()
        if self._closed:
            return
        self._closed = True
        for probe in list(self._probes.values()):
            self._close_probe(probe)
        for sock in self._sockets:
            if monitorable(self._sockets[sock].endpoint):
                sock.disable_monitor()
            sock.close(linger=0)
        for monitor in self._monitors:
            monitor.close(linger=0)
