"""The analytics path against a pipeline run: ``kvstream export`` reproduces the simulator's ground truth,
``kvstream report --as-of`` equals a replay of the changes up to that time (and the simulator's state then),
docs/analytics.md's DuckDB and pandas lines give the same occupancy, and ``kvstream tail`` decodes every topic
the pipeline writes.

One worker runs for the module, on a topic prefix of its own (so its sim-* instances never meet those of
test_pipeline.py), over a slice of the trace with small pools (blocks cascade GPU -> CPU -> KVCR and are
evicted) and a GPU reset; a publisher restart through the bridge fills the publisher-epochs table.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
import time
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from kafka_io.admin import ensure_topics
from kafka_io.reader import messages_to_end
from kvstream.broker import free_port
from kvstream.cli import main
from kvstream.tail import tail
from kvstream.worker import spawn_worker, stop_worker, wait_until_consumed
from producers.bridge import Bridge, BridgeMetrics, KafkaBatchSink, PublisherEndpoint
from producers.kafka_sink import KvEventProducer
from producers.simulator import TRACE_START_TS, ClusterSimulator, FleetConfig, load_trace, replay_to_kafka
from schemas import AvroCodec
from schemas.topics import TABLE_FAMILIES
from stream_apps.settings import WorkerSettings

pytestmark = pytest.mark.integration

PARTITIONS = 3
REQUESTS = 500
FLEET = FleetConfig(gpu_blocks=600, cpu_blocks=900, kvcr_blocks=1200, clear_instance=1, clear_at=0.6)
DOC = Path(__file__).resolve().parents[2] / "docs" / "analytics.md"


def _publish_restart(bootstrap: str, topic: str) -> None:
    """engine-r's seq goes back to 0 through the bridge: a PublisherRestarted (table publisher-epochs)."""
    sink = KafkaBatchSink(KvEventProducer(bootstrap, topic), BridgeMetrics())
    bridge = Bridge([], sink)
    endpoint = PublisherEndpoint("file:engine-r", None, "engine-r")
    stored = {"type": "BlockStored", "block_hashes": [0xAA], "parent_block_hash": None, "token_ids": [],
              "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0}
    bridge.on_live(endpoint, 0, msgspec.msgpack.encode([1767230000.0, [stored], 0]))
    bridge.on_live(endpoint, 1, msgspec.msgpack.encode([1767230001.0, [{**stored, "block_hashes": [0xAB]}], 0]))
    bridge.on_live(endpoint, 0, msgspec.msgpack.encode([1767230002.0, [{**stored, "block_hashes": [0xAC]}], 0]))
    sink.producer.flush(30)


@pytest.fixture(scope="module")
def pipeline(kafka_bootstrap, tmp_path_factory):
    work = tmp_path_factory.mktemp("analytics")
    settings = WorkerSettings(bootstrap_servers=kafka_bootstrap, app_id="analytics", partitions=PARTITIONS,
                              topic_prefix=f"analytics{int(time.time() * 1000)}.", web_port=free_port(),
                              data_dir=work / "data", residency_changes=True)
    topics = settings.topics
    ensure_topics(kafka_bootstrap, {topics.kv_events: PARTITIONS, topics.dead_letter: 1})
    requests = load_trace(limit=REQUESTS)
    result = replay_to_kafka(requests, KvEventProducer(kafka_bootstrap, topics.kv_events), FLEET)
    _publish_restart(kafka_bootstrap, topics.kv_events)
    process = spawn_worker(settings, work / "worker.log")
    try:
        wait_until_consumed(kafka_bootstrap, topics, process, timeout_s=180)
    except Exception:
        print((work / "worker.log").read_text()[-5000:])
        stop_worker(process)
        raise
    stop_worker(process)  # everything below reads Kafka only
    flags = ["--bootstrap-servers", kafka_bootstrap, "--app-id", settings.app_id,
             "--topic-prefix", settings.topic_prefix]
    yield {"settings": settings, "requests": requests, "result": result, "work": work, "flags": flags}


@pytest.fixture(scope="module")
def exported(pipeline):
    """The changes and the residency table, exported to Parquet by the command line."""
    work, flags = pipeline["work"], pipeline["flags"]
    changes, residency = work / "changes.parquet", work / "residency.parquet"
    assert main(["export", "kv-residency-changes", *flags, "--output", str(changes)]) == 0
    assert main(["export", "residency", *flags, "--output", str(residency)]) == 0
    return {"changes": changes, "residency": residency}


def _identity(row: dict) -> tuple:
    """A residency row's identity as the simulator's ground truth writes it."""
    return (row["instance_id"], row["data_parallel_rank"], row["tier"], row["ownership"], row["locality"],
            row["group_idx"], bytes.fromhex(row["block_hash"]))


def _simulated(rows: dict) -> dict:
    return {identity: copies for identity, copies in rows.items() if identity[0].startswith("sim-")}


def test_exported_parquet_reproduces_the_simulators_ground_truth(pipeline, exported):
    import pyarrow as pa
    import pyarrow.parquet as pq

    changes = pq.read_table(exported["changes"])
    timestamp = pa.timestamp("us", tz="UTC")
    assert {name: changes.schema.field(name).type for name in ("block_hash", "ownership", "locality", "ts",
                                                                "resident", "copies")} == {
        "block_hash": pa.string(), "ownership": pa.string(), "locality": pa.string(), "ts": timestamp,
        "resident": pa.bool_(), "copies": pa.int32()}
    assert changes.schema.field("ownership").nullable and changes.schema.field("locality").nullable
    rows = changes.to_pylist()
    assert all(re.fullmatch(r"[0-9a-f]{16}", row["block_hash"]) for row in rows)
    assert {row["ownership"] for row in rows} == {None, "kvcr"}
    # the last change of each row (all of a row's changes are on one partition, in offset order) decides
    last: dict[tuple, dict] = {}
    for row in sorted(rows, key=lambda r: (r["partition"], r["offset"])):
        last[_identity(row)] = row
    replayed = {identity: row["copies"] for identity, row in last.items() if row["resident"]}
    truth = pipeline["result"].ground_truth
    assert _simulated(replayed) == truth
    assert {identity[2] for identity in truth} == {"GPU", "CPU", "STORAGE"}
    first = min(row["ts"] for row in rows if row["instance_id"].startswith("sim-"))
    assert first.timestamp() == TRACE_START_TS + pipeline["requests"][0].timestamp_ms / 1000

    snapshot = pq.read_table(exported["residency"])
    assert snapshot.schema.field("since").type == timestamp and snapshot.schema.field("block_hash").type == pa.string()
    assert _simulated({_identity(row): row["copies"] for row in snapshot.to_pylist()}) == truth


def _replay_topic(bootstrap: str, topic: str, as_of: float) -> Counter:
    """Resident rows per (ownership, tier, instance) from the changes with ts <= as_of, read straight from the
    topic: the last change of each row decides."""
    codec = AvroCodec("residency_change")
    last: dict[tuple, bool] = {}
    for message in messages_to_end(bootstrap, topic):
        c = codec.decode(message.value())
        if c["ts"] <= as_of:
            last[(c["instance_id"], c["data_parallel_rank"], c["tier"], c["ownership"], c["locality"],
                  c["group_idx"], c["block_hash"])] = c["resident"]
    return Counter((o, t, i) for (i, _, t, o, *_), resident in last.items() if resident)


def _simulated_until(requests, last_index: int) -> Counter:
    """The simulator's residency per (ownership, tier, instance) once requests[0..last_index] are served, with
    the module's fleet (the GPU reset at the same request as in the full run)."""
    reset_at = int(len(requests) * FLEET.clear_at)
    served = requests[:last_index + 1]
    clear_at = (reset_at + 0.5) / len(served) if reset_at < len(served) else 2.0  # 2.0: no reset among them
    simulator = ClusterSimulator(dataclasses.replace(FLEET, clear_at=clear_at))
    for _ in simulator.run(served):
        pass
    return Counter((o, t, i) for (i, _, t, o, *_) in simulator.ground_truth())


@pytest.mark.parametrize("fraction", [0.35, 0.8])
def test_report_as_of_occupancy_equals_a_replay_up_to_that_time(pipeline, exported, tmp_path, fraction):
    requests = pipeline["requests"]
    assert [r.timestamp_ms for r in requests] == sorted(r.timestamp_ms for r in requests)
    index = int(len(requests) * fraction)
    while requests[index + 1].timestamp_ms == requests[index].timestamp_ms:  # every request of that instant
        index += 1
    as_of = TRACE_START_TS + requests[index].timestamp_ms / 1000
    out = tmp_path / "report"
    assert main(["report", str(exported["changes"]), "--as-of", str(as_of), "--output-dir", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["as_of_s"] == as_of
    reported = Counter({(r["ownership"], r["tier"], r["instance_id"]): r["resident_blocks"]
                        for r in summary["occupancy_as_of"]})
    settings = pipeline["settings"]
    assert reported == _replay_topic(settings.bootstrap_servers, settings.topics.residency_changes, as_of)
    # ... and the fleet as simulated then, but for the instance that resets its GPU cache (sim-1): its
    # changes are exact at the end, not at every time around the reset. Before it, its stores that reach their
    # partition after the reset's copy are never applied (no change); after it, a row stored again before the
    # reset's copy reaches the row's partition is reset without a change (docs/analytics.md, "kvstream report")
    left_out = {f"sim-{FLEET.clear_instance}"}
    simulated = _simulated_until(requests, index)
    assert +simulated  # a fleet with blocks in it
    assert ({k: n for k, n in reported.items() if k[2].startswith("sim-") and k[2] not in left_out}
            == {k: n for k, n in simulated.items() if k[2] not in left_out})
    for name in ("resident_blocks.png", "dwell_time.png", "tier_transitions.png", "occupancy_as_of.png",
                 "overview.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert summary["transitions"] and summary["tiers"]["GPU"]["dwell_s_median"] > 0


def test_report_reads_the_topic_as_it_reads_the_export(pipeline, exported, tmp_path):
    from_file, from_topic = tmp_path / "file", tmp_path / "topic"
    assert main(["report", str(exported["changes"]), "--output-dir", str(from_file)]) == 0
    assert main(["report", *pipeline["flags"], "--output-dir", str(from_topic)]) == 0
    by_file = json.loads((from_file / "summary.json").read_text())
    by_topic = json.loads((from_topic / "summary.json").read_text())
    # Parquet keeps times to the microsecond, the topic as doubles: the same figures within that
    for key in ("changes", "repeated_changes", "first_ts", "last_ts", "as_of", "transitions", "occupancy_as_of"):
        assert by_file[key] == by_topic[key], key
    assert by_file["as_of_s"] == pytest.approx(by_topic["as_of_s"], abs=1e-6)
    for tier, figures in by_topic["tiers"].items():
        assert by_file["tiers"][tier] == pytest.approx(figures, abs=1e-5), tier
    # after the last change, the occupancy is the final residency: the ground truth's, counted
    truth = Counter((o, t, i) for (i, _, t, o, *_) in pipeline["result"].ground_truth)
    assert {(r["ownership"], r["tier"], r["instance_id"]): r["resident_blocks"] for r in by_topic["occupancy_as_of"]
            if r["instance_id"].startswith("sim-")} == truth


def test_the_docs_duckdb_and_pandas_lines_give_the_occupancy(pipeline, exported, monkeypatch):
    snippet = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    monkeypatch.chdir(exported["changes"].parent)  # the snippet reads changes.parquet and residency.parquet
    namespace: dict = {}
    exec(compile(snippet, str(DOC), "exec"), namespace)
    occupancy = {(r.ownership, r.tier, r.instance_id): r.resident_blocks for r in namespace["occupancy"].itertuples()}
    replayed = {(r.ownership, r.tier, r.instance_id): r.resident_blocks for r in namespace["replayed"].itertuples()}
    truth = Counter((o or "primary", t, i) for (i, _, t, o, *_) in pipeline["result"].ground_truth)
    assert {k: n for k, n in occupancy.items() if k[2].startswith("sim-")} == truth
    assert occupancy == replayed
    assert len(namespace["changes"]) > len(namespace["residency"]) > 0


def test_export_stops_at_an_offset_and_writes_json_lines(pipeline, tmp_path):
    path = tmp_path / "first.jsonl"
    assert main(["export", "kv-residency-changes", *pipeline["flags"], "--format", "jsonl", "--output", str(path),
                 "--until-offset", "0:10,2:5"]) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert Counter(row["partition"] for row in rows)[0] == 10 and Counter(row["partition"] for row in rows)[2] == 5
    assert Counter(row["partition"] for row in rows)[1] > 10  # not named: read to its end
    assert all(row["ts"].startswith("2026-01-01T") and row["ts"].endswith("Z") for row in rows)


def test_tail_decodes_every_topic_the_pipeline_writes(pipeline):
    topics = pipeline["settings"].topics
    names = [topics.kv_events, topics.by_ownership, topics.source_clears, topics.residency_changes,
             topics.tier_occupancy, *(topics.changelog(table) for table in TABLE_FAMILIES)]
    for name in names:
        out = io.StringIO()
        printed = tail(pipeline["settings"].bootstrap_servers, name, from_beginning=True, max_messages=300,
                       idle_timeout_s=10, to_end=True, out=out)
        lines = [json.loads(line) for line in out.getvalue().splitlines()]
        assert printed == len(lines) > 0, name
        assert all(isinstance(line["value"], dict) and "error" not in line for line in lines
                   if line["value"] is not None), name
    out = io.StringIO()
    tail(pipeline["settings"].bootstrap_servers, topics.changelog("publisher-epochs"), from_beginning=True,
         max_messages=None, idle_timeout_s=10, to_end=True, out=out)
    epochs = [json.loads(line)["value"] for line in out.getvalue().splitlines()]
    assert {value["instance_id"] for value in epochs if value} == {"engine-r"}


def test_tail_export_and_report_take_the_apps_topics_by_their_short_names(pipeline, tmp_path, capsys):
    """Issue 28: export took kv-residency-changes, tail only <app id>-kv-residency-changes."""
    topics, flags = pipeline["settings"].topics, pipeline["flags"]  # an app id and a topic prefix of its own
    for short, full in (("kv-residency-changes", topics.residency_changes), ("kv-events", topics.kv_events),
                        ("residency-changelog", topics.changelog("residency"))):
        assert main(["tail", short, *flags, "--from-beginning", "--max-messages", "3"]) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert len(lines) == 3 and {line["topic"] for line in lines} == {full}, short
        assert all("error" not in line for line in lines)
    by_short, by_full = tmp_path / "short.jsonl", tmp_path / "full.jsonl"
    assert main(["export", "residency-changelog", *flags, "--format", "jsonl", "--output", str(by_short)]) == 0
    assert main(["export", topics.changelog("residency"), *flags, "--format", "jsonl", "--output", str(by_full)]) == 0
    assert sorted(by_short.read_text().splitlines()) == sorted(by_full.read_text().splitlines()) != []
    assert main(["report", "kv-residency-changes", *flags, "--output-dir", str(tmp_path / "report")]) == 0
    assert json.loads((tmp_path / "report" / "summary.json").read_text())["source"] == topics.residency_changes
    # a table's name is no topic's, and the error says which topic holds the table
    assert main(["tail", "residency", *flags, "--from-beginning", "--max-messages", "1"]) != 0
    assert "the residency table is kept in the topic residency-changelog" in capsys.readouterr().err
