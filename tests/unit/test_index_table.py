"""The fleet index's block table (stream_apps/index/table.py): its semantics, run against the pure-Python twin and
the compiled table (stream_apps/index/_table.pyx), and the two compared on random sequences of operations."""

from __future__ import annotations

import random

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.tiers import TIERS
from stream_apps.index import table as table_module
from stream_apps.index.scoring import HolderInfo, prefix_runs
from stream_apps.index.table import PyBlockTable, block_key
from tests.conftest import compiled_module

U64 = (1 << 64) - 1


def compiled_class():
    """The compiled table class; a table that was not built fails the test (tests/conftest.py's
    ``compiled_module``)."""
    return compiled_module("stream_apps.index._table", "stream_apps/index/_table.pyx").BlockTable


@pytest.fixture(params=("python", "compiled"))
def table_class(request):
    """Each test runs with both implementations."""
    return PyBlockTable if request.param == "python" else compiled_class()


@pytest.fixture
def table(table_class):
    return table_class()


# -- block keys --------------------------------------------------------------------------------------------


def test_block_key_of_an_8_byte_hash_is_big_endian():
    assert block_key(bytes.fromhex("0000000000000102")) == 0x0102
    assert block_key(b"\xff" * 8) == U64


def test_block_key_of_other_lengths_is_xxh3():
    digest = bytes(range(32))
    assert block_key(digest) == xxhash.xxh3_64_intdigest(digest)
    assert block_key(b"") == xxhash.xxh3_64_intdigest(b"")
    assert block_key(b"1234567") == xxhash.xxh3_64_intdigest(b"1234567")


def test_block_keys_is_block_key_of_each_hash():
    hashes = [bytes(range(8)), b"\xff" * 8, b"\x00" * 8, b"", b"1234567", bytes(range(32)), bytearray(b"abcdefgh"),
              memoryview(b"12345678"), bytearray(b"123456789")]
    expected = [block_key(h) for h in hashes]
    compiled = compiled_class()
    import stream_apps.index._table as compiled_module

    assert compiled is compiled_module.BlockTable
    for block_keys in (table_module._block_keys, compiled_module.block_keys, table_module.block_keys):
        assert block_keys(hashes) == expected
        assert block_keys(tuple(hashes)) == expected and block_keys(iter(hashes)) == expected
        assert block_keys([]) == []
        for bad in ([None], [b"12345678", 5]):
            with pytest.raises(TypeError):
                block_keys(bad)


def test_pure_python_variable_chooses_the_python_table(monkeypatch):
    monkeypatch.setenv("KVSTREAM_PURE_PYTHON", "1")
    assert table_module._compiled() is None
    monkeypatch.delenv("KVSTREAM_PURE_PYTHON")
    try:
        from stream_apps.index._table import BlockTable as built
    except ImportError:
        built = None
    assert table_module._compiled() is built
    assert table_module.BlockTable is (table_module.CompiledBlockTable or PyBlockTable)


# -- replace and holders_at ----------------------------------------------------------------------------------


def test_holders_at_stops_before_the_first_absent_block(table):
    table.replace(10, 0, [3, 1, 2], None, 100)
    table.replace(11, 0, [1], 10, 101)
    table.replace(13, 0, [1], 12, 103)
    assert table.holders_at([10, 11, 12, 13]) == [(1, 2, 3), (1,)]
    assert table.holders_at([12, 10]) == []
    assert table.holders_at([]) == []
    assert table.holders_at((13,)) == [(1,)]
    assert len(table) == 3
    assert table.links == 5


def test_holders_are_the_union_of_the_scopes_distinct_and_ascending(table):
    table.replace(5, 0, [7, 2], None, None)
    table.replace(5, 1, [2, 9, 2], None, None)  # repeats in the input count once
    assert table.holders_at([5]) == [(2, 7, 9)]
    assert table.links == 4  # (0, 2), (0, 7), (1, 2), (1, 9)
    table.replace(5, 0, [7], None, None)
    assert table.holders_at([5]) == [(2, 7, 9)]  # 2 still holds it in scope 1
    table.replace(5, 1, [], None, None)
    assert table.holders_at([5]) == [(7,)]
    assert table.links == 1


def test_replace_makes_the_holders_exactly_the_list(table):
    table.replace(1, 4, [1, 2, 3], None, None)
    table.replace(1, 4, [3, 4], None, None)
    assert table.holders_at([1]) == [(3, 4)]
    assert list(table.items()) == [(1, None, None, ((4, 3), (4, 4)))]


def test_the_last_holder_gone_removes_the_block(table):
    table.replace(1, 0, [1], None, 100)
    table.replace(1, 1, [2], None, None)
    table.replace(1, 0, [], None, None)
    assert len(table) == 1
    table.replace(1, 1, [], None, None)
    assert len(table) == 0 and table.links == 0
    assert table.holders_at([1]) == []
    assert list(table.items()) == []
    # the block comes back without what it had
    table.replace(1, 0, [1], None, None)
    assert list(table.items()) == [(1, None, None, ((0, 1),))]
    assert table.content_walk([100]) == []


def test_an_absent_block_given_no_holder_stays_absent(table):
    table.replace(1, 0, [], 7, 100)
    assert len(table) == 0
    assert table.content_walk([100]) == []


def test_parent_and_content_none_keep_what_the_block_has(table):
    table.replace(2, 0, [1], 1, 200)
    table.replace(2, 0, [1, 2], None, None)
    assert list(table.items()) == [(2, 1, 200, ((0, 1), (0, 2)))]
    table.replace(2, 1, [3], 9, None)  # overwrites the parent, keeps the content
    assert list(table.items()) == [(2, 9, 200, ((0, 1), (0, 2), (1, 3)))]
    table.replace(2, 1, [3], None, 201)
    assert list(table.items()) == [(2, 9, 201, ((0, 1), (0, 2), (1, 3)))]


def test_a_changed_content_moves_the_block_in_the_content_walk(table):
    table.replace(1, 0, [1], None, 100)
    table.replace(2, 0, [1], 1, 200)
    assert table.content_walk([100, 200]) == [(1,), (1,)]
    table.replace(2, 0, [1], None, 300)
    assert table.content_walk([100, 200]) == [(1,)]
    assert table.content_walk([100, 300]) == [(1,), (1,)]
    table.replace(2, 0, [1], 5, None)  # another parent: no longer under block 1
    assert table.content_walk([100, 300]) == [(1,)]
    table.replace(1, 0, [1], 0, None)  # block 1 gets a parent: no longer a root
    assert table.content_walk([100]) == []


def test_parent_zero_is_not_no_parent(table):
    table.replace(0, 0, [1], None, 100)
    table.replace(1, 0, [2], 0, 100)
    assert table.content_walk_blocks([100, 100, 100]) == [(0,), (1,)]


# -- content walk ------------------------------------------------------------------------------------------


def test_a_scope_without_content_inherits_the_blocks_content(table):
    # scope A (an engine) stores the block with its content; scope B (a tokenless offloading store) with none
    table.replace(1, 0, [1], None, 100)
    table.replace(2, 0, [1], 1, 200)
    table.replace(2, 1, [9], None, None)
    assert table.content_walk([100, 200]) == [(1,), (1, 9)]
    # scope A's holders go: the block stays, with its content, held by scope B's holders
    table.replace(2, 0, [], None, None)
    assert table.content_walk([100, 200]) == [(1,), (9,)]
    assert sorted(table.items()) == [(1, None, 100, ((0, 1),)), (2, 1, 200, ((1, 9),))]


def test_chains_of_equal_content_under_different_block_keys_are_all_followed(table):
    # two engines with different hash seeds: the same tokens, different block keys
    for seed, holder in ((1000, 1), (2000, 2)):
        table.replace(seed + 1, 0, [holder], None, 100)
        table.replace(seed + 2, 0, [holder], seed + 1, 200)
        table.replace(seed + 3, 0, [holder], seed + 2, 300)
    table.replace(2004, 0, [2], 2003, 400)  # only the second engine goes further
    assert table.content_walk([100, 200, 300, 400, 500]) == [(1, 2), (1, 2), (1, 2), (2,)]
    assert table.content_walk_blocks([100, 200, 300, 400]) == [(1001, 2001), (1002, 2002), (1003, 2003), (2004,)]
    assert table.content_mixed([100, 200, 300, 400]) and table.content_mixed([100])
    assert not table.content_mixed([999]) and not table.content_mixed([])
    table.replace(1001, 0, [], None, None)  # the first engine's chain now starts at its block 2, never reached
    assert not table.content_mixed([100, 200, 300, 400])
    table.replace(1001, 0, [1], None, 100)
    assert table.content_walk([200]) == []  # depth 0 starts at the roots only
    assert table.content_walk([]) == []
    # a chain that diverges in content
    assert table.content_walk([100, 999]) == [(1, 2)]


def test_equal_content_under_one_parent_and_a_block_in_several_scopes(table):
    table.replace(1, 0, [1], None, 100)
    table.replace(2, 0, [2], 1, 200)
    table.replace(3, 0, [3], 1, 200)  # e.g. another LoRA: same tokens hash, another block key
    table.replace(3, 1, [2, 4], None, None)
    assert table.content_walk_blocks([100, 200]) == [(1,), (2, 3)]
    assert table.content_walk([100, 200]) == [(1,), (2, 3, 4)]


def test_removing_the_last_holder_removes_the_block_from_the_content_walk(table):
    table.replace(1, 0, [1], None, 100)
    table.replace(2, 0, [1, 2], 1, 200)
    table.replace(3, 0, [2], 2, 300)
    assert table.content_walk([100, 200, 300]) == [(1,), (1, 2), (2,)]
    table.replace(2, 0, [2], None, None)
    assert table.content_walk([100, 200, 300]) == [(1,), (2,), (2,)]
    table.replace(2, 0, [], None, None)
    assert table.content_walk([100, 200, 300]) == [(1,)]
    assert table.content_walk_blocks([100, 200, 300]) == [(1,)]
    table.replace(1, 0, [], None, None)
    assert table.content_walk([100]) == []


# -- holders ------------------------------------------------------------------------------------------------


def test_holder_blocks_counts_blocks_not_links(table):
    assert table.holder_blocks(1) == 0
    table.replace(1, 0, [1, 2], None, None)
    table.replace(1, 1, [1], None, None)  # holder 1 in two scopes of block 1: one block
    table.replace(2, 0, [1], None, None)
    assert (table.holder_blocks(1), table.holder_blocks(2)) == (2, 1)
    table.replace(1, 0, [2], None, None)
    assert table.holder_blocks(1) == 2  # scope 1 still holds block 1 for it
    table.replace(1, 1, [], None, None)
    assert (table.holder_blocks(1), table.holder_blocks(2)) == (1, 1)
    table.replace(2, 0, [], None, None)
    assert table.holder_blocks(1) == 0


def test_remove_holder_drops_it_everywhere(table):
    table.replace(1, 0, [1, 2], None, 100)
    table.replace(1, 1, [1], None, None)
    table.replace(2, 0, [1], 1, 200)
    table.replace(3, 0, [2], 1, 300)
    assert table.remove_holder(1) == 2
    assert table.holder_blocks(1) == 0
    assert table.holder_blocks(2) == 2
    assert len(table) == 2 and table.links == 2
    assert sorted(table.items()) == [(1, None, 100, ((0, 2),)), (3, 1, 300, ((0, 2),))]
    assert table.content_walk([100, 200]) == [(2,)]
    assert table.remove_holder(1) == 0
    assert table.remove_holder(77) == 0
    assert table.holder_blocks(77) == 0
    table.replace(2, 0, [1], 1, 200)
    assert table.holder_blocks(1) == 1


def test_a_block_of_thousands_of_holders(table):
    holders = list(range(0, 6000, 2))
    for i in range(1, len(holders) + 1, 97):  # the entry grows a few holders at a time
        table.replace(1, 0, holders[:i], None, 100)
    table.replace(1, 0, holders, None, None)
    table.replace(1, 1, holders[::-1][:500], None, None)  # unsorted, in another scope
    assert table.holders_at([1]) == [tuple(holders)]
    assert table.links == len(holders) + 500
    assert table.holder_blocks(holders[-1]) == 1
    table.replace(1, 0, holders[1:], None, None)
    assert table.holder_blocks(0) == 0
    assert table.remove_holder(holders[-1]) == 1
    assert table.holders_at([1]) == [tuple(holders[1:-1])]
    table.replace(1, 0, [], None, None)
    assert table.holders_at([1]) == [tuple(holders[-500:-1])]
    assert table.content_walk([100]) == [tuple(holders[-500:-1])]


# -- scored lookups: chain_runs, content_runs -----------------------------------------------------------------

#: Tier indices (schemas.TIERS order) and the weights the scored tests use (FleetIndex's defaults, UNKNOWN and
#: EXTERNAL at scoring.OTHER_TIER_WEIGHT).
GPU, CPU, STORAGE, EXTERNAL, UNKNOWN = range(5)
WEIGHTS = (1.0, 0.8, 0.5, 0.25, 0.25)


def _runs_table(table):
    """Holders 0..5: group 0 = holders 0 (GPU), 1 (CPU), 2 (STORAGE); group 7 = holders 3 (GPU), 4 (UNKNOWN);
    group 9 = holder 5 (EXTERNAL). Chain 10, 11, 12, 13 (contents 100..103)."""
    for holder, group, tier in ((0, 0, GPU), (1, 0, CPU), (2, 0, STORAGE), (3, 7, GPU), (4, 7, UNKNOWN),
                                (5, 9, EXTERNAL)):
        table.set_holder(holder, group, tier)
    table.replace(10, 0, [0, 3, 4], None, 100)
    table.replace(11, 0, [1, 2, 3], 10, 101)
    table.replace(11, 1, [5], None, None)  # group 9 holds block 1 but not block 0: no run
    table.replace(12, 0, [2, 4], 11, 102)
    table.replace(13, 0, [0], 12, 103)
    return table


def test_chain_runs_per_group_tier_and_class(table):
    _runs_table(table)
    assert table.chain_runs([10, 11, 12, 13], WEIGHTS) == [
        # group 0: block 0 on GPU, 1 on CPU and STORAGE, 2 on STORAGE, 3 on GPU: any 4; GPU run 1 (a gap at 1),
        # CPU 0, STORAGE 0 (not at block 0); the ordered walk: GPU to 1, CPU to 2, disk to 3 (block 3 is on the
        # GPU only, which the disk phase does not go back to); score 1 + 0.8 + 0.5 + 1
        (0, 4, 3.3, (1, 0, 0, 0, 0), (1, 2, 3)),
        # group 7: GPU and UNKNOWN at 0, GPU at 1, UNKNOWN at 2, nothing at 3
        (7, 3, 2.25, (2, 0, 0, 0, 1), (2, 2, 2)),
    ]
    assert table.chain_runs([10, 11, 12, 13], WEIGHTS) == table.chain_runs((10, 11, 12, 13, 99), WEIGHTS)
    assert table.content_runs([100, 101, 102, 103], WEIGHTS) == table.chain_runs([10, 11, 12, 13], WEIGHTS)
    assert table.chain_runs([11, 12], WEIGHTS) == [(0, 2, 1.3, (0, 1, 2, 0, 0), (0, 1, 2)),
                                                  (7, 2, 1.25, (1, 0, 0, 0, 0), (1, 1, 1)),
                                                  (9, 1, 0.25, (0, 0, 0, 1, 0), (0, 0, 1))]
    assert table.chain_runs([], WEIGHTS) == [] and table.chain_runs([99, 10], WEIGHTS) == []
    assert table.content_runs([], WEIGHTS) == [] and table.content_runs([101], WEIGHTS) == []
    # the best weight per block, whatever the tiers' order; an unweighted tier can win
    assert table.chain_runs([10], (0.1, 0.2, 0.3, 0.4, 7.0))[1][2] == 7.0


def test_chain_runs_filters_by_holder(table):
    _runs_table(table)
    chain = [10, 11, 12, 13]
    refuse_gpu_0 = bytes([0, 1, 1, 1, 1, 1])
    # group 0 without holder 0 misses block 0; group 7 unchanged
    assert table.chain_runs(chain, WEIGHTS, refuse_gpu_0) == [(7, 3, 2.25, (2, 0, 0, 0, 1), (2, 2, 2))]
    assert table.chain_runs(chain, WEIGHTS, bytearray(refuse_gpu_0)) == table.chain_runs(chain, WEIGHTS,
                                                                                          refuse_gpu_0)
    assert table.chain_runs(chain, WEIGHTS, memoryview(refuse_gpu_0)) == table.chain_runs(chain, WEIGHTS,
                                                                                           refuse_gpu_0)
    # holders past the mask's end do not count: only 0 and 1
    assert table.chain_runs(chain, WEIGHTS, b"\x01\x01") == [(0, 2, 1.8, (1, 0, 0, 0, 0), (1, 2, 2))]
    assert table.chain_runs(chain, WEIGHTS, b"") == []
    calls = []

    def no_unknown(holder):
        calls.append(holder)
        return holder != 4

    assert table.chain_runs(chain, WEIGHTS, no_unknown) == [(0, 4, 3.3, (1, 0, 0, 0, 0), (1, 2, 3)),
                                                            (7, 2, 2.0, (2, 0, 0, 0, 0), (2, 2, 2))]
    assert calls == [0, 1, 2, 3, 4, 5]  # each holder of the walk once, ascending, before the scoring
    calls.clear()
    assert table.content_runs([100, 101], WEIGHTS, no_unknown) == table.chain_runs([10, 11], WEIGHTS, no_unknown)
    assert calls == [0, 1, 2, 3, 4, 5] * 2


def test_a_filter_may_use_and_change_the_table(table):
    _runs_table(table)
    expected = table.chain_runs([10, 11, 12, 13], WEIGHTS)

    def busy(holder):
        # queries reuse the compiled table's scratch, changes move its arrays: the walk was taken before
        table.holders_at([10, 11, 12])
        table.chain_runs([11, 12], WEIGHTS, lambda h: True)
        table.content_runs([100, 101], WEIGHTS)
        for block in range(1000, 1300):
            table.replace(block, 0, [holder, 40], None, block)
        table.set_holder(40 + holder, 3, GPU)
        return True

    assert table.chain_runs([10, 11, 12, 13], WEIGHTS, busy) == expected
    assert len(table) == 304


def test_set_holder_registers_and_overwrites(table):
    assert table.holder_info_end == 0 and table.holder_info(0) is None
    table.set_holder(3, 5, STORAGE)
    assert (table.holder_info_end, table.holder_info(3), table.holder_info(2), table.holder_info(99)) == (
        4, (5, STORAGE), None, None)
    table.replace(1, 0, [3], None, None)
    assert table.chain_runs([1], WEIGHTS) == [(5, 1, 0.5, (0, 0, 1, 0, 0), (0, 0, 1))]
    table.set_holder(3, 6, GPU)  # another group and tier from now on
    assert table.chain_runs([1], WEIGHTS) == [(6, 1, 1.0, (1, 0, 0, 0, 0), (1, 1, 1))]
    table.set_holder((1 << 24) - 1, (1 << 24) - 1, UNKNOWN)
    assert table.holder_info_end == 1 << 24
    table.clear()  # forgets the metadata with the blocks
    assert table.holder_info_end == 0 and table.holder_info(3) is None


@pytest.mark.parametrize("args, error", [((-1, 0, 0), OverflowError), ((1 << 24, 0, 0), OverflowError),
                                         ((0, 1 << 24, 0), OverflowError), ((0, -1, 0), OverflowError),
                                         ((0, 0, 5), ValueError), ((0, 0, -1), ValueError),
                                         ((0, 0, 1 << 70), ValueError), ((0.0, 0, 0), TypeError),
                                         ((0, "1", 0), TypeError), ((0, 0, 1.0), TypeError)])
def test_set_holder_checks_its_arguments(table, args, error):
    with pytest.raises(error):
        table.set_holder(*args)
    assert table.holder_info_end == 0


def test_scored_lookups_check_their_arguments(table):
    _runs_table(table)
    for query, keys in ((table.chain_runs, [10, 11]), (table.content_runs, [100, 101])):
        for weights, error in (((1.0,) * 4, ValueError), ((1.0,) * 6, ValueError), (None, TypeError),
                               ((1.0, 1.0, 1.0, 1.0, "1"), TypeError), ((1.0, None, 1.0, 1.0, 1.0), TypeError),
                               ((1.0, 1.0, float("nan"), 1.0, 1.0), ValueError)):
            with pytest.raises(error):
                query(keys, weights)
        for allowed in ({0, 1}, 3, "abc"):
            with pytest.raises(TypeError):
                query(keys, WEIGHTS, allowed)
        with pytest.raises(OverflowError):
            query([10, -1], WEIGHTS)
        with pytest.raises(TypeError):
            query([10, 1.0], WEIGHTS)
        # ints and infinities are numbers: group 7 holds block 0 on UNKNOWN
        assert [run[2] for run in query(keys, [1, 0, 0, 0, float("inf")])] == [1.0, float("inf")]

    def refuse(holder):
        raise LookupError(holder)

    with pytest.raises(LookupError):
        table.chain_runs([10], WEIGHTS, refuse)
    table.replace(11, 0, [1, 2, 3, 77], None, None)  # holder 77 has no metadata
    with pytest.raises(KeyError, match="holder 77"):
        table.chain_runs([10, 11], WEIGHTS)
    with pytest.raises(KeyError, match="holder 77"):
        table.content_runs([100, 101], WEIGHTS, b"\x01" * 100)
    # a holder a filter refuses needs metadata too (as scoring.prefix_runs looks every holder up); one past
    # the depth the runs end at does not: the scoring never reaches it
    with pytest.raises(KeyError, match="holder 77"):
        table.chain_runs([10, 11], WEIGHTS, b"\x01" * 10)
    table.replace(10, 0, [0], None, None)
    table.replace(11, 0, [77], None, None)
    with pytest.raises(KeyError):
        table.chain_runs([10, 11], WEIGHTS)
    table.replace(12, 0, [0], 11, None)
    table.replace(11, 0, [3], None, None)
    table.replace(13, 0, [77], 12, None)
    assert table.chain_runs([10, 11, 13], WEIGHTS) == [(0, 1, 1.0, (1, 0, 0, 0, 0), (1, 1, 1))]
    # the largest holder id a link may have: no metadata possible, a filter's verdicts stay small
    table.replace(10, 1, [(1 << 32) - 1], None, None)
    seen = []
    with pytest.raises(KeyError, match=f"holder {(1 << 32) - 1}"):
        table.chain_runs([10, 11], WEIGHTS, lambda h: seen.append(h) or True)
    assert seen == [0, 3, 5, (1 << 32) - 1]


# -- dump, size, errors ---------------------------------------------------------------------------------------


def test_items_dumps_every_block(table):
    table.replace(U64, 1 << 31, [(1 << 32) - 1, 0], U64 - 1, U64)
    table.replace(3, 2, [5], None, None)
    table.replace(3, 1, [6, 5], None, None)
    assert sorted(table.items()) == [(3, None, None, ((1, 5), (1, 6), (2, 5))),
                                     (U64, U64 - 1, U64, ((1 << 31, 0), (1 << 31, (1 << 32) - 1)))]


def test_items_refuses_a_table_changed_under_it(table):
    for block in range(10):
        table.replace(block, 0, [1], None, None)
    items = table.items()
    next(items)
    table.replace(99, 0, [1], None, None)
    with pytest.raises(RuntimeError):
        list(items)


def test_clear_and_memory(table):
    empty = table.memory_bytes()
    for block in range(2000):
        table.replace(block * 7919, block % 3, [block % 5, 9], None if block == 0 else (block - 1) * 7919, block)
    assert table.memory_bytes() > empty
    assert len(table) == 2000
    table.clear()
    assert (len(table), table.links, table.holder_blocks(9)) == (0, 0, 0)
    assert table.holders_at([0]) == [] and table.content_walk([0]) == []
    table.replace(1, 0, [1], None, None)
    assert table.holders_at([1]) == [(1,)]


@pytest.mark.parametrize("args", [(-1, 0, [1]), (1 << 64, 0, [1]), (1, -1, [1]), (1, 1 << 32, [1]),
                                  (1, 0, [1, -1]), (1, 0, [1 << 32]), (1, 0, [1], -1, None),
                                  (1, 0, [1], None, 1 << 64)])
def test_out_of_range_values_raise_overflow_error_and_change_nothing(table, args):
    table.replace(1, 0, [5], None, 100)
    with pytest.raises(OverflowError):
        table.replace(*args)
    assert list(table.items()) == [(1, None, 100, ((0, 5),))]


@pytest.mark.parametrize("args", [(1.0, 0, [1]), ("1", 0, [1]), (1, 0, [1.5]), (1, 0, None), (1, 0, [1], 2.0)])
def test_non_integers_raise_type_error(table, args):
    with pytest.raises(TypeError):
        table.replace(*args)
    assert len(table) == 0


def test_queries_check_their_keys(table):
    table.replace(1, 0, [5], None, 100)
    for query in (table.holders_at, table.content_walk, table.content_walk_blocks, table.content_mixed):
        with pytest.raises(OverflowError):
            query([1, -1])
        with pytest.raises(TypeError):
            query([1, 2.0])
    with pytest.raises(OverflowError):
        table.holder_blocks(-1)
    with pytest.raises(OverflowError):
        table.remove_holder(1 << 32)


# -- compiled against Python ----------------------------------------------------------------------------------


def _state(t) -> tuple:
    return len(t), t.links, sorted(t.items())


def _compare(py, c, holders, blocks, contents) -> None:
    assert _state(c) == _state(py)
    for h in holders:
        assert c.holder_blocks(h) == py.holder_blocks(h), h
    assert c.holders_at(blocks) == py.holders_at(blocks)
    assert c.content_walk(contents) == py.content_walk(contents)
    assert c.content_walk_blocks(contents) == py.content_walk_blocks(contents)
    assert c.content_mixed(contents) == py.content_mixed(contents)


BLOCKS = st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, U64])
CONTENTS = st.sampled_from([0, 1, 2, U64])
OPS = st.one_of(
    st.tuples(st.just("replace"), BLOCKS, st.integers(0, 2), st.lists(st.integers(0, 5), max_size=6),
              st.one_of(st.none(), BLOCKS), st.one_of(st.none(), CONTENTS)),
    st.tuples(st.just("remove_holder"), st.integers(0, 5)),
    st.tuples(st.just("holders_at"), st.lists(BLOCKS, max_size=8)),
    st.tuples(st.just("walk"), st.lists(CONTENTS, max_size=6)),
    st.tuples(st.just("clear")),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OPS, max_size=60))
def test_compiled_and_python_agree_on_random_operations(ops):
    py, c = PyBlockTable(), compiled_class()()
    for op in ops:
        name, args = op[0], op[1:]
        if name == "replace":
            py.replace(*args)
            c.replace(*args)
        elif name == "remove_holder":
            assert c.remove_holder(*args) == py.remove_holder(*args)
        elif name == "holders_at":
            assert c.holders_at(*args) == py.holders_at(*args)
        elif name == "walk":
            assert c.content_walk(*args) == py.content_walk(*args)
            assert c.content_walk_blocks(*args) == py.content_walk_blocks(*args)
            assert c.content_mixed(*args) == py.content_mixed(*args)
        else:
            py.clear()
            c.clear()
        assert _state(c) == _state(py)
    _compare(py, c, range(6), [0, 1, 2, 3, 4, 5, 6, 7, U64], [0, 1, 2, 0, 1])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_compiled_and_python_agree_on_a_large_random_run(seed):
    """Thousands of blocks: the compiled table's arrays grow, its hash slots are deleted and shifted back,
    its link segments change size class and are reused."""
    rng = random.Random(seed)
    keys = [rng.getrandbits(64) for _ in range(3000)] + [0, 1, 2, U64]
    contents = [rng.getrandbits(64) for _ in range(40)]
    holders = list(range(60))
    # chains of equal content under different keys (engines of different hash seeds), for the content walk
    chains = [[rng.getrandbits(64) for _ in range(10)] for _ in range(20)]
    py, c = PyBlockTable(), compiled_class()()
    for t in (py, c):  # groups of 3 holders of mixed tiers, for the scored lookups
        for h in holders:
            t.set_holder(h, h // 3, h % 5)
    weights = (1.0, 0.8, 0.5, 0.25, 0.1)
    for step in range(30000):
        roll = rng.random()
        if roll < 0.3:
            chain, depth = rng.choice(chains), rng.randrange(10)
            parent = chain[depth - 1] if depth else None
            content = contents[depth] if rng.random() < 0.8 else None
            args = (chain[depth], rng.randint(0, 3), rng.sample(holders, rng.randint(0, 3)), parent, content)
            py.replace(*args)
            c.replace(*args)
        elif roll < 0.97:
            block = rng.choice(keys)
            many = rng.random() < 0.02
            held = rng.sample(holders, rng.randint(5, 60) if many else rng.randint(0, 4))
            parent = rng.choice((None, rng.choice(keys), rng.choice(keys[:20])))
            content = rng.choice((None, rng.choice(contents), rng.choice(contents[:3])))
            args = (block, rng.randint(0, 3), held, parent, content)
            py.replace(*args)
            c.replace(*args)
        elif roll < 0.975:
            h = rng.choice(holders)
            assert c.remove_holder(h) == py.remove_holder(h)
        else:
            chain = rng.sample(keys, 5) if rng.random() < 0.5 else [k for k, *_ in py.items()][:27]
            assert c.holders_at(chain) == py.holders_at(chain)
            walk = contents[:rng.randint(1, 10)] if rng.random() < 0.7 else \
                [rng.choice(contents[:3]) for _ in range(rng.randint(1, 6))]
            assert c.content_walk(walk) == py.content_walk(walk)
            assert c.content_walk_blocks(walk) == py.content_walk_blocks(walk)
            mask = bytes(rng.randint(0, 1) for _ in range(rng.randint(0, 70)))
            assert c.chain_runs(chain, weights) == py.chain_runs(chain, weights)
            assert c.chain_runs(chain, weights, mask) == py.chain_runs(chain, weights, mask)
            assert c.content_runs(walk, weights, mask) == py.content_runs(walk, weights, mask)
        if step % 5000 == 0:
            _compare(py, c, holders, rng.sample(keys, 30), contents[:10])
    _compare(py, c, holders, keys, contents[:10])
    for chain in chains:
        assert c.holders_at(chain) == py.holders_at(chain)
        assert c.chain_runs(chain, weights) == py.chain_runs(chain, weights)
    assert c.content_runs(contents[:10], weights) == py.content_runs(contents[:10], weights)
    assert any(c.chain_runs(chain, weights) for chain in chains)
    assert len(c) > 500
    assert len(c.content_walk(contents[:10])) > 1


# -- scored lookups, compiled against Python and against a brute force ---------------------------------------

#: The tiers each phase of the ordered walk reads (scoring.PHASES): GPU; CPU; STORAGE or EXTERNAL.
PHASE_TIERS = ({GPU}, {CPU}, {STORAGE, EXTERNAL})


def brute_force_runs(held, info, weights, counts):
    """The runs by their definition, one group at a time: the longest prefix of depths where the group's
    counted holders are present (any; per tier; per class), the score the sum of each such depth's best weight.
    ``held``: the walk's holders per depth; ``info``: holder -> (group, tier); ``counts``: holder -> bool."""
    def tiers_at(group, depth):
        return {info[h][1] for h in held[depth] if counts(h) and info[h][0] == group}

    def run_of(group, tiers):
        depth = 0
        while depth < len(held) and tiers_at(group, depth) & tiers:
            depth += 1
        return depth

    def ordered(group, depths):
        """The conductor's walk by its words: consume GPU blocks, test the first miss in CPU and go on there,
        test the first CPU miss on disk and go on there; the first disk miss ends it. Boundaries cumulative."""
        depth, bounds = 0, []
        for tiers in PHASE_TIERS:
            while depth < depths and tiers_at(group, depth) & tiers:
                depth += 1
            bounds.append(depth)
        return tuple(bounds)

    groups = []
    for h in (held[0] if held else ()):
        if counts(h) and info[h][0] not in groups:
            groups.append(info[h][0])
    out = []
    for group in groups:
        matched = run_of(group, set(range(5)))
        score = 0.0
        for depth in range(matched):
            score += max(weights[t] for t in tiers_at(group, depth))
        out.append((group, matched, score, tuple(run_of(group, {t}) for t in range(5)), ordered(group, matched)))
    return out


@st.composite
def scored_scenarios(draw):
    """A table of a few chains of equal content under different keys (engines of different hash seeds), each
    block held by a few of up to 10 holders in up to 2 scopes (none: the block is absent); every holder's group
    (several ranks and tiers per group) and tier; a chain and a token path to ask, weights and a filter."""
    holders = draw(st.integers(1, 10))
    info = [(draw(st.integers(0, 4)), draw(st.integers(0, 4))) for _ in range(holders)]
    depth = draw(st.integers(0, 7))
    contents = draw(st.lists(st.integers(0, 3), min_size=depth, max_size=depth))
    seeds = draw(st.integers(1, 3))
    links = [[[draw(st.lists(st.integers(0, holders - 1), max_size=4)) for _ in range(2)] for _ in range(depth)]
             for _ in range(seeds)]
    ask = draw(st.integers(0, seeds - 1))
    extra = draw(st.lists(st.sampled_from([999, 100]), max_size=2))
    weights = tuple(draw(st.lists(st.sampled_from([0.0, 1.0, 0.8, 0.5, 0.25, -1.0, 0.1, 3.0]), min_size=5,
                                  max_size=5)))
    kind = draw(st.sampled_from(["none", "mask", "callable"]))
    mask = bytes(draw(st.lists(st.integers(0, 2), max_size=holders + 2)))
    return info, contents, links, ask, extra, weights, kind, mask


def _build_scored(table, info, contents, links) -> None:
    for holder, (group, tier) in enumerate(info):
        table.set_holder(holder, group, tier)
    for seed, blocks in enumerate(links):
        for d, scopes in enumerate(blocks):
            for scope, held in enumerate(scopes):
                table.replace(seed * 100 + d, scope, held, None if d == 0 else seed * 100 + d - 1, contents[d])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scored_scenarios())
def test_scored_lookups_agree_with_python_and_the_definition(scenario):
    info, contents, links, ask, extra, weights, kind, mask = scenario
    py, c = PyBlockTable(), compiled_class()()
    _build_scored(py, info, contents, links)
    _build_scored(c, info, contents, links)
    calls = {"py": [], "c": []}
    if kind == "none":
        allowed = {"py": None, "c": None}

        def counts(h):
            return True
    elif kind == "mask":
        allowed = {"py": mask, "c": bytearray(mask)}

        def counts(h):
            return h < len(mask) and mask[h] != 0
    else:
        allowed = {name: (lambda h, log=log: log.append(h) or (h * 7 + len(mask)) % 3 != 0)
                   for name, log in calls.items()}

        def counts(h):
            return (h * 7 + len(mask)) % 3 != 0
    chain = [ask * 100 + d for d in range(len(contents))] + extra
    path = contents + extra
    for walk, runs, keys in ((py.holders_at, "chain_runs", chain), (py.content_walk, "content_runs", path)):
        for log in calls.values():
            log.clear()
        expected = getattr(py, runs)(keys, weights, allowed["py"])
        assert getattr(c, runs)(keys, weights, allowed["c"]) == expected
        assert calls["c"] == calls["py"]
        held = walk(keys)
        assert expected == brute_force_runs(held, info, weights, counts)
        # scoring.prefix_runs, the reference over HolderInfo: group g as instance "g<g>" of rank 0, the holder
        # id in the ownership (unused by the scoring) so that the filter can tell holders of one group and tier
        holder_infos = [HolderInfo(f"g{group}", 0, TIERS[tier], str(h)) for h, (group, tier) in enumerate(info)]
        reference = prefix_runs(held, holder_infos, dict(zip(TIERS, weights)),
                                None if kind == "none" else lambda i: counts(int(i.ownership)))
        assert [(f"g{group}", matched, score, {TIERS[t]: r for t, r in enumerate(tiers) if r}, list(classes))
                for group, matched, score, tiers, classes in expected] == [
            (key[0], run.any, run.score, run.tiers, run.classes) for key, run in reference.items()]


def _key_block_outcome(parse, key: bytes):
    try:
        return parse(key)
    except Exception as exc:  # noqa: BLE001 - the outcome compared is the error's type and message too
        return type(exc), str(exc)


_HEX = "0123456789abcdefABCDEF"


@settings(max_examples=2000, deadline=None)
@given(key=st.one_of(
    # residency keys as workers write them, and near misses: other lengths, a non-hex digit, spaces, no slash
    st.tuples(st.sampled_from(["primary", "kvcr", "", "prim/ary", "é"]),
              st.text(_HEX, min_size=14, max_size=18), st.sampled_from(["", "g", " ", "/"]))
    .map(lambda t: f"{t[0]}/{t[1]}{t[2]}".encode()),
    st.text(_HEX, min_size=16, max_size=16).map(str.encode),
    st.binary(max_size=40)))
def test_the_compiled_residency_key_parse_gives_the_references_results_and_errors(key):
    from stream_apps.index.table_keys import residency_key_block as reference

    compiled = compiled_class()  # fails when not built, as the table tests do
    from stream_apps.index._table import residency_key_block

    assert compiled is not None
    assert _key_block_outcome(residency_key_block, key) == _key_block_outcome(reference, key)


def test_a_residency_key_names_its_ownership_and_the_block_key_of_its_hash():
    from stream_apps.index.table import residency_key_block

    block = bytes.fromhex("00ff10203040a0b0")
    assert residency_key_block(b"primary/00ff10203040a0b0") == (None, block_key(block))
    assert residency_key_block(b"kvcr/00FF10203040A0B0") == ("kvcr", int.from_bytes(block, "big"))
    assert residency_key_block(b"kvcr/" + b"ab" * 32) == ("kvcr", xxhash.xxh3_64_intdigest(bytes.fromhex("ab" * 32)))
    with pytest.raises(ValueError):
        residency_key_block(b"primary/00ff10203040a0bg")
