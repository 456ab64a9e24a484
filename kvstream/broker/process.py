"""Whether a process is alive, and stopping one: for the broker's JVM and the schema registry's
(:mod:`kvstream.registry`)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def process_alive(pid: int) -> bool:
    """True if process ``pid`` exists and is not a zombie (reaps our own children)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False  # was our child and has just been reaped
    except ChildProcessError:
        pass  # not our child
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def pid_of(pid_file: Path, *markers: str) -> int | None:
    """The pid in ``pid_file`` if that process is alive and its command line contains every one of ``markers``
    (a guard against pid reuse: the process must be the one that wrote the file); None otherwise. Without
    ``/proc`` the pid file is trusted."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if not process_alive(pid):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return pid
    return pid if all(marker.encode() in cmdline for marker in markers) else None


def terminate_process(pid: int, grace_s: float) -> None:
    """SIGTERM ``pid``, wait up to ``grace_s`` seconds, then SIGKILL it."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not process_alive(pid):
                return
            time.sleep(0.1)
