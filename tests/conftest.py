"""Shared fixtures: the session's Kafka broker (tests/broker_fixture.py)."""

pytest_plugins = ["tests.broker_fixture"]
