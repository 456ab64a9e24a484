"""A bridge's ``SourceDisconnected`` (kv_event v6) through the workers' stages, without Kafka: the repartition
process routes it as a source-wide event, as it does a ``SourceHeartbeat``, and the materializing agent applies it
without changing any residency, without dead-lettering it, and without renewing the source's lease (a heartbeat
writes the source's ``sources`` row again; a disconnect must not). Each test runs on the pure-Python path and on
the compiled one (tests/conftest.py's ``hotpath`` fixture)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from producers.split import Publisher, source_event, split_event
from schemas import SOURCE_DISCONNECTED, SOURCE_HEARTBEAT, SOURCE_WIDE_EVENTS, AvroCodec
from schemas.ownership_batch import OwnershipBatchReader
from schemas.topics import TopicNames
from tests.unit.test_repartition import _repartitioner
from tests.unit.test_residency_records import _materializer

EVENTS = AvroCodec("kv_event")
TOPICS = TopicNames("unit")
PUBLISHER = Publisher("engine-d", 0, publisher_epoch=1767225600000)
STORE = {"type": "BlockStored", "block_hashes": [0x71, 0x72], "parent_block_hash": None, "token_ids": list(range(8)),
         "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None, None]}


def _records() -> list[dict]:
    """A store of two blocks, a heartbeat, then the bridge's disconnect: what kv-events holds of a source whose
    engine died after its last heartbeat."""
    return [*split_event(PUBLISHER, 0, 1.0, 0, STORE),
            source_event(PUBLISHER, SOURCE_HEARTBEAT, {"evidence": "events"}, 0, 2.0),
            source_event(PUBLISHER, SOURCE_DISCONNECTED, {"reason": "disconnected"}, 0, 3.0)]


def _rekeyed(values: list[bytes], partition: int = 1) -> tuple[list[tuple], dict]:
    """``values`` read from kv-events ``partition`` through the repartition loop: what it produced (topic, value,
    key, partition) and its counters."""
    messages = [SimpleNamespace(error=lambda: None, partition=lambda: partition, offset=lambda n=n: n,
                                value=lambda v=v: v, key=lambda: None, topic=lambda: "kv-events")
                for n, v in enumerate(values)]
    produced = []
    producer = SimpleNamespace(produce=lambda topic, value, key=None, **kwargs: produced.append(
        (topic, value, key, kwargs.get("partition"))), flush=lambda *args: 0)
    counters = {"repartitioned": 0, "dead_lettered": 0}
    _repartitioner(SimpleNamespace(commit=lambda **kwargs: None), producer=producer, counters=counters).process(
        messages)
    return produced, counters


def test_a_source_disconnected_is_source_wide_and_keeps_its_partition_like_a_heartbeat(hotpath):
    assert SOURCE_DISCONNECTED in SOURCE_WIDE_EVENTS
    disconnect = source_event(PUBLISHER, SOURCE_DISCONNECTED, {"reason": "replay-silent"}, 4, 3.0)
    heartbeat = source_event(PUBLISHER, SOURCE_HEARTBEAT, {"evidence": "replay"}, 4, 2.0)
    produced, counters = _rekeyed([EVENTS.encode(heartbeat), EVENTS.encode(disconnect)], partition=3)
    assert counters["dead_lettered"] == 0 and {topic for topic, *_ in produced} == {TOPICS.by_ownership}
    assert {partition for *_, partition in produced} == {3}  # the kv-events partition it was read from
    items = [item for _, value, _, _ in produced for item in OwnershipBatchReader(EVENTS).read(value)]
    assert [key for key, *_ in items] == ["SourceHeartbeat/engine-d/0", "SourceDisconnected/engine-d/0"]
    record = EVENTS.decode(items[1][2][items[1][3]:items[1][4]])
    assert record["event"] == (SOURCE_DISCONNECTED, {"reason": "replay-silent"}) and record["seq"] == 4


def test_the_agent_applies_a_disconnect_without_changing_residency_or_renewing_the_lease(hotpath, tmp_path):
    from stream_apps.materialize import message_applier

    materializer = _materializer(tmp_path, hotpath is not None, "disconnect")
    sources_writes = []
    write = materializer.write_small_table

    def recording_write(table, partition, key, value):
        if table is materializer.tables.sources:
            sources_writes.append(key)
        write(table, partition, key, value)

    materializer.write_small_table = recording_write
    dead_letters = []
    materializer.outputs.dead_letter = lambda *args: dead_letters.append(args)
    apply = message_applier(SimpleNamespace(crash=None), materializer, EVENTS)
    residency = materializer.tables.residency_store

    def resident() -> dict:
        return {(p, key): residency.entry(p, key) for p in (0, 1) for key in residency.partition_keys(p)}

    def rekey_and_apply(records: list[dict]) -> None:
        produced, counters = _rekeyed([EVENTS.encode(record) for record in records], partition=0)
        assert counters["dead_lettered"] == 0
        for offset, (topic, value, _, partition) in enumerate(produced):
            if topic == TOPICS.by_ownership:
                asyncio.run(apply(topic, partition, offset, None, value))

    rekey_and_apply(_records())  # a store of two blocks, a heartbeat, a disconnect
    assert dead_letters == [] and materializer.stats.applied == 2
    assert len(resident()) == 2 and all(entry["rows"][0]["copies"] == 1 for entry in resident().values())
    assert "0/engine-d/0/-1" in sources_writes  # the heartbeat's (and the store's) lease renewal

    # a disconnect alone writes nothing: no sources row (it would renew the lease), no residency change
    writes, changes, state = len(sources_writes), len(materializer.outputs.changes), resident()
    rekey_and_apply([source_event(PUBLISHER, SOURCE_DISCONNECTED, {"reason": "disconnected"}, 0, 4.0)])
    assert (len(sources_writes), len(materializer.outputs.changes), resident()) == (writes, changes, state)
    assert dead_letters == [] and materializer.stats.duplicates == 0

    # and a heartbeat after it renews the lease again
    rekey_and_apply([source_event(PUBLISHER, SOURCE_HEARTBEAT, {"evidence": "replay"}, 0, 5.0)])
    assert sources_writes[writes:] == ["0/engine-d/0/-1"] and resident() == state
