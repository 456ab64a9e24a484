"""Sequencing of each source's batches: first contact, gaps, duplicates, restarts, epochs; the state file.

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

Replay on connect (docs/ingesting.md, "Heartbeats and replay on connect"): whenever
the SUB connection to a publisher comes up (ZMQ's socket monitor,
``EVENT_CONNECTED``: at start and after every disconnect; :mod:`producers.bridge_liveness`), the bridge asks the
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

The state file keeps each source's epoch and last seq across bridge restarts (:func:`read_state_file`,
:meth:`BridgeSequencing.save_state`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from producers.bridge_endpoints import END_SEQ, PublisherEndpoint, replay_frames, state_key
from producers.bridge_liveness import Link
from producers.bridge_sink import BatchSink, BridgeMetrics
from producers.kafka_sink import ProduceError
from schemas import PUBLISHER_RESTARTED, SOURCE_STALE

# every part of the bridge logs as ``producers.bridge``, the name its lines (the text format's name, the JSON's
# ``logger``) had before the bridge was split into modules: log filters and alerts keep matching
log = logging.getLogger("producers.bridge")


@dataclass
class SourceState:
    """What the bridge knows of one source's batches in its current publisher epoch."""

    epoch: int
    #: Last seq handed to the sink in this epoch; None before the first batch (an epoch begun by a restart that an
    #: empty replay showed).
    last_seq: int | None = None
    #: Seqs a replay delivered: live copies of them are duplicates, not a restart.
    replayed: range = field(default_factory=lambda: range(0))
    #: True once a gap could not be recovered (events were lost).
    stale: bool = False


def read_state_file(state_file: Path | None) -> dict[str, dict]:
    """The sources' epochs and last seqs a bridge saved (:meth:`BridgeSequencing.save_state`), by
    :func:`producers.bridge_endpoints.state_key`: ``{"epoch": ..., "last_seq": ...}`` each; empty when there is no
    state file (None, or not written yet).

    Raises:
        ValueError: the file is not JSON.
    """
    if state_file is None or not Path(state_file).exists():
        return {}
    try:
        return json.loads(Path(state_file).read_text())
    except ValueError as exc:
        raise ValueError(f"bridge state file {state_file} is not JSON ({exc}); move it away to start "
                         "afresh") from None


class BridgeSequencing:
    """The part of :class:`producers.bridge.Bridge` that puts each source's batches in order (module docstring):
    live batches (:meth:`on_live`), the replay socket's batches (:meth:`replay`, and the answer of a replay on
    connect or a probe, :meth:`_apply_replay`), epochs and restarts, and the state file (:meth:`save_state`).

    A mixin of :class:`producers.bridge.Bridge`, which sets up the attributes below and has ``_labels``,
    ``_publisher`` and ``_new_epoch``; a restart found by a replay asks again with
    :meth:`producers.bridge_liveness.BridgeLiveness._start_replay`.
    """

    sink: BatchSink
    metrics: BridgeMetrics
    links: dict[PublisherEndpoint, Link]
    state: dict[PublisherEndpoint, SourceState]
    replay_timeout_ms: int
    _context: zmq.Context
    _state_file: Path | None
    _saved: dict[str, dict]
    _saved_at: float
    _saving: bool
    _monitors: dict[zmq.Socket, PublisherEndpoint]

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
        elif state is None and (saved := self._saved.get(state_key(endpoint))) and seq > saved["last_seq"]:
            # the bridge restarted, the publisher did not: same epoch, replay what was missed
            state = self.state[endpoint] = SourceState(saved["epoch"], last_seq=saved["last_seq"])
            if seq > state.last_seq + 1:
                self.metrics.gaps_found.labels(*labels).inc()
                self._catch_up(endpoint, state, state.last_seq + 1, seq, first_contact=False)
        elif state is None and (saved := self._saved.get(state_key(endpoint))):
            log.warning("%s: seq %d is not past the saved %d: the publisher restarted while the bridge was down",
                        endpoint.label, seq, saved["last_seq"])
            state = self._restarted(endpoint, saved["epoch"])
            self._catch_up(endpoint, state, 0, seq, first_contact=True)
        elif state is None or state.last_seq is None:
            # first contact, or the first batch of an epoch that an empty replay showed to have begun
            if state is None:
                state = self.state[endpoint] = SourceState(self._new_epoch())
            self._catch_up(endpoint, state, 0, seq, first_contact=True)
        elif seq > state.last_seq + 1:
            self.metrics.gaps_found.labels(*labels).inc()
            self._catch_up(endpoint, state, state.last_seq + 1, seq, first_contact=False)
        self._deliver(endpoint, state, seq, payload)
        if seq >= state.replayed.stop - 1:
            state.replayed = range(0)  # live has overtaken the replay: a lower seq from now on is a restart
        self._maybe_save()

    def _restarted(self, endpoint: PublisherEndpoint, previous_epoch: int) -> SourceState:
        """Begin a new epoch for a publisher that restarted; retire the previous epoch's residency before the new
        epoch's first batch (``PublisherRestarted``)."""
        self.metrics.restarts.labels(*self._labels(endpoint)).inc()
        if endpoint in self.links:
            self.links[endpoint].unconfirmed = False
        state = self.state[endpoint] = SourceState(self._new_epoch())
        self.sink.source_event(self._publisher(endpoint, state), PUBLISHER_RESTARTED,
                               {"previous_epoch": previous_epoch}, -1)
        return state

    def _maybe_save(self) -> None:
        if self._state_file is not None and not self._saving and time.monotonic() - self._saved_at > 1.0:
            self.save_state()

    def save_state(self) -> None:
        """Write each source's epoch and last seq to the state file (atomically: temp file, then rename).

        The sink is flushed first, so a saved seq is always acknowledged: a bridge killed right after a save
        replays from there and loses nothing (saving first could skip batches still in the producer's queue).
        The flush watches the connections meanwhile (:meth:`_flush_watching`).
        """
        if self._state_file is None:
            return
        self._flush_watching()
        for endpoint, state in self.state.items():
            if state.last_seq is not None:
                self._saved[state_key(endpoint)] = {"epoch": state.epoch, "last_seq": state.last_seq}
        path = Path(self._state_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(path.suffix + ".tmp")
        temporary.write_text(json.dumps(self._saved, indent=1, sort_keys=True))
        os.replace(temporary, path)
        self._saved_at = time.monotonic()

    def _flush_watching(self, timeout_s: float = 120.0) -> None:
        """Flush the sink, a short wait at a time, and between them handle the socket monitors' events: a flush
        waits for the broker's acknowledgements, a second or more on a loaded broker, and an engine that dies
        meanwhile must be said down at once (``SourceDisconnected``), not after it. What that produces (the
        engine's last batches, the disconnect) is flushed too before the state is written. A sink without
        ``flush_some`` (a capture file) is flushed whole.

        Raises:
            producers.kafka_sink.ProduceError: messages failed, or were still unacknowledged after ``timeout_s``.
        """
        flush_some = getattr(self.sink, "flush_some", None)
        if flush_some is None:
            self.sink.flush()
            return
        deadline = time.monotonic() + timeout_s
        self._saving = True
        try:
            while not flush_some(min(0.05, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise ProduceError(f"messages were still unacknowledged after {timeout_s:g}s: the state file "
                                       "is not written")
                for monitor in list(self._monitors):
                    if monitor in self._monitors:  # (an endpoint removed meanwhile)
                        self._on_monitor(monitor)
        finally:
            self._saving = False

    def _deliver(self, endpoint: PublisherEndpoint, state: SourceState, seq: int, payload: bytes) -> None:
        self.sink.batch(endpoint, self._publisher(endpoint, state), seq, payload)
        state.last_seq = seq

    def _catch_up(self, endpoint: PublisherEndpoint, state: SourceState, start: int, live_seq: int,
                  first_contact: bool) -> None:
        """Deliver the batches [start, live_seq) from the replay socket, marking what it no longer holds.

        The live loop waits for the answer (up to the replay timeout): the live batch ``live_seq`` must follow
        them."""
        if start >= live_seq:  # nothing before it to ask for (a first batch with seq 0)
            return
        replayed, complete = self._ask_replay(endpoint, start, self.replay_timeout_ms) if endpoint.replay_endpoint \
            else ([], False)
        if complete:
            self.links.setdefault(endpoint, Link()).replay_answered = True
        self._take_replayed(endpoint, state, replayed, start, first_contact, until=live_seq)

    def _take_replayed(self, endpoint: PublisherEndpoint, state: SourceState, replayed: list[tuple[int, bytes]],
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
                reply = replay_frames(frames)
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

    def _apply_replay(self, endpoint: PublisherEndpoint, state: SourceState | None, start: int,
                      batches: list[tuple[int, bytes]]) -> None:
        """Apply the answer of a request from ``start`` (:meth:`_replay_start`) to a source in ``state``: first
        contact, the same epoch continued, or a restart (vLLM buffers its newest batches and answers only those
        at or after the seq asked)."""
        labels = self._labels(endpoint)
        link = self.links[endpoint]
        saved = self._saved.get(state_key(endpoint)) if state is None else None
        if state is None and saved is None:  # first contact, asked from 0
            if batches:
                state = self.state[endpoint] = SourceState(self._new_epoch())
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
            state = self.state[endpoint] = SourceState(epoch, last_seq=last_seq)
        if batches[0][0] > last_seq + 1:
            self.metrics.gaps_found.labels(*labels).inc()
        self._take_replayed(endpoint, state, batches, last_seq + 1, first_contact=False)
        self._maybe_save()
