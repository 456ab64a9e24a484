"""A local multi-node KRaft cluster: ``kvstream broker start --nodes 3``.

Every node is a combined broker and controller in a JVM of its own, bound to 127.0.0.1. A cluster of ``n`` nodes
started on ``port`` listens for clients on ``port .. port+n-1`` (node ``i`` on ``port+i-1``) and its controllers on
``port+n .. port+2n-1``; the ports, the node count and the shared cluster id are fixed at the first start in
``<data_dir>/cluster.json``, so that a node restarted alone rejoins the same static voter set. Layout::

    cluster.json        nodes, first client port, controller ports, cluster id
    node-<id>/          one broker data directory per node (see kvstream.broker), node ids 1..n

:func:`kill_node` and :func:`restart_node` fail one node on purpose (tests, ``make chaos``); :func:`stop_cluster`
stops all of it; :func:`cluster_status` reports each node.
"""

from __future__ import annotations

import json
import os
import signal
import string
import time
from dataclasses import dataclass
from pathlib import Path

from kvstream.broker.config import format_storage, new_cluster_id
from kvstream.broker.errors import BrokerError
from kvstream.broker.jars import ensure_jars
from kvstream.broker.java import java_executable
from kvstream.broker.lifecycle import (
    DEFAULT_CLUSTER_DIR,
    BrokerStatus,
    _launch,
    broker_paths,
    running_pid,
    status,
    wait_until_ready,
)
from kvstream.broker.lock import file_lock
from kvstream.broker.ports import port_in_use
from kvstream.broker.process import process_alive, terminate_process

_NODE_TEMPLATE = Path(__file__).resolve().parent / "cluster-node.properties.in"
#: Default JVM heap of each node of a cluster (three share a small machine).
CLUSTER_HEAP = "-Xms256m -Xmx512m"


@dataclass(frozen=True)
class ClusterStatus:
    """State of the cluster of one data directory.

    Attributes:
        data_dir: absolute path of the cluster's data directory.
        nodes: each node's :class:`BrokerStatus`, in node id order (node ``i`` at index ``i-1``).
        controller_ports: each node's KRaft controller port, in the same order.
        bootstrap_servers: every node's ``127.0.0.1:<port>``, comma-separated (alive or not).
    """

    data_dir: Path
    nodes: tuple[BrokerStatus, ...]
    controller_ports: tuple[int, ...]
    bootstrap_servers: str

    @property
    def running(self) -> int:
        """How many nodes run."""
        return sum(1 for node in self.nodes if node.running)


def is_cluster(data_dir: Path) -> bool:
    """True if ``data_dir`` holds a cluster (a ``cluster.json``), not a single broker."""
    return (Path(data_dir).expanduser() / "cluster.json").is_file()


def node_dir(data_dir: Path, node_id: int) -> Path:
    """The broker data directory of node ``node_id`` (1-based) of the cluster in ``data_dir``."""
    return Path(data_dir).expanduser().resolve() / f"node-{node_id}"


def _read_layout(data_dir: Path) -> dict | None:
    try:
        return json.loads((Path(data_dir).expanduser() / "cluster.json").read_text())
    except (OSError, ValueError):
        return None


def cluster_status(data_dir: Path) -> ClusterStatus:
    """Report each node of the cluster of ``data_dir`` (no network access).

    Raises:
        BrokerError: ``data_dir`` holds no cluster.
    """
    layout = _read_layout(data_dir)
    if layout is None:
        raise BrokerError(f"{Path(data_dir).resolve()} holds no cluster (no cluster.json)")
    n, port = layout["nodes"], layout["port"]
    nodes = tuple(status(node_dir(data_dir, i)) for i in range(1, n + 1))
    return ClusterStatus(Path(data_dir).expanduser().resolve(), nodes, tuple(layout["controller_ports"]),
                         ",".join(f"127.0.0.1:{port + i}" for i in range(n)))


def start_cluster(nodes: int = 3, port: int = 9092, data_dir: Path = DEFAULT_CLUSTER_DIR,
                  timeout_s: float = 120, heap: str = CLUSTER_HEAP) -> ClusterStatus:
    """Start every node of a ``nodes``-node KRaft cluster and wait until each answers and all are registered.

    Args:
        nodes: how many combined broker/controller nodes (at least 2). Fixed at the first start.
        port: client port of node 1; node ``i`` listens on ``port+i-1``, the controllers on ``port+nodes`` and
            up. Fixed at the first start: a later start must give the same (or see BrokerError).
        data_dir: the cluster's data directory (created if missing; topic data survives restarts).
        timeout_s: seconds to wait for the cluster to answer (excluding the one-time jar download).
        heap: JVM heap options of each node.

    Returns:
        The :class:`ClusterStatus`. Nodes already running are left as they are.

    Raises:
        BrokerError: Java or the jars missing; a port taken by another process; the data dir holds a cluster of
            another size or port; a node died during start-up or the cluster did not answer in time (the nodes
            started by this call are then stopped).
        ValueError: fewer than 2 nodes.
    """
    if nodes < 2:
        raise ValueError("a cluster has at least 2 nodes; for one, use start()")
    d = Path(data_dir).expanduser().resolve()
    libs = ensure_jars()
    java_executable()
    d.mkdir(parents=True, exist_ok=True)
    with file_lock(d / ".lock"):
        layout = _read_layout(d)
        if layout is None:
            wanted = range(port, port + 2 * nodes)
            taken = [p for p in wanted if port_in_use(p)]
            if taken:
                raise BrokerError(f"ports {taken} on 127.0.0.1 are in use; a {nodes}-node cluster on {port} needs "
                                  f"{port}..{port + 2 * nodes - 1}. Pick another --port.")
            layout = {"nodes": nodes, "port": port, "controller_ports": list(range(port + nodes, port + 2 * nodes)),
                      "cluster_id": new_cluster_id()}
            (d / "cluster.json").write_text(json.dumps(layout, indent=2) + "\n")
        elif (layout["nodes"], layout["port"]) != (nodes, port):
            raise BrokerError(f"{d} holds a {layout['nodes']}-node cluster on port {layout['port']}, not "
                              f"{nodes} nodes on {port}. Stop it and give those, or another --data-dir.")
        launched = []
        for node_id in range(1, nodes + 1):
            if running_pid(node_dir(d, node_id)) is None:
                launched.append((node_id, _launch_node(libs, d, layout, node_id, heap)))
        try:
            for node_id, proc in launched:
                node = status(node_dir(d, node_id))
                wait_until_ready(proc.pid, node.bootstrap_servers, node.log_file,
                                 max(1.0, timeout_s), proc=proc)
            _wait_registered(d, layout, timeout_s)
        except BrokerError:
            for node_id, proc in launched:
                terminate_process(proc.pid, grace_s=10)
            raise
    return cluster_status(d)


def _launch_node(libs: Path, d: Path, layout: dict, node_id: int, heap: str):
    """Write node ``node_id``'s server.properties, format its storage once (the cluster's id), and launch it."""
    n, port = layout["nodes"], layout["port"]
    nd = node_dir(d, node_id)
    _, props, pid_file, _ = broker_paths(nd)
    pid_file.unlink(missing_ok=True)
    client_port = port + node_id - 1
    if port_in_use(client_port):
        raise BrokerError(f"port {client_port} of node {node_id} is in use by another process")
    voters = ",".join(f"{i}@127.0.0.1:{p}" for i, p in enumerate(layout["controller_ports"], 1))
    replication = min(3, n)
    props.parent.mkdir(parents=True, exist_ok=True)
    props.write_text(string.Template(_NODE_TEMPLATE.read_text()).substitute(
        node_id=node_id, voters=voters, port=client_port, controller_port=layout["controller_ports"][node_id - 1],
        log_dirs=nd / "data", replication=replication, min_isr=2 if replication >= 3 else 1))
    format_storage(libs, props, nd, cluster_id=layout["cluster_id"])
    return _launch(libs, nd, heap, f"127.0.0.1:{client_port}")


def _wait_registered(d: Path, layout: dict, timeout_s: float) -> None:
    """Wait until the metadata of node 1..n names every running node as a broker."""
    from confluent_kafka.admin import AdminClient

    bootstrap = ",".join(f"127.0.0.1:{layout['port'] + i}" for i in range(layout["nodes"]))
    deadline = time.monotonic() + timeout_s
    expected = {i for i in range(1, layout["nodes"] + 1) if running_pid(node_dir(d, i)) is not None}
    seen: set[int] = set()
    while time.monotonic() < deadline:
        try:
            seen = set(AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=2).brokers)
        except Exception:  # noqa: BLE001 - KafkaException while the nodes elect a controller
            seen = set()
        if expected <= seen:
            return
        time.sleep(0.25)
    raise BrokerError(f"the cluster in {d} registered brokers {sorted(seen)}, not {sorted(expected)}, "
                      f"within {timeout_s:g} s")


def _node(data_dir: Path, node_id: int) -> tuple[Path, dict]:
    """(node dir, layout) of node ``node_id``; BrokerError if there is no such node."""
    layout = _read_layout(data_dir)
    if layout is None:
        raise BrokerError(f"{Path(data_dir).resolve()} holds no cluster (no cluster.json): start one with --nodes")
    if not 1 <= node_id <= layout["nodes"]:
        raise BrokerError(f"the cluster in {Path(data_dir).resolve()} has nodes 1..{layout['nodes']}, not {node_id}")
    return node_dir(data_dir, node_id), layout


def kill_node(data_dir: Path, node_id: int, clean: bool = False, grace_s: float = 30.0) -> bool:
    """Stop node ``node_id`` of the cluster in ``data_dir``: SIGKILL (a crash), or with ``clean`` SIGTERM (Kafka's
    controlled shutdown: leadership moves first) and SIGKILL after ``grace_s``.

    Returns:
        True if the node was running.

    Raises:
        BrokerError: no such cluster or node.
    """
    nd, _ = _node(data_dir, node_id)
    with file_lock(nd / ".lock"):
        pid = running_pid(nd)
        if pid is None:
            return False
        if clean:
            terminate_process(pid, grace_s=grace_s)
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 10
            while process_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        broker_paths(nd)[2].unlink(missing_ok=True)
    return True


def restart_node(data_dir: Path, node_id: int, timeout_s: float = 120, heap: str = CLUSTER_HEAP,
                 wait_registered: bool = True) -> BrokerStatus:
    """Start node ``node_id`` of the cluster in ``data_dir`` again (no-op if it runs) and wait until it answers
    and, with ``wait_registered``, until the cluster's metadata names it.

    Raises:
        BrokerError: no such cluster or node; it died during start-up or did not answer within ``timeout_s``.
    """
    nd, layout = _node(data_dir, node_id)
    d = Path(data_dir).expanduser().resolve()
    libs = ensure_jars()
    with file_lock(nd / ".lock"):
        if running_pid(nd) is None:
            proc = _launch_node(libs, d, layout, node_id, heap)
            node = status(nd)
            wait_until_ready(proc.pid, node.bootstrap_servers, node.log_file, timeout_s, proc=proc)
    if wait_registered:
        _wait_registered(d, layout, timeout_s)
    return status(nd)


def stop_cluster(data_dir: Path, grace_s: float = 30.0) -> int:
    """Stop every node of the cluster in ``data_dir`` together (SIGTERM to all, SIGKILL after ``grace_s``).

    Returns:
        How many nodes were running.
    """
    layout = _read_layout(data_dir)
    if layout is None:
        return 0
    pids = [(i, running_pid(node_dir(data_dir, i))) for i in range(1, layout["nodes"] + 1)]
    pids = [(i, pid) for i, pid in pids if pid is not None]
    for _, pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(process_alive(pid) for _, pid in pids):
        time.sleep(0.1)
    for i, pid in pids:
        terminate_process(pid, grace_s=0.1)  # SIGKILL the ones a lost quorum kept from shutting down
        broker_paths(node_dir(data_dir, i))[2].unlink(missing_ok=True)
    return len(pids)


def controller_leader(bootstrap_servers: str, timeout_s: float = 60) -> int | None:
    """The node id of the active KRaft controller (the quorum's leader), as ``kafka-metadata-quorum describe
    --status`` reports it through ``bootstrap_servers``; None if it did not answer. Starts a JVM (seconds)."""
    import re

    from kvstream.broker.tools import run_tool

    try:
        result = run_tool("metadata-quorum", ["--bootstrap-server", bootstrap_servers, "describe", "--status"],
                          capture=True, timeout_s=timeout_s)
    except Exception:  # noqa: BLE001 - a timeout or a tool that cannot start: no answer
        return None
    found = re.search(r"^LeaderId:\s+(\d+)", result.stdout, re.M)
    return int(found.group(1)) if result.returncode == 0 and found else None
