"""The embedded three-node cluster (kvstream.broker.start_cluster): topics kvstream creates are replicated as a
cluster expects, and a node killed by id comes back (tests/broker_fixture.py, ``kafka_cluster``)."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from kafka_io.admin import ensure_topics
from kafka_io.config import producer_config
from kvstream.broker import cluster_status, kill_node, restart_node

pytestmark = pytest.mark.integration


def _replication(bootstrap: str, topic: str) -> tuple[set[int], str]:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    partitions = admin.list_topics(topic, timeout=10).topics[topic].partitions.values()
    resource = ConfigResource(ResourceType.TOPIC, topic)
    configs = admin.describe_configs([resource])[resource].result(timeout=10)
    return {len(p.replicas) for p in partitions}, configs["min.insync.replicas"].value


def test_cluster_replicates_topics_and_survives_a_node_kill(kafka_cluster) -> None:
    bootstrap = kafka_cluster.bootstrap_servers
    topic = f"test-cluster-{uuid.uuid4().hex[:12]}"
    ensure_topics(bootstrap, {topic: 3}, configs={topic: {"cleanup.policy": "compact"}})
    assert _replication(bootstrap, topic) == ({3}, "2")

    assert kill_node(kafka_cluster.data_dir, 2)
    st = cluster_status(kafka_cluster.data_dir)
    assert [node.running for node in st.nodes] == [True, False, True]
    # two of three replicas in sync: acks=all writes go on (min.insync.replicas=2)
    producer = Producer(producer_config(bootstrap, **{"message.timeout.ms": 60_000}))
    errors: list = []
    for i in range(20):
        producer.produce(topic, key=str(i).encode(), value=b"x",
                         on_delivery=lambda err, _m: errors.append(err) if err else None)
    assert producer.flush(90) == 0 and errors == []

    node = restart_node(kafka_cluster.data_dir, 2)
    assert node.running
    assert AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).brokers.keys() == {1, 2, 3}
