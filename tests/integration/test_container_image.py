"""The project's image, run as a container: the worker of ``docker run kvstream worker`` materializes a trace
slice from the session's broker and answers its views with the simulator's ground truth, then stops cleanly on
``docker stop``.

Needs a Docker engine (testcontainers); skipped with the reason where none answers, as in CI. The image is built
from the repository's Dockerfile (layers cached by the engine); its base image must be present or pullable
(``make images-local`` builds a stand-in where no registry is reachable). The container uses the host's network,
so it reaches the session's broker on 127.0.0.1 like any other client.
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import pytest

from kafka_io.admin import ensure_topics
from kvstream.broker import free_port
from producers.kafka_sink import KvEventProducer
from producers.simulator import ClusterSimulator, FleetConfig, load_trace
from stream_apps.settings import WorkerSettings

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TAG = "kvstream:container-test"
PARTITIONS = 4


def _docker_client():
    """A client of a Docker engine that answers, else skip the test with the reason."""
    try:
        import docker

        client = docker.from_env(timeout=600)
        client.ping()
        return client
    except Exception as exc:  # noqa: BLE001 - any failure means no usable engine here
        pytest.skip(f"no Docker engine answers ({type(exc).__name__}: {exc}); the container test needs one")


def _base_image_or_skip(client) -> str:
    """The Dockerfile's base image (BASE_IMAGE, or ``KVSTREAM_TEST_BASE_IMAGE``), present locally or pulled."""
    import docker

    image = os.environ.get("KVSTREAM_TEST_BASE_IMAGE", "python:3.11-slim")
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        try:
            client.images.pull(image)
        except docker.errors.APIError as exc:
            pytest.skip(f"base image {image} is neither present nor pullable ({exc}); `make images-local` builds "
                        "a stand-in")
    return image


def _reaper_or_none(client) -> None:
    """Use testcontainers' reaper (Ryuk) where its image is present or pullable; otherwise do without it (the
    test removes its container itself), as on a machine without an image registry."""
    import docker
    from testcontainers.core.config import testcontainers_config

    if testcontainers_config.ryuk_disabled:
        return
    try:
        client.images.get(testcontainers_config.ryuk_image)
    except docker.errors.ImageNotFound:
        try:
            client.images.pull(testcontainers_config.ryuk_image)
        except docker.errors.APIError:
            testcontainers_config.ryuk_disabled = True


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return 0, {}


@pytest.fixture(scope="module")
def worker_image():
    """The project's image, built from the repository's Dockerfile (tag ``kvstream:container-test``)."""
    from testcontainers.core.image import DockerImage

    client = _docker_client()
    base = _base_image_or_skip(client)
    _reaper_or_none(client)
    # Host networking for the build: where dockerd runs with --iptables=false, build containers have no route.
    image = DockerImage(path=ROOT, tag=TAG, clean_up=False, network_mode="host", buildargs={"BASE_IMAGE": base})
    image.build()
    return TAG


def test_the_worker_image_materializes_a_slice_and_stops_cleanly(worker_image, kafka_bootstrap):
    from testcontainers.core.container import DockerContainer

    prefix = f"container{uuid.uuid4().hex[:8]}."
    settings = WorkerSettings(bootstrap_servers=kafka_bootstrap, app_id="container", topic_prefix=prefix,
                              partitions=PARTITIONS)
    names = settings.topics
    ensure_topics(kafka_bootstrap, {names.kv_events: PARTITIONS, names.dead_letter: 1})
    producer = KvEventProducer(kafka_bootstrap, names.kv_events, dead_letter_topic=names.dead_letter)
    simulator = ClusterSimulator(FleetConfig(gpu_blocks=600, cpu_blocks=900, kvcr_blocks=1200))
    for batch in simulator.run(load_trace(limit=150)):
        for index, event in enumerate(batch.events):
            producer.send_event(batch.publisher, batch.seq, batch.ts, index, event)
    producer.flush()
    truth = simulator.ground_truth()
    expected = Counter((own, tier, inst) for (inst, _, tier, own, _, _, _) in truth)

    port = free_port()
    container = (DockerContainer(worker_image, network_mode="host")
                 .with_command(["worker", "--bootstrap-servers", kafka_bootstrap, "--app-id", "container",
                                "--topic-prefix", prefix, "--partitions", str(PARTITIONS), "--web-port", str(port),
                                "--data-dir", "/data", "--store", "rocksdb://"]))
    container.start()
    url = f"http://127.0.0.1:{port}"
    wrapped = container.get_wrapped_container()
    try:
        deadline = time.monotonic() + 180
        while _get(f"{url}/ready")[0] != 200:
            wrapped.reload()
            assert wrapped.status == "running", wrapped.logs().decode()[-3000:]
            assert time.monotonic() < deadline, "worker in the container not ready:\n" + wrapped.logs().decode()[-3000:]
            time.sleep(0.5)
        while True:  # ready means recovered, not caught up: wait for the slice to be consumed
            status, body = _get(f"{url}/occupancy/")
            occupancy = {(r["ownership"], r["tier"], r["instance_id"]): r["resident_blocks"]
                         for r in body.get("occupancy", [])}
            if occupancy == expected or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert occupancy == expected
        by_block: dict[bytes, dict] = {}
        for identity, copies in truth.items():
            by_block.setdefault(identity[6], {})[identity[:6]] = copies
        for block in random.Random(15).sample(sorted(by_block), 30):
            status, body = _get(f"{url}/residency/{block.hex()}/")
            assert status == 200, body
            rows = {(r["instance_id"], r["data_parallel_rank"], r["tier"], r["ownership"], r["locality"],
                     r["group_idx"]): r["copies"] for r in body["rows"]}
            assert rows == by_block[block], block.hex()
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
            assert "kvstream_ready 1.0" in response.read().decode()

        wrapped.stop(timeout=90)  # SIGTERM to the worker (PID 1 of the container), SIGKILL after 90 s
        result = wrapped.wait(timeout=120)
        assert result["StatusCode"] == 0, wrapped.logs().decode()[-3000:]
    finally:
        container.stop()
