"""The workload of a chaos run and its ground truth: the trace slice through the simulator, its records and messages,
and the residency a naive replay of its batches gives."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from producers.simulator import Batch, ClusterSimulator, FleetConfig, load_trace
from producers.split import split_event
from schemas.tiers import tier_of

#: Small pools (as tests/integration/test_pipeline.py): blocks cascade GPU -> CPU -> KVCR and get evicted; one GPU
#: reset.
CHAOS_FLEET = FleetConfig(gpu_blocks=600, cpu_blocks=900, kvcr_blocks=1200, clear_instance=1, clear_at=0.6)


@dataclass
class Workload:
    """A simulated trace slice: its batches, the block records they become, and the ground truth."""

    #: Batches in publishing order (see :class:`producers.simulator.Batch`).
    batches: list[Batch]
    #: Block-level ``kv_event`` records in producing order.
    records: list[dict]
    #: Kafka messages the records become with ``partitions`` partitions (a clear once per partition).
    messages: int
    #: Final residency: (instance, dp rank, tier, ownership, locality, group, hash bytes) -> copies.
    ground_truth: dict


def simulate_workload(requests: int, fleet: FleetConfig, partitions: int) -> Workload:
    """Simulate the first ``requests`` requests of the vendored trace through ``fleet``."""
    sim = ClusterSimulator(fleet)
    batches = list(sim.run(load_trace(limit=requests)))
    records = [record for batch in batches for index, event in enumerate(batch.events)
               for record in split_event(batch.publisher, batch.seq, batch.ts, index, event)]
    return Workload(batches, records, message_count(records, partitions), sim.ground_truth())


def message_count(records: list[dict], partitions: int) -> int:
    """Kafka messages ``records`` become: one per keyed record, one per partition for a record without a key."""
    return sum(1 if record["block_hash"] is not None else partitions for record in records)


def naive_residency(batches: list[Batch], skip_seqs: set[int] = frozenset()) -> dict:
    """Apply batches in order with plain reference counts (GPU clears; one worker per source).

    Args:
        skip_seqs: seqs of batches that never arrived (a gap), left out.

    Returns:
        ``{(instance, dp rank, tier, ownership, locality, group, hash bytes): copies}`` of resident rows, the
        identity :func:`stream_apps.snapshot.resident_rows` uses. Sources with several workers
        (``world_size`` > 1) are not supported: the fleet scenarios use the simulator's own ground truth.
    """
    counts: Counter = Counter()
    for batch in batches:
        if batch.seq in skip_seqs:
            continue
        p = batch.publisher
        for event in batch.events:
            if event["type"] == "AllBlocksCleared":
                for key in [k for k in counts if k[0] == p.instance_id and k[1] == p.data_parallel_rank
                            and k[2] == "GPU"]:
                    del counts[key]
                continue
            tier = tier_of(event.get("medium"))
            for h in event["block_hashes"]:
                key = (p.instance_id, p.data_parallel_rank, tier, event.get("ownership"), event.get("locality"),
                       event.get("group_idx") or 0, h.to_bytes(8, "big"))
                if event["type"] == "BlockStored":
                    counts[key] += 1
                elif counts[key] > 0:
                    counts[key] -= 1
                    if not counts[key]:
                        del counts[key]
    return {key: copies for key, copies in counts.items() if copies > 0}
