"""The bench's processes: workers it starts and asks, CPU and RSS sampling, the bridge step's publisher child."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from kvstream.broker import free_port


def _say(text: str) -> None:
    print(text, flush=True)


#: The bench workers' --source-lease-s: the bench's sources publish once and are asked about long after, so a day.
BENCH_SOURCE_LEASE_S = 86_400.0


def _http_json(url: str, timeout_s: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


def _stats(port: int) -> dict | None:
    try:
        return _http_json(f"http://127.0.0.1:{port}/stats/", 5)
    except (OSError, ValueError):
        return None


#: The samples of a worker's ``/metrics`` that a round keeps: what its collector and its checkpoints cost.
ROUND_METRICS = ("kvstream_gc_pause_seconds", "kvstream_checkpoint_seconds")


def _worker_metrics(port: int, prefixes: tuple[str, ...] = ROUND_METRICS) -> dict[str, float] | None:
    """The worker's ``/metrics`` samples whose names start with one of ``prefixes``, ``{'name{labels}': value}``;
    None if it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    samples = {}
    for line in text.splitlines():
        if line.startswith(prefixes):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def gc_and_checkpoint_summary(samples: dict[str, float] | None) -> str:
    """``", GC 0.41 s in 120 collections (full 0.12 s), checkpoints 0.90 s in 7"`` from :func:`_worker_metrics`'
    samples; empty without them."""
    if not samples:
        return ""
    gc_s = sum(v for k, v in samples.items() if k.startswith("kvstream_gc_pause_seconds_sum"))
    gc_n = sum(v for k, v in samples.items() if k.startswith("kvstream_gc_pause_seconds_count"))
    full_s = samples.get('kvstream_gc_pause_seconds_sum{generation="2"}', 0.0)
    return (f", GC {gc_s:.2f} s in {gc_n:,.0f} collections (full {full_s:.2f} s), checkpoints "
            f"{samples.get('kvstream_checkpoint_seconds_sum', 0.0):.2f} s in "
            f"{samples.get('kvstream_checkpoint_seconds_count', 0.0):,.0f}")


def machine_probe_ms(iterations: int = 2_000_000) -> float:
    """CPU milliseconds (this process's, ``time.process_time``) of a fixed loop of Python additions.

    On the bench's shared 2-core machine the same loop took either about 70-90 or 120-150 ms, switching every
    few seconds with the machine idle and no steal time reported (bench/HISTORY.md, "2026-12-04 late night"):
    the host's cores are not always as fast. Taken just before and after each peers round, it says whether a
    round's pair ran on the same machine; it is not a benchmark of anything of ours.
    """
    start = time.process_time()
    total = 0
    for i in range(iterations):
        total += i
    return round((time.process_time() - start) * 1000.0, 1)


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds used so far by these processes and all their live children (psutil)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for p in (proc, *proc.children(recursive=True)):
                times = p.cpu_times()
                total += times.user + times.system
        except psutil.Error:
            pass
    return total


class _Peak:
    """Samples the RSS of a process and its children every ``every_s`` in a thread; ``peak`` in bytes."""

    def __init__(self, pids: Callable[[], list[int]], every_s: float = 0.5) -> None:
        self.peak = 0
        self._pids = pids
        self._every = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            total = 0
            for pid in self._pids():
                try:
                    proc = psutil.Process(pid)
                    total += proc.memory_info().rss
                    total += sum(c.memory_info().rss for c in proc.children(recursive=True))
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(self._every)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


@dataclass
class _Workers:
    """Workers of one app id started by the bench, with their ports and logs."""

    bootstrap: str
    app_id: str
    work: Path
    store: str = "memory://"
    partitions: int = 8
    #: ``--topic-prefix`` of the workers (the peers step reads ``peers.kv-events``).
    topic_prefix: str = ""
    #: ``--residency-changes``: the stream steps publish them (the latency and tail steps read them); the peers
    #: step does not, as a deployment that does not ask for them.
    residency_changes: bool = False
    #: ``--schema-registry-url`` of the workers (``make bench BENCH_ARGS=--schema-registry=URL``).
    schema_registry_url: str = ""
    processes: list = field(default_factory=list)
    ports: list = field(default_factory=list)
    logs: list = field(default_factory=list)

    def start(self, count: int = 1, fresh_dirs: bool = True) -> None:
        from kvstream.worker import spawn_worker
        from stream_apps.settings import WorkerSettings

        for _ in range(count):
            index = len(self.processes)
            port = free_port()
            data_dir = self.work / f"{self.app_id}-{index}-{port}"
            if fresh_dirs:
                shutil.rmtree(data_dir, ignore_errors=True)
            log = self.work / f"{self.app_id}-{index}.log"
            options = WorkerSettings(bootstrap_servers=self.bootstrap, web_port=port, data_dir=data_dir,
                                    store=self.store, partitions=self.partitions, app_id=self.app_id, log_level="info",
                                    topic_prefix=self.topic_prefix, residency_changes=self.residency_changes,
                                    schema_registry_url=self.schema_registry_url,
                                    source_lease_s=BENCH_SOURCE_LEASE_S)
            self.processes.append(spawn_worker(options, log))
            self.ports.append(port)
            self.logs.append(log)

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.poll() is None]

    def materialized(self) -> int:
        return sum((_stats(port) or {}).get("materialized", 0) for port in self.ports)

    def resident_rows(self) -> int:
        total = 0
        for port in self.ports:
            s = _stats(port) or {}
            total += s.get("became_resident", 0) - s.get("stopped_resident", 0)
        return total

    def check_alive(self) -> None:
        for process, log in zip(self.processes, self.logs):
            if process.poll() is not None:
                tail = log.read_text(errors="replace").splitlines()[-15:]
                raise RuntimeError(f"worker exited with code {process.returncode}; last lines of {log}:\n  "
                                   + "\n  ".join(tail))

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until the first worker answers ``/ready`` with 200 (assigned, tables recovered, index caught up;
        asked without the trailing slash, which older workers do not answer).

        Raises:
            RuntimeError: a worker exited (the last lines of its log in the message).
            TimeoutError: not ready within ``timeout_s`` (the worker's last answer in the message).
        """
        import urllib.error
        import urllib.request

        url = f"http://127.0.0.1:{self.ports[0]}/ready"
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urllib.request.urlopen(url, timeout=5):
                    return
            except urllib.error.HTTPError as exc:
                last = f"{exc.code}: {exc.read()[:300].decode(errors='replace')}"
            except OSError as exc:
                last = str(exc)
            time.sleep(0.5)
        raise TimeoutError(f"the worker on port {self.ports[0]} was not ready within {timeout_s:.0f} s "
                           f"(its last answer: {last})")

    def wait_first_event(self, timeout_s: float) -> float:
        """Wait until a worker has materialized an event; returns the perf_counter time it was seen."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            if self.materialized() > 0:
                return time.perf_counter()
            time.sleep(0.1)
        raise TimeoutError(f"workers of {self.app_id} materialized nothing within {timeout_s:.0f}s")

    def wait_consumed(self, total: int, timeout_s: float, label: str) -> float:
        """Wait until the group has committed everything; returns the perf_counter time it was seen."""
        from kvstream.worker import wait_until_consumed
        from schemas.topics import TopicNames

        with tqdm(total=total, unit="ev", desc=label, leave=False, disable=None) as bar:
            def show(_progress):
                if bar.disable:  # no terminal: no HTTP request to the worker being measured
                    return
                bar.n = min(self.materialized(), total)
                bar.refresh()

            process = self.processes[0]
            try:
                wait_until_consumed(self.bootstrap, TopicNames(self.app_id, self.topic_prefix), process,
                                    timeout_s=timeout_s, on_progress=show,
                                    poll_s=0.25)
            except RuntimeError:
                self.check_alive()
                raise
        self.check_alive()
        return time.perf_counter()

    def stop(self) -> None:
        from kvstream.worker import stop_worker

        for process in self.processes:
            stop_worker(process)


def _publish_process(port: int, payloads: list[bytes], start, done) -> None:
    """Child process: bind PUB on 127.0.0.1:port, wait for ``start``, send every payload, set ``done``."""
    import zmq

    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # never drop: the bridge's receive buffer is the bound
    pub.bind(f"tcp://127.0.0.1:{port}")
    start.wait()
    for seq, payload in enumerate(payloads):
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
    done.set()
    pub.close(linger=-1)
    context.term()


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
