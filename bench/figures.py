"""The figures of ``make bench``: every figure's target, unit and definition, and the table and plot of a run's."""

from __future__ import annotations

import math
from pathlib import Path

from bench.index_bench import INDEX_DEFINITIONS

#: Target, unit and definition of every figure, and which figure (if any) is its baseline.
DEFINITIONS: dict[str, dict] = {
    "producer_events_per_s": {
        "unit": "block events/s", "target": 150_000, "better": "higher", "baseline": "fastavro_encode_per_s",
        "definition": "Simulator engine events (generated beforehand, not timed) through per-block split, Avro "
                      "encode and produce to kv-events, until the broker acknowledged all (flush). Baseline: "
                      "fastavro's schemaless_writer alone on the same records, one core."},
    "bridge_events_per_s": {
        "unit": "block events/s", "target": 150_000, "better": "higher", "baseline": "producer_events_per_s",
        "definition": "A local ZMQ PUB publisher (another process) sends the simulator's batches as vLLM msgpack "
                      "at full speed; the bridge decodes, splits, encodes and produces them. From the first "
                      "batch received to the last message acknowledged."},
    "stream_events_per_s_1w": {
        "unit": "events/s", "target": 30_000, "better": "higher", "baseline": "plain_consumer_events_per_s",
        "definition": "One worker, kv-events pre-filled with the producer step's events: kv-events messages "
                      "divided by the time from the worker's first materialized event (GET /stats/) to the "
                      "consumer group having committed everything in kv-events and the re-keyed topic. "
                      "'including_startup_s' counts from the worker's start. Store memory://."},
    "stream_events_per_s_1w_rocksdb": {
        "unit": "events/s", "target": None, "better": "higher", "baseline": "stream_events_per_s_1w",
        "definition": "As stream_events_per_s_1w with store rocksdb://, the default of 'kvstream worker' and of "
                      "deployments: every table partition in RocksDB, entries read back through its cache."},
    "stream_events_per_s_2w": {
        "unit": "events/s", "target": "1.6 x stream_events_per_s_1w", "better": "higher",
        "baseline": "stream_events_per_s_1w",
        "definition": "As stream_events_per_s_1w with two workers of one app id (separate web ports and data "
                      "dirs), from the first materialized event on either worker to everything committed."},
    "stream_2w_vs_1w": {
        "unit": "ratio", "target": None, "better": "higher", "baseline": None,
        "definition": "stream_events_per_s_2w / stream_events_per_s_1w, reported with the CPU µs per event of "
                      "each process of both runs (details.cpu_us_per_event_by_process_1w, _2w): on a 2-core "
                      "machine two workers and their repartition children share the cores with the broker, so "
                      "the ratio says how much of the machine one worker left idle, not how the app scales."},
    "latency_p50_ms": {
        "unit": "ms", "target": None, "better": "lower", "baseline": None,
        "definition": "Event-to-table delay while kv-events receives a steady 10,000 block events/s (fresh "
                      "blocks, ts = wall clock at produce) and one caught-up worker runs: for every record of "
                      "kv-residency-changes caused by those events, its Kafka timestamp (set when the worker "
                      "produced it, right after applying the event to the table) minus the event's ts. Includes "
                      "the producer's linger and the worker's batching. details: p99 per 5 s, and the two "
                      "halves' [p50, p99] split at the repartition topic."},
    "latency_p99_ms": {
        "unit": "ms", "target": 50, "better": "lower", "baseline": None,
        "definition": "99th percentile of the delays of latency_p50_ms. Issue 27's target; its moonshot is 20."},
    "bytes_per_row_memory": {
        "unit": "bytes/row", "target": 300, "better": "lower", "baseline": None,
        "definition": "tracemalloc's traced memory of what the memory:// store holds, divided by rows: a dict "
                      "{residency key: the entry's Avro bytes} for entries built with apply_block_event from "
                      "the simulator's stores (one resident row per entry), plus its cache of decoded entries "
                      "at the default size (details: cache_entries, and the figure without_cache)."},
    "bytes_per_row_rocksdb": {
        "unit": "bytes/row", "target": 250, "better": "lower", "baseline": "bytes_per_row_memory",
        "definition": "The same rows in a RocksDB store opened with Faust's rocksdict options (raw UTF-8 key, "
                      "Avro 'residency' value with single-object framing): size of the database directory after "
                      "flush and full compaction, divided by rows."},
    "rss_peak_mib_1m_rows": {
        "unit": "MiB", "target": None, "better": "lower", "baseline": None,
        "definition": "Peak RSS (sampled every 0.5 s, psutil) of a worker process tree with store rocksdb:// "
                      "while it materializes everything in kv-events, which holds at least 1 million resident "
                      "rows (the Mooncake trace repeated through an eviction-free fleet, block ids shifted per "
                      "repetition)."},
    "rss_peak_mib_10m_rows": {
        "unit": "MiB", "target": 1536, "better": "lower", "baseline": "rss_peak_mib_1m_rows",
        "definition": "As rss_peak_mib_1m_rows with at least 10 million resident rows (--rows-large)."},
    "recovery_s_1m_rows": {
        "unit": "s", "target": 60, "better": "lower", "baseline": None,
        "definition": "A fresh worker (same app id, empty data dir, store rocksdb://) after the 1 million rows "
                      "run: seconds from its start until Faust logs 'Recovery complete' (tables rebuilt from "
                      "their changelogs)."},
    "fastavro_encode_per_s": {
        "unit": "records/s", "target": None, "better": "higher", "baseline": None,
        "definition": "fastavro.schemaless_writer over the simulator's kv_event records, one core, no Kafka: the "
                      "producer path's baseline."},
    "fastavro_decode_per_s": {
        "unit": "records/s", "target": None, "better": "higher", "baseline": None,
        "definition": "fastavro.schemaless_reader over the encoded kv_event bodies of the simulator's records, "
                      "one core, no Kafka: the limit of any consumer that decodes every event."},
    "kafka_streams_events_per_s": {
        "unit": "events/s", "target": None, "better": "higher", "baseline": None,
        "definition": "Step peers: the Kafka Streams peer (bench/kafka_streams: Processor API, one stream thread, "
                      "RocksDB store with a changelog and caching, commit every 1 s, clears applied by a store "
                      "scan, no repartition, epochs or idempotency) over peers.kv-events (the trace, as the "
                      "stream steps): events divided by the time from its first event processed to its group "
                      "having committed the end of the topic. Median of --peer-rounds runs."},
    "stream_vs_kafka_streams_rocksdb": {
        "unit": "ratio", "target": 1.0, "better": "higher", "baseline": None,
        "definition": "Step peers: one kvstream worker with rocksdb:// over the same topic, same definition of the "
                      "rate, divided by kafka_streams_events_per_s (medians of the same rounds, interleaved). "
                      "Issue 27's target; its moonshot is 1.3."},
    "stream_vs_kafka_streams_memory": {
        "unit": "ratio", "target": 1.2, "better": "higher", "baseline": None,
        "definition": "As stream_vs_kafka_streams_rocksdb with memory://. Issue 27's target; its moonshot is 1.5."},
    "cpu_vs_kafka_streams_rocksdb": {
        "unit": "ratio", "target": 1.0, "better": "lower", "baseline": None,
        "definition": "Step peers: cpu_us_per_event_stream_rocksdb / cpu_us_per_event_kafka_streams, every process "
                      "of the worker (its repartition child included) against every thread of the peer's JVM; "
                      "details.by_process has each process's share."},
    "cpu_vs_kafka_streams_memory": {
        "unit": "ratio", "target": 1.0, "better": "lower", "baseline": None,
        "definition": "As cpu_vs_kafka_streams_rocksdb with memory://."},
    "cpu_us_per_event_stream_rocksdb": {
        "unit": "µs/event", "target": None, "better": "lower", "baseline": "cpu_us_per_event_kafka_streams",
        "definition": "Step peers: user + system CPU of the worker's process tree (the worker and its repartition "
                      "child) from its first event to everything committed, per input event; the broker's apart. "
                      "details.peers has it per process."},
    "cpu_us_per_event_stream_memory": {
        "unit": "µs/event", "target": None, "better": "lower", "baseline": "cpu_us_per_event_kafka_streams",
        "definition": "As cpu_us_per_event_stream_rocksdb with memory://."},
    "cpu_us_per_event_kafka_streams": {
        "unit": "µs/event", "target": None, "better": "lower", "baseline": None,
        "definition": "As cpu_us_per_event_stream_rocksdb for the Kafka Streams peer's JVM (every thread: stream "
                      "thread, producer, RocksDB, GC, JIT)."},
    "messages_per_event_stream_rocksdb": {
        "unit": "messages/event", "target": None, "better": "lower", "baseline": "messages_per_event_kafka_streams",
        "definition": "Step peers: messages the run wrote to the broker (end offsets of every topic but the input "
                      "and __consumer_offsets, after minus before), per input event. details.peers has them per "
                      "topic."},
    "messages_per_event_stream_memory": {
        "unit": "messages/event", "target": None, "better": "lower", "baseline": "messages_per_event_kafka_streams",
        "definition": "As messages_per_event_stream_rocksdb with memory://."},
    "messages_per_event_kafka_streams": {
        "unit": "messages/event", "target": None, "better": "lower", "baseline": None,
        "definition": "As messages_per_event_stream_rocksdb for the Kafka Streams peer (its changelog)."},
    "plain_consumer_events_per_s": {
        "unit": "events/s", "target": None, "better": "higher", "baseline": "fastavro_decode_per_s",
        "definition": "confluent-kafka consumer over kv-events (batches of 10,000), Avro decode, "
                      "apply_block_event / apply_clear into a dict: the stream app's aggregation without Faust "
                      "and without changelogs, from the first message to the last."},
    "tail_messages_per_s": {
        "unit": "messages/s", "target": None, "better": "higher", "baseline": "kcat_messages_per_s",
        "definition": "'kvstream tail kv-events --from-beginning --to-end' as a process (Python start-up included), "
                      "every record decoded with the project's codec and printed as a JSON line to /dev/null: "
                      "messages in kv-events divided by the wall time from its start to its exit. Best of 2. "
                      "details.tail also has the same on the stream-1w app's kv-residency-changes topic."},
    "kcat_messages_per_s": {
        "unit": "messages/s", "target": None, "better": "higher", "baseline": None,
        "definition": "'kcat -C -o beginning -e -q' on the same topic in the same run, raw values to /dev/null "
                      "(no decoding): messages divided by wall time from start to exit. Best of 2. None, with the "
                      "reason in details, when kcat is not installed."},
    "tail_vs_kcat": {
        "unit": "ratio", "target": 0.3, "better": "higher", "baseline": None,
        "definition": "tail_messages_per_s / kcat_messages_per_s on kv-events."},
}


DEFINITIONS.update(INDEX_DEFINITIONS)  # the index step's (bench/index_bench.py)


#: The keys results.json always holds (value null when a step was skipped or failed); fastavro_encode_per_s is
#: an extra, the producer path's baseline.
FIGURES = tuple(DEFINITIONS)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.2f}"


def _met(value, target, better: str) -> str:
    """``yes``/``NO`` for a figure with a numeric target, ``-`` without one or without a value."""
    if not isinstance(target, (int, float)) or value is None:
        return "-"
    return "yes" if (value >= target if better == "higher" else value <= target) else "NO"


def print_table(results: dict) -> None:
    """Print every figure with its unit, target and baseline."""
    print(f"\n{'figure':<30} {'value':>14} {'target':>24} {'met':>4} {'baseline':>32}  unit")
    figures = results["figures"]
    for key, f in figures.items():
        base = f.get("baseline")
        base_text = f"{base}={_fmt(figures[base]['value'])}" if isinstance(base, str) else "-"
        target = bound = f["target"]
        if target == "1.6 x stream_events_per_s_1w":
            one = figures["stream_events_per_s_1w"]["value"]
            bound = 1.6 * one if one else None
            target = f"1.6x1w={_fmt(bound)}" if one else "1.6 x 1w"
        print(f"{key:<30} {_fmt(f['value']):>14} {_fmt(target):>24} {_met(f['value'], bound, f['better']):>4} "
              f"{base_text:>32}  {f['unit']}")
    from bench.peers import print_peers

    print_peers(results.get("peers"))
    if results.get("errors"):
        print("\nfailed steps: " + "; ".join(f"{k}: {v}" for k, v in results["errors"].items()))


def plot(results: dict, path: Path) -> None:
    """One small bar chart per figure: the value, its baseline (if any) and its target (dashed line).

    Raises:
        ImportError: matplotlib is not installed (the ``bench`` extra).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = results["figures"]
    keys = list(figures)
    cols = 4
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows))
    for ax, key in zip(axes.flat, keys):
        f = figures[key]
        labels, values, colors = ["value"], [f["value"] or 0], ["tab:blue"]
        base = f.get("baseline")
        if isinstance(base, str) and figures[base]["value"] is not None:
            labels.append(base.replace("_events_per_s", "").replace("_per_s", "")[:18])
            values.append(figures[base]["value"])
            colors.append("tab:gray")
        ax.bar(labels, values, color=colors)
        target = f["target"]
        if target == "1.6 x stream_events_per_s_1w" and figures["stream_events_per_s_1w"]["value"]:
            target = 1.6 * figures["stream_events_per_s_1w"]["value"]
        if isinstance(target, (int, float)):
            ax.axhline(target, color="tab:red", linestyle="--", label=f"target {target:,.0f}")
            ax.legend(fontsize=7)
        ax.set_title(f"{key}\n({f['unit']}, {f['better']} is better)", fontsize=8)
        ax.tick_params(labelsize=7)
        if f["value"] is None:
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", fontsize=8)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    machine = results["machine"]
    fig.suptitle(f"make bench ({results['mode']}), {results['date']}, {machine['cores']} cores, "
                 f"Python {machine['python']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
