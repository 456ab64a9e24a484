"""The engine publishers a bridge subscribes to, and what it reads off their sockets.

A :class:`PublisherEndpoint` names one publisher (one engine, one data-parallel rank): its PUB endpoint, its
replay endpoint and the identity put on its events. Endpoints come from the command line
(:func:`data_parallel_endpoints`, vLLM's port-offset rule of :func:`offset_endpoint`) or from a registration in
``kv-instances`` (:func:`registration_endpoints`, ``kvstream bridge --follow-registrations``).

Also here: which addresses a subscriber can connect to (:data:`CONNECTABLE`) and watch with ZMQ's socket
monitor (:func:`monitorable`), a source's key in the bridge's state file (:func:`state_key`), and the replay
socket's reply frames (:data:`END_SEQ`, :func:`replay_frames`; docs/ingesting.md, "Wire protocol").
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class PublisherEndpoint:
    """One engine publisher the bridge subscribes to (vLLM: one per data-parallel rank)."""

    #: PUB endpoint to connect to, e.g. ``tcp://10.0.0.5:5557``.
    endpoint: str
    #: ROUTER replay endpoint (vLLM ``replay_endpoint``); None when the publisher has none (gaps are then lost).
    replay_endpoint: str | None
    #: Serving instance name put on every event (vLLM sends none).
    instance_id: str
    #: Data-parallel rank of this publisher; a batch that names its own rank wins.
    data_parallel_rank: int = 0
    #: Worker rank, where each worker of an engine publishes separately (see kv_event.worker_rank).
    worker_rank: int | None = None
    #: Workers reporting this engine's connector events; None means 1.
    world_size: int | None = None
    #: REPLICATED or SHARDED (see kv_event.aggregation); None means REPLICATED.
    aggregation: str | None = None
    #: The engine's protocol, ``vllm`` or ``sglang`` (:attr:`producers.split.Publisher.engine`).
    engine: str = "vllm"
    #: How the engine reports prefix-cache reuse (:attr:`producers.split.Publisher.report_mode`): None, the default;
    #: ``"full"``, vLLM's ``kv_cache_report_mode="full"``.
    report_mode: str | None = None

    @property
    def label(self) -> str:
        worker = "" if self.worker_rank is None else f"/w{self.worker_rank}"
        return f"{self.instance_id}/dp{self.data_parallel_rank}{worker}"


_TCP = re.compile(r"^(?P<head>tcp://.*:)(?P<port>\d+)$")
#: Addresses a subscriber can connect to: tcp with a host (not a bind address's ``*``) and a port, ipc, inproc.
CONNECTABLE = re.compile(r"^(tcp://(?!\*:).+:\d+|ipc://.+|inproc://.+)$")


def offset_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's ``ZmqEventPublisher.offset_endpoint_port``: the endpoint of data-parallel rank ``rank``.

    tcp: port + rank (port 0 is left alone); inproc: ``_dp<rank>`` suffix; rank 0: unchanged.

    Raises:
        ValueError: ipc (or another transport) with rank > 0, as vLLM does.
    """
    if rank == 0:
        return endpoint
    match = _TCP.match(endpoint)
    if match:
        port = int(match["port"])
        return endpoint if port == 0 else f"{match['head']}{port + rank}"
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    raise ValueError(f"Invalid endpoint {endpoint!r}: must contain 'inproc' or 'tcp' for data-parallel rank {rank}")


def data_parallel_endpoints(endpoint: str, replay_endpoint: str | None, instance_id: str,
                            data_parallel_size: int, engine: str = "vllm",
                            report_mode: str | None = None) -> list[PublisherEndpoint]:
    """Every rank's endpoints of one engine with ``data_parallel_size`` ranks (vLLM's port-offset rule)."""
    return [PublisherEndpoint(offset_endpoint(endpoint, rank),
                              None if replay_endpoint is None else offset_endpoint(replay_endpoint, rank),
                              instance_id, rank, engine=engine, report_mode=report_mode)
            for rank in range(data_parallel_size)]


def registration_endpoints(info, report_mode: str | None = None) -> list[PublisherEndpoint]:
    """The publishers of one registered instance (``POST /register``, a record of ``kv-instances``), which
    ``kvstream bridge --follow-registrations`` subscribes to.

    Args:
        info: the registration, a :class:`stream_apps.index.fleet_index.SourceInfo` (its ``instance_id``,
            ``endpoint``, ``replay_endpoint``, ``engine_type`` and ``dp_ranks`` are read).
        report_mode: the engine's report mode (:attr:`PublisherEndpoint.report_mode`); a registration names none.

    Returns:
        One endpoint per registered data-parallel rank (rank 0 when it names none), in rank order: rank ``r``
        on ``offset_endpoint(endpoint, r)`` and ``offset_endpoint(replay_endpoint, r)`` (vLLM's port-offset
        rule, as ``--data-parallel-size``), protocol ``sglang`` when ``engine_type`` is SGLang (in any case), else
        ``vllm``. Empty when the registration has no ``endpoint``.

    Raises:
        ValueError: a rank above 0 on an endpoint that cannot be offset (ipc), as vLLM refuses it.
    """
    if not info.endpoint:
        return []
    engine = "sglang" if (info.engine_type or "").lower() == "sglang" else "vllm"
    return [PublisherEndpoint(offset_endpoint(info.endpoint, rank),
                              None if not info.replay_endpoint else offset_endpoint(info.replay_endpoint, rank),
                              info.instance_id, rank, engine=engine, report_mode=report_mode)
            for rank in sorted(info.dp_ranks or {0})]


def state_key(endpoint: PublisherEndpoint) -> str:
    """A source's key in the bridge's state file: its instance, data-parallel rank, worker rank and PUB endpoint."""
    worker = "" if endpoint.worker_rank is None else endpoint.worker_rank
    return f"{endpoint.instance_id}|{endpoint.data_parallel_rank}|{worker}|{endpoint.endpoint}"


def monitorable(endpoint: str) -> bool:
    """ZMQ's socket monitor reports connections of tcp and ipc endpoints; inproc ones report none (and are up
    for as long as the process that binds them, this one)."""
    return endpoint.startswith(("tcp://", "ipc://"))


#: vLLM's replay end marker: seq -1 as 8 signed big-endian bytes.
END_SEQ = b"\xff" * 8


def replay_frames(frames: list[bytes]) -> tuple[bytes, bytes] | None:
    """``(seq bytes, payload)`` of one replay reply as a DEALER receives it: ``[b"", topic, seq, payload]`` (vLLM),
    ``[b"", seq, payload]`` (older vLLM, no topic frame); None for any other shape."""
    app_frames = frames[1:] if frames and frames[0] == b"" else frames
    if len(app_frames) == 3:
        return app_frames[1], app_frames[2]
    if len(app_frames) == 2:
        return app_frames[0], app_frames[1]
    return None
