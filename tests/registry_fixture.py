"""Session-wide schema registry for the test suite: Apicurio Registry run by :mod:`kvstream.registry`
(fetched once with Maven into ``~/.cache/kvstream``), on a free port, stopped when pytest exits.

``KVSTREAM_TEST_SCHEMA_REGISTRY=URL`` uses a registry you run instead (never stopped). Isolate tests with
their own topic names: subjects are ``<topic>-value``.
"""

from __future__ import annotations

import os

import pytest

from kvstream import registry
from kvstream.broker import free_port


@pytest.fixture(scope="session")
def schema_registry_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The Confluent-API URL of the session's schema registry."""
    external = os.environ.get("KVSTREAM_TEST_SCHEMA_REGISTRY")
    if external:
        yield external
        return
    data_dir = tmp_path_factory.mktemp("schema-registry")
    status = registry.start(port=free_port(), data_dir=data_dir, timeout_s=180)
    try:
        yield status.url
    finally:
        registry.stop(data_dir)
