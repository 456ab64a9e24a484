"""The ``kvstream`` commands around the pipeline: ``demo`` (all of it on a fresh embedded broker, checked
against the simulator's ground truth), ``tail`` (print a pipeline topic decoded), ``export`` (the residency
changes or table to Parquet or JSON lines) and ``report`` (plots and a summary of the residency changes).

Each command has an ``add_<command>`` that adds its subparser (flags, help texts) for
:func:`kvstream.cli.build_parser`, and a ``_cmd_<command>`` that runs it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kafka_io.config import DEFAULT_PARTITIONS
from kvstream.options import add_settings_arguments, interrupt_on_sigterm, positive_int


def add_demo(sub: argparse._SubParsersAction) -> None:
    """``kvstream demo``: the demo's own flags (no settings class: flags only)."""
    from producers.simulator import DEFAULT_TRACE, FleetConfig

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


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvstream.demo import DemoOptions, run_demo

    interrupt_on_sigterm()
    return run_demo(DemoOptions(port=args.port, web_port=args.web_port, work_dir=args.work_dir, trace=args.trace,
                                requests=args.requests, partitions=args.partitions, instances=args.instances,
                                keep_running=args.keep_running, timeout_s=args.timeout,
                                registry_port=args.registry_port, no_registry=args.no_registry))


def add_tail(sub: argparse._SubParsersAction) -> None:
    """``kvstream tail``: print a pipeline topic's messages decoded, as JSON lines."""
    from kvstream.settings import TailSettings

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


def _cmd_tail(args: argparse.Namespace) -> int:
    from kvstream.options import settings_from_args
    from kvstream.settings import TailSettings, app_topic
    from kvstream.tail import reader_codecs, tail
    from schemas.topics import TABLE_FAMILIES, TopicNames

    settings = settings_from_args(TailSettings, args)
    names = TopicNames(settings.app_id, settings.topic_prefix)
    codecs = reader_codecs(settings.bootstrap_servers, settings.schema_registry_url, names.schemas)
    try:
        tail(settings.bootstrap_servers, app_topic(args.topic, names), from_beginning=settings.from_beginning,
             max_messages=settings.max_messages, idle_timeout_s=settings.idle_timeout_s, to_end=settings.to_end,
             codecs=codecs)
    except RuntimeError as exc:
        if args.topic in TABLE_FAMILIES and "does not exist" in str(exc):  # a table's name, not a topic's
            raise RuntimeError(f"{exc}: the {args.topic} table is kept in the topic {args.topic}-changelog "
                               f"(kvstream tail {args.topic}-changelog)") from None
        raise
    return 0


def add_export(sub: argparse._SubParsersAction) -> None:
    """``kvstream export``: the residency changes, or the residency table, to a file."""
    from kvstream.settings import ExportSettings

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


def add_report(sub: argparse._SubParsersAction) -> None:
    """``kvstream report``: plots and a summary of the residency changes."""
    from kvstream.settings import ReportSettings

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


def _cmd_report(args: argparse.Namespace) -> int:
    from kvstream.options import settings_from_args
    from kvstream.report import report
    from kvstream.settings import ReportSettings

    settings = settings_from_args(ReportSettings, args)
    summary = report(settings, args.source)
    print(summary.text)
    print(f"\nwrote {', '.join(str(p) for p in summary.files)}", file=sys.stderr)
    return 0
