"""The settings of the tools ``kvstream tail`` and ``kvstream query``: one typed object per command.

Precedence, highest first: the flag, the ``KVSTREAM_<NAME>`` environment variable, the default
(docs/configuration.md).
"""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kafka_io.config import DEFAULT_BOOTSTRAP_SERVERS, check_bootstrap_servers


class TailSettings(BaseSettings):
    """``kvstream tail TOPIC``: print a topic's records decoded, as JSON lines."""

    model_config = SettingsConfigDict(env_prefix="KVSTREAM_", frozen=True, extra="forbid")

    #: Kafka bootstrap servers, ``HOST:PORT[,HOST:PORT...]`` (no URL scheme).
    bootstrap_servers: str = Field(DEFAULT_BOOTSTRAP_SERVERS, description="Kafka bootstrap servers, HOST:PORT[,...]")
    #: Start at the earliest offset; otherwise only records written from now on are printed.
    from_beginning: bool = Field(False, description="start at the earliest offset")
    #: Stop after this many records; none: no limit.
    max_messages: int | None = Field(None, ge=1, description="stop after N records")
    #: Stop after this many seconds without a record; none: never.
    idle_timeout_s: float | None = Field(None, gt=0, description="stop after this many seconds without a record")
    #: Stop at the end every partition has when the command starts (as ``kcat -e``); needs ``from_beginning``.
    to_end: bool = Field(False, description="stop at the end the topic has at the start, as kcat -e (with "
                                            "--from-beginning)")

    @field_validator("bootstrap_servers")
    @classmethod
    def _no_url_scheme(cls, value: str) -> str:
        return check_bootstrap_servers(value)


class QuerySettings(BaseSettings):
    """``kvstream query VIEW``: ask a worker's HTTP views and print the JSON answer."""

    model_config = SettingsConfigDict(env_prefix="KVSTREAM_", frozen=True, extra="forbid")

    #: Base URL of any worker (lookups of keys held by another worker are forwarded there).
    worker_url: str = Field("http://127.0.0.1:6066", description="base URL of any stream-app worker")
    #: Longest wait for the answer, in seconds.
    request_timeout_s: float = Field(10.0, gt=0, description="longest wait for the answer, seconds")

    @field_validator("worker_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"{value!r} is not an http:// or https:// URL (e.g. http://127.0.0.1:6066)")
        return value.rstrip("/")
