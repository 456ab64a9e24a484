"""``kvstream export``: the residency changes, or a snapshot of the residency table, as Parquet or JSON lines.

Two sources, each named by its topic or its short name:

- **changes**: ``<app id>-kv-residency-changes`` (short name ``kv-residency-changes``), one row per record, in
  the order read (offset order per partition; all the changes of one row are on one partition);
- **residency**: the residency table (short name ``residency``, or its changelog
  ``<app id>-residency-changelog``), read back from its changelog: one row per resident row (copies > 0).

Columns are typed (:data:`CHANGE_SCHEMA`, :data:`RESIDENCY_SCHEMA`): block hashes as lowercase hex (16 digits
for the engines' 8-byte hashes, 64 for 32-byte digests), engine times as UTC timestamps in microseconds,
ownership, medium and locality as nullable strings. In JSON lines the same columns are written with times as
ISO 8601 text. Both read to the end of the topic as of the start, or to ``--until-offset`` or ``--until-time``.

Records are decoded through :class:`schemas.AvroCodec` (one per schema family), so every framing the codec
reads is read here too.
"""

from __future__ import annotations

import datetime
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from confluent_kafka import KafkaException

from kafka_io.config import security_config
from kafka_io.reader import ReadRange, messages_to_end
from kvstream.settings import app_topic
from schemas import AvroCodec, DecodeError
from schemas.topics import KV_RESIDENCY_CHANGES, topic_family

#: How the CLI's tables (the demo's, the report's) show ownership null (the JSON's ``"ownership": null``, empty in
#: an export): the serving framework's own tiers (docs/contract.md, "Ownership").
NULL_OWNERSHIP = "null (framework)"
#: Columns of an exported change, in order (see :func:`change_schema` for their types).
CHANGE_COLUMNS = ("partition", "offset", "kafka_timestamp", "block_hash", "ownership", "instance_id",
                  "data_parallel_rank", "tier", "medium", "locality", "group_idx", "resident", "copies", "ts",
                  "cause")
#: Columns of an exported residency row, in order (see :func:`residency_schema`).
RESIDENCY_COLUMNS = ("block_hash", "ownership", "instance_id", "data_parallel_rank", "tier", "medium", "locality",
                     "group_idx", "copies", "since", "last_ts")
#: Columns holding times: seconds since the Unix epoch in memory, timestamps in the files.
TIME_COLUMNS = frozenset({"ts", "since", "last_ts", "kafka_timestamp"})
#: Rows per Parquet row group (and per batch handed to a consumer of :func:`change_batches`).
BATCH_ROWS = 100_000


def change_schema():
    """The Arrow schema of exported changes: ``residency_change`` records with where each was read.

    ``partition`` (int32) and ``offset`` (int64) of the record, ``kafka_timestamp`` (when the worker wrote it),
    ``block_hash`` (hex), ``ownership`` (null: the engine's own tiers), ``instance_id``, ``data_parallel_rank``
    (int32), ``tier``, ``medium``, ``locality`` (nullable), ``group_idx`` (nullable int32), ``resident`` (true:
    became resident, false: stopped), ``copies`` (int32, after the change), ``ts`` (engine time of the event
    that caused it), ``cause`` (the event type). Times are ``timestamp[us, UTC]``.
    """
    import pyarrow as pa

    ts = pa.timestamp("us", tz="UTC")
    return pa.schema([
        pa.field("partition", pa.int32(), nullable=False), pa.field("offset", pa.int64(), nullable=False),
        pa.field("kafka_timestamp", ts), pa.field("block_hash", pa.string(), nullable=False),
        pa.field("ownership", pa.string()), pa.field("instance_id", pa.string(), nullable=False),
        pa.field("data_parallel_rank", pa.int32(), nullable=False), pa.field("tier", pa.string(), nullable=False),
        pa.field("medium", pa.string()), pa.field("locality", pa.string()), pa.field("group_idx", pa.int32()),
        pa.field("resident", pa.bool_(), nullable=False), pa.field("copies", pa.int32(), nullable=False),
        pa.field("ts", ts, nullable=False), pa.field("cause", pa.string(), nullable=False)])


def residency_schema():
    """The Arrow schema of an exported residency table: one row per resident row (copies > 0).

    ``block_hash`` (hex), ``ownership`` (null: the engine's own tiers), ``instance_id``, ``data_parallel_rank``
    (int32), ``tier``, ``medium`` (of the last event applied), ``locality`` (nullable), ``group_idx``
    (nullable int32), ``copies`` (int32), ``since`` (engine time it became resident), ``last_ts`` (engine time of
    its last event); times are ``timestamp[us, UTC]``.
    """
    import pyarrow as pa

    ts = pa.timestamp("us", tz="UTC")
    return pa.schema([
        pa.field("block_hash", pa.string(), nullable=False), pa.field("ownership", pa.string()),
        pa.field("instance_id", pa.string(), nullable=False),
        pa.field("data_parallel_rank", pa.int32(), nullable=False), pa.field("tier", pa.string(), nullable=False),
        pa.field("medium", pa.string()), pa.field("locality", pa.string()), pa.field("group_idx", pa.int32()),
        pa.field("copies", pa.int32(), nullable=False), pa.field("since", ts, nullable=False),
        pa.field("last_ts", ts, nullable=False)])


@dataclass(frozen=True)
class ExportSource:
    """What ``kvstream export`` reads: ``kind`` ``changes`` or ``residency``, from ``topic``."""

    kind: str
    topic: str


def resolve_source(name: str, topics) -> ExportSource:
    """The source a user names: a topic of the app, or a short name (``kv-residency-changes``, ``residency``).

    Args:
        topics: the app's :class:`schemas.topics.TopicNames` (app id and prefix of the short names: the app's
            topics without their ``<app id>-``, :func:`kvstream.settings.app_topic`).

    Raises:
        ValueError: a name that is neither; the message lists what can be exported.
    """
    topic = app_topic(name, topics)
    if topic == topics.residency_changes or topic_family(topic) == "residency_change":
        return ExportSource("changes", topic)
    if name == "residency":
        return ExportSource("residency", topics.changelog("residency"))
    if topic.endswith("-residency-changelog") and topic_family(topic) == "residency":
        return ExportSource("residency", topic)
    raise ValueError(f"cannot export {name!r}: give the residency changes ({topics.residency_changes}, or "
                     f"{KV_RESIDENCY_CHANGES} for the app of --app-id) or the residency table (residency, or its "
                     f"changelog {topics.changelog('residency')}, or residency-changelog)")


class _Progress:
    """A tqdm bar on standard error when it is a terminal (sized once the read range is known), else silent."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label, self.enabled, self.bar = label, enabled, None

    def start(self, read: ReadRange) -> None:
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=read.messages, unit="msg", desc=self.label, disable=None, file=sys.stderr,
                            leave=False)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _messages(bootstrap_servers: str, topic: str, *, until_offset, until_time: float | None, timeout_s: float,
              on_range: Callable[[ReadRange], None] | None):
    """The topic's messages up to the stops, with the errors users meet turned into RuntimeError."""
    try:
        yield from messages_to_end(bootstrap_servers, topic, timeout_s, stop_offsets=until_offset,
                                   stop_time_ms=None if until_time is None else int(until_time * 1000),
                                   missing_ok=False, on_range=on_range)
    except KafkaException as exc:
        # worded as every other command's (kafka_io.config.unreachable, whose client, the reader's, is closed by
        # now): the error's text, not its repr, and the TLS hint rather than "is a broker listening" when it applies
        error = exc.args[0] if exc.args else None
        reason = error.str() if hasattr(error, "str") else str(exc)
        if security_config().get("security.protocol", "PLAINTEXT") == "PLAINTEXT":
            hint = "is a broker listening there? ('kvstream broker start' runs one on 127.0.0.1:9092)"
        else:
            hint = "check KVSTREAM_SECURITY_PROTOCOL and the KVSTREAM_SASL_*, KVSTREAM_SSL_* settings"
        raise RuntimeError(f"Kafka at {bootstrap_servers} did not answer while reading {topic}: {reason} ({hint})") \
            from None


def change_batches(bootstrap_servers: str, topic: str, *, until_offset=None, until_time: float | None = None,
                   timeout_s: float = 3600.0, progress: bool = False,
                   codec: AvroCodec | None = None) -> Iterator[dict[str, list]]:
    """The residency changes of ``topic`` as column batches of up to :data:`BATCH_ROWS` rows.

    Args:
        codec: the ``residency_change`` reader (:func:`kafka_io.schema_registry.reader_codec` in registry mode);
            default: the schemas this version ships.
        until_offset: stop each partition before this offset (an int for all, or partition -> offset).
        until_time: stop each partition at its first record written at or after this time (Kafka timestamp,
            seconds since the Unix epoch).
        progress: show a progress bar on standard error when it is a terminal.

    Yields:
        column name (:data:`CHANGE_COLUMNS`) -> list of values; times in seconds since the Unix epoch (float),
        block hashes as hex.

    Raises:
        RuntimeError: the topic does not exist, the broker did not answer, or a record does not decode (with its
            partition, offset and the reason).
        TimeoutError: the read took longer than ``timeout_s``.
    """
    decode = (codec or AvroCodec("residency_change")).decode
    bar = _Progress(topic, progress)
    columns: dict[str, list] = {name: [] for name in CHANGE_COLUMNS}
    appenders = [columns[name].append for name in CHANGE_COLUMNS]
    (a_partition, a_offset, a_kafka_ts, a_hash, a_ownership, a_instance, a_rank, a_tier, a_medium, a_locality,
     a_group, a_resident, a_copies, a_ts, a_cause) = appenders
    rows = 0
    try:
        for message in _messages(bootstrap_servers, topic, until_offset=until_offset, until_time=until_time,
                                 timeout_s=timeout_s, on_range=bar.start):
            value = message.value()
            if value is None:
                continue
            try:
                c = decode(value)
            except DecodeError as exc:
                raise RuntimeError(f"{topic} partition {message.partition()} offset {message.offset()} is not a "
                                   f"residency change: {exc}") from None
            a_partition(message.partition())
            a_offset(message.offset())
            kind, stamp = message.timestamp()
            a_kafka_ts(stamp / 1000.0 if kind else None)
            a_hash(c["block_hash"].hex())
            a_ownership(c["ownership"])
            a_instance(c["instance_id"])
            a_rank(c["data_parallel_rank"])
            a_tier(c["tier"])
            a_medium(c["medium"])
            a_locality(c["locality"])
            a_group(c["group_idx"])
            a_resident(c["resident"])
            a_copies(c["copies"])
            a_ts(c["ts"])
            a_cause(c["cause"])
            rows += 1
            if rows == BATCH_ROWS:
                bar.update(rows)
                yield columns
                columns = {name: [] for name in CHANGE_COLUMNS}
                appenders = [columns[name].append for name in CHANGE_COLUMNS]
                (a_partition, a_offset, a_kafka_ts, a_hash, a_ownership, a_instance, a_rank, a_tier, a_medium,
                 a_locality, a_group, a_resident, a_copies, a_ts, a_cause) = appenders
                rows = 0
        if rows:
            bar.update(rows)
            yield columns
    finally:
        bar.close()


def residency_snapshot(bootstrap_servers: str, topic: str, *, until_offset=None, until_time: float | None = None,
                       timeout_s: float = 3600.0, progress: bool = False) -> dict[str, list]:
    """The residency table read back from its changelog ``topic`` (last value per key, an empty value deletes),
    flattened to its resident rows (copies > 0), as columns (:data:`RESIDENCY_COLUMNS`).

    Args: as :func:`change_batches`; the stops give the table as it was at that offset or time.

    Raises:
        RuntimeError: the topic does not exist, the broker did not answer, or a value does not decode.
        TimeoutError: the read took longer than ``timeout_s``.
    """
    decode = AvroCodec("residency").decode
    bar = _Progress(topic, progress)
    latest: dict[bytes, bytes] = {}
    read = 0
    try:
        for message in _messages(bootstrap_servers, topic, until_offset=until_offset, until_time=until_time,
                                 timeout_s=timeout_s, on_range=bar.start):
            if message.value():
                latest[message.key()] = message.value()
            else:
                latest.pop(message.key(), None)
            read += 1
            if read % 10_000 == 0:
                bar.update(10_000)
    finally:
        bar.close()
    columns: dict[str, list] = {name: [] for name in RESIDENCY_COLUMNS}
    for key, value in latest.items():
        try:
            entry = decode(value)
        except DecodeError as exc:
            raise RuntimeError(f"{topic} key {key.decode(errors='replace')!r} is not a residency entry: "
                               f"{exc}") from None
        block_hash = entry["block_hash"].hex()
        for row in entry["rows"]:
            if row["copies"] <= 0:
                continue
            for name, value_ in (("block_hash", block_hash), ("ownership", entry["ownership"]),
                                 ("instance_id", row["instance_id"]),
                                 ("data_parallel_rank", row["data_parallel_rank"]), ("tier", row["tier"]),
                                 ("medium", row["medium"]), ("locality", row["locality"]),
                                 ("group_idx", row["group_idx"]), ("copies", row["copies"]),
                                 ("since", row["since"]), ("last_ts", row["last_ts"])):
                columns[name].append(value_)
    return columns


def _arrow_batch(columns: dict[str, list], schema):
    """A pyarrow RecordBatch of ``columns``; time columns (float seconds) become microsecond timestamps."""
    import numpy as np
    import pyarrow as pa

    arrays = []
    for field in schema:
        values = columns[field.name]
        if field.name in TIME_COLUMNS:
            seconds = pa.array(values, pa.float64())
            micros = np.rint(seconds.to_numpy(zero_copy_only=False) * 1e6)
            mask = None if seconds.null_count == 0 else np.asarray(seconds.is_null())
            arrays.append(pa.array(np.nan_to_num(micros).astype("int64"), type=field.type, mask=mask))
        else:
            arrays.append(pa.array(values, type=field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _iso(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


class _Writer:
    """Writes column batches to a Parquet or JSON-lines file; a partial file is removed on failure."""

    def __init__(self, path: Path, fmt: str, schema) -> None:
        self.path, self.format, self.schema, self.rows = path, fmt, schema, 0
        path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = path.with_name(path.name + ".partial")
        if fmt == "parquet":
            import pyarrow.parquet as pq

            self._parquet = pq.ParquetWriter(self._tmp, schema, compression="zstd")
        else:
            import msgspec

            self._file = open(self._tmp, "wb")
            self._encode = msgspec.json.Encoder().encode

    def write(self, columns: dict[str, list]) -> None:
        count = len(next(iter(columns.values()))) if columns else 0
        if not count:
            return
        if self.format == "parquet":
            self._parquet.write_batch(_arrow_batch(columns, self.schema), row_group_size=BATCH_ROWS)
        else:
            names = list(columns)
            values = [[_iso(v) for v in columns[n]] if n in TIME_COLUMNS else columns[n] for n in names]
            self._file.write(b"".join(self._encode(dict(zip(names, row))) + b"\n" for row in zip(*values)))
        self.rows += count

    def close(self, ok: bool) -> None:
        if self.format == "parquet":
            self._parquet.close()
        else:
            self._file.close()
        if ok:
            self._tmp.replace(self.path)
        else:
            self._tmp.unlink(missing_ok=True)


@dataclass
class ExportResult:
    """What :func:`export` wrote."""

    source: ExportSource
    path: Path
    rows: int
    seconds: float


def export(bootstrap_servers: str, source: ExportSource, path: Path, fmt: str = "parquet", *, until_offset=None,
           until_time: float | None = None, timeout_s: float = 3600.0, progress: bool = False,
           codec: AvroCodec | None = None) -> ExportResult:
    """Write ``source`` to ``path`` as Parquet (typed columns, zstd, row groups of :data:`BATCH_ROWS`) or JSON
    lines. The file appears only once complete (written as ``<path>.partial``, then renamed). ``codec``: the
    ``residency_change`` reader for a changes export, as :func:`change_batches`.

    Raises:
        RuntimeError: the topic does not exist, the broker did not answer, or a record does not decode.
        TimeoutError: the read took longer than ``timeout_s``.
        ValueError: ``fmt`` is neither ``parquet`` nor ``jsonl``.
        RuntimeError: also when pyarrow or numpy (the ``analytics`` extra) is missing for Parquet, before Kafka
            is asked anything.
    """
    if fmt not in ("parquet", "jsonl"):
        raise ValueError(f"unknown format {fmt!r}: parquet or jsonl")
    if fmt == "parquet":
        require_analytics("pyarrow", "numpy")
    started = time.perf_counter()
    schema = change_schema() if source.kind == "changes" and fmt == "parquet" else (
        residency_schema() if fmt == "parquet" else None)
    writer = _Writer(path, fmt, schema)
    ok = False
    try:
        if source.kind == "changes":
            for columns in change_batches(bootstrap_servers, source.topic, until_offset=until_offset,
                                          until_time=until_time, timeout_s=timeout_s, progress=progress,
                                          codec=codec):
                writer.write(columns)
        else:
            writer.write(residency_snapshot(bootstrap_servers, source.topic, until_offset=until_offset,
                                            until_time=until_time, timeout_s=timeout_s, progress=progress))
        ok = True
    finally:
        writer.close(ok)
    return ExportResult(source, path, writer.rows, time.perf_counter() - started)


def require_analytics(*modules: str) -> Any:
    """Import the ``analytics`` extra's ``modules`` (pyarrow, numpy, matplotlib); returns the first.

    Raises:
        RuntimeError: one is not installed, or a module it imports is not (numpy under matplotlib); the message
            names the missing one and says how to install the extra.
    """
    import importlib

    imported = []
    for module in modules:
        try:
            imported.append(importlib.import_module(module))
        except ImportError as exc:
            missing = exc.name or module
            needed_by = "" if missing == module else f" (needed by {module})"
            raise RuntimeError(f"{missing} is not installed{needed_by}: install the analytics extra, "
                               "pip install -e '.[analytics]' (make install does)") from None
    return imported[0]
