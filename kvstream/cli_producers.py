"""The ``kvstream`` commands that write ``kv-events``: ``simulate`` (replay a trace through the simulated
fleet), ``bridge`` (live engine publishers), ``capture`` (record live publishers to a file) and ``produce``
(publish such a file through the bridge's path), with the bridge's endpoint and registration helpers that
``bridge`` and ``capture`` share.

Each command has an ``add_<command>`` that adds its subparser (flags, help texts) for
:func:`kvstream.cli.build_parser`, and a ``_cmd_<command>`` that runs it.
"""

from __future__ import annotations

import argparse
import json
import sys

from kafka_io.logs import configure_logging
from kvstream.options import add_settings_arguments


def add_simulate(sub: argparse._SubParsersAction) -> None:
    """``kvstream simulate``: replay a trace through the simulated fleet into kv-events."""
    from producers.settings import SimulateSettings

    p = sub.add_parser("simulate", help="replay a trace through the simulated fleet into kv-events",
                       description="Route each request of a Mooncake-format trace to a simulated instance by prefix "
                                   "affinity, simulate its GPU pool, CPU offload tier and KVCR secondary tier, and "
                                   "produce the resulting vLLM-shaped events, one Kafka message per block. Each "
                                   "simulated publisher gets a heartbeat every --heartbeat-interval-s while the "
                                   "replay runs, and one at its end.")
    add_settings_arguments(p, SimulateSettings)
    p.set_defaults(func=_cmd_simulate)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvstream.options import settings_from_args
    from producers.kafka_sink import KvEventProducer
    from producers.settings import SimulateSettings
    from producers.simulator import (
        DEFAULT_TRACE,
        TRACE_BLOCK_SIZE,
        FleetConfig,
        load_trace,
        replay_to_kafka,
        simulated_instance_names,
    )
    from schemas.topics import TopicNames
    from stream_apps.index.fleet_index import SourceInfo
    from stream_apps.index.registrations import register_sources

    settings = settings_from_args(SimulateSettings, args)
    configure_logging(settings.log_level, settings.log_format)
    requests = load_trace(settings.trace or DEFAULT_TRACE, settings.requests)
    producer = KvEventProducer.from_settings(settings)
    config = FleetConfig(instances=settings.instances, gpu_blocks=settings.gpu_blocks, cpu_blocks=settings.cpu_blocks,
                         kvcr_blocks=settings.kvcr_blocks)
    # before the replay: a query by token ids right after it cuts the 512-token trace blocks as the instances do
    registered = register_sources(settings.bootstrap_servers, TopicNames(prefix=settings.topic_prefix).instances,
                                  [SourceInfo(name, model_name=settings.model_name, block_size=TRACE_BLOCK_SIZE,
                                              engine_type="kvstream simulate", dp_ranks={0})
                                   for name in simulated_instance_names(config)])
    print(f"registered {len(registered)} simulated instances in {TopicNames(prefix=settings.topic_prefix).instances} "
          f"(block size {TRACE_BLOCK_SIZE}, model {settings.model_name or 'any'})")
    with tqdm(total=len(requests), unit="req", disable=None) as bar:
        result = replay_to_kafka(requests, producer, config, progress=bar.update,
                                 heartbeat_interval_s=settings.heartbeat_interval_s)
    print(f"{result.records:,} block events ({result.messages:,} Kafka messages) in {result.seconds:.1f}s: "
          f"{result.messages / result.seconds:,.0f} events/s; {result.heartbeats:,} heartbeats")
    if settings.ground_truth:
        rows = [{"instance_id": i, "data_parallel_rank": dp, "tier": tier, "ownership": own, "locality": loc,
                 "group_idx": group, "block_hash": h.hex(), "copies": copies}
                for (i, dp, tier, own, loc, group, h), copies in sorted(result.ground_truth.items())]
        settings.ground_truth.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        print(f"ground truth: {len(rows):,} resident rows written to {settings.ground_truth}")
    return 0


def add_bridge(sub: argparse._SubParsersAction) -> None:
    """``kvstream bridge``: live vLLM / SGLang publishers (ZMQ) into kv-events."""
    from producers.settings import BridgeSettings

    p = sub.add_parser("bridge", help="subscribe to running vLLM/SGLang KV event publishers (ZMQ) and produce to "
                                      "kv-events",
                       description="Subscribe to engine KV event publishers (vLLM --kv-events-config, SGLang "
                                   "--kv-events-config) and produce their events to Kafka, one message per block, "
                                   "keyed by canonical block hash. Gaps are replayed from the publisher's replay "
                                   "socket (a DEALER), and so is what the bridge has not seen whenever its "
                                   "connection comes up; a seq that goes backwards starts a new publisher epoch; "
                                   "undecodable input goes to kv-events-dead-letter. Every --heartbeat-interval-s "
                                   "each source gets a heartbeat while its engine shows it is alive (its batches, "
                                   "an answer of its replay socket, or its connection up). With "
                                   "--follow-registrations it also subscribes to the engine of every instance "
                                   "registered in kv-instances (POST /register) with an endpoint, and unsubscribes "
                                   "when the registration is removed or changes. Stop with Ctrl-C or SIGTERM.",
                       epilog="Example, one vLLM engine with 2 data-parallel ranks started with "
                              "--kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                              "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5567\"}': "
                              "kvstream bridge --endpoint tcp://ENGINE:5557 --replay-endpoint tcp://ENGINE:5567 "
                              "--instance-id engine-0 --data-parallel-size 2. Every engine the routers register: "
                              "kvstream bridge --follow-registrations")
    add_settings_arguments(p, BridgeSettings)
    p.set_defaults(func=_cmd_bridge)


def _bridge_endpoints(settings):
    """The publishers to subscribe to, from a BridgeSettings or CaptureSettings: none only for a bridge that
    follows the registrations (``--follow-registrations``), which finds its publishers in ``kv-instances``.

    Raises:
        ValueError: the endpoint options do not go together; the message says what to give.
    """
    from producers.bridge import PublisherEndpoint, data_parallel_endpoints

    endpoints, replays, instances = settings.endpoint, settings.replay_endpoint, settings.instance_id
    following = getattr(settings, "follow_registrations", None)  # capture has no such option
    if not endpoints and not following:
        raise ValueError("give at least one --endpoint tcp://HOST:PORT (or KVSTREAM_ENDPOINT)"
                         + (", or --follow-registrations" if following is not None else ""))
    if not endpoints and (replays or instances):
        raise ValueError("--replay-endpoint and --instance-id name the --endpoints, and none is given (followed "
                         "registrations name their own)")
    if replays and len(replays) != len(endpoints):
        raise ValueError("give one --replay-endpoint per --endpoint, in the same order (or none)")
    if len(instances) != len(endpoints):
        raise ValueError("give one --instance-id per --endpoint, in the same order")
    # capture has no report mode: it records events; kv_event v5's null is the engine's default
    modes = [None if mode == "default" else mode
             for mode in _per_endpoint(getattr(settings, "report_mode", []), endpoints, "--report-mode")]
    if settings.data_parallel_size > 1:
        if len(endpoints) != 1:
            raise ValueError("--data-parallel-size follows the ranks of one engine: give a single --endpoint")
        return data_parallel_endpoints(endpoints[0], replays[0] if replays else None, instances[0],
                                       settings.data_parallel_size, settings.engine, modes[0])
    return [PublisherEndpoint(e, replays[i] if replays else None, instances[i], settings.dp_rank,
                              engine=settings.engine, report_mode=modes[i]) for i, e in enumerate(endpoints)]


def _stop_on_sigterm() -> list:
    """A list that becomes non-empty on SIGTERM, for loops that stop cleanly (as on Ctrl-C)."""
    import signal

    stopping: list = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    return stopping


def _registration_follower(settings, bridge):
    """``(follower, feed)`` for ``kvstream bridge --follow-registrations``: a
    :class:`producers.bridge.RegistrationFollower` of ``bridge`` and the feed of ``kv-instances`` (the settings'
    topic prefix applied) that calls it; the feed opens at its first poll."""
    from kafka_io.schema_registry import reader_codec
    from producers.bridge import RegistrationFollower
    from schemas.topics import TopicNames
    from stream_apps.index.registrations import RegistrationsFeed

    # a single --report-mode is every engine's; one per --endpoint says nothing of the registered ones
    modes = settings.report_mode
    follower = RegistrationFollower(bridge, report_mode=modes[0] if len(modes) == 1 and modes[0] != "default"
                                    else None)
    codec = reader_codec("instance_registration", settings.bootstrap_servers, settings.schema_registry_url,
                         settings.schemas_topic)
    feed = RegistrationsFeed(settings.bootstrap_servers, TopicNames(prefix=settings.topic_prefix).instances,
                             follower.apply, codec)
    return follower, feed


def _per_endpoint(values: list, endpoints: list[str], flag: str) -> list:
    """One value per endpoint from a flag given once (for all), once per endpoint, or not at all (Nones)."""
    if not values:
        return [None] * len(endpoints)
    if len(values) == 1:
        return values * len(endpoints)
    if len(values) != len(endpoints):
        raise ValueError(f"give one {flag} for every --endpoint, or one per --endpoint in the same order")
    return list(values)


def _register_bridge_sources(settings, endpoints) -> list:
    """With ``--model-name`` or ``--block-size``, register the bridge's engines in kv-instances (merged into what
    routers registered); returns what was written."""
    if not settings.model_name and not settings.block_size:
        return []
    from schemas.topics import TopicNames
    from stream_apps.index.fleet_index import SourceInfo
    from stream_apps.index.registrations import register_sources

    bases = settings.endpoint  # one per engine; with --data-parallel-size, rank 0's (the others are offset ports)
    models = _per_endpoint(settings.model_name, bases, "--model-name")
    sizes = _per_endpoint(settings.block_size, bases, "--block-size")
    if any(size is not None and size < 1 for size in sizes):
        raise ValueError("--block-size must be at least 1")
    by_instance = {instance: i for i, instance in enumerate(settings.instance_id)}
    engine_type = {"vllm": "vLLM", "sglang": "SGLang"}[settings.engine]
    infos = []
    for endpoint in endpoints:
        i = by_instance[endpoint.instance_id]
        infos.append(SourceInfo(endpoint.instance_id, model_name=models[i], block_size=sizes[i],
                                endpoint=bases[i], replay_endpoint=(settings.replay_endpoint[i]
                                                                    if settings.replay_endpoint else None),
                                engine_type=engine_type, dp_ranks={endpoint.data_parallel_rank}))
    return register_sources(settings.bootstrap_servers, TopicNames(prefix=settings.topic_prefix).instances, infos)


#: librdkafka's ``linger.ms`` of the bridge's producer (the other producers keep kafka_io.config's 5 ms).
BRIDGE_LINGER_MS = 1


def _cmd_bridge(args: argparse.Namespace) -> int:
    from prometheus_client import start_http_server

    from kvstream.options import settings_from_args
    from producers.bridge import Bridge, BridgeMetrics, KafkaBatchSink
    from producers.kafka_sink import KvEventProducer
    from producers.settings import BridgeSettings

    settings = settings_from_args(BridgeSettings, args)
    configure_logging(settings.log_level, settings.log_format)
    endpoints = _bridge_endpoints(settings)
    registered = _register_bridge_sources(settings, endpoints)
    # a live engine's events wait at most 1 ms for their batch, not librdkafka's 5: the index applies kv-events
    # as they arrive, so the linger is a fifth of an event's way to a router (docs/architecture.md)
    producer = KvEventProducer.from_settings(settings, **{"linger.ms": BRIDGE_LINGER_MS})
    metrics = BridgeMetrics()
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr=settings.metrics_bind, registry=metrics.registry)
    bridge = Bridge(endpoints, KafkaBatchSink(producer, metrics), zmq_topic=settings.zmq_topic.encode(),
                    metrics=metrics, state_file=settings.state_file,
                    heartbeat_interval_s=settings.heartbeat_interval_s,
                    probe_timeout_s=settings.heartbeat_probe_timeout_s)
    stopping = _stop_on_sigterm()
    for e in endpoints:
        print(f"subscribed to {e.endpoint} (replay: {e.replay_endpoint or 'none'}) as {e.label}")
    for info in registered:
        print(f"registered {info.instance_id}: model {info.model_name or 'any'}, block size "
              f"{info.block_size or 'the default'}, ranks {sorted(info.dp_ranks)}", flush=True)
    feed = None
    try:
        if settings.follow_registrations:
            follower, feed = _registration_follower(settings, bridge)
            print(f"following the registrations in {feed.topic}", flush=True)
            follower.run(feed, should_stop=lambda: bool(stopping))
        else:
            bridge.run(should_stop=lambda: bool(stopping))
    except KeyboardInterrupt:
        pass
    finally:
        if feed is not None:
            feed.close()
        bridge.close()
        stats = producer.flush()
        print(f"produced {stats.acked - stats.dead_lettered:,} messages to {settings.events_topic}; "
              f"{stats.dead_lettered:,} inputs to the dead-letter topic {settings.dead_letter_topic}")
    return 0


def add_capture(sub: argparse._SubParsersAction) -> None:
    """``kvstream capture``: record live publishers' batches to a JSON-lines file."""
    from producers.settings import CaptureSettings

    p = sub.add_parser("capture", help="record live engine KV event streams to a JSON-lines file",
                       description="Subscribe like 'kvstream bridge' (same sequencing: replay of gaps, epochs) and "
                                   "write one JSON line per batch to --output (format: docs/ingesting.md). Stops "
                                   "on Ctrl-C, SIGTERM, --max-batches or --duration-s.")
    add_settings_arguments(p, CaptureSettings)
    p.set_defaults(func=_cmd_capture)


def _cmd_capture(args: argparse.Namespace) -> int:
    import time

    from kvstream.options import settings_from_args
    from producers.bridge import Bridge
    from producers.capture import CaptureSink
    from producers.settings import CaptureSettings

    settings = settings_from_args(CaptureSettings, args)
    configure_logging(settings.log_level, settings.log_format)
    endpoints = _bridge_endpoints(settings)
    with open(settings.output, "a") as out:
        sink = CaptureSink(out)
        bridge = Bridge(endpoints, sink, zmq_topic=settings.zmq_topic.encode())
        deadline = None if settings.duration_s is None else time.monotonic() + settings.duration_s
        stopping = _stop_on_sigterm()
        try:
            bridge.run(should_stop=lambda: bool(stopping)
                       or (settings.max_batches is not None and sink.batches >= settings.max_batches)
                       or (deadline is not None and time.monotonic() > deadline))
        except KeyboardInterrupt:
            pass
        finally:
            bridge.close()
    print(f"captured {sink.batches:,} batches to {settings.output}")
    return 0


def add_produce(sub: argparse._SubParsersAction) -> None:
    """``kvstream produce``: publish a capture file to kv-events through the bridge's path."""
    from producers.settings import ProduceSettings

    p = sub.add_parser("produce", help="publish a capture file (JSON lines) to kv-events through the bridge's path",
                       description="Publish a file written by 'kvstream capture' (or any file in its format) "
                                   "exactly as the bridge publishes a live stream: sequence, restart and epoch "
                                   "handling, per-block messages, dead letters. At the end it sends one "
                                   "heartbeat (SourceHeartbeat, evidence 'producing') per source of the file, so "
                                   "the workers' leases of those sources start at load time (the lease runs on "
                                   "the workers' clock of arrival, not the capture's timestamps) and lapse one "
                                   "lease (kvstream worker --source-lease-s) later.")
    add_settings_arguments(p, ProduceSettings)
    p.set_defaults(func=_cmd_produce)


def _counting_sink(producer, metrics):
    """A :class:`producers.bridge.KafkaBatchSink` that also counts, by kind, the messages of the events the bridge
    writes itself (``kinds``: event type -> ``[events, messages]``). Those (a ``SourceStale`` for seqs lost before
    the file's first line, a ``PublisherRestarted``, the final heartbeats) go to every partition: counted with the
    block events, a capture none of whose events was accepted reported "produced 8 messages" (issue 28)."""
    from producers.bridge import KafkaBatchSink

    class CountingSink(KafkaBatchSink):
        def __init__(self, producer, metrics) -> None:
            super().__init__(producer, metrics)
            self.kinds: dict[str, list[int]] = {}

        def source_event(self, publisher, kind, body, seq):
            before = self.producer.stats.sent
            super().source_event(publisher, kind, body, seq)
            counts = self.kinds.setdefault(kind, [0, 0])
            counts[0] += 1
            counts[1] += self.producer.stats.sent - before

    return CountingSink(producer, metrics)


def _reports_text(kinds: dict[str, list[int]]) -> str:
    """``" and 1 report of lost seqs (SourceStale, 8 messages)"``: the bridge's own reports, heartbeats left out."""
    from schemas import PUBLISHER_RESTARTED, SOURCE_STALE

    names = {SOURCE_STALE: "of lost seqs", PUBLISHER_RESTARTED: "of a publisher restart"}
    parts = [f"{events:,} report{'s' * (events != 1)} {names[kind]} ({kind.rsplit('.', 1)[-1]}, {messages:,} "
             f"messages)" for kind, (events, messages) in sorted(kinds.items()) if kind in names]
    return "".join(f", {part}" for part in parts)


def _cmd_produce(args: argparse.Namespace) -> int:
    from kvstream.options import settings_from_args
    from producers.bridge import BridgeMetrics
    from producers.capture import CaptureError, check_capture, produce_capture
    from producers.kafka_sink import KvEventProducer
    from producers.settings import ProduceSettings

    settings = settings_from_args(ProduceSettings, args)
    configure_logging(settings.log_level, settings.log_format)
    try:  # the local input first: a missing file is no reason to wait for Kafka
        check_capture(settings.jsonl, settings.engine)
    except CaptureError as exc:
        print(f"kvstream produce: error: --jsonl {exc}", file=sys.stderr)
        return 2
    producer = KvEventProducer.from_settings(settings)
    metrics = BridgeMetrics()
    sink = _counting_sink(producer, metrics)
    bridge = produce_capture(settings.jsonl, sink, metrics, settings.engine)

    def block_messages() -> int:  # what the file's block events became, without the bridge's own reports
        return producer.stats.sent - producer.stats.dead_lettered - sum(m for _, m in sink.kinds.values())

    # one heartbeat per source at the end: the workers' leases (their clock of arrival) start now, whatever the
    # capture's timestamps; the sources then lapse one lease later, as nothing more will come from them. A file
    # none of whose events became a block record has no blocks to keep alive, and gets none.
    sources = bridge.send_heartbeats() if block_messages() > 0 else 0
    stats = producer.flush()  # raises ProduceError unless every message was acknowledged
    accepted = block_messages()
    dead_letter = settings.dead_letter_topic
    heartbeats = f"a heartbeat of each of its {sources:,} sources" if sources else "no heartbeat"
    print(f"produced {accepted:,} messages to {settings.events_topic} from {settings.jsonl} (block events)"
          f"{_reports_text(sink.kinds)}, {heartbeats}; {stats.dead_lettered:,} inputs to the dead-letter topic "
          f"{dead_letter}")
    if accepted:
        return 0
    if stats.dead_lettered:
        why = (f"every input went to the dead-letter topic: none became a KV event record (the reason of each is "
               f"in its kvstream-error header: kvstream tail {dead_letter} --from-beginning)")
    else:
        why = f"{settings.jsonl} holds no block event"
    print(f"kvstream produce: error: nothing was accepted: {why}", file=sys.stderr)
    return 1
