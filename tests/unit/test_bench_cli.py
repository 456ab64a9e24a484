"""``python -m bench``'s command line: what it refuses before starting a broker, and its step list."""

from __future__ import annotations

import argparse

import pytest

from bench.__main__ import build_parser, main
from bench.run import STEPS
from kvstream.options import non_negative_int, positive_float


def test_latency_without_stream_1w_is_refused_before_any_broker(tmp_path, capsys):
    # the latency step runs on stream-1w's worker: alone it used to start a broker, run nothing and exit 0
    assert main(["--only", "latency", "--work-dir", str(tmp_path / "work"), "--output-dir", str(tmp_path)]) == 1
    assert "add stream-1w to --only" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()
    assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize("argv", [["--rows-large", "-5"], ["--latency-seconds", "0"], ["--latency-seconds", "nan"]])
def test_out_of_range_sizes_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert f"argument {argv[0]}" in capsys.readouterr().err


def test_help_lists_every_step_the_only_option_takes():
    text = build_parser().format_help()
    for step in STEPS:
        assert f"\n  {step} " in text, step


def test_range_types():
    assert non_negative_int("0") == 0 and positive_float("0.5") == 0.5
    for type_, text in ((non_negative_int, "-1"), (positive_float, "-0.1"), (positive_float, "0")):
        with pytest.raises(argparse.ArgumentTypeError):
            type_(text)
