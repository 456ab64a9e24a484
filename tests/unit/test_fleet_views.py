"""The fleet views' freshness (issue 28): each source's arrival lag, by the workers' clock."""

from __future__ import annotations

from types import SimpleNamespace

from stream_apps.fleet import source_rows


def _status(instance: str, last_event_ts: float | None, events: int) -> dict:
    return {"instance_id": instance, "data_parallel_rank": 0, "worker_rank": -1, "publisher_epoch": 1,
            "stale": False, "first_lost_seq": None, "last_lost_seq": None, "gaps": 0, "restarts": 0,
            "last_seq": events, "last_event_ts": last_event_ts, "events_applied": events, "changed_ts": 0.0}


def test_arrival_lag_is_measured_by_the_workers_clock_not_the_engines():
    """Replayed data: the trace's engine clock is months behind, which made lag_s 28.9 million seconds."""
    engine_ts = 1767225600.0  # the simulator's 2026-01-01
    now = engine_ts + 28_900_000
    statuses = {"0/sim-0/0/-1": _status("sim-0", engine_ts + 10, 5), "3/sim-0/0/-1": _status("sim-0", engine_ts + 12, 7),
                "1/sim-1/0/-1": _status("sim-1", None, 0)}
    store = SimpleNamespace(written_at={"0/sim-0/0/-1": now - 9.5, "3/sim-0/0/-1": now - 2.25})
    tables = SimpleNamespace(sources=SimpleNamespace(items=statuses.items, data=store))
    sim0, sim1 = source_rows(tables, now=now)
    assert sim0["lag_s"] == 28_900_000 - 12 and sim0["events_applied"] == 12
    assert (sim0["applied_ts"], sim0["arrival_lag_s"]) == (now - 2.25, 2.25)  # the partition written last
    assert (sim1["applied_ts"], sim1["arrival_lag_s"], sim1["lag_s"]) == (None, None, None)
    tables.sources.data = SimpleNamespace()  # a store that keeps no times: the fields are there, unknown
    assert source_rows(tables, now=now)[0]["arrival_lag_s"] is None
