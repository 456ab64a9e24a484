"""The broker's error, and the log tails its messages end with.

Every failure of :mod:`kvstream.broker` is raised as :class:`BrokerError`; its message quotes the last lines of
the broker's, Maven's or a Kafka tool's output (:func:`tail_text`, :func:`log_tail`).
"""

from __future__ import annotations

import re
from pathlib import Path


class BrokerError(RuntimeError):
    """The broker or its jars could not be set up, started, stopped or queried.

    The message is meant for humans and includes the relevant log tail.
    """


def tail_text(text: str, lines: int = 40) -> str:
    """The last ``lines`` lines of ``text``, ANSI colours stripped."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # strip ANSI colours
    return "\n".join(text.rstrip().splitlines()[-lines:])


def log_tail(log_file: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file, ANSI colours stripped; a placeholder if it cannot be read."""
    try:
        return tail_text(log_file.read_text(errors="replace"), lines)
    except OSError:
        return "(no log output)"
