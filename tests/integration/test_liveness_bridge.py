"""Liveness end to end (issue 26): `kvstream bridge` reading vLLM-protocol publisher doubles
(harness/vllm_publisher.py), the real broker, and one `kvstream worker` with a short lease. An idle engine stays
live on the bridge's heartbeats; a killed engine, or a killed bridge, takes its sources out of every answer within
a lease plus 5 s; a restarted engine (a new epoch) or bridge brings them back; a bridge started after its engine
went idle knows its blocks within seconds (docs/residency.md, "Liveness"; docs/ingesting.md, "Heartbeats and
replay on connect"). An engine process killed outright is said down in kv-events at once (``SourceDisconnected``,
issue 49), and gets no heartbeat until it is back."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import zmq
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from harness.vllm_publisher import BlockStored, FakeVllmPublisher
from kafka_io.admin import ensure_topics
from kafka_io.config import client_config
from kvstream.broker import free_port, free_ports
from kvstream.worker import spawn_worker, stop_worker
from schemas import PUBLISHER_RESTARTED, SOURCE_DISCONNECTED, SOURCE_HEARTBEAT, AvroCodec
from schemas.topics import KV_EVENTS
from stream_apps.settings import WorkerSettings

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PARTITIONS = 2
#: Topics and app of their own, one set per run: kv-events is shared by the session's other tests.
RUN = uuid.uuid4().hex[:8]
PREFIX = f"liveness-bridge-test.{RUN}."
RUN_SEED = int(RUN[:4], 16)
APP_ID = "kvstream-liveness-bridge-test"
#: The worker's lease (its --source-lease-s; tests/conftest.py gives other tests a day) and the bridge's
#: heartbeat interval and probe timeout, well below it.
LEASE_S = 3.0
INTERVAL_S = 0.4
PROBE_TIMEOUT_S = 0.3
#: How soon a source whose engine or bridge died must have left every answer (issue 26).
DOWN_BOUND_S = LEASE_S + 5.0
#: How soon a bridge started next to an idle engine, or restarted, must have its blocks answering (its own start
#: included: a Python process, a Kafka producer, the first replay).
KNOWN_BOUND_S = 10.0
#: How soon after its engine's process was killed the bridge's ``SourceDisconnected`` must be readable in kv-events
#: (issue 49: every answer free of the engine within 1 s, of which this is the bridge's part).
DISCONNECT_BOUND_S = 0.5
BLOCK_SIZE = 4


# ---------------------------------------------------------------------------------------------------- helpers

def _chain(seed: int, length: int) -> list[int]:
    """``length`` block hashes (unsigned 64-bit, as vLLM's) unique to ``seed``, in prefix order."""
    return [(seed << 32) + (RUN_SEED << 16) + i for i in range(1, length + 1)]


def _post(url: str, body: dict) -> tuple[int, dict]:
    """POST ``body`` as JSON; the status and the JSON answer (an error's too)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _get(url: str) -> tuple[int, dict]:
    """GET; the status and the JSON answer (an error's too)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _answers(url: str, chain: list[int], instances: tuple[str, ...]) -> dict:
    """What the worker says now about ``chain`` and ``instances``: per instance named, the blocks matched by
    ``POST /prefix-match/`` and by ``POST /query_by_hash``, the instances holding the chain's first block
    (``GET /residency/``), and ``GET /workers``' ``live`` of each of ``instances`` (None: not listed). A view
    that does not answer 200 gives its status instead."""
    status, prefix = _post(f"{url}/prefix-match/", {"block_hashes": [h.to_bytes(8, "big").hex() for h in chain]})
    prefix_blocks = {m["instance_id"]: m["matched_blocks"] for m in prefix["matches"]} if status == 200 else status
    status, by_hash = _post(f"{url}/query_by_hash", {"seq_hashes": chain})
    hash_blocks = ({instance: ranks["0"]["matched_blocks"] for instance, ranks in by_hash["kvstream"]["ranks"].items()}
                   if status == 200 else status)
    status, residency = _get(f"{url}/residency/{chain[0].to_bytes(8, 'big').hex()}/")
    holders = sorted({row["instance_id"] for row in residency["rows"]}) if status == 200 else status
    status, workers = _get(f"{url}/workers")
    live = ({instance: next((w["live"] for w in workers["workers"] if w["instance_id"] == instance), None)
             for instance in instances} if status == 200 else status)
    return {"prefix_match": prefix_blocks, "query_by_hash": hash_blocks, "residency": holders, "live": live}


def _expected(chain_holders: dict[str, int], live: dict[str, bool]) -> dict:
    """The answers of :func:`_answers` when ``chain_holders`` (instance -> blocks of the chain) are the live
    holders and ``live`` the liveness of the instances asked about."""
    return {"prefix_match": chain_holders, "query_by_hash": chain_holders, "residency": sorted(chain_holders),
            "live": live}


def _wait_for(read, expected, timeout_s: float, since: float | None = None) -> tuple[object, float]:
    """Poll ``read()`` every 0.2 s until it returns ``expected`` or ``timeout_s`` passed; returns the last value and
    the seconds from ``since`` (a ``time.monotonic()``; default: the call) to the answer."""
    start = time.monotonic() if since is None else since
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if value == expected or time.monotonic() > deadline:
            return value, time.monotonic() - start
        time.sleep(0.2)


class Engine:
    """A vLLM engine as the network sees it: a :class:`FakeVllmPublisher` (PUB and ROUTER replay) on two ports,
    in this process. ``kill`` closes its sockets at once, as a crashed engine's kernel does; ``restart`` binds a
    new one, counting seqs from 0 again, on the same ports."""

    def __init__(self) -> None:
        self.port, self.replay_port = free_ports(2)
        self.publisher = self._bind()

    def _bind(self) -> FakeVllmPublisher:
        for _ in range(100):  # a killed engine's ports are released by ZMQ's I/O thread, a moment later
            try:
                return FakeVllmPublisher(self.port, self.replay_port)
            except zmq.ZMQError:
                time.sleep(0.05)
        raise RuntimeError(f"could not bind ports {self.port} and {self.replay_port} again")

    def store(self, hashes: list[int], parent: int | None = None) -> int:
        """Publish one batch storing ``hashes`` (a chain under ``parent``) on the GPU; returns its seq."""
        tokens = list(range(1000, 1000 + BLOCK_SIZE * len(hashes)))
        return self.publisher.publish([BlockStored(hashes, parent, tokens, BLOCK_SIZE, None, "GPU", None,
                                                   group_idx=0)], ts=time.time())

    def kill(self) -> None:
        """Close both sockets at once: its peers see the connections drop, nothing more is sent or answered."""
        self.publisher.kill()
        self.publisher = None

    def restart(self) -> None:
        """A new process on the same ports: seqs from 0, an empty replay buffer."""
        self.publisher = self._bind()

    def close(self) -> None:
        """Kill it unless it is dead already."""
        if self.publisher is not None:
            self.kill()


class BridgeProcess:
    """``kvstream bridge`` in a child process, following ``engines`` (instance id -> :class:`Engine`)."""

    def __init__(self, bootstrap: str, engines: dict[str, Engine], state_file: Path, log_file: Path,
                 metrics_port: int | None = None) -> None:
        self.command = [sys.executable, "-m", "kvstream.cli", "bridge", f"--bootstrap-servers={bootstrap}",
                        f"--topic-prefix={PREFIX}", f"--partitions={PARTITIONS}",
                        f"--heartbeat-interval-s={INTERVAL_S}", f"--heartbeat-probe-timeout-s={PROBE_TIMEOUT_S}",
                        f"--state-file={state_file}"]
        for instance, engine in engines.items():
            self.command += [f"--endpoint=tcp://127.0.0.1:{engine.port}",
                             f"--replay-endpoint=tcp://127.0.0.1:{engine.replay_port}", f"--instance-id={instance}"]
        if metrics_port is not None:
            self.command.append(f"--metrics-port={metrics_port}")
        self.log_file = log_file
        self.process: subprocess.Popen | None = None

    def start(self) -> float:
        """Start it; returns when (``time.monotonic()``)."""
        started = time.monotonic()
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                            start_new_session=True)
        return started

    def kill(self) -> None:
        """SIGKILL: no state saved, no flush, nothing sent after."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        """SIGTERM (it saves its state and flushes), SIGKILL if it does not stop."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def _bridge_metric(port: int, name: str, instance: str) -> float:
    """The sum of a bridge counter's samples for ``instance`` on its Prometheus endpoint (0 if it has none)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'instance="{instance}"' in line)


def _source(url: str, instance: str) -> dict:
    """``GET /sources/``' row of ``instance`` (rank 0)."""
    status, answer = _get(f"{url}/sources/")
    assert status == 200, answer
    rows = [row for row in answer["sources"] if row["instance_id"] == instance]
    assert len(rows) == 1, answer
    return rows[0]


def _worker_row(url: str, instance: str) -> dict:
    """``GET /workers``' row of ``instance`` (rank 0)."""
    status, answer = _get(f"{url}/workers")
    assert status == 200, answer
    return next(w for w in answer["workers"] if w["instance_id"] == instance)


def _wait_connected(engine: Engine, timeout_s: float = 20.0) -> None:
    """Wait for the bridge's replay on connect to reach ``engine``: its SUB connection is up."""
    _, waited = _wait_for(lambda: engine.publisher.replay_requests > 0, True, timeout_s)
    assert engine.publisher.replay_requests > 0, (f"no replay request reached the engine within {waited:.1f} s: the "
                                                  "bridge did not connect, or did not replay on connect")


class EngineProcess:
    """An engine in a process of its own (``python -m harness.vllm_publisher``): publishes ``batches`` one-block
    batches, then idles serving its replay socket until it is killed with SIGKILL, as a crashed vLLM is (the kernel
    closes its sockets)."""

    def __init__(self) -> None:
        self.port, self.replay_port = free_ports(2)
        self.process: subprocess.Popen | None = None

    def start(self, batches: int) -> None:
        """Start it (a new process: seqs from 0, an empty replay buffer) and wait until it has published."""
        for _ in range(50):  # a killed process's ports may take a moment to be free again
            self.process = subprocess.Popen(
                [sys.executable, "-m", "harness.vllm_publisher", "--port", str(self.port), "--replay-port",
                 str(self.replay_port), "--batches", str(batches)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, cwd=REPO)
            if self.process.stdout.readline().strip() == "ready":
                return
            self.process.wait(10)
            time.sleep(0.1)
        raise RuntimeError(f"the engine process could not bind ports {self.port} and {self.replay_port}")

    def kill(self) -> float:
        """SIGKILL; returns when (``time.time()``)."""
        self.process.send_signal(signal.SIGKILL)
        killed_at = time.time()
        self.process.wait(10)
        return killed_at

    def close(self) -> None:
        """Kill it unless it is dead already."""
        if self.process is not None and self.process.poll() is None:
            self.kill()


class EventsTail:
    """Reads partition 0 of this module's kv-events from its beginning (every source-wide event has a copy there):
    the records of one instance, each with the time this process read it (``time.time()``)."""

    def __init__(self, bootstrap: str, instance: str) -> None:
        self.instance = instance
        self.codec = AvroCodec("kv_event")
        self.consumer = Consumer(client_config(bootstrap, **{"group.id": f"liveness-tail-{uuid.uuid4().hex}",
                                                             "enable.auto.commit": False,
                                                             "fetch.wait.max.ms": 50}))
        self.consumer.assign([TopicPartition(PREFIX + KV_EVENTS, 0, OFFSET_BEGINNING)])
        #: (read at, record) of the instance, in order.
        self.read: list[tuple[float, dict]] = []

    def until(self, done, timeout_s: float) -> bool:
        """Read until ``done(self.read)`` is true (True) or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while not done(self.read):
            if time.monotonic() > deadline:
                return False
            for message in self.consumer.consume(100, 0.05):
                if message.error() is None:
                    record = self.codec.decode(message.value())
                    if record["instance_id"] == self.instance:
                        self.read.append((time.time(), record))
        return True

    def kinds(self, since: int = 0) -> list[tuple[str, int]]:
        """(kind's short name, epoch) of the records read, from the ``since``-th on."""
        return [(record["event"][0].rsplit(".", 1)[-1], record["publisher_epoch"]) for _, record in self.read[since:]]

    def close(self) -> None:
        """Close the consumer."""
        self.consumer.close()


def _of_kind(kind: str):
    """``done`` for :meth:`EventsTail.until`: a record of ``kind`` was read."""
    return lambda read: any(record["event"][0] == kind for _, record in read)


# ---------------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def worker(kafka_bootstrap, tmp_path_factory):
    """One worker on this module's topics with a lease of LEASE_S, ready to answer; yields its URL."""
    ensure_topics(kafka_bootstrap, {PREFIX + KV_EVENTS: PARTITIONS})
    work = tmp_path_factory.mktemp("liveness-bridge")
    settings = WorkerSettings(bootstrap_servers=kafka_bootstrap, web_port=free_port(), data_dir=work / "worker",
                              partitions=PARTITIONS, app_id=APP_ID, topic_prefix=PREFIX, store="memory://",
                              source_lease_s=LEASE_S)
    log_file = work / "worker.log"
    process = spawn_worker(settings, log_file)
    url = f"http://127.0.0.1:{settings.web_port}"
    try:
        def ready():
            if process.poll() is not None:
                raise RuntimeError(f"the worker exited with code {process.returncode}")
            try:
                return _post(f"{url}/prefix-match/", {"block_hashes": ["00" * 8]})[0]
            except OSError:
                return None
        status, waited = _wait_for(ready, 200, 120)
        assert status == 200, f"the worker was not ready after {waited:.0f} s"
        yield url
    finally:
        stop_worker(process)
        print("worker.log:", log_file.read_text()[-4000:])


@pytest.fixture
def rig(kafka_bootstrap, tmp_path):
    """Makes engines and bridges for one test, and stops them all at its end (their logs printed)."""
    engines: list[Engine] = []
    bridges: list[BridgeProcess] = []

    class Rig:
        def engine(self) -> Engine:
            engines.append(Engine())
            return engines[-1]

        def bridge(self, engines_by_instance: dict[str, Engine], metrics_port: int | None = None) -> BridgeProcess:
            bridge = BridgeProcess(kafka_bootstrap, engines_by_instance, tmp_path / "bridge-state.json",
                                   tmp_path / f"bridge-{len(bridges)}.log", metrics_port)
            bridges.append(bridge)
            return bridge

    try:
        yield Rig()
    finally:
        for bridge in bridges:
            bridge.stop()
        for engine in engines:
            engine.close()
        for bridge in bridges:
            if bridge.log_file.exists():
                print(f"{bridge.log_file.name}:", bridge.log_file.read_text()[-3000:])


# ---------------------------------------------------------------------------------------------------- the tests

def test_an_idle_engine_stays_live_past_three_leases_on_the_bridges_heartbeats(worker, rig):
    instance = f"idle-{RUN}"
    engine = rig.engine()
    bridge = rig.bridge({instance: engine})
    bridge.start()
    _wait_connected(engine)
    chain = _chain(1, 4)
    engine.store(chain[:2])  # its first batches, live; then nothing
    engine.store(chain[2:], parent=chain[1])
    known = _expected({instance: 4}, {instance: True})
    answers, waited = _wait_for(lambda: _answers(worker, chain, (instance,)), known, KNOWN_BOUND_S)
    assert answers == known, f"after {waited:.1f} s"

    idle_since, probes_before = time.monotonic(), engine.publisher.replay_requests
    polls = 0
    while time.monotonic() - idle_since < 3 * LEASE_S + INTERVAL_S:
        answers = _answers(worker, chain, (instance,))
        assert answers == known, f"{time.monotonic() - idle_since:.1f} s into the engine's idleness"
        polls += 1
        time.sleep(0.2)
    idle_for = time.monotonic() - idle_since
    assert engine.publisher.seq == 2  # idle all along: no batch after its first two
    assert polls >= 10
    # what kept it live: the bridge's probes of the idle engine's replay socket, one per interval
    probes = engine.publisher.replay_requests - probes_before
    assert probes >= 3 * LEASE_S / INTERVAL_S / 2, probes
    print(f"idle engine live for {idle_for:.1f} s ({polls} polls answered, {probes} probes)")
    row = _worker_row(worker, instance)
    assert row["blocks"] == {"GPU": 4} and row["down_since"] is None
    assert time.time() - row["last_heard"] < LEASE_S


def test_a_killed_engines_blocks_leave_every_answer_within_a_lease_and_5_s_and_its_restart_answers_again(
        worker, rig):
    killed, survivor = f"killed-{RUN}", f"survivor-{RUN}"
    engines = {killed: rig.engine(), survivor: rig.engine()}
    bridge = rig.bridge(engines)
    bridge.start()
    for engine in engines.values():
        _wait_connected(engine)
    chain = _chain(2, 4)
    for engine in engines.values():  # both hold the same prefix
        engine.store(chain[:2])
        engine.store(chain[2:], parent=chain[1])
    both = _expected({killed: 4, survivor: 4}, {killed: True, survivor: True})
    answers, waited = _wait_for(lambda: _answers(worker, chain, (killed, survivor)), both, KNOWN_BOUND_S)
    assert answers == both, f"after {waited:.1f} s"

    engines[killed].kill()
    killed_at = time.monotonic()
    survivor_only = _expected({survivor: 4}, {killed: False, survivor: True})
    answers, took = _wait_for(lambda: _answers(worker, chain, (killed, survivor)), survivor_only,
                              DOWN_BOUND_S + 5, since=killed_at)
    assert answers == survivor_only, f"{took:.1f} s after the kill"
    assert took <= DOWN_BOUND_S, f"the killed engine left the answers {took:.1f} s after the kill"
    print(f"killed engine out of every answer {took:.1f} s after the kill")
    row = _worker_row(worker, killed)
    assert row["blocks"] == {"GPU": 4} and row["down_since"] is not None  # kept, not answered
    epoch_before = _source(worker, killed)["publisher_epoch"]

    engines[killed].restart()  # a new process on the same endpoint: seqs from 0, an empty cache, then new blocks
    restarted_at = time.monotonic()
    fresh = _chain(3, 4)
    engines[killed].store(fresh)
    back = _expected({killed: 4}, {killed: True, survivor: True})
    answers, took = _wait_for(lambda: _answers(worker, fresh, (killed, survivor)), back, KNOWN_BOUND_S,
                              since=restarted_at)
    assert answers == back, f"{took:.1f} s after the restart"
    print(f"restarted engine's new blocks answered {took:.1f} s after the restart")
    # the dead process's blocks do not come back with the new one: its epoch was retired (PublisherRestarted)
    answers, took = _wait_for(lambda: _answers(worker, chain, (killed, survivor)), survivor_only | {
        "live": {killed: True, survivor: True}}, 5)
    assert answers == survivor_only | {"live": {killed: True, survivor: True}}
    source = _source(worker, killed)
    assert source["publisher_epoch"] > epoch_before and source["restarts"] == 1
    assert _worker_row(worker, killed)["blocks"] == {"GPU": 4}  # the new process's only


def test_a_killed_bridges_sources_go_down_and_come_back_when_it_restarts(worker, rig):
    instance = f"orphan-{RUN}"
    engine = rig.engine()
    bridge = rig.bridge({instance: engine})
    bridge.start()
    _wait_connected(engine)
    chain = _chain(4, 8)
    engine.store(chain[:2])
    engine.store(chain[2:4], parent=chain[1])
    known = _expected({instance: 4}, {instance: True})
    answers, waited = _wait_for(lambda: _answers(worker, chain, (instance,)), known, KNOWN_BOUND_S)
    assert answers == known, f"after {waited:.1f} s"
    epoch = _source(worker, instance)["publisher_epoch"]

    bridge.kill()
    killed_at = time.monotonic()
    down = _expected({}, {instance: False})
    answers, took = _wait_for(lambda: _answers(worker, chain, (instance,)), down, DOWN_BOUND_S + 5, since=killed_at)
    assert answers == down, f"{took:.1f} s after the bridge was killed"
    assert took <= DOWN_BOUND_S, f"the bridge's source left the answers {took:.1f} s after the bridge was killed"
    print(f"killed bridge's source out of every answer {took:.1f} s after the kill")
    engine.store(chain[4:], parent=chain[3])  # while no bridge runs: only the engine's replay buffer has it

    restarted_at = bridge.start()  # the same state file: it continues the epoch from the seq it saved
    back = _expected({instance: 8}, {instance: True})
    answers, took = _wait_for(lambda: _answers(worker, chain, (instance,)), back, KNOWN_BOUND_S + 5,
                              since=restarted_at)
    assert answers == back, f"{took:.1f} s after the bridge restarted"
    assert took <= KNOWN_BOUND_S, f"the source answered again {took:.1f} s after the bridge restarted"
    print(f"source answered again {took:.1f} s after the bridge restarted")
    source = _source(worker, instance)
    assert (source["publisher_epoch"], source["restarts"], source["stale"]) == (epoch, 0, False)
    assert engine.publisher.seq == 3


def test_a_bridge_started_after_its_engine_went_idle_knows_its_blocks_within_seconds(worker, rig):
    instance = f"early-{RUN}"
    engine = rig.engine()
    chain = _chain(5, 6)
    engine.store(chain[:3])  # before any bridge exists: only its replay buffer holds them
    engine.store(chain[3:], parent=chain[2])
    metrics_port = free_port()
    bridge = rig.bridge({instance: engine}, metrics_port=metrics_port)
    started = bridge.start()
    known = _expected({instance: 6}, {instance: True})
    answers, took = _wait_for(lambda: _answers(worker, chain, (instance,)), known, KNOWN_BOUND_S + 5, since=started)
    assert answers == known, f"{took:.1f} s after the bridge started"
    assert took <= KNOWN_BOUND_S, f"the idle engine's blocks answered {took:.1f} s after the bridge started"
    print(f"idle engine's blocks answered {took:.1f} s after the bridge started")
    # delivered by the replay on first contact, not by a live batch
    assert _bridge_metric(metrics_port, "kvstream_bridge_batches_replayed_total", instance) == 2
    assert _bridge_metric(metrics_port, "kvstream_bridge_batches_received_total", instance) == 0
    assert engine.publisher.seq == 2


def test_a_killed_engine_process_is_said_down_in_kv_events_at_once_and_heartbeats_stop_until_it_is_back(
        kafka_bootstrap, rig):
    instance = f"sigkill-{RUN}"
    ensure_topics(kafka_bootstrap, {PREFIX + KV_EVENTS: PARTITIONS})
    engine = EngineProcess()
    tail = EventsTail(kafka_bootstrap, instance)
    try:
        engine.start(batches=2)
        rig.bridge({instance: engine}).start()
        # contacted (its two batches, by the replay on connect) and vouched for by a probe's answer
        assert tail.until(lambda read: [r["event"][1] for _, r in read if r["event"][0] == SOURCE_HEARTBEAT][-1:] == [
            {"evidence": "replay"}], KNOWN_BOUND_S), tail.kinds()
        epoch = tail.read[-1][1]["publisher_epoch"]

        killed_at = engine.kill()
        assert tail.until(_of_kind(SOURCE_DISCONNECTED), DISCONNECT_BOUND_S + 5), tail.kinds()
        at, disconnect = next((at, r) for at, r in tail.read if r["event"][0] == SOURCE_DISCONNECTED)
        print(f"SourceDisconnected read from kv-events {at - killed_at:.3f} s after the SIGKILL")
        assert at - killed_at <= DISCONNECT_BOUND_S, f"read {at - killed_at:.2f} s after the kill"
        assert disconnect["event"][1] == {"reason": "disconnected"}
        assert (disconnect["publisher_epoch"], disconnect["seq"], disconnect["batch_index"]) == (epoch, 1, -1)
        assert disconnect["block_hash"] is None and disconnect["tier"] is None
        said_down = len(tail.read)

        # dead for many heartbeat intervals: nothing more of it in kv-events
        tail.until(lambda read: False, 6 * INTERVAL_S + PROBE_TIMEOUT_S)
        assert tail.kinds(said_down) == [], "kv-events has records of the engine after it was said down"

        engine.start(batches=1)  # back as a new process on the same ports: seqs from 0, a new epoch
        assert tail.until(lambda read: any(r["event"][0] == SOURCE_HEARTBEAT for _, r in read[said_down:]),
                          KNOWN_BOUND_S), tail.kinds(said_down)
        after = tail.kinds(said_down)
        assert after[0] == ("PublisherRestarted", after[0][1]) and after[0][1] > epoch, after
        assert all(e == after[0][1] for _, e in after), after  # only the new epoch speaks from then on
        assert tail.read[said_down][1]["event"] == (PUBLISHER_RESTARTED, {"previous_epoch": epoch})
    finally:
        tail.close()
        engine.close()
