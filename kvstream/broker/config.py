"""The broker's configuration in its data directory: server.properties, generated from server.properties.in on
every start, and the KRaft storage, formatted once.

:func:`write_config` is the step of :func:`kvstream.broker.start` that produces both; :func:`configured_listener`
reads back what the last start configured.
"""

from __future__ import annotations

import base64
import re
import string
import subprocess
import uuid
from pathlib import Path

from kvstream.broker.errors import BrokerError, tail_text
from kvstream.broker.java import TOOL_JVM_FLAGS, TOOLS_LOG4J, java_command
from kvstream.broker.ports import free_port
from kvstream.broker.security import secure_client_listener
from kvstream.tls import TlsMaterial

_SERVER_TEMPLATE = Path(__file__).resolve().parent / "server.properties.in"


def write_config(libs: Path, d: Path, props: Path, port: int, scram_user: tuple[str, str] | None,
                 tls: TlsMaterial | None, require_client_certificate: bool) -> None:
    """Write ``props`` for the client listener on ``port`` (secured if ``scram_user`` or ``tls``) and a controller
    port picked afresh, then format the storage of ``d`` if it is not yet."""
    controller_port = free_port()
    while controller_port == port:
        controller_port = free_port()
    write_server_properties(props, port, controller_port, d / "data")
    if scram_user is not None or tls is not None:
        secure_client_listener(props, port, scram=scram_user is not None, tls=tls,
                               require_client_certificate=require_client_certificate)
    format_storage(libs, props, d, scram_user)


def write_server_properties(props: Path, port: int, controller_port: int, log_dirs: Path) -> None:
    """server.properties from its template: a PLAINTEXT client listener on ``port``, topic data in ``log_dirs``."""
    template = string.Template(_SERVER_TEMPLATE.read_text())
    props.parent.mkdir(parents=True, exist_ok=True)
    props.write_text(template.substitute(port=port, controller_port=controller_port, log_dirs=log_dirs))


def configured_listener(props: Path) -> tuple[str, int] | None:
    """(security protocol, port) of the client listener in the last generated server.properties, or None."""
    try:
        m = re.search(r"^advertised\.listeners=((?:SASL_)?(?:PLAINTEXT|SSL))://[^:]+:(\d+)", props.read_text(), re.M)
    except OSError:
        return None
    return (m.group(1), int(m.group(2))) if m else None


def new_cluster_id() -> str:
    """A fresh KRaft cluster id, in the format of StorageTool's ``random-uuid`` (no leading '-')."""
    cluster_id = "-"
    while cluster_id.startswith("-"):
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
    return cluster_id


def format_storage(libs: Path, props: Path, d: Path, scram_user: tuple[str, str] | None = None,
                   cluster_id: str | None = None) -> None:
    """Format the KRaft storage of ``d`` once, with ``cluster_id`` (the nodes of a cluster share theirs) or a new
    one; no-op if already formatted."""
    if (d / "data" / "meta.properties").exists():
        return
    cluster_id = cluster_id or new_cluster_id()
    cmd = java_command("kafka.tools.StorageTool", TOOL_JVM_FLAGS, TOOLS_LOG4J, libs)
    cmd += ["format", "--ignore-formatted", "-t", cluster_id, "-c", str(props)]
    if scram_user is not None:  # KRaft keeps SCRAM users in its metadata: they are created with the cluster
        cmd += ["--add-scram", f"SCRAM-SHA-512=[name={scram_user[0]},password={scram_user[1]}]"]
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:
        output = tail_text(proc.stdout + proc.stderr)
        raise BrokerError(f"Formatting the Kafka storage in {d / 'data'} failed:\n{output}")
