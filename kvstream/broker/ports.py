"""Free TCP ports on 127.0.0.1, for brokers, workers and publishers, and whether a port is taken."""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that were free a moment ago (held open together while chosen)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port_range(n: int, attempts: int = 50) -> int:
    """The first of ``n`` consecutive TCP ports on 127.0.0.1 that were all free a moment ago (for publishers
    that bind ``base + rank``, as vLLM's data-parallel ranks do).

    Raises:
        RuntimeError: no such range found in ``attempts`` tries.
    """
    for _ in range(attempts):
        base = free_port()
        if base + n <= 65536 and not any(port_in_use(port) for port in range(base + 1, base + n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports found on 127.0.0.1")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for brokers, workers and publishers)."""
    return free_ports(1)[0]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True if ``host:port`` cannot be bound, i.e. something listens there (SO_REUSEADDR ignores TIME_WAIT,
    like Java and aiohttp)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False
