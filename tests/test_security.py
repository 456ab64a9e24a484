"""The pipeline against a broker that requires SASL SCRAM-SHA-512, configured from the environment only."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from kvstream import broker
from kvstream.kafka_config import ensure_topics
from kvstream.worker import WorkerOptions, spawn_worker, stop_worker, wait_until_consumed
from producers.kafka_sink import KvEventProducer
from producers.simulator import FleetConfig, load_trace, replay_to_kafka
from schemas.topics import KV_EVENTS
from stream_apps.snapshot import changelog_topic, compare_rows, read_table, resident_rows
from tests.broker_fixture import free_port

pytestmark = pytest.mark.integration

USER, PASSWORD = "kvstream-test", f"pw-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def scram_bootstrap(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("scram-broker")
    try:
        status = broker.start(port=free_port(), data_dir=data_dir, scram_user=(USER, PASSWORD))
        with pytest.MonkeyPatch.context() as env:  # every client of the project reads these
            env.setenv("KVSTREAM_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
            env.setenv("KVSTREAM_SASL_MECHANISM", "SCRAM-SHA-512")
            env.setenv("KVSTREAM_SASL_USERNAME", USER)
            env.setenv("KVSTREAM_SASL_PASSWORD", PASSWORD)
            yield status.bootstrap_servers, data_dir
    finally:
        broker.stop(data_dir)


def test_a_client_without_credentials_is_refused(scram_bootstrap):
    bootstrap, _ = scram_bootstrap
    with pytest.raises(KafkaException):
        AdminClient({"bootstrap.servers": bootstrap, "security.protocol": "SASL_PLAINTEXT",
                     "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": USER,
                     "sasl.password": "wrong"}).list_topics(timeout=5)


def test_pipeline_runs_with_scram_and_never_logs_the_password(scram_bootstrap):
    bootstrap, data_dir = scram_bootstrap
    ensure_topics(bootstrap, {KV_EVENTS: 2})
    fleet = FleetConfig(gpu_blocks=600, cpu_blocks=900, kvcr_blocks=1200, clear_instance=None)
    result = replay_to_kafka(load_trace(limit=150), KvEventProducer(bootstrap, KV_EVENTS), fleet)
    log_file = data_dir / "worker.log"
    options = WorkerOptions(bootstrap, web_port=free_port(), data_dir=data_dir / "worker", partitions=2,
                            app_id="kvstream-scram")
    process = spawn_worker(options, log_file)
    try:
        wait_until_consumed(bootstrap, options.app_id, process, timeout_s=300)
    finally:
        stop_worker(process)
    table = read_table(bootstrap, changelog_topic(options.app_id, "residency"), "residency")
    comparison = compare_rows(result.ground_truth, resident_rows(table))
    assert comparison.differences == [] and comparison.matching == len(result.ground_truth) > 0
    assert PASSWORD not in log_file.read_text()
