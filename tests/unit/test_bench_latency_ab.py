"""bench.latency_ab's command line, its worker options per version, its order of runs, its medians and its build, and
the bench's wait for a worker to be ready (no broker: the runs themselves are the bench's latency step, which make
bench exercises)."""

import http.server
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bench.latency_ab import (
    Version,
    build_compiled_modules,
    given_options,
    known_worker_options,
    main,
    missing_compiled_modules,
    parse_versions,
    rotation,
    summarize,
    unknown_worker_args,
    worker_argv,
)

HERE = str(Path(__file__).resolve().parents[2])  # this checkout


def _checkout(tmp_path: Path, name: str) -> Path:
    root = tmp_path / name
    (root / "kvstream").mkdir(parents=True)
    (root / "kvstream" / "__init__.py").write_text("")
    return root


def test_versions_take_their_own_environment_and_worker_options(tmp_path):
    before = _checkout(tmp_path, "before")
    versions = parse_versions([f"before={before}", f"after={HERE}"],
                              ["after:EXPERIMENT=1", "after:OTHER=a=b"], ["before:--repartition-linger-s=0.01"])
    assert [(v.name, v.checkout) for v in versions] == [("before", before), ("after", Path(HERE))]
    assert versions[0].env == {} and versions[0].worker_args == ["--repartition-linger-s=0.01"]
    assert versions[1].env == {"EXPERIMENT": "1", "OTHER": "a=b"} and versions[1].worker_args == []


@pytest.mark.parametrize(("specs", "envs", "args", "message"), [
    ([f"a={HERE}"], [], [], "at least two versions"),
    ([f"a={HERE}", f"a={HERE}"], [], [], "given twice"),
    ([f"a={HERE}", "b"], [], [], "NAME=PATH"),
    ([f"a={HERE}", "b=/"], [], [], "not a kvstream checkout"),
    ([f"a={HERE}", f"b={HERE}"], ["c:X=1"], [], "names no version"),
    ([f"a={HERE}", f"b={HERE}"], ["a:X"], [], "NAME:VAR=VALUE"),
    ([f"a={HERE}", f"b={HERE}"], [], ["a:linger=1"], "NAME:--option"),
])
def test_malformed_versions_are_refused_with_the_reason(specs, envs, args, message):
    with pytest.raises(ValueError, match=message):
        parse_versions(specs, envs, args)


def test_a_version_replaces_an_option_adds_one_and_loses_those_its_checkout_does_not_know():
    base = ["--store=memory://", "--repartition-linger-s=0.02", "--residency-changes", "--repartition-nice=10"]
    version = Version("v", Path(HERE), worker_args=["--repartition-linger-s=0.01", "--standby-replicas=1"])
    known = {"--store", "--repartition-linger-s", "--residency-changes", "--standby-replicas"}
    argv, left_out = worker_argv(base, version, known)
    assert argv == ["--store=memory://", "--residency-changes", "--repartition-linger-s=0.01", "--standby-replicas=1"]
    assert left_out == ["--repartition-nice=10"]


def test_only_the_options_the_bench_set_are_passed_so_each_checkout_keeps_its_own_defaults():
    argv = ["--bootstrap-servers=b:1", "--store=memory://", "--repartition-linger-s=0.02", "--no-residency-changes",
            "--changelog-interval-s=0.25"]
    assert given_options(argv, {"bootstrap_servers", "store", "residency_changes"}) == [
        "--bootstrap-servers=b:1", "--store=memory://", "--no-residency-changes"]


def test_a_checkouts_options_come_from_its_own_code_not_from_the_current_directory(tmp_path, monkeypatch):
    fake = _checkout(tmp_path, "fake")
    (fake / "kvstream" / "cli.py").write_text("print('usage: kvstream worker [--only-in-fake S] [--store S]')\n")
    monkeypatch.chdir(HERE)  # a real checkout, which python -m would import first without PYTHONSAFEPATH
    assert known_worker_options(fake) == {"--only-in-fake", "--store"}


def test_a_versions_own_option_that_its_checkout_does_not_know_is_named():
    versions = [Version("a", Path(HERE), worker_args=["--store=rocksdb://", "--repartition-lingr-s=0.01"]),
                Version("b", Path(HERE), worker_args=["--store=memory://"])]
    known = {"a": {"--store", "--repartition-linger-s"}, "b": {"--store"}}
    assert unknown_worker_args(versions, known) == ["a:--repartition-lingr-s=0.01"]


def test_each_round_rotates_the_order_of_the_versions():
    names = ["a", "b", "c"]
    assert [rotation(names, r) for r in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                      ["a", "b", "c"]]


def test_the_summary_gives_medians_per_version_and_the_runs_p99_in_order():
    def run(p99, worker):
        return {"p50_ms": 30.0, "p99_ms": p99, "worker_cores": worker, "broker_cores": 0.4, "idle_cores": 0.7}

    summary = summarize({"a": [run(120.0, 0.7), run(80.0, 0.6), run(100.0, 0.8)], "b": []})
    assert summary == {"a": {"p50_ms": 30.0, "p99_ms": 100.0, "worker_cores": 0.7, "broker_cores": 0.4,
                             "idle_cores": 0.7, "runs": 3, "p99_by_run": [120.0, 80.0, 100.0]}}


def test_a_checkout_without_its_built_extensions_is_named(tmp_path):
    root = _checkout(tmp_path, "old")
    (root / "schemas").mkdir()
    (root / "schemas" / "_hotpath.pyx").write_text("")
    (root / "schemas" / "_hotpath.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    (root / "stream_apps" / "index").mkdir(parents=True)
    (root / "stream_apps" / "index" / "_table.pyx").write_text("")
    assert missing_compiled_modules(root) == ["stream_apps/index/_table.pyx"]


def test_the_command_refuses_a_checkout_without_compiled_modules_before_starting_anything(tmp_path, capsys):
    root = _checkout(tmp_path, "old")
    (root / "schemas").mkdir()
    (root / "schemas" / "_hotpath.pyx").write_text("")
    assert main([f"old={root}", f"new={root}", "--work-dir", str(tmp_path / "work")]) == 1
    assert "has no compiled module for schemas/_hotpath.pyx" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_a_checkouts_modules_are_built_beside_their_sources_whatever_its_pyproject_says(tmp_path):
    pytest.importorskip("Cython", reason="Cython comes with the bench extra (pip install '.[bench]')")
    root = _checkout(tmp_path, "old")
    (root / "pyproject.toml").write_text('[project]\nname = "old"\nlicense = "not a table today\'s setuptools takes"\n')
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "_fast.pxd").write_text("cdef int answer()\n")
    (root / "pkg" / "_fast.pyx").write_text("cdef int answer():\n    return 42\n\ndef value():\n    return answer()\n")
    assert missing_compiled_modules(root) == ["pkg/_fast.pyx"]
    build_compiled_modules(root, ["pkg/_fast.pyx"])
    assert missing_compiled_modules(root) == []
    done = subprocess.run([sys.executable, "-c", "import pkg._fast as f; print(f.__file__, f.value())"],
                          capture_output=True, text=True, cwd=root, check=True)
    path, value = done.stdout.split()
    assert Path(path).parent == root / "pkg" and value == "42"


class _Readiness(http.server.BaseHTTPRequestHandler):
    """/ready answers 503 with a reason until ``ready_after`` requests were made, then 200; /ready/ is a 404 (as
    older workers answer it)."""

    requests = 0
    ready_after = 2

    def do_GET(self):  # noqa: N802 - http.server's name
        type(self).requests += 1
        if self.path != "/ready":
            status, body = 404, b"404: Not Found"
        elif type(self).requests > self.ready_after:
            status, body = 200, b'{"ready": true}'
        else:
            status, body = 503, b'{"reasons": ["recovering its tables"]}'
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def worker_stand_in():
    """A _Workers whose one worker is a live process and whose port answers as :class:`_Readiness` says."""
    from bench.harness import _Workers

    _Readiness.requests = 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Readiness)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    group = _Workers("unused:9092", "app", Path("."), processes=[process], ports=[server.server_address[1]])
    yield group
    process.kill()
    process.wait()
    server.shutdown()


def test_a_group_is_ready_once_its_worker_answers_ready_with_200(worker_stand_in):
    worker_stand_in.wait_ready(30)
    assert _Readiness.requests == 3  # two 503s, then the 200


def test_a_worker_never_ready_times_out_with_its_last_answer(worker_stand_in):
    _Readiness.ready_after = 10**6
    try:
        with pytest.raises(TimeoutError, match=r"its last answer: 503: .*recovering its tables"):
            worker_stand_in.wait_ready(1.5)
    finally:
        _Readiness.ready_after = 2
