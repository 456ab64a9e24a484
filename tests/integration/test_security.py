"""The pipeline against a secured broker, every client configured from the environment only.

Three brokers, one per security setting (a module fixture parametrized over them):

- ``SASL_PLAINTEXT``: SCRAM-SHA-512 without TLS;
- ``SASL_SSL``: SCRAM-SHA-512 over TLS; clients trust the broker with the throwaway CA;
- ``SSL-mTLS``: TLS with client certificates (an encrypted client key and its password), no SASL.

Each runs a trace slice through the producer (confluent-kafka), a Faust worker (aiokafka), reads the
residency changelog back with stream_apps.snapshot and ``kvstream tail`` (confluent-kafka), and compares
with the simulator's ground truth; checks that clients with the wrong settings are refused with a clear
reason; and that no secret reaches the worker's log.
"""

from __future__ import annotations

import asyncio
import io
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from kafka_io.admin import ensure_topics, topic_partitions
from kafka_io.config import aiokafka_security, client_config
from kvstream import broker
from kvstream.broker import free_port
from kvstream.tail import tail
from kvstream.tls import TlsMaterial, generate_tls_material
from kvstream.worker import spawn_worker, stop_worker, wait_until_consumed
from producers.kafka_sink import KvEventProducer
from producers.simulator import FleetConfig, load_trace, replay_to_kafka
from schemas.topics import KV_EVENTS, changelog_topic
from stream_apps.settings import WorkerSettings
from stream_apps.snapshot import compare_rows, read_table, resident_rows

pytestmark = pytest.mark.integration

USER, PASSWORD = "kvstream-test", f"pw-{uuid.uuid4().hex}"

#: Security settings under test: id -> (SCRAM user on, TLS on, client certificates required).
MODES = {
    "SASL_PLAINTEXT": (True, False, False),
    "SASL_SSL": (True, True, False),
    "SSL-mTLS": (False, True, True),
}


@dataclass(frozen=True)
class SecuredBroker:
    """One running broker of a :data:`MODES` setting, with the environment its clients get."""

    # MODES key.
    mode: str
    # "127.0.0.1:<port>".
    bootstrap: str
    # Broker data dir (the worker's files go there too).
    data_dir: Path
    # The TLS material of the broker, None without TLS.
    tls: TlsMaterial | None
    # The KVSTREAM_* security variables set for every client of the test (secrets included).
    environment: dict[str, str]

    @property
    def secrets(self) -> list[str]:
        """Strings no log may contain: the SCRAM password, the key password, the private keys' PEM bodies."""
        found = [PASSWORD]
        if self.tls is not None:
            found.append(self.tls.client_key_password)
            for key in (self.tls.client_key, self.tls.broker_key, self.tls.ca_key):
                found += [line for line in key.read_text().splitlines() if len(line) >= 16 and "-----" not in line]
        return found


@pytest.fixture(scope="module", params=list(MODES))
def secured(request, tmp_path_factory) -> SecuredBroker:
    mode = request.param
    scram, use_tls, client_auth = MODES[mode]
    data_dir = tmp_path_factory.mktemp(f"broker-{mode}")
    tls = generate_tls_material(data_dir / "tls") if use_tls else None
    environment = {"KVSTREAM_SECURITY_PROTOCOL": ("SASL_" if scram else "") + ("SSL" if use_tls else "PLAINTEXT")}
    if scram:
        environment.update(KVSTREAM_SASL_MECHANISM="SCRAM-SHA-512", KVSTREAM_SASL_USERNAME=USER,
                           KVSTREAM_SASL_PASSWORD=PASSWORD)
    if tls is not None:
        environment.update(tls.client_environment(client_certificate=client_auth))
    try:
        status = broker.start(port=free_port(), data_dir=data_dir, scram_user=(USER, PASSWORD) if scram else None,
                              tls=tls, require_client_certificate=client_auth, timeout_s=180)
        assert status.security_protocol == environment["KVSTREAM_SECURITY_PROTOCOL"]
        with pytest.MonkeyPatch.context() as env:  # every client of the project reads these
            for name, value in environment.items():
                env.setenv(name, value)
            yield SecuredBroker(mode, status.bootstrap_servers, data_dir, tls, environment)
    finally:
        broker.stop(data_dir)


def _refusal_reasons(bootstrap: str, **changes: str | None) -> str:
    """Connect a project client (client_config) with the environment changed; return librdkafka's errors.

    ``changes``: variable -> new value, or None to remove it (only for this call). Fails the test if the
    client is let in.
    """
    logs = io.StringIO()
    logger = logging.getLogger(f"test-security-{uuid.uuid4()}")  # own logger: the project's drops repeated lines
    logger.addHandler(logging.StreamHandler(logs))
    logger.setLevel(logging.ERROR)
    with pytest.MonkeyPatch.context() as env:
        for name, value in changes.items():
            if value is None:
                env.delenv(name, raising=False)
            else:
                env.setenv(name, value)
        admin = AdminClient(client_config(bootstrap, logger=logger))
    with pytest.raises(KafkaException):
        admin.list_topics(timeout=2)
    admin.poll(0.5)  # serves librdkafka's log queue: the reasons reach the logger
    return logs.getvalue()


def test_clients_with_the_wrong_settings_are_refused_with_a_clear_reason(secured, caplog):
    scram, use_tls, client_auth = MODES[secured.mode]
    if scram:
        assert "Authentication failed" in _refusal_reasons(secured.bootstrap, KVSTREAM_SASL_PASSWORD="wrong")
    if use_tls:
        assert "certificate verify failed" in _refusal_reasons(secured.bootstrap, KVSTREAM_SSL_CA_LOCATION=None)

        async def bootstrap_aiokafka():  # aiokafka (the Faust worker's client) without the CA
            admin = AIOKafkaAdminClient(bootstrap_servers=secured.bootstrap, **aiokafka_security())
            try:
                await admin.start()
            finally:
                await admin.close()

        with pytest.MonkeyPatch.context() as env:
            env.delenv("KVSTREAM_SSL_CA_LOCATION")
            with pytest.raises(KafkaConnectionError), caplog.at_level(logging.ERROR, logger="aiokafka"):
                asyncio.run(bootstrap_aiokafka())
        assert "CERTIFICATE_VERIFY_FAILED" in caplog.text
        with pytest.MonkeyPatch.context() as env:  # the project's own error points at the settings
            env.delenv("KVSTREAM_SSL_CA_LOCATION")
            with pytest.raises(RuntimeError, match="did not answer.*KVSTREAM_SSL_"):
                topic_partitions(secured.bootstrap, KV_EVENTS, timeout_s=2)
    if client_auth:
        reasons = _refusal_reasons(secured.bootstrap, KVSTREAM_SSL_CERTIFICATE_LOCATION=None,
                                   KVSTREAM_SSL_KEY_LOCATION=None, KVSTREAM_SSL_KEY_PASSWORD=None)
        assert "certificate" in reasons  # the broker's TLS alert: bad / required certificate


def test_pipeline_runs_secured_and_never_logs_a_secret(secured):
    bootstrap, data_dir = secured.bootstrap, secured.data_dir
    ensure_topics(bootstrap, {KV_EVENTS: 2})
    fleet = FleetConfig(gpu_blocks=600, cpu_blocks=900, kvcr_blocks=1200, clear_instance=None)
    result = replay_to_kafka(load_trace(limit=150), KvEventProducer(bootstrap, KV_EVENTS), fleet)
    log_file = data_dir / "worker.log"
    options = WorkerSettings(bootstrap_servers=bootstrap, web_port=free_port(), data_dir=data_dir / "worker",
                            partitions=2, app_id="kvstream-secured")
    process = spawn_worker(options, log_file)
    try:
        wait_until_consumed(bootstrap, options.app_id, process, timeout_s=300)
    finally:
        stop_worker(process)
    table = read_table(bootstrap, changelog_topic(options.app_id, "residency"), "residency")
    comparison = compare_rows(result.ground_truth, resident_rows(table))
    assert comparison.differences == [] and comparison.matching == len(result.ground_truth) > 0
    out = io.StringIO()  # kvstream tail reads through the same settings
    assert tail(bootstrap, KV_EVENTS, from_beginning=True, max_messages=5, idle_timeout_s=30, out=out) == 5
    log = log_file.read_text()
    assert "kvstream-secured" in log  # the worker did log
    leaked = [secret for secret in secured.secrets if secret in log]
    assert leaked == [], f"{len(leaked)} secret strings in {log_file}"


def test_tls_settings_that_cannot_work_fail_early_and_name_the_variable(tmp_path, monkeypatch):
    tls = generate_tls_material(tmp_path / "tls")
    for name in ("KVSTREAM_SASL_MECHANISM", "KVSTREAM_SASL_USERNAME", "KVSTREAM_SASL_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    for name, value in tls.client_environment().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KVSTREAM_SECURITY_PROTOCOL", "SSL")
    assert aiokafka_security()["ssl_context"].check_hostname  # loads: CA, certificate, key and its password
    monkeypatch.setenv("KVSTREAM_SSL_KEY_PASSWORD", "wrong")
    with pytest.raises(ValueError, match="KVSTREAM_SSL_KEY_PASSWORD must decrypt") as refused:
        aiokafka_security()
    assert tls.client_key_password not in str(refused.value)
    monkeypatch.setenv("KVSTREAM_SSL_CA_LOCATION", str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="KVSTREAM_SSL_CA_LOCATION=.*missing.pem.*no such readable file"):
        client_config("127.0.0.1:9")
    monkeypatch.setenv("KVSTREAM_SECURITY_PROTOCOL", "TLS")
    with pytest.raises(ValueError, match="KVSTREAM_SECURITY_PROTOCOL='TLS' is not one of"):
        client_config("127.0.0.1:9")
