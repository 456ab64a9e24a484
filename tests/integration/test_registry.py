"""Registry mode and forward compatibility (docs/registry.md), through the session's broker and schema registry
(Apicurio, tests/registry_fixture.py) and real workers.

* The pipeline's topics in registry mode are read by confluent-kafka's own ``AvroDeserializer`` and by kcat.
* A schema change that breaks BACKWARD compatibility is refused when a producer starts, with the reason.
* A newer producer's schema (one more ``Tier`` symbol) is read by today's worker, through the registry and,
  without one, through the schemas topic: nothing dead-lettered, residency as produced.
* A topic can switch framing without a stop: the registry-mode worker reads single-object records too.
"""

from __future__ import annotations

import copy
import io
import json
import shutil
import struct
import subprocess
import sys
import time
import urllib.request

import fastavro
import pytest
from confluent_kafka import Producer
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from kafka_io.admin import ensure_topics
from kafka_io.config import producer_config
from kafka_io.reader import messages_to_end
from kafka_io.schema_registry import publish_schema
from kvstream.broker import free_port
from kvstream.worker import spawn_worker, stop_worker, wait_until_consumed
from producers.bridge import BridgeMetrics, KafkaBatchSink
from producers.capture import produce_capture
from producers.kafka_sink import KvEventProducer
from producers.settings import ProduceSettings
from producers.split import Publisher, split_event
from schemas.codec import SINGLE_OBJECT_MAGIC, SchemaVersion, schema_fingerprint, schema_versions
from stream_apps.settings import WorkerSettings

pytestmark = pytest.mark.integration

PARTITIONS = 2
TS = 1767225600.0


def _stored(hashes: list[int], medium: str = "GPU") -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": list(range(2 * len(hashes))), "block_size": 2, "lora_id": None, "medium": medium,
            "lora_name": None}


def _removed(hashes: list[int], medium: str = "GPU") -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def _capture(path, instance: str) -> None:
    """Five blocks stored on GPU, two offloaded to CPU, one GPU copy removed: GPU 4, CPU 2."""
    lines = [{"instance_id": instance, "data_parallel_rank": 0, "seq": 0, "ts": TS,
              "events": [_stored([0x101, 0x102, 0x103, 0x104, 0x105])]},
             {"instance_id": instance, "data_parallel_rank": 0, "seq": 1, "ts": TS + 1,
              "events": [_stored([0x101, 0x102], "CPU"), _removed([0x103])]}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _newer_kv_event() -> dict:
    """kv_event as a newer producer might write it: today's schema plus a ``Tier`` symbol ``HBM``."""
    schema = copy.deepcopy(json.loads(schema_versions("kv_event")[-1].text))
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "enum" and node.get("name") == "Tier":
                node["symbols"].append("HBM")
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema


def _newer_records(instance: str) -> list[dict]:
    """Three GPU stores and one HBM store of ``instance``, as records of the newer schema."""
    publisher = Publisher(instance, 0, publisher_epoch=1)
    records = split_event(publisher, 0, TS, 0, _stored([0x201, 0x202, 0x203]))
    hbm = split_event(publisher, 1, TS + 1, 0, _stored([0x204], "HBM"))
    for record in hbm:
        record["tier"] = "HBM"  # the newer producer's own tier for the medium
    return records + hbm


def _produce_framed(bootstrap: str, topic: str, header: bytes, schema: dict, records: list[dict]) -> None:
    parsed = fastavro.parse_schema(schema)
    producer = Producer(producer_config(bootstrap))
    for record in records:
        body = io.BytesIO()
        fastavro.schemaless_writer(body, parsed, record)
        producer.produce(topic, key=record["block_hash"], value=header + body.getvalue())
    assert producer.flush(30) == 0


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _occupancy(url: str, instance: str) -> dict[str, int]:
    return {r["tier"]: r["resident_blocks"] for r in _get(f"{url}/occupancy/")["occupancy"]
            if r["instance_id"] == instance}


def _worker(kafka_bootstrap, work, prefix: str, registry_url: str):
    settings = WorkerSettings(bootstrap_servers=kafka_bootstrap, app_id="reg", partitions=PARTITIONS,
                              topic_prefix=prefix, web_port=free_port(), data_dir=work / "data",
                              schema_registry_url=registry_url, residency_changes=True)
    return settings, spawn_worker(settings, work / "worker.log")


@pytest.fixture(scope="module")
def registry_pipeline(kafka_bootstrap, schema_registry_url, tmp_path_factory):
    """A capture and a newer producer's records, both through the registry, read by a registry-mode worker."""
    work = tmp_path_factory.mktemp("registry")
    prefix = f"reg{int(time.time() * 1000)}."
    capture = work / "capture.jsonl"
    _capture(capture, "reg-e")
    settings = ProduceSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix, partitions=PARTITIONS,
                               jsonl=capture, schema_registry_url=schema_registry_url)
    producer = KvEventProducer.from_settings(settings)
    metrics = BridgeMetrics()
    produce_capture(capture, KafkaBatchSink(producer, metrics), metrics)
    producer.flush()
    newer = _newer_kv_event()
    client = SchemaRegistryClient({"url": schema_registry_url})
    schema_id = client.register_schema(f"{settings.events_topic}-value", Schema(json.dumps(newer), "AVRO"))
    _produce_framed(kafka_bootstrap, settings.events_topic, b"\x00" + struct.pack(">I", schema_id), newer,
                    _newer_records("newer-reg"))
    worker_settings, process = _worker(kafka_bootstrap, work, prefix, schema_registry_url)
    try:
        wait_until_consumed(kafka_bootstrap, worker_settings.topics, process, timeout_s=180)
        yield {"settings": worker_settings, "process": process, "work": work, "producer_settings": settings,
               "url": f"http://127.0.0.1:{worker_settings.web_port}"}
    finally:
        stop_worker(process)


def test_confluents_deserializer_reads_every_record_of_the_pipelines_topics(registry_pipeline, kafka_bootstrap,
                                                                         schema_registry_url):
    topics = registry_pipeline["settings"].topics
    deserialize = AvroDeserializer(SchemaRegistryClient({"url": schema_registry_url}))
    decoded, latest = {}, {}
    for topic in (topics.kv_events, topics.residency_changes, topics.tier_occupancy):
        messages = list(messages_to_end(kafka_bootstrap, topic))
        assert messages, topic
        assert all(m.value()[:1] == b"\x00" for m in messages), f"{topic}: not all in the Confluent wire format"
        decoded[topic] = [deserialize(m.value(), SerializationContext(topic, MessageField.VALUE)) for m in messages]
        latest[topic] = {(m.partition(), m.key()): value for m, value in zip(messages, decoded[topic])}
    events = decoded[topics.kv_events]
    assert sum(e["instance_id"] == "reg-e" for e in events) == 8  # 5 + 2 stores, 1 removal
    assert {e["tier"] for e in events if e["instance_id"] == "newer-reg"} == {"GPU", "HBM"}  # the writer's view
    changes = [c for c in decoded[topics.residency_changes] if c["instance_id"] == "reg-e"]
    resident = {}
    for change in changes:
        resident[change["tier"]] = resident.get(change["tier"], 0) + (1 if change["resident"] else -1)
    assert resident == {"GPU": 4, "CPU": 2}
    occupancy: dict[str, int] = {}
    for row in latest[topics.tier_occupancy].values():  # counted per partition: sum each key's latest
        if row["instance_id"] == "reg-e":
            occupancy[row["tier"]] = occupancy.get(row["tier"], 0) + row["resident_blocks"]
    assert occupancy == {"GPU": 4, "CPU": 2} == _occupancy(registry_pipeline["url"], "reg-e")


def _kcat_with_avro() -> str | None:
    for candidate in ("/opt/kcat-avro/bin/kcat", shutil.which("kcat"), shutil.which("kafkacat")):
        if candidate and shutil.which(candidate):
            help_text = subprocess.run([candidate, "-h"], capture_output=True, text=True, check=False)
            if "avro" in (help_text.stdout + help_text.stderr).lower():
                return candidate
    return None


def test_kcat_prints_the_records_as_json(registry_pipeline, kafka_bootstrap, schema_registry_url):
    kcat = _kcat_with_avro()
    if kcat is None:
        pytest.skip("no kcat with Avro support: Debian's kcat package is built without libserdes "
                    "(kcat -h lists no 'avro' deserializer); see docs/registry.md")
    topics = registry_pipeline["settings"].topics
    for topic in (topics.kv_events, topics.residency_changes, topics.tier_occupancy):
        # -J would need kcat's own fork of yajl; without it kcat prints each value as Avro's JSON encoding
        run = subprocess.run([kcat, "-C", "-b", kafka_bootstrap, "-t", topic, "-s", "value=avro",
                              "-r", schema_registry_url, "-e", "-q", "-f", "%s\n"],
                             capture_output=True, text=True, timeout=60, check=False)
        assert run.returncode == 0, run.stderr
        records = [json.loads(line) for line in run.stdout.splitlines() if line.strip()]
        assert len(records) == len(list(messages_to_end(kafka_bootstrap, topic))), topic
        assert all("instance_id" in record for record in records), topic


def test_the_registry_mode_worker_reads_single_object_records_too(registry_pipeline, kafka_bootstrap, tmp_path):
    """A topic switches framing without a stop: records from a producer without a registry are read too."""
    capture = tmp_path / "plain.jsonl"
    _capture(capture, "plain-e")
    settings = ProduceSettings(bootstrap_servers=kafka_bootstrap, partitions=PARTITIONS, jsonl=capture,
                               topic_prefix=registry_pipeline["producer_settings"].topic_prefix)
    producer = KvEventProducer.from_settings(settings)
    metrics = BridgeMetrics()
    produce_capture(capture, KafkaBatchSink(producer, metrics), metrics)
    producer.flush()
    wait_until_consumed(kafka_bootstrap, registry_pipeline["settings"].topics, registry_pipeline["process"],
                        timeout_s=120)
    assert _occupancy(registry_pipeline["url"], "plain-e") == {"GPU": 4, "CPU": 2}


def test_a_newer_producer_schema_is_read_through_the_registry(registry_pipeline, kafka_bootstrap):
    assert _occupancy(registry_pipeline["url"], "newer-reg") == {"GPU": 3, "UNKNOWN": 1}  # HBM: the enum default
    topics = registry_pipeline["settings"].topics
    assert list(messages_to_end(kafka_bootstrap, topics.dead_letter)) == []


def test_a_newer_producer_schema_is_read_through_the_schemas_topic(kafka_bootstrap, tmp_path):
    prefix = f"fwd{int(time.time() * 1000)}."
    settings = WorkerSettings(bootstrap_servers=kafka_bootstrap, app_id="reg", partitions=PARTITIONS,
                              topic_prefix=prefix)
    topics = settings.topics
    ensure_topics(kafka_bootstrap, {topics.kv_events: PARTITIONS})
    newer = _newer_kv_event()
    parsed = fastavro.parse_schema(copy.deepcopy(newer))
    fingerprint = schema_fingerprint(parsed)
    publish_schema(kafka_bootstrap, topics.schemas,
                   SchemaVersion("kv_event", 99, parsed, text=json.dumps(newer), fingerprint=fingerprint))
    _produce_framed(kafka_bootstrap, topics.kv_events, SINGLE_OBJECT_MAGIC + fingerprint, newer,
                    _newer_records("newer-plain"))
    worker_settings, process = _worker(kafka_bootstrap, tmp_path, prefix, "")
    try:
        wait_until_consumed(kafka_bootstrap, worker_settings.topics, process, timeout_s=180)
        url = f"http://127.0.0.1:{worker_settings.web_port}"
        assert _occupancy(url, "newer-plain") == {"GPU": 3, "UNKNOWN": 1}
        assert list(messages_to_end(kafka_bootstrap, topics.dead_letter)) == []
    finally:
        stop_worker(process)


def test_a_schema_change_that_breaks_backward_compatibility_is_refused_at_start(kafka_bootstrap,
                                                                                 schema_registry_url, tmp_path):
    prefix = f"incompat{int(time.time() * 1000)}."
    # the subject's latest version lacks fields today's kv_event requires without a default (instance_id, ...):
    # today's schema could not read its records, which BACKWARD forbids
    earlier = {"type": "record", "name": "KvBlockEvent", "namespace": "kvstream.v1",
               "fields": [{"name": "note", "type": "string"}]}
    SchemaRegistryClient({"url": schema_registry_url}).register_schema(
        f"{prefix}kv-events-value", Schema(json.dumps(earlier), "AVRO"))
    capture = tmp_path / "one.jsonl"
    _capture(capture, "incompat-e")
    run = subprocess.run([sys.executable, "-m", "kvstream.cli", "produce", f"--jsonl={capture}",
                          f"--bootstrap-servers={kafka_bootstrap}", f"--topic-prefix={prefix}",
                          f"--schema-registry={schema_registry_url}"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "refused kv_event" in run.stderr and "incompatible" in run.stderr.lower(), run.stderr
    assert "Traceback" not in run.stderr
    assert list(messages_to_end(kafka_bootstrap, f"{prefix}kv-events")) == []


def test_every_schema_file_parses_alone_with_avros_java_parser(schema_registry_url):
    """Issue 14, item 5: Avro's Java ``Schema.Parser``, from the jars of the registry the session already
    fetched, parses each .avsc with a parser of its own (a type named but defined in another file fails)."""
    from pathlib import Path

    import schemas
    from kvstream.registry import ensure_registry

    lib = ensure_registry().parent / "lib"
    wanted = ("org.apache.avro.avro-", "com.fasterxml.jackson.core.", "org.slf4j.slf4j-api-",
              "org.apache.commons.commons-compress-")
    classpath = [str(jar) for jar in sorted(lib.glob("*.jar")) if jar.name.startswith(wanted)]
    assert any("org.apache.avro.avro-" in jar for jar in classpath), f"no Avro jar in {lib}"
    files = sorted(str(p) for p in Path(schemas.__file__).parent.glob("*_v*.avsc"))
    source = Path(__file__).resolve().parents[1] / "java" / "ParseSchemas.java"
    run = subprocess.run(["java", "-cp", ":".join(classpath), str(source), *files], capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert [line.split()[1] for line in run.stdout.splitlines() if line.startswith("ok ")] == files


def test_tail_and_export_read_registry_framed_topics(registry_pipeline, kafka_bootstrap, schema_registry_url,
                                                    tmp_path):
    settings = registry_pipeline["settings"]
    topics = settings.topics
    registry = f"--schema-registry={schema_registry_url}"
    run = subprocess.run([sys.executable, "-m", "kvstream.cli", "tail", topics.residency_changes,
                          f"--bootstrap-servers={kafka_bootstrap}", "--from-beginning", "--to-end", registry,
                          f"--topic-prefix={settings.topic_prefix}"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    expected = len(list(messages_to_end(kafka_bootstrap, topics.residency_changes)))
    assert len(lines) == expected and not [line for line in lines if "error" in line]
    assert {line["value"]["instance_id"] for line in lines} >= {"reg-e", "newer-reg"}
    output = tmp_path / "changes.jsonl"
    run = subprocess.run([sys.executable, "-m", "kvstream.cli", "export", "kv-residency-changes", "--format=jsonl",
                          f"--output={output}", f"--bootstrap-servers={kafka_bootstrap}", f"--app-id={settings.app_id}",
                          f"--topic-prefix={settings.topic_prefix}", registry],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert len(output.read_text().splitlines()) == expected
