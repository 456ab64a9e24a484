"""The tail step of ``make bench``: ``kvstream tail`` against kcat over the same topic."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import time

from bench.harness import _say


class TailStep:
    """The tail step of :class:`bench.run.Bench` (a mixin: it uses the run's broker, options and results)."""

    def _time_process(self, argv: list[str], runs: int = 2) -> float:
        """Best wall time of ``runs`` runs of a command with its output to /dev/null, in seconds.

        Raises:
            RuntimeError: the command exited with a non-zero code (its standard error in the message).
        """
        import subprocess

        best = math.inf
        for _ in range(runs):
            t0 = time.perf_counter()
            done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=self.o.timeout_s)
            seconds = time.perf_counter() - t0
            if done.returncode != 0:
                raise RuntimeError(f"{argv[0]} exited with {done.returncode}: {done.stderr.decode()[-500:]}")
            best = min(best, seconds)
        return best

    def _tail_vs_kcat(self, topic: str) -> dict:
        """tail's and kcat's rates over every message of ``topic``, one after the other."""
        from confluent_kafka import Consumer, TopicPartition

        from kafka_io.config import client_config

        consumer = Consumer(client_config(self.bootstrap, **{"group.id": "bench-tail-count"}))
        try:
            partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
            messages = 0
            for p in partitions:
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                messages += high - low
        finally:
            consumer.close()
        registry = ["--schema-registry", self.o.schema_registry] if self.o.schema_registry else []
        tail_s = self._time_process([sys.executable, "-c", "import sys; from kvstream.cli import main; "
                                     "sys.exit(main())", "tail", topic, "--bootstrap-servers", self.bootstrap,
                                     "--from-beginning", "--to-end", *registry])
        found = {"topic": topic, "messages": messages, "tail_s": round(tail_s, 3),
                 "tail_messages_per_s": round(messages / tail_s)}
        kcat = shutil.which("kcat") or shutil.which("kafkacat")
        if kcat is None:
            found["kcat_skipped"] = "kcat is not installed (Debian: apt-get install kcat)"
            return found
        kcat_s = self._time_process([kcat, "-C", "-b", self.bootstrap, "-t", topic, "-o", "beginning", "-e", "-q"])
        found.update(kcat_s=round(kcat_s, 3), kcat_messages_per_s=round(messages / kcat_s),
                     tail_vs_kcat=round(kcat_s / tail_s, 3))
        # kcat above prints the raw bytes; in registry mode a kcat built with Avro support decodes them to JSON
        # as tail does (the same job), so that ratio is in details too
        avro_kcat = _kcat_with_avro()
        if self.o.schema_registry and avro_kcat:
            avro_s = self._time_process([avro_kcat, "-C", "-b", self.bootstrap, "-t", topic, "-o", "beginning", "-e",
                                         "-q", "-s", "value=avro", "-r", self.o.schema_registry, "-f", "%s\n"])
            found.update(kcat_avro_s=round(avro_s, 3), kcat_avro_messages_per_s=round(messages / avro_s),
                         tail_vs_kcat_avro=round(avro_s / tail_s, 3))
        return found

    def step_tail(self) -> None:
        """``kvstream tail`` against kcat on kv-events (and on a changes topic, if a stream step made one)."""
        self._stream_input()
        from schemas.topics import KV_EVENTS, TopicNames

        main = self._tail_vs_kcat(KV_EVENTS)
        topics = {KV_EVENTS: main}
        changes = TopicNames("bench-1w").residency_changes
        from confluent_kafka.admin import AdminClient

        from kafka_io.config import client_config

        if changes in AdminClient(client_config(self.bootstrap)).list_topics(timeout=10).topics:
            topics[changes] = self._tail_vs_kcat(changes)
        self._set("tail_messages_per_s", main["tail_messages_per_s"], topics=topics)
        self._set("kcat_messages_per_s", main.get("kcat_messages_per_s"), **(
            {"skipped": main["kcat_skipped"]} if "kcat_skipped" in main else {}))
        self._set("tail_vs_kcat", main.get("tail_vs_kcat"))
        for topic, found in topics.items():
            _say(f"      {topic}: {found['messages']:,} messages; tail {found['tail_messages_per_s']:,}/s, kcat "
                 + (f"{found['kcat_messages_per_s']:,}/s: tail/kcat {found['tail_vs_kcat']:.2f}"
                    if "kcat_s" in found else f"skipped ({found['kcat_skipped']})"))


def _kcat_with_avro() -> str | None:
    """A kcat that decodes Confluent-framed Avro (``-s value=avro``; Debian's package does not), or None."""
    for candidate in ("/opt/kcat-avro/bin/kcat", shutil.which("kcat")):
        if candidate and shutil.which(candidate):
            shown = subprocess.run([candidate, "-h"], capture_output=True, text=True, check=False)
            if "avro" in (shown.stdout + shown.stderr).lower():
                return candidate
    return None
