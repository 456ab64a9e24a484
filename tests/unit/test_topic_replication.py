"""The replication kvstream gives the topics it creates (kafka_io.config.topic_replication)."""

from __future__ import annotations

import pytest

from kafka_io.config import topic_replication


@pytest.mark.parametrize(("brokers", "expected"), [(1, (1, None)), (2, (2, None)), (3, (3, 2)), (5, (3, 2))])
def test_replication_follows_the_cluster(monkeypatch, brokers, expected):
    monkeypatch.delenv("KVSTREAM_REPLICATION_FACTOR", raising=False)
    monkeypatch.delenv("KVSTREAM_MIN_INSYNC_REPLICAS", raising=False)
    assert topic_replication(brokers) == expected


def test_replication_is_settable(monkeypatch):
    monkeypatch.setenv("KVSTREAM_REPLICATION_FACTOR", "5")  # more than the brokers: Kafka's to refuse, not ours
    monkeypatch.setenv("KVSTREAM_MIN_INSYNC_REPLICAS", "3")
    assert topic_replication(3) == (5, 3)
    monkeypatch.setenv("KVSTREAM_REPLICATION_FACTOR", "zero")
    with pytest.raises(ValueError, match="KVSTREAM_REPLICATION_FACTOR"):
        topic_replication(3)
