"""The ``materialize-residency`` agent: reads ``<app id>-kv-events-by-ownership`` and applies each batch message.

Thin by design: decode, apply (:class:`stream_apps.applier.BatchApplier`), dead-letter what cannot be
applied. The agent never waits for the broker: outputs are flushed by the checkpoint before Faust commits
offsets (:class:`stream_apps.checkpoint.Checkpoint`), so outputs of several messages can be unflushed at
once; a source-wide event runs a checkpoint before the record that marks it applied.
"""

from __future__ import annotations

import logging

import faust

from schemas import AvroCodec, DecodeError
from stream_apps.applier import BatchApplier, InvalidRecord, Materializer
from stream_apps.checkpoint import CheckpointError

log = logging.getLogger(__name__)

#: Name of the agent (and of its consumer's client id suffix).
AGENT_NAME = "materialize-residency"


def register_agent(app: faust.App, topic: faust.TopicT, materializer: Materializer, event_codec: AvroCodec) -> None:
    """Declare the agent on ``app``: every ``ownership_batch`` message of ``topic`` is applied with
    ``materializer``, its kv_event records decoded with ``event_codec`` (either framing, any writer schema
    it can resolve); undecodable or inapplicable events go to the dead-letter topic with the reason."""
    batch_codec = AvroCodec("ownership_batch")
    outputs = materializer.outputs

    async def materialize_residency(stream):
        async for event in stream.events():
            message = event.message
            where = f"{message.topic}/{message.partition}/{message.offset}"
            try:
                batch = batch_codec.decode(event.value)
            except DecodeError as exc:
                outputs.dead_letter(message.key, message.value, str(exc), where)
                continue
            applier = BatchApplier(materializer, message.partition)
            for item in batch["events"]:
                try:
                    applier.apply(item, event_codec.decode(item["event"]))
                except CheckpointError as exc:  # never dead-letter a clear whose removals may be lost: stop
                    log.error("stopping the worker: %s", exc)
                    await app.crash(exc)
                    raise
                except (DecodeError, InvalidRecord) as exc:
                    outputs.dead_letter(item["key"].encode(), item["event"], str(exc), where)
                except Exception as exc:  # a record this code cannot apply: keep it, say why, go on
                    log.exception("could not apply %s", item["key"])
                    outputs.dead_letter(item["key"].encode(), item["event"],
                                        f"could not apply: {type(exc).__name__}: {exc}", where)
            applier.finish()

    app.agent(topic, name=AGENT_NAME)(materialize_residency)
