"""``kvstream report``'s summary (kvstream/report.py), from residency changes given in memory."""

from __future__ import annotations

import pytest

pytest.importorskip("numpy", reason="the report needs the analytics extra (numpy)")

from kvstream.export import NULL_OWNERSHIP  # noqa: E402
from kvstream.report import REPORT_COLUMNS, ChangeReplay, summarize  # noqa: E402


def _changes(*rows: tuple) -> dict[str, list]:
    return {name: [row[i] for row in rows] for i, name in enumerate(REPORT_COLUMNS)}


def test_the_occupancy_table_names_ownership_null_as_the_demo_does_and_counts_what_is_resident_at_the_end():
    replay = ChangeReplay()
    replay.add(_changes(
        (b"\x01" * 8, None, "engine-a", 0, "GPU", None, 0, True, 100.0),
        (b"\x02" * 8, None, "engine-a", 0, "GPU", None, 0, True, 101.0),
        (b"\x02" * 8, None, "engine-a", 0, "GPU", None, 0, False, 102.0),
        (b"\x03" * 8, "kvcr", "engine-a", 0, "STORAGE", None, 0, True, 103.0)))

    summary = summarize(replay, "test")

    assert f"| {NULL_OWNERSHIP} | GPU | engine-a | 1 |" in summary.text
    assert "| kvcr | STORAGE | engine-a | 1 |" in summary.text
    assert "primary" not in summary.text
    assert [(row["ownership"], row["resident_blocks"]) for row in summary.data["occupancy_as_of"]] == [
        (None, 1), ("kvcr", 1)]
