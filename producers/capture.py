"""Capture files: a live KV event stream recorded as JSON lines, and published again through the bridge's path.

One line per batch (the format is in docs/ingesting.md, "Capture file format")::

    {"instance_id": "engine-0", "data_parallel_rank": 0, "seq": 12, "ts": 1767225600.0,
     "events": [{"type": "BlockStored", "block_hashes": [1882140585328457242], ...}, ...]}

Events are vLLM's map-encoded events in JSON; block hashes are integers (vLLM's
unsigned or SGLang's signed 64-bit ints) or hex strings (byte digests); other
bytes are hex strings. ``engine`` names the protocol (``vllm`` or ``sglang``;
``kvstream produce --engine`` for lines without it). Lines of a publisher that
is one of several workers of an engine add ``worker_rank``, ``world_size`` and
``aggregation``. Events the
capture could not decode are kept in ``undecodable`` with their reason and
msgpack bytes (hex), so nothing is lost silently.

``kvstream produce --jsonl`` re-encodes each line as the msgpack batch it was
and hands it to :class:`producers.bridge.Bridge`'s sequencing (gaps, restarts
and epochs are handled as live; there is no replay socket, so a gap is lost)
and to the same Kafka sink. At the end it sends one heartbeat per source of the
file (``SourceHeartbeat``, evidence ``producing``,
:meth:`producers.bridge.Bridge.send_heartbeats`): the workers' leases of those
sources run on their clock of arrival, so they start at load time, whatever the
capture's timestamps, and lapse one lease later. A capture has no heartbeats of
its own (:meth:`CaptureSink.source_event` writes none).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, TextIO

import msgspec

from producers.bridge import Bridge, PublisherEndpoint
from producers.engine_decode import BatchDecodeError, decode_batch
from producers.split import ENGINE_INT_ENCODING, Publisher

_HASH_FIELDS = ("block_hashes", "parent_block_hash")


class CaptureError(ValueError):
    """A capture line that is not a batch; the message names the line."""


def _to_json(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    return value


def _hash_from_json(value: Any) -> Any:
    return bytes.fromhex(value) if isinstance(value, str) else value


class CaptureSink:
    """A bridge sink that writes each batch as one JSON line."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.batches = 0

    def batch(self, endpoint: PublisherEndpoint, publisher: Publisher, seq: int, payload: bytes) -> None:
        line: dict[str, Any] = {"instance_id": publisher.instance_id,
                                "data_parallel_rank": publisher.data_parallel_rank, "seq": seq,
                                "engine": publisher.engine}
        try:
            decoded = decode_batch(payload)
        except BatchDecodeError as exc:
            line.update(ts=None, events=[], undecodable=[{"batch_index": None, "reason": str(exc),
                                                          "msgpack": payload.hex()}])
        else:
            if decoded.data_parallel_rank is not None:
                line["data_parallel_rank"] = decoded.data_parallel_rank
            line.update(ts=decoded.ts, events=[_to_json(event) for _, event, _ in decoded.events])
            if decoded.failures:
                line["undecodable"] = [{"batch_index": f.batch_index, "reason": f.reason, "msgpack": f.raw.hex()}
                                       for f in decoded.failures]
        if publisher.worker_rank is not None:
            line.update(worker_rank=publisher.worker_rank, world_size=publisher.world_size,
                        aggregation=publisher.aggregation or "REPLICATED")
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()
        self.batches += 1

    def flush(self) -> None:
        """Flush the capture file's buffer to the operating system."""
        self.out.flush()

    def source_event(self, publisher: Publisher, kind: str, body: dict, seq: int) -> None:
        """Not written: ``produce`` finds restarts (seq going back) and lost batches (gaps) in the file again, and
        sends heartbeats of its own at its end (the capture's would be stale by then)."""


def read_capture(path: Path, engine: str = "vllm") -> Iterator[tuple[PublisherEndpoint, int, bytes]]:
    """Each line of a capture as (source, seq, msgpack payload as the engine would have sent it).

    ``engine`` is the protocol of lines that do not name theirs (``"engine"``: ``vllm`` or ``sglang``).

    Hex-string hashes become bytes again; undecodable events are put back as their original msgpack,
    so they reach the dead-letter topic as they would have live.

    Raises:
        CaptureError: a line is not JSON or lacks ``instance_id``, ``seq``, ``ts`` or ``events``.
    """
    with open(path) as lines:
        for number, text in enumerate(lines, 1):
            if not text.strip():
                continue
            try:
                line = json.loads(text)
                line_engine = line.get("engine", engine)
                if line_engine not in ENGINE_INT_ENCODING:
                    raise ValueError(f"engine {line_engine!r} is not one of {', '.join(ENGINE_INT_ENCODING)}")
                source = PublisherEndpoint(f"file:{path}", None, line["instance_id"],
                                           int(line.get("data_parallel_rank") or 0), line.get("worker_rank"),
                                           line.get("world_size"), line.get("aggregation"), line_engine)
                whole = [f for f in line.get("undecodable", []) if f.get("batch_index") is None]
                if whole:  # the payload was not a batch at all: give back its bytes as they came
                    yield source, int(line["seq"]), bytes.fromhex(whole[0]["msgpack"])
                    continue
                events: list[Any] = []
                for event in line["events"]:
                    event = dict(event)
                    for name in _HASH_FIELDS:
                        if isinstance(event.get(name), list):
                            event[name] = [_hash_from_json(h) for h in event[name]]
                        elif name in event:
                            event[name] = _hash_from_json(event[name])
                    events.append(event)
                for failure in line.get("undecodable", []):
                    if failure.get("batch_index") is not None:
                        events.insert(failure["batch_index"], msgspec.Raw(bytes.fromhex(failure["msgpack"])))
                payload = msgspec.msgpack.encode([line["ts"], events, line.get("data_parallel_rank")])
                yield source, int(line["seq"]), payload
            except (ValueError, KeyError, TypeError) as exc:
                raise CaptureError(f"{path}:{number}: not a capture line ({type(exc).__name__}: {exc})") from None


def check_capture(path: Path, engine: str = "vllm") -> None:
    """Check a capture file before anything is sent anywhere: it exists, it is readable text, and its first
    line is a batch. Later lines are read as they are published (:func:`read_capture` raises there).

    Raises:
        CaptureError: it is not; the message is one line naming the file.
    """
    lines = read_capture(path, engine)
    try:
        first = next(lines, None)
    except FileNotFoundError:
        raise CaptureError(f"{path}: no such file (give a capture file written by 'kvstream capture', "
                           "docs/ingesting.md)") from None
    except UnicodeDecodeError:
        raise CaptureError(f"{path}: not a text file (a capture file is JSON lines, docs/ingesting.md)") from None
    except OSError as exc:
        raise CaptureError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    finally:
        lines.close()
    if first is None:
        raise CaptureError(f"{path}: holds no capture line (empty)")


def produce_capture(path: Path, sink, metrics=None, engine: str = "vllm") -> Bridge:
    """Publish a capture file through the bridge's sequencing into ``sink``; returns the bridge (its metrics, and
    :meth:`producers.bridge.Bridge.send_heartbeats`, which ``kvstream produce`` calls at the end).

    ``engine``: the protocol of lines that do not name theirs."""
    bridge = Bridge([], sink, metrics=metrics)
    for source, seq, payload in read_capture(path, engine):
        bridge.on_live(source, seq, payload)
    return bridge
