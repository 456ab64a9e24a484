"""Invariants of the cluster simulator: its events, replayed naively, give back its ground truth."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from producers.simulator import KVCR, ClusterSimulator, FleetConfig, block_hash_of, load_trace
from schemas.tiers import tier_of


@pytest.fixture(scope="module")
def replay():
    requests = load_trace(limit=1500)
    config = FleetConfig(gpu_blocks=600, cpu_blocks=900, kvcr_blocks=1200)  # small pools: many evictions
    sim = ClusterSimulator(config)
    return sim, list(sim.run(requests)), requests


def test_trace_loads_with_its_documented_shape():
    requests = load_trace()
    assert len(requests) == 12031
    assert sum(len(r.hash_ids) for r in requests) == 288500
    assert len({h for r in requests for h in r.hash_ids}) == 182790


def test_block_hashes_are_distinct_and_span_the_u64_range():
    hashes = [block_hash_of(i) for i in range(200000)]
    assert len(set(hashes)) == len(hashes)
    assert any(h >= 2**63 for h in hashes) and all(0 <= h < 2**64 for h in hashes)


def test_seq_is_contiguous_from_zero_per_publisher(replay):
    _, batches, _ = replay
    seqs = defaultdict(list)
    for batch in batches:
        seqs[batch.publisher].append(batch.seq)
    assert all(s == list(range(len(s))) for s in seqs.values())
    assert any(p.worker_rank == 1 and p.world_size == 2 for p in seqs)


def test_naive_replay_of_the_events_equals_the_ground_truth(replay):
    """Reference counts per (instance, tier, ownership, block), worker reports must agree, clears drop GPU."""
    sim, batches, _ = replay
    counts = Counter()
    per_worker = defaultdict(Counter)
    removed_unknown = 0
    for batch in batches:
        p = batch.publisher
        for event in batch.events:
            if event["type"] == "AllBlocksCleared":
                for key in [k for k in counts if k[0] == p.instance_id and k[1] == "GPU"]:
                    del counts[key]
                continue
            tier, ownership = tier_of(event["medium"]), event.get("ownership")
            for h in event["block_hashes"]:
                key = (p.instance_id, tier, ownership, h)
                if p.worker_rank is not None:
                    per_worker[p.worker_rank][key] += 1 if event["type"] == "BlockStored" else -1
                    continue
                if event["type"] == "BlockStored":
                    counts[key] += 1
                elif counts[key] > 0:
                    counts[key] -= 1
                else:
                    removed_unknown += 1
    assert per_worker[0] == per_worker[1]  # replicated: both workers report the same connector events
    for key, n in per_worker[0].items():
        counts[key] += n
    expected = {(i, 0, tier, own, None, 0, h.to_bytes(8, "big")): n for (i, tier, own, h), n in counts.items() if n}
    assert removed_unknown == 0
    assert expected == sim.ground_truth()


def test_tiers_stay_within_capacity_and_cascade_gpu_cpu_kvcr(replay):
    sim, batches, _ = replay
    config = sim.config
    for inst in sim.instances:
        assert len(inst.gpu) <= config.gpu_blocks and len(inst.cpu) <= config.cpu_blocks
        assert len(inst.kvcr) <= config.kvcr_blocks
    media = Counter((e["medium"], e.get("ownership")) for b in batches for e in b.events if "medium" in e)
    assert set(media) == {("GPU", None), ("CPU", None), ("STORAGE", KVCR)}


def test_every_request_is_served_and_load_stays_bounded(replay):
    sim, _, requests = replay
    assert sim.stats.requests == len(requests)
    routed = [inst.routed for inst in sim.instances]
    assert sum(routed) == len(requests) and max(routed) <= 1.1 * len(requests) / len(routed) + 2


def test_gpu_reset_emits_one_clear_and_empties_only_the_gpu_pool():
    sim = ClusterSimulator(FleetConfig(clear_instance=0, clear_at=0.5))
    batches = list(sim.run(load_trace(limit=400)))
    clears = [b for b in batches if b.events == [{"type": "AllBlocksCleared"}]]
    assert len(clears) == 1 and clears[0].publisher.instance_id == "sim-0"


def test_a_trace_blocks_tokens_are_derived_from_its_id_alone():
    from producers.simulator import TRACE_BLOCK_SIZE, TRACE_VOCAB_SIZE, trace_block_tokens

    tokens = trace_block_tokens(7)
    assert len(tokens) == TRACE_BLOCK_SIZE == 512
    assert tokens == trace_block_tokens(7) and tokens != trace_block_tokens(8)
    # the documented derivation, written out: SHAKE-128 of the id, 3 bytes per token, the lowest 17 bits
    import hashlib

    stream = hashlib.shake_128((7).to_bytes(8, "little")).digest(1536)
    assert tokens == [int.from_bytes(stream[3 * i:3 * i + 3], "little") & 0x1FFFF for i in range(512)]
    many = [t for i in range(200) for t in trace_block_tokens(i)]
    assert 0 <= min(many) and max(many) < TRACE_VOCAB_SIZE and len(set(many)) > 50_000
    assert trace_block_tokens(2**64 - 1) and trace_block_tokens(3 * (1 << 40) + 5)  # the bench's shifted ids
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match="outside"):
            trace_block_tokens(bad)


def test_a_requests_tokens_give_the_content_hashes_its_simulated_gpu_stores_carry(replay):
    """A query by a request's tokens (schemas.content_hash.block_content_hashes, block size 512) computes the
    content hashes the stores of its blocks publish, without the stores carrying a token."""
    from producers.simulator import TRACE_BLOCK_SIZE, trace_request_tokens
    from producers.split import CONTENT_HASHES, split_event
    from schemas.content_hash import block_content_hashes

    _, batches, requests = replay
    published = {}
    for batch in batches:
        for index, event in enumerate(batch.events):
            if event["type"] != "BlockStored":
                continue
            for record in split_event(batch.publisher, batch.seq, batch.ts, index, event):
                body = record["event"][1]
                assert body["token_ids"] == []
                if body["medium"] == "GPU":
                    assert body["block_size"] == TRACE_BLOCK_SIZE and body["content_hash"] is not None
                    published[record["block_hash"]] = body["content_hash"]
                else:  # the offload connector's placeholders: no tokens, no content
                    assert body["block_size"] == 0 and body["content_hash"] is None and CONTENT_HASHES not in event
    checked = 0
    for request in requests[:200]:
        tokens = trace_request_tokens(request)
        assert len(tokens) == TRACE_BLOCK_SIZE * len(request.hash_ids)
        assert trace_request_tokens(request.hash_ids) == tokens
        for hash_id, content in zip(request.hash_ids, block_content_hashes(tokens, TRACE_BLOCK_SIZE)):
            block = block_hash_of(hash_id).to_bytes(8, "big")
            if block in published:
                assert published[block] == content
                checked += 1
    assert checked > 1000
