"""The settings of the tools ``kvstream tail``, ``query``, ``export`` and ``report``: one typed object per command.

Precedence, highest first: the flag, the ``KVSTREAM_<NAME>`` environment variable, the default
(docs/configuration.md).
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kafka_io.config import DEFAULT_BOOTSTRAP_SERVERS, BootstrapServers
from kafka_io.schema_registry import RegistryUrl, schema_registry_field
from schemas.topics import (
    KV_EVENTS,
    KV_EVENTS_BY_OWNERSHIP,
    KV_EVENTS_DEAD_LETTER,
    KV_RESIDENCY_CHANGES,
    KV_TIER_OCCUPANCY,
    SCHEMAS,
    TABLE_FAMILIES,
    TopicNames,
)
from stream_apps.web_settings import ClientCa, ClientCert, ClientKey, ClientKeyPasswordFile, ClientTokenFile

_OFFSETS = re.compile(r"^\d+$|^\d+:\d+(,\d+:\d+)*$")


def parse_time(value) -> float | None:
    """A time given as ISO 8601 (``2026-01-01T00:30:00Z``; no zone: UTC) or as seconds since the Unix epoch, in
    seconds since the Unix epoch.

    Raises:
        ValueError: neither form; the message shows both.
    """
    if value is None or isinstance(value, (int, float)):
        return value
    text = str(value).strip()
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is not a time: give ISO 8601 (e.g. 2026-01-01T00:30:00Z, UTC when no zone is "
                         f"given) or seconds since the Unix epoch (e.g. 1767227400)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp()


def parse_offsets(text: str | None) -> int | dict[int, int] | None:
    """``--until-offset``: ``N`` (every partition) or ``PARTITION:OFFSET[,PARTITION:OFFSET...]``.

    Raises:
        ValueError: neither form.
    """
    if text is None:
        return None
    text = text.replace(" ", "")
    if not _OFFSETS.match(text):
        raise ValueError(f"{text!r} is not an offset: give N (every partition stops before offset N) or "
                         "PARTITION:OFFSET[,...] (e.g. 0:1200,1:980; partitions not named are read to their end)")
    if ":" not in text:
        return int(text)
    return {int(p): int(o) for p, o in (pair.split(":") for pair in text.split(","))}


def short_topic_names(topics: TopicNames) -> dict[str, str]:
    """Short name -> full name of every topic of an app: its own topics without the ``<app id>-`` in front
    (``kv-residency-changes``, ``residency-changelog``, ``kv-events-by-ownership``, ...) and the shared ones by
    their base names (``kv-events``, ``kv-events-dead-letter``), the topic prefix in front of each."""
    return {KV_EVENTS: topics.kv_events, KV_EVENTS_DEAD_LETTER: topics.dead_letter, SCHEMAS: topics.schemas,
            KV_EVENTS_BY_OWNERSHIP: topics.by_ownership, "repartition-source-clears": topics.source_clears,
            KV_RESIDENCY_CHANGES: topics.residency_changes, KV_TIER_OCCUPANCY: topics.tier_occupancy,
            **{f"{table}-changelog": topics.changelog(table) for table in TABLE_FAMILIES}}


def app_topic(name: str, topics: TopicNames) -> str:
    """The topic a user names: a short name of the app's topics (:func:`short_topic_names`) is that topic;
    any other name is a topic's full name, taken as it is."""
    return short_topic_names(topics).get(name, name)


class TailSettings(BaseSettings):
    """``kvstream tail TOPIC``: print a topic's records decoded, as JSON lines."""

    model_config = SettingsConfigDict(env_prefix="KVSTREAM_", frozen=True, extra="forbid")

    #: Kafka bootstrap servers, ``HOST:PORT[,HOST:PORT...]`` (no URL scheme).
    bootstrap_servers: BootstrapServers = DEFAULT_BOOTSTRAP_SERVERS
    #: Start at the earliest offset; otherwise only records written from now on are printed.
    from_beginning: bool = Field(False, description="start at the earliest offset")
    #: Stop after this many records; none: no limit.
    max_messages: int | None = Field(None, ge=1, description="stop after N records")
    #: Stop after this many seconds without a record; none: never.
    idle_timeout_s: float | None = Field(None, gt=0, description="stop after this many seconds without a record")
    #: The schema registry that resolves Confluent-framed records' schema ids; empty: none.
    schema_registry_url: RegistryUrl = schema_registry_field(reads_only=True)
    #: The stream app whose topics are meant by their short names (``kv-residency-changes``, ...).
    app_id: str = Field("kvstream", min_length=1, description="app id of the stream app whose topics the short "
                                                              "names mean")
    #: Put in front of the short names and of the schemas topic's name (where writer schemas this version does
    #: not ship are found).
    topic_prefix: str = Field("", description="topic prefix of the pipeline (of the short names and its schemas "
                                              "topic); empty: none")
    #: Stop at the end every partition has when the command starts (as ``kcat -e``); needs ``from_beginning``.
    to_end: bool = Field(False, description="stop at the end the topic has at the start, as kcat -e (with "
                                            "--from-beginning)")


class QuerySettings(BaseSettings):
    """``kvstream query VIEW``: ask a worker's HTTP views and print the JSON answer."""

    model_config = SettingsConfigDict(env_prefix="KVSTREAM_", frozen=True, extra="forbid")

    #: Base URL of any worker (lookups of keys held by another worker are forwarded there).
    worker_url: str = Field("http://127.0.0.1:6066", description="base URL of any stream-app worker")
    #: Longest wait for the answer, in seconds.
    request_timeout_s: float = Field(10.0, gt=0, description="longest wait for the answer, seconds")
    #: Before asking, wait until the workers have consumed their input (``caught_up`` of ``GET /occupancy/``).
    wait_caught_up: bool = Field(False, description="first wait until the workers have consumed their input "
                                                    "(caught_up of GET /occupancy/) and their copies of the "
                                                    "global tables have settled, progress on standard error")
    #: Longest wait of ``wait_caught_up``, in seconds.
    wait_timeout_s: float = Field(600.0, gt=0, description="longest wait of --wait-caught-up, seconds")
    # the web port's token and TLS, as the servers were given them (docs/security.md)
    api_token_file: ClientTokenFile = None
    web_ca: ClientCa = None
    web_client_cert: ClientCert = None
    web_client_key: ClientKey = None
    web_client_key_password_file: ClientKeyPasswordFile = None

    def client_options(self) -> dict:
        """The token and TLS arguments of :class:`kvstream.client.IndexClient` (the token file read now).

        Raises:
            ValueError: the token file or a key password file cannot be read.
        """
        from stream_apps.web_access import read_token

        password = None
        if self.web_client_key_password_file is not None:
            try:
                password = self.web_client_key_password_file.read_text().strip()
            except OSError as exc:
                raise ValueError(f"--web-client-key-password-file {self.web_client_key_password_file}: "
                                 f"{exc.strerror or exc}") from None
        return {"token": read_token(self.api_token_file), "ca_file": self.web_ca, "cert_file": self.web_client_cert,
                "key_file": self.web_client_key, "key_password": password}

    @field_validator("worker_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"{value!r} is not an http:// or https:// URL (e.g. http://127.0.0.1:6066)")
        return value.rstrip("/")


class _AppTopicsSettings(BaseSettings):
    """Kafka and the app whose topics a tool reads."""

    model_config = SettingsConfigDict(env_prefix="KVSTREAM_", frozen=True, extra="forbid")

    #: Kafka bootstrap servers, ``HOST:PORT[,HOST:PORT...]`` (no URL scheme).
    bootstrap_servers: BootstrapServers = DEFAULT_BOOTSTRAP_SERVERS
    #: The stream app whose topics and tables are meant by their short names (``kvstream worker --app-id``).
    app_id: str = Field("kvstream", min_length=1, description="app id of the stream app whose topics are read")
    #: The topic prefix of that app (``kvstream worker --topic-prefix``); empty: none.
    topic_prefix: str = Field("", description="topic prefix of that app; empty: none")
    #: The schema registry that resolves Confluent-framed records' schema ids; empty: none.
    schema_registry_url: RegistryUrl = schema_registry_field(reads_only=True)
    #: Longest time the whole read of the topic may take, in seconds.
    read_timeout_s: float = Field(3600.0, gt=0, description="longest time the read of the topic may take, seconds")

    @property
    def topics(self) -> TopicNames:
        """The app's topic names."""
        return TopicNames(self.app_id, self.topic_prefix)

    def topic(self, name: str) -> str:
        """The topic ``name`` means: a short name's full name (:func:`app_topic`), or ``name`` itself."""
        return app_topic(name, self.topics)


class ExportSettings(_AppTopicsSettings):
    """``kvstream export TOPIC|TABLE``: write the residency changes, or a snapshot of the residency table, to a
    Parquet or JSON-lines file."""

    #: Output format: Parquet (typed columns, pyarrow) or JSON lines.
    format: Literal["parquet", "jsonl"] = Field("parquet", description="output format: parquet or jsonl")
    #: The file to write (replaced if it exists).
    output: Path = Field(description="file to write (replaced if it exists)")
    #: Stop each partition before this offset: ``N`` for every partition, or ``PARTITION:OFFSET[,...]``.
    until_offset: str | None = Field(None, description="stop each partition before this offset: N, or "
                                                       "PARTITION:OFFSET[,...]; none: at its end")
    #: Stop each partition at its first record written at or after this time (the record's Kafka timestamp).
    until_time: float | None = Field(None, description="stop at the first record written at or after this time "
                                                       "(Kafka timestamp; ISO 8601 or Unix seconds); none: at "
                                                       "the end")

    @field_validator("until_offset")
    @classmethod
    def _offsets(cls, value: str | None) -> str | None:
        parse_offsets(value)
        return value

    @field_validator("until_time", mode="before")
    @classmethod
    def _time(cls, value):
        return parse_time(value)


class ReportSettings(_AppTopicsSettings):
    """``kvstream report [SOURCE]``: plots and a summary table of the residency changes."""

    #: Directory of the PNG plots, summary.md and summary.json (created if missing).
    output_dir: Path = Field(Path("report"), description="directory of the PNG plots, summary.md and summary.json")
    #: The fleet's occupancy is reported as of this engine time; none: the time of the last change.
    as_of: float | None = Field(None, description="report the fleet's occupancy as of this engine time (ISO "
                                                  "8601 or Unix seconds); none: the last change's time")

    @field_validator("as_of", mode="before")
    @classmethod
    def _time(cls, value):
        return parse_time(value)
