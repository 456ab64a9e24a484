"""The fleet views' freshness (issue 28): the workers' lag behind their input (``caught_up``, ``lag``) read from
the broker without blocking the event loop, cached for a second; each source's arrival lag, by the workers'
clock; and ``kvstream query --wait-caught-up``."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
from types import SimpleNamespace

import pytest

from kafka_io.admin import GroupProgress
from stream_apps.fleet import InputLag, InputLagReader, source_rows


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _progress(kv_events_lag: int, rekeyed_lag: int) -> dict[str, GroupProgress]:
    return {"kv-events": GroupProgress(1000 - kv_events_lag, 1000),
            "app-kv-events-by-ownership": GroupProgress(50 - rekeyed_lag, 50)}


def test_the_lag_is_the_input_not_yet_consumed_by_both_groups():
    reader = InputLagReader(lambda: _progress(120, 7))
    reading = asyncio.run(reader.reading())
    assert (reading.lag, reading.caught_up) == (127, False)
    assert reading.json() == {"caught_up": False, "lag": 127,
                              "lag_by_topic": {"kv-events": 120, "app-kv-events-by-ownership": 7}}
    assert asyncio.run(InputLagReader(lambda: _progress(0, 0)).reading()).json()["caught_up"] is True


def test_a_reading_is_reused_for_a_second_and_shared_by_the_requests_that_ask_meanwhile():
    calls, threads = [], set()
    loop_thread = []

    def read():
        calls.append(1)
        threads.add(threading.get_ident())
        time.sleep(0.2)  # a blocking admin call: it must not stop the event loop
        return _progress(len(calls), 0)

    clock = _Clock()
    reader = InputLagReader(read, clock=clock)

    async def scenario():
        loop_thread.append(threading.get_ident())
        ticks = 0

        async def ticker():  # runs while the read blocks its thread
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        task = asyncio.ensure_future(ticker())
        first = await asyncio.gather(*(reader.reading() for _ in range(5)))
        task.cancel()
        assert ticks >= 10, "the event loop was blocked while the broker was asked"
        clock.now += 0.5
        cached = await reader.reading()
        clock.now += 0.6  # 1.1 s after the first: read again
        fresh = await reader.reading()
        return first, cached, fresh

    first, cached, fresh = asyncio.run(scenario())
    assert [r.lag for r in first] == [1] * 5 and cached.lag == 1 and fresh.lag == 2
    assert len(calls) == 2 and loop_thread[0] not in threads


def test_no_answer_in_time_or_an_error_is_not_caught_up_and_says_why():
    def slow():
        time.sleep(1.0)
        return _progress(0, 0)

    reading = asyncio.run(InputLagReader(slow, wait_s=0.1).reading())
    assert reading.caught_up is False and reading.lag is None and "within 0.1 s" in reading.json()["lag_error"]

    def failing():
        raise RuntimeError("could not read consumer group app: the coordinator is loading")

    reading = asyncio.run(InputLagReader(failing).reading())
    assert reading.json() == {"caught_up": False, "lag": None, "lag_by_topic": {},
                              "lag_error": "could not read consumer group app: the coordinator is loading"}
    assert InputLag(0, {}, "stale").caught_up is False  # a lag of 0 with an error is no proof


def _status(instance: str, last_event_ts: float | None, events: int) -> dict:
    return {"instance_id": instance, "data_parallel_rank": 0, "worker_rank": -1, "publisher_epoch": 1,
            "stale": False, "first_lost_seq": None, "last_lost_seq": None, "gaps": 0, "restarts": 0,
            "last_seq": events, "last_event_ts": last_event_ts, "events_applied": events, "changed_ts": 0.0}


def test_arrival_lag_is_measured_by_the_workers_clock_not_the_engines():
    """Replayed data: the trace's engine clock is months behind, which made lag_s 28.9 million seconds."""
    engine_ts = 1767225600.0  # the simulator's 2026-01-01
    now = engine_ts + 28_900_000
    statuses = {"0/sim-0/0/-1": _status("sim-0", engine_ts + 10, 5),
                "3/sim-0/0/-1": _status("sim-0", engine_ts + 12, 7), "1/sim-1/0/-1": _status("sim-1", None, 0)}
    store = SimpleNamespace(written_at={"0/sim-0/0/-1": now - 9.5, "3/sim-0/0/-1": now - 2.25})
    tables = SimpleNamespace(sources=SimpleNamespace(items=statuses.items, data=store))
    sim0, sim1 = source_rows(tables, now=now)
    assert sim0["lag_s"] == 28_900_000 - 12 and sim0["events_applied"] == 12
    assert (sim0["applied_ts"], sim0["arrival_lag_s"]) == (now - 2.25, 2.25)  # the partition written last
    assert (sim1["applied_ts"], sim1["arrival_lag_s"], sim1["lag_s"]) == (None, None, None)
    tables.sources.data = SimpleNamespace()  # a store that keeps no times: the fields are there, unknown
    assert source_rows(tables, now=now)[0]["arrival_lag_s"] is None


class _FakeWorker(http.server.ThreadingHTTPServer):
    """Answers GET /occupancy/ with the next of ``answers`` (the last one repeated), and counts the requests."""

    def __init__(self, answers: list) -> None:
        self.answers, self.requests = answers, []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(handler):  # noqa: N805
                self.requests.append(handler.path)
                answer = self.answers[min(len(self.requests) - 1, len(self.answers) - 1)]
                status, body = (answer if isinstance(answer, tuple) else (200, answer))
                data = json.dumps(body).encode()
                handler.send_response(status)
                handler.send_header("Content-Type", "application/json")
                handler.send_header("Content-Length", str(len(data)))
                handler.end_headers()
                handler.wfile.write(data)

            def log_message(handler, *args):  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def fake_worker():
    servers = []

    def start(answers):
        servers.append(_FakeWorker(answers))
        return servers[-1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _occupancy(lag: int | None, error: str | None = None, blocks: int = 10) -> dict:
    answer = {"occupancy": [{"ownership": None, "tier": "GPU", "instance_id": "sim-0", "resident_blocks": blocks}],
              "caught_up": lag == 0 and error is None, "lag": lag,
              "lag_by_topic": {} if lag is None else {"kv-events": lag}}
    return {**answer, "lag_error": error} if error else answer


def test_query_warns_when_the_workers_have_not_caught_up(fake_worker, capsys):
    from kvstream.cli import main

    worker = fake_worker([_occupancy(1234)])
    assert main(["query", "occupancy", "--worker-url", worker.url]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["lag"] == 1234
    assert err.startswith("warning: the workers have not caught up with their input, 1,234 messages") and \
        "--wait-caught-up" in err


def test_wait_caught_up_polls_until_the_workers_have_consumed_everything(fake_worker, capsys, monkeypatch):
    from kvstream import cli

    monkeypatch.setattr(time, "sleep", lambda s: None)
    worker = fake_worker([_occupancy(None, "the coordinator is loading"), _occupancy(5000), _occupancy(5000),
                          _occupancy(20), _occupancy(0)])
    assert cli.main(["query", "occupancy", "--wait-caught-up", "--worker-url", worker.url]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["caught_up"] is True and "warning" not in err
    assert err.splitlines() == [
        "waiting for the workers to catch up: their lag is unknown (the coordinator is loading)",
        "waiting for the workers to catch up: 5,000 messages of their input to go (kv-events 5,000)",
        "waiting for the workers to catch up: 20 messages of their input to go (kv-events 20)",
        "waiting for the workers to catch up: the global tables' copies are settling",
        "the workers have caught up (0 s)"]
    assert worker.requests == ["/occupancy/"] * 7  # six polls (the last two caught up and equal), then the query


def test_wait_caught_up_waits_for_the_other_workers_copies_of_the_global_tables(fake_worker, capsys, monkeypatch):
    # caught up: every change is in the changelogs; the occupancy still grows while this worker's copy of the
    # other workers' partitions reads them, and the wait ends at the first answer equal to the one before it
    from kvstream import cli

    monkeypatch.setattr(time, "sleep", lambda s: None)
    worker = fake_worker([_occupancy(0, blocks=6), _occupancy(0, blocks=9), _occupancy(0, blocks=10),
                          _occupancy(0, blocks=10)])
    assert cli.main(["query", "occupancy", "--wait-caught-up", "--worker-url", worker.url]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["occupancy"][0]["resident_blocks"] == 10
    assert err == ""  # an idle fleet's short settling is not worth a line
    assert len(worker.requests) == 5


def test_wait_caught_up_gives_up_after_its_timeout(fake_worker, capsys):
    from kvstream.cli import main

    worker = fake_worker([_occupancy(77)])
    assert main(["query", "sources", "--wait-caught-up", "--wait-timeout-s", "1.5", "--worker-url", worker.url]) == 1
    assert len(worker.requests) > 1  # it polled until the timeout, not once
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "kvstream query: error: the workers have not caught up after 1.5 s: 77 messages " \
                                   "of their input to go (kv-events 77)"
    assert set(worker.requests) == {"/occupancy/"}  # the sources were never asked


def test_wait_caught_up_needs_a_worker(fake_worker, capsys):
    from kvstream.cli import main

    index = fake_worker([(404, {"error": "not found"})])
    assert main(["query", "workers", "--wait-caught-up", "--worker-url", index.url]) == 1
    assert "needs a stream-app worker's URL" in capsys.readouterr().err
