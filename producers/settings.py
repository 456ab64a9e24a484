"""The settings of the producer commands (``simulate``, ``bridge``, ``capture``, ``produce``): one typed object
per command, built once and passed down.

Precedence, highest first: the flag, the ``KVSTREAM_<NAME>`` environment variable, the default
(docs/configuration.md). A variable is named after its setting, so ``KVSTREAM_BOOTSTRAP_SERVERS`` and
``KVSTREAM_TOPIC`` apply to every command that has them. Lists (``endpoint``, ...) are comma-separated in a
variable and repeated flags on the command line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from kafka_io.config import DEFAULT_BOOTSTRAP_SERVERS, DEFAULT_PARTITIONS, BootstrapServers
from kafka_io.schema_registry import RegistryUrl, schema_registry_field
from producers.simulator import FleetConfig
from schemas.topics import KV_EVENTS, KV_EVENTS_DEAD_LETTER, SCHEMAS

_FLEET = FleetConfig()


def _comma_separated(value):
    """A list from a variable's ``a,b,c`` (flags give lists already)."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


class _Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVSTREAM_", frozen=True, extra="forbid")

    #: Log level of the command.
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    #: ``text``, or ``json``: one JSON object per line (kafka_io/logs.py).
    log_format: Literal["text", "json"] = Field("text", description="log format: text, or json (one object per line)")


class _KafkaTarget(_Settings):
    """Where events are produced."""

    #: Kafka bootstrap servers, ``HOST:PORT[,HOST:PORT...]`` (no URL scheme).
    bootstrap_servers: BootstrapServers = DEFAULT_BOOTSTRAP_SERVERS
    #: The topic of block-level events (before the prefix).
    topic: str = Field(KV_EVENTS, min_length=1, description="Kafka topic of the block events")
    #: Put in front of the topic's and the dead-letter topic's names (as ``kvstream worker --topic-prefix``).
    topic_prefix: str = Field("", description="prefix of the topic names; empty: none")
    #: A Confluent-compatible schema registry (``kvstream registry start`` prints one): every topic written for
    #: others then carries the Confluent wire format, its schema registered under ``<topic>-value``; empty:
    #: single-object framing, writer schemas published to the schemas topic (docs/registry.md).
    schema_registry_url: RegistryUrl = schema_registry_field()
    #: Partitions of the topic if this command creates it (an existing topic keeps its own).
    partitions: int = Field(DEFAULT_PARTITIONS, ge=1, description="partitions if the topic is created")

    @property
    def events_topic(self) -> str:
        """The topic events go to, prefix included."""
        return self.topic_prefix + self.topic

    @property
    def dead_letter_topic(self) -> str:
        """The dead-letter topic, prefix included."""
        return self.topic_prefix + KV_EVENTS_DEAD_LETTER

    @property
    def schemas_topic(self) -> str:
        """The schemas topic (writer schemas for readers without a registry), prefix included."""
        return self.topic_prefix + SCHEMAS


class _EngineEndpoints(_Settings):
    """Which engine publishers to subscribe to (vLLM's and SGLang's ``--kv-events-config``)."""

    #: Publisher PUB endpoints, ``tcp://HOST:PORT``, one per publisher.
    endpoint: Annotated[list[str], NoDecode] = Field(description="publisher PUB endpoint tcp://HOST:PORT "
                                                                 "(repeatable, one per publisher)")
    #: Publisher ROUTER replay endpoints, one per ``endpoint`` in the same order; empty: no replay of gaps.
    replay_endpoint: Annotated[list[str], NoDecode] = Field([], description="publisher ROUTER replay endpoint, "
                                                                            "one per --endpoint in order")
    #: Instance name of each ``endpoint``, in the same order (vLLM sends no identity of its own).
    instance_id: Annotated[list[str], NoDecode] = Field([], description="instance name of each --endpoint, "
                                                                        "in order")
    #: Data-parallel rank of the endpoints.
    dp_rank: int = Field(0, ge=0, description="data-parallel rank of the endpoints")
    #: Follow ranks 0..N-1 of one engine on its offset ports (vLLM: port + rank).
    data_parallel_size: int = Field(1, ge=1, description="follow ranks 0..N-1 of one engine on offset ports")
    #: Publisher topic prefix to subscribe to; empty: all.
    zmq_topic: str = Field("", description="publisher topic prefix to subscribe to; empty: all")
    #: The engines' protocol: vLLM's (unsigned hashes) or SGLang's (signed hashes, fewer required fields).
    engine: Literal["vllm", "sglang"] = Field("vllm", description="the engines' protocol: vllm or sglang")

    _split_lists = field_validator("endpoint", "replay_endpoint", "instance_id", mode="before")(
        lambda cls, value: _comma_separated(value))


class SimulateSettings(_KafkaTarget):
    """``kvstream simulate``: replay a Mooncake-format trace through the simulated fleet into ``kv-events``."""

    #: The trace (JSON lines, optionally gzipped); none: the vendored Mooncake conversation trace.
    trace: Path | None = Field(None, description="Mooncake-format trace; none: the vendored Mooncake trace")
    #: Replay only the first N requests; none: all.
    requests: int | None = Field(None, ge=1, description="replay only the first N requests")
    #: Simulated serving instances.
    instances: int = Field(_FLEET.instances, ge=1, description="simulated instances")
    #: GPU block pool per instance, in blocks.
    gpu_blocks: int = Field(_FLEET.gpu_blocks, ge=1, description="GPU pool blocks per instance")
    #: CPU offload tier per instance, in blocks.
    cpu_blocks: int = Field(_FLEET.cpu_blocks, ge=1, description="CPU tier blocks per instance")
    #: KVCR secondary tier per instance, in blocks.
    kvcr_blocks: int = Field(_FLEET.kvcr_blocks, ge=1, description="KVCR tier blocks per instance")
    #: Write the final residency (JSON lines, one resident row each) to this file.
    ground_truth: Path | None = Field(None, description="write the final residency to this file (JSON lines)")
    #: Wall-clock seconds between the heartbeats (``SourceHeartbeat``, evidence ``producing``) of every simulated
    #: publisher while the replay runs; one more each at its end. 0: none (the workers' leases then lapse).
    heartbeat_interval_s: float = Field(5.0, ge=0, description="seconds between the heartbeats of every simulated "
                                                               "publisher while it publishes, and one at the end; "
                                                               "0: none")
    #: The model the simulated instances serve, registered with their block size (512 tokens, the trace's) in
    #: ``kv-instances`` before the replay, so a query by token ids needs no ``block_size``; none: any model.
    model_name: str | None = Field(None, description="model the simulated instances are registered with (their "
                                                     "512-token blocks are registered in any case); none: any")


class BridgeSettings(_KafkaTarget, _EngineEndpoints):
    """``kvstream bridge``: subscribe to live engine publishers and produce their events to ``kv-events``."""

    #: Publisher PUB endpoints, ``tcp://HOST:PORT``, one per publisher; none only with ``follow_registrations``.
    endpoint: Annotated[list[str], NoDecode] = Field([], description="publisher PUB endpoint tcp://HOST:PORT "
                                                                     "(repeatable, one per publisher); required "
                                                                     "unless --follow-registrations")

    #: Port of the Prometheus ``/metrics`` endpoint; none: off.
    metrics_port: int | None = Field(None, ge=1, le=65535, description="port of the Prometheus /metrics "
                                                                        "endpoint; none: off")
    #: Address the metrics endpoint binds to (``0.0.0.0`` in a container).
    metrics_bind: str = Field("127.0.0.1", description="address the metrics endpoint binds to")
    #: Each source's epoch and last seq, so a restarted bridge continues where it stopped.
    state_file: Path = Field(Path(".kvstream/bridge-state.json"), description="state file: each source's epoch "
                                                                              "and last seq")
    #: Seconds between a source's heartbeats (``SourceHeartbeat``), sent while there is evidence that its engine is
    #: alive: its batches, an answer of its replay socket, or its connection up (docs/ingesting.md); 0: none.
    heartbeat_interval_s: float = Field(5.0, ge=0, description="seconds between each source's heartbeats while its "
                                                               "engine shows it is alive; 0: none")
    #: How long a heartbeat's probe of the replay socket may take to answer; later, that interval has no heartbeat.
    heartbeat_probe_timeout_s: float = Field(1.0, gt=0, description="seconds a heartbeat's probe of the replay "
                                                                    "socket may take to answer")
    #: How each engine reports prefix-cache reuse (vLLM's ``kv_cache_report_mode``): ``default``, or ``full`` (vLLM PR
    #: #45261: a reused block is re-announced with a BlockStored, and no BlockRemoved follows it). One value for every
    #: ``--endpoint``, or one per ``--endpoint`` in order. The stores of a ``full`` engine are marked (kv_event v5
    #: ``BlockStored.report_mode``), so the workers count a repeated store of a block as an announcement.
    report_mode: Annotated[list[Literal["default", "full"]], NoDecode] = Field(
        ["default"], description="each engine's KV report mode, default or full (vLLM kv_cache_report_mode; full "
                                 "re-announces reused blocks): one for all --endpoints or one per --endpoint")

    #: Also follow the engine of every instance registered in ``kv-instances`` (``POST /register``; the topic prefix
    #: applies) that has an ``endpoint``: each registered data-parallel rank on its offset port, its replay endpoint
    #: likewise, unfollowed when the registration is removed or its endpoint changes (docs/ingesting.md).
    follow_registrations: bool = Field(False, description="also subscribe to the engine of every registration in "
                                                          "kv-instances that has an endpoint, and unsubscribe when "
                                                          "it is removed or changes")

    #: The model each engine serves (one for every ``--endpoint``, or one per ``--endpoint`` in order): registered in
    #: ``kv-instances`` at start, so a query for another model does not name the engine (docs/querying.md).
    model_name: Annotated[list[str], NoDecode] = Field(
        [], description="the model each engine serves, registered at start so queries for other models skip it: "
                        "one for all --endpoints or one per --endpoint")
    #: Tokens per KV block of each engine (vLLM's --block-size; one for every ``--endpoint``, or one per
    #: ``--endpoint``): registered with the model, so a query by token ids cuts its blocks as the engine does.
    block_size: Annotated[list[int], NoDecode] = Field(
        [], description="each engine's tokens per KV block (vLLM --block-size), registered at start: one for all "
                        "--endpoints or one per --endpoint")

    _split_report_modes = field_validator("report_mode", "model_name", "block_size", mode="before")(
        lambda cls, value: _comma_separated(value))


class CaptureSettings(_EngineEndpoints):
    """``kvstream capture``: record live engine streams to a JSON-lines capture file."""

    #: The capture file (appended to).
    output: Path = Field(description="capture file (JSON lines, appended to)")
    #: Stop after this many batches; none: no limit.
    max_batches: int | None = Field(None, ge=1, description="stop after N batches")
    #: Stop after this many seconds; none: no limit.
    duration_s: float | None = Field(None, gt=0, description="stop after this many seconds")


class ProduceSettings(_KafkaTarget):
    """``kvstream produce``: publish a capture file exactly as the bridge publishes a live stream."""

    #: The capture file (``kvstream capture``'s format, docs/ingesting.md).
    jsonl: Path = Field(description="capture file to publish")
    #: The protocol of capture lines that do not name theirs.
    engine: Literal["vllm", "sglang"] = Field("vllm", description="protocol of lines without an engine: vllm or "
                                                                  "sglang")
