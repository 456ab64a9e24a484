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
    """``kvstream unregister``: a source-scoped clear of every tier of one instance in kv-events, and the removal of
    its registration from kv-instances."""
    p = sub.add_parser("unregister", help="remove an instance's blocks from every answer: a source-scoped clear of "
                                          "every tier in kv-events, and its registration from kv-instances",
                       description="Write a SourceUnregistered of INSTANCE to every partition of kv-events: every "
                                   "worker and every index removes the instance's rows on every tier and ownership, "
                                   "in order with its events (events it publishes later apply again); and remove "
                                   "the rank (or the whole instance) from its registration in kv-instances. The path "
                                   "for a Kubernetes endpoint deletion, or for an operator. An instance neither "
                                   "registered nor known from its events is refused (exit code 1: service not "
                                   "found), as POST /unregister answers 404.")
    p.add_argument("instance_id", metavar="INSTANCE", help="the instance, as its events name it")
    p.add_argument("--dp-rank", type=int, default=None, help="only this data-parallel rank (default: every rank)")
    p.add_argument("--tenant-id", default="default", help="the tenant it was registered under (default: %(default)s)")
    p.add_argument("--reason", default="kvstream unregister", help="why, recorded in the event and the workers' logs")
    p.add_argument("--bootstrap-servers", default=DEFAULT_BOOTSTRAP, help="Kafka bootstrap servers "
                                                                         "(default: %(default)s)")
    p.add_argument("--app-id", default="kvstream", help="the workers' app id, whose sources table says which "
                                                        "instances the workers know (default: %(default)s)")
    p.add_argument("--topic-prefix", default="", help="prefix of every topic name (default: none)")
    p.set_defaults(func=_cmd_unregister)


def known_ranks(bootstrap: str, topics, instance: str, tenant: str) -> tuple[object, set[int], set[int]]:
    """What the fleet knows of ``instance``: ``(its registration under tenant or None, its registered ranks, the
    ranks the workers know from its events)``, read from kv-instances and the workers' sources changelog (an
    instance never registered is in the default tenant)."""
    from kafka_io.admin import topic_partitions
    from stream_apps.index.registrations import read_registrations
    from stream_apps.snapshot import read_table

    registration = read_registrations(bootstrap, topics.instances).get(instance)
    if registration is not None and registration.tenant_id != tenant:
        registration = None
    registered = set(registration.dp_ranks or {0}) if registration is not None else set()
    seen: set[int] = set()
    sources = topics.changelog("sources")
    if tenant == "default":
        try:
            topic_partitions(bootstrap, sources)
        except RuntimeError:  # no worker of this app has run: nothing is known from events
            return registration, registered, seen
        seen = {row["data_parallel_rank"] for row in read_table(bootstrap, sources, "source_status").values()
                if row["instance_id"] == instance}
    return registration, registered, seen


def _cmd_unregister(args: argparse.Namespace) -> int:
    from kafka_io.admin import topic_partitions
    from kafka_io.config import check_bootstrap_servers
    from schemas.topics import TopicNames
    from stream_apps.index.conductor import service_key, service_not_found
    from stream_apps.index.liveness import write_unregister
    from stream_apps.index.registrations import RegistrationWriter, reduced_registration

    bootstrap = check_bootstrap_servers(args.bootstrap_servers)
    tenant = args.tenant_id or "default"
    topics = TopicNames(args.app_id, args.topic_prefix)
    topic = topics.kv_events
    # asked first, within the connect timeout: write_unregister's own metadata request waits 10 s for a broker that
    # is not there and raises librdkafka's exception, which printed a traceback (issue 28)
    topic_partitions(bootstrap, topic)
    registration, registered, seen = known_ranks(bootstrap, topics, args.instance_id, tenant)
    ranks = (registered | seen) if args.dp_rank is None else {args.dp_rank} & (registered | seen)
    if not ranks:
        raise RuntimeError(f"{service_not_found(args.instance_id, tenant, args.dp_rank).error}: neither registered "
                           f"in {topics.instances} nor known to the workers of {args.app_id!r} from its events; "
                           "nothing written")
    partitions = write_unregister(bootstrap, topic, args.instance_id, args.dp_rank, args.reason)
    deregistered = registration is not None and (args.dp_rank is None or args.dp_rank in registered)
    if deregistered:
        writer = RegistrationWriter(bootstrap, topics.instances)
        remaining = None if args.dp_rank is None else reduced_registration(registration, args.dp_rank)
        if remaining is None:
            writer.remove(args.instance_id)
        else:
            writer.write(remaining)
        writer.close()
    which = "every rank" if args.dp_rank is None else f"rank {args.dp_rank}"
    removed = ", ".join(service_key(args.instance_id, tenant, rank) for rank in sorted(ranks))
    registry = f", and {'the rank is' if args.dp_rank is not None else 'it is'} out of its registration in " \
               f"{topics.instances}" if deregistered else ""
    print(f"unregistered {args.instance_id} ({which}: {removed}): a SourceUnregistered is on all {partitions} "
          f"partitions of {topic}{registry}; every worker and index removes its rows on every tier as it reads it",
          file=sys.stderr)
    return 0
