"""Session-wide Kafka broker for the test suite.

Use it from a conftest.py with either::

    from tests.broker_fixture import kafka_bootstrap  # noqa: F401
    pytest_plugins = ["tests.broker_fixture"]

The ``kafka_bootstrap`` fixture returns a bootstrap-servers string, taken from
the first backend that applies:

1. ``KVSTREAM_TEST_BOOTSTRAP`` is set: that broker, used as is (never stopped).
2. ``KVSTREAM_TEST_DOCKER=1`` and ``docker info`` succeeds: a
   testcontainers ``KafkaContainer`` (KRaft mode).
3. Otherwise the embedded broker of :mod:`kvstream.broker`, on a free port with
   a data dir under pytest's tmp dir (the first run downloads ~55 MB of jars).

One broker serves the whole session, even if several modules import the
fixture; it is stopped when pytest exits. Isolate tests with unique
(uuid-suffixed) topic names and group ids.

``kafka_cluster`` gives a test a three-node embedded KRaft cluster
(:func:`kvstream.broker.start_cluster`) of the session's own, started at its
first use on free consecutive ports, for tests that fail a node on purpose
(:func:`kvstream.broker.kill_node`, :func:`kvstream.broker.restart_node`); it
is stopped when pytest exits.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstream.broker import free_port, free_port_range, start, start_cluster, stop


@dataclass(frozen=True)
class KafkaBackend:
    """The broker serving this test session.

    Attributes:
        kind: ``"external"``, ``"docker"`` or ``"embedded"``.
        bootstrap_servers: ``host:port[,host:port...]`` for Kafka clients.
        data_dir: Data directory of the embedded broker, else None.
    """

    kind: str
    bootstrap_servers: str
    data_dir: Path | None = None


_BACKEND_KEY = pytest.StashKey[KafkaBackend]()


def kafka_backend(config: pytest.Config) -> KafkaBackend | None:
    """The backend started for this session, or None if ``kafka_bootstrap`` has not run yet."""
    return config.stash.get(_BACKEND_KEY, None)


def _docker_available() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _start_backend(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> KafkaBackend:
    external = os.environ.get("KVSTREAM_TEST_BOOTSTRAP")
    if external:
        return KafkaBackend("external", external)
    if os.environ.get("KVSTREAM_TEST_DOCKER") == "1" and _docker_available():
        try:
            from testcontainers.community.kafka import KafkaContainer
        except ImportError:  # testcontainers < 4.10
            from testcontainers.kafka import KafkaContainer
        container = KafkaContainer().with_kraft()
        container.start()
        config.add_cleanup(container.stop)
        return KafkaBackend("docker", container.get_bootstrap_server())
    data_dir = tmp_path_factory.mktemp("kafka-broker")
    config.add_cleanup(lambda: stop(data_dir))  # registered first: also runs if start() fails
    status = start(port=free_port(), data_dir=data_dir)
    return KafkaBackend("embedded", status.bootstrap_servers, data_dir)


@pytest.fixture(scope="session")
def kafka_bootstrap(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Bootstrap servers (``"host:port"``) of a Kafka broker shared by the whole session."""
    backend = kafka_backend(request.config)
    if backend is None:
        backend = _start_backend(request.config, tmp_path_factory)
        request.config.stash[_BACKEND_KEY] = backend
    return backend.bootstrap_servers


@dataclass(frozen=True)
class KafkaCluster:
    """The three-node embedded cluster of this test session.

    Attributes:
        data_dir: the cluster's data directory (pass it to kill_node / restart_node).
        bootstrap_servers: every node's ``127.0.0.1:port``, comma-separated.
        nodes: how many nodes (ids 1..nodes).
    """

    data_dir: Path
    bootstrap_servers: str
    nodes: int = 3


@pytest.fixture(scope="module")
def kafka_cluster(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> KafkaCluster:
    """A three-node KRaft cluster (combined nodes) for one test module, stopped when the module ends: three idle
    JVMs left running for the rest of the session slowed every later test on 2 cores (a worker's global table
    then missed a 20 s deadline in test_fleet)."""
    data_dir = tmp_path_factory.mktemp("kafka-cluster")
    request.addfinalizer(lambda: stop(data_dir))  # registered first: also runs if the start fails
    status = start_cluster(nodes=3, port=free_port_range(6), data_dir=data_dir, timeout_s=180)
    return KafkaCluster(data_dir, status.bootstrap_servers, 3)
