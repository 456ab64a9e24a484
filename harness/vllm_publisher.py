"""A KV event publisher that follows vLLM 0.33's protocol (no vLLM install needed), for tests and ``make chaos``.

Structs mirror ``vllm/distributed/kv_events.py`` (field order, ``array_like``
batch, tagged map events, ``omit_defaults``); sockets mirror
``ZmqEventPublisher``: PUB sends ``(topic, seq 8-byte BE, payload)``, a ROUTER
replay socket answers ``[id, b"", start_seq]`` with every buffered batch from
``start_seq`` (oldest buffered if older) and an end marker ``(b"", ff*8, b"")``.

As a process (``python -m harness.vllm_publisher --port P --replay-port R --batches N``) it publishes N
batches, prints ``ready`` and then idles, serving its replay socket, until it is killed: an idle engine, and one
that a test can kill outright (SIGKILL: its sockets are closed by the kernel, as a crashed vLLM's are).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
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
        #: Cleared: replay requests are read and left unanswered (a hung engine whose sockets are still open).
        self.answer_replay = threading.Event()
        self.answer_replay.set()
        #: Replay requests received (answered or not), e.g. to see that a bridge probes.
        self.replay_requests = 0
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
            self.replay_requests += 1
            if not self.answer_replay.is_set():
                continue
            start_seq = int.from_bytes(start, "big")
            with self._lock:
                for seq, payload in list(self.buffer):
                    if seq >= start_seq:
                        self.router.send_multipart([identity, b"", self.topic, seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([identity, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def drop_connections(self) -> None:
        """Close the PUB socket and bind it again, keeping seq and buffer: the engine goes on, its subscribers'
        connections drop (a network blip) and reconnect. What is published meanwhile only the replay has."""
        with self._lock:
            endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.pub.close(linger=0)
            self.pub = self.context.socket(zmq.PUB)
            for _ in range(100):  # the old socket's port is released by ZMQ's I/O thread, a moment later
                try:
                    self.pub.bind(endpoint)
                    break
                except zmq.ZMQError:
                    time.sleep(0.02)
            else:
                raise RuntimeError(f"could not bind {endpoint} again")

    def oldest_buffered_seq(self) -> int | None:
        """The oldest seq the replay buffer still holds (None while empty)."""
        with self._lock:
            return self.buffer[0][0] if self.buffer else None

    def close(self) -> None:
        """Stop the replay thread and close the sockets (their peers see the connections close)."""
        self._stop.set()
        if self._replay_thread:
            self._replay_thread.join(2)
            self.router.close(linger=0)
        self.pub.close(linger=0)
        self.context.term()

    #: Seen from the network, a killed engine is one whose sockets closed at once: nothing is sent after it.
    kill = close


def _stored(block_hash: int) -> BlockStored:
    return BlockStored([block_hash], None, [1, 2, 3, 4], 4, None, "GPU", None, group_idx=0)


def main(argv: list[str] | None = None) -> int:
    """Publish ``--batches`` one-block batches (hashes 0, 1, ...), print ``ready``, then serve replay until killed."""
    parser = argparse.ArgumentParser(prog="python -m harness.vllm_publisher", description=main.__doc__)
    parser.add_argument("--port", type=int, required=True, help="PUB port (vLLM endpoint)")
    parser.add_argument("--replay-port", type=int, default=None, help="ROUTER replay port; none: no replay socket")
    parser.add_argument("--batches", type=int, default=0, help="batches to publish before going idle")
    parser.add_argument("--buffer-steps", type=int, default=10_000, help="batches the replay buffer keeps")
    args = parser.parse_args(argv)
    publisher = FakeVllmPublisher(args.port, args.replay_port, buffer_steps=args.buffer_steps)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    try:
        for block_hash in range(args.batches):
            publisher.publish([_stored(block_hash)])  # a subscriber not connected yet gets them from the replay
        print("ready", flush=True)
        while not stopping.is_set():
            time.sleep(0.1)
    finally:
        publisher.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
