"""Tenants kept apart (issue 49, item 3): a salted or LoRA block answers no query of another namespace, on any tier.

vLLM 0.33's GPU block pool says each block's extra keys in ``extra_keys`` (``[['tenant-1'], None, None, None]`` for a
salted request: the salt on block 0, a LoRA name on every block); its ``OffloadingEventsTracker`` stores the same
blocks on the CPU tier with their tokens but without ``extra_keys`` and with ``lora_name`` null. Such a store does not
say its extra keys: the producer gives it the content hash of the engine's earlier store of the same block
(``producers.split.ParentTracker``), or none, and the stream app computes none from its tokens alone.

The events below are built as the engine sends them, block hashes as vLLM computes them
(:func:`schemas.engine_hashes.engine_block_hashes`), and go through the producer's two encoders, the repartition
stage's two paths, the residency rules and the fleet index's two tables.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producers.split import BlockEncoder, ParentTracker, Publisher, rebuild_event, split_event
from schemas import AvroCodec
from schemas.avro_writers import KvEventWriter
from schemas.clear_position import NO_CLEAR
from schemas.content_hash import block_content_hashes, query_extra_keys, stored_content_hash
from schemas.engine_hashes import HashProfile, engine_block_hashes
from stream_apps.index.fleet_index import FleetIndex
from stream_apps.residency import DEFAULT_CLEAR_TIERS, ApplyStats, apply_block_event, content_digest, residency_key

CODEC = AvroCodec("kv_event")
BLOCK = 4
PROFILE = HashProfile("sha256", "0")
ENGINE = Publisher("vllm-0", 0, publisher_epoch=1767225600000)
TOKENS = list(range(100, 116))  # four blocks


def _ints(hashes: list[bytes]) -> list[int]:
    return [int.from_bytes(h, "big") for h in hashes]


def _gpu_store(tokens, lora=None, salt=None, start=0, block_size=BLOCK) -> dict:
    """The GPU block pool's BlockStored of a request's blocks from ``start`` on: ``extra_keys`` has one entry per block,
    ``(lora_name,)`` on every block of a LoRA request, then the salt on block 0 (None: no keys)."""
    hashes = _ints(engine_block_hashes(PROFILE, tokens, block_size, lora, salt))
    return {"type": "BlockStored", "block_hashes": hashes[start:], "parent_block_hash": hashes[start - 1] if start else
            None, "token_ids": tokens[start * block_size:len(hashes) * block_size], "block_size": block_size,
            "lora_id": 7 if lora else None, "medium": "GPU", "lora_name": lora,
            "extra_keys": [query_extra_keys(i, lora, salt) for i in range(start, len(hashes))], "group_idx": 0,
            "kv_cache_spec_kind": "full_attention"}


def _offload_store(gpu: dict, first: int = 0, last: int | None = None, medium="CPU", ownership=None,
                   tokens=True) -> dict:
    """The OffloadingEventsTracker's store of blocks ``first..last`` of a GPU store: the same block hashes and
    parent, their tokens (none: the legacy placeholder), no ``extra_keys`` field at all, ``lora_name`` null."""
    last = len(gpu["block_hashes"]) - 1 if last is None else last
    size = gpu["block_size"]
    event = {"type": "BlockStored", "block_hashes": gpu["block_hashes"][first:last + 1],
             "parent_block_hash": gpu["block_hashes"][first - 1] if first else gpu["parent_block_hash"],
             "token_ids": gpu["token_ids"][first * size:(last + 1) * size] if tokens else [],
             "block_size": size if tokens else 0, "lora_id": None, "medium": medium, "lora_name": None,
             "group_idx": 0}
    if ownership is not None:
        event["ownership"] = ownership
    return event


def _produce(events, publisher=ENGINE, capacity: int = 200_000) -> list[dict]:
    """The records a producer writes for ``events`` in order, decoded: the bridge's encoder (BlockEncoder) and
    split_event + ParentTracker.note + fastavro (KvEventProducer.send's path) write the same bytes."""
    encoder = BlockEncoder(KvEventWriter(CODEC), ParentTracker(capacity))
    fast = [pair for seq, event in enumerate(events) for pair in encoder.encode_event(publisher, seq, 1.0, 0, event)]
    tracker, reference = ParentTracker(capacity), []
    for seq, event in enumerate(events):
        for record in split_event(publisher, seq, 1.0, 0, event):
            tracker.note(record)
            reference.append((record["block_hash"], CODEC.encode(record)))
    assert fast == reference
    return [CODEC.decode(value) for _, value in fast]


def _contents(records: list[dict]) -> list:
    return [r["event"][1]["content_hash"] for r in records]


# --------------------------------------------------------------------------- the producer


def test_the_cpu_copy_of_a_salted_block_gets_the_salted_content_of_its_gpu_store():
    """The issue's events: a salted GPU store (``[['tenant-1'], None, None, None]``), then the CPU store of the same
    block hashes with tokens and no extra_keys. The CPU copy's content is the salted one a query with the salt
    computes, never the unsalted one of the same tokens."""
    gpu = _gpu_store(TOKENS, salt="tenant-1")
    assert gpu["extra_keys"] == [["tenant-1"], None, None, None]
    cpu = _offload_store(gpu)
    assert "extra_keys" not in cpu and cpu["lora_name"] is None
    records = _produce([gpu, cpu])
    salted, unsalted = block_content_hashes(TOKENS, BLOCK, cache_salt="tenant-1"), block_content_hashes(TOKENS, BLOCK)
    assert _contents(records[:4]) == _contents(records[4:]) == salted
    assert salted[0] != unsalted[0]  # block 0 carries the salt; later blocks are told apart by their parents
    assert [r["tier"] for r in records] == ["GPU"] * 4 + ["CPU"] * 4


def test_a_lora_blocks_offloaded_copies_keep_the_adapter_on_every_tier_and_ownership():
    gpu = _gpu_store(TOKENS, lora="sql-adapter")
    copies = [_offload_store(gpu), _offload_store(gpu, 1, 2, medium="STORAGE", ownership="kvcr")]
    records = _produce([gpu, *copies])
    adapter = block_content_hashes(TOKENS, BLOCK, lora_name="sql-adapter")
    assert _contents(records) == adapter + adapter + adapter[1:3]
    assert not set(_contents(records)) & set(block_content_hashes(TOKENS, BLOCK))  # every block carries the name


def test_a_store_that_does_not_say_its_extra_keys_gets_no_content_hash_when_the_producer_never_saw_the_block():
    """Without an earlier store of the block by the same engine (a producer started after the GPU store, one that
    forgot it, another engine's store), the CPU copy has no content hash rather than the unsalted one: it answers no
    query by tokens."""
    gpu = _gpu_store(TOKENS, salt="tenant-1")
    salted = block_content_hashes(TOKENS, BLOCK, cache_salt="tenant-1")
    assert _contents(_produce([_offload_store(gpu)])) == [None] * 4
    # capacity 4: a later request's two blocks push blocks 0 and 1 out of the producer's memory
    later = _gpu_store(list(range(500, 508)))
    records = _produce([gpu, later, _offload_store(gpu, 2, 3), _offload_store(gpu, 0, 0)], capacity=4)
    assert _contents(records[6:]) == [salted[2], salted[3], None]
    # memory is per engine, (instance, data-parallel rank): another engine's store of the block is not this one's
    encoder = BlockEncoder(KvEventWriter(CODEC), ParentTracker())
    encoder.encode_event(Publisher("other"), 0, 1.0, 0, gpu)
    encoder.encode_event(Publisher(ENGINE.instance_id, 1), 0, 1.0, 0, gpu)
    values = [v for _, v in encoder.encode_event(ENGINE, 0, 1.0, 0, _offload_store(gpu))]
    assert _contents([CODEC.decode(v) for v in values]) == [None] * 4


def test_a_store_that_names_another_parent_than_the_remembered_one_gets_no_content_hash():
    """An engine hash covers the block's parent: a store that names another parent (a tracker that sends each block
    alone, parent null) does not say where the block sits, and content keys with it would move the block's chain."""
    gpu = _gpu_store(TOKENS, salt="tenant-1")
    alone = [{**_offload_store(gpu, i, i), "parent_block_hash": None} for i in range(4)]
    salted = block_content_hashes(TOKENS, BLOCK, cache_salt="tenant-1")
    assert _contents(_produce([gpu, *alone])[4:]) == [salted[0], None, None, None]


def test_a_plain_request_and_sglang_stores_keep_the_content_their_fields_give():
    plain = _gpu_store(TOKENS)
    assert _contents(_produce([plain, _offload_store(plain)])) == block_content_hashes(TOKENS, BLOCK) * 2
    sglang = Publisher("sglang-0", engine="sglang")
    event = {"type": "BlockStored", "block_hashes": [-5, 7], "parent_block_hash": None, "token_ids": TOKENS[:8],
             "block_size": BLOCK, "lora_id": None, "lora_name": "a", "cache_salt": "tenant-1"}
    assert _contents(_produce([event], sglang)) == block_content_hashes(TOKENS[:8], BLOCK, "a", "tenant-1")


def test_the_offloaded_copys_event_is_rebuilt_as_the_engine_sent_it():
    """The content hash a store got from the producer's memory is the producer's: the rebuilt event has no
    kvstream_content_hashes field, as the engine's has none."""
    gpu = _gpu_store(TOKENS, salt="tenant-1")
    cpu = _offload_store(gpu)
    records = _produce([gpu, cpu])
    assert rebuild_event(records[4:]) == cpu
    assert rebuild_event(records[:4]) == gpu


# --------------------------------------------------------------------------- the stream app


def test_the_record_rule_gives_no_content_hash_to_a_vllm_store_without_extra_keys():
    """The repartition stage computes a missing content hash from the record (a producer of before kv_event v4): a
    vLLM record without extra_keys does not say them (UINT64 or BYTES hashes), an SGLang one (INT64) says them in
    lora_name and cache_salt."""
    gpu = _gpu_store(TOKENS, salt="tenant-1")
    body = _produce([_offload_store(gpu)])[0]["event"][1]
    assert stored_content_hash(body, "vllm") is None
    assert stored_content_hash(body, "sglang") == block_content_hashes(TOKENS[:4], BLOCK)[0]
    with_keys = _produce([gpu])[0]["event"][1]
    assert stored_content_hash(with_keys, "vllm") == with_keys["content_hash"] == block_content_hashes(
        TOKENS, BLOCK, cache_salt="tenant-1")[0]
    with pytest.raises(ValueError, match="unknown engine"):
        stored_content_hash(body, "trtllm")


def test_replicas_agree_whatever_their_producer_remembered():
    """A content hash the producer remembered is its own view, as parent_known is: replicated workers whose stores
    went through producers that did and did not remember the block agree (content_digest leaves it out)."""
    gpu = _gpu_store(TOKENS, salt="tenant-1")
    remembered = _produce([gpu, _offload_store(gpu)])[4]["event"][1]
    forgotten = _produce([_offload_store(gpu)])[0]["event"][1]
    assert remembered["content_hash"] is not None and forgotten["content_hash"] is None
    assert content_digest(remembered, "vllm") == content_digest(forgotten, "vllm")
    given = {**forgotten, "token_ids": [], "content_hash": 5}  # a tokenless store whose producer gave its content
    assert content_digest(given, "vllm") != content_digest({**given, "content_hash": None}, "vllm")


def _message(value: bytes, offset: int):
    return SimpleNamespace(error=lambda: None, partition=lambda: 0, offset=lambda: offset, value=lambda: value,
                           key=lambda: None, topic=lambda: "kv-events")


@pytest.mark.usefixtures("hotpath")
def test_the_repartition_stage_keeps_what_the_producer_said_on_both_paths():
    """Compiled (projection) and pure-Python (decoded) re-keying: a store without a content hash that does not say
    its extra keys reaches the agent without one, a store with one keeps it; a replicated source's stores get the
    same content digest whether their producer remembered the block or not."""
    from schemas.block_event import BlockEvent
    from schemas.ownership_batch import OwnershipBatchReader
    from schemas.topics import TopicNames
    from stream_apps.repartition import Repartitioner

    gpu = _gpu_store(TOKENS, salt="tenant-1")
    salted = block_content_hashes(TOKENS, BLOCK, cache_salt="tenant-1")
    remembering, forgetful = (Publisher(name, worker_rank=0, world_size=2, aggregation="REPLICATED")
                              for name in ("tp", "tp-restarted"))
    values = []
    for publisher in (ENGINE, remembering):
        encoder = BlockEncoder(KvEventWriter(CODEC), ParentTracker())
        for seq, event in enumerate([gpu, _offload_store(gpu), _offload_store(gpu, 0, 0, "STORAGE", "kvcr")]):
            values += [v for _, v in encoder.encode_event(publisher, seq, 1.0, 0, event)]
    values += [v for _, v in BlockEncoder(KvEventWriter(CODEC), ParentTracker()).encode_event(
        forgetful, 0, 1.0, 0, _offload_store(gpu))]  # a producer that never saw the GPU store
    produced = []
    producer = SimpleNamespace(produce=lambda topic, value, key, **kwargs: produced.append((topic, value)),
                               flush=lambda *args: 0)
    stage = Repartitioner("unused:0", TopicNames("unit"), 4, {"repartitioned": 0, "dead_lettered": 0},
                          batch_size=100, within_s=60.0, linger_s=0.02,
                          stop_event=SimpleNamespace(is_set=lambda: False),
                          consumer=SimpleNamespace(commit=lambda **kwargs: None), producer=producer)
    stage.process([_message(v, n) for n, v in enumerate(values)])
    reader = OwnershipBatchReader(CODEC)
    events = [BlockEvent._make(event) for topic, value in produced if topic == stage.output_topic
              for *_, event in reader.read(value)]
    assert len(events) == len(values)
    by_key = {(e.source.instance_id, e.tier, e.block_hash): e for e in events}
    hashes = [h.to_bytes(8, "big") for h in gpu["block_hashes"]]
    for instance in ("vllm-0", "tp"):
        assert [by_key[instance, tier, h].content_hash for tier in ("GPU", "CPU") for h in hashes] == salted * 2
        assert by_key[instance, "STORAGE", hashes[0]].content_hash == salted[0]
    assert [by_key["tp-restarted", "CPU", h].content_hash for h in hashes] == [None] * 4
    assert [by_key["tp", "CPU", h].content for h in hashes] == [by_key["tp-restarted", "CPU", h].content
                                                                 for h in hashes]
    assert None not in [by_key["tp", "CPU", h].content for h in hashes]


# --------------------------------------------------------------------------- the fleet index, property-tested

#: Requests of a small alphabet and few blocks, so that prefixes are shared and equal tokens meet under several salts
#: and adapters.
NAMESPACES = [(lora, salt) for lora in (None, "adapter-a", "adapter-b") for salt in (None, "tenant-1", "tenant-2")]
INSTANCES = ("e0", "e1")


def _requests():
    tokens = st.integers(1, 3).flatmap(lambda blocks: st.lists(st.integers(1, 2), min_size=blocks * BLOCK,
                                                               max_size=blocks * BLOCK))
    return st.lists(st.tuples(tokens, st.sampled_from(NAMESPACES)), min_size=1, max_size=4)


def _fleet(exact: bool):
    """Operations on a fleet of two vLLM engines: a GPU store of a request from some block on, an offload store of
    some of its blocks (CPU with ownership null, or the kvcr tier's STORAGE), a removal. ``exact``: offloads only of
    blocks the engine stored on its GPU before (an offload of others stores the request on the GPU first), with their
    tokens and parents, as vLLM's tracker sends them; else also tokenless placeholders, stores naming no parent,
    blocks the engine never stored."""
    operation = st.tuples(st.sampled_from(("gpu", "offload", "offload", "remove", "remove")),
                          st.sampled_from(INSTANCES), st.integers(0, 3), st.sampled_from((0, 0, 1, 2)),
                          st.integers(0, 2), st.sampled_from((("CPU", None), ("STORAGE", "kvcr"))), st.booleans(),
                          st.booleans())
    return st.tuples(_requests(), st.lists(operation, min_size=4, max_size=30), st.just(exact))


def _run_fleet(requests, operations, exact, table_class, capacity):
    """Every operation through the producer (one per engine, as a bridge), the residency rules and the index."""
    trackers = {i: BlockEncoder(KvEventWriter(CODEC), ParentTracker(capacity)) for i in INSTANCES}
    publishers = {i: Publisher(i, 0, publisher_epoch=1767225600000) for i in INSTANCES}
    seqs = {i: itertools.count() for i in INSTANCES}
    gpu_stored: dict[str, set] = {i: set() for i in INSTANCES}
    entries: dict[str, dict | None] = {}
    index = FleetIndex(default_block_size=BLOCK, table=table_class())
    stats = ApplyStats()

    def send(instance: str, event: dict) -> None:
        for _, value in trackers[instance].encode_event(publishers[instance], next(seqs[instance]), 1.0, 0, event):
            record = CODEC.decode(value)
            key = residency_key(record["event"][1]["ownership"], record["block_hash"])
            entry, _, _ = apply_block_event(entries.get(key), record, NO_CLEAR, NO_CLEAR, DEFAULT_CLEAR_TIERS, stats)
            entries[key] = entry
            index.apply_entry(key, entry)

    for kind, instance, which, start, span, (medium, ownership), with_tokens, said_parent in operations:
        tokens, (lora, salt) = requests[which % len(requests)]
        gpu = _gpu_store(tokens, lora, salt)
        count = len(gpu["block_hashes"])
        first = min(start, count - 1)
        last = min(first + span, count - 1)
        if kind == "gpu":
            event = _gpu_store(tokens, lora, salt, start=first)
            gpu_stored[instance].update(event["block_hashes"])
        elif kind == "offload":
            event = _offload_store(gpu, first, last, medium, ownership, tokens=with_tokens or exact)
            if exact and not set(event["block_hashes"]) <= gpu_stored[instance]:
                send(instance, gpu)
                gpu_stored[instance].update(gpu["block_hashes"])
            if not exact and not said_parent:
                event["parent_block_hash"] = None
        else:
            event = {"type": "BlockRemoved", "block_hashes": gpu["block_hashes"][first:last + 1],
                     "medium": "GPU" if with_tokens else medium, "group_idx": 0,
                     **({"ownership": ownership} if ownership and not with_tokens else {})}
        send(instance, event)
    return index


def _answers(index, tokens, lora, salt):
    chain = engine_block_hashes(PROFILE, tokens, BLOCK, lora, salt)
    return (index.query_tokens(tokens, block_size=BLOCK, lora_name=lora, cache_salt=salt),
            index.query_hashes(chain))


@pytest.mark.parametrize("table", ["python", "compiled"])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fleet=_fleet(exact=True))
def test_a_token_query_equals_the_hash_query_of_its_namespace(table, fleet):
    """Over random fleets with salts, LoRA adapters and offload tiers: a query by tokens with a LoRA name and a salt
    names exactly what the query by the engine hashes of those tokens, adapter and salt names, tier by tier. The
    engine hashes are the namespace: equal tokens under another salt or adapter are other blocks, so no salted or LoRA
    block answers a query of another namespace, on any tier or ownership."""
    from stream_apps.index import table as tables

    table_class = tables.PyBlockTable if table == "python" else tables.CompiledBlockTable
    if table_class is None:
        pytest.skip("stream_apps/index/_table.pyx is not built")
    requests, operations, exact = fleet
    index = _run_fleet(requests, operations, exact, table_class, capacity=200_000)
    for tokens, _ in requests:
        for lora, salt in NAMESPACES:
            by_tokens, by_hashes = _answers(index, tokens, lora, salt)
            assert by_tokens == by_hashes, (lora, salt)


@pytest.mark.parametrize("table", ["python", "compiled"])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fleet=_fleet(exact=False), capacity=st.sampled_from((1, 3, 200_000)))
def test_a_token_query_never_names_more_than_the_hash_query_of_its_namespace(table, fleet, capacity):
    """Whatever the offload stores say (tokenless placeholders, no parent, blocks the engine never stored on its GPU)
    and however little the producer remembers: a query by tokens may find fewer blocks than the engine hashes hold,
    never more, on any tier. Content it does not know is no content, never another namespace's."""
    from stream_apps.index import table as tables

    table_class = tables.PyBlockTable if table == "python" else tables.CompiledBlockTable
    if table_class is None:
        pytest.skip("stream_apps/index/_table.pyx is not built")
    requests, operations, exact = fleet
    index = _run_fleet(requests, operations, exact, table_class, capacity)
    for tokens, _ in requests:
        for lora, salt in NAMESPACES:
            by_tokens, by_hashes = _answers(index, tokens, lora, salt)
            for instance, answer in by_tokens["instances"].items():
                held = by_hashes["instances"].get(instance)
                assert held is not None, (instance, lora, salt)
                for tier_class in ("longest_matched", "GPU", "CPU", "DISK"):
                    assert answer[tier_class] <= held[tier_class], (instance, tier_class, lora, salt)
                for rank, tokens_matched in answer["DP"].items():
                    assert tokens_matched <= held["DP"][rank]
