"""The repartition child's re-keying alone, in memory: ``python -m bench.repartition_child``.

Runs :meth:`stream_apps.repartition.Repartitioner.process` over the simulator's records of the trace, in batches as
the child reads them, with no broker: the consumer and the producer only take what they are given. Prints the CPU
µs per event, the best of ``--runs``. It leaves out librdkafka, the broker and a profiler's overhead, so it
spreads less than a worker's figures: bench/PROFILE.md's eighth round compares commits with it.
``KVSTREAM_PURE_PYTHON=1`` measures the pure-Python path.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

from kvstream.options import positive_int


class _Message:
    """What the loop reads of a confluent-kafka message."""

    __slots__ = ("_partition", "_offset", "_value")

    def __init__(self, partition: int, offset: int, value: bytes) -> None:
        self._partition, self._offset, self._value = partition, offset, value

    def error(self):
        return None

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes:
        return self._value

    def key(self):
        return None

    def topic(self) -> str:
        return "kv-events"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.repartition_child", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=positive_int, default=None, metavar="N",
                   help="trace requests to simulate (default: the whole trace, about 1.2 million events)")
    p.add_argument("--batch", type=positive_int, default=10_000, metavar="N",
                   help="messages per batch, as --repartition-batch (default: %(default)s)")
    p.add_argument("--partitions", type=positive_int, default=8, metavar="N",
                   help="partitions of kv-events and of the re-keyed topic (default: %(default)s)")
    p.add_argument("--runs", type=positive_int, default=5, metavar="N",
                   help="passes over the events; the best is printed (default: %(default)s)")
    args = p.parse_args(argv)

    from bench.trace import _fleet_batches, _records
    from producers.simulator import load_trace
    from schemas import AvroCodec
    from schemas.topics import TopicNames
    from stream_apps.hotpath import hotpath
    from stream_apps.repartition import Repartitioner

    events = AvroCodec("kv_event")
    print(f"simulating {'the whole trace' if args.requests is None else f'{args.requests:,} trace requests'}...",
          flush=True)
    batches, _ = _fleet_batches(load_trace(limit=args.requests))
    messages = [_Message(n % args.partitions, n, events.encode(record)) for n, record in enumerate(_records(batches))]
    producer = SimpleNamespace(produce=lambda *a, **k: None, flush=lambda *a: 0, poll=lambda *a: 0)
    repartitioner = Repartitioner("unused:0", TopicNames("bench"), args.partitions,
                                  {"repartitioned": 0, "dead_lettered": 0},
                                  stop_event=SimpleNamespace(is_set=lambda: False),
                                  consumer=SimpleNamespace(commit=lambda **k: None), producer=producer)
    print(f"{len(messages):,} events; {hotpath().describe()}; {args.runs} runs", flush=True)
    best = float("inf")
    for run in range(args.runs):
        start = time.process_time()
        for i in range(0, len(messages), args.batch):
            repartitioner.process(messages[i:i + args.batch])
        spent = time.process_time() - start
        best = min(best, spent)
        print(f"  run {run + 1}: {spent / len(messages) * 1e6:.2f} µs per event", flush=True)
    print(f"best: {best / len(messages) * 1e6:.2f} µs of CPU per event")


if __name__ == "__main__":
    main()
