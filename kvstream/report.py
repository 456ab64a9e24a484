"""``kvstream report``: plots and a summary table of the residency changes.

The changes (``<app id>-kv-residency-changes``, or a Parquet file written by ``kvstream export``) are replayed in
the order read. A change counts only when it flips its row (became resident while not resident, stopped while
resident): a change repeated by an at-least-once redelivery is counted once, as the topic's consumers are told
to do (docs/querying.md, "Output topics"). A row is (instance, data-parallel rank, tier, ownership, locality,
group, block hash), as in the residency table.

What comes out, all in engine time (the changes' ``ts``):

- **resident blocks over time** per tier and instance: the running sum of the flips;
- **dwell time** per tier: from becoming resident to stopping, for the rows that stopped;
- **tier transitions**: each time a block becomes resident on an instance, the tier it last became resident
  on there before (``new`` the first time): GPU to CPU is an offload, CPU to GPU a reload;
- **occupancy as of** a time: the rows whose last change at or before it left them resident, counted per
  (ownership, tier, instance), as ``GET /occupancy/`` counts them.
"""

from __future__ import annotations

import datetime
import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from kvstream.export import NULL_OWNERSHIP, TIME_COLUMNS, change_batches, require_analytics

#: The columns the report reads (an export of the changes has them all).
REPORT_COLUMNS = ("block_hash", "ownership", "instance_id", "data_parallel_rank", "tier", "locality", "group_idx",
                  "resident", "ts")
#: Tiers in the order blocks usually move through them; others follow, by name.
TIER_ORDER = ("GPU", "CPU", "STORAGE")
#: Points per line of the resident-blocks plot.
TIME_POINTS = 400


def tier_label(ownership: str | None, tier: str) -> str:
    """A tier as the report names it: ``GPU``, or ``STORAGE/kvcr`` for a tier owned by a secondary offloading
    tier."""
    return tier if ownership is None else f"{tier}/{ownership}"


def _label_order(label: str) -> tuple:
    tier, _, ownership = label.partition("/")
    return (TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER), tier, ownership)


def iso(seconds: float | None) -> str | None:
    """Seconds since the Unix epoch as ISO 8601 UTC text (``2026-01-01T00:30:00Z``), None as None."""
    if seconds is None:
        return None
    text = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(timespec="milliseconds")
    return text.replace(".000+00:00", "Z").replace("+00:00", "Z")


@dataclass
class ChangeReplay:
    """The replay of residency changes that every figure of the report comes from.

    Feed column batches (:data:`REPORT_COLUMNS`, times in seconds since the Unix epoch) in the order the changes
    were read with :meth:`add`; then read the attributes.

    Args:
        as_of: engine time (seconds) of the occupancy snapshot; None: after the last change.
    """

    as_of: float | None = None
    #: Changes read, and those that flipped nothing (repeated by a redelivery).
    changes: int = 0
    repeated: int = 0
    first_ts: float | None = None
    last_ts: float | None = None
    #: row identity -> engine time it became resident, for the rows resident now.
    resident_since: dict = field(default_factory=dict)
    #: Flips in read order: engine time, series index, +1 or -1 (series: :attr:`series`).
    flip_ts: list = field(default_factory=list)
    flip_series: list = field(default_factory=list)
    flip_delta: list = field(default_factory=list)
    #: (ownership, tier, instance) of each series index.
    series: list = field(default_factory=list)
    _series_index: dict = field(default_factory=dict)
    #: tier label -> counts of became / stopped flips.
    became: Counter = field(default_factory=Counter)
    stopped: Counter = field(default_factory=Counter)
    #: tier label -> dwell times of the rows that stopped, seconds.
    dwell: dict = field(default_factory=lambda: defaultdict(list))
    #: (from tier label or "new", to tier label) -> count.
    transitions: Counter = field(default_factory=Counter)
    _last_tier: dict = field(default_factory=dict)
    #: row identity -> resident, from the last change at or before ``as_of`` (when ``as_of`` is set).
    _as_of_state: dict = field(default_factory=dict)

    def add(self, columns: dict[str, list]) -> None:
        """Replay one batch of changes, in order."""
        as_of = self.as_of
        resident_since, as_of_state = self.resident_since, self._as_of_state
        for block, ownership, instance, rank, tier, locality, group, resident, ts in zip(
                *(columns[name] for name in REPORT_COLUMNS)):
            self.changes += 1
            if self.first_ts is None or ts < self.first_ts:
                self.first_ts = ts
            if self.last_ts is None or ts > self.last_ts:
                self.last_ts = ts
            identity = (instance, rank, tier, ownership, locality, group, block)
            if as_of is not None and ts <= as_of:
                as_of_state[identity] = resident
            since = resident_since.get(identity)
            if resident == (since is not None):
                self.repeated += 1
                continue
            label = tier_label(ownership, tier)
            key = (ownership, tier, instance)
            index = self._series_index.get(key)
            if index is None:
                index = self._series_index[key] = len(self.series)
                self.series.append(key)
            self.flip_ts.append(ts)
            self.flip_series.append(index)
            if resident:
                resident_since[identity] = ts
                self.flip_delta.append(1)
                self.became[label] += 1
                place = (instance, rank, block)
                self.transitions[(self._last_tier.get(place, "new"), label)] += 1
                self._last_tier[place] = label
            else:
                del resident_since[identity]
                self.flip_delta.append(-1)
                self.stopped[label] += 1
                self.dwell[label].append(ts - since)

    def occupancy_as_of(self) -> dict[tuple, int]:
        """(ownership, tier, instance) -> rows resident as of :attr:`as_of` (after the last change when None);
        keys with no resident row are left out."""
        counts: Counter = Counter()
        if self.as_of is None:
            for instance, _, tier, ownership, *_ in self.resident_since:
                counts[(ownership, tier, instance)] += 1
        else:
            for (instance, _, tier, ownership, *_), resident in self._as_of_state.items():
                if resident:
                    counts[(ownership, tier, instance)] += 1
        return dict(counts)

    def labels(self) -> list[str]:
        """Every tier label seen, GPU, CPU, STORAGE first."""
        return sorted({tier_label(o, t) for o, t, _ in self.series}, key=_label_order)

    def resident_over_time(self, points: int = TIME_POINTS):
        """Resident rows per series at ``points`` evenly spaced engine times from the first to the last change.

        Returns:
            (times: numpy array of seconds, {series key (ownership, tier, instance): numpy array of counts}).
        """
        import numpy as np

        if not self.flip_ts:
            return np.array([]), {}
        ts = np.asarray(self.flip_ts, dtype=float)
        series = np.asarray(self.flip_series)
        delta = np.asarray(self.flip_delta)
        order = np.argsort(ts, kind="stable")
        ts, series, delta = ts[order], series[order], delta[order]
        times = np.linspace(self.first_ts, self.last_ts, points) if self.last_ts > self.first_ts else np.array(
            [self.first_ts])
        result = {}
        for index, key in enumerate(self.series):
            mine = series == index
            running = np.concatenate([[0], np.cumsum(delta[mine])])
            result[key] = running[np.searchsorted(ts[mine], times, side="right")]
        return times, result


def parquet_batches(path: Path) -> Iterator[dict[str, list]]:
    """The changes of a Parquet file written by ``kvstream export`` as column batches (:data:`REPORT_COLUMNS`,
    times in seconds since the Unix epoch).

    Raises:
        RuntimeError: the file is missing or is not an export of the residency changes.
    """
    pa = require_analytics("pyarrow", "numpy")
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except FileNotFoundError:
        raise RuntimeError(f"{path} does not exist") from None
    except (OSError, pa.ArrowException) as exc:
        raise RuntimeError(f"{path} is not a Parquet file: {exc}") from None
    missing = [name for name in REPORT_COLUMNS if name not in parquet.schema_arrow.names]
    if missing:
        raise RuntimeError(f"{path} is not an export of the residency changes (no column "
                           f"{', '.join(missing)}): write one with 'kvstream export kv-residency-changes --output "
                           f"{path.name}'")
    for batch in parquet.iter_batches(batch_size=100_000, columns=list(REPORT_COLUMNS)):
        columns = {}
        for name in REPORT_COLUMNS:
            column = batch.column(name)
            if name in TIME_COLUMNS:
                columns[name] = (column.cast(pa.int64()).to_numpy(zero_copy_only=False) / 1e6).tolist()
            else:
                columns[name] = column.to_pylist()
        yield columns


def _fmt_s(seconds: float | None) -> str:
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "-"
    return f"{seconds:,.1f}"


def _table(header: list[str], rows: Iterable[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


@dataclass
class ReportSummary:
    """What :func:`report` wrote: the summary as Markdown text and as data, and the files."""

    text: str
    data: dict
    files: list[Path]


def summarize(replay: ChangeReplay, source: str) -> ReportSummary:
    """The summary table of a replay (Markdown ``text`` and JSON-ready ``data``; no files)."""
    import numpy as np

    labels = replay.labels()
    occupancy = replay.occupancy_as_of()
    resident_now = Counter(tier_label(o, t) for _, _, t, o, *_ in replay.resident_since)
    tiers = {}
    for label in labels:
        dwell = np.asarray(replay.dwell.get(label, []), dtype=float)
        tiers[label] = {
            "became_resident": replay.became[label], "stopped": replay.stopped[label],
            "resident_at_end": resident_now[label],
            "dwell_s_median": float(np.median(dwell)) if dwell.size else None,
            "dwell_s_p90": float(np.percentile(dwell, 90)) if dwell.size else None,
            "dwell_s_mean": float(dwell.mean()) if dwell.size else None}
    as_of = replay.as_of if replay.as_of is not None else replay.last_ts
    data = {
        "source": source, "changes": replay.changes, "repeated_changes": replay.repeated,
        "first_ts": iso(replay.first_ts), "last_ts": iso(replay.last_ts), "as_of": iso(as_of),
        "as_of_s": as_of, "tiers": tiers,
        "transitions": [{"from": a, "to": b, "count": n} for (a, b), n in sorted(
            replay.transitions.items(), key=lambda item: (item[0][0] != "new", _label_order(item[0][0]),
                                                          _label_order(item[0][1])))],
        "occupancy_as_of": [{"ownership": o, "tier": t, "instance_id": i, "resident_blocks": n}
                            for (o, t, i), n in sorted(occupancy.items(),
                                                       key=lambda item: (_label_order(tier_label(*item[0][:2])),
                                                                         item[0][2]))],
    }
    lines = [f"# Residency report: {source}", "",
             f"{replay.changes:,} changes ({replay.repeated:,} repeated by redeliveries, counted once), engine time "
             f"{data['first_ts']} to {data['last_ts']}.", "", "## Tiers", ""]
    lines += _table(["tier", "became resident", "stopped", "resident at end", "dwell median (s)", "dwell p90 (s)",
                     "dwell mean (s)"],
                    [[label, f"{t['became_resident']:,}", f"{t['stopped']:,}", f"{t['resident_at_end']:,}",
                      _fmt_s(t["dwell_s_median"]), _fmt_s(t["dwell_s_p90"]), _fmt_s(t["dwell_s_mean"])]
                     for label, t in tiers.items()])
    sources = ["new"] + labels
    lines += ["", "## Tier transitions", "",
              "Row: the tier a block last became resident on, on that instance (new: never before); column: the "
              "tier it became resident on.", ""]
    lines += _table(["from \\ to", *labels],
                    [[a, *(f"{replay.transitions.get((a, b), 0):,}" for b in labels)] for a in sources])
    lines += ["", f"## Occupancy as of {data['as_of']}", ""]
    lines += _table(["ownership", "tier", "instance", "resident blocks"],
                    [[row["ownership"] or NULL_OWNERSHIP, row["tier"], row["instance_id"],
                      f"{row['resident_blocks']:,}"]
                     for row in data["occupancy_as_of"]])
    total = sum(row["resident_blocks"] for row in data["occupancy_as_of"])
    lines += ["", f"{total:,} resident blocks in all."]
    return ReportSummary("\n".join(lines), data, [])


def _datetimes(seconds):
    import numpy as np

    return (np.asarray(seconds, dtype=float) * 1e6).astype("int64").astype("datetime64[us]")


def _plot_resident(axes, replay: ChangeReplay, labels: list[str], per_instance: bool) -> None:
    times, counts = replay.resident_over_time()
    when = _datetimes(times)
    for ax, label in zip(axes if per_instance else axes * len(labels), labels):
        total = None
        for (ownership, tier, instance), values in sorted(counts.items(), key=lambda item: item[0][2]):
            if tier_label(ownership, tier) != label:
                continue
            if per_instance:
                ax.step(when, values, where="post", label=instance, linewidth=1)
            total = values if total is None else total + values
        if not per_instance and total is not None:
            ax.step(when, total, where="post", label=label, linewidth=1.2)
        if per_instance:
            ax.set_title(f"{label}: resident blocks per instance", fontsize=9)
            ax.legend(fontsize=7, loc="upper left")
    if not per_instance:
        axes[0].set_title("resident blocks per tier (all instances)", fontsize=9)
        axes[0].legend(fontsize=7, loc="upper left")
    for ax in axes:
        ax.tick_params(labelsize=7)
        ax.set_xlabel("engine time (UTC)", fontsize=8)
        if replay.as_of is not None:
            ax.axvline(_datetimes([replay.as_of])[0], color="tab:red", linestyle="--", linewidth=0.8)


def _plot_dwell(ax, replay: ChangeReplay, labels: list[str]) -> None:
    import numpy as np

    values = [np.asarray(replay.dwell.get(label, []), dtype=float) for label in labels]
    positive = np.concatenate([v[v > 0] for v in values]) if values else np.array([])
    if positive.size:
        bins = np.logspace(math.log10(max(positive.min(), 1e-3)), math.log10(positive.max() * 1.01), 40)
        for label, v in zip(labels, values):
            if v.size:
                ax.hist(np.clip(v, bins[0], None), bins=bins, histtype="step", linewidth=1.2,
                        label=f"{label} (median {np.median(v):,.0f} s, n={v.size:,})")
        ax.set_xscale("log")
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no row stopped being resident", transform=ax.transAxes, ha="center", fontsize=8)
    ax.set_title("dwell time per tier (became resident -> stopped)", fontsize=9)
    ax.set_xlabel("seconds (log)", fontsize=8)
    ax.set_ylabel("rows", fontsize=8)
    ax.tick_params(labelsize=7)


def _plot_transitions(ax, replay: ChangeReplay, labels: list[str]) -> None:
    import numpy as np

    sources = ["new"] + labels
    matrix = np.array([[replay.transitions.get((a, b), 0) for b in labels] for a in sources], dtype=float)
    shade = np.log10(matrix + 1)
    ax.imshow(shade, cmap="Blues", aspect="auto")
    for i in range(len(sources)):
        for j in range(len(labels)):
            dark = shade[i, j] > 0.6 * shade.max()
            ax.text(j, i, f"{int(matrix[i, j]):,}", ha="center", va="center", fontsize=7,
                    color="white" if dark else "black")
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_yticks(range(len(sources)), sources, fontsize=7)
    ax.set_xlabel("became resident on", fontsize=8)
    ax.set_ylabel("last resident on (same instance)", fontsize=8)
    ax.set_title("tier transitions", fontsize=9)


def _plot_occupancy(ax, data: dict, labels: list[str]) -> None:
    import numpy as np

    rows = data["occupancy_as_of"]
    instances = sorted({row["instance_id"] for row in rows})
    width = 0.8 / max(len(labels), 1)
    for k, label in enumerate(labels):
        counts = {row["instance_id"]: row["resident_blocks"] for row in rows
                  if tier_label(row["ownership"], row["tier"]) == label}
        ax.bar(np.arange(len(instances)) + k * width, [counts.get(i, 0) for i in instances], width, label=label)
    ax.set_xticks(np.arange(len(instances)) + 0.4 - width / 2, instances, fontsize=7)
    ax.set_title(f"occupancy as of {data['as_of']}", fontsize=9)
    ax.set_ylabel("resident blocks", fontsize=8)
    ax.tick_params(labelsize=7)
    if labels:
        ax.legend(fontsize=7)


def write_plots(replay: ChangeReplay, summary: ReportSummary, output_dir: Path) -> list[Path]:
    """Write the report's PNG files into ``output_dir``; returns their paths.

    Raises:
        RuntimeError: matplotlib is missing (the ``analytics`` extra).
    """
    matplotlib = require_analytics("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = replay.labels()
    files = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = output_dir / name
        fig.savefig(path, dpi=90)
        plt.close(fig)
        files.append(path)

    fig, axes = plt.subplots(len(labels) or 1, 1, figsize=(9, 2.6 * max(len(labels), 1)), squeeze=False)
    _plot_resident(list(axes[:, 0]), replay, labels, per_instance=True)
    save(fig, "resident_blocks.png")
    fig, ax = plt.subplots(figsize=(8, 4))
    _plot_dwell(ax, replay, labels)
    save(fig, "dwell_time.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    _plot_transitions(ax, replay, labels)
    save(fig, "tier_transitions.png")
    fig, ax = plt.subplots(figsize=(8, 4))
    _plot_occupancy(ax, summary.data, labels)
    save(fig, "occupancy_as_of.png")
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    _plot_resident([axes[0, 0]], replay, labels, per_instance=False)
    _plot_dwell(axes[0, 1], replay, labels)
    _plot_transitions(axes[1, 0], replay, labels)
    _plot_occupancy(axes[1, 1], summary.data, labels)
    fig.suptitle(f"kvstream report: {summary.data['source']}", fontsize=10)
    save(fig, "overview.png")
    return files


def is_parquet_source(source: str) -> bool:
    """Whether ``kvstream report SOURCE`` names a Parquet file (a path ending in ``.parquet``, or an existing
    file) rather than a topic."""
    return source.endswith(".parquet") or Path(source).is_file()


def report(settings, source: str | None = None) -> ReportSummary:
    """Replay the changes of ``source`` (a Parquet file, or a topic; None: the app's changes topic) and write
    the plots, ``summary.md`` and ``summary.json`` into ``settings.output_dir``.

    Args:
        settings: a :class:`kvstream.settings.ReportSettings`.

    Returns:
        The summary, with every file written.

    Raises:
        RuntimeError: the source is missing or unreadable, it holds no change, or the analytics extra is missing.
        TimeoutError: reading the topic took longer than ``settings.read_timeout_s``.
    """
    require_analytics("matplotlib", "numpy")
    replay = ChangeReplay(as_of=settings.as_of)
    if source is not None and is_parquet_source(source):
        batches = parquet_batches(Path(source))
    else:
        source = settings.topic(source) if source else settings.topics.residency_changes
        from kafka_io.schema_registry import reader_codec

        codec = reader_codec("residency_change", settings.bootstrap_servers, settings.schema_registry_url,
                             settings.topics.schemas)
        batches = change_batches(settings.bootstrap_servers, source, timeout_s=settings.read_timeout_s,
                                 progress=True, codec=codec)
    for columns in batches:
        replay.add(columns)
    if not replay.changes:
        raise RuntimeError(f"{source} holds no residency change: nothing to report")
    summary = summarize(replay, source)
    output_dir = settings.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    summary.files = write_plots(replay, summary, output_dir)
    (output_dir / "summary.md").write_text(summary.text + "\n")
    (output_dir / "summary.json").write_text(json.dumps(summary.data, indent=1) + "\n")
    summary.files += [output_dir / "summary.md", output_dir / "summary.json"]
    return summary
