"""``kvstream``: one command line for the whole pipeline.

Subcommands: ``demo`` (everything, on the embedded broker), ``broker`` (the embedded Kafka broker and
Kafka's CLI tools), ``registry`` (a local schema registry), ``simulate`` (replay the trace into kv-events),
``bridge`` (live engine publishers into kv-events), ``capture`` and ``produce`` (record live publishers to a
file, publish the file), ``worker`` (the Faust stream app), ``index`` (a query-only replica of the fleet index),
``unregister`` (remove an instance's blocks from every answer), ``tail`` (print a topic decoded), ``export``
and ``report`` (the residency changes as Parquet or JSON lines, plots and a summary), ``query`` (ask a
worker's HTTP views). Every subcommand that talks to Kafka takes ``--bootstrap-servers``. The benchmark and
the fault scenarios are not subcommands: ``make bench`` (``python -m bench``) and ``make chaos``
(``python -m chaos``).

This module assembles the parser and runs the command; each command's parser and code are in the module of
its group: :mod:`kvstream.cli_producers` (simulate, bridge, capture, produce), :mod:`kvstream.cli_workers`
(worker, index, unregister), :mod:`kvstream.cli_query` (query), :mod:`kvstream.cli_tools` (demo, tail,
export, report), and :mod:`kvstream.broker` and :mod:`kvstream.registry` for their own commands.
"""

from __future__ import annotations

import argparse
import sys

from kvstream import broker, cli_producers, cli_query, cli_tools, cli_workers, registry
from kvstream.options import run_command


def _version() -> str:
    """The installed distribution's version (``pyproject.toml``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvstream")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The ``kvstream`` argument parser (every subcommand sets ``func``)."""
    parser = argparse.ArgumentParser(
        prog="kvstream",
        description="KV cache events of LLM serving engines -> Kafka (Avro, keyed by block hash) -> Faust "
                    "stream app -> tier residency tables: which instance holds which block on which tier.",
        epilog="Start with 'kvstream demo'. Each subcommand has its own --help.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # the order of `kvstream --help`'s list of commands
    cli_tools.add_demo(sub)
    broker.register_cli(sub)
    registry.register_cli(sub)
    cli_producers.add_simulate(sub)
    cli_workers.add_worker(sub)
    cli_workers.add_index(sub)
    cli_workers.add_unregister(sub)
    cli_producers.add_bridge(sub)
    cli_producers.add_capture(sub)
    cli_producers.add_produce(sub)
    cli_tools.add_tail(sub)
    cli_tools.add_export(sub)
    cli_tools.add_report(sub)
    cli_query.add_query(sub)
    return parser


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the subcommand ``args`` names (of its own subcommand, e.g. ``broker start``, if it has one)."""
    while True:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or getattr(args, actions[0].dest, None) not in actions[0].choices:
            return parser
        parser = actions[0].choices[getattr(args, actions[0].dest)]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvstream`` command."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse's own error would show `kvstream`'s usage, not that of the command the flag was given to
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    return run_command(f"kvstream {args.command}", args.func, args)


if __name__ == "__main__":
    sys.exit(main())
