"""The checkpoint protocol (stream_apps.checkpoint.Checkpoint) that both stages run, without Kafka: its step order,
what a failure leaves uncommitted, the awaiting flush, and the repartition stage's use of it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from stream_apps.checkpoint import Checkpoint, CheckpointError


class _Producer:
    """An :class:`stream_apps.checkpoint.Acknowledging` producer: each acknowledge() call acknowledges one queued
    record (all of them when the wait is long), recording the calls in ``calls``."""

    def __init__(self, calls: list, queued: int = 0, refused: list[str] | None = None) -> None:
        self.calls = calls
        self.queued = queued
        self.refused = list(refused or [])
        self.stuck = False

    def acknowledge(self, timeout_s: float) -> int:
        self.calls.append("flush")
        if not self.stuck:
            self.queued = max(0, self.queued - 1) if timeout_s < 0.1 else 0
        return self.queued

    def take_delivery_errors(self) -> list[str]:
        errors, self.refused = self.refused, []
        return errors


class _Store:
    def __init__(self, calls: list, name: str) -> None:
        self.calls, self.name = calls, name

    def produce_changelog(self) -> int:
        self.calls.append(f"produce {self.name}")
        return 1

    def persist(self) -> None:
        self.calls.append(f"persist {self.name}")


def _checkpoint(calls, producer=None, **kwargs):
    producer = producer or _Producer(calls)
    return Checkpoint(producer, [_Store(calls, "a"), _Store(calls, "b")],
                      produce=[lambda: calls.append("produce stage") or 2],
                      commit_offsets=lambda offsets: calls.append(("commit", offsets)), freeze_gc=False, **kwargs)


def test_a_checkpoint_produces_then_flushes_then_persists_then_commits_the_offsets_it_was_handed():
    calls = []
    checkpoint = _checkpoint(calls)
    checkpoint.store_offsets({0: 10, 1: 4})
    checkpoint.store_offsets({0: 12})  # a later batch: the latest offset of each partition
    checkpoint.commit()
    assert calls == ["produce stage", "produce a", "produce b", "flush", "persist a", "persist b",
                     ("commit", {0: 12, 1: 4})]
    calls.clear()
    checkpoint.commit()  # committed offsets are not committed again
    assert ("commit", {0: 12, 1: 4}) not in calls and checkpoint.commits == 2


@pytest.mark.parametrize("failure", ["refused", "not acknowledged"])
def test_outputs_refused_or_not_acknowledged_leave_state_and_offsets_uncommitted_for_good(failure):
    calls = []
    producer = _Producer(calls, queued=3, refused=["out[0]: broker down"] if failure == "refused" else [])
    producer.stuck = failure == "not acknowledged"
    checkpoint = _checkpoint(calls, producer, flush_timeout_s=0.5)
    checkpoint.store_offsets({0: 10})
    with pytest.raises(CheckpointError, match="refused|not acknowledged"):
        checkpoint.commit()
    assert "persist a" not in calls and not [c for c in calls if isinstance(c, tuple)]  # no commit
    producer.refused, producer.stuck, producer.queued = [], False, 0
    calls.clear()
    with pytest.raises(CheckpointError, match="earlier checkpoint failed"):
        checkpoint.commit()  # e.g. Faust's last commit at shutdown: a second flush would pass
    assert calls == []


def test_a_record_that_cannot_be_produced_fails_the_checkpoint_before_anything_is_flushed():
    calls = []

    def broken() -> int:
        raise ValueError("cannot encode")

    checkpoint = Checkpoint(_Producer(calls), [_Store(calls, "a")], produce=[broken], freeze_gc=False)
    with pytest.raises(CheckpointError, match="could not be produced"):
        checkpoint.commit()
    assert calls == []


def test_prepare_waits_for_the_acknowledgements_with_the_event_loop_free_and_commits_nothing():
    calls = []
    producer = _Producer(calls, queued=5)
    checkpoint = _checkpoint(calls, producer)
    checkpoint.store_offsets({0: 10})
    ticks = []

    async def other_work(done: asyncio.Event):  # e.g. the agent, the HTTP views: they run while the checkpoint waits
        while not done.is_set():
            ticks.append(calls.count("flush"))
            await asyncio.sleep(0)

    async def main():
        done = asyncio.Event()
        work = asyncio.ensure_future(other_work(done))
        await checkpoint.prepare()
        done.set()
        await work

    asyncio.run(main())
    assert producer.queued == 0
    assert set(ticks) >= {1, 2, 3, 4}  # the other coroutine ran after each poll that left some outstanding
    assert "persist a" not in calls and not [c for c in calls if isinstance(c, tuple)]  # no commit
    calls.clear()
    asyncio.run(checkpoint.commit_async())
    assert calls[-3:] == ["persist a", "persist b", ("commit", {0: 10})]


def test_the_repartition_stage_commits_a_batch_offsets_only_after_its_outputs_are_acknowledged():
    from producers.split import Publisher, split_event
    from schemas import AvroCodec
    from schemas.topics import TopicNames
    from stream_apps.repartition import Repartitioner

    calls, refused = [], []

    class Producer:
        def produce(self, topic, value, key, **kwargs):
            calls.append(("produce", topic))
            self.on_delivery = kwargs["on_delivery"]

        def flush(self, timeout):
            calls.append("flush")
            for error in refused:
                self.on_delivery(error, SimpleNamespace(topic=lambda: "by-ownership", partition=lambda: 0))
            return 0

    consumer = SimpleNamespace(commit=lambda offsets, asynchronous: calls.append(
        ("commit", [(tp.partition, tp.offset) for tp in offsets], asynchronous)))
    r = Repartitioner("unused:0", TopicNames("unit"), 4, {"repartitioned": 0, "dead_lettered": 0},
                      stop_event=SimpleNamespace(is_set=lambda: False), consumer=consumer, producer=Producer())
    clear = AvroCodec("kv_event").encode(split_event(Publisher("e1"), 3, 1.0, 0, {"type": "AllBlocksCleared"})[0])
    message = SimpleNamespace(error=lambda: None, partition=lambda: 2, offset=lambda: 41, value=lambda: clear,
                              key=lambda: None, topic=lambda: "kv-events")
    assert r.process([message]) == {2: 42}
    assert [c if isinstance(c, str) else c[0] for c in calls] == ["produce", "produce", "flush", "commit"]
    assert calls[-1] == ("commit", [(2, 42)], True) and r.counters["repartitioned"] == 1

    calls.clear()
    refused.append("broker down")
    with pytest.raises(CheckpointError, match="refused"):
        r.process([message])
    assert "commit" not in [c[0] for c in calls if not isinstance(c, str)]


def test_every_collection_is_counted_with_its_pause_by_generation_once_however_often_installed(monkeypatch):
    import gc
    import itertools
    import types

    import stream_apps.checkpoint as checkpoint
    from stream_apps.checkpoint import GC_PAUSES, warn_on_long_gc_pauses

    warn_on_long_gc_pauses()
    warn_on_long_gc_pauses()  # a second app in the same process: still one callback
    assert sum(getattr(callback, "_kvstream_gc_pauses", False) for callback in gc.callbacks) == 1
    # A clock that moves 0.25 s per reading: each collection (one reading at its start, one at its end) lasts
    # exactly 0.25 s, so the sums are exact whatever the machine's speed
    clock = itertools.count(1000.0, 0.25)
    monkeypatch.setattr(checkpoint, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    gc.disable()  # no automatic collection in between: only the three below are counted
    try:
        before = list(GC_PAUSES.collections), list(GC_PAUSES.seconds)
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        gc.enable()
        monkeypatch.undo()
    assert [after - was for after, was in zip(GC_PAUSES.collections, before[0])] == [1, 0, 2]
    # each collection's duration was added to its generation's sum
    assert [after - was for after, was in zip(GC_PAUSES.seconds, before[1])] == pytest.approx([0.25, 0.0, 0.5])
