"""``make compose-test``: bring docker-compose.yml up as a user would and check every worker against the truth.

Steps: build the project's image with ``docker compose build``; ``docker compose up`` the broker, the registry
and 3 workers while the simulator (``docker compose run simulate``) replays a slice of the Mooncake trace and
writes its ground truth; wait for every worker's ``/ready`` (printing each one's time to ready); check that every
worker runs the compiled hot path (``kvstream_hotpath_info{implementation="compiled"}`` on ``/metrics``: the image
must not have fallen back to pure Python); check every worker's ``/occupancy/`` and a sample of
``/residency/{hash}/`` lookups against the ground truth; scale to 2 workers; wait until both survivors have
rebalanced and are ready; check again; ``docker compose down -v``.

It installs nothing. Without Docker, a running engine, or Compose v2, it says what is missing, prints a
SKIPPED line and exits 0. Exit code 1 if any check fails. Standard library only, so it runs on any Python 3.8+.
The compose project is ``kvstream-compose-test``, with free host ports, so it leaves a user's ``kvstream``
project alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "kvstream-compose-test"
WEB_PORT = 6066


def say(line: str) -> None:
    """Print one progress line of the run."""
    print(f"[compose-test] {line}", flush=True)


def missing_tools() -> list[str]:
    """What is missing to run the test: the docker CLI, a running engine, Compose v2; empty if nothing."""
    if shutil.which("docker") is None:
        return ["the docker command is not installed (Debian: apt-get install docker.io)"]
    missing = []
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
    if info.returncode != 0:
        missing.append("the Docker engine does not answer (start it, e.g. dockerd --iptables=false "
                       "--storage-driver=vfs &)")
    version = subprocess.run(["docker", "compose", "version", "--short"], capture_output=True, text=True)
    if version.returncode != 0:
        missing.append("Docker Compose v2 is not installed (the docker-compose CLI plugin; docs/deployment.md, "
                       "\"Docker on a machine without a registry\")")
    return missing


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Compose:
    """``docker compose`` on the project's compose file, as project :data:`PROJECT`."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env, self.log_dir = env, log_dir
        self.base = ["docker", "compose", "--project-name", PROJECT, "--project-directory", str(ROOT),
                     "--file", str(ROOT / "docker-compose.yml")]

    def run(self, *args: str, check: bool = True, capture: bool = False, log: str | None = None):
        """Run ``docker compose ARGS``; output to the terminal, or captured, or into ``log_dir/log``."""
        if log:
            with open(self.log_dir / log, "a") as out:
                proc = subprocess.run([*self.base, *args], env=self.env, stdout=out, stderr=subprocess.STDOUT)
        else:
            proc = subprocess.run([*self.base, *args], env=self.env, capture_output=capture, text=True)
        if check and proc.returncode != 0:
            where = f"; see {self.log_dir / log}" if log else ""
            raise RuntimeError(f"docker compose {' '.join(args)} failed with exit code {proc.returncode}{where}"
                               + (f":\n{proc.stderr}" if capture else ""))
        return proc

    def popen(self, *args: str, log: str) -> subprocess.Popen:
        """Start ``docker compose ARGS`` in the background, its output into ``log_dir/log``."""
        out = open(self.log_dir / log, "a")
        return subprocess.Popen([*self.base, *args], env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def worker_url(self, index: int) -> str | None:
        """``http://127.0.0.1:PORT`` of worker replica ``index`` (1-based), or None if it has no port yet."""
        proc = self.run("port", "--index", str(index), "worker", str(WEB_PORT), check=False, capture=True)
        match = re.search(r":(\d+)\s*$", proc.stdout.strip()) if proc.returncode == 0 else None
        # a replica still starting may report port 0: no port yet, not a port to remember
        return f"http://127.0.0.1:{match.group(1)}" if match and match.group(1) != "0" else None

    def worker_volumes(self) -> set[str]:
        """Names of the volumes on ``/data`` of the running worker replicas (their anonymous state volumes)."""
        names = self.worker_names()
        if not names:
            return set()
        proc = subprocess.run(["docker", "inspect", "--format",
                               '{{range .Mounts}}{{if eq .Destination "/data"}}{{.Name}}{{end}}{{end}}', *names],
                              capture_output=True, text=True)
        return {line.strip() for line in proc.stdout.splitlines() if line.strip()}

    def worker_names(self) -> list[str]:
        """Container names of the running worker replicas, by replica number."""
        proc = self.run("ps", "--format", "{{.Name}}", "worker", capture=True)
        return sorted(proc.stdout.split(), key=lambda name: int(name.rsplit("-", 1)[-1]))


def http_json(url: str, timeout: float = 30) -> tuple[int, dict]:
    """GET ``url``: (status, JSON body); (0, {}) if nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read())
        except ValueError:
            return exc.code, {}
    except (OSError, ValueError):
        return 0, {}


def rebalances(url: str) -> float | None:
    """The worker's ``kvstream_rebalances_total`` from ``/metrics``, or None if it does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
            text = response.read().decode()
    except OSError:
        return None
    match = re.search(r"^kvstream_rebalances_total\s+([0-9.e+]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def hotpath_implementation(url: str) -> str | None:
    """The ``implementation`` label of the worker's ``kvstream_hotpath_info`` on ``/metrics`` ("compiled",
    "python" or "partial"); "" if the metric is missing; None if the worker does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
            text = response.read().decode()
    except OSError:
        return None
    match = re.search(r'^kvstream_hotpath_info\{[^}]*implementation="([^"]*)"[^}]*\}\s+1(\.0)?$', text, re.MULTILINE)
    return match.group(1) if match else ""


def check_hotpath(checks: Checks, urls: dict[int, str]) -> None:
    """Check that every worker runs the compiled hot path, as the image is built to (Dockerfile)."""
    for index, url in sorted(urls.items()):
        implementation = hotpath_implementation(url)
        if implementation == "compiled":
            detail = 'kvstream_hotpath_info{implementation="compiled"}'
        elif implementation is None:
            detail = "/metrics did not answer"
        elif not implementation:
            detail = "no kvstream_hotpath_info on /metrics (an image built from older sources?)"
        else:
            detail = (f'kvstream_hotpath_info{{implementation="{implementation}"}}: the image runs pure Python '
                      "for some or all of the hot path; its log says which (\"hot path: ...\"); build.log shows "
                      "whether the compiled modules were built")
        checks.record(f"worker {index} runs the compiled hot path", implementation == "compiled", detail)


def wait_ready(compose: Compose, replicas: int, since: float, timeout_s: float,
               rebalanced_after: dict[int, float] | None = None) -> dict[int, str]:
    """Wait until replicas 1..``replicas`` answer ``/ready`` with 200 (and, if given, have received a partition
    assignment since the counts in ``rebalanced_after``); print each one's time since ``since``. Returns their
    URLs by replica number."""
    deadline = time.monotonic() + timeout_s
    urls: dict[int, str] = {}
    pending = set(range(1, replicas + 1))
    while pending:
        for index in sorted(pending):
            url = urls.get(index) or compose.worker_url(index)
            if url is None:
                continue
            urls[index] = url
            if rebalanced_after is not None:
                count = rebalances(url)
                if count is None or count <= rebalanced_after[index]:
                    continue
            status, body = http_json(f"{url}/ready", timeout=5)
            if status == 200:
                pending.discard(index)
                say(f"worker {index} ({url}) ready after {time.monotonic() - since:.1f} s")
            else:
                urls.pop(index)  # asked again next time: a replica recreated while starting has a new port
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"workers {sorted(pending)} not ready after {timeout_s:.0f} s")
        time.sleep(0.5)
    return urls


def load_truth(path: Path) -> dict[tuple, int]:
    """The simulator's ground truth file: (instance, dp rank, tier, ownership, locality, group, hash hex) -> copies."""
    truth = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            truth[(r["instance_id"], r["data_parallel_rank"], r["tier"], r["ownership"], r["locality"],
                   r["group_idx"], r["block_hash"])] = r["copies"]
    return truth


class Checks:
    """The checks of one run, each printed as it completes."""

    def __init__(self) -> None:
        self.results: list[tuple[str, bool]] = []

    def record(self, name: str, passed: bool, detail: str) -> None:
        """Record and print one check's result."""
        self.results.append((name, passed))
        say(f"check {'PASS' if passed else 'FAIL'}: {name}: {detail}")

    @property
    def passed(self) -> bool:
        """True if at least one check ran and none failed."""
        return bool(self.results) and all(passed for _, passed in self.results)


def occupancy(url: str) -> dict[tuple, int] | None:
    """A worker's ``/occupancy/`` as (ownership, tier, instance) -> resident blocks, or None if not answered."""
    status, body = http_json(f"{url}/occupancy/")
    if status != 200:
        return None
    return {(r["ownership"], r["tier"], r["instance_id"]): r["resident_blocks"] for r in body["occupancy"]}


def residency(url: str, block_hex: str) -> tuple[int, dict[tuple, int]]:
    """A block's rows as a router asks for them, a 503 retried for up to 30 s: (status, identity -> copies)."""
    deadline = time.monotonic() + 30
    status, body = http_json(f"{url}/residency/{block_hex}/")
    while status in (0, 503) and time.monotonic() < deadline:
        time.sleep(0.5)
        status, body = http_json(f"{url}/residency/{block_hex}/")
    rows = {(r["instance_id"], r["data_parallel_rank"], r["tier"], r["ownership"], r["locality"], r["group_idx"]):
            r["copies"] for r in body.get("rows", [])} if status == 200 else {}
    return status, rows


def check_workers(checks: Checks, stage: str, urls: dict[int, str], truth: dict[tuple, int], sample: int,
                  settle_s: float) -> None:
    """Every worker's occupancy equals the truth's per (ownership, tier, instance) counts (waiting up to
    ``settle_s`` for the workers to consume everything), and a seeded sample of resident blocks plus some absent
    hashes answer ``/residency/`` with exactly the truth's rows."""
    expected = Counter((own, tier, inst) for (inst, _, tier, own, _, _, _) in truth)
    by_block: dict[str, dict[tuple, int]] = {}
    for identity, copies in truth.items():
        by_block.setdefault(identity[6], {})[identity[:6]] = copies
    rng = random.Random(15)
    blocks = rng.sample(sorted(by_block), min(sample, len(by_block)))
    absent = [f"{rng.getrandbits(64):016x}" for _ in range(20)]
    absent = [h for h in absent if h not in by_block]

    deadline = time.monotonic() + settle_s
    while True:
        answers = {index: occupancy(url) for index, url in urls.items()}
        if all(a == expected for a in answers.values()) or time.monotonic() > deadline:
            break
        time.sleep(1)
    for index, answer in sorted(answers.items()):
        total = sum(answer.values()) if answer else None
        detail = (f"{total:,} resident blocks in {len(answer)} (ownership, tier, instance) groups, "
                  f"truth {sum(expected.values()):,} in {len(expected)}")
        if answer is not None and answer != expected:
            diff = sorted(k for k in set(answer) | set(expected) if answer.get(k) != expected.get(k))[:5]
            detail += "; differs at " + ", ".join(f"{k}: {answer.get(k)} vs {expected.get(k)}" for k in diff)
        checks.record(f"{stage}: worker {index} /occupancy/ equals the ground truth", answer == expected,
                      detail if answer is not None else "no answer")
    for index, url in sorted(urls.items()):
        wrong = []
        for block in blocks + absent:
            status, rows = residency(url, block)
            if status != 200 or rows != by_block.get(block, {}):
                wrong.append(f"{block} (HTTP {status})")
        checks.record(f"{stage}: worker {index} /residency/ equals the ground truth", not wrong,
                      f"{len(blocks) + len(absent) - len(wrong)} of {len(blocks) + len(absent)} lookups "
                      f"({len(blocks)} resident blocks, {len(absent)} absent hashes)"
                      + (f"; wrong: {', '.join(wrong[:5])}" if wrong else ""))


def _post(url: str, body: dict, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def check_unregister_needs_the_token(checks: Checks, url: str, token: str) -> None:
    """``POST /unregister`` of a live instance: refused (401) without the token and with a wrong one (403), the
    instance still answered; with the token it is unregistered (docs/security.md, "HTTP views")."""
    status, answer = http_json(f"{url}/workers")
    instances = sorted({w["instance_id"] for w in answer.get("workers", []) if w.get("blocks")})
    if not instances:
        checks.record("unauthenticated unregistration refused", False, f"no instance to unregister ({status})")
        return
    body = {"instance_id": instances[0], "dp_rank": 0}
    anonymous, wrong = _post(f"{url}/unregister", body), _post(f"{url}/unregister", body, "not-the-token")
    still = instances[0] in {w["instance_id"] for w in http_json(f"{url}/workers")[1].get("workers", [])}
    checks.record("unauthenticated unregistration refused", anonymous[0] == 401 and wrong[0] == 403 and still,
                  f"no token: {anonymous[0]} {anonymous[1].get('reason')}; wrong token: {wrong[0]} "
                  f"{wrong[1].get('reason')}; {instances[0]} still answered: {still}")
    allowed = _post(f"{url}/unregister", body, token)
    checks.record("authenticated unregistration works", allowed[0] == 200,
                  f"{allowed[0]} {allowed[1].get('status') or allowed[1].get('error')}")


def image_note(env: dict[str, str]) -> None:
    """Say which base images are stand-ins built by ``make images-local``."""
    for variable, default in (("PYTHON_IMAGE", "python:3.11-slim"), ("KAFKA_IMAGE", "apache/kafka:4.1.2"),
                              ("REGISTRY_IMAGE", "apicurio/apicurio-registry-mem:2.6.13.Final")):
        image = env.get(variable, default)
        proc = subprocess.run(["docker", "image", "inspect", "--format",
                               '{{index .Config.Labels "org.kvstream.stand-in"}}', image],
                              capture_output=True, text=True)
        label = proc.stdout.strip() if proc.returncode == 0 else ""
        kind = ("not present locally (pulled on first use)" if proc.returncode != 0
                else "stand-in of make images-local" if label and label != "<no value>" else "as pulled")
        say(f"{variable}={image}: {kind}")


class _Stop(Exception):
    """Ends the run after a failed check that the later steps depend on."""


def run(args: argparse.Namespace) -> int:
    """The whole test; returns the exit code."""
    work = Path(tempfile.mkdtemp(prefix="kvstream-compose-test-"))
    truth_dir = work / "truth"
    truth_dir.mkdir()
    truth_dir.chmod(0o777)  # the image's user (uid 10001) writes the ground truth here
    # Host networking for the image build: with dockerd --iptables=false, build containers have no route out.
    token = secrets.token_urlsafe(32)
    token_file = work / "api-token"
    token_file.write_text(f"compose-test {token}\n")
    token_file.chmod(0o644)  # bind-mounted as the secret: the image's user (uid 10001) reads it
    env = {"BUILD_NETWORK": "host", **os.environ, "KAFKA_HOST_PORT": str(free_port()),
           "REGISTRY_HOST_PORT": str(free_port()), "KVSTREAM_API_TOKEN_HOST_FILE": str(token_file)}
    compose = Compose(env, work)
    checks = Checks()
    volumes: set[str] = set()
    say(f"logs in {work}")
    image_note(env)
    started = time.monotonic()
    try:
        say("docker compose build worker")
        t = time.monotonic()
        compose.run("build", "worker", log="build.log")
        say(f"image {env.get('KVSTREAM_IMAGE', 'kvstream:latest')} built in {time.monotonic() - t:.1f} s")

        say(f"docker compose up -d --scale worker={args.workers} kafka registry worker, "
            f"and docker compose run simulate (--requests {args.requests})")
        up_at = time.monotonic()
        compose.run("up", "--detach", "--no-build", "--scale", f"worker={args.workers}", "kafka", "registry",
                    "worker", log="up.log")
        simulate = compose.popen("run", "--rm", "--volume", f"{truth_dir}:/truth", "simulate",
                                 "simulate", "--requests", str(args.requests), "--ground-truth",
                                 "/truth/truth.jsonl", log="simulate.log")
        say(f"compose up returned after {time.monotonic() - up_at:.1f} s (broker and registry healthy)")
        urls = wait_ready(compose, args.workers, up_at, args.timeout)
        say("workers: " + ", ".join(compose.worker_names()))
        volumes |= compose.worker_volumes()
        check_hotpath(checks, urls)
        try:
            code = simulate.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            simulate.kill()
            raise RuntimeError(f"the simulator did not finish within {args.timeout:.0f} s") from None
        summary = [line for line in (work / "simulate.log").read_text().splitlines()
                   if "events/s" in line or "ground truth" in line]
        checks.record("simulator ran and wrote its ground truth", code == 0 and (truth_dir / "truth.jsonl").exists(),
                      f"exit code {code}; " + "; ".join(s.strip() for s in summary))
        if code != 0:
            raise _Stop
        truth = load_truth(truth_dir / "truth.jsonl")
        check_workers(checks, f"{args.workers} workers", urls, truth, args.sample, args.timeout)

        before = {index: rebalances(url) or 0.0 for index, url in urls.items() if index <= args.scale_to}
        say(f"docker compose up -d --scale worker={args.scale_to} worker")
        scaled_at = time.monotonic()
        compose.run("up", "--detach", "--no-build", "--no-recreate", "--scale", f"worker={args.scale_to}", "worker",
                    log="up.log")
        say(f"scaled to {args.scale_to} workers in {time.monotonic() - scaled_at:.1f} s; waiting for the survivors "
            "to rebalance")
        urls = wait_ready(compose, args.scale_to, scaled_at, args.timeout, rebalanced_after=before)
        say("workers: " + ", ".join(compose.worker_names()))
        check_workers(checks, f"{args.scale_to} workers", urls, truth, args.sample, args.timeout)
        check_unregister_needs_the_token(checks, next(iter(urls.values())), token)
    except _Stop:  # a failed check made the rest meaningless; it is reported already
        pass
    except Exception as exc:  # noqa: BLE001 - reported as a failed check, then the stack is taken down
        checks.record("run", False, str(exc))
        compose.run("logs", "--no-color", "--tail", "40", log="failure-logs.log", check=False)
        say(f"last container logs in {work / 'failure-logs.log'}")
    finally:
        if args.keep:
            say(f"--keep: the stack stays up (docker compose --project-name {PROJECT} down -v)")
        else:
            compose.run("down", "--volumes", "--remove-orphans", "--timeout", "90", log="down.log", check=False)
            # `down -v` removes the volumes of the containers it removes; a replica removed by scaling in
            # leaves its anonymous volume behind.
            left = [v for v in sorted(volumes) if subprocess.run(["docker", "volume", "rm", v],
                                                                 capture_output=True).returncode == 0]
            say("docker compose down -v: done" + (f"; removed {len(left)} volume(s) of scaled-in workers" if left
                                                   else ""))
    failed = [name for name, passed in checks.results if not passed]
    say(f"{len(checks.results) - len(failed)} of {len(checks.results)} checks passed in "
        f"{time.monotonic() - started:.0f} s: {'PASSED' if checks.passed else 'FAILED'}")
    return 0 if checks.passed else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``make compose-test`` (``python deploy/compose_test.py``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="trace requests the simulator replays")
    parser.add_argument("--workers", type=int, default=3, help="worker replicas to start with")
    parser.add_argument("--scale-to", type=int, default=2, help="worker replicas after scaling in")
    parser.add_argument("--sample", type=int, default=200, help="resident blocks looked up on every worker")
    parser.add_argument("--timeout", type=float, default=600, help="longest single wait, seconds")
    parser.add_argument("--keep", action="store_true", help="leave the stack up at the end")
    args = parser.parse_args(argv)
    missing = missing_tools()
    if missing:
        for line in missing:
            say(f"missing: {line}")
        say("SKIPPED: Docker or Docker Compose is not available here")
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
