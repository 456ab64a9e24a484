"""Run stream-app workers: in this process (``kvstream worker``) or as child processes, and wait for them.

A worker's settings are one :class:`stream_apps.settings.WorkerSettings`, passed down to
:func:`stream_apps.app.create_app`. Every topic the app uses is created before Faust starts: a topic created
while the consumer group forms is left out of the first assignment.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kafka_io.admin import GroupProgressReader, cluster_metadata, ensure_topics
from kafka_io.config import topic_replication
from kafka_io.logs import configure_logging, logging_config
from kvstream.broker import port_in_use
from kvstream.options import settings_to_argv
from schemas.topics import TopicNames
from stream_apps.fleet import input_progress
from stream_apps.hotpath import log_hotpath
from stream_apps.settings import WorkerSettings

log = logging.getLogger(__name__)


def run_worker(settings: WorkerSettings) -> int:
    """Run one worker in this process until it is stopped (SIGTERM/SIGINT); returns the exit code.

    Creates every topic the app uses first (:meth:`stream_apps.app.StreamApp.declared_topics`), and logs which
    implementation of the hot path runs (:func:`stream_apps.hotpath.log_hotpath`).
    """
    from stream_apps.app import create_app
    from stream_apps.web_access import check_exposure

    # Faust's worker configures logging only once it runs, which is after the topics are created and the app is
    # built; the same configuration now puts the hot path first in the log, formatted as the rest.
    configure_logging(settings.log_level, settings.log_format)
    check_exposure(settings, log)  # a non-loopback --web-bind without a token file: one line naming the flag
    if port_in_use(settings.web_port, settings.web_bind):  # before any topic or group is touched
        raise RuntimeError(f"port {settings.web_port} on {settings.web_bind} is in use by another program "
                           "(another worker?); choose --web-port")
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    log_hotpath(log)
    replication_factor, _ = topic_replication(len(cluster_metadata(settings.bootstrap_servers).brokers))
    stream_app = create_app(settings, replication_factor)
    topics = stream_app.declared_topics()
    ensure_topics(settings.bootstrap_servers, {name: p for name, (p, _) in topics.items()},
                  configs={name: config for name, (_, config) in topics.items()})
    worker = stream_app.app.Worker(loglevel=settings.log_level,
                                   logging_config=logging_config(settings.log_level, settings.log_format))
    worker.execute_from_commandline()  # raises SystemExit with the worker's exit code
    return 0


def spawn_worker(settings: WorkerSettings, log_file: Path, extra_env: dict[str, str] | None = None
                 ) -> subprocess.Popen:
    """Start ``kvstream worker`` with ``settings`` as a child process (in its own session), its output appended
    to ``log_file``.

    Args:
        extra_env: variables added to this process's environment for the worker, e.g. Faust's own
            ``BROKER_SESSION_TIMEOUT`` (seconds; default 60) that ``make chaos`` shortens.
    """
    log_file.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "kvstream.cli", "worker", *settings_to_argv(settings)]
    with open(log_file, "ab") as out:
        env = {**os.environ, **extra_env} if extra_env else None
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def stop_worker(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Stop a worker started by :func:`spawn_worker`: SIGTERM (Faust shuts down cleanly), SIGKILL after ``grace_s``."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_until_consumed(bootstrap_servers: str, app: str | TopicNames, process: subprocess.Popen | None, *,
                        timeout_s: float, on_progress=None, poll_s: float = 1.0) -> float:
    """Wait until an app (its id, or its :class:`TopicNames`) has committed everything in kv-events and its
    re-keyed topic.

    kv-events is read by the repartition process's group ``<app id>-repartition``
    (:func:`stream_apps.repartition.repartition_group`), the re-keyed topic by the app's own group.

    Args:
        process: the worker; if it exits meanwhile, this raises.
        on_progress: called with ``{topic: GroupProgress}`` after each poll.

    Returns:
        Seconds waited.

    Raises:
        RuntimeError: the worker exited.
        TimeoutError: not consumed within ``timeout_s``.
    """
    names = app if isinstance(app, TopicNames) else TopicNames(app)
    group = names.scoped_app_id
    started = time.monotonic()
    with GroupProgressReader(bootstrap_servers) as reader:  # one set of clients for the whole wait
        while True:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"the stream-app worker exited with code {process.returncode}")
            try:
                progress = input_progress(reader, names)
            except RuntimeError as exc:  # e.g. the group coordinator is still loading: ask again
                if time.monotonic() - started > timeout_s:
                    raise TimeoutError(f"consumer group {group} unreadable after {timeout_s:.0f}s: {exc}") from None
                time.sleep(poll_s)
                continue
            if on_progress:
                on_progress(progress)
            upstream = progress[names.kv_events]
            if upstream.end and all(p.lag == 0 for p in progress.values()):
                return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"consumer group {group} still has {sum(p.lag for p in progress.values())} "
                                   f"messages to commit after {timeout_s:.0f}s")
            time.sleep(poll_s)
