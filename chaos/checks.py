"""The checks of a chaos run: the residency table, the topics and the workers' HTTP answers against the truth, and a
run's entry of the results file."""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field

from confluent_kafka import Consumer, TopicPartition

from chaos.env import Worker, http_json
from kafka_io.config import client_config
from kafka_io.reader import messages_to_end
from schemas import AvroCodec
from schemas.topics import KV_EVENTS, by_ownership_topic, changelog_topic
from stream_apps.snapshot import read_table, resident_rows


@dataclass
class RowCheck:
    """The residency table against the ground truth, in rows."""

    #: Resident rows in the truth.
    truth_rows: int
    #: Resident rows in the table.
    table_rows: int
    #: Rows equal on both sides.
    matching: int
    #: Rows of the truth the table does not hold.
    missing: int
    #: Resident rows of the table the truth does not have.
    extra: int
    #: Rows held with fewer copies than the truth.
    below: int
    #: Rows held with more copies than the truth.
    above: int
    #: Up to 10 differences: {"row": [...], "expected": copies or None, "actual": copies or None}.
    examples: list = field(default_factory=list)
    #: Differences per "<instance>/<tier>/<missing|extra|below|above>".
    by_source: dict = field(default_factory=dict)

    @property
    def matches(self) -> bool:
        """True when every row matches."""
        return not (self.missing or self.extra or self.below or self.above)

    @property
    def lost(self) -> int:
        """Rows missing or below the truth."""
        return self.missing + self.below

    @property
    def duplicated(self) -> int:
        """Rows above the truth or not in it."""
        return self.above + self.extra


def compare_residency(truth: dict, actual: dict) -> RowCheck:
    """Compare two ``{row identity: copies}`` maps and classify every difference."""
    check = RowCheck(len(truth), len(actual), 0, 0, 0, 0, 0)
    for identity in truth.keys() | actual.keys():
        want, got = truth.get(identity), actual.get(identity)
        if want == got:
            check.matching += 1
            continue
        if got is None:
            check.missing += 1
        elif want is None:
            check.extra += 1
        elif got < want:
            check.below += 1
        else:
            check.above += 1
        kind = "missing" if got is None else "extra" if want is None else "below" if got < want else "above"
        label = f"{identity[0]}/{identity[2]}/{kind}"
        check.by_source[label] = check.by_source.get(label, 0) + 1
        if len(check.examples) < 10:
            check.examples.append({"row": [*identity[:6], identity[6].hex()], "expected": want, "actual": got})
    return check


def check_residency(bootstrap: str, app_id: str, truth: dict) -> RowCheck:
    """Read ``<app_id>-residency-changelog`` to its end and compare its resident rows with ``truth``."""
    table = read_table(bootstrap, changelog_topic(app_id, "residency"), "residency", timeout_s=120)
    return compare_residency(truth, resident_rows(table))


def rekey_check(bootstrap: str, app_id: str) -> dict:
    """Which events of kv-events never reached ``<app_id>-kv-events-by-ownership`` (the repartition process's output).

    Returns:
        ``{"kv_events_distinct", "rekeyed_items", "rekeyed_distinct", "never_rekeyed"}``: distinct event
        payloads (a clear's copies count once) in kv-events, items in the re-keyed topic, distinct payloads
        among them, and payloads of kv-events missing from the re-keyed topic. Tells a loss in the repartition
        process from one in the materializing agent.
    """
    upstream = set(read_topic(bootstrap, KV_EVENTS))
    codec = AvroCodec("ownership_batch")
    items = 0
    rekeyed = set()
    for value in read_topic(bootstrap, by_ownership_topic(app_id)):
        for item in codec.decode(value)["events"]:
            items += 1
            rekeyed.add(item["event"])
    return {"kv_events_distinct": len(upstream), "rekeyed_items": items, "rekeyed_distinct": len(rekeyed),
            "never_rekeyed": len(upstream - rekeyed)}


def topic_messages(bootstrap: str, topic: str = KV_EVENTS) -> int:
    """Messages in ``topic``: the sum over its partitions of end offset minus start offset."""
    consumer = Consumer(client_config(bootstrap, **{"group.id": f"kvstream-chaos-{uuid.uuid4()}"}))
    try:
        metadata = consumer.list_topics(topic, timeout=30)
        total = 0
        for p in metadata.topics[topic].partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)
            total += high - low
        return total
    finally:
        consumer.close()


def read_topic(bootstrap: str, topic: str = KV_EVENTS, timeout_s: float = 120.0) -> list[bytes]:
    """Every message value of ``topic`` from the start to its current end, partition by partition."""
    return [message.value() for message in messages_to_end(bootstrap, topic, timeout_s)]


def _run_result(run: int, check: RowCheck, produced: int, in_topic: int, seconds: float,
                checks: dict[str, bool] | None = None, lost_in_topic: int | None = None, **detail) -> dict:
    """One run's entry of the results file."""
    checks = checks or {}
    missing_messages = max(produced - in_topic, 0) if lost_in_topic is None else lost_in_topic
    return {"run": run, "matches_truth": check.matches, "passed": check.matches and all(checks.values()),
            "events_produced": produced, "messages_in_topic": in_topic,
            "events_lost": missing_messages + check.lost, "duplicates_applied": check.duplicated,
            "rows": {k: v for k, v in asdict(check).items() if k not in ("examples", "by_source")},
            "differences_by_source": check.by_source,
            "differences": check.examples, "checks": checks, "seconds": round(seconds, 1), **detail}


def _diagnose(function, *args):
    """``function(*args)``, or the error it raised as text: a diagnosis must not lose the run's comparison."""
    try:
        return function(*args)
    except Exception as exc:  # noqa: BLE001 - reported in the results instead
        return f"diagnosis failed: {type(exc).__name__}: {exc}"


def _explain(worker: Worker, check: RowCheck) -> None:
    """Add the worker's own answer (``GET /residency/{hex}/``, its local table) to each difference of ``check``.

    Tells a table that is right locally but whose changelog missed an update from one that is wrong itself.
    """
    for difference in check.examples:
        identity = tuple(difference["row"][:6])
        try:
            status, body = http_json(f"{worker.url}/residency/{difference['row'][6]}/")
        except (OSError, ValueError) as exc:
            difference["worker_view"] = f"no answer: {exc}"
            continue
        difference["worker_view"] = _rows_of(body["rows"]).get(identity) if status == 200 else f"HTTP {status}"


def _answers(url: str, blocks: list[bytes]) -> dict:
    """Each block's ``GET /residency/{hex}/`` answer (rows, and sources without the clock-dependent lag), plus
    ``GET /occupancy/`` under the key ``"occupancy"``.

    Raises:
        RuntimeError: a lookup did not answer 200.
    """
    answers = {}
    for block in blocks:
        status, body = http_json(f"{url}/residency/{block.hex()}/")
        if status != 200:
            raise RuntimeError(f"GET {url}/residency/{block.hex()}/ answered {status}: {body}")
        answers[block.hex()] = {"rows": body["rows"],
                                "sources": [{k: v for k, v in s.items() if k != "lag_s"} for s in body["sources"]]}
    status, body = http_json(f"{url}/occupancy/")
    if status != 200:
        raise RuntimeError(f"GET {url}/occupancy/ answered {status}: {body}")
    answers["occupancy"] = sorted(body["occupancy"], key=lambda r: (r["ownership"] or "", r["tier"], r["instance_id"]))
    return answers


def _rows_of(answer_rows: list[dict]) -> dict:
    return {(r["instance_id"], r["data_parallel_rank"], r["tier"], r["ownership"], r["locality"], r["group_idx"]):
            r["copies"] for r in answer_rows}


def _http_agrees(answers: dict, truth: dict) -> int:
    """How many sampled blocks of ``answers`` (from :func:`_answers`) disagree with ``truth``."""
    by_block: dict[str, dict] = {}
    for identity, copies in truth.items():
        by_block.setdefault(identity[6].hex(), {})[identity[:6]] = copies
    return sum(1 for block, answer in answers.items()
               if block != "occupancy" and _rows_of(answer["rows"]) != by_block.get(block, {}))


#: Fields of a ``/sources/`` row that each worker measures by its own clock (``applied_ts``: a worker's own
#: writes at the write, the others' at their changelog record, up to ``--global-changelog-interval-s`` later).
_OWN_CLOCK_FIELDS = frozenset({"lag_s", "applied_ts", "arrival_lag_s"})


def _fleet_views(workers: list, truth: dict, settle_s: float = 20.0) -> dict:
    """Each worker's ``/occupancy/`` against the truth's resident rows per (ownership, tier, instance), and
    ``/sources/`` compared across workers (without what each worker measures by its own clock: ``lag_s``,
    ``applied_ts``, ``arrival_lag_s``), retried for ``settle_s`` while the global
    tables reach every worker. Returns each worker's occupancy total, the truth's, and whether all agree."""
    expected = Counter((own, tier, inst) for (inst, _, tier, own, _, _, _) in truth)
    deadline = time.monotonic() + settle_s
    while True:
        occupancy, sources = {}, {}
        for worker in workers:
            occupancy[worker.url] = {(r["ownership"], r["tier"], r["instance_id"]): r["resident_blocks"]
                                     for r in _get_json(f"{worker.url}/occupancy/")["occupancy"]}
            sources[worker.url] = [{k: v for k, v in s.items() if k not in _OWN_CLOCK_FIELDS}
                                   for s in _get_json(f"{worker.url}/sources/")["sources"]]
        occupancy_equal = all(o == expected for o in occupancy.values())
        sources_equal = all(s == next(iter(sources.values())) for s in sources.values())
        if (occupancy_equal and sources_equal) or time.monotonic() > deadline:
            return {"occupancy_totals": {url: sum(o.values()) for url, o in occupancy.items()},
                    "truth_total": sum(expected.values()), "occupancy_equal": occupancy_equal,
                    "sources_equal": sources_equal}
        time.sleep(0.5)


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _http_sample(url: str, truth: dict, sample: int, rng: random.Random) -> dict:
    """Ask ``sample`` resident blocks of ``truth`` over HTTP; returns {"asked", "wrong"}."""
    blocks = rng.sample(sorted({identity[6] for identity in truth}), min(sample, len(truth)))
    answers = _answers(url, blocks)
    return {"asked": len(blocks), "wrong": _http_agrees(answers, truth)}
