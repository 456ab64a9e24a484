"""The settings of ``kvstream index``, the query-only index replica: one typed object, built once.

Precedence, highest first: the flag, the ``KVSTREAM_<NAME>`` environment variable, the default
(docs/configuration.md). The Kafka security settings come from the environment, as for every command
(:mod:`kafka_io.config`).
"""

from __future__ import annotations

from functools import cached_property
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kafka_io.config import DEFAULT_BOOTSTRAP_SERVERS, BootstrapServers
from kafka_io.schema_registry import RegistryUrl, schema_registry_field
from schemas.topics import TopicNames
from stream_apps.index.api import MAX_BODY_BYTES, MAX_CHAIN_BLOCKS, MAX_NESTING_DEPTH, MAX_TOKENS
from stream_apps.index.fleet_index import DEFAULT_BLOCK_SIZE
from stream_apps.residency import parse_tier_weights
from stream_apps.web_settings import (
    ApiTokenFile,
    InsecureHttp,
    MaxBodyBytes,
    MaxHashes,
    MaxNestingDepth,
    MaxTokens,
    ReadRequiresToken,
    RegisterAllowCidr,
    WebTlsCert,
    WebTlsClientCa,
    WebTlsKey,
)


class IndexSettings(BaseSettings):
    """Settings of one ``kvstream index`` replica (``kvstream index --help``)."""

    model_config = SettingsConfigDict(env_prefix="KVSTREAM_", frozen=True, extra="forbid")

    #: Kafka bootstrap servers, ``HOST:PORT[,HOST:PORT...]`` (no URL scheme).
    bootstrap_servers: BootstrapServers = DEFAULT_BOOTSTRAP_SERVERS
    #: App id of the workers whose residency changelog the index reads (``<app id>-residency-changelog``).
    app_id: str = Field("kvstream", min_length=1, description="app id of the workers whose tables are indexed")
    #: Prefix of every topic name, as the workers were given it; empty: none.
    topic_prefix: str = Field("", description="prefix of every topic name; empty: none")
    #: The schema registry the workers write through, if any (docs/registry.md); empty: single-object framing.
    schema_registry_url: RegistryUrl = schema_registry_field()
    #: HTTP port of the router APIs.
    web_port: int = Field(6080, ge=1, le=65535, description="HTTP port of the router APIs")
    #: Address the HTTP server binds to.
    web_bind: str = Field("127.0.0.1", description="HTTP bind address")
    #: Tokens per block of an instance that registered none (``POST /register``'s ``block_size``); vLLM's
    #: default is 16.
    default_block_size: int = Field(DEFAULT_BLOCK_SIZE, ge=1, description="tokens per block of an instance that "
                                                                           "registered none")
    #: Seconds without an event or heartbeat after which a source is down: its rows are left out of every answer
    #: (as the workers' ``--source-lease-s``; a replica clears nothing itself).
    source_lease_s: float = Field(30.0, gt=0, description="seconds without an event or heartbeat after which a "
                                                          "source is down (left out of every answer)")
    #: Tier weights of the prefix-match score: ``GPU=1.0,CPU=0.8,STORAGE=0.5``; tiers not named weigh 0.25.
    tier_weights: str = Field("", description="tier weights of the prefix-match score, e.g. GPU=1.0,CPU=0.8")
    #: Log level of the process.
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    #: ``text``, or ``json`` (one JSON object per line).
    log_format: Literal["text", "json"] = Field("text", description="log format: text, or json (one object per line)")

    # the web port: who may do what, HTTPS, body limits (stream_apps/web_settings.py; docs/security.md)
    api_token_file: ApiTokenFile = None
    read_requires_token: ReadRequiresToken = False
    register_allow_cidr: RegisterAllowCidr = ""
    insecure_http: InsecureHttp = False
    web_tls_cert: WebTlsCert = None
    web_tls_key: WebTlsKey = None
    web_tls_client_ca: WebTlsClientCa = None
    max_body_bytes: MaxBodyBytes = MAX_BODY_BYTES
    max_tokens: MaxTokens = MAX_TOKENS
    max_hashes: MaxHashes = MAX_CHAIN_BLOCKS
    max_nesting_depth: MaxNestingDepth = MAX_NESTING_DEPTH

    @field_validator("tier_weights")
    @classmethod
    def _valid_tier_weights(cls, value: str) -> str:
        parse_tier_weights(value)
        return value

    @property
    def topics(self) -> TopicNames:
        """Every topic name of the indexed app."""
        return TopicNames(self.app_id, self.topic_prefix)

    @cached_property
    def weights(self) -> dict[str, float]:
        """Tier weights, parsed."""
        return parse_tier_weights(self.tier_weights)
