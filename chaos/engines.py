"""The engines of the engine-crash scenario and the watch over answers that name a dead one."""

from __future__ import annotations

import math
import threading
import time
import traceback
from dataclasses import dataclass, field

import msgspec

from chaos.workload import naive_residency
from harness.vllm_publisher import FakeVllmPublisher
from kvstream.client import IndexClient, IndexQueryError
from producers.simulator import Batch


class _Engine(threading.Thread):
    """An engine double (:class:`FakeVllmPublisher`: vLLM's ZMQ PUB and replay sockets) publishing one simulated
    instance's batches, one every ``pace_s`` seconds, in a thread.

    With ``kill_after`` it is killed after that many batches: its sockets close at once, as the kernel closes a
    SIGKILLed vLLM's, so what is still queued is never sent and nothing answers its replay socket. With ``down_s``
    too, it comes back that many seconds later as a new process on the same ports (seq from 0, an empty cache
    and replay buffer), loads for ``boot_s`` seconds and publishes the rest of its batches; otherwise it stays
    dead. The engine that is never killed stays up, idle, once it has published everything (the bridge's probes
    keep its lease).

    Just before its kill, the engine asks every answerer about blocks it holds (:meth:`_DeadEngineWatch.named_now`):
    ``named_before_kill`` says per API whether one answer named it, so that an engine absent from the answers after
    its kill is known to have been in them before.

    After :meth:`join`, ``incarnations`` holds per process the batches it published (index = its seq) and
    ``error`` the traceback text of a failure.
    """

    def __init__(self, name: str, batches: list[Batch], ports: tuple[int, int], watch: _DeadEngineWatch, *,
                 pace_s: float, kill_after: int | None = None, down_s: float | None = None,
                 boot_s: float = 0.5) -> None:
        super().__init__(daemon=True, name=f"engine-{name}")
        self.engine = name
        self.batches = batches
        self.ports = ports
        self.watch = watch
        self.pace_s = pace_s
        self.kill_after = kill_after
        self.down_s = down_s
        self.boot_s = boot_s
        self.publisher: FakeVllmPublisher | None = None
        self.incarnations: list[list[Batch]] = []
        #: Canonical hashes the current process has stored so far, each added before its batch is sent.
        self.stored: set[bytes] = set()
        #: API -> whether an answer named the engine just before its kill (:meth:`_DeadEngineWatch.named_now`).
        self.named_before_kill: dict[str, bool] = {}
        self.error: str | None = None
        self._halt = threading.Event()

    def bind(self) -> None:
        """Start the first process: bind its sockets (before the bridge connects)."""
        self.publisher = FakeVllmPublisher(*self.ports)
        self.incarnations.append([])

    def run(self) -> None:
        try:
            end = len(self.batches) if self.kill_after is None else self.kill_after
            self._publish(self.batches[:end])
            if self.kill_after is None or self._halt.is_set():
                return
            held = naive_residency(self.incarnations[-1])
            self.named_before_kill = self.watch.named_now(self.engine, sorted({identity[6] for identity in held}))
            killed_at = time.monotonic()
            self.publisher.kill()
            self.publisher = None
            self.watch.killed(self.engine, killed_at, sorted({identity[6] for identity in held}))
            if self.down_s is None or self._halt.wait(self.down_s):
                return
            self.stored = set()  # a new object: the watch keeps the new process's
            self.publisher = FakeVllmPublisher(*self.ports)
            self.incarnations.append([])
            self.watch.restarted(self.engine, time.monotonic(), sorted({identity[6] for identity in held}),
                                 self.stored)
            if self._halt.wait(self.boot_s):
                return
            self._publish(self.batches[end:])
        except Exception:  # noqa: BLE001 - reported by the scenario, which fails the run
            self.error = traceback.format_exc(limit=-4)

    def _publish(self, batches: list[Batch]) -> None:
        start = time.monotonic()
        for i, batch in enumerate(batches):
            # an absolute schedule: the pace holds however long a send takes
            if self._halt.wait(max(0.0, start + i * self.pace_s - time.monotonic())):
                return
            # before the send: a block the watch finds missing here was not published when it asked
            self.stored.update(h.to_bytes(8, "big") for e in batch.events if e["type"] == "BlockStored"
                               for h in e["block_hashes"])
            self.publisher.publish_payload(msgspec.msgpack.encode([batch.ts, batch.events, 0]))
            self.incarnations[-1].append(batch)

    def close(self) -> None:
        """Stop publishing and close the current process's sockets (end of the run)."""
        self._halt.set()
        if self.is_alive():
            self.join(10)
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None


@dataclass
class _Kill:
    """One engine kill as :class:`_DeadEngineWatch` saw its answers (times: ``time.monotonic()``)."""

    engine: str
    killed_at: float
    #: Blocks the engine held when it was killed (what the watch asks about while it is dead).
    blocks: list[bytes]
    #: The kill's wall-clock time (``time.time()``), to compare with records' timestamps.
    killed_wall: float = 0.0
    restarted_at: float | None = None
    #: After the restart: the blocks the dead process held, and what the new process has stored so far (its
    #: :attr:`_Engine.stored`); a block of the first not yet in the second is asked about.
    old_blocks: list[bytes] = field(default_factory=list)
    stored_since_restart: set = field(default_factory=set)
    #: Latest answer naming the engine while it was dead, seconds after the kill; and which (API, answerer).
    named_for_s: float = 0.0
    named_by: str | None = None
    named_after_kill: bool = False
    #: Per answer (``"<API> <answerer URL>"``): ``[answers, seconds after the kill of the latest that named the
    #: engine (0.0: none did)]``. From that time on every answer of that API and answerer was free of the engine.
    answers: dict = field(default_factory=dict)
    #: Last time the watch asked about the engine while it was dead, seconds after the kill.
    watched_for_s: float = 0.0
    #: Per worker URL: seconds after the kill when GET /workers first said ``live: false``.
    down_seen_s: dict = field(default_factory=dict)
    #: Latest answer naming the restarted engine for a block its dead process held and the new one had not
    #: stored when asked, seconds after the restart (None: none did).
    old_named_s: float | None = None
    asked: int = 0
    old_asked: int = 0
    _turn: int = 0

    def next_block(self, blocks: list[bytes]) -> bytes:
        """The next of ``blocks`` to ask about, in turn (``blocks`` must not be empty)."""
        self._turn += 1
        return blocks[self._turn % len(blocks)]

    def next_old_block(self) -> bytes | None:
        """The next block the dead process held that the new one has not stored yet; None if there is none."""
        for _ in range(len(self.old_blocks)):
            block = self.next_block(self.old_blocks)
            if block not in self.stored_since_restart:
                return block
        return None

    def free_after_s(self) -> list[float]:
        """Per answer (API and answerer) the seconds after the kill from which it never named the engine again."""
        return [named for _, named in self.answers.values()]

    def summary(self, bound_s: float) -> dict:
        """The kill's entry of the results file."""
        return {"engine": self.engine, "restarted_after_s": None if self.restarted_at is None
                else round(self.restarted_at - self.killed_at, 3), "named_for_s": round(self.named_for_s, 3),
                "bound_s": bound_s, "named_by": self.named_by, "named_after_kill": self.named_after_kill,
                "free_after_s": {answer: round(named, 3) for answer, (_, named) in sorted(self.answers.items())},
                "watched_for_s": round(self.watched_for_s, 2),
                "down_seen_s": {url: round(v, 2) for url, v in self.down_seen_s.items()},
                "held_blocks": len(self.blocks), "asked": self.asked,
                "old_blocks": len(self.old_blocks), "old_asked": self.old_asked, "old_named_s": self.old_named_s}


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``values``; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _names(answer: dict, engine: str) -> bool:
    """Whether a ``/query`` or ``/query_by_hash`` answer names ``engine`` as a holder: a registered instance is
    listed with ``longest_matched`` 0 when it holds nothing (Mooncake's conductor API), which is not a hit."""
    return (answer["instances"].get(engine) or {}).get("longest_matched", 0) > 0


class _DeadEngineWatch(threading.Thread):
    """Asks every answerer (the workers, a ``kvstream index``), in a loop, the lookups a router makes about the
    engines that are dead now: ``GET /workers`` (is it ``live``?), ``POST /prefix-match/`` and ``POST /query_by_hash``
    of one block it held when it was killed, and ``POST /query`` of the tokens of one (``queries``), each in turn;
    and, once an engine is back, ``POST /prefix-match/`` of blocks its dead process held that the new one has not
    stored yet. Records when each answer last named a dead engine (:class:`_Kill`). A 503 or an error is counted in
    ``errors``, not taken for an answer.

    Args:
        urls: the answerers' base URLs.
        queries: canonical block hash -> the token ids of a request whose last block it is (``POST /query``'s body;
            the instances are registered with their block size); blocks without one are not asked by tokens.
    """

    def __init__(self, urls: list[str], pause_s: float = 0.1, queries: dict[bytes, list[int]] | None = None) -> None:
        super().__init__(daemon=True, name="dead-engine-watch")
        self.urls = list(urls)
        self.clients = {url: IndexClient(url, timeout_s=10) for url in urls}
        self.pause_s = pause_s
        self.queries = queries or {}
        self.kills: list[_Kill] = []
        self.asked = 0
        self.errors = 0
        self.error_examples: list[str] = []
        self._lock = threading.Lock()
        self._done = threading.Event()

    def killed(self, engine: str, at: float, blocks: list[bytes]) -> None:
        """``engine`` was killed at ``at`` (monotonic), holding ``blocks``."""
        wall = time.time() - (time.monotonic() - at)
        with self._lock:
            self.kills.append(_Kill(engine, at, blocks, killed_wall=wall))

    def named_now(self, engine: str, blocks: list[bytes], tries: int = 10) -> dict[str, bool]:
        """Whether ``engine`` is named now, per API: ``POST /prefix-match/`` of up to ``tries`` of ``blocks`` and
        ``POST /query`` of up to ``tries`` of those with tokens (:attr:`queries`), on every answerer, each API until
        one answer names it. Its own connections: the watch's thread keeps using its clients meanwhile."""
        found = {"POST /prefix-match/": False, "POST /query": False}
        with_tokens = [b for b in blocks if b in self.queries]
        for url in self.urls:
            with IndexClient(url, timeout_s=10) as client:
                for block in blocks[:tries]:
                    answer = self._ask(url, client.prefix_match, [block])
                    if answer is not None and any(m["instance_id"] == engine for m in answer["matches"]):
                        found["POST /prefix-match/"] = True
                        break
                for block in with_tokens[:tries]:
                    answer = self._ask(url, client.query, self.queries[block])
                    if answer is not None and _names(answer, engine):
                        found["POST /query"] = True
                        break
        return found

    def restarted(self, engine: str, at: float, old_blocks: list[bytes], stored: set[bytes]) -> None:
        """``engine`` is back since ``at`` (monotonic); ``old_blocks``: what its dead process held; ``stored``:
        the set of what the new process stores, which its engine thread fills as it publishes."""
        with self._lock:
            kill = self.kill_of(engine)
            kill.restarted_at, kill.old_blocks, kill.stored_since_restart = at, old_blocks, stored

    def kill_of(self, engine: str) -> _Kill:
        """The (last) kill of ``engine``. Raises StopIteration if it was not killed."""
        return next(k for k in reversed(self.kills) if k.engine == engine)

    def stop(self) -> None:
        """End the loop and wait for it."""
        self._done.set()
        if self.is_alive():
            self.join(30)
        for client in self.clients.values():
            client.close()

    def run(self) -> None:
        while not self._done.is_set():
            with self._lock:
                kills = list(self.kills)
            for url, client in self.clients.items():
                dead = [k for k in kills if k.restarted_at is None]
                back = [k for k in kills if k.restarted_at is not None and k.old_blocks]
                if dead:
                    workers = self._ask(url, client.workers)
                    if workers is not None:
                        live = {w["instance_id"] for w in workers["workers"] if w["live"]}
                        for kill in dead:
                            self._saw(kill, url, "GET /workers", kill.engine in live)
                            if kill.engine not in live:
                                kill.down_seen_s.setdefault(url, time.monotonic() - kill.killed_at)
                for kill in (k for k in dead if k.blocks):
                    answer = self._ask(url, client.prefix_match, [kill.next_block(kill.blocks)])
                    if answer is not None:
                        self._saw(kill, url, "POST /prefix-match/",
                                  any(m["instance_id"] == kill.engine for m in answer["matches"]))
                    answer = self._ask(url, client.query_by_hash, [kill.next_block(kill.blocks)])
                    if answer is not None:
                        self._saw(kill, url, "POST /query_by_hash", _names(answer, kill.engine))
                    with_tokens = [b for b in kill.blocks if b in self.queries]
                    if with_tokens:
                        answer = self._ask(url, client.query, self.queries[kill.next_block(with_tokens)])
                        if answer is not None:
                            self._saw(kill, url, "POST /query", _names(answer, kill.engine))
                for kill in back:
                    block = kill.next_old_block()
                    answer = None if block is None else self._ask(url, client.prefix_match, [block])
                    if answer is not None:
                        kill.old_asked += 1
                        if any(m["instance_id"] == kill.engine for m in answer["matches"]):
                            kill.old_named_s = round(time.monotonic() - kill.restarted_at, 2)
            self._done.wait(self.pause_s)

    def _ask(self, url: str, call, *args):
        self.asked += 1
        try:
            return call(*args)
        except (IndexQueryError, OSError, ValueError) as exc:
            self.errors += 1
            if len(self.error_examples) < 20:
                self.error_examples.append(f"{url} {getattr(call, '__name__', call)}: {type(exc).__name__}: {exc}")
            return None

    @staticmethod
    def _saw(kill: _Kill, url: str, api: str, named: bool) -> None:
        # the answer's time is when it came back: an upper bound of when the worker computed it
        now = time.monotonic()
        if kill.restarted_at is not None and now >= kill.restarted_at:
            return  # asked while dead, answered after the restart: the engine is alive again
        kill.asked += 1
        kill.watched_for_s = max(kill.watched_for_s, now - kill.killed_at)
        counted = kill.answers.setdefault(f"{api} {url}", [0, 0.0])
        counted[0] += 1
        if named:
            counted[1] = max(counted[1], now - kill.killed_at)
            kill.named_after_kill = True
            if now - kill.killed_at >= kill.named_for_s:
                kill.named_for_s, kill.named_by = now - kill.killed_at, f"{api} {url}"
