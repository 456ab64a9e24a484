"""`kvstream bridge --follow-registrations` through the real broker: a registration in `kv-instances` subscribes the
bridge to its engine (a vLLM-protocol publisher double, harness/vllm_publisher.py), whose batches reach `kv-events`
under the registered instance id; the registration's tombstone unsubscribes it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from harness.vllm_publisher import BlockStored, FakeVllmPublisher
from kafka_io.reader import messages_to_end
from kvstream.broker import free_ports
from schemas import AvroCodec
from schemas.topics import TopicNames
from stream_apps.index.fleet_index import SourceInfo
from stream_apps.index.registrations import RegistrationWriter

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60.0


def _stored(h: int) -> BlockStored:
    return BlockStored([h], None, [1, 2, 3, 4], 4, None, "GPU", None, group_idx=0)


def _engine(instance: str) -> tuple[FakeVllmPublisher, SourceInfo]:
    port, replay_port = free_ports(2)
    publisher = FakeVllmPublisher(port, replay_port)
    return publisher, SourceInfo(instance, model_name="llama", block_size=4, endpoint=f"tcp://127.0.0.1:{port}",
                                 replay_endpoint=f"tcp://127.0.0.1:{replay_port}", engine_type="vLLM",
                                 dp_ranks={0})


def _blocks(bootstrap: str, topic: str) -> dict[int, list[dict]]:
    """Block hash (as an integer) -> the block records of ``topic`` with it, as of now."""
    codec = AvroCodec("kv_event")
    found: dict[int, list[dict]] = {}
    for message in messages_to_end(bootstrap, topic, 30):
        record = codec.decode(message.value())
        if record["block_hash"] is not None:
            found.setdefault(int.from_bytes(record["block_hash"], "big"), []).append(record)
    return found


def _wait(what: str, done, bridge: subprocess.Popen, log: Path, timeout_s: float = TIMEOUT_S):
    """Poll ``done()`` until it gives something true; fail with the bridge's log if it does not in time."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = done()
        if result:
            return result
        if bridge.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:.0f} s (bridge exit code {bridge.poll()}); its log:\n"
                        + log.read_text()[-4000:])
        time.sleep(0.2)


@pytest.mark.integration
def test_a_registration_subscribes_the_bridge_and_its_tombstone_unsubscribes_it(kafka_bootstrap, tmp_path):
    prefix = f"bridge-registrations-test-{uuid.uuid4().hex[:8]}."
    topics = TopicNames(prefix=prefix)
    engine_a, registration_a = _engine("engine-a")
    engine_b, registration_b = _engine("engine-b")  # stays registered: shows how far the bridge has got
    writer = RegistrationWriter(kafka_bootstrap, topics.instances)
    log = tmp_path / "bridge.log"
    bridge = None
    try:
        writer.write(registration_a)
        writer.write(registration_b)
        with open(log, "w") as out:
            bridge = subprocess.Popen(
                [sys.executable, "-m", "kvstream.cli", "bridge", "--follow-registrations",
                 f"--bootstrap-servers={kafka_bootstrap}", f"--topic-prefix={prefix}", "--partitions=2",
                 f"--state-file={tmp_path / 'bridge-state.json'}", "--heartbeat-interval-s=1"],
                stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for h in (1, 2, 3):
            engine_a.publish([_stored(h)])  # live, or from the replay buffer once the bridge connects
        engine_b.publish([_stored(0x100)])

        blocks = _wait("engine-a's batches in kv-events",
                       lambda: (found := _blocks(kafka_bootstrap, topics.kv_events)).keys() >= {1, 2, 3, 0x100}
                       and found, bridge, log)
        assert {r["instance_id"] for h in (1, 2, 3) for r in blocks[h]} == {"engine-a"}
        assert sorted(r["seq"] for h in (1, 2, 3) for r in blocks[h]) == [0, 1, 2]
        assert {r["instance_id"] for r in blocks[0x100]} == {"engine-b"}
        text = log.read_text()
        assert (f"subscribed to {registration_a.endpoint} (replay: {registration_a.replay_endpoint}) as "
                f"engine-a/dp0: registered instance engine-a") in text

        writer.remove("engine-a")
        _wait("the bridge unsubscribing engine-a",
              lambda: f"unsubscribed from {registration_a.endpoint} as engine-a/dp0: instance engine-a unregistered"
              in log.read_text(), bridge, log)
        after = engine_a.seq
        for h in (0x200, 0x201, 0x202):
            engine_a.publish([_stored(h)])
        engine_b.publish([_stored(0x300)])  # published after engine-a's: forwarded, while those are not
        blocks = _wait("engine-b's batch after the tombstone",
                       lambda: (found := _blocks(kafka_bootstrap, topics.kv_events)).get(0x300) and found,
                       bridge, log)
        assert not blocks.keys() & {0x200, 0x201, 0x202}
        assert not [r for records in blocks.values() for r in records
                    if r["instance_id"] == "engine-a" and r["seq"] >= after]
    finally:
        if bridge is not None and bridge.poll() is None:
            bridge.send_signal(signal.SIGTERM)
            try:
                bridge.wait(20)
            except subprocess.TimeoutExpired:
                bridge.kill()
                bridge.wait(10)
        engine_a.close()
        engine_b.close()
    assert bridge.returncode == 0, log.read_text()[-4000:]
    assert "produced" in log.read_text()
