"""The fleet index without Kafka: entries in, answers out (stream_apps/index/), with both block tables."""

from __future__ import annotations

import array

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.content_hash import content_hash, query_extra_keys
from stream_apps.index.api import IndexAPI
from stream_apps.index.fleet_index import FleetIndex
from stream_apps.index.scoring import HolderInfo, instances_answer, prefix_runs

BLOCK = 4


def _answer_row(ranks: dict[str, tuple[int, int, int]]) -> dict:
    """An instance of ``/query``'s ``instances`` as the conductor's document words it, from each rank's ordered
    boundaries ``(gpu, cpu, disk)`` in tokens, with the older API's names beside (docs/querying.md)."""
    gpu, cpu, disk = (max((b[i] for b in ranks.values()), default=0) for i in range(3))
    dp = {rank: b[0] for rank, b in ranks.items()}
    return {"longest_matched": disk, "gpu": gpu, "cpu": cpu, "disk": disk, "dp": dp,
            "rank_matches": {rank: {"gpu": b[0], "cpu": b[1], "disk": b[2]} for rank, b in ranks.items()},
            "GPU": gpu, "CPU": cpu, "DISK": disk, "DP": dp}


@pytest.fixture(params=["python", "compiled"])
def index(request):
    from stream_apps.index import table

    cls = table.PyBlockTable if request.param == "python" else table.CompiledBlockTable
    if cls is None:
        pytest.skip("stream_apps/index/_table.pyx is not built")
    return FleetIndex(default_block_size=BLOCK, table=cls())


def _row(instance, tier, dp=0, copies=1):
    return {"instance_id": instance, "data_parallel_rank": dp, "tier": tier, "copies": copies}


def _entry(block_hash: bytes, rows, parent: bytes | None = None, content: int | None = None, ownership=None):
    return {"block_hash": block_hash, "ownership": ownership, "rows": rows, "parent_block_hash": parent,
            "content_hash": content}


def _key(block_hash: bytes, ownership=None) -> str:
    return f"{ownership or 'primary'}/{block_hash.hex()}"


def _store_chain(index, instance, tokens, seed: int, tier="GPU", lora=None, salt=None, ownership=None,
                 rows=None):
    """Entries as the workers write them for one vLLM-shaped BlockStored chain; returns the engine hashes."""
    hashes, parent = [], None
    for i in range(len(tokens) // BLOCK):
        block = tokens[i * BLOCK:(i + 1) * BLOCK]
        engine_hash = ((seed * 1_000_003 + i * 7919 + sum(block)) % (1 << 64)).to_bytes(8, "big")
        extra = query_extra_keys(i, lora, salt)  # what vLLM puts in the block's extra_keys
        index.apply_entry(_key(engine_hash, ownership), _entry(engine_hash, rows or [_row(instance, tier)], parent,
                                                               content_hash(block, extra), ownership))
        hashes.append(engine_hash)
        parent = engine_hash
    return hashes


TOKENS = list(range(100, 116))  # four blocks
PROFILE = {"strategy": "vllm_v1", "algorithm": "sha256_cbor", "python_hash_seed": "0", "index_projection": "low64_be"}


def _registration(instance: str, **fields) -> bytes:
    """A whole ``POST /register`` body (Mooncake's conductor requires every field), JSON; an endpoint of its own."""
    port = 20000 + sum(map(ord, instance)) * 7 % 10000
    return msgspec.json.encode({"endpoint": f"tcp://10.0.0.1:{port}", "type": "vLLM", "modelname": "m",
                                "instance_id": instance, "block_size": BLOCK, "dp_rank": 0, "hash_profile": PROFILE,
                                **fields})


def test_a_query_by_tokens_equals_the_query_by_engine_hashes(index):
    hashes = _store_chain(index, "e1", TOKENS, seed=1)
    by_tokens = index.query_tokens(TOKENS)
    assert by_tokens["instances"] == index.query_hashes(hashes)["instances"]
    assert by_tokens["instances"]["e1"] == _answer_row({"0": (16, 16, 16)})
    # a longer prompt matches its held prefix; a prompt diverging at block 2 matches two blocks
    assert index.query_tokens(TOKENS + [1] * 8)["instances"]["e1"]["longest_matched"] == 16
    assert index.query_tokens(TOKENS[:8] + [0] * 8)["instances"]["e1"]["longest_matched"] == 8


def test_lora_and_salt_change_the_keys_and_an_unused_salt_matches_nothing(index):
    _store_chain(index, "lora", TOKENS, seed=2, lora="adapter-1")
    _store_chain(index, "salted", TOKENS, seed=3, salt="tenant-1")
    assert set(index.query_tokens(TOKENS, lora_name="adapter-1")["instances"]) == {"lora"}
    assert set(index.query_tokens(TOKENS, cache_salt="tenant-1")["instances"]) == {"salted"}
    assert index.query_tokens(TOKENS, cache_salt="never-used")["instances"] == {}
    assert index.query_tokens(TOKENS)["instances"] == {}  # unsalted, no LoRA: neither


def test_a_tokenless_copy_of_another_ownership_inherits_the_content(index):
    hashes = _store_chain(index, "e1", TOKENS, seed=4)
    for h in hashes:  # the offload tier stores the blocks without tokens, under its ownership
        index.apply_entry(_key(h, "kvcr"), _entry(h, [_row("e1", "STORAGE")], ownership="kvcr"))
    for h in hashes:  # the GPU copies are evicted
        index.apply_entry(_key(h), None)
    answer = index.query_tokens(TOKENS)["instances"]["e1"]
    assert answer == _answer_row({"0": (0, 0, 16)})  # the walk misses on the GPU and in CPU memory, then reads disk


def test_equal_content_under_unequal_engine_hashes_is_found_and_counted(index):
    _store_chain(index, "seed-a", TOKENS, seed=5)
    _store_chain(index, "seed-b", TOKENS, seed=6)
    assert set(index.query_tokens(TOKENS)["instances"]) == {"seed-a", "seed-b"}
    stats = index.stats()
    assert stats["mixed_hash_queries"] == 1 and stats["mixed_hash_instances"] == [["seed-a", "seed-b"]]


def test_tier_boundaries_follow_the_load_order_and_ranks_apart(index):
    hashes = _store_chain(index, "e1", TOKENS, seed=7, rows=[_row("e1", "GPU"), _row("e1", "CPU", dp=1)])
    # block 2 leaves the GPU of rank 0 but is on its CPU; block 3 only on rank 1's CPU
    index.apply_entry(_key(hashes[2]), _entry(hashes[2], [_row("e1", "CPU"), _row("e1", "CPU", dp=1)]))
    index.apply_entry(_key(hashes[3]), _entry(hashes[3], [_row("e1", "CPU", dp=1)]))
    answer = index.query_tokens(TOKENS)["instances"]["e1"]
    # rank 0: GPU to block 2, then its CPU copy of block 2, then nothing; rank 1: CPU memory from block 0
    assert answer == _answer_row({"0": (8, 12, 12), "1": (0, 16, 16)})


def test_model_tenant_and_block_size_come_from_registration(index):
    _store_chain(index, "llama", TOKENS, seed=8)
    _store_chain(index, "qwen", TOKENS, seed=9)
    api = IndexAPI(index, list)
    for instance, model in (("llama", "llama-3"), ("qwen", "qwen-2")):
        reply = api.register(_registration(instance, modelname=model), "application/json")
        assert reply.status == 200
        assert msgspec.json.decode(reply.body) == {"status": "registered successfully", "instance_id": instance}
    assert set(index.query_tokens(TOKENS, model_name="llama-3")["instances"]) == {"llama"}
    assert set(index.query_tokens(TOKENS)["instances"]) == {"llama", "qwen"}
    assert index.query_tokens(TOKENS, tenant_id="other")["instances"] == {}
    assert index.query_tokens(TOKENS, block_size=8)["instances"] == {}  # other block size: other content keys


def test_query_speaks_msgpack_with_int32_token_bytes_as_mooncakes_proxy_sends(index):
    _store_chain(index, "e1", TOKENS, seed=10)
    api = IndexAPI(index, list)
    body = msgspec.msgpack.encode({"model": "m", "token_ids": array.array("i", TOKENS).tobytes(), "block_size": BLOCK,
                                   "tenant_id": "default", "lora_name": None})
    reply = api.query(body, "application/msgpack")
    assert reply.status == 200 and reply.content_type == "application/msgpack"
    assert msgspec.msgpack.decode(reply.body)["instances"]["e1"]["longest_matched"] == 16
    json_reply = api.query(msgspec.json.encode({"token_ids": TOKENS}), "application/json")
    assert msgspec.json.decode(json_reply.body)["instances"]["e1"]["longest_matched"] == 16


@pytest.mark.parametrize("body, reason", [
    (b"not json", "not JSON"),
    (b'{"token_ids": "abc"}', "token_ids"),
    (b'{"token_ids": [1, 2.5]}', "Expected `int`, got `float` - at `$.token_ids[1]`"),
    (b'{"token_ids": [1, 4294967296]}', "Expected `int` <= 4294967295"),
    (b'{"token_ids": [1], "block_size": 0}', "block_size"),
    (b'{"model": "m"}', "missing required field: token_ids"),
    (b"[1, 2]", "request body must be a map"),
])
def test_bad_queries_get_a_400_with_the_reason(index, body, reason):
    reply = IndexAPI(index, list).query(body, "application/json")
    assert reply.status == 400 and reason in msgspec.json.decode(reply.body)["error"]


def test_an_index_that_has_not_caught_up_answers_503_with_the_reason(index):
    reply = IndexAPI(index, lambda: ["catching up: 5 records to go"]).query(b'{"token_ids": [1]}', None)
    assert reply.status == 503 and "catching up" in msgspec.json.decode(reply.body)["error"]


def test_a_tombstone_removes_the_block_from_every_answer(index):
    hashes = _store_chain(index, "e1", TOKENS, seed=11)
    index.apply_entry(_key(hashes[0]), None)
    assert index.query_tokens(TOKENS)["instances"] == {}
    assert index.prefix_match(hashes) == []
    assert index.stats()["blocks"] == 3


def test_workers_and_dump_list_what_the_index_holds(index):
    hashes = _store_chain(index, "e1", TOKENS, seed=12)
    index.apply_entry(_key(hashes[0], "kvcr"), _entry(hashes[0], [_row("e1", "STORAGE")], ownership="kvcr"))
    [worker] = index.workers()
    assert worker["instance_id"] == "e1" and worker["blocks"] == {"GPU": 4, "STORAGE": 1}
    dumped = {d["block_hash"]: d for d in index.dump()}
    assert set(dumped) == {h.hex() for h in hashes}
    assert sorted(h["tier"] for h in dumped[hashes[0].hex()]["holders"]) == ["GPU", "STORAGE"]
    assert dumped[hashes[1].hex()]["parent_block_hash"] == hashes[0].hex()


def test_instances_answer_takes_the_best_rank_per_instance():
    holders = [HolderInfo("e1", 0, "GPU", None), HolderInfo("e1", 1, "CPU", None)]
    runs = prefix_runs([(0, 1), (1,)], holders, {"GPU": 1.0, "CPU": 0.8})
    answer = instances_answer(runs, lambda instance: 16)
    assert answer["instances"]["e1"] == _answer_row({"0": (16, 16, 16), "1": (0, 32, 32)})
    assert answer["scores"] == {"e1": {"0": 16, "1": 32}}


def test_a_source_whose_hashes_differ_from_its_declared_profile_is_flagged(index):
    from schemas.engine_hashes import HashProfile, engine_block_hashes

    profile = {"strategy": "vllm_v1", "algorithm": "sha256", "python_hash_seed": "0", "index_projection": "low64_be"}
    honest = engine_block_hashes(HashProfile.parse(profile), TOKENS, BLOCK)
    parent = None
    for i, engine_hash in enumerate(honest):  # "honest" publishes the hashes its profile gives
        block = TOKENS[i * BLOCK:(i + 1) * BLOCK]
        index.apply_entry(_key(engine_hash), _entry(engine_hash, [_row("honest", "GPU")], parent,
                                                    content_hash(block)))
        parent = engine_hash
    _store_chain(index, "liar", TOKENS, seed=13)  # declares the same profile but runs another seed
    api = IndexAPI(index, list)
    for instance in ("honest", "liar"):
        assert api.register(_registration(instance, hash_profile=profile), "application/json").status == 200
    assert set(index.query_tokens(TOKENS)["instances"]) == {"honest", "liar"}  # answers come from content keys
    flags = {w["instance_id"]: w["hash_profile_ok"] for w in index.workers()}
    assert flags == {"honest": True, "liar": False}
    bad = _registration("x", hash_profile={"strategy": "vllm_v1", "algorithm": "md5"})
    reply = api.register(bad, "application/json")
    assert reply.status == 400 and "hash_profile" in msgspec.json.decode(reply.body)["error"]


# -- the table's scored lookups against the Python reference ---------------------------------------------------


def _reference_answers(index, chain, tokens, allowed=None):
    """prefix_match, query_hashes and query_tokens (block size BLOCK) as the index answered them before the table
    scored its walks: scoring.prefix_runs over holders_at and content_walk."""
    from schemas.content_hash import block_content_hashes
    from stream_apps.index.scoring import prefix_match_rows
    from stream_apps.index.table import block_key

    holders = [index.holder(i) for i in range(index.stats()["holders"])]
    by_hash = prefix_runs(index.holders_at(chain), holders, index.weights, allowed)
    contents = [c & ((1 << 64) - 1) for c in block_content_hashes(tokens, BLOCK)]
    by_tokens = prefix_runs(index._table.content_walk(contents), holders, index.weights, allowed)
    assert all(block_key(h) == int.from_bytes(h, "big") for h in chain)
    return (prefix_match_rows(by_hash), instances_answer(by_hash, index.sources.block_size),
            instances_answer(by_tokens, index.sources.block_size))


def _mixed_fleet(index):
    """Instances of two ranks, every tier, an ownership of offloaded copies, and a chain they diverge along."""
    hashes = _store_chain(index, "e1", TOKENS, seed=20, rows=[_row("e1", "GPU"), _row("e1", "CPU", dp=1),
                                                               _row("e2", "CPU"), _row("e2", "UNKNOWN", dp=1)])
    index.apply_entry(_key(hashes[2]), _entry(hashes[2], [_row("e1", "CPU"), _row("e2", "GPU", dp=1)]))
    index.apply_entry(_key(hashes[3]), _entry(hashes[3], [_row("e1", "CPU", dp=1), _row("e2", "CPU")]))
    for h in hashes[:3]:  # a secondary tier's copies of the first blocks, under its ownership
        index.apply_entry(_key(h, "kvcr"), _entry(h, [_row("e3", "STORAGE"), _row("e1", "EXTERNAL", dp=1)],
                                                  ownership="kvcr"))
    _store_chain(index, "e4", TOKENS[:8] + [7] * 8, seed=21, tier="STORAGE")
    return hashes


def test_answers_equal_the_python_scoring_of_the_walks(index):
    import json

    hashes = _mixed_fleet(index)
    for chain in (hashes, hashes[:2], hashes[1:], hashes + [b"\0" * 8], []):
        match, by_hash, by_tokens = _reference_answers(index, chain, TOKENS)
        answers = (index.prefix_match(chain), index.query_hashes(chain), index.query_tokens(TOKENS, block_size=BLOCK))
        # equal as JSON too: the same keys in the same order, the same ints and floats
        assert json.dumps(answers) == json.dumps((match, by_hash, by_tokens))
    e1_rank_1 = index.query_hashes(hashes)["kvstream"]["ranks"]["e1"]["1"]  # a gap on CPU at block 2, EXTERNAL there
    assert (e1_rank_1["matched_blocks"], e1_rank_1["prefix_blocks"]) == (4, {"CPU": 2, "EXTERNAL": 3})
    # registered instances: the model filter leaves the others out, the same in both
    api = IndexAPI(index, list)
    for instance, model in (("e1", "m1"), ("e2", "m2"), ("e3", "m1")):
        assert api.register(_registration(instance, modelname=model), "application/json").status == 200
    expected = _reference_answers(index, hashes, TOKENS, lambda info: info.instance_id in ("e1", "e3", "e4"))[1]
    assert index.query_hashes(hashes, model_name="m1") == expected
    assert set(expected["instances"]) == {"e1", "e3"}


def test_holders_added_later_and_a_cleared_table_are_scored(index):
    hashes = _store_chain(index, "e1", TOKENS, seed=22)
    assert [m["matched_blocks"] for m in index.prefix_match(hashes)] == [4]
    # new holders after a query (the entries now list e2 too): registered by the next query
    _store_chain(index, "e2", TOKENS, seed=22, rows=[_row("e1", "GPU"), _row("e2", "CPU")])
    assert [(m["instance_id"], m["prefix_blocks"]) for m in index.prefix_match(hashes)] == [
        ("e1", {"GPU": 4}), ("e2", {"CPU": 4})]
    index.clear()  # the table forgets its holders' metadata with its blocks: given again on the next query
    assert index.prefix_match(hashes) == []
    _store_chain(index, "e2", TOKENS, seed=22, rows=[_row("e2", "CPU"), _row("e2", "GPU", dp=3)])
    assert [(m["instance_id"], m["data_parallel_rank"], m["score"]) for m in index.prefix_match(hashes)] == [
        ("e2", 3, 4.0), ("e2", 0, 3.2)]


def test_a_tier_outside_the_canonical_five_is_scored_in_python(index):
    hashes = _store_chain(index, "e1", TOKENS, seed=23, rows=[_row("e1", "GPU"), _row("e1", "HBM")])
    answer = index.query_hashes(hashes)
    assert answer == _reference_answers(index, hashes, TOKENS)[1]
    assert answer["kvstream"]["ranks"]["e1"]["0"]["prefix_blocks"] == {"GPU": 4, "HBM": 4}
    assert index.prefix_match(hashes)[0]["prefix_blocks"] == {"GPU": 4, "HBM": 4}


def test_a_registration_filters_the_python_scoring_of_an_unknown_tier_too(index):
    from stream_apps.index.fleet_index import SourceInfo

    _store_chain(index, "e1", TOKENS, seed=24, rows=[_row("e1", "HBM")])
    _store_chain(index, "e2", TOKENS, seed=25)
    index.sources.register(SourceInfo("e1", model_name="llama-3"))
    assert set(index.query_tokens(TOKENS, model_name="llama-3")["instances"]) == {"e1", "e2"}  # e2: any model
    index.sources.register(SourceInfo("e2", model_name="qwen-2"))  # a registration changes the cached filter
    assert set(index.query_tokens(TOKENS, model_name="llama-3")["instances"]) == {"e1"}
    assert set(index.query_tokens(TOKENS, model_name="qwen-2")["instances"]) == {"e2"}
    index.sources.unregister("e1")
    assert set(index.query_tokens(TOKENS, model_name="qwen-2")["instances"]) == {"e1", "e2"}


def _prefix_match_rows_before(runs):
    """prefix_match_rows as it was written before it ranked tuples (the oracle of its rewrite)."""
    rows = [{"instance_id": instance, "data_parallel_rank": rank, "matched_blocks": run.any,
             "prefix_blocks": {tier: n for tier, n in sorted(run.tiers.items()) if n},
             "score": round(run.score, 6)}
            for (instance, rank), run in runs.items() if run.any]
    return sorted(rows, key=lambda r: (-r["score"], -r["matched_blocks"], r["instance_id"], r["data_parallel_rank"]))


def _instances_answer_by_words(runs, block_size_of):
    """instances_answer written from the conductor's document, instance by instance (the oracle of the rewrite):
    per rank its boundaries in tokens, the instance's the best rank's, ``dp`` each rank's GPU boundary."""
    instances, scores, detail = {}, {}, {}
    for (instance, rank), run in sorted(runs.items(), key=lambda item: item[0]):
        if not run.any:
            continue
        size = block_size_of(instance)
        gpu, cpu, disk = (blocks * size for blocks in run.classes)
        answer = instances.setdefault(instance, {"longest_matched": 0, "gpu": 0, "cpu": 0, "disk": 0, "dp": {},
                                                 "rank_matches": {}})
        answer["dp"][str(rank)] = gpu
        answer["rank_matches"][str(rank)] = {"gpu": gpu, "cpu": cpu, "disk": disk}
        for name, value in (("gpu", gpu), ("cpu", cpu), ("disk", disk), ("longest_matched", disk)):
            answer[name] = max(answer[name], value)
        scores.setdefault(instance, {})[str(rank)] = run.any * size
        detail.setdefault(instance, {})[str(rank)] = {
            "matched_blocks": run.any, "block_size": size,
            "prefix_blocks": {tier: n for tier, n in sorted(run.tiers.items()) if n}, "score": round(run.score, 6)}
    for answer in instances.values():
        answer.update(GPU=answer["gpu"], CPU=answer["cpu"], DISK=answer["disk"], DP=dict(answer["dp"]))
    return {"instances": instances, "scores": scores, "kvstream": {"ranks": detail}}


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(
    st.tuples(st.sampled_from(["a", "b", "c", "e10"]), st.integers(0, 3)),
    st.tuples(st.integers(0, 6), st.sampled_from([0.0, 1.0, 1.8, 2.3000001, 2.3000004, 0.25, -0.5]),
              st.dictionaries(st.sampled_from(["GPU", "CPU", "STORAGE", "EXTERNAL", "UNKNOWN"]), st.integers(0, 6)),
              st.lists(st.integers(0, 6), min_size=3, max_size=3)),
    max_size=8))
def test_the_answers_are_built_as_before(spec):
    import json

    from stream_apps.index.scoring import PrefixRun, prefix_match_rows

    runs = {key: PrefixRun(matched, score, dict(tiers), list(classes))
            for key, (matched, score, tiers, classes) in spec.items()}
    sizes = {"a": 16, "b": 512, "c": 1, "e10": 16}.__getitem__
    assert json.dumps(prefix_match_rows(runs)) == json.dumps(_prefix_match_rows_before(runs))
    assert instances_answer(runs, sizes) == _instances_answer_by_words(runs, sizes)
