"""The stream steps of ``make bench``: the plain-consumer baseline, the stream app with one and two workers, and
event-to-table latency."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import defaultdict

from tqdm import tqdm

from bench.harness import _cpu_seconds, _say, _Workers
from bench.trace import _fleet_batches, _shifted

#: Seconds of the steady rate before the latency step measures: the producer's first connection and the
#: worker's switch from catching up to steady flow are a transient, not the steady state the figure is about
#: (their delays are still in ``details``, as the first ``p99_ms_per_5s`` window).
LATENCY_WARMUP_S = 5.0


class StreamSteps:
    """The stream and latency steps of :class:`bench.run.Bench` (a mixin: it uses the run's broker, options and
    results)."""

    def _stream_input(self) -> None:
        """Write the simulator's events for ``stream_requests`` into kv-events once (not timed)."""
        if self._kv_events_messages:
            return
        from producers.simulator import load_trace
        from schemas.topics import KV_EVENTS

        requests = self._trace_requests()
        if self.o.stream_requests is not None and self.o.stream_requests != len(requests):
            requests = load_trace(limit=self.o.stream_requests)
        batches, _ = _fleet_batches(requests)
        producer = self._kv_producer(KV_EVENTS)
        for batch in batches:
            for index, event in enumerate(batch.events):
                producer.send_event(batch.publisher, batch.seq, batch.ts, index, event)
        self._kv_events_messages += producer.flush().acked
        self.results["details"]["kv_events_input"] = {"requests": len(requests),
                                                      "messages": self._kv_events_messages}
        _say(f"      kv-events: {self._kv_events_messages:,} messages from {len(requests):,} trace requests")

    def step_plain_consumer(self) -> None:
        """The aggregation as a plain confluent-kafka consumer loop over kv-events."""
        self._stream_input()
        import uuid

        from confluent_kafka import Consumer, TopicPartition

        from kafka_io.config import client_config
        from schemas import ALL_BLOCKS_CLEARED, SOURCE_WIDE_EVENTS, AvroCodec
        from schemas.clear_position import NO_CLEAR
        from schemas.topics import KV_EVENTS
        from stream_apps.residency import ApplyStats, SourceSettings, apply_block_event, apply_clear, residency_key

        codec = AvroCodec("kv_event")
        settings = SourceSettings()
        consumer = Consumer(client_config(self.bootstrap, **{
            "group.id": f"bench-plain-{uuid.uuid4()}", "enable.auto.commit": False,
            "auto.offset.reset": "earliest", "fetch.max.bytes": 64 << 20,
            "max.partition.fetch.bytes": 16 << 20}))
        ends = {}
        for p in range(self.o.partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(KV_EVENTS, p), timeout=10)
            if high > low:
                ends[p] = high
        consumer.assign([TopicPartition(KV_EVENTS, p, 0) for p in ends])
        table: dict[str, dict] = {}
        marks: dict[tuple, tuple] = {}
        stats = ApplyStats()
        events = 0
        t0 = None
        deadline = time.monotonic() + self.o.timeout_s
        try:
            while ends:
                if time.monotonic() > deadline:
                    raise TimeoutError("plain consumer did not reach the end of kv-events")
                for message in consumer.consume(10_000, timeout=1.0):
                    if message.error():
                        continue
                    if t0 is None:
                        t0 = time.perf_counter()
                    events += 1
                    record = codec.decode(message.value())
                    kind, _ = record["event"]
                    source = (message.partition(), record["instance_id"], record["data_parallel_rank"])
                    if kind in SOURCE_WIDE_EVENTS:
                        if kind == ALL_BLOCKS_CLEARED:
                            mark = (record["publisher_epoch"], record["seq"], record["batch_index"])
                            marks[source] = mark
                            tiers = settings.clear_tiers(record["instance_id"])
                            for key in list(table):
                                entry, _, changed = apply_clear(table[key], record["instance_id"],
                                                                record["data_parallel_rank"], mark, tiers, stats)
                                if changed:
                                    if entry is None:
                                        del table[key]
                                    else:
                                        table[key] = entry
                    else:
                        mark = marks.get(source, NO_CLEAR)
                        key = residency_key(record["event"][1]["ownership"], record["block_hash"])
                        entry, _, _ = apply_block_event(table.get(key), record, mark, mark,
                                                        settings.clear_tiers(record["instance_id"]), stats)
                        if entry is None:
                            table.pop(key, None)
                        else:
                            table[key] = entry
                    p = message.partition()
                    if p in ends and message.offset() + 1 >= ends[p]:
                        del ends[p]
        finally:
            consumer.close()
        seconds = time.perf_counter() - (t0 or time.perf_counter())
        resident = sum(1 for e in table.values() for r in e["rows"] if r["copies"] > 0)
        self._set("plain_consumer_events_per_s", events / seconds if seconds else None, events=events,
                  seconds=round(seconds, 3), resident_rows=resident)
        _say(f"      {events:,} events in {seconds:.2f}s: {events / seconds:,.0f} events/s; {resident:,} resident rows")

    def _stream(self, workers: int, key: str, keep: bool = False, store: str = "memory://") -> _Workers | None:
        from bench.peers import process_cpu

        self._stream_input()
        app_id = f"bench-{workers}w" + ("" if store == "memory://" else "-" + store.split(":")[0])
        group = self._workers(app_id, self.work, store=store, partitions=self.o.partitions,
                         residency_changes=True)
        t_start = time.perf_counter()
        group.start(workers)
        try:
            t_first = group.wait_first_event(self.o.timeout_s)
            labels = {pid: f"worker{n}" for n, pid in enumerate(group.pids())}
            cpu_first = _cpu_seconds(group.pids()), _cpu_seconds([self.broker_pid])
            by_process_first = process_cpu(group.pids(), labels)
            t_done = group.wait_consumed(self._kv_events_messages, self.o.timeout_s, f"{workers} worker(s)")
            cpu_done = _cpu_seconds(group.pids()), _cpu_seconds([self.broker_pid])
            by_process_done = process_cpu(group.pids(), labels)
        except BaseException:
            group.stop()
            raise
        events = self._kv_events_messages
        seconds = t_done - t_first
        # cores busy on average from the first event to the last: how much of the machine this rate took
        self._set(key, events / seconds, events=events, seconds=round(seconds, 3),
                  including_startup_s=round(t_done - t_start, 3),
                  including_startup_events_per_s=round(events / (t_done - t_start)),
                  worker_cores=round((cpu_done[0] - cpu_first[0]) / seconds, 2),
                  broker_cores=round((cpu_done[1] - cpu_first[1]) / seconds, 2), machine_cores=os.cpu_count(),
                  cpu_us_per_event_by_process={
                      label: round((cpu - by_process_first.get(label, 0.0)) / events * 1e6, 2)
                      for label, cpu in by_process_done.items() if not label.endswith("resource_tracker")},
                  broker_cpu_us_per_event=round((cpu_done[1] - cpu_first[1]) / events * 1e6, 2), store=store)
        one, two = (self.results["figures"][k]["value"] for k in ("stream_events_per_s_1w", "stream_events_per_s_2w"))
        if one and two:
            details = self.results["details"]
            self._set("stream_2w_vs_1w", two / one, **{
                f"cpu_us_per_event_by_process_{n}w": details.get(f"stream_events_per_s_{n}w", {}).get(
                    "cpu_us_per_event_by_process") for n in (1, 2)})
        _say(f"      {events:,} events in {seconds:.1f}s from the first event ({t_done - t_start:.1f}s from start): "
             f"{events / seconds:,.0f} events/s")
        if keep:
            return group
        group.stop()
        return None

    def step_stream_1w(self) -> None:
        """One worker end to end; then the latency step on the same (caught-up) worker."""
        group = self._stream(1, "stream_events_per_s_1w", keep="latency" in self._steps)
        if group is not None:
            try:
                self._latency(group)
            finally:
                group.stop()

    def step_stream_1w_rocksdb(self) -> None:
        """One worker end to end with the RocksDB store, the default of ``kvstream worker``."""
        self._stream(1, "stream_events_per_s_1w_rocksdb", store="rocksdb://")

    def step_stream_2w(self) -> None:
        """Two workers of one app id end to end."""
        self._stream(2, "stream_events_per_s_2w")

    def _latency(self, group: _Workers) -> None:
        """Steady produce of fresh blocks at ``latency_rate``; delays from kv-residency-changes, split at the
        repartition topic (the ``ownership_batch`` message that carried each event)."""
        import psutil

        from bench.peers import partition_end_offsets
        from kafka_io.reader import messages_to_end
        from schemas import AvroCodec
        from schemas.topics import KV_EVENTS, TopicNames

        _say(f"[latency] {self.o.latency_rate:,} events/s for {LATENCY_WARMUP_S:.0f}s of warm-up, then "
             f"{self.o.latency_s:.0f}s measured, into a running worker")
        total = int(self.o.latency_rate * (LATENCY_WARMUP_S + self.o.latency_s))
        events = []
        repetition = 1000
        while len(events) < total:  # fresh blocks: the trace shifted, through the normal fleet
            batches, _ = _fleet_batches(_shifted(self._trace_requests(), repetition), None, repetition)
            events += [(b.publisher, b.seq, i, e) for b in batches for i, e in enumerate(b.events)]
            repetition += 1
        topics = TopicNames(group.app_id)
        ends = partition_end_offsets(self.bootstrap, [topics.residency_changes, topics.by_ownership])
        starts = {topic: {p: offset for (t, p), offset in ends.items() if t == topic}
                  for topic in (topics.residency_changes, topics.by_ownership)}
        producer = self._kv_producer(KV_EVENTS)
        sent = 0
        cpu_start = _cpu_seconds(group.pids())
        broker_start, idle_start = _cpu_seconds([self.broker_pid]), psutil.cpu_times().idle
        t0 = time.perf_counter()
        began = time.time()
        index = 0
        with tqdm(total=total, unit="ev", desc="steady", leave=False, disable=None) as bar:
            while sent < total:
                due = int((time.perf_counter() - t0) * self.o.latency_rate)
                while sent < min(due, total) and index < len(events):
                    publisher, seq, batch_index, event = events[index]
                    index += 1
                    sent += producer.send_event(publisher, seq, time.time(), batch_index, event)
                producer.poll()
                bar.n = sent
                bar.refresh()
                time.sleep(0.002)
        produced_s = time.perf_counter() - t0
        # The worker's share of a core at this rate (both its processes): lower lingers cut the wait but make
        # more, smaller batch messages, and this is what they cost
        worker_cores = (_cpu_seconds(group.pids()) - cpu_start) / produced_s
        # the broker's share and the machine's idle cores over the same window: the p99 follows the machine's
        # other load more than most changes (bench/README.md, "Machine caveats")
        broker_cores = (_cpu_seconds([self.broker_pid]) - broker_start) / produced_s
        idle_cores = (psutil.cpu_times().idle - idle_start) / produced_s
        stats = producer.flush()
        self._kv_events_messages += stats.acked
        group.wait_consumed(self._kv_events_messages, self.o.timeout_s, "catch up")
        # When the repartition process wrote each event's ownership_batch message (its Kafka timestamp), by the
        # event's (block hash, instance, ts): the delay's two halves, before and after the repartition topic
        batch_codec, event_codec = AvroCodec("ownership_batch"), AvroCodec("kv_event")
        rekeyed: dict[tuple, float] = {}
        for message in messages_to_end(self.bootstrap, topics.by_ownership, self.o.timeout_s,
                                       starts[topics.by_ownership]):
            for item in batch_codec.decode(message.value())["events"]:
                event = event_codec.decode(item["event"])
                if event["ts"] >= began and event["block_hash"] is not None:
                    rekeyed[(event["block_hash"], event["instance_id"], event["ts"])] = message.timestamp()[1]
        codec = AvroCodec("residency_change")
        delays, to_batch, after_batch = [], [], []
        windows: dict[int, list[float]] = defaultdict(list)  # 5 s windows of event time -> delays
        for message in messages_to_end(self.bootstrap, topics.residency_changes, self.o.timeout_s,
                                       starts[topics.residency_changes]):
            change = codec.decode(message.value())
            if change["ts"] < began:
                continue
            changed_ms, event_ms = message.timestamp()[1], change["ts"] * 1000.0
            delay = changed_ms - event_ms
            windows[int((change["ts"] - began) // 5)].append(delay)
            if change["ts"] >= began + LATENCY_WARMUP_S:
                delays.append(delay)
                batch_ms = rekeyed.get((change["block_hash"], change["instance_id"], change["ts"]))
                if batch_ms is not None:
                    to_batch.append(batch_ms - event_ms)
                    after_batch.append(changed_ms - batch_ms)
        if not delays:
            raise RuntimeError("no kv-residency-changes records from the steady-rate events")
        delays.sort()
        p50, p99 = _percentile(delays, 0.5), _percentile(delays, 0.99)
        details = {"samples": len(delays), "events": sent, "seconds": round(produced_s, 2),
                   "achieved_rate": round(sent / produced_s), "max_ms": round(delays[-1], 1),
                   "worker_cpu_cores": round(worker_cores, 3),
                   "broker_cpu_cores": round(broker_cores, 3),
                   "machine_idle_cores": round(idle_cores, 3),
                   "mean_ms": round(statistics.fmean(delays), 1),
                   "warmup_s": LATENCY_WARMUP_S,
                   # per 5 s of event time, the warm-up's first: the transient and the steady state apart
                   "p99_ms_per_5s": [round(_percentile(sorted(w), 0.99)) for _, w in sorted(windows.items())],
                   # event ts -> its ownership_batch message written (producer linger, broker, the repartition
                   # process's read, batching, re-keying), then -> its table change produced (the batch's
                   # flush, the agent's fetch and queue, the apply); p50 and p99 of each, in ms
                   "to_repartition_topic_ms": _quantiles(to_batch),
                   "repartition_topic_to_table_ms": _quantiles(after_batch)}
        self._set("latency_p50_ms", p50, **details)
        self._set("latency_p99_ms", p99, **details)
        _say(f"      {sent:,} events at {sent / produced_s:,.0f}/s; {len(delays):,} table changes: "
             f"p50 {p50:,.0f} ms, p99 {p99:,.0f} ms, max {delays[-1]:,.0f} ms; p50/p99 to the repartition "
             f"topic {details['to_repartition_topic_ms']}, from there to the table "
             f"{details['repartition_topic_to_table_ms']}; the worker used {worker_cores:.2f} of a core")


def _percentile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile (0 to 1) of the sorted list ``ordered``, by the nearest-rank rule."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(len(ordered) * q) - 1))]


def _quantiles(values: list[float]) -> list[float] | None:
    """``[p50, p99]`` of ``values`` in ms, rounded to 0.1; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return [round(_percentile(ordered, 0.5), 1), round(_percentile(ordered, 0.99), 1)]
