"""The peers step of ``make bench``: kvstream's worker against the Kafka Streams peer (bench/peers.py), in rounds."""

from __future__ import annotations

import time

from bench.harness import (
    _cpu_seconds,
    _load,
    _Peak,
    _say,
    _stats,
    _worker_metrics,
    gc_and_checkpoint_summary,
    machine_probe_ms,
)
from bench.trace import _fleet_batches
from kvstream.broker import free_port


class PeerStep:
    """The peers step of :class:`bench.run.Bench` (a mixin: it uses the run's broker, options and results)."""

    def _peer_input(self) -> dict:
        """``peers.kv-events``, written once with the stream steps' trace requests (untimed), and the truth."""
        if self._peer_input_info is not None:
            return self._peer_input_info
        from bench.peers import PEER_PREFIX
        from kafka_io.admin import ensure_topics
        from producers.simulator import load_trace
        from schemas.topics import TopicNames

        topic = TopicNames(prefix=PEER_PREFIX).kv_events
        ensure_topics(self.bootstrap, {topic: self.o.partitions})
        requests = self._trace_requests()
        if self.o.stream_requests is not None and self.o.stream_requests != len(requests):
            requests = load_trace(limit=self.o.stream_requests)
        batches, sim = _fleet_batches(requests)
        producer = self._kv_producer(topic,
                                   dead_letter_topic=TopicNames(prefix=PEER_PREFIX).dead_letter)
        for batch in batches:
            for index, event in enumerate(batch.events):
                producer.send_event(batch.publisher, batch.seq, batch.ts, index, event)
        messages = producer.flush().acked
        truth = sum(1 for copies in sim.ground_truth().values() if copies > 0)
        self._peer_input_info = {"topic": topic, "events": messages, "requests": len(requests), "truth_rows": truth}
        _say(f"      {topic}: {messages:,} messages from {len(requests):,} trace requests; truth {truth:,} rows")
        return self._peer_input_info

    def _peer_round(self, name: str, round_: int, classpath: str | None) -> dict:
        """One run of one contestant over ``peers.kv-events``: its figures (see bench/peers.py)."""
        from bench.peers import PEER_PREFIX, KafkaStreamsPeer, process_cpu, topic_end_offsets, wait_committed

        source = self._peer_input()
        topic, events = source["topic"], source["events"]
        app_id = f"{name}-{round_}"
        before = topic_end_offsets(self.bootstrap)
        probe_before = machine_probe_ms()
        t_start = time.perf_counter()
        if name == "kafka-streams":
            peer = KafkaStreamsPeer(classpath, self.bootstrap, app_id, self.work / f"peer-{app_id}",
                                    free_port(), self.work / f"peer-{app_id}.log", topic)
            pids, labels, alive = peer.pids, {peer.process.pid: "kafka_streams"}, peer.check_alive
            processed = lambda: (peer.stats() or {}).get("events", 0)  # noqa: E731
            group = app_id
            stop = peer.stop
        else:
            store = "rocksdb://" if name == "stream-rocksdb" else "memory://"
            workers = self._workers(app_id, self.work, store=store, partitions=self.o.partitions,
                               topic_prefix=PEER_PREFIX)
            workers.start(1)
            pids, labels, alive = workers.pids, {workers.processes[0].pid: "worker"}, workers.check_alive
            processed = workers.materialized
            group = None
            stop = workers.stop
        peak = _Peak(pids)
        try:
            deadline = time.monotonic() + self.o.timeout_s
            while processed() == 0:
                alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} processed nothing within {self.o.timeout_s:.0f}s")
                time.sleep(0.1)
            t_first = time.perf_counter()
            cpu_first = process_cpu(pids(), labels), _cpu_seconds([self.broker_pid])
            if group is None:
                t_done = workers.wait_consumed(events, self.o.timeout_s, app_id)
            else:
                t_done = wait_committed(self.bootstrap, group, topic, self.o.timeout_s, alive)
            cpu_done = process_cpu(pids(), labels), _cpu_seconds([self.broker_pid])
            if name == "kafka-streams":
                stats = peer.stats() or {}
                rows = peer.rows()
                resident = rows["resident_rows"]
                processed_s = (stats["last_event_ms"] - stats["first_event_ms"]) / 1000.0
                extra = {"peer_stats": stats, "peer_rows": rows}
            else:
                resident = workers.resident_rows()
                processed_s = None
                extra = {"worker_stats": _stats(workers.ports[0]), "worker_metrics": _worker_metrics(workers.ports[0])}
        finally:
            rss = peak.stop()
            stop()
        probe_after = machine_probe_ms()
        after = topic_end_offsets(self.bootstrap)
        seconds = t_done - t_first
        written = {t: after.get(t, 0) - before.get(t, 0) for t in after
                   if t != topic and after.get(t, 0) != before.get(t, 0)}
        offsets = written.pop("__consumer_offsets", 0)
        by_process = {label: round((cpu_done[0].get(label, 0.0) - cpu_first[0].get(label, 0.0)) / events * 1e6, 2)
                      for label in cpu_done[0]}
        result = {
            "round": round_, "events": events, "seconds": round(seconds, 3), "events_per_s": events / seconds,
            "including_startup_s": round(t_done - t_start, 3),
            "processed_events_per_s": (events / processed_s) if processed_s else None,
            "cpu_us_per_event": round(sum(by_process.values()), 2), "cpu_us_per_event_by_process": by_process,
            "broker_cpu_us_per_event": round((cpu_done[1] - cpu_first[1]) / events * 1e6, 2),
            "rss_peak_mib": round(rss / (1 << 20), 1), "messages_written": sum(written.values()),
            "messages_per_event": round(sum(written.values()) / events, 4), "messages_by_topic": written,
            "consumer_offsets_messages": offsets, "resident_rows": resident,
            "rows_equal_truth": resident == source["truth_rows"],
            "machine_probe_ms": {"before": probe_before, "after": probe_after}, **extra}
        _say(f"      {name} round {round_}: {events / seconds:,.0f} events/s, {result['cpu_us_per_event']:.1f} µs CPU "
             f"per event (broker {result['broker_cpu_us_per_event']:.1f}), peak RSS {result['rss_peak_mib']:,.0f} "
             f"MiB, {result['messages_per_event']:.2f} messages/event, {resident:,} resident rows "
             f"({'=' if result['rows_equal_truth'] else '!='} truth {source['truth_rows']:,}), "
             f"machine probe {probe_before:.0f} / {probe_after:.0f} ms"
             f"{gc_and_checkpoint_summary(result.get('worker_metrics'))}")
        return result

    def step_peers(self) -> None:
        """kvstream's worker (RocksDB, memory) against the Kafka Streams peer, one at a time, medians of rounds."""
        from bench.peers import CONTESTANTS, PEER, build_kafka_streams, paired_ratios, summarize

        classpath = build_kafka_streams(_say)
        source = self._peer_input()
        peers = self.results.setdefault("peers", {})
        peers.update({"rounds": self.o.peer_rounds, "events": source["events"], "truth_rows": source["truth_rows"],
                      "topic": source["topic"], "load_average_at_start": _load(),
                      "contestants": {name: {"rounds": []} for name in CONTESTANTS}})
        errors = []
        for round_ in range(self.o.peer_rounds):  # interleaved: a slow minute of the machine hits every one
            for name in CONTESTANTS:
                try:
                    peers["contestants"][name]["rounds"].append(self._peer_round(name, round_, classpath))
                except KeyboardInterrupt:
                    raise
                except Exception as exc:  # one contestant's failure keeps the others' rounds
                    errors.append(f"{name} round {round_}: {type(exc).__name__}: {exc}")
                    _say(f"      {name} round {round_} FAILED: {type(exc).__name__}: {exc}")
                self._write()
        peers["load_average_at_end"] = _load()
        medians = {}
        for name, contestant in peers["contestants"].items():
            contestant["median"] = summarize(contestant["rounds"]) if contestant["rounds"] else None
            medians[name] = contestant["median"] or {}
        ks = medians["kafka-streams"].get("events_per_s")
        self._set("kafka_streams_events_per_s", ks, rows_equal_truth=medians["kafka-streams"].get("rows_equal_truth"))
        for store in ("rocksdb", "memory"):
            m = medians[f"stream-{store}"]
            rate = m.get("events_per_s")
            self._set(f"stream_vs_kafka_streams_{store}", rate / ks if rate and ks else None,
                      stream_events_per_s=rate, kafka_streams_events_per_s=ks,
                      by_round=[round(r, 3) for r in paired_ratios(
                          peers["contestants"][f"stream-{store}"]["rounds"],
                          peers["contestants"][PEER]["rounds"])])
            self._set(f"cpu_us_per_event_stream_{store}", m.get("cpu_us_per_event"),
                      by_process=m.get("cpu_us_per_event_by_process"))
            self._set(f"messages_per_event_stream_{store}", m.get("messages_per_event"))
        k = medians["kafka-streams"]
        self._set("cpu_us_per_event_kafka_streams", k.get("cpu_us_per_event"),
                  by_process=k.get("cpu_us_per_event_by_process"))
        for store in ("rocksdb", "memory"):
            m = medians[f"stream-{store}"]
            ours, theirs = m.get("cpu_us_per_event"), k.get("cpu_us_per_event")
            self._set(f"cpu_vs_kafka_streams_{store}", ours / theirs if ours and theirs else None,
                      by_process=m.get("cpu_us_per_event_by_process"), kafka_streams_cpu_us_per_event=theirs)
        self._set("messages_per_event_kafka_streams", k.get("messages_per_event"))
        if errors:
            raise RuntimeError("; ".join(errors))
