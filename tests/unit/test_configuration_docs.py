"""docs/configuration.md lists every setting of ``kvstream worker`` exactly as the code defines it."""

from __future__ import annotations

import re
from pathlib import Path

from kvstream.options import settings_table
from stream_apps.settings import WorkerSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
ROW = re.compile(r"^\| (\w+) \| `([^`]*)` \| `([^`]*)` \| `([^`]*)` \| .+ \|$")


def _documented_rows(section: str) -> list[tuple[str, str, str, str]]:
    text = DOC.read_text()
    start = text.index(f"## `{section}`")
    end = text.find("\n## ", start + 1)
    return [m.groups() for line in text[start:end].splitlines() if (m := ROW.match(line))]


def test_worker_settings_table_equals_the_code():
    assert _documented_rows("kvstream worker") == [row[:4] for row in settings_table(WorkerSettings)]


def test_a_flag_beats_its_variable_which_beats_the_default(monkeypatch):
    monkeypatch.setenv("KVSTREAM_APP_ID", "from-env")
    monkeypatch.setenv("KVSTREAM_STORE", "memory://")
    assert WorkerSettings().app_id == "from-env" and WorkerSettings().store == "memory://"
    assert WorkerSettings(app_id="from-flag").app_id == "from-flag"
    monkeypatch.delenv("KVSTREAM_APP_ID")
    assert WorkerSettings().app_id == "kvstream"


def test_a_bootstrap_address_with_a_url_scheme_is_refused_with_the_accepted_form():
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="has a URL scheme; give HOST:PORT, e.g. 'broker:9092'"):
        WorkerSettings(bootstrap_servers="kafka://broker:9092")
