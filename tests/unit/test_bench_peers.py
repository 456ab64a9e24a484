"""bench.peers: the peers step's figures from its rounds (no broker: the rounds are given)."""

from bench.peers import paired_ratios, print_peers, summarize


def _round(n: int, rate: float | None) -> dict:
    return {"round": n, "events_per_s": rate, "cpu_us_per_event": 10.0, "cpu_us_per_event_by_process": {},
            "rows_equal_truth": True, "resident_rows": 5}


def test_each_round_is_divided_by_the_peers_same_round():
    ours = [_round(0, 56_300.0), _round(1, 65_378.0), _round(2, 57_079.0)]
    theirs = [_round(0, 71_576.0), _round(1, 90_412.0), _round(2, 92_287.0)]  # bench/HISTORY.md, 2026-12-04 15:28
    assert [round(r, 3) for r in paired_ratios(ours, theirs)] == [0.787, 0.723, 0.618]


def test_a_round_either_side_lacks_is_left_out():
    ours = [_round(0, 50.0), _round(1, 60.0), _round(2, None)]
    theirs = [_round(1, 120.0), _round(2, 100.0)]  # the peer's round 0 failed
    assert paired_ratios(ours, theirs) == [0.5]


def test_the_peers_table_prints_the_round_by_round_ratios_and_their_spread(capsys):
    contestants = {"stream-rocksdb": [_round(0, 80.0), _round(1, 60.0), _round(2, 90.0)],
                   "kafka-streams": [_round(0, 100.0), _round(1, 100.0), _round(2, 100.0)]}
    print_peers({"rounds": 3, "events": 1000, "truth_rows": 5, "contestants": {
        name: {"rounds": rounds, "median": summarize(rounds)} for name, rounds in contestants.items()}})
    out = capsys.readouterr().out
    assert "stream-rocksdb / kafka-streams, events/s round by round: 0.80, 0.60, 0.90 (median 0.80, spread " \
           "0.60-0.90)" in out


def test_a_rounds_gc_and_checkpoint_costs_are_read_from_the_workers_metrics_and_summed():
    import http.server
    import threading

    from bench.harness import _worker_metrics, gc_and_checkpoint_summary
    from kvstream.broker import free_port

    text = ("# HELP kvstream_gc_pause_seconds ...\n# TYPE kvstream_gc_pause_seconds summary\n"
            'kvstream_gc_pause_seconds_count{generation="0"} 100.0\n'
            'kvstream_gc_pause_seconds_sum{generation="0"} 0.25\n'
            'kvstream_gc_pause_seconds_count{generation="1"} 10.0\n'
            'kvstream_gc_pause_seconds_sum{generation="1"} 0.05\n'
            'kvstream_gc_pause_seconds_count{generation="2"} 1.0\n'
            'kvstream_gc_pause_seconds_sum{generation="2"} 0.11\n'
            "kvstream_checkpoint_seconds_count 7.0\nkvstream_checkpoint_seconds_sum 0.9\n"
            'kvstream_events_total{outcome="applied"} 20.0\n')

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's name
            body = text.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    port = free_port()
    server = http.server.HTTPServer(("127.0.0.1", port), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        samples = _worker_metrics(port)
    finally:
        server.shutdown()
        server.server_close()
    assert len(samples) == 8 and samples["kvstream_checkpoint_seconds_count"] == 7.0  # the events count left out
    assert gc_and_checkpoint_summary(samples) == (", GC 0.41 s in 111 collections (full 0.11 s), checkpoints "
                                                  "0.90 s in 7")
    assert gc_and_checkpoint_summary(None) == "" and _worker_metrics(free_port()) is None  # nothing answers
