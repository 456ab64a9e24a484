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
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import zmq
from prometheus_client import CollectorRegistry, Counter

from producers.engine_decode import BatchDecodeError, decode_batch
from producers.split import InvalidEvent, Publisher, source_event
from schemas import PUBLISHER_RESTARTED, SOURCE_STALE

log = logging.getLogger(__name__)

#: vLLM's replay end marker: seq -1 as 8 signed big-endian bytes.
END_SEQ = b"\xff" * 8


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

    @property
    def label(self) -> str:
        worker = "" if self.worker_rank is None else f"/w{self.worker_rank}"
        return f"{self.instance_id}/dp{self.data_parallel_rank}{worker}"


_TCP = re.compile(r"^(?P<head>tcp://.*:)(?P<port>\d+)$")


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
                            data_parallel_size: int, engine: str = "vllm") -> list[PublisherEndpoint]:
    """Every rank's endpoints of one engine with ``data_parallel_size`` ranks (vLLM's port-offset rule)."""
    return [PublisherEndpoint(offset_endpoint(endpoint, rank),
                              None if replay_endpoint is None else offset_endpoint(replay_endpoint, rank),
                              instance_id, rank, engine=engine) for rank in range(data_parallel_size)]


def _state_key(endpoint: PublisherEndpoint) -> str:
    worker = "" if endpoint.worker_rank is None else endpoint.worker_rank
    return f"{endpoint.instance_id}|{endpoint.data_parallel_rank}|{worker}|{endpoint.endpoint}"


class BatchSink(Protocol):
    """Where decoded batches go: Kafka (:class:`KafkaBatchSink`) or a capture file."""

    def batch(self, endpoint: PublisherEndpoint, publisher: Publisher, seq: int, payload: bytes) -> None: ...

    def source_event(self, publisher: Publisher, kind: str, body: dict, seq: int) -> None:
        """An event the bridge makes itself: ``PUBLISHER_RESTARTED`` or ``SOURCE_STALE`` (schemas)."""

    def flush(self) -> None:
        """Make everything handed over so far durable (Kafka: acknowledged); raises if it cannot be."""


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
            publisher = Publisher(publisher.instance_id, decoded.data_parallel_rank, publisher.worker_rank,
                                  publisher.world_size, publisher.aggregation, publisher.publisher_epoch,
                                  publisher.engine)
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
    #: Last seq handed to the sink in this epoch; None before the first batch.
    last_seq: int | None = None
    #: Seqs a replay delivered: live copies of them are duplicates, not a restart.
    replayed: range = field(default_factory=lambda: range(0))
    #: True once a gap could not be recovered (events were lost).
    stale: bool = False


class Bridge:
    """Subscribe to publishers and hand their batches, in seq order, to a sink.

    Args:
        endpoints: the publishers.
        sink: where batches go (e.g. :class:`KafkaBatchSink`).
        zmq_topic: subscription prefix (vLLM ``KVEventsConfig.topic``, default empty: everything).
        replay_timeout_s: how long to wait for each replay reply before giving up.
        clock_ms: source of publisher epochs (milliseconds since the Unix epoch).
        receive_hwm: ZMQ receive high-water mark per socket (a bounded buffer: beyond it ZMQ drops, the
            bridge sees a gap and replays).
        state_file: where the bridge keeps each source's epoch and last seq (JSON, written at most once a
            second and on close). A restarted bridge then continues a publisher's epoch, replaying from
            the last seq it produced, instead of taking the publisher for restarted; a first seq at or
            below the saved one means the publisher did restart meanwhile. None: kept in memory only.
    """

    def __init__(self, endpoints: list[PublisherEndpoint], sink: BatchSink, *, zmq_topic: bytes = b"",
                 metrics: BridgeMetrics | None = None, replay_timeout_s: float = 5.0,
                 clock_ms: Callable[[], int] = lambda: int(time.time() * 1000), receive_hwm: int = 100_000,
                 context: zmq.Context | None = None, state_file: Path | None = None) -> None:
        self.endpoints = endpoints
        self.sink = sink
        self.metrics = metrics or BridgeMetrics()
        self.replay_timeout_ms = int(replay_timeout_s * 1000)
        self._clock_ms = clock_ms
        self._last_epoch = 0
        self._context = context or zmq.Context.instance()
        self._sockets: dict[zmq.Socket, PublisherEndpoint] = {}
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
        for endpoint in endpoints:
            sock = self._context.socket(zmq.SUB)
            sock.setsockopt(zmq.RCVHWM, receive_hwm)
            sock.setsockopt(zmq.SUBSCRIBE, zmq_topic)
            sock.connect(endpoint.endpoint)
            self._sockets[sock] = endpoint
        self._poller = zmq.Poller()
        for sock in self._sockets:
            self._poller.register(sock, zmq.POLLIN)

    def _new_epoch(self) -> int:
        self._last_epoch = max(self._clock_ms(), self._last_epoch + 1)
        return self._last_epoch

    def _publisher(self, endpoint: PublisherEndpoint, state: _SourceState) -> Publisher:
        return Publisher(endpoint.instance_id, endpoint.data_parallel_rank, endpoint.worker_rank, endpoint.world_size,
                         endpoint.aggregation, state.epoch, endpoint.engine)

    def poll(self, timeout_ms: int = 100) -> int:
        """Receive what has arrived (waiting up to ``timeout_ms``); returns the number of live messages handled."""
        handled = 0
        for sock, _ in self._poller.poll(timeout_ms):
            endpoint = self._sockets[sock]
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                handled += 1
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.sink_dead_letter(endpoint, frames[-1], f"live message of {len(frames)} frames "
                                                                f"(expected topic, 8-byte seq, payload)")
                    continue
                self.on_live(endpoint, int.from_bytes(frames[1], "big"), frames[2])
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

    def on_live(self, endpoint: PublisherEndpoint, seq: int, payload: bytes) -> None:
        """Handle one live batch: detect first contact, gaps, duplicates and restarts; deliver in order."""
        labels = (endpoint.instance_id, str(endpoint.data_parallel_rank))
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
            self.metrics.restarts.labels(*labels).inc()
            previous_epoch = state.epoch
            state = self.state[endpoint] = _SourceState(self._new_epoch())
            # retire the old epoch's residency before the new epoch's first batch
            self.sink.source_event(self._publisher(endpoint, state), PUBLISHER_RESTARTED,
                                   {"previous_epoch": previous_epoch}, -1)
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
            self.metrics.restarts.labels(*labels).inc()
            state = self.state[endpoint] = _SourceState(self._new_epoch())
            self.sink.source_event(self._publisher(endpoint, state), PUBLISHER_RESTARTED,
                                   {"previous_epoch": saved["epoch"]}, -1)
            self._catch_up(endpoint, state, 0, seq, first_contact=True)
        elif state is None:
            state = self.state[endpoint] = _SourceState(self._new_epoch())
            self._catch_up(endpoint, state, 0, seq, first_contact=True)
        elif seq > state.last_seq + 1:
            self.metrics.gaps_found.labels(*labels).inc()
            self._catch_up(endpoint, state, state.last_seq + 1, seq, first_contact=False)
        self._deliver(endpoint, state, seq, payload)
        if seq >= state.replayed.stop - 1:
            state.replayed = range(0)  # live has overtaken the replay: a lower seq from now on is a restart
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
        """Deliver the batches [start, live_seq) from the replay socket, marking what it no longer holds."""
        labels = (endpoint.instance_id, str(endpoint.data_parallel_rank))
        replayed = self.replay(endpoint, start) if endpoint.replay_endpoint else []
        first_replayed = None
        for seq, payload in replayed:
            if seq >= live_seq or (state.last_seq is not None and seq <= state.last_seq):
                continue
            first_replayed = seq if first_replayed is None else first_replayed
            self.metrics.batches_replayed.labels(*labels).inc()
            self._deliver(endpoint, state, seq, payload)
        if replayed:
            state.replayed = range(replayed[0][0], replayed[-1][0] + 1)
        expected_first = start
        got_from = first_replayed if first_replayed is not None else live_seq
        if got_from > expected_first:
            # first contact: batches before the oldest one we could get describe cache state we never saw
            self.metrics.gaps_unrecovered.labels(*labels).inc()
            state.stale = True
            self.sink.source_event(self._publisher(endpoint, state), SOURCE_STALE,
                                   {"first_lost_seq": expected_first, "last_lost_seq": got_from - 1}, expected_first)
            log.warning("%s: %d batches (seq %d..%d) are lost%s", endpoint.label, got_from - expected_first,
                        expected_first, got_from - 1, " before first contact" if first_contact else "")

    def replay(self, endpoint: PublisherEndpoint, start_seq: int) -> list[tuple[int, bytes]]:
        """Ask the publisher's replay socket for every batch from ``start_seq`` on (DEALER; REQ gets only one).

        Returns:
            ``[(seq, payload)]`` in the order received, up to the end marker; empty on timeout.
        """
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint.replay_endpoint)
        batches: list[tuple[int, bytes]] = []
        try:
            sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
            while sock.poll(self.replay_timeout_ms):
                frames = sock.recv_multipart()
                app_frames = frames[1:] if frames and frames[0] == b"" else frames
                if len(app_frames) == 3:
                    _, seq_bytes, payload = app_frames
                elif len(app_frames) == 2:  # older vLLM: (seq, payload), no topic frame
                    seq_bytes, payload = app_frames
                else:
                    log.warning("%s: replay reply of %d frames ignored", endpoint.label, len(frames))
                    continue
                if seq_bytes == END_SEQ:
                    return batches
                batches.append((int.from_bytes(seq_bytes, "big"), payload))
            log.warning("%s: replay from %d timed out after %d batches", endpoint.label, start_seq, len(batches))
            return batches
        finally:
            sock.close()

    def close(self) -> None:
        """Save the state file and close the subscriber sockets."""
        self.save_state()
        for sock in self._sockets:
            sock.close(linger=0)
