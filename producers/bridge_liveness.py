"""Liveness of the bridge's sources: connection events, replay requests in flight, heartbeats.

Heartbeats: every ``heartbeat_interval_s`` each source the bridge has had contact
with gets a ``SourceHeartbeat`` (:data:`schemas.SOURCE_HEARTBEAT`, with its
current epoch and last seq) while there is evidence that its engine is alive
(:func:`heartbeat_evidence`): live batches since the last interval (``events``),
else an answer of its replay socket (``replay``: a replay on connect, a gap's
catch-up, or a probe asking from the last seq, as in :mod:`producers.bridge_sequence`),
else, for a publisher without a replay socket, its SUB connection up (``connected``). Probes and
replays on connect run without blocking the live loop: each is a DEALER socket
in the bridge's poller, given up at its deadline.

The connections are watched with ZMQ's socket monitor (``EVENT_CONNECTED``,
``EVENT_DISCONNECTED``) and ZMTP heartbeats (:data:`ZMTP_PING_MS`); whenever a
connection comes up, the bridge asks the replay socket for what it has not seen
(docs/ingesting.md, "Heartbeats and replay on connect").

Down at once: when a contacted source's connection drops (``EVENT_DISCONNECTED``), or its replay socket leaves
:data:`SILENT_PROBES` heartbeat probes in a row unanswered (the second sent as soon as the first is given up, so a
single slow answer is not taken for a hung engine), the bridge writes a ``SourceDisconnected``
(:data:`schemas.SOURCE_DISCONNECTED`, reason :data:`DISCONNECTED` or :data:`REPLAY_SILENT`) at once, after the
batches it had already received, and sends no heartbeat for the source until the engine shows it is alive and
the same run (:func:`heartbeat_evidence` with ``down``): a live batch once connected again, or a replay answer that
holds the last seq the bridge delivered (a connection that never dropped: any answer). A connection that comes back
up is not evidence by itself. A restarted engine is found as before (seq going back, an empty replay):
``PublisherRestarted`` first, then the new epoch's heartbeats.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from producers.bridge_endpoints import END_SEQ, PublisherEndpoint, replay_frames, state_key
from producers.bridge_sink import BatchSink, BridgeMetrics
from schemas import SOURCE_DISCONNECTED, SOURCE_HEARTBEAT

if TYPE_CHECKING:
    from producers.bridge_sequence import SourceState

# every part of the bridge logs as ``producers.bridge``, the name its lines (the text format's name, the JSON's
# ``logger``) had before the bridge was split into modules: log filters and alerts keep matching
log = logging.getLogger("producers.bridge")


#: The evidence a heartbeat names (kv_event ``SourceHeartbeat.evidence``): live batches since the last interval, an
#: answer of the replay socket, the SUB connection up (publishers without a replay socket), and what a producer
#: says that publishes a source's events itself (the simulator, ``kvstream produce``).
EVENTS, REPLAY, CONNECTED, PRODUCING = "events", "replay", "connected", "producing"
#: :func:`heartbeat_evidence`'s answer when only the replay socket can tell: probe it.
PROBE = "probe"
#: Why a ``SourceDisconnected`` was sent (kv_event v6 ``SourceDisconnected.reason``): the socket monitor saw the SUB
#: connection drop; a heartbeat's probe of the replay socket got no end marker within the probe timeout.
DISCONNECTED, REPLAY_SILENT = "disconnected", "replay-silent"
#: Heartbeat probes in a row without an answer that make a connected source :data:`REPLAY_SILENT`: after the first,
#: the next is sent at once.
SILENT_PROBES = 2

#: ZMTP heartbeats on each SUB connection (libzmq >= 4.2): a PING every second, and a connection whose peer has
#: answered nothing for 3 seconds is dropped, so a dead engine host (no TCP FIN ever comes) shows up as
#: ``EVENT_DISCONNECTED`` too, not only a process that exited.
ZMTP_PING_MS, ZMTP_TIMEOUT_MS = 1000, 3000


def heartbeat_evidence(*, contacted: bool, live_events: bool, replay_answered: bool, connected: bool,
                       has_replay: bool, down: bool = False) -> str | None:
    """What one source's heartbeat of this interval can say (the rule of docs/ingesting.md, "Heartbeats").

    Args:
        contacted: the bridge has had a batch of the source (or detected its restart); before that it sends none,
            as it has no epoch to name.
        live_events: live batches arrived since the last interval.
        replay_answered: a replay request reached its end marker since the last interval (a replay on connect,
            a gap's catch-up).
        connected: the SUB connection is up (socket monitor).
        has_replay: the publisher has a replay socket.
        down: the bridge said the source was down (``SourceDisconnected``) and has had no evidence since. Then an
            open connection is no evidence (it may be a new process's, or the same hung one's), nor an answer from
            before: only live batches, or a probe's answer (:meth:`BridgeLiveness._replay_answered` judges it).

    Returns:
        :data:`EVENTS`, :data:`REPLAY`, :data:`CONNECTED`; :data:`PROBE`: ask the replay socket, and heartbeat
        ``replay`` if it answers within the probe timeout; None: no evidence, no heartbeat.
    """
    if not contacted:
        return None
    if live_events:
        return EVENTS
    if not connected:
        return None
    if down:
        return PROBE if has_replay else None
    if replay_answered:
        return REPLAY
    # with a replay socket, a connection alone is weak evidence (a hung engine's kernel keeps it open): ask
    return PROBE if has_replay else CONNECTED


@dataclass
class Probe:
    """A replay request in flight (a replay on connect, a retry of first contact, or a heartbeat's probe)."""

    endpoint: PublisherEndpoint
    socket: zmq.Socket
    #: The seq asked from.
    start: int
    #: The source's epoch and last seq when asked (None, None: no contact yet). If either has changed when the
    #: answer comes, live batches have decided the source's fate meanwhile, and the answer is only evidence.
    epoch: int | None
    last_seq: int | None
    #: When it is given up (the bridge's monotonic clock, seconds).
    deadline: float
    #: Send a ``replay`` heartbeat when it is answered (it is a heartbeat's probe).
    heartbeat: bool
    batches: list[tuple[int, bytes]] = field(default_factory=list)


@dataclass
class Link:
    """What the bridge knows of one publisher's connection, for heartbeats and replay on connect."""

    #: The SUB connection is up (socket monitor: ``EVENT_CONNECTED`` seen last, not ``EVENT_DISCONNECTED``).
    connected: bool = False
    #: Live messages arrived since the last heartbeat interval.
    live_events: bool = False
    #: A replay request (not a heartbeat's probe) reached its end marker since the last interval.
    replay_answered: bool = False
    #: The replay request in flight, at most one per publisher.
    probe: Probe | None = None
    #: The evidence of the last interval (None: none), to log only when it changes.
    evidence: str | None = None
    #: The process behind the connection may not be the one whose batches the bridge delivered last: the
    #: connection dropped since (or the bridge restarted). Only then does an empty replay answer mean a restart;
    #: a replay answer that holds the last seq, or a restart found, settles it.
    unconfirmed: bool = False
    #: An empty replay answer without a reason has been logged (once per source).
    warned_empty: bool = False
    #: The reason of the ``SourceDisconnected`` the bridge sent (:data:`DISCONNECTED`, :data:`REPLAY_SILENT`) while it
    #: has had no evidence since that the engine is alive; None: not down.
    down: str | None = None
    #: Heartbeat probes given up in a row since the replay socket last answered (:data:`SILENT_PROBES`).
    unanswered_probes: int = 0


class BridgeLiveness:
    """The part of :class:`producers.bridge.Bridge` that tells whether each engine is alive: the socket monitor's
    connection events, the replay requests in flight (replays on connect and heartbeats' probes, answered through
    the bridge's poller) and each interval's heartbeats.

    A mixin of :class:`producers.bridge.Bridge`, which sets up the attributes below and has ``_labels`` and
    ``_publisher``; the answer of a replay is applied by
    :meth:`producers.bridge_sequence.BridgeSequencing._apply_replay`.
    """

    endpoints: list[PublisherEndpoint]
    sink: BatchSink
    metrics: BridgeMetrics
    links: dict[PublisherEndpoint, Link]
    state: dict[PublisherEndpoint, SourceState]
    replay_timeout_ms: int
    probe_timeout_s: float
    _context: zmq.Context
    _poller: zmq.Poller
    _monitors: dict[zmq.Socket, PublisherEndpoint]
    _probes: dict[zmq.Socket, Probe]
    _saved: dict[str, dict]
    _monotonic: Callable[[], float]
    _drain_live: Callable[[PublisherEndpoint], int]

    # ------------------------------------------------------------------ replay requests in flight

    def _replay_start(self, endpoint: PublisherEndpoint) -> int:
        """The seq a replay on connect or a probe asks from: the last one delivered (from the state file's after a
        bridge restart), whose presence in the answer shows the publisher is the same process; 0 before any
        batch."""
        state = self.state.get(endpoint)
        if state is not None:
            return 0 if state.last_seq is None else state.last_seq
        saved = self._saved.get(state_key(endpoint))
        return saved["last_seq"] if saved else 0

    def _start_replay(self, endpoint: PublisherEndpoint, *, heartbeat: bool, timeout_s: float) -> None:
        """Send a replay request without waiting for its answer (the poller delivers it to
        :meth:`_on_probe_reply`). A request already in flight for ``endpoint`` is kept when this one is a heartbeat's
        probe (its answer serves both), and replaced otherwise (a reconnect: the old request went to the old
        connection)."""
        if endpoint.replay_endpoint is None:
            return
        link = self.links[endpoint]
        if link.probe is not None:
            if heartbeat:
                link.probe.heartbeat = True
                return
            heartbeat = link.probe.heartbeat
            self._close_probe(link.probe)
        state = self.state.get(endpoint)
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)  # a request given up is dropped with its socket: a late answer goes nowhere
        sock.connect(endpoint.replay_endpoint)
        start = self._replay_start(endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        self.metrics.replay_requests.labels(*self._labels(endpoint)).inc()
        probe = link.probe = Probe(endpoint, sock, start, state.epoch if state else None,
                                    state.last_seq if state else None, self._monotonic() + timeout_s, heartbeat)
        self._probes[sock] = probe
        self._poller.register(sock, zmq.POLLIN)

    def _close_probe(self, probe: Probe) -> None:
        self._poller.unregister(probe.socket)
        probe.socket.close(linger=0)
        del self._probes[probe.socket]
        link = self.links[probe.endpoint]
        if link.probe is probe:
            link.probe = None

    def _give_up(self, probe: Probe) -> None:
        """The probe's deadline passed without the end marker: no evidence; its batches are dropped (the next
        probe or live batch asks again)."""
        self._close_probe(probe)
        self.metrics.replay_unanswered.labels(*self._labels(probe.endpoint)).inc()
        log.info("%s: the replay socket did not answer a request from seq %d in time%s", probe.endpoint.label,
                 probe.start, ": no heartbeat" if probe.heartbeat else "")
        if probe.heartbeat:
            self.metrics.heartbeats_skipped.labels(*self._labels(probe.endpoint)).inc()
            self._note_evidence(probe.endpoint, None, "its replay socket did not answer")
            link = self.links[probe.endpoint]
            if link.connected:  # else it is down as disconnected already
                link.unanswered_probes += 1
                if link.unanswered_probes >= SILENT_PROBES:
                    self._went_down(probe.endpoint, REPLAY_SILENT)
                elif link.down is None and probe.endpoint in self.state:  # one slow answer is not silence: again
                    self._start_replay(probe.endpoint, heartbeat=True, timeout_s=self.probe_timeout_s)

    def _on_probe_reply(self, sock: zmq.Socket) -> None:
        probe = self._probes[sock]
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = replay_frames(frames)
            if reply is None:
                log.warning("%s: replay reply of %d frames ignored", probe.endpoint.label, len(frames))
                continue
            seq_bytes, payload = reply
            if seq_bytes != END_SEQ:
                probe.batches.append((int.from_bytes(seq_bytes, "big"), payload))
                continue
            self._close_probe(probe)
            self._replay_answered(probe)
            return

    def _replay_answered(self, probe: Probe) -> None:
        """A replay request reached its end marker: apply the answer (module docstring, "Replay on connect"), then
        count it as evidence (a heartbeat now, for a heartbeat's probe)."""
        endpoint = probe.endpoint
        state = self.state.get(endpoint)
        if (state.epoch if state else None, state.last_seq if state else None) == (probe.epoch, probe.last_seq):
            self._apply_replay(endpoint, state, probe.start, [b for b in probe.batches if b[0] >= probe.start])
        # else live batches came meanwhile and decided first contact, a gap or a restart themselves
        link = self.links[endpoint]
        link.unanswered_probes = 0
        if link.down is not None:
            # evidence only of the same run (an answer that held the last seq, on a connection that may have been
            # another process's) or of a restart found, whose PublisherRestarted went first: up again at once
            if link.connected and not link.unconfirmed and endpoint in self.state:
                self._came_back(endpoint, REPLAY)
        elif probe.heartbeat and endpoint in self.state:
            self._heartbeat(endpoint, REPLAY)
        elif not probe.heartbeat:
            link.replay_answered = True

    # ------------------------------------------------------------------ connections and heartbeats

    def _on_monitor(self, monitor: zmq.Socket) -> None:
        endpoint = self._monitors[monitor]
        link = self.links[endpoint]
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_CONNECTED:
                log.info("%s: connected to %s; asking its replay socket what the bridge has not seen",
                         endpoint.label, endpoint.endpoint)
                link.connected = True
                # at start and after every disconnect: an idle engine sends nothing live that would start a catch-up
                self._start_replay(endpoint, heartbeat=False, timeout_s=self.replay_timeout_ms / 1000)
            elif event == zmq.EVENT_DISCONNECTED:
                log.warning("%s: disconnected from %s (ZMQ reconnects)", endpoint.label, endpoint.endpoint)
                link.connected = False
                link.unconfirmed = True  # the engine may come back as a new process
                if link.probe is not None:  # asked of the process that went: the replay on reconnect asks again
                    self._close_probe(link.probe)
                self._went_down(endpoint, DISCONNECTED)

    def _went_down(self, endpoint: PublisherEndpoint, reason: str) -> None:
        """The bridge lost a source's engine (``reason``: :data:`DISCONNECTED`, :data:`REPLAY_SILENT`): a
        ``SourceDisconnected`` now, unless it is down already or was never contacted (no epoch to name), and no
        heartbeat until there is evidence again. The batches already received go first, so that nothing of the
        engine follows the disconnect in kv-events."""
        link = self.links[endpoint]
        if link.down is not None or endpoint not in self.state:
            return
        self._drain_live(endpoint)
        link.down = reason
        link.live_events = link.replay_answered = False  # what they said is from before
        state = self.state[endpoint]
        self.sink.source_event(self._publisher(endpoint, state), SOURCE_DISCONNECTED, {"reason": reason},
                               -1 if state.last_seq is None else state.last_seq)
        self.metrics.disconnects.labels(*self._labels(endpoint), reason).inc()
        poll_sink = getattr(self.sink, "poll", None)
        if poll_sink is not None:
            poll_sink()
        log.warning("%s: the engine is gone (%s): SourceDisconnected sent; no heartbeat until it is back",
                    endpoint.label, "its connection dropped" if reason == DISCONNECTED
                    else "its replay socket did not answer")

    def _came_back(self, endpoint: PublisherEndpoint, evidence: str) -> None:
        """A source that was down shows it is alive and the same run (or a new one, announced by
        ``PublisherRestarted``): heartbeats again, the first one now for an answer of its replay socket (a live
        batch speaks for itself)."""
        link = self.links[endpoint]
        log.info("%s: the engine is back (evidence: %s) after %s", endpoint.label, evidence, link.down)
        link.down = None
        if evidence != EVENTS:
            self._heartbeat(endpoint, evidence)

    def _heartbeat_interval(self) -> None:
        """An interval ended: each source's heartbeat, by its evidence (:func:`heartbeat_evidence`)."""
        poll_sink = getattr(self.sink, "poll", None)
        if poll_sink is not None:
            poll_sink()
        for endpoint in self.endpoints:
            link = self.links[endpoint]
            contacted = endpoint in self.state
            evidence = heartbeat_evidence(contacted=contacted, live_events=link.live_events,
                                          replay_answered=link.replay_answered, connected=link.connected,
                                          has_replay=endpoint.replay_endpoint is not None,
                                          down=link.down is not None)
            link.live_events = link.replay_answered = False
            if evidence == PROBE:
                self._start_replay(endpoint, heartbeat=True, timeout_s=self.probe_timeout_s)
            elif evidence is not None:
                self._heartbeat(endpoint, evidence)
            elif not contacted:
                if link.connected and link.probe is None:  # the replay on connect found nothing yet: ask again
                    self._start_replay(endpoint, heartbeat=False, timeout_s=self.replay_timeout_ms / 1000)
            else:
                self.metrics.heartbeats_skipped.labels(*self._labels(endpoint)).inc()
                self._note_evidence(endpoint, None, "not connected" if not link.connected
                                    else "reconnected, but no batch since it went")

    def _heartbeat(self, endpoint: PublisherEndpoint, evidence: str) -> None:
        state = self.state[endpoint]
        self.sink.source_event(self._publisher(endpoint, state), SOURCE_HEARTBEAT, {"evidence": evidence},
                               -1 if state.last_seq is None else state.last_seq)
        self.metrics.heartbeats.labels(*self._labels(endpoint), evidence).inc()
        self._note_evidence(endpoint, evidence, "")

    def _note_evidence(self, endpoint: PublisherEndpoint, evidence: str | None, why: str) -> None:
        """Log when a source's evidence of life comes and goes (not every interval)."""
        link = self.links.get(endpoint)
        if link is None or (link.evidence is None) == (evidence is None):
            if link is not None:
                link.evidence = evidence
            return
        link.evidence = evidence
        if evidence is None:
            log.warning("%s: no evidence that the engine is alive (%s): no heartbeat until there is", endpoint.label,
                        why)
        else:
            log.info("%s: heartbeats (evidence: %s)", endpoint.label, evidence)

    def send_heartbeats(self, evidence: str = PRODUCING) -> int:
        """One ``SourceHeartbeat`` now for every source the bridge has had contact with, naming ``evidence``
        (``kvstream produce`` at the end of a capture: ``producing``). Returns the number of sources."""
        for endpoint, state in self.state.items():
            self.sink.source_event(self._publisher(endpoint, state), SOURCE_HEARTBEAT, {"evidence": evidence},
                                   -1 if state.last_seq is None else state.last_seq)
            self.metrics.heartbeats.labels(*self._labels(endpoint), evidence).inc()
        return len(self.state)
