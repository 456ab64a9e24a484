"""Shared fixtures: the session's Kafka broker (tests/broker_fixture.py) and schema registry
(tests/registry_fixture.py)."""

pytest_plugins = ["tests.broker_fixture", "tests.registry_fixture"]
