"""``kvstream``: one command line for the whole pipeline.

Subcommands: ``demo`` (everything, on the embedded broker), ``broker`` (the embedded Kafka broker and
Kafka's CLI tools), ``simulate`` (replay the trace into kv-events), ``bridge`` (live engine publishers into
kv-events), ``capture`` and ``produce`` (record live publishers to a file, publish the file), ``worker``
(the Faust stream app), ``tail`` (print a topic decoded), ``export`` and ``report`` (the residency changes
as Parquet or JSON lines, plots and a summary), ``query`` (ask a worker's HTTP views). Every
subcommand that talks to Kafka takes ``--bootstrap-servers``. The benchmark and the fault scenarios are
not subcommands: ``make bench`` (``python -m bench``) and ``make chaos`` (``python -m chaos``).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from kafka_io.config import DEFAULT_BOOTSTRAP_SERVERS as DEFAULT_BOOTSTRAP
from kafka_io.config import DEFAULT_PARTITIONS
from kafka_io.logs import configure_logging
from kvstream import broker, registry
from kvstream.options import interrupt_on_sigterm, positive_int, run_command


def _version() -> str:
    """The installed distribution's version (``pyproject.toml``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvstream")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvstream.demo import DemoOptions, run_demo

    interrupt_on_sigterm()
    return run_demo(DemoOptions(port=args.port, web_port=args.web_port, work_dir=args.work_dir, trace=args.trace,
                                requests=args.requests, partitions=args.partitions, instances=args.instances,
                                keep_running=args.keep_running, timeout_s=args.timeout,
                                registry_port=args.registry_port, no_registry=args.no_registry))


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


def _cmd_worker(args: argparse.Namespace) -> int:
    from kvstream.options import settings_from_args
    from kvstream.worker import run_worker
    from stream_apps.settings import WorkerSettings

    return run_worker(settings_from_args(WorkerSettings, args))


def _cmd_index(args: argparse.Namespace) -> int:
    from kvstream.options import settings_from_args
    from stream_apps.index.server import run_index
    from stream_apps.index.settings import IndexSettings

    settings = settings_from_args(IndexSettings, args)
    configure_logging(settings.log_level, settings.log_format)
    return run_index(settings)


def _cmd_unregister(args: argparse.Namespace) -> int:
    from kafka_io.config import check_bootstrap_servers
    from schemas.topics import TopicNames
    from stream_apps.index.liveness import write_unregister

    bootstrap = check_bootstrap_servers(args.bootstrap_servers)
    topic = TopicNames(prefix=args.topic_prefix).kv_events
    partitions = write_unregister(bootstrap, topic, args.instance_id, args.dp_rank, args.reason)
    which = "every rank" if args.dp_rank is None else f"rank {args.dp_rank}"
    print(f"unregistered {args.instance_id} ({which}): a SourceUnregistered is on all {partitions} partitions of "
          f"{topic}; every worker and index removes its rows on every tier as it reads it", file=sys.stderr)
    return 0


def _query_tokens(args: argparse.Namespace, settings) -> int:
    """``kvstream query tokens``: ``POST /query`` with the token ids given, printed as JSON."""
    from kvstream.client import IndexClient, IndexQueryError

    try:
        tokens = [int(t) for t in args.block_hash]
    except ValueError:
        print("error: query tokens takes token ids (integers), e.g. 'kvstream query tokens 1 2 3'", file=sys.stderr)
        return 2
    if args.token_file is not None:
        try:
            tokens += [int(t) for t in json.loads(Path(args.token_file).read_text())]
        except (OSError, ValueError, TypeError) as exc:
            print(f"error: --token-file {args.token_file}: expected a JSON list of token ids ({exc})",
                  file=sys.stderr)
            return 2
    if not tokens:
        print("error: query tokens needs token ids, as arguments or with --token-file", file=sys.stderr)
        return 2
    options = {"model_name": args.model, "lora_name": args.lora_name, "cache_salt": args.cache_salt,
               "block_size": args.block_size}
    try:
        with IndexClient(settings.worker_url, timeout_s=settings.request_timeout_s) as client:
            answer = client.query(tokens, **options)
    except IndexQueryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: no index or worker answered at {settings.worker_url}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=2))
    return 0


def _lag_text(answer: dict) -> str:
    """How far the workers are behind, from a fleet view's answer (``lag``, ``lag_by_topic``, ``lag_error``)."""
    if answer.get("lag") is None:
        return f"their lag is unknown ({answer.get('lag_error') or 'no reading'})"
    topics = ", ".join(f"{topic} {lag:,}" for topic, lag in sorted(answer.get("lag_by_topic", {}).items()) if lag)
    return f"{answer['lag']:,} messages of their input to go" + (f" ({topics})" if topics else "")


def _wait_caught_up(settings, poll_s: float = 1.0) -> int:
    """Poll ``GET /occupancy/`` until the workers report ``caught_up``; progress on standard error. Returns 0
    once they have, else the exit code (1: the wait timed out, or the URL is no worker's)."""
    import time

    url = settings.worker_url + "/occupancy/"
    started = time.monotonic()
    said = None
    while True:
        try:
            with urllib.request.urlopen(url, timeout=settings.request_timeout_s) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            print(f"error: --wait-caught-up: {url} answered HTTP {exc.code}: it needs a stream-app worker's URL "
                  "(a 'kvstream index' replica has no /occupancy/)", file=sys.stderr)
            return 1
        except (OSError, ValueError) as exc:  # not up yet (a worker starting), or a broken answer
            answer = {"lag": None, "lag_error": f"no worker answered at {settings.worker_url}: {exc}"}
        if "caught_up" not in answer and "lag_error" not in answer:
            print(f"error: --wait-caught-up: {url} does not say whether it has caught up (a worker older than this "
                  "command?)", file=sys.stderr)
            return 1
        if answer.get("caught_up"):
            if said is not None:
                print(f"the workers have caught up ({time.monotonic() - started:.0f} s)", file=sys.stderr)
            return 0
        waited = time.monotonic() - started
        if waited >= settings.wait_timeout_s:
            print(f"error: the workers have not caught up after {settings.wait_timeout_s:g} s: {_lag_text(answer)}",
                  file=sys.stderr)
            return 1
        text = _lag_text(answer)
        if text != said:
            print(f"waiting for the workers to catch up: {text}", file=sys.stderr)
            said = text
        time.sleep(min(poll_s, max(settings.wait_timeout_s - waited, 0.0)))


def _cmd_query(args: argparse.Namespace) -> int:
    from kvstream.options import settings_from_args
    from kvstream.settings import QuerySettings
    from schemas import InvalidBlockHash, parse_block_hash

    settings = settings_from_args(QuerySettings, args)
    if settings.wait_caught_up and (code := _wait_caught_up(settings)):
        return code
    if args.what == "tokens":
        return _query_tokens(args, settings)
    data = None
    try:  # refused here, with the accepted forms, rather than by the worker
        hashes = [parse_block_hash(text).hex() for text in args.block_hash]
    except InvalidBlockHash as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.what == "residency":
        if len(hashes) != 1:
            print("error: query residency needs one block hash", file=sys.stderr)
            return 2
        path = f"/residency/{urllib.parse.quote(hashes[0])}/"
    elif args.what == "prefix-match":
        if not hashes:
            print("error: query prefix-match needs the request's block hashes, in prefix order",
                  file=sys.stderr)
            return 2
        path, data = "/prefix-match/", json.dumps({"block_hashes": hashes}).encode()
    elif hashes:
        print(f"error: query {args.what} takes no block hash", file=sys.stderr)
        return 2
    else:
        path = "/workers" if args.what == "workers" else f"/{args.what}/"
    request = urllib.request.Request(settings.worker_url + path, data=data,
                                     headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=settings.request_timeout_s) as response:
            answer = json.loads(response.read())
        print(json.dumps(answer, indent=2))
        if isinstance(answer, dict) and answer.get("caught_up") is False:
            print(f"warning: the workers have not caught up with their input, {_lag_text(answer)}: these figures "
                  "are partial (--wait-caught-up waits for them)", file=sys.stderr)
        return 0
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
        try:
            body = json.loads(body)["error"]
        except (ValueError, KeyError, TypeError):
            pass
        print(f"error: HTTP {exc.code}: {body}", file=sys.stderr)
    except OSError as exc:
        print(f"error: no stream-app worker answered at {settings.worker_url}: {exc}", file=sys.stderr)
    return 1


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
    modes = list(getattr(settings, "report_mode", None) or ["default"])  # capture has none: it records events
    if len(modes) == 1:
        modes *= len(endpoints)
    if len(modes) != len(endpoints):
        raise ValueError("give one --report-mode for every --endpoint, or one per --endpoint in the same order")
    modes = [None if mode == "default" else mode for mode in modes]  # kv_event v5: null is the engine's default
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
    producer = KvEventProducer.from_settings(settings)
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


def _cmd_produce(args: argparse.Namespace) -> int:
    from kvstream.options import settings_from_args
    from producers.bridge import BridgeMetrics, KafkaBatchSink
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
    bridge = produce_capture(settings.jsonl, KafkaBatchSink(producer, metrics), metrics, settings.engine)
    # one heartbeat per source at the end: the workers' leases (their clock of arrival) start now, whatever the
    # capture's timestamps; the sources then lapse one lease later, as nothing more will come from them. A file
    # none of whose inputs became a record has no source to keep alive, and gets none.
    before = producer.stats.sent
    sources = bridge.send_heartbeats() if producer.stats.sent > producer.stats.dead_lettered else 0
    heartbeat_messages = producer.stats.sent - before
    stats = producer.flush()
    accepted = stats.acked - stats.dead_lettered - heartbeat_messages
    dead_letter = settings.dead_letter_topic
    print(f"produced {accepted:,} messages to {settings.events_topic} from {settings.jsonl} and a heartbeat of each "
          f"of its {sources:,} sources; {stats.dead_lettered:,} inputs to the dead-letter topic {dead_letter}")
    if accepted:
        return 0
    if stats.dead_lettered:
        why = (f"every input went to the dead-letter topic: none became a KV event record (the reason of each is "
               f"in its kvstream-error header: kvstream tail {dead_letter} --from-beginning)")
    else:
        why = f"{settings.jsonl} holds no block event"
    print(f"kvstream produce: error: nothing was accepted: {why}", file=sys.stderr)
    return 1


def _cmd_tail(args: argparse.Namespace) -> int:
    from kvstream.options import settings_from_args
    from kvstream.settings import TailSettings, app_topic
    from kvstream.tail import reader_codecs, tail
    from schemas.topics import TopicNames

    settings = settings_from_args(TailSettings, args)
    names = TopicNames(settings.app_id, settings.topic_prefix)
    codecs = reader_codecs(settings.bootstrap_servers, settings.schema_registry_url, names.schemas)
    tail(settings.bootstrap_servers, app_topic(args.topic, names), from_beginning=settings.from_beginning,
         max_messages=settings.max_messages, idle_timeout_s=settings.idle_timeout_s, to_end=settings.to_end,
         codecs=codecs)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from kvstream.export import export, resolve_source
    from kvstream.options import settings_from_args
    from kvstream.settings import ExportSettings, parse_offsets

    settings = settings_from_args(ExportSettings, args)
    source = resolve_source(args.source, settings.topics)
    from kafka_io.schema_registry import reader_codec

    codec = reader_codec("residency_change", settings.bootstrap_servers, settings.schema_registry_url,
                         settings.topics.schemas)
    result = export(settings.bootstrap_servers, source, settings.output, settings.format,
                    until_offset=parse_offsets(settings.until_offset), until_time=settings.until_time,
                    timeout_s=settings.read_timeout_s, progress=True, codec=codec)
    what = "residency changes" if source.kind == "changes" else "resident rows of the residency table"
    print(f"exported {result.rows:,} {what} from {source.topic} to {result.path} ({settings.format}) in "
          f"{result.seconds:.1f}s", file=sys.stderr)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from kvstream.options import settings_from_args
    from kvstream.report import report
    from kvstream.settings import ReportSettings

    settings = settings_from_args(ReportSettings, args)
    summary = report(settings, args.source)
    print(summary.text)
    print(f"\nwrote {', '.join(str(p) for p in summary.files)}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``kvstream`` argument parser (every subcommand sets ``func``)."""
    from kvstream.options import add_settings_arguments
    from kvstream.settings import ExportSettings, QuerySettings, ReportSettings, TailSettings
    from producers.settings import BridgeSettings, CaptureSettings, ProduceSettings, SimulateSettings
    from producers.simulator import DEFAULT_TRACE, FleetConfig
    from stream_apps.index.settings import IndexSettings
    from stream_apps.settings import WorkerSettings

    parser = argparse.ArgumentParser(
        prog="kvstream",
        description="KV cache events of LLM serving engines -> Kafka (Avro, keyed by block hash) -> Faust "
                    "stream app -> tier residency tables: which instance holds which block on which tier.",
        epilog="Start with 'kvstream demo'. Each subcommand has its own --help.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    fleet = FleetConfig()

    p = sub.add_parser("demo", help="run the whole pipeline on the embedded broker and the Mooncake trace",
                       description="Start a fresh local Kafka broker, replay the Mooncake trace through a simulated "
                                   "fleet into kv-events, run a stream-app worker until it has consumed everything, "
                                   "print the tier occupancy and each stage's speed, and compare the residency table "
                                   "with the simulator's ground truth row for row (exit code 1 on any difference).")
    p.add_argument("--port", type=int, default=9092, help="broker port on 127.0.0.1 (default: %(default)s)")
    p.add_argument("--web-port", type=int, default=6066, help="worker HTTP port (default: %(default)s)")
    p.add_argument("--work-dir", type=Path, default=Path(".kvstream/demo"),
                   help="broker and worker files; emptied at start (default: %(default)s)")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format trace (default: vendored)")
    p.add_argument("--requests", type=positive_int, default=None,
                   help="replay only the first N requests (default: all)")
    p.add_argument("--partitions", type=positive_int, default=DEFAULT_PARTITIONS,
                   help="partitions (default: %(default)s)")
    p.add_argument("--instances", type=positive_int, default=fleet.instances,
                   help="simulated instances (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=1800, metavar="SECONDS",
                   help="give up if the worker has not consumed everything by then (default: %(default)s)")
    p.add_argument("--keep-running", action="store_true",
                   help="leave the broker and the worker running and print where the HTTP views answer")
    p.add_argument("--registry-port", type=int, default=8081,
                   help="port of the schema registry the demo runs (default: %(default)s)")
    p.add_argument("--no-registry", action="store_true",
                   help="run without a schema registry: single-object framing instead of the Confluent wire format")
    p.set_defaults(func=_cmd_demo)

    broker.register_cli(sub)
    registry.register_cli(sub)

    p = sub.add_parser("simulate", help="replay a trace through the simulated fleet into kv-events",
                       description="Route each request of a Mooncake-format trace to a simulated instance by prefix "
                                   "affinity, simulate its GPU pool, CPU offload tier and KVCR secondary tier, and "
                                   "produce the resulting vLLM-shaped events, one Kafka message per block. Each "
                                   "simulated publisher gets a heartbeat every --heartbeat-interval-s while the "
                                   "replay runs, and one at its end.")
    add_settings_arguments(p, SimulateSettings)
    p.set_defaults(func=_cmd_simulate)

    p = sub.add_parser("worker", help="run a stream-app worker (Faust); start several to share the partitions",
                       description="Run one worker of the Faust stream app: re-key kv-events by ownership, "
                                   "materialize the residency and tier-occupancy tables, serve the HTTP views. "
                                   "Workers with the same --app-id share the partitions. Each setting is taken "
                                   "from its flag, else its KVSTREAM_* variable, else its default.")
    add_settings_arguments(p, WorkerSettings)
    p.set_defaults(func=_cmd_worker)

    p = sub.add_parser("index", help="run a query-only replica of the fleet index (router APIs; no partitions, "
                                     "no writes)",
                       description="Read the workers' residency changelog into a compact in-memory index of the "
                                   "whole fleet and serve the router APIs on it: POST /query (token ids, Mooncake's "
                                   "and Dynamo's API), /query_by_hash, /prefix-match/, /register, GET /workers, "
                                   "/dump. It joins no consumer group and writes nothing: add replicas to scale "
                                   "reads. Answers 503 until it has read the changelog to its end as of its start.")
    add_settings_arguments(p, IndexSettings)
    p.set_defaults(func=_cmd_index)

    p = sub.add_parser("unregister", help="remove an instance's blocks from every answer: a source-scoped clear of "
                                          "every tier in kv-events",
                       description="Write a SourceUnregistered of INSTANCE to every partition of kv-events: every "
                                   "worker and every index removes the instance's rows on every tier and ownership, "
                                   "in order with its events (events it publishes later apply again). The path for "
                                   "a Kubernetes endpoint deletion, or for an operator. POST /unregister does the "
                                   "same over HTTP.")
    p.add_argument("instance_id", metavar="INSTANCE", help="the instance, as its events name it")
    p.add_argument("--dp-rank", type=int, default=None, help="only this data-parallel rank (default: every rank)")
    p.add_argument("--reason", default="kvstream unregister", help="why, recorded in the event and the workers' logs")
    p.add_argument("--bootstrap-servers", default=DEFAULT_BOOTSTRAP, help="Kafka bootstrap servers "
                                                                         "(default: %(default)s)")
    p.add_argument("--topic-prefix", default="", help="prefix of every topic name (default: none)")
    p.set_defaults(func=_cmd_unregister)

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

    p = sub.add_parser("capture", help="record live engine KV event streams to a JSON-lines file",
                       description="Subscribe like 'kvstream bridge' (same sequencing: replay of gaps, epochs) and "
                                   "write one JSON line per batch to --output (format: docs/ingesting.md). Stops "
                                   "on Ctrl-C, SIGTERM, --max-batches or --duration-s.")
    add_settings_arguments(p, CaptureSettings)
    p.set_defaults(func=_cmd_capture)

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

    p = sub.add_parser("tail", help="print a pipeline topic's messages decoded, as JSON lines",
                       description="Print the messages of kv-events, <app id>-kv-events-by-ownership, a table "
                                   "changelog (<app id>-<table>-changelog) or the dead-letter topic as JSON lines, "
                                   "values decoded with the project's Avro schemas, bytes as hex. The app's topics "
                                   "may be named without their '<app id>-' (kv-residency-changes, "
                                   "residency-changelog): those of --app-id, with --topic-prefix in front.")
    p.add_argument("topic", help="topic to read, e.g. kv-events, kv-residency-changes (short for "
                                 "<app id>-kv-residency-changes) or kvstream-residency-changelog")
    add_settings_arguments(p, TailSettings)
    p.set_defaults(func=_cmd_tail)

    p = sub.add_parser("export", help="write the residency changes, or a snapshot of the residency table, to "
                                      "Parquet or JSON lines",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Read the residency changes (topic <app id>-kv-residency-changes) or the residency "
                                   "table (from its changelog) to the end of the topic as it is now, or to "
                                   "--until-offset / --until-time, and write them to --output.\n\n"
                                   "Parquet columns are typed: block_hash as hex (16 digits; 64 for 32-byte "
                                   "digests), times (ts, since, last_ts, kafka_timestamp) as UTC timestamps, "
                                   "ownership, medium and locality as nullable strings. JSON lines carry the same "
                                   "columns, times in ISO 8601. Column meanings: docs/analytics.md.",
                       epilog="Examples:\n"
                              "  kvstream export kv-residency-changes --output changes.parquet\n"
                              "  kvstream export residency --output residency.parquet --until-time "
                              "2026-01-01T00:30:00Z\n"
                              "  kvstream export kvstream-kv-residency-changes --format jsonl --output changes.jsonl "
                              "--until-offset 0:5000,1:5000")
    p.add_argument("source", metavar="TOPIC|TABLE",
                   help="kv-residency-changes (or the topic <app id>-kv-residency-changes): one row per change; "
                        "residency (or its changelog, residency-changelog or <app id>-residency-changelog): one "
                        "row per resident row")
    add_settings_arguments(p, ExportSettings)
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("report", help="plots (PNG) and a summary table of the residency changes",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Replay the residency changes, from their topic or from a Parquet file written "
                                   "by 'kvstream export', and write to --output-dir:\n"
                                   "  resident_blocks.png   resident blocks over time, per tier and instance\n"
                                   "  dwell_time.png        how long blocks stay on each tier before removal\n"
                                   "  tier_transitions.png  where blocks go: new -> GPU -> CPU -> STORAGE -> gone\n"
                                   "  occupancy_as_of.png   the fleet's occupancy at --as-of\n"
                                   "  overview.png          the four in one image\n"
                                   "  summary.md, summary.json  the summary table (also printed)\n"
                                   "Times are engine times (the changes' ts). A change repeated by an at-least-once "
                                   "redelivery is counted once.",
                       epilog="Examples:\n"
                              "  kvstream report                                   # the app's changes topic\n"
                              "  kvstream report changes.parquet --as-of 2026-01-01T00:30:00Z\n"
                              "  kvstream report team-a.kvstream-kv-residency-changes --output-dir report-a")
    p.add_argument("source", metavar="SOURCE", nargs="?", default=None,
                   help="a Parquet file written by 'kvstream export' (a path ending in .parquet), or a residency "
                        "changes topic: kv-residency-changes (the default) is <app id>-kv-residency-changes of "
                        "--app-id")
    add_settings_arguments(p, ReportSettings)
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("query", help="ask a running worker or index: residency of a block, prefix match, a "
                                     "prompt's tokens, occupancy, sources, workers, stats",
                       description="Query a stream-app worker's HTTP views (or a 'kvstream index' replica's: "
                                   "prefix-match, tokens, workers) and print the JSON answer. Any worker answers "
                                   "for the whole fleet.",
                       epilog="examples:\n"
                              "  kvstream query occupancy --wait-caught-up    # once the workers have consumed "
                              "everything\n"
                              "  kvstream query residency e220a8397b1dcdaf\n"
                              "  kvstream query prefix-match e220a8397b1dcdaf 5c1a5e1f3a0b7c44\n"
                              "  kvstream query tokens --token-file prompt.json --block-size 16 --model llama\n"
                              "  kvstream query workers --worker-url http://127.0.0.1:6080",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["residency", "prefix-match", "tokens", "occupancy", "sources", "workers",
                                    "stats"], help="which view")
    p.add_argument("block_hash", nargs="*", help="block hash: 16 or 64 hex digits, or a decimal integer as vLLM or "
                                                 "SGLang logs it (residency: one; prefix-match: the "
                                                 "request's blocks in prefix order); for tokens: token ids")
    p.add_argument("--token-file", default=None, help="tokens: a JSON list of token ids (added after any given "
                                                      "as arguments)")
    p.add_argument("--model", default=None, help="tokens: only instances serving this model (default: any)")
    p.add_argument("--lora-name", default=None, help="tokens: the request's LoRA adapter")
    p.add_argument("--cache-salt", default=None, help="tokens: the request's cache salt")
    p.add_argument("--block-size", type=positive_int, default=None,
                   help="tokens: tokens per block (default: each instance's registered block size)")
    add_settings_arguments(p, QuerySettings)
    p.set_defaults(func=_cmd_query)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvstream`` command."""
    args = build_parser().parse_args(argv)
    return run_command(f"kvstream {args.command}", args.func, args)


if __name__ == "__main__":
    sys.exit(main())
