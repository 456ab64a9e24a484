"""Run the Faust stream app (``kvstream worker``), in this process or as a child process.

The app (:mod:`stream_apps.app`) is configured through environment variables
because Faust apps are declared at import time; :func:`worker_environment`
builds them from the options, and :func:`run_worker` runs Faust's own worker
command with them. Every topic the app uses is created first, with the app's partition
count: Faust would create its internal topics itself, but a topic created
while the consumer group forms is left out of the first assignment (seen: stage
2 then stays idle until the next rebalance).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka.admin import AdminClient

from kafka_io.admin import GroupProgress, ensure_topics, group_progress
from kafka_io.config import DEFAULT_PARTITIONS, client_config
from schemas.topics import KV_EVENTS, by_ownership_topic
from stream_apps.repartition import repartition_group

#: Default Faust app id: the consumer group and the prefix of changelog topics.
DEFAULT_APP_ID = "kvstream"


@dataclass
class WorkerOptions:
    """Options of one stream-app worker (see ``kvstream worker --help``)."""

    bootstrap_servers: str
    #: HTTP port of the worker's web server (views and routing between workers).
    web_port: int = 6066
    #: Address the web server binds to; localhost unless told otherwise.
    web_bind: str = "127.0.0.1"
    #: Host name or address other workers reach this one at (requests for keys it holds are forwarded there).
    web_host: str = "127.0.0.1"
    #: Local state directory (RocksDB stores, Faust's own files).
    data_dir: Path = Path(".kvstream/worker")
    #: Table store: ``rocksdb://`` (the default for deployments: on disk in ``data_dir``, a restart reads only
    #: the changelog written since) or ``memory://`` (rebuilt from the whole changelog at start, held in RAM).
    store: str = "rocksdb://"
    #: Partitions of kv-events and of the app's topics and tables.
    partitions: int = DEFAULT_PARTITIONS
    #: Tiers an AllBlocksCleared removes: ``gpu`` (default, vLLM semantics) or ``all``, then per-instance
    #: overrides: ``gpu,engine-7=all``.
    clear_scope: str = "gpu"
    #: World size and mode of sources whose events do not declare them: ``engine-3=2:REPLICATED,...``.
    aggregation: str = ""
    app_id: str = DEFAULT_APP_ID
    log_level: str = "info"


def worker_environment(options: WorkerOptions) -> dict[str, str]:
    """The environment variables :mod:`stream_apps.app` reads, for these options."""
    return {
        "KVSTREAM_BOOTSTRAP_SERVERS": options.bootstrap_servers,
        "KVSTREAM_WEB_PORT": str(options.web_port),
        "KVSTREAM_WEB_BIND": options.web_bind,
        "KVSTREAM_WEB_HOST": options.web_host,
        "KVSTREAM_DATA_DIR": str(options.data_dir),
        "KVSTREAM_STORE": options.store,
        "KVSTREAM_PARTITIONS": str(options.partitions),
        "KVSTREAM_CLEAR_SCOPE": options.clear_scope,
        "KVSTREAM_AGGREGATION": options.aggregation,
        "KVSTREAM_APP_ID": options.app_id,
    }


def run_worker(options: WorkerOptions) -> int:
    """Run one worker in this process until it is stopped (SIGTERM/SIGINT); returns the exit code.

    Creates every topic the app uses first (see :func:`stream_apps.app.declared_topics`).
    """
    os.environ.update(worker_environment(options))
    Path(options.data_dir).mkdir(parents=True, exist_ok=True)
    from stream_apps.app import app, declared_topics  # configured from the environment at import

    topics = declared_topics()
    ensure_topics(options.bootstrap_servers, {name: p for name, (p, _) in topics.items()},
                  configs={name: config for name, (_, config) in topics.items()})

    sys.argv = ["kvstream worker", "worker", "--loglevel", options.log_level, "--web-port", str(options.web_port),
                "--web-bind", options.web_bind, "--web-host", options.web_host]
    app.main()
    return 0


def spawn_worker(options: WorkerOptions, log_file: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``kvstream worker`` as a child process (in its own session) with its output appended to ``log_file``.

    Args:
        extra_env: variables added to this process's environment for the worker, e.g. Faust's own
            ``BROKER_SESSION_TIMEOUT`` (seconds; default 60) that ``make chaos`` shortens.
    """
    log_file.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "kvstream.cli", "worker", "--bootstrap-servers", options.bootstrap_servers,
               "--web-port", str(options.web_port), "--web-bind", options.web_bind, "--web-host", options.web_host,
               "--data-dir",
               str(options.data_dir), "--store", options.store, "--partitions", str(options.partitions),
               "--clear-scope", options.clear_scope, "--aggregation", options.aggregation, "--app-id",
               options.app_id, "--loglevel", options.log_level]
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


def app_progress(bootstrap_servers: str, app_id: str, admin: AdminClient | None = None) -> dict[str, GroupProgress]:
    """Progress of both stages: kv-events (repartition group) and the re-keyed topic (the app's group).

    Raises:
        RuntimeError: as :func:`group_progress`.
    """
    admin = admin or AdminClient(client_config(bootstrap_servers))
    return {**group_progress(bootstrap_servers, repartition_group(app_id), [KV_EVENTS], admin),
            **group_progress(bootstrap_servers, app_id, [by_ownership_topic(app_id)], admin)}


def wait_until_consumed(bootstrap_servers: str, group: str, process: subprocess.Popen | None, *,
                        timeout_s: float, on_progress=None, poll_s: float = 1.0) -> float:
    """Wait until the app ``group`` (the app id) has committed everything in kv-events and its re-keyed topic.

    kv-events is read by the repartition stage's group ``<app id>-repartition``
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
    started = time.monotonic()
    admin = AdminClient(client_config(bootstrap_servers))
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the stream-app worker exited with code {process.returncode}")
        try:
            progress = app_progress(bootstrap_servers, group, admin)
        except RuntimeError as exc:  # e.g. the group coordinator is still loading: ask again
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"consumer group {group} unreadable after {timeout_s:.0f}s: {exc}") from None
            time.sleep(poll_s)
            continue
        if on_progress:
            on_progress(progress)
        upstream = progress[KV_EVENTS]
        if upstream.end and all(p.lag == 0 for p in progress.values()):
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"consumer group {group} still has {sum(p.lag for p in progress.values())} "
                               f"messages to commit after {timeout_s:.0f}s")
        time.sleep(poll_s)
