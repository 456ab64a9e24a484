"""Engine bridge: subscribe to vLLM/SGLang ZMQ publishers and produce their events to Kafka.

Protocol (docs/ingesting.md, "Live engines"): the publisher binds a PUB
socket and sends 3-frame messages ``(topic, seq as 8-byte big-endian, msgpack
KVEventBatch)``; ``seq`` starts at 0 per publisher and grows by one per batch.
An optional ROUTER replay socket answers ``[b"", start_seq]`` from a DEALER
with every buffered batch from ``start_seq`` on (3 frames each, 2 in older vLLM)
and then an end marker whose seq is ``ff..ff``. Requests older than the buffer
start at the oldest batch it holds, so the first replayed seq must be checked.

Per source (one endpoint = one publisher = one data-parallel rank), the bridge
keeps the next expected seq:

* first contact: replay from 0, i.e. from the oldest batch the publisher holds;
* a gap (seq jumps ahead): replay the missing batches; what the buffer no
  longer holds is an unrecovered gap and marks the source stale;
* replayed and live batches are merged in seq order without duplicates;
* the epoch's last seq again is a duplicate: dropped and counted
  (``kvstream_bridge_batches_duplicate_total``);
* a seq below the epoch's last one (outside a replay's range) means the
  publisher restarted (vLLM's starts again at 0): a new ``publisher_epoch``
  begins (milliseconds now, always larger than the previous one).

Every batch is decoded event by event (:mod:`producers.engine_decode`), split
per block (:mod:`producers.split`) and produced through
:class:`producers.kafka_sink.KvEventProducer`; what cannot be decoded goes to
the dead-letter topic with its reason and bytes, and the rest flows.

Replay on connect (docs/ingesting.md, "Heartbeats and replay on connect"): whenever
the SUB connection to a publisher comes up (ZMQ's socket monitor,
``EVENT_CONNECTED``: at start and after every disconnect), the bridge asks the
replay socket for what it has not seen, without waiting for a live batch, so an
idle engine is known within seconds. It asks from the last seq it delivered
(from the state file's after a bridge restart; from 0 on first contact): vLLM
answers only with the batches it buffers at or after the seq asked, so

* an answer that starts with that seq comes from the same publisher (the batch
  itself is a duplicate, dropped; what follows is delivered in order);
* an answer that starts later means the buffer no longer holds the batches in
  between: they are lost (``SourceStale``), the rest is delivered;
* an empty answer (the end marker alone) means the publisher holds nothing that
  recent: it restarted (vLLM counts from 0 again and keeps its newest batches). A
  new epoch begins (``PublisherRestarted``) and what the new process holds is
  asked for from 0;
* on first contact, batches before the oldest one replayed are lost
  (``SourceStale``), as for a first live batch.

Heartbeats: every ``heartbeat_interval_s`` each source the bridge has had contact
with gets a ``SourceHeartbeat`` (:data:`schemas.SOURCE_HEARTBEAT`, with its
current epoch and last seq) while there is evidence that its engine is alive
(:func:`heartbeat_evidence`): live batches since the last interval (``events``),
else an answer of its replay socket (``replay``: a replay on connect, a gap's
catch-up, or a probe asking from the last seq, as above), else, for a publisher
without a replay socket, its SUB connection up (``connected``). Probes and
replays on connect run without blocking the live loop: each is a DEALER socket
in the bridge's poller, given up at its deadline.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Protocol

import zmq
from prometheus_client import CollectorRegistry, Counter
from zmq.utils.monitor import recv_monitor_message

from producers.engine_decode import BatchDecodeError, decode_batch
from producers.split import InvalidEvent, Publisher, source_event
from schemas import PUBLISHER_RESTARTED, SOURCE_HEARTBEAT, SOURCE_STALE

log = logging.getLogger(__name__)

#: vLLM's replay end marker: seq -1 as 8 signed big-endian bytes.
END_SEQ = b"\xff" * 8

#: The evidence a heartbeat names (kv_event ``SourceHeartbeat.evidence``): live batches since the last interval, an
#: answer of the replay socket, the SUB connection up (publishers without a replay socket), and what a producer
#: says that publishes a source's events itself (the simulator, ``kvstream produce``).
EVENTS, REPLAY, CONNECTED, PRODUCING = "events", "replay", "connected", "producing"
#: :func:`heartbeat_evidence`'s answer when only the replay socket can tell: probe it.
PROBE = "probe"

#: ZMTP heartbeats on each SUB connection (libzmq >= 4.2): a PING every second, and a connection whose peer has
#: answered nothing for 3 seconds is dropped, so a dead engine host (no TCP FIN ever comes) shows up as
#: ``EVENT_DISCONNECTED`` too, not only a process that exited.
ZMTP_PING_MS, ZMTP_TIMEOUT_MS = 1000, 3000


def heartbeat_evidence(*, contacted: bool, live_events: bool, replay_answered: bool, connected: bool,
                       has_replay: bool) -> str | None:
    """What one source's heartbeat of this interval can say (the rule of docs/ingesting.md, "Heartbeats").

    Args:
        contacted: the bridge has had a batch of the source (or detected its restart); before that it sends none,
            as it has no epoch to name.
        live_events: live batches arrived since the last interval.
        replay_answered: a replay request reached its end marker since the last interval (a replay on connect,
            a gap's catch-up).
        connected: the SUB connection is up (socket monitor).
        has_replay: the publisher has a replay socket.

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
    if replay_answered:
        return REPLAY
    # with a replay socket, a connection alone is weak evidence (a hung engine's kernel keeps it open): ask
    return PROBE if has_replay else CONNECTED


@dataclass(frozen=True)
class PublisherEndpoint:
    """One engine publisher the bridge subscribes to (vLLM: one per data-parallel rank)."""

    #: PUB endpoint to connect to, e.g. ``tcp://10.0.0.5:5557``.
    endpoint: str
    #: ROUTER replay endpoint (vLLM ``replay_endpoint``); None when the publisher has none (gaps are then lost).
    replay_endpoint: str | None
    #: Serving instance name put on every event (vLLM sends none).
    instance_id: str
    #: Data-parallel rank of this publisher; a batch that names its own rank wins.
    data_parallel_rank: int = 0
    #: Worker rank, where each worker of an engine publishes separately (see kv_event.worker_rank).
    worker_rank: int | None = None
    #: Workers reporting this engine's connector events; None means 1.
    world_size: int | None = None
    #: REPLICATED or SHARDED (see kv_event.aggregation); None means REPLICATED.
    aggregation: str | None = None
    #: The engine's protocol, ``vllm`` or ``sglang`` (:attr:`producers.split.Publisher.engine`).
    engine: str = "vllm"
    #: How the engine reports prefix-cache reuse (:attr:`producers.split.Publisher.report_mode`): None, the default;
    #: ``"full"``, vLLM's ``kv_cache_report_mode="full"``.
    report_mode: str | None = None

    @property
    def label(self) -> str:
        worker = "" if self.worker_rank is None else f"/w{self.worker_rank}"
        return f"{self.instance_id}/dp{self.data_parallel_rank}{worker}"


_TCP = re.compile(r"^(?P<head>tcp://.*:)(?P<port>\d+)$")
#: Addresses a subscriber can connect to: tcp with a host (not a bind address's ``*``) and a port, ipc, inproc.
_CONNECTABLE = re.compile(r"^(tcp://(?!\*:).+:\d+|ipc://.+|inproc://.+)$")


def offset_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's ``ZmqEventPublisher.offset_endpoint_port``: the endpoint of data-parallel rank ``rank``.

    tcp: port + rank (port 0 is left alone); inproc: ``_dp<rank>`` suffix; rank 0: unchanged.

    Raises:
        ValueError: ipc (or another transport) with rank > 0, as vLLM does.
    """
    if rank == 0:
        return endpoint
    match = _TCP.match(endpoint)
    if match:
        port = int(match["port"])
        return endpoint if port == 0 else f"{match['head']}{port + rank}"
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    raise ValueError(f"Invalid endpoint {endpoint!r}: must contain 'inproc' or 'tcp' for data-parallel rank {rank}")


def data_parallel_endpoints(endpoint: str, replay_endpoint: str | None, instance_id: str,
                            data_parallel_size: int, engine: str = "vllm",
                            report_mode: str | None = None) -> list[PublisherEndpoint]:
    """Every rank's endpoints of one engine with ``data_parallel_size`` ranks (vLLM's port-offset rule)."""
    return [PublisherEndpoint(offset_endpoint(endpoint, rank),
                              None if replay_endpoint is None else offset_endpoint(replay_endpoint, rank),
                              instance_id, rank, engine=engine, report_mode=report_mode)
            for rank in range(data_parallel_size)]


def registration_endpoints(info, report_mode: str | None = None) -> list[PublisherEndpoint]:
    """The publishers of one registered instance (``POST /register``, a record of ``kv-instances``), which
    ``kvstream bridge --follow-registrations`` subscribes to.

    Args:
        info: the registration, a :class:`stream_apps.index.fleet_index.SourceInfo` (its ``instance_id``,
            ``endpoint``, ``replay_endpoint``, ``engine_type`` and ``dp_ranks`` are read).
        report_mode: the engine's report mode (:attr:`PublisherEndpoint.report_mode`); a registration names none.

    Returns:
        One endpoint per registered data-parallel rank (rank 0 when it names none), in rank order: rank ``r``
        on ``offset_endpoint(endpoint, r)`` and ``offset_endpoint(replay_endpoint, r)`` (vLLM's port-offset
        rule, as ``--data-parallel-size``), protocol ``sglang`` when ``engine_type`` is SGLang (in any case), else
        ``vllm``. Empty when the registration has no ``endpoint``.

    Raises:
        ValueError: a rank above 0 on an endpoint that cannot be offset (ipc), as vLLM refuses it.
    """
    if not info.endpoint:
        return []
    engine = "sglang" if (info.engine_type or "").lower() == "sglang" else "vllm"
    return [PublisherEndpoint(offset_endpoint(info.endpoint, rank),
                              None if not info.replay_endpoint else offset_endpoint(info.replay_endpoint, rank),
                              info.instance_id, rank, engine=engine, report_mode=report_mode)
            for rank in sorted(info.dp_ranks or {0})]


def _state_key(endpoint: PublisherEndpoint) -> str:
    worker = "" if endpoint.worker_rank is None else endpoint.worker_rank
    return f"{endpoint.instance_id}|{endpoint.data_parallel_rank}|{worker}|{endpoint.endpoint}"


class BatchSink(Protocol):
    """Where decoded batches go: Kafka (:class:`KafkaBatchSink`) or a capture file."""

    def batch(self, endpoint: PublisherEndpoint, publisher: Publisher, seq: int, payload: bytes) -> None: ...

    def source_event(self, publisher: Publisher, kind: str, body: dict, seq: int) -> None:
        """An event the bridge makes itself: ``PUBLISHER_RESTARTED``, ``SOURCE_STALE`` or ``SOURCE_HEARTBEAT``
        (schemas)."""

    def flush(self) -> None:
        """Make everything handed over so far durable (Kafka: acknowledged); raises if it cannot be.

        A sink may also have ``poll()``, which the bridge calls once a heartbeat interval (:class:`KafkaBatchSink`:
        delivery reports)."""


class BridgeMetrics:
    """Prometheus counters per source (labels ``instance``, ``dp_rank``)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ("instance", "dp_rank")

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"kvstream_bridge_{name}", doc, labels, registry=self.registry)

        self.batches_received = counter("batches_received", "Batches received live from the publisher")
        self.batches_replayed = counter("batches_replayed", "Batches received from the replay socket")
        self.batches_duplicate = counter("batches_duplicate", "Batches dropped as already seen (replay/live overlap)")
        self.events_received = counter("events_received", "Engine events decoded")
        self.events_produced = counter("events_produced", "Block-level records produced to Kafka")
        self.dead_lettered = counter("dead_lettered", "Payloads or events sent to the dead-letter topic")
        self.gaps_found = counter("gaps_found", "Sequence gaps detected")
        self.gaps_unrecovered = counter("gaps_unrecovered", "Gaps (or batches) the replay buffer no longer held")
        self.restarts = counter("restarts", "Publisher restarts (seq went backwards): new publisher epochs")
        self.heartbeats = Counter("kvstream_bridge_heartbeats", "SourceHeartbeat events sent, by evidence",
                                  (*labels, "evidence"), registry=self.registry)
        self.heartbeats_skipped = counter("heartbeats_skipped", "Heartbeat intervals without evidence of life "
                                                                "(connection down, probe unanswered)")
        self.replay_requests = counter("replay_requests", "Requests to the replay socket (catch-ups, replays on "
                                                          "connect, probes)")
        self.replay_unanswered = counter("replay_unanswered", "Replay requests without their end marker in time")


class KafkaBatchSink:
    """Decode, split per block and produce; undecodable payloads and events go to the dead-letter topic."""

    def __init__(self, producer, metrics: BridgeMetrics) -> None:
        self.producer = producer
        self.metrics = metrics

    def source_event(self, publisher: Publisher, kind: str, body: dict, seq: int) -> None:
        self.producer.send(source_event(publisher, kind, body, seq, time.time()))

    def flush(self) -> None:
        """Wait for the broker's acknowledgements (raises :class:`producers.kafka_sink.ProduceError`)."""
        self.producer.flush()

    def poll(self) -> None:
        """Serve librdkafka's delivery reports without waiting (the bridge calls it once an interval: an idle
        bridge sends only heartbeats, too few for the producer's own polling every 4,096 messages)."""
        self.producer.poll(0)

    def batch(self, endpoint: PublisherEndpoint, publisher: Publisher, seq: int, payload: bytes) -> None:
        labels = (publisher.instance_id, str(publisher.data_parallel_rank))
        where = f"{endpoint.endpoint} seq {seq}"
        try:
            decoded = decode_batch(payload)
        except BatchDecodeError as exc:
            self.producer.dead_letter(payload, str(exc), where)
            self.metrics.dead_lettered.labels(*labels).inc()
            return
        if decoded.data_parallel_rank is not None and decoded.data_parallel_rank != publisher.data_parallel_rank:
            publisher = replace(publisher, data_parallel_rank=decoded.data_parallel_rank)
        for failure in decoded.failures:
            self.producer.dead_letter(failure.raw, failure.reason, f"{where} event {failure.batch_index}")
            self.metrics.dead_lettered.labels(*labels).inc()
        # counters are updated once per batch: a labelled counter lookup costs about as much as encoding a block
        self.metrics.events_received.labels(*labels).inc(len(decoded.events))
        produced = 0
        try:
            for index, event, raw in decoded.events:
                try:
                    produced += self.producer.send_event(publisher, seq, decoded.ts, index, event)
                except InvalidEvent as exc:
                    self.producer.dead_letter(raw, str(exc), f"{where} event {index}")
                    self.metrics.dead_lettered.labels(*labels).inc()
        finally:
            self.metrics.events_produced.labels(*labels).inc(produced)


@dataclass
class _SourceState:
    epoch: int
    #: Last seq handed to the sink in this epoch; None before the first batch (an epoch begun by a restart that an
    #: empty replay showed).
    last_seq: int | None = None
    #: Seqs a replay delivered: live copies of them are duplicates, not a restart.
    replayed: range = field(default_factory=lambda: range(0))
    #: True once a gap could not be recovered (events were lost).
    stale: bool = False


@dataclass
class _Probe:
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
class _Link:
    """What the bridge knows of one publisher's connection, for heartbeats and replay on connect."""

    #: The SUB connection is up (socket monitor: ``EVENT_CONNECTED`` seen last, not ``EVENT_DISCONNECTED``).
    connected: bool = False
    #: Live messages arrived since the last heartbeat interval.
    live_events: bool = False
    #: A replay request (not a heartbeat's probe) reached its end marker since the last interval.
    replay_answered: bool = False
    #: The replay request in flight, at most one per publisher.
    probe: _Probe | None = None
    #: The evidence of the last interval (None: none), to log only when it changes.
    evidence: str | None = None
    #: The process behind the connection may not be the one whose batches the bridge delivered last: the
    #: connection dropped since (or the bridge restarted). Only then does an empty replay answer mean a restart;
    #: a replay answer that holds the last seq, or a restart found, settles it.
    unconfirmed: bool = False
    #: An empty replay answer without a reason has been logged (once per source).
    warned_empty: bool = False


def _monitorable(endpoint: str) -> bool:
    """ZMQ's socket monitor reports connections of tcp and ipc endpoints; inproc ones report none (and are up
    for as long as the process that binds them, this one)."""
    return endpoint.startswith(("tcp://", "ipc://"))


def _replay_frames(frames: list[bytes]) -> tuple[bytes, bytes] | None:
    """``(seq bytes, payload)`` of one replay reply as a DEALER receives it: ``[b"", topic, seq, payload]`` (vLLM),
    ``[b"", seq, payload]`` (older vLLM, no topic frame); None for any other shape."""
    app_frames = frames[1:] if frames and frames[0] == b"" else frames
    if len(app_frames) == 3:
        return app_frames[1], app_frames[2]
    if len(app_frames) == 2:
        return app_frames[0], app_frames[1]
    return None


class Bridge:
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
            that its engine is alive (module docstring), seconds; 0: none (replays on connect still happen).
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
        self._last_epoch = 0
        self._context = context or zmq.Context.instance()
        self._sockets: dict[zmq.Socket, PublisherEndpoint] = {}
        self._monitors: dict[zmq.Socket, PublisherEndpoint] = {}
        self._probes: dict[zmq.Socket, _Probe] = {}
        self.links: dict[PublisherEndpoint, _Link] = {}
        self.state: dict[PublisherEndpoint, _SourceState] = {}
        self._state_file = state_file
        self._saved: dict[str, dict] = {}
        self._saved_at = 0.0
        if state_file is not None and Path(state_file).exists():
            try:
                self._saved = json.loads(Path(state_file).read_text())
            except ValueError as exc:
                raise ValueError(f"bridge state file {state_file} is not JSON ({exc}); move it away to start "
                                 "afresh") from None
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
        connection is up (module docstring): from the last seq of the state file (or of an earlier subscription
        of the same source, :meth:`remove_endpoint`), else from 0.

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
            if address is not None and not _CONNECTABLE.match(address):
                raise ValueError(f"{endpoint.label}: cannot connect to {address!r}: expected tcp://HOST:PORT, "
                                 "ipc://PATH or inproc://NAME")
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, self._receive_hwm)
        sock.setsockopt(zmq.SUBSCRIBE, self._zmq_topic)
        sock.setsockopt(zmq.HEARTBEAT_IVL, ZMTP_PING_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMTP_TIMEOUT_MS)
        link = _Link(unconfirmed=_state_key(endpoint) in self._saved)
        monitor = None
        try:
            if _monitorable(endpoint.endpoint):
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
            key = _state_key(endpoint)
            if state.last_seq is not None:
                self._saved[key] = {"epoch": state.epoch, "last_seq": state.last_seq}
            else:  # an epoch begun by a restart, before its first batch: the saved seq is the old process's
                self._saved.pop(key, None)
        self._maybe_save()

    def _new_epoch(self) -> int:
        self._last_epoch = max(self._clock_ms(), self._last_epoch + 1)
        return self._last_epoch

    def _publisher(self, endpoint: PublisherEndpoint, state: _SourceState) -> Publisher:
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
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                handled += 1
                self.links[endpoint].live_events = True
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.sink_dead_letter(endpoint, frames[-1], f"live message of {len(frames)} frames "
                                                                f"(expected topic, 8-byte seq, payload)")
                    continue
                self.on_live(endpoint, int.from_bytes(frames[1], "big"), frames[2])
        now = self._monotonic()
        for probe in [p for p in self._probes.values() if p.deadline <= now]:
            self._give_up(probe)
        if self.heartbeat_interval_s and now >= self._next_tick:
            self._next_tick += self.heartbeat_interval_s
            if self._next_tick <= now:  # intervals missed (a long catch-up held the loop): one heartbeat, not a burst
                self._next_tick = now + self.heartbeat_interval_s
            self._heartbeat_interval()
        return handled

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

    # ------------------------------------------------------------------ live batches

    def on_live(self, endpoint: PublisherEndpoint, seq: int, payload: bytes) -> None:
        """Handle one live batch: detect first contact, gaps, duplicates and restarts; deliver in order."""
        labels = self._labels(endpoint)
        self.metrics.batches_received.labels(*labels).inc()
        state = self.state.get(endpoint)
        if state is not None and state.last_seq is not None and seq <= state.last_seq:
            if seq in state.replayed or seq == state.last_seq:
                # the same batch again (a replay overlapping live, a capture file concatenated twice): only a seq
                # below the epoch's last one is a restart, as vLLM's publisher starts again at 0
                self.metrics.batches_duplicate.labels(*labels).inc()
                return
            log.warning("%s: seq went back from %d to %d: publisher restarted, new epoch", endpoint.label,
                        state.last_seq, seq)
            state = self._restarted(endpoint, state.epoch)
            self._catch_up(endpoint, state, 0, seq, first_contact=True)
        elif state is None and (saved := self._saved.get(_state_key(endpoint))) and seq > saved["last_seq"]:
            # the bridge restarted, the publisher did not: same epoch, replay what was missed
            state = self.state[endpoint] = _SourceState(saved["epoch"], last_seq=saved["last_seq"])
            if seq > state.last_seq + 1:
                self.metrics.gaps_found.labels(*labels).inc()
                self._catch_up(endpoint, state, state.last_seq + 1, seq, first_contact=False)
        elif state is None and (saved := self._saved.get(_state_key(endpoint))):
            log.warning("%s: seq %d is not past the saved %d: the publisher restarted while the bridge was down",
                        endpoint.label, seq, saved["last_seq"])
            state = self._restarted(endpoint, saved["epoch"])
            self._catch_up(endpoint, state, 0, seq, first_contact=True)
        elif state is None or state.last_seq is None:
            # first contact, or the first batch of an epoch that an empty replay showed to have begun
            if state is None:
                state = self.state[endpoint] = _SourceState(self._new_epoch())
            self._catch_up(endpoint, state, 0, seq, first_contact=True)
        elif seq > state.last_seq + 1:
            self.metrics.gaps_found.labels(*labels).inc()
            self._catch_up(endpoint, state, state.last_seq + 1, seq, first_contact=False)
        self._deliver(endpoint, state, seq, payload)
        if seq >= state.replayed.stop - 1:
            state.replayed = range(0)  # live has overtaken the replay: a lower seq from now on is a restart
        self._maybe_save()

    def _restarted(self, endpoint: PublisherEndpoint, previous_epoch: int) -> _SourceState:
        """Begin a new epoch for a publisher that restarted; retire the previous epoch's residency before the new
        epoch's first batch (``PublisherRestarted``)."""
        self.metrics.restarts.labels(*self._labels(endpoint)).inc()
        if endpoint in self.links:
            self.links[endpoint].unconfirmed = False
        state = self.state[endpoint] = _SourceState(self._new_epoch())
        self.sink.source_event(self._publisher(endpoint, state), PUBLISHER_RESTARTED,
                               {"previous_epoch": previous_epoch}, -1)
        return state

    def _maybe_save(self) -> None:
        if self._state_file is not None and time.monotonic() - self._saved_at > 1.0:
            self.save_state()

    def save_state(self) -> None:
        """Write each source's epoch and last seq to the state file (atomically: temp file, then rename).

        The sink is flushed first, so a saved seq is always acknowledged: a bridge killed right after a save
        replays from there and loses nothing (saving first could skip batches still in the producer's queue).
        """
        if self._state_file is None:
            return
        self.sink.flush()
        for endpoint, state in self.state.items():
            if state.last_seq is not None:
                self._saved[_state_key(endpoint)] = {"epoch": state.epoch, "last_seq": state.last_seq}
        path = Path(self._state_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(path.suffix + ".tmp")
        temporary.write_text(json.dumps(self._saved, indent=1, sort_keys=True))
        os.replace(temporary, path)
        self._saved_at = time.monotonic()

    def _deliver(self, endpoint: PublisherEndpoint, state: _SourceState, seq: int, payload: bytes) -> None:
        self.sink.batch(endpoint, self._publisher(endpoint, state), seq, payload)
        state.last_seq = seq

    def _catch_up(self, endpoint: PublisherEndpoint, state: _SourceState, start: int, live_seq: int,
                  first_contact: bool) -> None:
        """Deliver the batches [start, live_seq) from the replay socket, marking what it no longer holds.

        The live loop waits for the answer (up to the replay timeout): the live batch ``live_seq`` must follow
        them."""
        if start >= live_seq:  # nothing before it to ask for (a first batch with seq 0)
            return
        replayed, complete = self._ask_replay(endpoint, start, self.replay_timeout_ms) if endpoint.replay_endpoint \
            else ([], False)
        if complete:
            self.links.setdefault(endpoint, _Link()).replay_answered = True
        self._take_replayed(endpoint, state, replayed, start, first_contact, until=live_seq)

    def _take_replayed(self, endpoint: PublisherEndpoint, state: _SourceState, replayed: list[tuple[int, bytes]],
                       expected_first: int, first_contact: bool, until: int | None = None) -> None:
        """Deliver the replayed batches past the source's last seq (and before ``until``, a live batch's seq) in
        order; what is missing between ``expected_first`` and the first of them (or ``until``) is lost and marks
        the source stale (``SourceStale``)."""
        labels = self._labels(endpoint)
        first_delivered = last_delivered = None
        for seq, payload in replayed:
            if (until is not None and seq >= until) or (state.last_seq is not None and seq <= state.last_seq):
                continue
            first_delivered = seq if first_delivered is None else first_delivered
            last_delivered = seq
            self.metrics.batches_replayed.labels(*labels).inc()
            self._deliver(endpoint, state, seq, payload)
        if first_delivered is not None:
            low = min(state.replayed.start, first_delivered) if state.replayed else first_delivered
            state.replayed = range(low, last_delivered + 1)
        got_from = first_delivered if first_delivered is not None else until
        if got_from is not None and got_from > expected_first:
            # batches before the oldest one we could get describe cache state we never saw
            self.metrics.gaps_unrecovered.labels(*labels).inc()
            state.stale = True
            self.sink.source_event(self._publisher(endpoint, state), SOURCE_STALE,
                                   {"first_lost_seq": expected_first, "last_lost_seq": got_from - 1}, expected_first)
            log.warning("%s: %d batches (seq %d..%d) are lost%s", endpoint.label, got_from - expected_first,
                        expected_first, got_from - 1, " before first contact" if first_contact else "")

    # ------------------------------------------------------------------ the replay socket

    def replay(self, endpoint: PublisherEndpoint, start_seq: int) -> list[tuple[int, bytes]]:
        """Ask the publisher's replay socket for every batch from ``start_seq`` on, waiting up to the replay
        timeout (DEALER; REQ gets only one reply).

        Returns:
            ``[(seq, payload)]`` in the order received, up to the end marker; what came before a timeout.
        """
        return self._ask_replay(endpoint, start_seq, self.replay_timeout_ms)[0]

    def _ask_replay(self, endpoint: PublisherEndpoint, start_seq: int,
                    timeout_ms: int) -> tuple[list[tuple[int, bytes]], bool]:
        """``replay``, and whether the end marker came (False: timed out, with the batches received so far)."""
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint.replay_endpoint)
        self.metrics.replay_requests.labels(*self._labels(endpoint)).inc()
        batches: list[tuple[int, bytes]] = []
        try:
            sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
            while sock.poll(timeout_ms):
                frames = sock.recv_multipart()
                reply = _replay_frames(frames)
                if reply is None:
                    log.warning("%s: replay reply of %d frames ignored", endpoint.label, len(frames))
                    continue
                seq_bytes, payload = reply
                if seq_bytes == END_SEQ:
                    return batches, True
                batches.append((int.from_bytes(seq_bytes, "big"), payload))
            self.metrics.replay_unanswered.labels(*self._labels(endpoint)).inc()
            log.warning("%s: replay from %d timed out after %d batches", endpoint.label, start_seq, len(batches))
            return batches, False
        finally:
            sock.close()

    def _replay_start(self, endpoint: PublisherEndpoint) -> int:
        """The seq a replay on connect or a probe asks from: the last one delivered (from the state file's after a
        bridge restart), whose presence in the answer shows the publisher is the same process; 0 before any
        batch."""
        state = self.state.get(endpoint)
        if state is not None:
            return 0 if state.last_seq is None else state.last_seq
        saved = self._saved.get(_state_key(endpoint))
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
        probe = link.probe = _Probe(endpoint, sock, start, state.epoch if state else None,
                                    state.last_seq if state else None, self._monotonic() + timeout_s, heartbeat)
        self._probes[sock] = probe
        self._poller.register(sock, zmq.POLLIN)

    def _close_probe(self, probe: _Probe) -> None:
        self._poller.unregister(probe.socket)
        probe.socket.close(linger=0)
        del self._probes[probe.socket]
        link = self.links[probe.endpoint]
        if link.probe is probe:
            link.probe = None

    def _give_up(self, probe: _Probe) -> None:
        """The probe's deadline passed without the end marker: no evidence; its batches are dropped (the next
        probe or live batch asks again)."""
        self._close_probe(probe)
        self.metrics.replay_unanswered.labels(*self._labels(probe.endpoint)).inc()
        log.info("%s: the replay socket did not answer a request from seq %d in time%s", probe.endpoint.label,
                 probe.start, ": no heartbeat" if probe.heartbeat else "")
        if probe.heartbeat:
            self.metrics.heartbeats_skipped.labels(*self._labels(probe.endpoint)).inc()
            self._note_evidence(probe.endpoint, None, "its replay socket did not answer")

    def _on_probe_reply(self, sock: zmq.Socket) -> None:
        probe = self._probes[sock]
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = _replay_frames(frames)
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

    def _replay_answered(self, probe: _Probe) -> None:
        """A replay request reached its end marker: apply the answer (module docstring, "Replay on connect"), then
        count it as evidence (a heartbeat now, for a heartbeat's probe)."""
        endpoint = probe.endpoint
        state = self.state.get(endpoint)
        if (state.epoch if state else None, state.last_seq if state else None) == (probe.epoch, probe.last_seq):
            self._apply_replay(endpoint, state, probe.start, [b for b in probe.batches if b[0] >= probe.start])
        # else live batches came meanwhile and decided first contact, a gap or a restart themselves
        if probe.heartbeat and endpoint in self.state:
            self._heartbeat(endpoint, REPLAY)
        elif not probe.heartbeat:
            self.links[endpoint].replay_answered = True

    def _apply_replay(self, endpoint: PublisherEndpoint, state: _SourceState | None, start: int,
                      batches: list[tuple[int, bytes]]) -> None:
        """Apply the answer of a request from ``start`` (:meth:`_replay_start`) to a source in ``state``: first
        contact, the same epoch continued, or a restart (vLLM buffers its newest batches and answers only those
        at or after the seq asked)."""
        labels = self._labels(endpoint)
        link = self.links[endpoint]
        saved = self._saved.get(_state_key(endpoint)) if state is None else None
        if state is None and saved is None:  # first contact, asked from 0
            if batches:
                state = self.state[endpoint] = _SourceState(self._new_epoch())
                self._take_replayed(endpoint, state, batches, 0, first_contact=True)
                self._maybe_save()
            return  # an empty buffer: the publisher has sent nothing yet, there is no source to know
        if state is not None and state.last_seq is None:  # an epoch begun by a restart, asked from 0
            if batches:
                self._take_replayed(endpoint, state, batches, 0, first_contact=True)
                self._maybe_save()
            return
        last_seq, epoch = (state.last_seq, state.epoch) if state is not None else (saved["last_seq"], saved["epoch"])
        if not batches and not link.unconfirmed:
            # the same connection all along, so the same process, which should still hold its newest batch (an
            # engine with buffer_steps 0 holds none): evidence of life, no restart
            if not link.warned_empty:
                link.warned_empty = True
                log.warning("%s: the replay socket holds nothing from seq %d on although the connection never "
                            "dropped (vLLM buffer_steps 0?): gaps cannot be replayed", endpoint.label, last_seq)
            return
        if not batches:
            # the same process would still hold the batch asked for, its newest or a newer one: this one restarted
            log.warning("%s: the replay socket holds nothing from seq %d on, the last the bridge delivered: the "
                        "publisher restarted%s, new epoch", endpoint.label, last_seq,
                        "" if state is not None else " while the bridge was down")
            self._restarted(endpoint, epoch)
            self._start_replay(endpoint, heartbeat=False, timeout_s=self.replay_timeout_ms / 1000)
            return
        link.unconfirmed = False
        if state is None:  # the bridge restarted, the publisher did not: same epoch
            state = self.state[endpoint] = _SourceState(epoch, last_seq=last_seq)
        if batches[0][0] > last_seq + 1:
            self.metrics.gaps_found.labels(*labels).inc()
        self._take_replayed(endpoint, state, batches, last_seq + 1, first_contact=False)
        self._maybe_save()

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
                                          has_replay=endpoint.replay_endpoint is not None)
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
                self._note_evidence(endpoint, None, "not connected")

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

    def close(self) -> None:
        """Save the state file and close the subscriber, monitor and replay sockets (again: nothing more)."""
        self.save_state()
        if self._closed:
            return
        self._closed = True
        for probe in list(self._probes.values()):
            self._close_probe(probe)
        for sock in self._sockets:
            if _monitorable(self._sockets[sock].endpoint):
                sock.disable_monitor()
            sock.close(linger=0)
        for monitor in self._monitors:
            monitor.close(linger=0)


class RegistrationFollower:
    """Keeps a :class:`Bridge` subscribed to the engine of every registered instance (``kvstream bridge
    --follow-registrations``, docs/ingesting.md "Following registrations").

    :meth:`apply` is the callback of a :class:`stream_apps.index.registrations.RegistrationsFeed` of
    ``kv-instances``: a registration with an ``endpoint`` subscribes the bridge to its publishers
    (:func:`registration_endpoints`); a tombstone, or a registration without an endpoint, unsubscribes them; a
    changed endpoint, replay endpoint, engine type or set of ranks unsubscribes what is no longer named and
    subscribes what is new (a rank whose publisher is unchanged stays connected). The bridge's own ``--endpoint``
    publishers are never unsubscribed, and a PUB address the bridge already follows is not subscribed again
    (its batches would be produced twice, under two names): it waits until the address is free.

    Args:
        bridge: the bridge to subscribe and unsubscribe; its other endpoints are left alone.
        report_mode: the report mode of every followed engine (:attr:`PublisherEndpoint.report_mode`; None: the
            default), as registrations name none.
        monotonic: the clock of :meth:`run`'s reads of the feed, seconds.
    """

    def __init__(self, bridge: Bridge, report_mode: str | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.bridge = bridge
        self.report_mode = report_mode
        #: instance id -> the publishers its registration names (what the bridge should follow for it).
        self.wanted: dict[str, list[PublisherEndpoint]] = {}
        #: instance id -> the publishers the bridge follows for it now (a subset of :attr:`wanted`'s).
        self.followed: dict[str, list[PublisherEndpoint]] = {}
        self._monotonic = monotonic
        # publishers not subscribed, with why, so each is logged once, not at every reconciliation
        self._refused: dict[PublisherEndpoint, str] = {}

    def apply(self, instance_id: str, info) -> None:
        """Apply one record of ``kv-instances``: ``info`` (a :class:`stream_apps.index.fleet_index.SourceInfo`) is
        the instance's registration, None its unregistration (a tombstone). Errors of one registration (an
        endpoint the bridge cannot connect to) are logged, never raised: the other instances go on."""
        if info is None:
            wanted, why = [], "unregistered"
        else:
            why = "registration changed" if info.endpoint else "registered without an endpoint"
            try:
                wanted = registration_endpoints(info, self.report_mode)
            except ValueError as exc:
                log.error("registered instance %s: cannot follow its endpoint %s: %s", instance_id, info.endpoint,
                          exc)
                wanted = []
        if wanted:
            self.wanted[instance_id] = wanted
        else:
            self.wanted.pop(instance_id, None)
        for endpoint in [e for e in self._refused if e.instance_id == instance_id and e not in wanted]:
            del self._refused[endpoint]
        self._unsubscribe(instance_id, why)
        self._subscribe(instance_id)
        for other in list(self.wanted):  # a publisher address this instance let go of may be another's to follow
            if other != instance_id:
                self._subscribe(other)

    def _unsubscribe(self, instance_id: str, why: str) -> None:
        wanted = self.wanted.get(instance_id, [])
        kept = []
        for endpoint in self.followed.pop(instance_id, []):
            if endpoint in wanted:
                kept.append(endpoint)
                continue
            self.bridge.remove_endpoint(endpoint)
            log.info("unsubscribed from %s as %s: instance %s %s", endpoint.endpoint, endpoint.label, instance_id,
                     why)
        if kept:
            self.followed[instance_id] = kept

    def _subscribe(self, instance_id: str) -> None:
        followed = self.followed.setdefault(instance_id, [])
        for endpoint in self.wanted.get(instance_id, []):
            if endpoint in followed:
                continue
            holder = next((e for e in self.bridge.endpoints if e.endpoint == endpoint.endpoint), None)
            try:
                if holder is not None:
                    raise ValueError(f"the bridge already follows {endpoint.endpoint} as {holder.label}")
                self.bridge.add_endpoint(endpoint)
            except ValueError as exc:
                if self._refused.get(endpoint) != str(exc):
                    self._refused[endpoint] = str(exc)
                    log.warning("registered instance %s: not subscribed to %s: %s", instance_id, endpoint.endpoint,
                                exc)
                continue
            self._refused.pop(endpoint, None)
            followed.append(endpoint)
            log.info("subscribed to %s (replay: %s) as %s: registered instance %s", endpoint.endpoint,
                     endpoint.replay_endpoint or "none", endpoint.label, instance_id)
        if not followed:
            del self.followed[instance_id]

    def run(self, feed, should_stop: Callable[[], bool] = lambda: False, read_interval_s: float = 0.5) -> None:
        """Poll the bridge until ``should_stop()`` returns True, reading ``feed`` (a ``RegistrationsFeed`` whose
        callback is :meth:`apply`) without waiting every ``read_interval_s`` seconds between the bridge's polls.

        A feed that raises :class:`confluent_kafka.KafkaException` is logged and read again at the next interval:
        the bridge goes on forwarding what it follows while the broker cannot say what changed."""
        from confluent_kafka import KafkaException

        next_read = self._monotonic()
        while not should_stop():
            if self._monotonic() >= next_read:
                try:
                    feed.poll(0)
                except KafkaException as exc:
                    log.warning("reading the registrations in %s: %s; retrying", getattr(feed, "topic", "?"), exc)
                next_read = self._monotonic() + read_interval_s
            self.bridge.poll(100)
