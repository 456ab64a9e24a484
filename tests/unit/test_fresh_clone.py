"""What a new user meets trying the README from a fresh clone (issue 28): the files it writes, the test target, the
extras, the README's own promises."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", ["truth.jsonl", "changes.parquet", "report/summary.md", "report/overview.png"])
def test_the_by_hand_outputs_are_ignored_by_git(path):
    """The README's by-hand section writes these in the working directory (``simulate --ground-truth``, ``export
    --output``, ``report``'s default ``--output-dir``)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT)
    assert result.returncode == 0, f"{path} is not in .gitignore"


def test_the_same_names_elsewhere_are_not_ignored():
    """Only the repository root's: a test fixture named so in a subdirectory stays visible."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    assert subprocess.run(["git", "check-ignore", "--no-index", "-q", "docs/truth.jsonl"], cwd=ROOT).returncode == 1


def test_make_test_shows_why_tests_were_skipped():
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    commands = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    pytest_calls = [line.split() for line in commands.splitlines() if " -m pytest" in line]
    assert pytest_calls and all("-rs" in call for call in pytest_calls), commands
