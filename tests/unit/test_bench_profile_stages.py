"""``python -m bench.profile_stages`` over a few trace requests: the stand-in stores still satisfy every method
of the worker's store classes that the materializing path calls (a new attribute of theirs once broke it
at the first checkpoint)."""

import json

from bench import profile_stages


def test_profile_stages_runs_both_stores_through_checkpoints(tmp_path, capsys):
    out = tmp_path / "stages.json"
    assert profile_stages.main(["--requests", "40", "--store", "both", "--producer", "fake",
                                "--commit-every", "2", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["events"] > 0
    for store in ("memory", "rocksdb"):
        timed, plain = figures["stores"][store]["timed"], figures["stores"][store]["plain"]
        # every event of the input reached the materializing loop, in both passes
        assert timed["items"] == plain["items"] == figures["events"]
        assert timed["timers"]["residency rules (apply_block)"]["calls"] > 0
        assert figures["stores"][store]["us_per_event"]["stage 2 total"] > 0
    assert "stage 2 total" in capsys.readouterr().out
