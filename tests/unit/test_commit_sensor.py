"""The at-least-once order depends on Faust calling the commit sensor before it reads the acknowledged offsets
(stream_apps.checkpoint.CommitSensor). Faust's API does not promise it; this runs the installed Faust's own
``Consumer.force_commit`` and fails if an upgrade changes the order."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from faust.transport.consumer import Consumer


class _Recorder:
    """What force_commit touches, recording the order of the calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.diag = SimpleNamespace(set_flag=lambda flag: None, unset_flag=lambda flag: None)
        self.app = SimpleNamespace(sensors=SimpleNamespace(on_commit_initiated=self._initiated,
                                                           on_commit_completed=self._completed))

    def _initiated(self, consumer) -> str:
        self.calls.append("sensor")
        return "state"

    def _completed(self, consumer, state) -> None:
        assert state == "state"
        self.calls.append("completed")

    def _filter_tps_with_pending_acks(self, topics):
        self.calls.append("pending acks read")
        return iter(["tp"])

    async def _commit_tps(self, tps, start_new_transaction: bool) -> bool:
        self.calls.append("offsets committed")
        return True


def test_faust_calls_the_commit_sensor_before_it_reads_the_acknowledged_offsets():
    recorder = _Recorder()
    assert asyncio.run(Consumer.force_commit(recorder)) is True
    assert recorder.calls == ["sensor", "pending acks read", "offsets committed", "completed"]
