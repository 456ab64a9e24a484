"""The ``kvstream`` commands of the fleet's tables: ``worker`` (a stream-app worker, which materializes them),
``index`` (a query-only replica of the fleet index) and ``unregister`` (remove an instance's blocks from every
answer).

Each command has an ``add_<command>`` that adds its subparser (flags, help texts) for
:func:`kvstream.cli.build_parser`, and a ``_cmd_<command>`` that runs it.
"""

from __future__ import annotations

import argparse
import sys

from kafka_io.config import DEFAULT_BOOTSTRAP_SERVERS as DEFAULT_BOOTSTRAP
from kafka_io.logs import configure_logging
from kvstream.options import add_settings_arguments


def add_worker(sub: argparse._SubParsersAction) -> None:
    """``kvstream worker``: one worker of the Faust stream app."""
    from stream_apps.settings import WorkerSettings

    p = sub.add_parser("worker", help="run a stream-app worker (Faust); start several to share the partitions",
                       description="Run one worker of the Faust stream app: re-key kv-events by ownership, "
                                   "materialize the residency and tier-occupancy tables, serve the HTTP views. "
                                   "Workers with the same --app-id share the partitions. Each setting is taken "
                                   "from its flag, else its KVSTREAM_* variable, else its default.")
    add_settings_arguments(p, WorkerSettings)
    p.set_defaults(func=_cmd_worker)


def _cmd_worker(args: argparse.Namespace) -> int:
    from kvstream.options import settings_from_args
    from kvstream.worker import run_worker
    from stream_apps.settings import WorkerSettings

    return run_worker(settings_from_args(WorkerSettings, args))


def add_index(sub: argparse._SubParsersAction) -> None:
    """``kvstream index``: a query-only replica of the fleet index (the router APIs)."""
    from stream_apps.index.settings import IndexSettings

    p = sub.add_parser("index", help="run a query-only replica of the fleet index (router APIs; no partitions, "
                                     "no writes)",
                       description="Read the workers' residency changelog into a compact in-memory index of the "
                                   "whole fleet and serve the router APIs on it: POST /query (token ids, Mooncake's "
                                   "and Dynamo's API), /query_by_hash, /prefix-match/, /register, GET /workers, "
                                   "/dump. It joins no consumer group and writes nothing: add replicas to scale "
                                   "reads. Answers 503 until it has read the changelog to its end as of its start.")
    add_settings_arguments(p, IndexSettings)
    p.set_defaults(func=_cmd_index)


def _cmd_index(args: argparse.Namespace) -> int:
    from kvstream.options import settings_from_args
    from stream_apps.index.server import run_index
    from stream_apps.index.settings import IndexSettings

    settings = settings_from_args(IndexSettings, args)
    configure_logging(settings.log_level, settings.log_format)
    return run_index(settings)


def add_unregister(sub: argparse._SubParsersAction) -> None:
    """``kvstream unregister``: a source-scoped clear of every tier of one instance in kv-events."""
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


def _cmd_unregister(args: argparse.Namespace) -> int:
    from kafka_io.admin import topic_partitions
    from kafka_io.config import check_bootstrap_servers
    from schemas.topics import TopicNames
    from stream_apps.index.liveness import write_unregister

    bootstrap = check_bootstrap_servers(args.bootstrap_servers)
    topic = TopicNames(prefix=args.topic_prefix).kv_events
    # asked first, within the connect timeout: write_unregister's own metadata request waits 10 s for a broker that
    # is not there and raises librdkafka's exception, which printed a traceback (issue 28)
    topic_partitions(bootstrap, topic)
    partitions = write_unregister(bootstrap, topic, args.instance_id, args.dp_rank, args.reason)
    which = "every rank" if args.dp_rank is None else f"rank {args.dp_rank}"
    print(f"unregistered {args.instance_id} ({which}): a SourceUnregistered is on all {partitions} partitions of "
          f"{topic}; every worker and index removes its rows on every tier as it reads it", file=sys.stderr)
    return 0
