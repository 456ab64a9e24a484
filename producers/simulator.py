"""Cluster simulator: replays a request trace through a simulated serving fleet.

Each request of the Mooncake trace (its prompt's KV blocks, in prefix order) is
routed by prefix affinity to one of N instances. Each instance has

* a GPU block pool (LRU over cached blocks, vLLM ``BlockPool``): a miss stores
  the block, a full pool evicts its least recently used block;
* a CPU offload tier (bounded LRU) that receives every block the GPU pool
  evicts (vLLM OffloadingConnector, CPU primary tier);
* a secondary tier below it with ``ownership="kvcr"`` (vLLM KVCR tier, medium
  ``STORAGE``) that receives the blocks the CPU tier evicts.

The instances publish vLLM 0.33-shaped event batches: the scheduler publishes
the GPU pool's events (removals, then stores, as ``BlockPool`` emits them) and,
on single-worker instances, the connector's events before them; instances with
2 tensor-parallel workers have each worker publish the connector events on its
own seq stream (``worker_rank``, ``world_size=2``, replicated), before the
scheduler's batch, so the stream app's aggregation across workers is exercised.
The connector's events come first because an offload copies a block out of the
GPU before its slot is reused (vLLM's offloading connector stores blocks as they
are computed, long before the pool evicts them): a block's CPU store precedes
its GPU removal, and its residency entry keeps the content keys the GPU store
gave it. One instance resets its GPU
prefix cache half way through (``AllBlocksCleared``).

The simulator keeps the ground truth: the final residency of every (instance,
data-parallel rank, tier, ownership, locality, group, block hash) with its
number of copies, in the same identity the stream app materializes.

While :func:`replay_to_kafka` publishes, each simulated publisher gets a ``SourceHeartbeat`` (evidence
``producing``) every heartbeat interval of wall-clock time and one at the end, so the workers' leases of the
simulated sources start when the replay ends.

The GPU stores carry each trace block's content hash (:func:`trace_block_content_hash`), not its tokens. The
trace itself, and what its block ids stand for (tokens, content hashes, block hashes), is in
:mod:`producers.trace`; every name of it other modules use is importable from here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Iterator

from producers.split import CONTENT_HASHES, Publisher
from producers.trace import (
    DEFAULT_TRACE,
    TRACE_BLOCK_SIZE,
    TRACE_VOCAB_SIZE,
    Request,
    block_hash_of,
    load_trace,
    trace_block_content_hash,
    trace_block_tokens,
    trace_request_tokens,
)

__all__ = [
    "DEFAULT_TRACE", "TRACE_BLOCK_SIZE", "TRACE_VOCAB_SIZE", "TRACE_START_TS", "Request", "load_trace",
    "block_hash_of", "trace_block_tokens", "trace_request_tokens", "trace_block_content_hash", "FleetConfig",
    "KVCR", "Batch", "SimulationStats", "simulated_instance_names", "ClusterSimulator", "ReplayResult",
    "replay_to_kafka",
]

#: 2026-01-01T00:00:00Z: the wall-clock time at which the replayed trace starts, in seconds.
TRACE_START_TS = 1767225600.0


@dataclass
class FleetConfig:
    """Shape of the simulated fleet. Capacities are in blocks of 512 tokens."""

    #: Number of serving instances requests are routed to.
    instances: int = 4
    #: GPU block pool capacity per instance.
    gpu_blocks: int = 4096
    #: CPU offload tier capacity per instance.
    cpu_blocks: int = 8192
    #: KVCR secondary tier capacity per instance.
    kvcr_blocks: int = 16384
    #: Instances (by index) whose 2 tensor-parallel workers each publish the connector events.
    tp_instances: tuple[int, ...] = (1, 3)
    #: Instance (by index) that resets its GPU prefix cache; None for no reset.
    clear_instance: int | None = 2
    #: Fraction of the trace after which that instance resets.
    clear_at: float = 0.5
    #: Bounded-load routing: an instance takes no request while it has served more than (1 + slack) times
    #: an even share of the requests so far.
    load_slack: float = 0.1


#: Ownership of the simulated secondary tier (vLLM 0.33's KVCR tier).
KVCR = "kvcr"


@dataclass
class Batch:
    """One published event batch: what an engine sends in one ZMQ message."""

    publisher: Publisher
    seq: int
    #: Wall-clock seconds since the Unix epoch.
    ts: float
    #: vLLM map-form events.
    events: list[dict]


@dataclass
class _Instance:
    name: str
    tp_workers: int
    gpu: OrderedDict = field(default_factory=OrderedDict)
    cpu: OrderedDict = field(default_factory=OrderedDict)
    kvcr: OrderedDict = field(default_factory=OrderedDict)
    routed: int = 0


@dataclass
class SimulationStats:
    """What the simulated fleet did, counted over the whole replay."""

    requests: int = 0
    block_lookups: int = 0
    gpu_hits: int = 0
    cpu_hits: int = 0
    kvcr_hits: int = 0
    batches: int = 0
    engine_events: int = 0


def simulated_instance_names(config: FleetConfig) -> list[str]:
    """The instance ids of the simulated fleet (``sim-0``, ``sim-1``, ...), as its events name them."""
    return [f"sim-{i}" for i in range(config.instances)]


class ClusterSimulator:
    """Replay requests through the fleet and yield the event batches it publishes.

    Usage: ``for batch in sim.run(requests): ...``; afterwards
    :meth:`ground_truth` gives the final residency.
    """

    def __init__(self, config: FleetConfig | None = None, publisher_epoch: int = int(TRACE_START_TS * 1000)) -> None:
        self.config = config = config or FleetConfig()
        if config.gpu_blocks < 2 * 247:
            raise ValueError("gpu_blocks must hold at least two of the trace's longest requests (494 blocks)")
        self.instances = [_Instance(name, 2 if i in config.tp_instances else 1)
                          for i, name in enumerate(simulated_instance_names(config))]
        self.stats = SimulationStats()
        self._epoch = publisher_epoch
        self._seq: dict[Publisher, int] = {}

    def _publisher(self, inst: _Instance, worker_rank: int | None) -> Publisher:
        if worker_rank is None:
            return Publisher(inst.name, 0, publisher_epoch=self._epoch)
        return Publisher(inst.name, 0, worker_rank=worker_rank, world_size=inst.tp_workers,
                         aggregation="REPLICATED", publisher_epoch=self._epoch)

    def _batch(self, publisher: Publisher, ts: float, events: list[dict]) -> Batch:
        seq = self._seq.get(publisher, 0)
        self._seq[publisher] = seq + 1
        self.stats.batches += 1
        self.stats.engine_events += len(events)
        return Batch(publisher, seq, ts, events)

    def _route(self, hashes: list[int]) -> _Instance:
        """Prefix affinity with bounded load: the instance holding the longest cached prefix of the
        request, among those that have not taken more than ``load_slack`` over an even share of the requests
        so far (consistent hashing with bounded loads), ties to the least loaded."""
        bound = (1 + self.config.load_slack) * self.stats.requests / len(self.instances) + 1
        best, best_len = None, -1
        for inst in self.instances:
            if inst.routed > bound:
                continue
            n = 0
            for h in hashes:
                if h in inst.gpu or h in inst.cpu or h in inst.kvcr:
                    n += 1
                else:
                    break
            if n > best_len or (n == best_len and inst.routed < best.routed):
                best, best_len = inst, n
        return best

    def _offload(self, inst: _Instance, evicted: list[int], connector: list[dict]) -> None:
        """Cascade GPU evictions into the CPU tier, and CPU evictions into the KVCR tier."""
        cpu_removed, kvcr_removed = [], []
        for h in evicted:
            if h in inst.cpu:
                inst.cpu.move_to_end(h)
                continue
            if len(inst.cpu) >= self.config.cpu_blocks:
                old, _ = inst.cpu.popitem(last=False)
                cpu_removed.append(old)
                if old in inst.kvcr:
                    inst.kvcr.move_to_end(old)
                else:
                    if len(inst.kvcr) >= self.config.kvcr_blocks:
                        kvcr_removed.append(inst.kvcr.popitem(last=False)[0])
                    inst.kvcr[old] = True
                    connector.append(_placeholder_store(old, "STORAGE", KVCR))
            inst.cpu[h] = True
            connector.append(_placeholder_store(h, "CPU", None))
        if cpu_removed:
            connector.append({"type": "BlockRemoved", "block_hashes": cpu_removed, "medium": "CPU", "group_idx": 0})
        if kvcr_removed:
            connector.append({"type": "BlockRemoved", "block_hashes": kvcr_removed, "medium": "STORAGE",
                              "group_idx": 0, "ownership": KVCR})

    def _serve(self, inst: _Instance, request: Request, ts: float) -> Iterator[Batch]:
        stats = self.stats
        hashes = [block_hash_of(i) for i in request.hash_ids]
        gpu, cap = inst.gpu, self.config.gpu_blocks
        scheduler_events: list[dict] = []
        evicted: list[int] = []
        run: list[int] = []
        run_parent: int | None = None
        run_start = 0
        #: (parent, blocks, position of the first in the request)
        stored_runs: list[tuple[int | None, list[int], int]] = []
        for position, h in enumerate(hashes):
            stats.block_lookups += 1
            if h in gpu:
                stats.gpu_hits += 1
                gpu.move_to_end(h)
                if run:
                    stored_runs.append((run_parent, run, run_start))
                    run = []
                continue
            if h in inst.cpu:
                stats.cpu_hits += 1
                inst.cpu.move_to_end(h)
            elif h in inst.kvcr:
                stats.kvcr_hits += 1
                inst.kvcr.move_to_end(h)
            while len(gpu) >= cap:
                old, _ = gpu.popitem(last=False)
                evicted.append(old)
                scheduler_events.append({"type": "BlockRemoved", "block_hashes": [old], "medium": "GPU",
                                         "group_idx": 0})
            gpu[h] = True
            if not run:
                run_parent = hashes[position - 1] if position else None
                run_start = position
            run.append(h)
        if run:
            stored_runs.append((run_parent, run, run_start))
        for parent, blocks, start in stored_runs:
            scheduler_events.append({
                "type": "BlockStored", "block_hashes": blocks, "parent_block_hash": parent, "token_ids": [],
                "block_size": TRACE_BLOCK_SIZE, "lora_id": None, "medium": "GPU", "lora_name": None,
                "extra_keys": [None] * len(blocks), "group_idx": 0, "kv_cache_spec_kind": "full_attention",
                CONTENT_HASHES: [trace_block_content_hash(i) for i in request.hash_ids[start:start + len(blocks)]],
            })
        connector: list[dict] = []
        if evicted:
            self._offload(inst, evicted, connector)
        yield from self._publish(inst, ts, scheduler_events, connector)

    def _publish(self, inst: _Instance, ts: float, scheduler_events: list[dict],
                 connector: list[dict]) -> Iterator[Batch]:
        # the connector's copies first: a block is offloaded before its GPU slot is reused (module docstring)
        if inst.tp_workers == 1:
            scheduler_events = connector + scheduler_events
            connector = []
        if connector:
            for worker in range(inst.tp_workers):
                yield self._batch(self._publisher(inst, worker), ts, connector)
        if scheduler_events:
            yield self._batch(self._publisher(inst, None), ts, scheduler_events)

    def _reset_gpu(self, inst: _Instance, ts: float) -> Iterator[Batch]:
        """vLLM ``reset_prefix_cache``: the GPU pool forgets every cached block; offloaded copies stay."""
        inst.gpu.clear()
        yield self._batch(self._publisher(inst, None), ts, [{"type": "AllBlocksCleared"}])

    def run(self, requests: list[Request]) -> Iterator[Batch]:
        """Serve every request in arrival order, yielding each published batch."""
        clear_index = None
        if self.config.clear_instance is not None and requests:
            clear_index = int(len(requests) * self.config.clear_at)
        for index, request in enumerate(requests):
            ts = TRACE_START_TS + request.timestamp_ms / 1000.0
            if index == clear_index:
                yield from self._reset_gpu(self.instances[self.config.clear_instance], ts)
            self.stats.requests += 1
            hashes = [block_hash_of(i) for i in request.hash_ids]
            inst = self._route(hashes)
            inst.routed += 1
            yield from self._serve(inst, request, ts)

    def last_seqs(self) -> dict[Publisher, int]:
        """Each publisher that has published so far -> the seq of its last batch (what its heartbeats name)."""
        return {publisher: seq - 1 for publisher, seq in self._seq.items()}

    def ground_truth(self) -> dict[tuple, int]:
        """Final residency: (instance, dp rank, tier, ownership, locality, group, block hash bytes) -> copies."""
        truth = {}
        for inst in self.instances:
            for tier, ownership, pool in (("GPU", None, inst.gpu), ("CPU", None, inst.cpu),
                                          ("STORAGE", KVCR, inst.kvcr)):
                for h in pool:
                    truth[(inst.name, 0, tier, ownership, None, 0, h.to_bytes(8, "big"))] = 1
        return truth


def _placeholder_store(block_hash: int, medium: str, ownership: str | None) -> dict:
    """An offload connector store in vLLM's placeholder shape (OffloadingEventsTracker, legacy mode)."""
    event = {"type": "BlockStored", "block_hashes": [block_hash], "parent_block_hash": None, "token_ids": [],
             "block_size": 0, "lora_id": None, "medium": medium, "lora_name": None, "group_idx": 0}
    if ownership is not None:
        event["ownership"] = ownership
    return event


@dataclass
class ReplayResult:
    """Outcome of :func:`replay_to_kafka`."""

    #: Block-level records produced (a clear counts once, not once per partition).
    records: int
    #: Kafka messages acknowledged (clears count once per partition).
    messages: int
    #: Wall-clock seconds from the first request to the last acknowledgement.
    seconds: float
    simulation: SimulationStats
    #: See :meth:`ClusterSimulator.ground_truth`.
    ground_truth: dict
    #: ``SourceHeartbeat`` records produced (one per publisher each heartbeat; each is a message per partition).
    heartbeats: int = 0


def replay_to_kafka(requests: list[Request], producer, config: FleetConfig | None = None,
                    progress=None, heartbeat_interval_s: float = 5.0,
                    monotonic: Callable[[], float] | None = None) -> ReplayResult:
    """Simulate the fleet over ``requests`` and produce every block event through ``producer``.

    While it publishes, every ``heartbeat_interval_s`` of wall-clock time, and once more at the end, each simulated
    publisher that has published gets a ``SourceHeartbeat`` (evidence ``producing``, its epoch and last seq,
    ``ts`` the wall clock): the workers' leases of the sources (``--source-lease-s``, on their clock of arrival) run
    from the end of the replay, not from the trace's timestamps.

    Args:
        producer: a :class:`producers.kafka_sink.KvEventProducer` (anything with
            ``send(record)``, ``flush()`` and ``stats``; its ``send_event`` is used when it has one).
        progress: optional callable taking the number of requests just served
            (e.g. ``tqdm.update``).
        heartbeat_interval_s: seconds between heartbeats; 0: none at all, not even at the end.
        monotonic: the clock of the intervals, seconds (default :func:`time.monotonic`; tests give a fake one).

    Raises:
        producers.split.InvalidEvent: the simulator built an invalid event (a bug).
        producers.kafka_sink.ProduceError: Kafka did not acknowledge every message.
    """
    import time

    from producers.split import source_event, split_event
    from schemas import SOURCE_HEARTBEAT

    clock = monotonic or time.monotonic
    sim = ClusterSimulator(config)
    started = time.perf_counter()
    records = heartbeats = 0
    served = 0
    send_event = getattr(producer, "send_event", None)

    def heartbeat() -> None:
        nonlocal heartbeats
        now = time.time()
        for publisher, seq in sim.last_seqs().items():
            producer.send(source_event(publisher, SOURCE_HEARTBEAT, {"evidence": "producing"}, seq, now))
            heartbeats += 1

    next_heartbeat = clock() + heartbeat_interval_s
    for batch in sim.run(requests):
        for index, event in enumerate(batch.events):
            if send_event is not None:  # the fast path: split and encoded in one step
                records += send_event(batch.publisher, batch.seq, batch.ts, index, event)
                continue
            for record in split_event(batch.publisher, batch.seq, batch.ts, index, event):
                producer.send(record)
                records += 1
        if heartbeat_interval_s and clock() >= next_heartbeat:
            next_heartbeat = clock() + heartbeat_interval_s
            heartbeat()
        if progress is not None and sim.stats.requests != served:
            progress(sim.stats.requests - served)
            served = sim.stats.requests
    if heartbeat_interval_s:
        heartbeat()  # the leases start at the end of the replay
    stats = producer.flush()
    return ReplayResult(records, stats.acked, time.perf_counter() - started, sim.stats, sim.ground_truth(),
                        heartbeats)
