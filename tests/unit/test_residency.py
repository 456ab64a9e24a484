"""Residency semantics as plain functions (stream_apps.residency), without Kafka."""

from __future__ import annotations

import itertools
import random

import pytest

from producers.split import Publisher, split_event
from schemas.clear_position import NO_CLEAR
from stream_apps.residency import (
    DEFAULT_CLEAR_TIERS,
    ApplyStats,
    aggregate_copies,
    apply_block_event,
    apply_clear,
    residency_key,
)

_seq = itertools.count()


def _store(block: int, publisher: Publisher, medium="GPU", ownership=None, seq=None):
    event = {"type": "BlockStored", "block_hashes": [block], "parent_block_hash": None, "token_ids": [],
             "block_size": 16, "lora_id": None, "medium": medium, "lora_name": None, "group_idx": 0}
    if ownership:
        event["ownership"] = ownership
    return split_event(publisher, next(_seq) if seq is None else seq, 1.0, 0, event)[0]


def _remove(block: int, publisher: Publisher, medium="GPU", seq=None):
    event = {"type": "BlockRemoved", "block_hashes": [block], "medium": medium, "group_idx": 0}
    return split_event(publisher, next(_seq) if seq is None else seq, 2.0, 0, event)[0]


def _apply(entry, records, stats=None, mark=NO_CLEAR, watermark=NO_CLEAR):
    stats = stats or ApplyStats()
    for record in records:
        entry, _, _ = apply_block_event(entry, record, mark, watermark, DEFAULT_CLEAR_TIERS, stats)
    return entry


def _copies(entry):
    return sorted((r["instance_id"], r["tier"], r["copies"]) for r in entry["rows"]) if entry else []


ENGINE = Publisher("e1")
W0 = Publisher("tp", worker_rank=0, world_size=2, aggregation="REPLICATED")
W1 = Publisher("tp", worker_rank=1, world_size=2, aggregation="REPLICATED")


def test_replicated_block_needs_every_worker_and_one_workers_duplicate_is_not_agreement():
    assert _copies(_apply(None, [_store(0x11, W0), _store(0x11, W0)])) == [("tp", "GPU", 0)]
    entry = _apply(None, [_store(0x22, W0), _store(0x22, W0), _store(0x22, W1)])
    assert _copies(entry) == [("tp", "GPU", 1)]


def test_sharded_block_counts_any_workers_report():
    s0 = Publisher("sh", worker_rank=0, world_size=2, aggregation="SHARDED")
    assert _copies(_apply(None, [_store(0x33, s0)])) == [("sh", "GPU", 1)]
    assert aggregate_copies([{"worker_rank": 0, "count": 2}, {"worker_rank": 1, "count": 1}], 2, "SHARDED") == 3


def test_reference_counting_keeps_a_block_until_its_last_copy_is_removed():
    stats = ApplyStats()
    entry = _apply(None, [_store(0xA3, ENGINE), _store(0xA3, ENGINE), _remove(0xA3, ENGINE)], stats)
    assert _copies(entry) == [("e1", "GPU", 1)]
    assert _apply(entry, [_remove(0xA3, ENGINE)], stats) is None
    assert stats.stopped_resident == 1 and stats.became_resident == 1


FULL = Publisher("e1", report_mode="full")


def _run(publisher: Publisher, events: list[dict]) -> list[dict]:
    """The records of engine events published at seqs 0, 1, ... (one event per batch)."""
    return [r for seq, event in enumerate(events) for r in split_event(publisher, seq, 1.0 + seq, 0, event)]


_STORED_H1_H2 = {"type": "BlockStored", "block_hashes": [0xF1, 0xF2], "parent_block_hash": None,
                 "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
_REMOVED_H1_H2 = {"type": "BlockRemoved", "block_hashes": [0xF1, 0xF2], "medium": "GPU"}


def test_a_full_mode_reuse_report_is_an_announcement_and_the_one_removal_empties_the_rows():
    """Issue 26's example: seq 0 stores [h1, h2], seq 1 repeats it (a reuse report), seq 2 removes both."""
    stats = ApplyStats()
    records = _run(FULL, [_STORED_H1_H2, _STORED_H1_H2, _REMOVED_H1_H2])
    assert {r["event"][1].get("report_mode") for r in records[:4]} == {"full"}
    entries = {}
    for record in records[:4]:  # the two stores
        key = record["block_hash"]
        entries[key] = _apply(entries.get(key), [record], stats)
    assert [_copies(e) for e in entries.values()] == [[("e1", "GPU", 1)]] * 2
    assert stats.reuse_reports == 2 and stats.duplicates == 0
    for record in records[4:]:  # the removal
        key = record["block_hash"]
        entries[key] = _apply(entries[key], [record], stats)
    assert entries == {(0xF1).to_bytes(8, "big"): None, (0xF2).to_bytes(8, "big"): None}


def test_in_the_default_mode_a_repeated_store_is_a_second_copy():
    stats = ApplyStats()
    records = _run(ENGINE, [_STORED_H1_H2, _STORED_H1_H2, _REMOVED_H1_H2])
    assert {r["event"][1].get("report_mode") for r in records} == {None}
    entry = _apply(None, [r for r in records if r["block_hash"] == (0xF1).to_bytes(8, "big")], stats)
    assert _copies(entry) == [("e1", "GPU", 1)] and stats.reuse_reports == 0


def test_a_full_mode_store_after_the_removal_stores_again_and_a_redelivered_report_is_a_duplicate():
    stats = ApplyStats()
    stored, again, removed, stored_later = (r for r in _run(FULL, [_STORED_H1_H2, _STORED_H1_H2, _REMOVED_H1_H2,
                                                                   _STORED_H1_H2])
                                            if r["block_hash"] == (0xF1).to_bytes(8, "big"))
    entry = _apply(None, [stored, again, again], stats)
    assert _copies(entry) == [("e1", "GPU", 1)] and stats.reuse_reports == 1 and stats.duplicates == 1
    assert _apply(entry, [removed], stats) is None
    assert _copies(_apply(None, [stored_later], stats)) == [("e1", "GPU", 1)]


def test_removal_of_an_unknown_block_is_counted_not_applied_below_zero():
    stats = ApplyStats()
    assert _apply(None, [_remove(0xB1, ENGINE)], stats) is None
    entry = _apply(None, [_store(0xB1, ENGINE), _remove(0xB1, ENGINE), _remove(0xB1, ENGINE)], stats)
    assert entry is None and stats.unknown_removals == 2


def test_redelivered_events_change_nothing():
    stored = _store(0xC1, ENGINE)
    stats = ApplyStats()
    entry = _apply(None, [stored, stored, stored], stats)
    assert _copies(entry) == [("e1", "GPU", 1)] and stats.duplicates == 2
    stored_again, removed = _store(0xC1, ENGINE), _remove(0xC1, ENGINE)
    entry = _apply(entry, [stored_again, removed, removed, stored], stats)
    assert _copies(entry) == [("e1", "GPU", 1)] and stats.duplicates == 4


def test_tiers_and_instances_are_separate_rows():
    e2 = Publisher("e2")
    entry = _apply(None, [_store(0xD1, ENGINE), _store(0xD1, e2), _store(0xD1, ENGINE, medium="cpu")])
    assert _copies(entry) == [("e1", "CPU", 1), ("e1", "GPU", 1), ("e2", "GPU", 1)]


def test_clear_removes_the_sources_gpu_rows_older_than_the_clear_and_keeps_offloaded_copies():
    e2 = Publisher("e2")
    entry = _apply(None, [_store(0xE1, ENGINE), _store(0xE1, e2), _store(0xE1, ENGINE, medium="CPU")])
    clear = (0, 100, 0)
    entry, removed, changed = apply_clear(entry, "e1", 0, clear, DEFAULT_CLEAR_TIERS, ApplyStats())
    assert _copies(entry) == [("e1", "CPU", 1), ("e2", "GPU", 1)] and len(removed) == 1 and changed


def test_clear_that_arrives_after_newer_events_only_wipes_what_came_before_it():
    """Two stores before the clear, one after; the clear's copy reaches this partition last."""
    clear = (0, 50, 0)
    entry = _apply(None, [_store(0xF1, ENGINE, seq=10), _store(0xF1, ENGINE, seq=11)])
    entry = _apply(entry, [_store(0xF1, ENGINE, seq=60)], mark=clear)  # stamped: a clear came before it
    assert _copies(entry) == [("e1", "GPU", 1)]
    entry, removed, changed = apply_clear(entry, "e1", 0, clear, DEFAULT_CLEAR_TIERS, ApplyStats())
    assert _copies(entry) == [("e1", "GPU", 1)] and removed == [] and not changed
    assert _apply(entry, [_remove(0xF1, ENGINE, seq=61)], mark=clear) is None


def test_resident_counts_stay_balanced_when_a_store_after_a_clear_overtakes_the_clears_copy():
    """Found by the pipeline test: a resident row, then a store stamped with a clear that has not reached this
    partition yet. The clear emptied the row and the store refilled it: still one resident row, so the change
    is 0, not +1 (the clear's copy will find the row newer than itself and report nothing either)."""
    clear = (0, 50, 0)
    stats = ApplyStats()
    entry, delta, _ = apply_block_event(None, _store(0xF3, ENGINE, seq=10), NO_CLEAR, NO_CLEAR,
                                        DEFAULT_CLEAR_TIERS, stats)
    assert delta == 1
    entry, delta, copies = apply_block_event(entry, _store(0xF3, ENGINE, seq=60), clear, NO_CLEAR,
                                             DEFAULT_CLEAR_TIERS, stats)
    assert (delta, copies) == (0, 1) and entry["rows"][0]["since"] == 1.0
    entry, removed, _ = apply_clear(entry, "e1", 0, clear, DEFAULT_CLEAR_TIERS, stats)
    assert removed == [] and _copies(entry) == [("e1", "GPU", 1)]
    entry, delta, _ = apply_block_event(entry, _remove(0xF3, ENGINE, seq=61), clear, clear, DEFAULT_CLEAR_TIERS, stats)
    assert entry is None and delta == -1
    assert stats.became_resident - stats.stopped_resident == 0


def test_events_older_than_an_applied_clear_are_ignored_in_its_scope():
    clear = (0, 50, 0)
    stats = ApplyStats()
    entry = _apply(None, [_store(0xF2, ENGINE, seq=10)], stats, watermark=clear)
    assert entry is None and stats.cleared_late == 1
    entry = _apply(None, [_store(0xF2, ENGINE, medium="CPU", seq=11)], stats, watermark=clear)
    assert _copies(entry) == [("e1", "CPU", 1)]


def test_residency_key_separates_ownerships():
    assert residency_key(None, b"\x01\x02") == "primary/0102"
    assert residency_key("kvcr", b"\x01\x02") == "kvcr/0102"


def test_a_newer_epoch_restarts_a_workers_count_and_retire_epoch_zeroes_untouched_rows():
    from dataclasses import replace

    from stream_apps.residency import retire_epoch

    old, new = replace(ENGINE, publisher_epoch=1), replace(ENGINE, publisher_epoch=2)
    touched = _apply(None, [_store(0x71, old), _store(0x71, old)])
    touched = _apply(touched, [_store(0x71, new, seq=0)])  # the restarted engine cached it again: one copy
    assert _copies(touched) == [("e1", "GPU", 1)]
    untouched = _apply(None, [_store(0x72, old), _store(0x72, old, medium="CPU")])
    stats = ApplyStats()
    entry, stopped, changed = retire_epoch(untouched, "e1", 0, None, 2, stats)
    assert entry is None and len(stopped) == 2 and changed
    entry, stopped, changed = retire_epoch(touched, "e1", 0, None, 2, stats)
    assert _copies(entry) == [("e1", "GPU", 1)] and stopped == [] and not changed


def test_prefix_match_weights_tiers_and_stops_at_the_first_missing_block():
    from stream_apps.index.scoring import HolderInfo, prefix_match_rows, prefix_runs
    from stream_apps.residency import DEFAULT_TIER_WEIGHTS, parse_tier_weights

    holders = [HolderInfo("a", 0, "GPU", None), HolderInfo("b", 0, "CPU", None), HolderInfo("a", 0, "CPU", None),
               HolderInfo("b", 0, "STORAGE", None)]
    blocks = [(0, 1), (2, 1), (3,), ()]
    result = prefix_match_rows(prefix_runs(blocks, holders, DEFAULT_TIER_WEIGHTS))
    assert result == [
        {"instance_id": "b", "data_parallel_rank": 0, "matched_blocks": 3,
         "prefix_blocks": {"CPU": 2}, "score": 2.1},
        {"instance_id": "a", "data_parallel_rank": 0, "matched_blocks": 2,
         "prefix_blocks": {"GPU": 1}, "score": 1.8},
    ]
    assert parse_tier_weights("gpu=2,EXTERNAL=0.1") == {"GPU": 2.0, "CPU": 0.8, "STORAGE": 0.5, "EXTERNAL": 0.1}


def test_rekeying_by_ownership_spreads_one_ownership_over_every_partition():
    """A key of ownership alone would put every kvcr event on one partition; ownership + hash spreads them."""
    import random

    from producers.simulator import block_hash_of
    from stream_apps.residency import key_partition

    partitions = 8
    counts = [0] * partitions
    for block in random.Random(11).sample(range(10**6), 20000):
        counts[key_partition(residency_key("kvcr", block_hash_of(block).to_bytes(8, "big")), partitions)] += 1
    even = 20000 / partitions
    assert min(counts) > 0 and max(counts) <= 2 * even


def test_key_partition_is_kafkas_murmur2_partition():
    """Kafka's own murmur2 test vectors (UtilsTest.testMurmur2, as signed 32-bit ints) and aiokafka's pure-Python
    murmur2 (what Faust's router uses) on random keys: the compiled hash gives the same partitions."""
    import random

    from aiokafka.partitioner import murmur2

    from stream_apps.residency import key_partition

    kafka_vectors = {"21": -973932308, "foobar": -790332482, "a-little-bit-long-string": -985981536,
                     "a-little-bit-longer-string": -1486304829, "abc": 479470107,
                     "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971}
    for key, signed_hash in kafka_vectors.items():
        assert key_partition(key, 2**31) == signed_hash & 0x7FFFFFFF  # "positive", then % partitions
    rng = random.Random(5)
    for _ in range(5000):
        key = "".join(rng.choice("0123456789abcdef/kvcrprimaéß") for _ in range(rng.randrange(0, 80)))
        for partitions in (1, 3, 8, 12):
            assert key_partition(key, partitions) == (murmur2(key.encode()) & 0x7FFFFFFF) % partitions


@pytest.mark.parametrize("implementation", ["python", "compiled"])
def test_block_key_is_the_residency_key_and_its_partition(implementation):
    """The repartition stage's (partition, key) of a block event, by the Python twin and the compiled one
    (schemas._hotpath.block_key): the UTF-8 residency key and its murmur2 partition, for every ownership (the
    empty one is the framework's own, as None) and block hashes of every length (murmur2's tail cases)."""
    from stream_apps.residency import block_key, key_partition
    from tests.conftest import hotpath_module

    key_of = block_key if implementation == "python" else hotpath_module("compiled").block_key
    rng = random.Random(3)
    for _ in range(3000):
        ownership = rng.choice([None, "", "kvcr", "ö-tier", "x" * 40])
        block_hash = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 41)))
        partitions = rng.choice([1, 3, 8, 2**31 - 1])
        key = residency_key(ownership, block_hash)
        assert key_of(ownership, block_hash, partitions) == (key_partition(key, partitions), key.encode())
    assert key_of("", b"\x01\x02", 8)[1] == b"primary/0102"


def test_source_settings_parse_clear_scopes_and_aggregation_per_instance():
    import pytest

    from stream_apps.residency import ALL_TIERS, SourceSettings

    settings = SourceSettings.parse("gpu,engine-7=all", "engine-3=2:sharded,engine-4=3")
    assert settings.clear_tiers("engine-7") == ALL_TIERS and settings.clear_tiers("x") == DEFAULT_CLEAR_TIERS
    assert settings.aggregation == {"engine-3": (2, "SHARDED"), "engine-4": (3, "REPLICATED")}
    for bad in ({"clear_scope": "some"}, {"aggregation": "engine=0"}, {"aggregation": "engine=2:avg"}):
        with pytest.raises(ValueError):
            SourceSettings.parse(**bad)


def test_configured_aggregation_applies_when_events_declare_none():
    """Workers publishing without world_size in the envelope: the configuration makes them agree."""
    w0, w1 = Publisher("cfg", worker_rank=0), Publisher("cfg", worker_rank=1)
    stats = ApplyStats()
    entry = None
    for record in (_store(0x91, w0), _store(0x91, w0)):
        entry, _, _ = apply_block_event(entry, record, NO_CLEAR, NO_CLEAR, DEFAULT_CLEAR_TIERS, stats,
                                        (2, "REPLICATED"))
    assert _copies(entry) == [("cfg", "GPU", 0)]
    entry, _, _ = apply_block_event(entry, _store(0x91, w1), NO_CLEAR, NO_CLEAR, DEFAULT_CLEAR_TIERS, stats,
                                    (2, "REPLICATED"))
    assert _copies(entry) == [("cfg", "GPU", 1)]


def test_each_worker_keeps_its_own_count_and_a_row_goes_only_when_every_count_is_zero():
    """A row of several workers: an event updates its own worker's count (found among the others, whatever
    their order), copies follow the mode, and the row stays while any worker still has a count."""
    s0, s1, s2 = (Publisher("sh", worker_rank=rank, world_size=3, aggregation="SHARDED") for rank in range(3))
    stats = ApplyStats()
    entry = _apply(None, [_store(0xD1, s2), _store(0xD1, s1), _store(0xD1, s1), _store(0xD1, s0)], stats)
    counts = lambda e: {w["worker_rank"]: w["count"] for w in e["rows"][0]["workers"]}  # noqa: E731
    assert counts(entry) == {2: 1, 1: 2, 0: 1} and _copies(entry) == [("sh", "GPU", 4)]
    entry = _apply(entry, [_remove(0xD1, s1), _remove(0xD1, s2), _remove(0xD1, s0)], stats)
    assert counts(entry) == {2: 0, 1: 1, 0: 0} and _copies(entry) == [("sh", "GPU", 1)]
    assert _apply(entry, [_remove(0xD1, s1)], stats) is None
    assert stats.stopped_resident == 1 and stats.unknown_removals == 0
    # one worker (world size 1): copies is its count, and ranks -1 and 0 are different workers
    assert aggregate_copies([{"worker_rank": -1, "count": 2}], 1, "REPLICATED") == 2
    assert aggregate_copies([{"worker_rank": -1, "count": 2}, {"worker_rank": 0, "count": 1}], 1, "REPLICATED") == 3
    assert aggregate_copies([], 1, "REPLICATED") == 0


def _with(record: dict, **fields) -> dict:
    kind, body = record["event"]
    return {**record, "event": (kind, {**body, **fields})}


def test_replicated_workers_must_agree_on_every_content_field():
    from stream_apps.residency import AGREEMENT_FIELDS

    assert "parent_known" not in AGREEMENT_FIELDS  # the producer's own view, not the engine's content
    for number, name in enumerate(AGREEMENT_FIELDS):
        block = 0x5A00 + number
        stats = ApplyStats()
        rank0 = _store(block, W0)
        value = rank0["event"][1][name]
        different = ([7] if isinstance(value, list) else 7 if name == "content_hash"
                     else "other" if isinstance(value, str) or value is None else 7)
        entry = _apply(None, [rank0, _with(_store(block, W1), **{name: different})], stats)
        assert _copies(entry) == [("tp", "GPU", 0)], name
        assert stats.replica_disagreements == 1, name
        # rank 1 drops its block and stores what rank 0 holds: agreement, resident
        entry = _apply(entry, [_remove(block, W1), _store(block, W1)], stats)
        assert _copies(entry) == [("tp", "GPU", 1)], name
        assert stats.replica_disagreements == 1, name


def test_content_is_compared_only_where_replicated_workers_aggregate():
    stats = ApplyStats()
    s0 = Publisher("sh", worker_rank=0, world_size=2, aggregation="SHARDED")
    s1 = Publisher("sh", worker_rank=1, world_size=2, aggregation="SHARDED")
    entry = _apply(None, [_with(_store(0x5B, s0), lora_name="a"), _with(_store(0x5B, s1), lora_name="b")], stats)
    assert _copies(entry) == [("sh", "GPU", 2)] and stats.replica_disagreements == 0
    assert all(worker["content"] is None for worker in entry["rows"][0]["workers"])
    # one engine publishing for its workers (world size 1): a re-store with new content simply counts
    entry = _apply(None, [_with(_store(0x5C, ENGINE), lora_name="a"), _with(_store(0x5C, ENGINE), lora_name="b")],
                   stats)
    assert _copies(entry) == [("e1", "GPU", 2)] and stats.replica_disagreements == 0


# --------------------------------------------------------------------------- content keys (residency v3)

def _with_tokens(record: dict, tokens: list[int], parent: bytes | None = None) -> dict:
    """A store with tokens, and the content hash the producer gives them (kv_event v4)."""
    from schemas.content_hash import content_hash

    return _with(record, token_ids=tokens, content_hash=content_hash(tokens), parent_block_hash=parent)


def _content_keys(entry) -> tuple:
    return entry["parent_block_hash"], entry["content_hash"]


def test_a_store_with_a_content_hash_gives_the_entry_its_content_keys_and_a_tokenless_one_keeps_them():
    """The entry's content keys come from the latest applied store that has a content hash: a CPU copy stored
    without tokens (an offload placeholder) keeps them, also once the GPU copy that gave them is gone."""
    from schemas.content_hash import content_hash

    parent = (0x70).to_bytes(8, "big")
    gpu = _with_tokens(_store(0x71, ENGINE), [1, 2, 3], parent)
    entry = _apply(None, [gpu])
    assert _content_keys(entry) == (parent, content_hash([1, 2, 3]))
    entry = _apply(entry, [_store(0x71, ENGINE, medium="CPU")])  # tokenless: content_hash null
    assert _content_keys(entry) == (parent, content_hash([1, 2, 3]))
    entry = _apply(entry, [_remove(0x71, ENGINE)])
    assert _copies(entry) == [("e1", "CPU", 1)] and _content_keys(entry) == (parent, content_hash([1, 2, 3]))
    # a later store with content sets them again: here the first block of a chain, whose parent is null
    entry = _apply(entry, [_with_tokens(_store(0x71, Publisher("e2")), [4, 5])])
    assert _content_keys(entry) == (None, content_hash([4, 5]))
    assert _apply(entry, [_remove(0x71, ENGINE, "CPU"), _remove(0x71, Publisher("e2"))]) is None


def test_an_entry_stored_only_without_tokens_has_no_content_keys_and_removals_never_set_them():
    entry = _apply(None, [_store(0x72, ENGINE, medium="CPU"), _store(0x72, ENGINE)])
    assert _content_keys(entry) == (None, None)
    assert _content_keys(_apply(entry, [_remove(0x72, ENGINE)])) == (None, None)


def test_a_store_that_is_not_applied_does_not_change_the_content_keys():
    from schemas.content_hash import content_hash

    first = _with_tokens(_store(0x73, ENGINE, seq=10), [1])
    entry = _apply(None, [first])
    late = _with_tokens(_store(0x73, ENGINE, seq=9), [2])  # older than the row's position: a redelivery
    stats = ApplyStats()
    entry = _apply(entry, [late], stats)
    assert stats.duplicates == 1 and _content_keys(entry) == (None, content_hash([1]))


def test_a_record_of_an_older_producer_gets_its_content_hash_from_its_tokens():
    """kv_event v3 had no content_hash: a record read with it null but with tokens gets the one its tokens and
    extra keys give (``b"\\xc0"``: vLLM's None entry, msgpack). A vLLM store without ``extra_keys`` does not say its
    extra keys (a salted or LoRA block's tokens alone are another namespace's content): it gets none."""
    from schemas.content_hash import content_hash

    old = _with(_store(0x74, ENGINE), token_ids=[9, 8, 7], extra_keys=b"\xc0", content_hash=None)
    assert _content_keys(_apply(None, [old])) == (None, content_hash([9, 8, 7]))
    unsaid = _with(_store(0x75, ENGINE), token_ids=[9, 8, 7], content_hash=None)
    assert _content_keys(_apply(None, [unsaid])) == (None, None)


def test_the_compiled_text_of_a_content_digest_is_the_repr_it_stands_for():
    """schemas._hotpath.repr_utf8, the text content_digest hashes: ``repr(values).encode()`` byte for byte, on
    tuples of every value an agreement field holds and of what it does not (big ints, bools and floats in a
    list, nested lists, one-tuples), so the digest stays the one every worker version wrote."""
    from tests.conftest import hotpath_module

    repr_utf8 = hotpath_module("compiled").repr_utf8
    rng = random.Random(9)
    ints = [0, 1, -1, 9, 10, 2**63 - 1, -2**63, 2**63, -2**63 - 1, 2**80, 123456789]
    atoms = [None, True, 0.5, float("nan"), "", "it's", 'q"uote', "é\n\x00\ud800", b"", b"\x00'\xff", b'"',
             *ints]

    def value(depth=0):
        if depth < 2 and rng.random() < 0.4:
            return [rng.choice(ints) if rng.random() < 0.8 else value(depth + 1)
                    for _ in range(rng.choice([0, 1, 3, 512]))]
        return rng.choice(atoms)

    cases = [(), (None,), ([],), ([1, 2],), tuple(range(13))]
    cases += [tuple(value() for _ in range(rng.randrange(0, 15))) for _ in range(300)]
    for values in cases:
        assert repr_utf8(values) == repr(values).encode(), values


@pytest.mark.usefixtures("hotpath")
def test_the_content_digest_of_a_store_is_the_one_workers_wrote_before_kv_event_v4():
    """Replicated workers compare digests kept in the changelog: a content hash its tokens give adds nothing, and
    leaves the digest what an older worker computed, so replicas whose stores straddle an upgrade still agree.
    A content hash given without tokens (the simulator's) is part of the content."""
    from hashlib import blake2b

    from stream_apps.residency import AGREEMENT_FIELDS, content_digest

    assert AGREEMENT_FIELDS[-1] == "content_hash"
    body = _with_tokens(_store(0x75, W0), [1, 2, 3], (0x74).to_bytes(8, "big"))["event"][1]
    before_v4 = tuple(body.get(name) for name in AGREEMENT_FIELDS[:-1])
    expected = int.from_bytes(blake2b(repr(before_v4).encode(), digest_size=8).digest(), "big", signed=True)
    assert content_digest(body) == content_digest({**body, "content_hash": None}) == expected
    given = {**body, "token_ids": [], "content_hash": 5}
    assert content_digest(given) != content_digest({**given, "content_hash": 6})
    assert content_digest(given) != content_digest({**given, "content_hash": None})


def test_replicated_workers_that_stored_different_content_hashes_disagree():
    stats = ApplyStats()
    entry = _apply(None, [_with(_store(0x76, W0), content_hash=5), _with(_store(0x76, W1), content_hash=6)], stats)
    assert _copies(entry) == [("tp", "GPU", 0)] and stats.replica_disagreements == 1
    entry = _apply(None, [_with(_store(0x77, W0), content_hash=5), _with(_store(0x77, W1), content_hash=5)], stats)
    assert _copies(entry) == [("tp", "GPU", 1)] and entry["content_hash"] == 5
