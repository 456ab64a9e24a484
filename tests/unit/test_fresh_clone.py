"""What a new user meets trying the README from a fresh clone (issue 28): the files it writes, the test target, the
extras, the README's own promises."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", ["truth.jsonl", "prompt.json", "changes.parquet", "report/summary.md",
                                  "report/overview.png"])
def test_the_by_hand_outputs_are_ignored_by_git(path):
    """The README's by-hand section writes these in the working directory (``simulate --ground-truth``, the
    prompt's tokens, ``export --output``, ``report``'s default ``--output-dir``)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT, check=False)
    assert result.returncode == 0, f"{path} is not in .gitignore"


def test_the_same_names_elsewhere_are_not_ignored():
    """Only the repository root's: a test fixture named so in a subdirectory stays visible."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "--no-index", "-q", "docs/truth.jsonl"], cwd=ROOT, check=False)
    assert ignored.returncode == 1


def test_make_test_shows_why_tests_were_skipped():
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    commands = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    pytest_calls = [line.split() for line in commands.splitlines() if " -m pytest" in line]
    assert pytest_calls and all("-rs" in call for call in pytest_calls), commands


def test_make_test_runs_the_linter_before_the_tests():
    """Ruff was configured but nothing ran it: ``make test`` runs ``make lint`` first, and the test extra that the
    CI installs pins ruff at the version installed here."""
    import tomllib
    from importlib.metadata import version

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    commands = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.splitlines()
    lint = [i for i, line in enumerate(commands) if "ruff check" in line]
    tests = [i for i, line in enumerate(commands) if " -m pytest" in line]
    assert lint and tests and lint[0] < tests[0], commands
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert f"ruff=={version('ruff')}" in extra


def test_the_analytics_extra_pins_numpy_at_the_version_installed():
    """export and report import numpy themselves; pyarrow installs without it."""
    import tomllib
    from importlib.metadata import version

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["analytics"]
    assert f"numpy=={version('numpy')}" in extra


def test_parquet_export_without_numpy_says_how_to_install_it_before_asking_kafka(monkeypatch, tmp_path):
    import sys

    from kvstream.export import ExportSource, export

    monkeypatch.setitem(sys.modules, "numpy", None)  # import numpy now raises ImportError, as when it is absent
    with pytest.raises(RuntimeError, match=r"^numpy is not installed.*pip install -e '\.\[analytics\]'"):
        # nobody listens on port 9: asking Kafka first would fail otherwise, and later
        export("127.0.0.1:9", ExportSource("changes", "kvstream-kv-residency-changes"), tmp_path / "c.parquet")
    assert not list(tmp_path.iterdir())


def test_report_without_numpy_says_how_to_install_it(monkeypatch, tmp_path):
    import sys

    from kvstream.report import report
    from kvstream.settings import ReportSettings

    monkeypatch.setitem(sys.modules, "numpy", None)
    with pytest.raises(RuntimeError, match=r"^numpy is not installed.*pip install -e '\.\[analytics\]'"):
        report(ReportSettings(bootstrap_servers="127.0.0.1:9", output_dir=tmp_path / "report"),
               str(tmp_path / "changes.parquet"))


def test_a_module_missing_under_another_is_named_with_it(monkeypatch, tmp_path):
    """matplotlib without numpy fails to import with numpy's name: that is the one to report."""
    import sys

    from kvstream.export import require_analytics

    (tmp_path / "kvstream_needs_numpy.py").write_text("import numpy\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "numpy", None)
    with pytest.raises(RuntimeError, match=r"^numpy is not installed \(needed by kvstream_needs_numpy\)"):
        require_analytics("kvstream_needs_numpy")


@pytest.mark.parametrize("level, tables_shown", [("info", False), ("warning", False), ("debug", True)])
def test_fausts_recovery_tables_are_logged_only_at_debug(level, tables_shown, capsys):
    """A worker's foreground output was mostly Faust's recovery tables (INFO, at every rebalance). Its one-line
    records stay: make chaos and make bench wait for 'Worker ready' and 'Recovery complete' in the logs."""
    import logging
    import logging.config

    from kafka_io.logs import logging_config

    root = logging.getLogger()
    saved = root.level, root.handlers[:]
    recovery = logging.getLogger("faust.tables.recovery")
    try:
        logging.config.dictConfig(logging_config("info", "text"))  # as a process configured twice: the last wins
        logging.config.dictConfig(logging_config(level, "text"))
        recovery.info("Highwater for active changelog partitions:\n%s", "+-topic-+\n| t 0 |\n+-------+")
        recovery.info("Worker ready")
        recovery.warning("a warning\nof two lines")
        logging.getLogger("stream_apps.other").info("a record\nof two lines, of another logger")
        err = capsys.readouterr().err
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
    assert ("Highwater" in err) is tables_shown and ("| t 0 |" in err) is tables_shown
    assert ("Worker ready" in err) is (level != "warning") and "a warning\nof two lines" in err
    assert ("of another logger" in err) is (level != "warning")


def test_the_demos_occupancy_table_names_ownership_null_as_the_json_does(capsys):
    """It said 'primary' where the JSON says "ownership": null; the README's sample shows the table."""
    from kvstream.demo import _print_occupancy

    _print_occupancy([{"ownership": None, "tier": "GPU", "instance_id": "sim-0", "resident_blocks": 4096},
                      {"ownership": "kvcr", "tier": "STORAGE", "instance_id": "sim-0", "resident_blocks": 16384}])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].split() == ["null", "(framework)", "GPU", "sim-0", "4,096"]
    assert lines[-1].split() == ["kvcr", "STORAGE", "sim-0", "16,384"]
    assert "primary" not in "\n".join(lines)
    readme = (ROOT / "README.md").read_text()
    for line in lines[-3:]:  # the header and the rows, up to the measured figures
        assert line.rsplit(maxsplit=1)[0] in readme, line


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) < 250


def test_the_readmes_by_hand_section_waits_for_the_workers_before_the_occupancy():
    """Issue 28: right after simulate, query occupancy answered partial figures."""
    readme = (ROOT / "README.md").read_text()
    by_hand = readme[readme.index("Running the pieces by hand"):readme.index("Against a live vLLM engine")]
    assert "kvstream query occupancy --wait-caught-up" in by_hand and "caught_up" in by_hand


def test_the_readmes_by_hand_section_keeps_the_replayed_sources_and_the_terminal_quiet():
    """Issue 28: the workers' output flooded the terminal the steps are typed in; and with the default 30 s lease
    the simulated sources, silent once simulate ends, left every lookup half a minute later (and were cleared ten
    minutes after that), so the steps after simulate answered empty."""
    readme = (ROOT / "README.md").read_text()
    by_hand = readme[readme.index("Running the pieces by hand"):readme.index("Against a live vLLM engine")]
    steps = by_hand[by_hand.index("```sh"):by_hand.index("```", by_hand.index("```sh") + 5)].splitlines()
    lease = next(i for i, line in enumerate(steps) if line.startswith("export KVSTREAM_SOURCE_LEASE_S="))
    assert int(steps[lease].split("=")[1].split()[0]) >= 86400
    background = [(i, line) for i, line in enumerate(steps) if line.split("#")[0].rstrip().endswith("&")]
    assert len(background) == 3  # the two workers and the index: `kill %1 %2 %3` stops them
    for i, line in background:
        assert i > lease and "> .kvstream/" in line and "2>&1" in line, line
    assert "lag_s" in by_hand and "arrival_lag_s" in by_hand  # what lag_s means on replayed data
    assert "prompt.json" in next(line for line in steps if line.startswith("python -c"))


def test_every_package_of_the_product_is_in_the_wheel():
    """pyproject.toml lists the packages by name: one left out installs from a checkout (editable) but is missing
    from a wheel, and so from the image (Dockerfile: pip install of the wheel)."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(root).parts)
             for top in ("kvstream", "kafka_io", "schemas", "producers", "stream_apps")
             for init in (root / top).rglob("__init__.py")}
    assert found - listed == set()


def test_every_worker_view_answers_with_and_without_its_trailing_slash():
    """Issue 28: ``GET /residency/<hash>`` without its slash was a bare plain-text 404; so were ``/occupancy``,
    ``/sources`` and ``/stats``. The route table is read from a stub app: no worker needed."""
    from types import SimpleNamespace

    from stream_apps.views import WorkerViews

    paths = []

    class App:
        def page(self, path):
            paths.append(path)
            return lambda view: view

        def table_route(self, table, match_info):
            return lambda view: view

    views = WorkerViews.__new__(WorkerViews)
    views.app, views.tables = App(), SimpleNamespace(residency=None)
    from stream_apps.index.observe import ReadPathMetrics

    views.metrics = SimpleNamespace(http_requests={}, read_path=ReadPathMetrics())
    views.api = SimpleNamespace(prefix_match=None, query=None, query_by_hash=None, register=None, unregister=None,
                                services=None, global_view=None)
    views.register()
    public = [p for p in paths if not p.startswith("/residency-key/")]
    for documented in ("/residency/{block_hash_hex}/", "/occupancy/", "/sources/", "/stats/", "/prefix-match/",
                       "/workers", "/query", "/health", "/ready", "/metrics"):
        assert documented in public
    assert {p.rstrip("/") for p in public} == {p.rstrip("/") for p in public if not p.endswith("/")}
    assert len(public) == 2 * len({p.rstrip("/") for p in public})  # each once with, once without
