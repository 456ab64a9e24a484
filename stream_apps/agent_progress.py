"""What the repartition process knows of the materializing agent's progress: the batches it waits for.

The agent pays a fixed cost per ``ownership_batch`` message (Faust's own per-message path, the batch's
small-table writes), so the repartition process must not cut batches faster than the agent finishes them
(:meth:`stream_apps.repartition.Repartitioner._read`). It learns how far the agent got from a shared array
that :class:`AgentProgress`, a Faust sensor in the worker, updates as the agent finishes messages.
"""

from __future__ import annotations

import faust

from stream_apps.repartition import NOT_READ_HERE


class AgentProgress(faust.Sensor):
    """Writes, per partition of the re-keyed topic, the offset of the last message the agent finished.

    Args:
        topic: the re-keyed topic (``<app id>-kv-events-by-ownership``); other topics are ignored.
        progress: a shared int64 array with one element per partition
            (:attr:`stream_apps.repartition.RepartitionProcess.agent_progress`); :data:`NOT_READ_HERE` for a
            partition this worker's agent does not read.
    """

    def __init__(self, topic: str, progress) -> None:
        super().__init__()
        self.topic = topic
        self.progress = progress

    def on_message_out(self, tp, offset: int, message) -> None:
        # Faust calls this once every stream has acknowledged the message: the agent is done with it
        if tp.topic == self.topic:
            self.progress[tp.partition] = offset

    def assigned(self, partitions: set[int]) -> None:
        """Partitions of the re-keyed topic now read here: a newly assigned one waits for its first finished
        message; one that left is no longer waited for."""
        progress = self.progress
        for partition in range(len(progress)):
            if partition not in partitions:
                progress[partition] = NOT_READ_HERE
            elif progress[partition] == NOT_READ_HERE:
                progress[partition] = -1
