"""The repartition stage in a process of its own: :class:`RepartitionProcess` runs the loop in a spawned child for
the worker's lifetime, :class:`RepartitionService` ties it to the worker's Faust app, and the counters and the
agent's progress are shared through ``multiprocessing`` values."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import threading

import mode

from kafka_io.logs import configure_logging
from schemas.topics import TopicNames
from stream_apps.repartition.loop import NOT_READ_HERE, Repartitioner

log = logging.getLogger(__name__)

class _SharedCounters:
    """The ``counters`` mapping of a :class:`Repartitioner` in a child process: each name is a shared
    ``multiprocessing.Value`` (int64) that the worker reads for ``/stats/``."""

    def __init__(self, values: dict) -> None:
        self._values = values

    def __getitem__(self, name: str) -> int:
        return self._values[name].value

    def __setitem__(self, name: str, value: int) -> None:
        self._values[name].value = value


def new_agent_progress(partitions: int):
    """A shared int64 array (one element per re-keyed partition, all :data:`NOT_READ_HERE`) that the worker
    writes and its repartition process reads, as :class:`Repartitioner`'s ``agent_progress``."""
    return multiprocessing.get_context("spawn").Array("q", [NOT_READ_HERE] * partitions, lock=False)


class RepartitionProcess:
    """Runs a :class:`Repartitioner` in a spawned child process for the worker's lifetime.

    The re-keying is Python work on every event. In a thread it shares the worker's GIL with the
    materializing agent (Faust's event loop), so each waits for the other; in a process of its own it runs
    on the other core. The child stops after the batch in hand when :meth:`stop` is called, when it gets SIGTERM, or
    when its parent (the worker) is gone; it ignores SIGINT (a terminal's Ctrl-C reaches the whole process
    group; the worker stops it in order). A loop that dies exits with code 1 after logging why; the worker
    watches :attr:`exitcode` and crashes too, so that a supervisor restarts both and the batch that was not
    acknowledged is read again.

    Args:
        bootstrap_servers, topics, partitions, batch_size, within_s, linger_s, agent_progress, aggregation: as
            :class:`Repartitioner` (``agent_progress`` made by :func:`new_agent_progress`; None: a new one). The child
            inherits the environment (security settings, ``BROKER_SESSION_TIMEOUT``).
        nice: niceness the child adds to its own at start (``os.nice``, 0 to 19; ``--repartition-nice``): below
            the worker's priority, it gets the CPU after the agent when both want it. 0: the same priority.
    """

    def __init__(self, bootstrap_servers: str, topics: TopicNames, partitions: int, *, batch_size: int = 10_000,
                 within_s: float = 0.1, linger_s: float = 0.02, nice: int = 0, log_format: str = "text",
                 schema_registry_url: str = "", agent_progress=None, aggregation: dict | None = None) -> None:
        if not 0 <= nice <= 19:
            raise ValueError(f"nice={nice!r}: expected 0 to 19 (added to the worker's niceness)")
        context = multiprocessing.get_context("spawn")  # the worker has threads; fork would copy their locks
        self._stop = context.Event()
        #: Re-keyed partition -> offset of the last message this worker's agent finished
        #: (:class:`stream_apps.agent_progress.AgentProgress`).
        self.agent_progress = agent_progress if agent_progress is not None else new_agent_progress(partitions)
        #: Events re-keyed and records dead-lettered by the child, read by the worker's ``/stats/``.
        self._values = {"repartitioned": context.Value("q", 0, lock=False),
                        "dead_lettered": context.Value("q", 0, lock=False)}
        self._process = context.Process(
            target=_run_child, name="kvstream-repartition", daemon=True,
            args=(bootstrap_servers, topics, partitions, batch_size, within_s, linger_s, self.agent_progress,
                  self._stop, self._values,
                  os.getpid(), logging.getLevelName(logging.getLogger().getEffectiveLevel()), log_format,
                  schema_registry_url, dict(aggregation or {}), nice))

    def start(self) -> None:
        """Spawn the child (it imports the project, then joins its consumer group)."""
        self._process.start()
        log.info("repartition stage started in process %d", self._process.pid)

    @property
    def exitcode(self) -> int | None:
        """None while the child runs; its exit code once it has ended (0: stopped as asked)."""
        return self._process.exitcode

    def counters(self) -> dict[str, int]:
        """``{"repartitioned": events re-keyed, "dead_lettered": records sent to the dead-letter topic}``."""
        return {name: value.value for name, value in self._values.items()}

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the child to stop after the batch in hand (flushed and committed) and wait; kill it after
        ``timeout_s`` (its batch is then read again by the next repartition process: at least once)."""
        self._stop.set()
        if self._process.pid is None:
            return
        self._process.join(timeout_s)
        if self._process.is_alive():
            log.warning("repartition stage did not stop within %.0f s; terminating it", timeout_s)
            self._process.kill()
            self._process.join(5)


def _run_child(bootstrap_servers: str, topics: TopicNames, partitions: int, batch_size: int, within_s: float,
               linger_s: float, agent_progress, stop, values: dict, parent_pid: int, log_level: str, log_format: str,
               schema_registry_url: str, aggregation: dict, nice: int) -> None:
    """The child process of :class:`RepartitionProcess`: run the loop until asked to stop."""
    configure_logging(log_level, log_format)
    if nice:
        log.info("repartition process at niceness %d (--repartition-nice %d)", os.nice(nice), nice)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def watch_parent() -> None:
        while not stop.wait(1.0):
            if os.getppid() != parent_pid:
                log.warning("the worker (pid %d) is gone; stopping the repartition stage", parent_pid)
                stop.set()

    threading.Thread(target=watch_parent, name="kvstream-parent-watch", daemon=True).start()
    repartitioner = Repartitioner(bootstrap_servers, topics, partitions, _SharedCounters(values),
                                  batch_size=batch_size, within_s=within_s, linger_s=linger_s, stop_event=stop,
                                  schema_registry_url=schema_registry_url, agent_progress=agent_progress,
                                  aggregation=aggregation)
    try:
        repartitioner.run()
    except BaseException:  # noqa: BLE001 - the worker learns it from the exit code
        log.exception("the repartition stage stopped")
        raise SystemExit(1)


class RepartitionService(mode.Service):
    """Runs the repartition process (:class:`RepartitionProcess`) for the worker's lifetime.

    If the process dies (e.g. the broker refuses its outputs), the worker crashes, so that a supervisor
    restarts it and the unacknowledged batch is read again.

    Args:
        app: the Faust app (its ``crash`` is called when the process exits).
        bootstrap_servers, topics, partitions, batch_size, within_s, linger_s, aggregation: as :class:`Repartitioner`.
        nice: as :class:`RepartitionProcess`.
    """

    def __init__(self, app, bootstrap_servers: str, topics: TopicNames, partitions: int, *, batch_size: int,
                 within_s: float, linger_s: float = 0.02, nice: int = 0, log_format: str = "text",
                 schema_registry_url: str = "", aggregation: dict | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.app = app
        self._arguments = (bootstrap_servers, topics, partitions, batch_size, within_s, linger_s, nice, log_format,
                           schema_registry_url, aggregation)
        #: What the worker's agent has finished, for the process (:class:`stream_apps.agent_progress.AgentProgress`).
        self.agent_progress = new_agent_progress(partitions)
        self.process: RepartitionProcess | None = None
        self._spawned = False

    async def on_start(self) -> None:
        # built here, not in __init__: the process takes the log level Faust has configured by now
        (bootstrap_servers, topics, partitions, batch_size, within_s, linger_s, nice, log_format, registry_url,
         aggregation) = self._arguments
        self.process = RepartitionProcess(bootstrap_servers, topics, partitions, batch_size=batch_size,
                                          within_s=within_s, linger_s=linger_s, nice=nice, log_format=log_format,
                                          agent_progress=self.agent_progress,
                                          schema_registry_url=registry_url, aggregation=aggregation)
        self.process.start()
        self._spawned = True

    @mode.Service.task
    async def _watch(self) -> None:
        while not self.should_stop:
            await self.sleep(1.0)
            code = self.process.exitcode if self._spawned else None
            if code is not None and not self.should_stop:
                await self.app.crash(RuntimeError(f"the repartition process exited with code {code} "
                                                  "(its log is above)"))
                return

    @property
    def alive(self) -> bool:
        """True while the process runs."""
        return self._spawned and self.process.exitcode is None

    def counters(self) -> dict[str, int]:
        """The process's counters (``repartitioned``, ``dead_lettered``); zeros before it started."""
        return self.process.counters() if self._spawned else {"repartitioned": 0, "dead_lettered": 0}

    async def on_stop(self) -> None:
        if self._spawned:
            await asyncio.get_running_loop().run_in_executor(None, self.process.stop)
