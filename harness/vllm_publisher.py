"""A KV event publisher that follows vLLM 0.33's protocol (no vLLM install needed), for tests and ``make chaos``.

Structs mirror ``vllm/distributed/kv_events.py`` (field order, ``array_like``
batch, tagged map events, ``omit_defaults``); sockets mirror
``ZmqEventPublisher``: PUB sends ``(topic, seq 8-byte BE, payload)``, a ROUTER
replay socket answers ``[id, b"", start_seq]`` with every buffered batch from
``start_seq`` (oldest buffered if older) and an end marker ``(b"", ff*8, b"")``.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=False, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class FakeVllmPublisher:
    """PUB + ROUTER replay on 127.0.0.1 ports; ``publish`` one batch, optionally without sending it live.

    Args:
        port: PUB port (vLLM ``endpoint``).
        replay_port: ROUTER replay port (vLLM ``replay_endpoint``); None for no replay socket.
        buffer_steps: batches the replay buffer keeps (vLLM ``buffer_steps``); older ones are dropped.
        topic: ZMQ topic frame of every message.
        data_parallel_rank: rank written into every batch.
    """

    def __init__(self, port: int, replay_port: int | None, *, buffer_steps: int = 10_000, topic: bytes = b"",
                 data_parallel_rank: int = 0) -> None:
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.topic = topic
        self.rank = data_parallel_rank
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._replay_thread = None
        if replay_port is not None:
            self.router = self.context.socket(zmq.ROUTER)
            self.router.bind(f"tcp://127.0.0.1:{replay_port}")
            self._replay_thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._replay_thread.start()

    def publish(self, events: list, *, ts: float = 1767225600.0, send_live: bool = True) -> int:
        """Encode and buffer one batch; send it on PUB unless ``send_live`` is False (a lost message)."""
        payload = msgspec.msgpack.encode(EventBatch(ts, events, self.rank))
        return self.publish_payload(payload, send_live=send_live)

    def publish_payload(self, payload: bytes, *, send_live: bool = True) -> int:
        """Buffer an already encoded batch and send it on PUB (unless ``send_live`` is False); returns its seq."""
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
            if send_live:
                self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue  # vLLM logs "Invalid replay request" and drops it
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            with self._lock:
                for seq, payload in list(self.buffer):
                    if seq >= start_seq:
                        self.router.send_multipart([identity, b"", self.topic, seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([identity, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def oldest_buffered_seq(self) -> int | None:
        """The oldest seq the replay buffer still holds (None while empty)."""
        with self._lock:
            return self.buffer[0][0] if self.buffer else None

    def close(self) -> None:
        """Stop the replay thread and close the sockets."""
        self._stop.set()
        if self._replay_thread:
            self._replay_thread.join(2)
            self.router.close(linger=0)
        self.pub.close(linger=0)
        self.context.term()
