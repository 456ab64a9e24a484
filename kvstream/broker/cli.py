"""The ``kvstream broker`` command: ``start``, ``stop``, ``status``, ``kill``, ``restart`` and ``tool``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvstream.broker.cluster import (
    CLUSTER_HEAP,
    ClusterStatus,
    cluster_status,
    is_cluster,
    kill_node,
    restart_node,
    start_cluster,
)
from kvstream.broker.errors import BrokerError
from kvstream.broker.jars import KAFKA_VERSION
from kvstream.broker.lifecycle import DEFAULT_CLUSTER_DIR, DEFAULT_DATA_DIR, BrokerStatus, start, status, stop
from kvstream.broker.tools import TOOLS, run_tool
from kvstream.tls import TlsMaterial, generate_tls_material, load_tls_material


def _print_status(st: BrokerStatus) -> None:
    state = f"running (pid {st.pid})" if st.running else "not running"
    print(f"Kafka {st.kafka_version} broker: {state}")
    print(f"  bootstrap servers: {st.bootstrap_servers or '-'}")
    print(f"  security protocol: {st.security_protocol or '-'}")
    print(f"  data dir:          {st.data_dir}")
    print(f"  log file:          {st.log_file}")


def _cli_tls_material(tls_dir: Path) -> TlsMaterial:
    """The material of ``tls_dir``: loaded if it has a CA certificate, else generated there."""
    if (tls_dir / "ca.pem").exists():
        return load_tls_material(tls_dir)
    material = generate_tls_material(tls_dir)
    print(f"Generated a throwaway CA, a broker certificate (localhost, 127.0.0.1) and a client certificate "
          f"in {material.ca_certificate.parent}")
    return material


def _print_cluster(st: ClusterStatus) -> None:
    print(f"Kafka {KAFKA_VERSION} cluster: {st.running} of {len(st.nodes)} nodes running")
    print(f"  bootstrap servers: {st.bootstrap_servers}")
    print(f"  data dir:          {st.data_dir}")
    for node_id, (node, controller) in enumerate(zip(st.nodes, st.controller_ports), 1):
        state = f"running (pid {node.pid})" if node.running else "not running"
        print(f"  node {node_id}: {state}; port {node.port or '-'}, controller port {controller}; log {node.log_file}")


def _cli_start(args: argparse.Namespace) -> int:
    if args.nodes > 1:
        if args.tls_dir is not None:
            print("kvstream broker start: error: --tls-dir is for a single broker, not --nodes", file=sys.stderr)
            return 2
        try:
            st = start_cluster(nodes=args.nodes, port=args.port, data_dir=args.data_dir or DEFAULT_CLUSTER_DIR,
                               timeout_s=max(args.timeout, 120), heap=args.heap or CLUSTER_HEAP)
        except (BrokerError, OSError, ValueError) as exc:
            print(f"kvstream broker start: error: {exc}", file=sys.stderr)
            return 1
        _print_cluster(st)
        return 0
    args.data_dir = args.data_dir or DEFAULT_DATA_DIR
    args.heap = args.heap or "-Xms512m -Xmx1g"
    if args.tls_client_auth and args.tls_dir is None:
        print("kvstream broker start: error: --tls-client-auth needs --tls-dir", file=sys.stderr)
        return 2
    try:
        tls = _cli_tls_material(args.tls_dir) if args.tls_dir is not None else None
        st = start(port=args.port, data_dir=args.data_dir, timeout_s=args.timeout, heap=args.heap, tls=tls,
                   require_client_certificate=args.tls_client_auth)
    except (BrokerError, OSError) as exc:
        print(f"kvstream broker start: error: {exc}", file=sys.stderr)
        return 1
    _print_status(st)
    if tls is not None:  # what a client needs; the key password stays in its file
        print("  clients need:")
        print(f"    export KVSTREAM_SECURITY_PROTOCOL=SSL KVSTREAM_SSL_CA_LOCATION={tls.ca_certificate}")
        if args.tls_client_auth:
            print(f"    export KVSTREAM_SSL_CERTIFICATE_LOCATION={tls.client_certificate}")
            print(f"    export KVSTREAM_SSL_KEY_LOCATION={tls.client_key}")
            print(f"    export KVSTREAM_SSL_KEY_PASSWORD=\"$(cat {tls.client_key_password_file})\"")
    return 0


def _data_dir(args: argparse.Namespace) -> Path:
    """--data-dir, else the default cluster's directory if it holds a cluster, else the single broker's."""
    if args.data_dir is not None:
        return args.data_dir
    return DEFAULT_CLUSTER_DIR if is_cluster(DEFAULT_CLUSTER_DIR) and not status(DEFAULT_DATA_DIR).running \
        else DEFAULT_DATA_DIR


def _cli_stop(args: argparse.Namespace) -> int:
    args.data_dir = _data_dir(args)
    stopped = stop(args.data_dir)
    print(f"Stopped the broker of {Path(args.data_dir).resolve()}." if stopped else "No broker was running.")
    return 0


def _cli_status(args: argparse.Namespace) -> int:
    data_dir = _data_dir(args)
    if is_cluster(data_dir):
        cluster = cluster_status(data_dir)
        _print_cluster(cluster)
        return 0 if cluster.running == len(cluster.nodes) else 1
    st = status(data_dir)
    _print_status(st)
    return 0 if st.running else 1


def _cli_kill(args: argparse.Namespace) -> int:
    data_dir = args.data_dir or DEFAULT_CLUSTER_DIR
    try:
        was_running = kill_node(data_dir, args.node, clean=args.clean)
    except BrokerError as exc:
        print(f"kvstream broker kill: error: {exc}", file=sys.stderr)
        return 1
    how = "stopped (SIGTERM)" if args.clean else "killed (SIGKILL)"
    print(f"Node {args.node} {how}." if was_running else f"Node {args.node} was not running.")
    return 0


def _cli_restart(args: argparse.Namespace) -> int:
    data_dir = args.data_dir or DEFAULT_CLUSTER_DIR
    try:
        st = restart_node(data_dir, args.node, timeout_s=args.timeout)
    except BrokerError as exc:
        print(f"kvstream broker restart: error: {exc}", file=sys.stderr)
        return 1
    print(f"Node {args.node} running (pid {st.pid}) on {st.bootstrap_servers}.")
    return 0


def _cli_tool(args: argparse.Namespace) -> int:
    try:
        return run_tool(args.name, args.args)
    except BrokerError as exc:
        print(f"kvstream broker tool: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``broker`` command (``start|stop|status|kill|restart|tool``) to an argparse subparsers object.

    Every leaf parser sets ``func``: the main CLI should call ``args.func(args)``
    and exit with its return value (0 = success).

    Args:
        subparsers: The object returned by ``parser.add_subparsers()``.

    Returns:
        The ``broker`` parser.
    """
    broker = subparsers.add_parser(
        "broker",
        help=f"run a local Kafka {KAFKA_VERSION} broker, or a cluster of several (no Docker needed)",
        description=(
            f"Run a local single-node Apache Kafka {KAFKA_VERSION} broker (KRaft, 127.0.0.1 only), or with "
            "'start --nodes N' a cluster of N nodes whose nodes 'kill ID' and 'restart ID' fail on purpose, "
            "from jars downloaded once with Maven, and Kafka's own CLI tools. "
            "Needs java 17+; mvn for the first download."
        ),
    )
    sub = broker.add_subparsers(dest="broker_command", metavar="{start,stop,status,kill,restart,tool}",
                                required=True)
    _add_start(sub)
    _add_stop(sub)
    _add_status(sub)
    _add_kill_restart(sub)
    _add_tool(sub)
    return broker


def _add_data_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"broker data directory: config, pid file, topic data, logs/broker.out (default: {DEFAULT_DATA_DIR}; "
        f"a cluster's: {DEFAULT_CLUSTER_DIR}, one node-<id> directory per node)",
    )


def _add_start(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "start",
        help="start the broker in the background and wait until it answers",
        description="Start the broker detached (it keeps running after this command exits) and wait until it "
        "answers metadata requests; the first start downloads the jars. Does nothing if it already runs.",
    )
    p.add_argument("--port", type=int, default=9092,
                   help="client port on 127.0.0.1; with --nodes N, node i's is PORT+i-1 and the controllers' "
                        "PORT+N..PORT+2N-1 (default: %(default)s)")
    p.add_argument("--nodes", type=int, default=1, metavar="N",
                   help="start a KRaft cluster of N combined broker/controller nodes (node ids 1..N) instead of "
                        "one broker; topics kvstream creates there get min(3, N) replicas (default: 1)")
    _add_data_dir(p)
    p.add_argument("--timeout", type=float, default=90, metavar="SECONDS",
                   help="start-up timeout (default: 90; 120 at least for a cluster)")
    p.add_argument("--heap", default=None, metavar="JVM_OPTS",
                   help=f"JVM heap of each node (default: -Xms512m -Xmx1g; {CLUSTER_HEAP} per node of a cluster)")
    p.add_argument("--tls-dir", type=Path, metavar="DIR",
                   help="serve TLS (security protocol SSL) on --port with the PEM files of DIR: ca.pem, broker.pem, "
                   "broker-key.pem, client.pem, client-key.pem, client-key.password; if DIR has no ca.pem, a "
                   "throwaway CA and certificates for localhost/127.0.0.1 are generated there first. Clients "
                   "then need KVSTREAM_SECURITY_PROTOCOL=SSL and KVSTREAM_SSL_CA_LOCATION=DIR/ca.pem")
    p.add_argument("--tls-client-auth", action="store_true",
                   help="with --tls-dir: require client certificates signed by DIR/ca.pem (mutual TLS); clients "
                   "also need KVSTREAM_SSL_CERTIFICATE_LOCATION, KVSTREAM_SSL_KEY_LOCATION, "
                   "KVSTREAM_SSL_KEY_PASSWORD")
    p.set_defaults(func=_cli_start)


def _add_stop(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "stop",
        help="stop the broker (SIGTERM, SIGKILL after 30 s)",
        description="Stop the broker cleanly with SIGTERM; kill it if it is still running after 30 s.",
    )
    _add_data_dir(p)
    p.set_defaults(func=_cli_stop)


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="show whether the broker runs (exit code 0 if running, else 1)",
        description="Print running state, pid, bootstrap servers and log file. Exit code 0 if running, 1 if not.",
    )
    _add_data_dir(p)
    p.set_defaults(func=_cli_status)


def _add_kill_restart(sub: argparse._SubParsersAction) -> None:
    kill = sub.add_parser(
        "kill",
        help="kill one node of a cluster by id (SIGKILL; --clean: SIGTERM)",
        description="Fail one node of a cluster started with --nodes on purpose: SIGKILL (a crash), or with "
        "--clean SIGTERM, Kafka's controlled shutdown (SIGKILL after 30 s). 'restart ID' brings it back.",
    )
    kill.add_argument("node", type=int, metavar="ID", help="node id, 1..N")
    kill.add_argument("--clean", action="store_true", help="clean shutdown (SIGTERM) instead of SIGKILL")
    _add_data_dir(kill)
    kill.set_defaults(func=_cli_kill)
    restart = sub.add_parser(
        "restart",
        help="start one node of a cluster again and wait until it is back in the cluster",
        description="Start node ID of a cluster again (same ports, same data) and wait until the cluster's "
        "metadata names it. Does nothing to a node that runs.",
    )
    restart.add_argument("node", type=int, metavar="ID", help="node id, 1..N")
    restart.add_argument("--timeout", type=float, default=120, metavar="SECONDS",
                         help="start-up timeout (default: %(default)s)")
    _add_data_dir(restart)
    restart.set_defaults(func=_cli_restart)


def _add_tool(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tool",
        help="run a Kafka CLI tool, e.g. 'tool topics --bootstrap-server 127.0.0.1:9092 --list'",
        description="Run one of Kafka's own command-line tools from the same jars. All arguments after NAME "
        "go to the tool; 'tool NAME --help' shows the tool's own help. Exits with the tool's exit code.",
        epilog="NAME is one of: " + ", ".join(TOOLS) + "; or a fully qualified Java main class.",
    )
    p.add_argument("name", metavar="NAME", help="tool name (see below)")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments passed to the tool")
    p.set_defaults(func=_cli_tool)
