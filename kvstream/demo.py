"""``kvstream demo``: the whole pipeline on the embedded broker and the Mooncake trace.

Steps: start a fresh one-node Kafka broker; replay the trace through the
simulated fleet into ``kv-events``; run a stream-app worker until it has
consumed everything; print the occupancy table and each stage's speed; compare
the materialized residency (read back from its changelog topic) with the
simulator's ground truth row for row, and check a sample of blocks through the
HTTP view. Exits non-zero on any difference.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from kafka_io.admin import ensure_topics
from kafka_io.config import DEFAULT_PARTITIONS
from kafka_io.schema_registry import writer_codec
from kvstream import broker, registry
from kvstream.export import NULL_OWNERSHIP
from kvstream.worker import spawn_worker, stop_worker, wait_until_consumed
from producers.kafka_sink import KvEventProducer
from producers.simulator import DEFAULT_TRACE, FleetConfig, ReplayResult, load_trace, replay_to_kafka
from schemas.topics import KV_EVENTS, SCHEMAS, changelog_topic
from stream_apps.settings import WorkerSettings
from stream_apps.snapshot import compare_rows, read_table, resident_rows


@dataclass
class DemoOptions:
    """Options of ``kvstream demo`` (see its ``--help``)."""

    port: int = 9092
    web_port: int = 6066
    work_dir: Path = Path(".kvstream/demo")
    trace: Path = DEFAULT_TRACE
    requests: int | None = None
    partitions: int = DEFAULT_PARTITIONS
    instances: int = 4
    keep_running: bool = False
    timeout_s: float = 1800.0
    #: Port of the schema registry the demo runs (registry mode: the Confluent wire format, as deployments).
    registry_port: int = 8081
    #: Run without a registry: single-object framing, writer schemas in the schemas topic.
    no_registry: bool = False
    http_sample: int = 200




def _print_occupancy(rows: list[dict]) -> None:
    print("\nTier occupancy (resident blocks)")
    print(f"  {'ownership':<16} {'tier':<8} {'instance':<10} {'blocks':>9}")
    for row in rows:
        ownership = NULL_OWNERSHIP if row["ownership"] is None else row["ownership"]
        print(f"  {ownership:<16} {row['tier']:<8} {row['instance_id']:<10} {row['resident_blocks']:>9,}")


def _http_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _worker_stats(url: str) -> dict | None:
    try:
        return _http_json(url)
    except (OSError, ValueError):
        return None


def _wait_for_web(url: str, process, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the stream-app worker exited with code {process.returncode}")
        try:
            _http_json(url)
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"the worker's web server did not answer at {url}")


def _worker_alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
        return True
    except (OSError, ValueError):
        return False


def _stop_hint(work: Path) -> str:
    kvstream = Path(sys.argv[0]).resolve() if sys.argv[0].endswith("kvstream") else "kvstream"
    return (f"kill $(cat {work / 'worker.pid'}); {kvstream} broker stop --data-dir {work / 'broker'}; "
            f"{kvstream} registry stop --data-dir {work / 'registry'}")


#: The demo workers' --source-lease-s (a day): see _worker_settings.
DEMO_SOURCE_LEASE_S = 86_400.0


def run_demo(options: DemoOptions) -> int:
    """Run the demo; returns the exit code (0 when the residency matches the ground truth).

    Its steps are the functions below, in the order they print ``[1/5]`` to ``[5/5]``; the broker, the registry
    and the worker are stopped at the end unless ``--keep-running``.
    """
    work = options.work_dir.resolve()
    broker_dir, registry_dir, log_file = work / "broker", work / "registry", work / "worker.log"
    _refuse_a_running_demo(options, work)
    shutil.rmtree(work, ignore_errors=True)  # every demo starts from empty topics and tables
    work.mkdir(parents=True)

    bootstrap, registry_url = _start_broker(options, broker_dir, registry_dir)
    worker_options = _worker_settings(options, bootstrap, registry_url, work / "worker")
    ensure_topics(bootstrap, {KV_EVENTS: options.partitions})
    process = None
    try:
        result = _replay_trace(options, bootstrap, registry_url)

        print(f"[3/5] Running a stream-app worker until it has consumed everything (log: {log_file})")
        t0 = time.perf_counter()
        process = spawn_worker(worker_options, log_file)
        (work / "worker.pid").write_text(str(process.pid))
        _consume_everything(options, bootstrap, worker_options.app_id, process, result.messages, log_file)
        stream_s = time.perf_counter() - t0
        print(f"      consumed in {stream_s:.1f}s (worker start-up included): "
              f"{result.messages / stream_s:,.0f} events/s end to end")

        base_url = f"http://127.0.0.1:{options.web_port}"
        actual, occupancy = _read_back(bootstrap, worker_options.app_id, base_url, process)
        failures = _compare_with_ground_truth(result.ground_truth, actual, occupancy, base_url, options.http_sample)
        if options.keep_running:
            print(f"\nStill running (--keep-running). Try:\n  curl {base_url}/occupancy/\n"
                  f"  curl {base_url}/residency/<block hash hex>/\n  curl {base_url}/sources/\n"
                  f"  curl {base_url}/stats/\nStop with:\n  {_stop_hint(work)}")
        return 1 if failures else 0
    finally:
        if not options.keep_running:
            if process is not None:
                stop_worker(process)
            broker.stop(broker_dir)
            registry.stop(registry_dir)


def _refuse_a_running_demo(options: DemoOptions, work: Path) -> None:
    """Raise RuntimeError, saying what to do, if an earlier demo still runs in ``work`` or a port is taken: the
    demo empties ``work`` next."""
    if broker.status(work / "broker").running or _worker_alive(work / "worker.pid"):
        raise RuntimeError(f"an earlier demo is still running in {work} (--keep-running?). Stop it first:\n"
                           f"  {_stop_hint(work)}\nor pass another --work-dir, --port and --web-port")
    if broker.port_in_use(options.web_port):
        raise RuntimeError(f"port {options.web_port} is in use by another program; choose --web-port")
    if broker.port_in_use(options.port):
        raise RuntimeError(f"port {options.port} is in use by another program; choose --port")
    registry_dir = work / "registry"
    if not options.no_registry and (registry.status(registry_dir).running or broker.port_in_use(options.registry_port)):
        raise RuntimeError(f"port {options.registry_port} is in use (an earlier demo's registry?); stop it with "
                           f"'kvstream registry stop --data-dir {registry_dir}', or choose --registry-port, "
                           "or pass --no-registry")


def _start_broker(options: DemoOptions, broker_dir: Path, registry_dir: Path) -> tuple[str, str]:
    """Step 1: start the broker, and the schema registry unless ``--no-registry``; returns ``(bootstrap servers,
    registry URL)``, the URL empty without a registry."""
    print(f"[1/5] Starting Kafka {broker.KAFKA_VERSION} on 127.0.0.1:{options.port} (data in {broker_dir})")
    t0 = time.perf_counter()
    status = broker.start(port=options.port, data_dir=broker_dir)
    print(f"      broker ready in {time.perf_counter() - t0:.1f}s; log: {status.log_file}")
    registry_url = ""
    if not options.no_registry:
        t0 = time.perf_counter()
        registry_url = registry.start(port=options.registry_port, data_dir=registry_dir).url
        print(f"      schema registry (Apicurio {registry.APICURIO_VERSION}) ready in {time.perf_counter() - t0:.1f}s "
              f"at {registry_url}: records in the Confluent wire format")
    return status.bootstrap_servers, registry_url


def _worker_settings(options: DemoOptions, bootstrap: str, registry_url: str, worker_dir: Path) -> WorkerSettings:
    """The demo worker's settings."""
    return WorkerSettings(bootstrap_servers=bootstrap, web_port=options.web_port, data_dir=worker_dir,
                          partitions=options.partitions, schema_registry_url=registry_url,
                          residency_changes=True,  # the demo's data feeds kvstream report
                          # the simulated instances publish the trace once and stop: a day's lease keeps
                          # their blocks in the answers while you explore with --keep-running
                          source_lease_s=DEMO_SOURCE_LEASE_S)


def _replay_trace(options: DemoOptions, bootstrap: str, registry_url: str) -> ReplayResult:
    """Step 2: replay the trace through the simulated fleet into kv-events; returns the replay's result (its
    ground truth included)."""
    requests = load_trace(options.trace, options.requests)
    print(f"[2/5] Replaying {len(requests):,} requests of {options.trace.name} through "
          f"{options.instances} simulated instances into '{KV_EVENTS}'")
    result = _replay(bootstrap, requests, FleetConfig(instances=options.instances), registry_url)
    sim = result.simulation
    print(f"      {result.records:,} block events ({result.messages:,} Kafka messages, clears on every "
          f"partition) from {sim.engine_events:,} engine events in {sim.batches:,} batches")
    print(f"      produced in {result.seconds:.1f}s: {result.messages / result.seconds:,.0f} events/s "
          f"(simulation + Avro + Kafka acks)")
    print(f"      lookups: {sim.block_lookups:,} blocks; hits GPU {sim.gpu_hits:,}, CPU {sim.cpu_hits:,}, "
          f"KVCR {sim.kvcr_hits:,}")
    return result


def _consume_everything(options: DemoOptions, bootstrap: str, app_id: str, process, messages: int,
                        log_file: Path) -> None:
    """Step 3, once the worker is spawned: wait until it has consumed the ``messages`` replayed, with a progress
    bar.

    Raises:
        RuntimeError: the worker exited or did not finish in ``--timeout``; the message ends with its log's last
            lines.
    """
    with tqdm(total=messages, unit="ev", leave=False, disable=None) as bar:
        def show(progress):
            stats = _worker_stats(f"http://127.0.0.1:{options.web_port}/stats/")
            # the worker's own counters move smoothly; committed offsets move at each Faust commit
            bar.n = stats["materialized"] if stats else progress[KV_EVENTS].committed
            bar.set_postfix(re_keyed=stats["repartitioned"] if stats else "?",
                            uncommitted=sum(p.lag for p in progress.values()))
            bar.refresh()

        try:
            wait_until_consumed(bootstrap, app_id, process, timeout_s=options.timeout_s, on_progress=show)
        except (RuntimeError, TimeoutError) as exc:
            tail = log_file.read_text(errors="replace").splitlines()[-15:]
            raise RuntimeError(f"{exc}; last lines of {log_file}:\n  " + "\n  ".join(tail)) from None


def _read_back(bootstrap: str, app_id: str, base_url: str, process) -> tuple[dict, list[dict]]:
    """Step 4: the resident rows of the residency table, read back from its changelog, and the worker's occupancy
    view (printed); returns ``(rows, occupancy)``."""
    print("[4/5] Reading the residency table back from its changelog")
    t0 = time.perf_counter()
    table = read_table(bootstrap, changelog_topic(app_id, "residency"), "residency")
    actual = resident_rows(table)
    print(f"      {len(table):,} keys, {len(actual):,} resident rows in {time.perf_counter() - t0:.1f}s")
    _wait_for_web(f"{base_url}/occupancy/", process)
    occupancy = _http_json(f"{base_url}/occupancy/")["occupancy"]
    _print_occupancy(occupancy)
    return actual, occupancy


def _compare_with_ground_truth(truth: dict, actual: dict, occupancy: list[dict], base_url: str, sample: int) -> int:
    """Step 5: the resident rows against the simulator's ground truth, the occupancy total against the rows, and
    a sample of blocks through the HTTP view; returns the number of checks that failed."""
    print("\n[5/5] Comparing with the simulator's ground truth")
    comparison = compare_rows(truth, actual)
    failures = 0
    if comparison.ok:
        print(f"residency matches ground truth: {comparison.matching:,} rows")
    else:
        failures += 1
        print(f"residency DIFFERS from ground truth: {comparison.differing:,} rows differ, "
              f"{comparison.matching:,} match; first differences (row, expected copies, actual):")
        for identity, want, got in comparison.differences:
            print(f"  {identity[:6]} {identity[6].hex()}: expected {want}, got {got}")
    occupancy_total = sum(row["resident_blocks"] for row in occupancy)
    if occupancy_total != len(actual):
        failures += 1
        print(f"occupancy view counts {occupancy_total:,} resident blocks, the table {len(actual):,}")
    return failures + _check_http_sample(base_url, truth, sample)


def _replay(bootstrap: str, requests: list, fleet: FleetConfig, registry_url: str):
    """Produce the simulation; the producer is released on return (it holds librdkafka threads)."""
    codec = writer_codec("kv_event", bootstrap, KV_EVENTS, registry_url, SCHEMAS)
    producer = KvEventProducer(bootstrap, KV_EVENTS, codec=codec)
    with tqdm(total=len(requests), unit="req", leave=False, disable=None) as bar:
        return replay_to_kafka(requests, producer, fleet, progress=bar.update)


def _check_http_sample(base_url: str, truth: dict, sample: int) -> int:
    """Ask ``GET /residency/{hash}/`` for a sample of blocks and compare with the ground truth; returns failures."""
    by_block: dict[bytes, dict] = {}
    for identity, copies in truth.items():
        by_block.setdefault(identity[6], {})[identity[:6]] = copies
    blocks = random.Random(7).sample(sorted(by_block), min(sample, len(by_block)))
    wrong = 0
    for block in blocks:
        answer = _http_json(f"{base_url}/residency/{block.hex()}/")
        got = {(r["instance_id"], r["data_parallel_rank"], r["tier"], r["ownership"], r["locality"],
                r["group_idx"]): r["copies"] for r in answer["rows"]}
        if got != by_block[block]:
            wrong += 1
            if wrong <= 3:
                print(f"GET /residency/{block.hex()}/ answered {got}, expected {by_block[block]}")
    print(f"HTTP view agrees with ground truth on {len(blocks) - wrong} of {len(blocks)} sampled blocks")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(run_demo(DemoOptions()))
