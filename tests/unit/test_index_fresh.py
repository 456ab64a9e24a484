"""The index's fresh layer without Kafka: kv-events records applied over changelog entries
(stream_apps/index/fresh.py, stream_apps/index/events_feed.py), with both block tables."""

from __future__ import annotations

import time

import pytest

from schemas import (
    ALL_BLOCKS_CLEARED,
    BLOCK_REMOVED,
    BLOCK_STORED,
    PUBLISHER_RESTARTED,
    SOURCE_DISCONNECTED,
    SOURCE_HEARTBEAT,
    SOURCE_UNREGISTERED,
    AvroCodec,
)
from stream_apps.index.events_feed import EventsFeed
from stream_apps.index.fleet_index import FleetIndex
from stream_apps.index.liveness import SourceLeases

H1, H2, H3 = (bytes([i]) * 8 for i in (1, 2, 3))


@pytest.fixture(params=["python", "compiled"])
def index(request):
    from stream_apps.index import table

    cls = table.PyBlockTable if request.param == "python" else table.CompiledBlockTable
    if cls is None:
        pytest.skip("stream_apps/index/_table.pyx is not built")
    index = FleetIndex(default_block_size=4, table=cls(), fresh_window_s=2.0)
    index.leases = SourceLeases(30.0)
    return index


_CODEC = AvroCodec("kv_event")
_BRANCHES = {branch["name"]: branch for field in _CODEC.schema.parsed["fields"] if field["name"] == "event"
             for branch in field["type"]}
_DEFAULTS = {"int": 0, "long": 0, "string": "", "boolean": True, "bytes": b"", "double": 0.0}


def _defaults(fields) -> dict:
    """Every field of a schema's record: its default, else a plain value of its type."""
    out = {}
    for field in fields:
        kind = field["type"]
        if "default" in field:
            out[field["name"]] = field["default"]
        elif isinstance(kind, str):
            out[field["name"]] = _DEFAULTS[kind]
        elif isinstance(kind, dict) and kind.get("type") == "array":
            out[field["name"]] = []
        elif isinstance(kind, dict) and kind.get("type") == "enum":
            out[field["name"]] = kind["symbols"][0]
        else:
            out[field["name"]] = None
    return out


def _event(kind, instance="e1", block_hash=None, tier="GPU", seq=0, epoch=1, body=None, **envelope):
    """A whole kv_event record, as a producer writes it (round-tripped through the codec)."""
    record = {**_defaults(_CODEC.schema.parsed["fields"]), "instance_id": instance, "publisher_epoch": epoch,
              "seq": seq, "ts": time.time(), "block_hash": block_hash, "tier": tier, **envelope}
    branch = _BRANCHES[kind]
    record["event"] = (kind, {**_defaults(branch.get("fields", [])), **(body or {})})
    return _CODEC.decode(_CODEC.encode(record))


def _feed(index) -> EventsFeed:
    return EventsFeed(index, "unused:9092", "kv-events", AvroCodec("kv_event"))


def _apply(feed, *records, live=True, now=None):
    feed.apply_records(list(records), live, now)


def _holders(index, block_hash) -> set[tuple[str, str]]:
    found = index.holders_at([block_hash])
    return {(index.holder(h).instance_id, index.holder(h).tier) for h in found[0]} if found else set()


def _entry(rows):
    return {"block_hash": H1, "ownership": None, "parent_block_hash": None, "content_hash": None,
            "rows": [{"instance_id": i, "data_parallel_rank": 0, "tier": t, "copies": 1} for i, t in rows]}


def test_a_store_answers_before_its_changelog_record_and_an_older_record_does_not_undo_it(index):
    feed = _feed(index)
    _apply(feed, _event(BLOCK_STORED, block_hash=H1))
    assert _holders(index, H1) == {("e1", "GPU")}
    index.apply_entry(f"primary/{H1.hex()}", None)  # the changelog's older state: the key was not in the table
    assert _holders(index, H1) == {("e1", "GPU")}
    index.apply_entry(f"primary/{H1.hex()}", _entry([("e1", "GPU")]))  # the table caught up: the override goes
    assert len(index.fresh) == 0 and index.fresh.counters.confirmed == 1
    assert _holders(index, H1) == {("e1", "GPU")}


def test_a_removal_answers_at_once_and_an_override_the_table_never_agrees_with_expires(index):
    feed = _feed(index)
    index.apply_entry(f"primary/{H1.hex()}", _entry([("e1", "GPU"), ("e1", "CPU")]))
    _apply(feed, _event(BLOCK_REMOVED, block_hash=H1, seq=3))
    assert _holders(index, H1) == {("e1", "CPU")}
    index.apply_entry(f"primary/{H1.hex()}", _entry([("e1", "GPU"), ("e1", "CPU")]))  # older: laid over again
    assert _holders(index, H1) == {("e1", "CPU")}
    with index.lock:
        index.fresh.expire(now=float("inf"))
    assert len(index.fresh) == 0 and index.fresh.counters.expired == 1
    # past the window the table's word stands, with no record needed (a second physical copy the removal did not
    # end, say)
    assert _holders(index, H1) == {("e1", "GPU"), ("e1", "CPU")}


def test_with_no_record_to_confirm_it_a_store_lapses_after_the_window(index):
    feed = _feed(index)
    _apply(feed, _event(BLOCK_STORED, block_hash=H1))
    assert _holders(index, H1) == {("e1", "GPU")}
    with index.lock:
        index.fresh.expire(now=float("inf"))
    assert _holders(index, H1) == set()  # the changelog is the authority: no worker wrote the block


def test_an_old_epochs_event_read_after_the_restart_and_a_cleared_event_after_the_clear_are_ignored(index):
    feed = _feed(index)
    _apply(feed, _event(PUBLISHER_RESTARTED, epoch=2, seq=-1, body={"previous_epoch": 1}))
    _apply(feed, _event(BLOCK_STORED, block_hash=H1, epoch=1, seq=9))  # the dead run's, from another partition
    assert _holders(index, H1) == set() and index.fresh.counters.retired_late == 1
    _apply(feed, _event(ALL_BLOCKS_CLEARED, epoch=2, seq=5))
    _apply(feed, _event(BLOCK_STORED, block_hash=H2, epoch=2, seq=4),  # before the clear, read after it
           _event(BLOCK_STORED, block_hash=H2, epoch=2, seq=4, tier="CPU"),  # a tier the clear kept
           _event(BLOCK_STORED, block_hash=H3, epoch=2, seq=6))  # after it
    assert _holders(index, H2) == {("e1", "CPU")} and _holders(index, H3) == {("e1", "GPU")}


def test_a_store_carries_its_content_keys_to_token_queries(index):
    from schemas.content_hash import content_hash

    feed = _feed(index)
    tokens = [1, 2, 3, 4]
    _apply(feed, _event(BLOCK_STORED, block_hash=H1, body={"content_hash": content_hash(tokens, None)}))
    assert index.query_tokens(tokens)["instances"]["e1"]["longest_matched"] == 4


def test_a_restart_retires_the_old_epoch_but_not_new_events_read_first_on_another_partition(index):
    feed = _feed(index)
    _apply(feed, _event(BLOCK_STORED, block_hash=H1, epoch=1, seq=5),
           _event(BLOCK_STORED, block_hash=H2, epoch=2, seq=0))  # H2: the new run's, read before the restart's copy
    restart = _event(PUBLISHER_RESTARTED, epoch=2, seq=-1, body={"previous_epoch": 1})
    _apply(feed, restart)
    assert _holders(index, H1) == set()
    assert _holders(index, H2) == {("e1", "GPU")}
    _apply(feed, restart)  # the copy of another partition: applied once
    assert index.fresh.counters.retirements == 1 and _holders(index, H2) == {("e1", "GPU")}


def test_a_clear_removes_the_gpu_tier_only_and_an_unregistration_every_tier(index):
    feed = _feed(index)
    _apply(feed, _event(BLOCK_STORED, block_hash=H1, seq=1), _event(BLOCK_STORED, block_hash=H1, tier="CPU", seq=2),
           _event(BLOCK_STORED, block_hash=H3, instance="e2", seq=1))
    _apply(feed, _event(ALL_BLOCKS_CLEARED, seq=3))
    assert _holders(index, H1) == {("e1", "CPU")}
    _apply(feed, _event(SOURCE_UNREGISTERED, seq=-1, body={"all_ranks": True, "reason": "test"}))
    assert _holders(index, H1) == set() and _holders(index, H3) == {("e2", "GPU")}
    # the instance comes back, and is unregistered again later: a second unregistration, not a copy of the first
    _apply(feed, _event(BLOCK_STORED, block_hash=H1, seq=4))
    _apply(feed, _event(SOURCE_UNREGISTERED, seq=-1, body={"all_ranks": True, "reason": "again"}))
    assert _holders(index, H1) == set() and index.fresh.counters.retirements == 3


def test_sources_of_several_publishers_and_other_kv_cache_groups_are_left_to_the_changelog(index):
    feed = _feed(index)
    _apply(feed, _event(BLOCK_STORED, block_hash=H1, world_size=2))
    index.apply_entry(f"primary/{H1.hex()}", _entry([("e1", "GPU")]))
    _apply(feed, _event(BLOCK_REMOVED, block_hash=H1, body={"group_idx": 1}))
    assert _holders(index, H1) == {("e1", "GPU")} and index.fresh.counters.left_to_changelog == 2


def test_a_disconnect_marks_the_source_down_until_it_is_heard_of_again(index):
    feed = _feed(index)
    _apply(feed, _event(BLOCK_STORED, block_hash=H1), now=100.0)
    assert index.leases.states(now=100.5)[("e1", 0)].live
    _apply(feed, _event(SOURCE_DISCONNECTED, seq=-1, body={"reason": "disconnected"}), now=101.0)
    state = index.leases.states(now=101.1)[("e1", 0)]
    assert not state.live and state.down_since == 101.0
    index.leases.note("0/e1/0/-1", "e1", 0, 101.5)  # a worker's sources row flushed after the disconnect
    assert not index.leases.states(now=101.6)[("e1", 0)].live
    _apply(feed, _event(SOURCE_HEARTBEAT, seq=-1, body={"evidence": "replay"}), now=102.0)
    assert index.leases.states(now=102.1)[("e1", 0)].live


def test_history_read_at_start_gives_liveness_but_no_block(index):
    feed = _feed(index)
    _apply(feed, _event(BLOCK_STORED, block_hash=H1, ts=90.0), live=False, now=100.0)
    assert _holders(index, H1) == set()
    assert index.leases.states(now=100.0)[("e1", 0)].last_heard == 100.0


def test_an_event_produced_before_the_disconnect_but_read_after_it_does_not_bring_the_engine_back(index):
    from stream_apps.index.events_feed import _item

    feed = _feed(index)
    now = time.time()
    down = _item(_event(SOURCE_DISCONNECTED, seq=-1, body={"reason": "disconnected"}))
    late = _item(_event(BLOCK_STORED, block_hash=H1, seq=7))  # another partition's, produced 50 ms earlier
    feed._apply_items([(down, True, now - 0.05), (late, True, now - 0.1)], now)
    assert not index.leases.states(now)[("e1", 0)].live
    after = _item(_event(BLOCK_STORED, block_hash=H2, seq=8))  # produced after the mark: the engine is back
    feed._apply_items([(after, True, now)], now)
    assert index.leases.states(now)[("e1", 0)].live


def test_the_compiled_projection_and_the_decoded_record_apply_alike(index):
    from stream_apps.index.events_feed import _item

    feed = _feed(index)
    record = _event(BLOCK_STORED, block_hash=H1,
                    body={"parent_block_hash": H2, "content_hash": -5, "ownership": "kvcr"})
    if feed._project is None:
        pytest.skip("the compiled module is not built")
    assert feed._project(_CODEC.encode(record)) == _item(record)


def test_records_written_before_the_workers_applied_a_restart_do_not_bring_the_old_blocks_back(index):
    feed = _feed(index)
    index.apply_entry(f"primary/{H1.hex()}", _entry([("e1", "GPU")]))  # the old run's block, from the changelog
    _apply(feed, _event(PUBLISHER_RESTARTED, epoch=2, seq=-1, body={"previous_epoch": 1}))
    assert _holders(index, H1) == set()
    index.apply_entry(f"primary/{H1.hex()}", _entry([("e1", "GPU")]))  # flushed before the worker applied it
    assert _holders(index, H1) == set() and index.fresh.counters.held_out == 1
    # the new run stores H2; the changelog confirms it, and a later record of H2 keeps it
    _apply(feed, _event(BLOCK_STORED, block_hash=H2, epoch=2, seq=0))
    entry = {**_entry([("e1", "GPU")]), "block_hash": H2}
    index.apply_entry(f"primary/{H2.hex()}", entry)
    assert len(index.fresh) == 0
    index.apply_entry(f"primary/{H2.hex()}", {**entry, "rows": entry["rows"] + [
        {"instance_id": "e2", "data_parallel_rank": 0, "tier": "GPU", "copies": 1}]})
    assert _holders(index, H2) == {("e1", "GPU"), ("e2", "GPU")}


def test_a_clear_of_a_source_with_several_publishers_is_left_to_the_changelog(index):
    feed = _feed(index)
    index.apply_entry(f"primary/{H1.hex()}", _entry([("e1", "GPU")]))
    _apply(feed, _event(ALL_BLOCKS_CLEARED, seq=3, world_size=2))
    # its rows stay until the changelog removes them, and the rows its workers store again are not held out
    assert _holders(index, H1) == {("e1", "GPU")} and index.fresh.counters.left_to_changelog == 1
    index.apply_entry(f"primary/{H1.hex()}", _entry([("e1", "GPU")]))
    assert _holders(index, H1) == {("e1", "GPU")} and index.fresh.counters.held_out == 0
