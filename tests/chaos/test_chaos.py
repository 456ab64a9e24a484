"""The fault scenarios of ``make chaos`` (chaos/scenarios.py), short: 3 worker crashes, one run of each other.

The stream app reads the fixed topic ``kv-events``, so these tests cannot share the session broker with
test_pipeline.py: like ``make chaos``, every run starts its own embedded broker (fresh data dir, free
port) and stops it at the end. A smaller trace slice than the default keeps the module within a few
minutes on a 2-core machine. Each run must end with the residency table equal to the ground truth, and
its scenario checks (see each run's ``checks``) must hold.
"""

from __future__ import annotations

import json

import pytest

from chaos.scenarios import Chaos, ChaosOptions, compare_residency, naive_residency, simulate_workload
from producers.simulator import FleetConfig

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def chaos(tmp_path_factory) -> Chaos:
    work = tmp_path_factory.mktemp("chaos")
    options = ChaosOptions(requests=150, work_dir=work, output=None, outage_s=10.0, timeout_s=240.0, live_s=4.0)
    runner = Chaos(options, log=print)
    runner.work.mkdir(parents=True, exist_ok=True)
    return runner


def _assert_passed(entry: dict, chaos: Chaos, name: str) -> None:
    """Print the run's entry, keep it as ``<work dir>/<name>.json``, and assert it passed."""
    text = json.dumps({k: v for k, v in entry.items() if k != "traceback"}, indent=1, default=str)
    print(text)
    (chaos.work / f"{name}.json").write_text(text)
    assert "error" not in entry, entry.get("traceback")
    assert entry["matches_truth"], entry["differences"]
    assert entry["events_lost"] == 0 and entry["duplicates_applied"] == 0
    assert all(entry["checks"].values()), entry["checks"]


def test_row_classification_names_each_kind_of_difference():
    row = ("e", 0, "GPU", None, None, 0)
    truth = {(*row, b"\x01"): 1, (*row, b"\x02"): 2, (*row, b"\x03"): 1, (*row, b"\x05"): 1}
    actual = {(*row, b"\x01"): 1, (*row, b"\x02"): 1, (*row, b"\x03"): 2, (*row, b"\x04"): 1}
    check = compare_residency(truth, actual)
    assert (check.matching, check.missing, check.extra, check.below, check.above) == (1, 1, 1, 1, 1)
    assert (check.lost, check.duplicated, check.matches) == (2, 2, False)


def test_naive_replay_of_a_one_instance_fleet_equals_the_simulators_truth():
    from producers.simulator import ClusterSimulator, load_trace

    sim = ClusterSimulator(FleetConfig(instances=1, tp_instances=(), clear_instance=0, gpu_blocks=600,
                                       cpu_blocks=900, kvcr_blocks=1200))
    batches = list(sim.run(load_trace(limit=300)))
    assert naive_residency(batches) == sim.ground_truth()
    assert simulate_workload(20, FleetConfig(), 4).messages > 0


@pytest.mark.parametrize("run", [0, 1, 2])
def test_worker_crash_at_a_random_moment(chaos, run):
    """Runs alternate rocksdb:// (even) and memory:// (odd) stores; kill moments are seeded per run."""
    _assert_passed(chaos.crash(run), chaos, f"crash-{run}")


@pytest.mark.parametrize("run", [0, 1], ids=["no-standbys", "one-standby"])
def test_rebalance_keeps_lookups_answered_and_every_view_exact(chaos, run):
    entry = chaos.rebalance(run)
    _assert_passed(entry, chaos, "rebalance")
    assert entry["standby_replicas"] == run and entry["views"]["occupancy_equal"]
    assert entry["queries"]["answered"] > 0


def test_broker_outage_loses_and_duplicates_nothing(chaos):
    entry = chaos.broker_outage(0)
    _assert_passed(entry, chaos, "broker-outage")
    assert entry["records_sent_during_outage"] > 0


def test_bridge_restart_recovers_what_the_replay_buffer_holds_and_reports_the_rest(chaos):
    """Run 1 of the scenario: a replay buffer too small for the outage (``make chaos`` also runs one that
    covers it)."""
    entry = chaos.bridge_restart(1)
    _assert_passed(entry, chaos, "bridge-restart")
    assert entry["reported_gap"] is not None and entry["source"]["stale"]


def test_table_recovery_from_the_changelog_answers_the_same(chaos):
    _assert_passed(chaos.table_recovery(0), chaos, "table-recovery")
