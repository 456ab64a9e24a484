"""Embedded Apache Kafka broker (one node, or a local cluster of several) for development and tests.

Kafka has no PyPI package, so the broker runs from its jars on Maven Central:
``pom.xml`` (next to this file) lists them, and :func:`ensure_jars` lets Maven
copy them into a per-version cache once. :func:`start` then runs a one-node
combined KRaft broker (broker + controller in one JVM, 127.0.0.1 only) as a
detached process that outlives the Python process that started it.

Layout of a broker data directory (default ``.kvstream/broker``)::

    server.properties   generated from server.properties.in on every start
    broker.pid          pid of the running broker JVM
    data/               Kafka log.dirs (topic data and KRaft metadata)
    logs/broker.out     the broker's stdout and stderr

Requires ``java`` (17+) on PATH or in ``$JAVA_HOME``, and ``mvn`` for the
one-time jar download. Every failure is raised as :class:`BrokerError`.

The package's modules, one concern each; this module re-exports the names other modules use:

    jars        the Kafka jars from Maven Central, cached once; KAFKA_VERSION (from pom.xml)
    java        which ``java``, the JVM flags and log4j configurations of the broker and the tools
    config      server.properties from its template, the KRaft storage format
    security    the SASL / TLS client listener, and the client settings that reach it
    lifecycle   start, stop and status of the broker of a data directory
    cluster     a local multi-node KRaft cluster (start --nodes N), and failing one node of it (kill, restart)
    process     whether a process is alive, stopping one (also for kvstream.registry)
    ports       free_port, free_ports, free_port_range, port_in_use
    lock        the file lock of a jar cache or a data directory
    errors      BrokerError and the log tails its messages end with
    tools       Kafka's own CLI tools (run_tool, TOOLS)
    cli         the ``kvstream broker`` command (register_cli)
"""

from __future__ import annotations

from kvstream.broker.cli import register_cli as register_cli
from kvstream.broker.cluster import ClusterStatus as ClusterStatus
from kvstream.broker.cluster import cluster_status as cluster_status
from kvstream.broker.cluster import controller_leader as controller_leader
from kvstream.broker.cluster import is_cluster as is_cluster
from kvstream.broker.cluster import kill_node as kill_node
from kvstream.broker.cluster import restart_node as restart_node
from kvstream.broker.cluster import start_cluster as start_cluster
from kvstream.broker.cluster import stop_cluster as stop_cluster
from kvstream.broker.errors import BrokerError as BrokerError
from kvstream.broker.errors import log_tail as log_tail
from kvstream.broker.jars import KAFKA_VERSION as KAFKA_VERSION
from kvstream.broker.jars import default_cache_root as default_cache_root
from kvstream.broker.jars import ensure_jars as ensure_jars
from kvstream.broker.java import java_executable as java_executable
from kvstream.broker.lifecycle import DEFAULT_CLUSTER_DIR as DEFAULT_CLUSTER_DIR
from kvstream.broker.lifecycle import DEFAULT_DATA_DIR as DEFAULT_DATA_DIR
from kvstream.broker.lifecycle import BrokerStatus as BrokerStatus
from kvstream.broker.lifecycle import start as start
from kvstream.broker.lifecycle import status as status
from kvstream.broker.lifecycle import stop as stop
from kvstream.broker.lock import file_lock as file_lock
from kvstream.broker.ports import free_port as free_port
from kvstream.broker.ports import free_port_range as free_port_range
from kvstream.broker.ports import free_ports as free_ports
from kvstream.broker.ports import port_in_use as port_in_use
from kvstream.broker.process import pid_of as pid_of
from kvstream.broker.process import process_alive as process_alive
from kvstream.broker.process import terminate_process as terminate_process
from kvstream.broker.tools import TOOLS as TOOLS
from kvstream.broker.tools import run_tool as run_tool

__all__ = [
    "KAFKA_VERSION",
    "TOOLS",
    "BrokerError",
    "BrokerStatus",
    "ensure_jars",
    "start",
    "stop",
    "status",
    "ClusterStatus",
    "start_cluster",
    "stop_cluster",
    "cluster_status",
    "kill_node",
    "restart_node",
    "run_tool",
    "register_cli",
]
