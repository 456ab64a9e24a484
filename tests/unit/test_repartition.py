"""The repartition stage's own code paths, without Kafka: clear history, hand-written Avro, batch reads."""

from __future__ import annotations

import random
import time

import pytest

from schemas import AvroCodec
from schemas.avro_writers import encode_clear_mark, encode_keyed_event, encode_ownership_batch
from schemas.clear_position import NO_CLEAR
from schemas.topics import TopicNames
from stream_apps.repartition import ClearHistory
from stream_apps.repartition.process import RepartitionProcess

BATCH = AvroCodec("ownership_batch")


def test_a_replayed_event_gets_the_clear_mark_it_got_the_first_time():
    history = ClearHistory("e1", 0, 3)
    assert history.mark_before(10) == NO_CLEAR
    assert history.add(20, (1, 5, 0)) and history.add(40, (1, 9, 2))
    assert not history.add(20, (1, 5, 0))  # the clear read again after a crash: already known
    assert [history.mark_before(o) for o in (10, 20, 21, 40, 41)] == [NO_CLEAR, NO_CLEAR, (1, 5, 0), (1, 5, 0),
                                                                      (1, 9, 2)]
    assert [history.encoded_mark_before(o) for o in (10, 30, 41)] == [encode_clear_mark(NO_CLEAR),
                                                                      encode_clear_mark((1, 5, 0)),
                                                                      encode_clear_mark((1, 9, 2))]
    assert ClearHistory.from_record(history.to_record()) == history
    AvroCodec("source_clears").encode(history.to_record())  # the record fits its schema


@pytest.mark.parametrize("seed", range(5))
def test_hand_written_ownership_batch_decodes_to_what_fastavro_writes(seed):
    rng = random.Random(seed)
    marks = [NO_CLEAR, (0, 0, 0), (1767225600000, 2**40, 7), (-1, 3, 2**31 - 1)]
    items = []
    for _ in range(rng.randrange(0, 50)):
        key = rng.choice(["primary/", "kvcr/", "AllBlocksCleared/ém/"]) + bytes(rng.randrange(8, 33)).hex()
        items.append((key, rng.choice(marks), rng.randbytes(rng.choice([0, 5, 200, 20000]))))
    written = encode_ownership_batch(BATCH.header,
                                     [encode_keyed_event(k, encode_clear_mark(m), e) for k, m, e in items])
    expected = {"sources": [], "strings": [],
                "events": [{"key": k, "clear_mark": None if m == NO_CLEAR else
                            {"publisher_epoch": m[0], "seq": m[1], "batch_index": m[2]}, "event": e, "block": None}
                           for k, m, e in items]}
    assert BATCH.decode(written) == expected
    assert written == BATCH.encode(expected)


class _Consumer:
    """A consumer whose reads return what ``arrivals`` holds for each call, recording (count, timeout)."""

    def __init__(self, arrivals, high=None, on_read=None) -> None:
        self.arrivals = list(arrivals)
        self.calls: list[tuple[int, float]] = []
        self.high = high or {}
        self.on_read = on_read

    def consume(self, count, timeout):
        self.calls.append((count, timeout))
        if self.on_read is not None:
            self.on_read(len(self.calls))
        batch = self.arrivals.pop(0) if self.arrivals else []
        assert len(batch) <= count
        return batch

    def get_watermark_offsets(self, partition, cached=False):
        assert cached  # never a request to the broker per batch
        return 0, self.high.get(partition.partition, -1)


def _repartitioner(consumer, batch_size=10, agent_progress=None, producer=None, counters=None, aggregation=None):
    from types import SimpleNamespace

    from schemas.topics import TopicNames
    from stream_apps.repartition import Repartitioner

    return Repartitioner("unused:0", TopicNames("unit"), 4, {} if counters is None else counters,
                         batch_size=batch_size, within_s=60.0, linger_s=0.02,
                         stop_event=SimpleNamespace(is_set=lambda: False), agent_progress=agent_progress,
                         consumer=consumer, producer=producer, aggregation=aggregation)


def test_a_backlogged_read_waits_for_a_whole_batch():
    consumer = _Consumer([list(range(10))])
    assert _repartitioner(consumer)._read(backlogged=True, last_read=time.monotonic()) == list(range(10))
    assert consumer.calls == [(10, 60.0)]


def test_a_read_without_backlog_waits_only_for_the_rest_of_the_linger():
    consumer = _Consumer([[1, 2]])
    assert _repartitioner(consumer)._read(backlogged=False, last_read=time.monotonic() - 1.0) == [1, 2]
    assert consumer.calls == [(10, 0.0)]  # the linger has passed since the previous read: what is here now


def test_a_read_with_nothing_arrived_waits_for_the_first_message_and_takes_what_came_with_it():
    consumer = _Consumer([[], [1], [2, 3]])
    assert _repartitioner(consumer)._read(backlogged=False, last_read=time.monotonic() - 1.0) == [1, 2, 3]
    assert consumer.calls == [(10, 0.0), (1, 60.0), (9, 0)]


def test_a_batch_grows_while_the_agent_has_not_finished_the_previous_one():
    from stream_apps.repartition import AGENT_CHECK_S, new_agent_progress

    progress = new_agent_progress(4)
    progress[1] = 6  # the agent read up to offset 6 of partition 1; the batch before wrote offset 7 there

    def agent(calls):
        if calls == 3:
            progress[1] = 7

    consumer = _Consumer([[1], [2], [3], [4]], on_read=agent)
    r = _repartitioner(consumer, agent_progress=progress)
    r.written.update({1: 7, 2: 3})
    assert r._read(backlogged=False, last_read=time.monotonic() - 1.0) == [1, 2, 3]
    assert consumer.calls == [(10, 0.0), (9, AGENT_CHECK_S), (8, AGENT_CHECK_S)]


def test_a_batch_read_across_a_revocation_drops_the_revoked_partitions_messages_and_stops_growing():
    """librdkafka runs the revocation inside consume(): messages read before it from a partition that left have
    lost their clear history (re-keyed, a block event would get no clear mark, and the agent would then drop it
    as older than the clear) and belong to the new owner, which reads them again from the committed offset."""
    from types import SimpleNamespace

    from confluent_kafka import TopicPartition

    from stream_apps.repartition import new_agent_progress

    def message(partition, offset):
        return SimpleNamespace(partition=lambda: partition, offset=lambda: offset, error=lambda: None)

    progress = new_agent_progress(4)
    progress[1] = 6  # the agent has not finished the previous batch: without the rebalance the batch would grow
    first, second = [message(0, 10), message(1, 20)], [message(1, 21)]

    def rebalance(calls):
        if calls == 2:
            r._on_revoke(None, [TopicPartition(r.topics.kv_events, 0)])

    consumer = _Consumer([first, second, [message(1, 22)]], on_read=rebalance)
    r = _repartitioner(consumer, agent_progress=progress)
    r.assigned.update({0, 1})
    r.written[1] = 7
    batch = r._read(backlogged=False, last_read=time.monotonic() - 1.0)
    assert [(m.partition(), m.offset()) for m in batch] == [(1, 20), (1, 21)]
    assert len(consumer.calls) == 2  # no read after the one that served the revocation


def test_backlog_is_another_whole_batch_behind_the_read_offsets():
    consumer = _Consumer([], high={0: 120, 1: 55})
    r = _repartitioner(consumer, batch_size=20)
    assert r._backlogged({0: 100, 1: 50}) is True  # 20 + 5 waiting
    assert r._backlogged({0: 110, 1: 50}) is False
    assert r._backlogged({3: 7}) is False  # no fetch seen for the partition yet (high -1)


def test_agent_progress_follows_finished_messages_and_the_assignment():
    from types import SimpleNamespace

    from stream_apps.agent_progress import AgentProgress
    from stream_apps.repartition import NOT_READ_HERE, new_agent_progress

    progress = new_agent_progress(3)
    sensor = AgentProgress("app-kv-events-by-ownership", progress)
    sensor.assigned({0, 1})
    assert list(progress) == [-1, -1, NOT_READ_HERE]
    sensor.on_message_out(SimpleNamespace(topic="app-kv-events-by-ownership", partition=1), 41, None)
    sensor.on_message_out(SimpleNamespace(topic="app-residency-changelog", partition=0), 99, None)
    assert list(progress) == [-1, 41, NOT_READ_HERE]
    sensor.assigned({1, 2})  # a partition kept keeps its progress; one that left is no longer waited for
    assert list(progress) == [NOT_READ_HERE, 41, -1]


@pytest.mark.parametrize("implementation", ["python", "compiled"])
def test_each_rekeyed_message_stays_under_the_size_limit_with_the_tables_its_items_index(implementation):
    """A message's block fields index its own sources and strings, and those tables count towards its size:
    2,000 events with distinct 4 KiB localities once made every message repeat the whole batch's tables."""
    from producers.split import Publisher, split_event
    from schemas.avro_writers import encode_clear_mark, encode_ownership_batch
    from schemas.block_event import block_event_of, block_route
    from schemas.ownership_batch import OwnershipBatchReader
    from stream_apps.repartition import MAX_BATCH_BYTES
    from stream_apps.repartition.batches import partition_batches
    from tests.conftest import hotpath_module

    if implementation == "compiled":
        hotpath_module("compiled")
    events = AvroCodec("kv_event")
    records, outgoing = [], partition_batches(implementation == "compiled")[0]
    for n in range(2000):
        event = {"type": "BlockStored", "block_hashes": [n], "parent_block_hash": None, "token_ids": [],
                 "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
                 "locality": f"{n:04d}" * 1024}
        value = events.encode(split_event(Publisher(f"e{n % 3}"), n, 1.0, 0, event)[0])
        records.append(events.decode(value))
        outgoing.add_block(f"primary/{n:016x}".encode(), encode_clear_mark(NO_CLEAR), value, block_route(records[-1]))
    messages = [encode_ownership_batch(BATCH.header, items, tables) for tables, items in outgoing.messages()]
    assert len(messages) > 1 and all(len(m) <= MAX_BATCH_BYTES for m in messages)
    read = [event for m in messages for *_, event in OwnershipBatchReader(events).read(m)]
    assert read == [block_event_of(r) for r in records]
    assert all(type(event) is tuple for event in read)  # every item came with its block fields


@pytest.mark.parametrize("seed", range(3))
def test_the_compiled_batch_writes_the_messages_the_python_batch_writes(seed):
    """schemas._hotpath.BlockBatch, the compiled loop's batch, against PartitionBatch: random block items and
    items without block fields, some large enough to start new messages, give the same messages and tables."""
    from schemas.block_event import R_GROUP_IDX, block_route
    from stream_apps.repartition.batches import partition_batches
    from tests.conftest import hotpath_module
    from tests.unit.test_ownership_batch_reader import _records

    hotpath_module("compiled")
    rng = random.Random(seed)
    compiled, python = partition_batches(True)[0], partition_batches(False)[0]
    assert type(compiled).__name__ == "BlockBatch" and type(python).__name__ == "PartitionBatch"
    for n, record in enumerate(_records(rng, 400)):
        value = bytes(rng.choice([10, 100, 300_000]))
        mark = rng.choice([b"\x00", b"\x02\x04\x06\x08"])
        if rng.random() < 0.1:
            for batch in (compiled, python):
                batch.add(f"clear/e{n}/0", mark, value)
            continue
        route = block_route(record)
        if rng.random() < 0.05:
            route[R_GROUP_IDX] = -1  # no block fields: the item carries the record only
        content = rng.choice([None, 5])
        for batch in (compiled, python):
            batch.add_block(f"primary/{n:x}".encode(), mark, value, list(route), content)
    assert len(python.messages()) > 3
    assert compiled.messages() == python.messages()


def test_a_store_without_content_hash_gets_one_in_the_repartition_process_and_others_keep_theirs():
    """Records of a v3 producer (or an old capture) have no content hash: the repartition process gives each store
    with tokens the one its tokens and extra keys give, so every input reaches the agent with content keys. A store
    that has one keeps it, and a store without tokens gets none, nor does a vLLM store without ``extra_keys`` (it
    does not say its extra keys), of any version."""
    from types import SimpleNamespace

    from producers.split import CONTENT_HASHES, Publisher, split_event
    from schemas.block_event import BlockEvent
    from schemas.content_hash import content_hash
    from schemas.ownership_batch import OwnershipBatchReader

    v3, v4 = AvroCodec("kv_event", 3), AvroCodec("kv_event")
    store = {"type": "BlockStored", "block_hashes": [0x51, 0x52], "parent_block_hash": 0x50,
             "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None,
             "extra_keys": [None, None]}
    unsaid = {**store, "block_hashes": [0x55], "token_ids": list(range(4))}
    del unsaid["extra_keys"]
    values = []
    for event in (store, unsaid):
        for record in split_event(Publisher("old"), 0, 1.0, 0, event):  # as a v3 producer wrote them
            body = {k: v for k, v in record["event"][1].items() if k != "content_hash"}
            values.append(v3.encode({**record, "event": (record["event"][0], body)}))
    given = {**store, "block_hashes": [0x53], "token_ids": [], "block_size": 512, CONTENT_HASHES: [77],
             "extra_keys": [None]}
    placeholder = {**store, "block_hashes": [0x54], "parent_block_hash": None, "token_ids": [], "block_size": 0,
                   "medium": "CPU", "extra_keys": [None]}
    values += [v4.encode(split_event(Publisher("new"), 0, 1.0, i, e)[0])
               for i, e in enumerate([given, placeholder, {**unsaid, "block_hashes": [0x56]}])]
    messages = [SimpleNamespace(error=lambda: None, partition=lambda: 0, offset=lambda n=n: n, value=lambda v=v: v,
                                key=lambda: None, topic=lambda: "kv-events") for n, v in enumerate(values)]
    produced = []
    producer = SimpleNamespace(produce=lambda topic, value, key, **kwargs: produced.append((topic, value)),
                               flush=lambda *args: 0)
    r = _repartitioner(SimpleNamespace(commit=lambda **kwargs: None), producer=producer,
                       counters={"repartitioned": 0, "dead_lettered": 0})
    r.process(messages)
    reader = OwnershipBatchReader(v4)
    events = [BlockEvent._make(event) for topic, value in produced if topic == r.output_topic
              for *_, event in reader.read(value)]
    assert sorted((e.block_hash[-1], e.parent_block_hash, e.content_hash) for e in events) == [
        (0x51, (0x50).to_bytes(8, "big"), content_hash(range(4))),
        (0x52, (0x51).to_bytes(8, "big"), content_hash(range(4, 8))),
        (0x53, (0x50).to_bytes(8, "big"), 77), (0x54, None, None), (0x55, (0x50).to_bytes(8, "big"), None),
        (0x56, (0x50).to_bytes(8, "big"), None)]


@pytest.mark.parametrize("seed", range(4))
def test_the_compiled_loop_rekeys_every_record_exactly_as_the_python_loop_does(seed, monkeypatch):
    """The repartition stage re-keys most block events in the compiled loop, read by the compiled projection
    (route fields only), and hands the rest to the Python loop's step, which decodes them. On random block
    events of every kind of field (stores of replicated sources, stores without content hash, full report
    mode), clears, another version's records and bytes that are no record, the messages, clear histories and
    dead letters it produces are byte for byte those of decoding every record, and of the pure-Python path."""
    from types import SimpleNamespace

    from producers.split import Publisher, split_event
    from schemas.block_event import R_KIND, ROUTE_SLOTS, BlockEvent
    from schemas.ownership_batch import OwnershipBatchReader
    from schemas.topics import TopicNames
    from stream_apps.residency import needs_content, source_aggregation
    from tests.conftest import hotpath_module
    from tests.unit.test_ownership_batch_reader import _records

    compiled = hotpath_module("compiled")
    monkeypatch.setattr("schemas.compiled.HOTPATH", compiled)
    rng = random.Random(seed)
    events, v3 = AvroCodec("kv_event"), AvroCodec("kv_event", 3)
    values = [events.encode(record) for record in _records(rng, 300)]
    clear = split_event(Publisher("e1"), 7, 1.0, 0, {"type": "AllBlocksCleared"})[0]
    for _ in range(5):
        values.insert(rng.randrange(len(values)), events.encode(clear))
    # v5 stores that carry tokens but no content hash (a bridge of kv_event v4's first days): the hash is computed
    stores = [r for r in _records(rng, 40) if r["event"][0] == "kvstream.v1.BlockStored"]
    for record in stores:
        record["event"][1].update(content_hash=None, token_ids=[rng.randrange(1000) for _ in range(4)])
    values += [events.encode(record) for record in stores]
    old = {k: v for k, v in _records(rng, 1)[0].items()}
    old["event"] = (old["event"][0], {k: v for k, v in old["event"][1].items()
                                      if k not in ("content_hash", "report_mode", "parent_known")})
    values += [v3.encode({k: v for k, v in old.items() if k not in ("worker_rank", "world_size", "aggregation")}),
               b"", b"not a record", values[0][:-1], values[1] + b"\x00"]
    project = events.own_version_projection(ROUTE_SLOTS)
    projected = [project(v) for v in values]
    assert sum(p is not None and p[R_KIND] in ("kvstream.v1.BlockStored", "kvstream.v1.BlockRemoved")
               for p in projected) > 100  # most go the projection's way

    def rekeyed(implementation: str) -> list:
        messages = [SimpleNamespace(error=lambda: None, partition=lambda n=n: n % 2, offset=lambda n=n: n,
                                    value=lambda v=v: v, key=lambda: None, topic=lambda: "kv-events")
                    for n, v in enumerate(values)]
        produced = []
        producer = SimpleNamespace(produce=lambda topic, value, key=None, **kwargs: produced.append(
            (topic, value, key, kwargs.get("partition"), kwargs.get("headers"))), flush=lambda *args: 0)
        monkeypatch.setattr("schemas.compiled.HOTPATH", None if implementation == "python" else compiled)
        r = _repartitioner(SimpleNamespace(commit=lambda **kwargs: None), producer=producer,
                           counters={"repartitioned": 0, "dead_lettered": 0},
                           aggregation={"engine-é7": (4, "REPLICATED")})
        assert (r._project is not None) is (implementation != "python")
        if implementation == "decoded":  # the compiled batches, every record decoded by the Python loop
            r._project = None
        r.process(messages)
        return produced

    with_projection, decoded, python = rekeyed("compiled"), rekeyed("decoded"), rekeyed("python")
    assert with_projection == decoded == python
    topics = TopicNames("unit")
    assert sum(topic == topics.dead_letter for topic, *_ in decoded) == 4  # the four values that are no record
    assert {topic for topic, *_ in decoded} == {topics.by_ownership, topics.source_clears, topics.dead_letter}
    # the stores of replicated sources carry their content digest, and nothing else does
    reader = OwnershipBatchReader(events)
    read = [BlockEvent._make(event) for topic, value, *_ in with_projection if topic == topics.by_ownership
            for *_, event in reader.read(value) if type(event) is tuple]
    replicated = [e for e in read if e.kind != "kvstream.v1.BlockRemoved" and needs_content(
        e.kind, source_aggregation(e.source, {"engine-é7": (4, "REPLICATED")}.get(e.source.instance_id)))]
    assert replicated and all(e.content is not None for e in replicated)
    assert all(e.content is None for e in read if e not in replicated)


@pytest.mark.parametrize("nice", [-1, 20])
def test_repartition_process_refuses_a_niceness_outside_0_to_19(nice):
    with pytest.raises(ValueError, match="expected 0 to 19"):
        RepartitionProcess("127.0.0.1:9", TopicNames("kvstream"), 8, nice=nice)
