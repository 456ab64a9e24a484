"""The row steps of ``make bench``: bytes per resident row in each store, a worker's peak RSS at N rows, and
recovery of them."""

from __future__ import annotations

import shutil
import time
import tracemalloc
from typing import Iterator

from tqdm import tqdm

from bench.harness import _Peak, _say
from bench.trace import _eviction_free_fleet, _fleet_batches, _records, _shifted


class RowSteps:
    """The memory, RSS and recovery steps of :class:`bench.run.Bench` (a mixin: it uses the run's broker, options
    and results)."""

    def _row_entries(self, count: int) -> Iterator[tuple[str, dict]]:
        """``count`` (key, entry) pairs as the residency table holds them, one resident row each."""
        from schemas.clear_position import NO_CLEAR
        from stream_apps.residency import ApplyStats, apply_block_event, residency_key

        stats = ApplyStats()
        made = 0
        repetition = 0
        while True:
            batches, _ = _fleet_batches(_shifted(self._trace_requests(), repetition), _eviction_free_fleet(),
                                        repetition)
            entries: dict[str, dict] = {}
            for record in _records(batches):
                kind, body = record["event"]
                if record["block_hash"] is None:
                    continue
                key = residency_key(body["ownership"], record["block_hash"])
                if key in entries:
                    continue  # one row per entry: the figure is per row
                entry, _, _ = apply_block_event(None, record, NO_CLEAR, NO_CLEAR, frozenset({"GPU"}), stats)
                if entry is None:
                    continue
                entries[key] = entry
                yield key, entry
                made += 1
                if made >= count:
                    return
            repetition += 1

    def step_memory(self) -> None:
        """Bytes per resident row in the memory store (tracemalloc) and in a RocksDB store (disk)."""
        from schemas import AvroCodec
        from stream_apps.store_settings import ResidencyRocksDBOptions, residency_rocksdb_options

        rows = self.o.memory_rows
        pairs = list(tqdm(self._row_entries(rows), total=rows, unit="row", desc="rows", leave=False,
                          disable=None))
        # memory: what the memory store (stream_apps.store.CompactMemoryTableStore) holds, built from fresh
        # copies under tracemalloc: every entry as its Avro bytes under its key, and its default cache of
        # decoded entries (the last 10,000 written)
        from stream_apps.settings import WorkerSettings
        from stream_apps.store import value_encoder

        encode = value_encoder(AvroCodec("residency"))
        cache_entries = WorkerSettings(store="memory://").residency_cache_entries
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        table = {}
        for key, entry in pairs:
            table[(key + " ")[:-1]] = encode(entry)
        encoded_only = tracemalloc.get_traced_memory()[0] - before
        cache = {(key + " ")[:-1]: _deep_copy(entry) for key, entry in pairs[-cache_entries:]}
        memory = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        del table, cache
        self._set("bytes_per_row_memory", memory / rows, rows=rows, cache_entries=cache_entries,
                  without_cache=round(encoded_only / rows, 1))

        codec = AvroCodec("residency")
        path = self.work / "rocksdb-bytes-per-row"
        shutil.rmtree(path, ignore_errors=True)
        from rocksdict import Rdict

        options = ResidencyRocksDBOptions(**residency_rocksdb_options())  # the worker's, default sizes
        db = Rdict(str(path), options=options.as_options())
        value_bytes = 0
        for key, entry in pairs:
            value = codec.encode(entry)
            value_bytes += len(value)
            db[key.encode()] = value
        db.flush()
        db.compact_range(None, None)
        db.close()
        disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        sst = sum(f.stat().st_size for f in path.rglob("*.sst"))
        self._set("bytes_per_row_rocksdb", disk / rows, rows=rows, sst_bytes_per_row=round(sst / rows, 1),
                  avro_value_bytes_per_row=round(value_bytes / rows, 1), directory_bytes=disk)
        _say(f"      {rows:,} rows: memory store {memory / rows:,.0f} B/row ({encoded_only / rows:,.0f} without its "
             f"cache of {cache_entries:,} decoded entries); RocksDB {disk / rows:,.0f} B/row on "
             f"disk ({sst / rows:,.0f} in SST files; Avro value {value_bytes / rows:,.0f} B)")
        shutil.rmtree(path, ignore_errors=True)

    def _fill_rows(self, rows_wanted: int, label: str) -> int:
        """Append eviction-free repetitions of the trace to kv-events until it holds ``rows_wanted`` more
        resident rows; returns the rows added."""
        from schemas.topics import KV_EVENTS

        producer = self._kv_producer(KV_EVENTS)
        added = 0
        repetition = self.results["details"].setdefault("_next_repetition", 1)
        with tqdm(total=rows_wanted, unit="row", desc=label, leave=False, disable=None) as bar:
            while added < rows_wanted:
                batches, sim = _fleet_batches(_shifted(self._trace_requests(), repetition),
                                              _eviction_free_fleet(), repetition)
                for batch in batches:
                    for index, event in enumerate(batch.events):
                        producer.send_event(batch.publisher, batch.seq, batch.ts, index, event)
                rows = len(sim.ground_truth())
                added += rows
                bar.update(rows)
                repetition += 1
        self.results["details"]["_next_repetition"] = repetition
        stats = producer.flush()
        self._kv_events_messages += stats.acked
        return added

    def _rss(self, rows: int, key: str, app_id: str, recovery: bool) -> None:
        self._stream_input()
        have = self.results["details"].get("_rows_in_kv_events", 0)
        if have < rows:
            _say(f"      writing {rows - have:,}+ resident rows into kv-events")
            have += self._fill_rows(rows - have, "rows")
            self.results["details"]["_rows_in_kv_events"] = have
        group = self._workers(app_id, self.work, store="rocksdb://", partitions=self.o.partitions)
        group.start(1)
        peak = _Peak(group.pids)
        try:
            t0 = time.perf_counter()
            group.wait_consumed(self._kv_events_messages, self.o.timeout_s, f"{app_id}")
            seconds = time.perf_counter() - t0
            resident = group.resident_rows()
        finally:
            peak_bytes = peak.stop()
            group.stop()
        self._set(key, peak_bytes / (1 << 20), resident_rows=resident, events=self._kv_events_messages,
                  consume_seconds=round(seconds, 1))
        _say(f"      {resident:,} resident rows; peak RSS {peak_bytes / (1 << 20):,.0f} MiB "
             f"({self._kv_events_messages:,} events in {seconds:.0f}s)")
        if recovery:
            self._recovery(app_id, resident)

    def _recovery(self, app_id: str, rows: int) -> None:
        group = self._workers(app_id, self.work / "recovery", store="rocksdb://",
                         partitions=self.o.partitions)
        t0 = time.perf_counter()
        group.start(1)
        try:
            deadline = time.monotonic() + self.o.timeout_s
            while True:
                group.check_alive()
                if "Recovery complete" in group.logs[0].read_text(errors="replace"):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("the recovering worker did not log 'Recovery complete'")
                time.sleep(0.1)
            seconds = time.perf_counter() - t0
        finally:
            group.stop()
        self._set("recovery_s_1m_rows", seconds, resident_rows=rows,
                  rows_per_s=round(rows / seconds) if seconds else None)
        _say(f"      fresh worker recovered {rows:,} rows in {seconds:.1f}s (from its start)")

    def step_rss(self) -> None:
        """Peak RSS at ``rows`` resident rows, then recovery of those rows."""
        self._rss(self.o.rows, "rss_peak_mib_1m_rows", "bench-rows", recovery=True)

    def step_rss_large(self) -> None:
        """Peak RSS at ``rows_large`` resident rows (optional)."""
        if not self.o.rows_large:
            self.results["details"]["rss_peak_mib_10m_rows"] = {"skipped": "--rows-large 0 (or --quick)"}
            self._write()
            _say("      skipped (--rows-large 0 or --quick)")
            return
        self._rss(self.o.rows_large, "rss_peak_mib_10m_rows", "bench-rows-large", recovery=False)


def _deep_copy(value):
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    if isinstance(value, bytes):
        return bytes(bytearray(value))
    return value
