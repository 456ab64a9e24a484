"""End-to-end tests of kvstream.broker against a real broker (see tests/broker_fixture.py)."""

from __future__ import annotations

import time
import uuid
import zipfile

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from kvstream.broker import KAFKA_VERSION, TOOLS, ensure_jars, run_tool, status
from tests.broker_fixture import kafka_backend

pytestmark = pytest.mark.integration


def _create_topic(bootstrap: str, partitions: int = 1) -> str:
    topic = f"test-broker-{uuid.uuid4().hex[:12]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})  # must outlive the future
    admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(timeout=30)
    return topic


def test_broker_answers(kafka_bootstrap: str) -> None:
    metadata = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=10)
    assert len(metadata.brokers) == 1


def test_produce_and_consume_roundtrip(kafka_bootstrap: str) -> None:
    topic = _create_topic(kafka_bootstrap, partitions=2)
    sent = [f"message-{i}".encode() for i in range(3)]
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "acks": "all"})
    errors: list[object] = []

    def on_delivery(err: object, _msg: object) -> None:
        if err is not None:
            errors.append(err)

    for i, value in enumerate(sent):
        producer.produce(topic, value=value, key=str(i).encode(), on_delivery=on_delivery)
    assert producer.flush(30) == 0
    assert errors == []

    consumer = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": f"test-broker-{uuid.uuid4().hex[:12]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    received: list[bytes] = []
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + 30
        while len(received) < len(sent) and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None:
                assert msg.error() is None, msg.error()
                received.append(msg.value())
    finally:
        consumer.close()
    assert sorted(received) == sent


def test_tool_main_classes_exist() -> None:
    classes: set[str] = set()
    for jar in ensure_jars().glob("*.jar"):
        with zipfile.ZipFile(jar) as zf:
            classes.update(n[:-6].replace("/", ".") for n in zf.namelist() if n.endswith(".class"))
    assert {"kafka.Kafka", *TOOLS.values()} <= classes


def test_run_tool_lists_topic(kafka_bootstrap: str) -> None:
    topic = _create_topic(kafka_bootstrap)
    result = run_tool("topics", ["--bootstrap-server", kafka_bootstrap, "--list"], capture=True, timeout_s=60)
    assert result.returncode == 0, result.stderr
    assert topic in result.stdout.split()


def test_status_reports_running_broker(kafka_bootstrap: str, request: pytest.FixtureRequest) -> None:
    backend = kafka_backend(request.config)
    if backend is None or backend.data_dir is None:
        pytest.skip("status() only describes the embedded broker")
    st = status(backend.data_dir)
    assert st.running and st.pid
    assert st.bootstrap_servers == kafka_bootstrap
    assert st.port == int(kafka_bootstrap.rsplit(":", 1)[1])
    assert st.kafka_version == KAFKA_VERSION
    assert st.log_file.is_file()
    assert "Kafka" in st.log_file.read_text()
