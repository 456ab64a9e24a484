"""docs/configuration.md lists every setting of every command exactly as the code defines it, and the
precedence it documents (flag, then variable, then default) holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvstream.cli import build_parser
from kvstream.options import settings_table
from kvstream.settings import ExportSettings, QuerySettings, ReportSettings, TailSettings
from producers.settings import BridgeSettings, CaptureSettings, ProduceSettings, SimulateSettings
from stream_apps.index.settings import IndexSettings
from stream_apps.settings import WorkerSettings

COMMANDS = {"worker": WorkerSettings, "simulate": SimulateSettings, "bridge": BridgeSettings,
            "capture": CaptureSettings, "produce": ProduceSettings, "tail": TailSettings, "query": QuerySettings,
            "export": ExportSettings, "report": ReportSettings, "index": IndexSettings}

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
ROW = re.compile(r"^\| (\w+) \| `([^`]*)` \| `([^`]*)` \| `([^`]*)` \| .+ \|$")


def _documented_rows(section: str) -> list[tuple[str, str, str, str]]:
    text = DOC.read_text()
    start = text.index(f"## `{section}`")
    end = text.find("\n## ", start + 1)
    return [m.groups() for line in text[start:end].splitlines() if (m := ROW.match(line))]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_settings_table_equals_the_code(command):
    assert _documented_rows(f"kvstream {command}") == [row[:4] for row in settings_table(COMMANDS[command])]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_setting_has_its_flag(command):
    subcommands = next(a for a in build_parser()._actions if a.dest == "command").choices
    flags = {option for action in subcommands[command]._actions for option in action.option_strings}
    assert {row[1] for row in settings_table(COMMANDS[command])} <= flags


def test_list_settings_read_comma_separated_variables(monkeypatch):
    monkeypatch.setenv("KVSTREAM_ENDPOINT", "tcp://a:5557, tcp://b:5557")
    monkeypatch.setenv("KVSTREAM_INSTANCE_ID", "a,b")
    settings = BridgeSettings()
    assert settings.endpoint == ["tcp://a:5557", "tcp://b:5557"] and settings.instance_id == ["a", "b"]
    assert BridgeSettings(endpoint=["tcp://c:1"]).endpoint == ["tcp://c:1"]


def test_a_worker_spawned_with_settings_gets_exactly_them(monkeypatch):
    from kvstream.options import settings_from_args, settings_to_argv

    settings = WorkerSettings(app_id="spawned", store="memory://", aggregation="", partitions=3)
    monkeypatch.setenv("KVSTREAM_APP_ID", "stray")  # a variable in the child's environment must not win
    args = build_parser().parse_args(["worker", *settings_to_argv(settings)])
    assert settings_from_args(WorkerSettings, args) == settings


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
