"""The corrections of stream_apps.consumer_fixes, on mode's real flow-control objects (the driver's two are
exercised by the rebalance runs of tests/chaos and make chaos, against a broker)."""

from __future__ import annotations

import asyncio

from mode.utils.queues import FlowControlEvent, FlowControlQueue

from stream_apps import consumer_fixes


def test_resuming_an_active_flow_keeps_the_messages_an_agent_has_not_taken_yet():
    consumer_fixes.install()

    async def scenario() -> tuple[int, int]:
        flow = FlowControlEvent(initially_suspended=False)
        queue = FlowControlQueue(flow_control=flow, clear_on_resume=True)
        queue.put_nowait("a message fetched during the seek")
        flow.resume()  # what Faust's recovery calls at its end, while the flow is already active
        kept = queue.qsize()
        flow.suspend()
        flow.resume()  # after a real suspension, stale messages are still dropped
        return kept, queue.qsize()

    assert asyncio.run(scenario()) == (1, 0)
