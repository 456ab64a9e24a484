"""Log formats of every process of the pipeline: text for a terminal, JSON lines for a log collector.

``--log-format json`` on the long-running commands (``worker``, ``bridge``, ``capture``, ``produce``,
``simulate``) writes one JSON object per line to standard error, with ``time``, ``level``, ``logger``,
``process`` and ``message`` keys (and ``exc_info`` for a traceback); the worker's repartition child process
logs the same way.
"""

from __future__ import annotations

import logging
import logging.config

#: The accepted ``--log-format`` values.
LOG_FORMATS = ("text", "json")
#: The text format (``[time] [pid] [LEVEL] logger: message``).
TEXT_FORMAT = "[%(asctime)s] [%(process)d] [%(levelname)s] %(name)s: %(message)s"
#: Loggers whose multi-line INFO records are dropped unless the level is ``debug``: Faust's table recovery logs a
#: table of every changelog partition (a row per partition and table, twice) at every rebalance, which floods a
#: terminal. Its one-line records stay: ``Recovery complete`` and ``Worker ready``, which ``make chaos`` and
#: ``make bench`` wait for in the workers' logs.
TABLE_LOGGERS = ("faust.tables.recovery",)


class DropLogTables(logging.Filter):
    """A handler filter: drops the records of :data:`TABLE_LOGGERS` at INFO or below that span several lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or record.name not in TABLE_LOGGERS or "\n" not in record.getMessage()


def logging_config(level: str, log_format: str) -> dict:
    """A :func:`logging.config.dictConfig` of the root logger at ``level`` in ``log_format`` (one of
    :data:`LOG_FORMATS`), writing to standard error; below debug, without Faust's recovery tables
    (:class:`DropLogTables`).

    Raises:
        ValueError: an unknown format.
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r}: expected one of {', '.join(LOG_FORMATS)}")
    formatter = {"format": TEXT_FORMAT} if log_format == "text" else {
        "()": "pythonjsonlogger.json.JsonFormatter",
        "fmt": "%(asctime)s %(levelname)s %(name)s %(process)d %(message)s",
        "rename_fields": {"asctime": "time", "levelname": "level", "name": "logger"}}
    # on the handler, which each configuration makes anew: a later one at debug shows the tables again
    tables = level.lower() == "debug"
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"default": formatter},
            "filters": {"log_tables": {"()": DropLogTables}},
            "handlers": {"default": {"class": "logging.StreamHandler", "formatter": "default",
                                     "stream": "ext://sys.stderr", "filters": [] if tables else ["log_tables"]}},
            "root": {"level": level.upper(), "handlers": ["default"]}}


def configure_logging(level: str, log_format: str) -> None:
    """Configure this process's root logger (see :func:`logging_config`)."""
    logging.config.dictConfig(logging_config(level, log_format))
