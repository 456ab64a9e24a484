"""The bench's input: the simulator's batches of the trace, shifted repetitions of it, and their records and vLLM
payloads."""

from __future__ import annotations

from typing import Iterator


def _fleet_batches(requests, fleet=None, epoch_offset: int = 0):
    """The simulator's batches for ``requests`` (the simulation is run here, all at once)."""
    from producers.simulator import TRACE_START_TS, ClusterSimulator

    sim = ClusterSimulator(fleet, publisher_epoch=int(TRACE_START_TS * 1000) + epoch_offset)
    return list(sim.run(requests)), sim


def _shifted(requests, repetition: int):
    """The requests with block ids shifted past every earlier repetition: distinct blocks, same shape."""
    from producers.simulator import Request

    if repetition == 0:
        return requests
    offset = repetition * (1 << 40)
    return [Request(r.timestamp_ms, tuple(h + offset for h in r.hash_ids)) for r in requests]


def _eviction_free_fleet():
    """A fleet whose tiers never evict, so every stored block stays resident (for the row-count steps)."""
    from producers.simulator import FleetConfig

    big = 1 << 40
    return FleetConfig(gpu_blocks=big, cpu_blocks=big, kvcr_blocks=big, clear_instance=None)


def _records(batches) -> Iterator[dict]:
    """The block records of ``batches``, one at a time (a whole trace's records as dicts take gigabytes)."""
    from producers.split import split_event

    for b in batches:
        for i, e in enumerate(b.events):
            yield from split_event(b.publisher, b.seq, b.ts, i, e)


def _vllm_payloads(batches) -> list[bytes]:
    """Each simulator batch as vLLM 0.33 publishes it: msgpack ``[ts, [event maps], dp_rank]``."""
    import msgspec

    encode = msgspec.msgpack.Encoder().encode
    return [encode([b.ts, b.events, 0]) for b in batches]
