"""The ``materialize-residency`` agent: reads ``<app id>-kv-events-by-ownership`` and applies each batch message.

Thin by design: read (one pass per batch message, :class:`schemas.ownership_batch.OwnershipBatchReader`: block
events come as :class:`schemas.block_event.BlockEvent` tuples, others as records), apply
(:class:`stream_apps.applier.BatchApplier`), dead-letter what cannot be applied. The agent never
waits for the broker: the checkpoint flushes the outputs before Faust commits offsets (the order is in
:class:`stream_apps.checkpoint.Checkpoint`'s docstring), so outputs of several messages can be unflushed at once; a
source-wide event runs a checkpoint before the record that marks it applied.
"""

from __future__ import annotations

import logging

import faust

from schemas import AvroCodec, DecodeError
from schemas.ownership_batch import OwnershipBatchReader
from stream_apps.applier import BatchApplier, InvalidRecord, Materializer, NeedsRecord
from stream_apps.checkpoint import CheckpointError

log = logging.getLogger(__name__)

#: Name of the agent (and of its consumer's client id suffix).
AGENT_NAME = "materialize-residency"


def message_applier(app: faust.App, materializer: Materializer, event_codec: AvroCodec):
    """The agent's work on one ``ownership_batch`` message: ``await apply(topic, partition, offset, key, value)``
    reads it (its kv_event records decoded with ``event_codec``: either framing, any writer schema it can
    resolve) and applies it with ``materializer``; an undecodable message or event goes to the dead-letter topic
    with the reason. A :class:`~stream_apps.checkpoint.CheckpointError` crashes ``app`` and is raised.

    Both readers of the re-keyed topic call it: Faust's agent (:func:`register_agent`) and
    :class:`stream_apps.rekeyed_reader.RekeyedReader`. Nothing in it awaits but the crash, so a message is
    applied whole within one step of the event loop.
    """
    reader = OwnershipBatchReader(event_codec)
    decode = event_codec.decode
    outputs = materializer.outputs

    async def apply_message(topic: str, partition: int, offset: int, message_key: bytes | None,
                            value: bytes) -> None:
        where = f"{topic}/{partition}/{offset}"
        try:
            items = reader.read(value)
        except DecodeError as exc:
            outputs.dead_letter(message_key, value, str(exc), where)
            return
        materializer.materialized += len(items)
        applier = BatchApplier(materializer, partition)
        apply, apply_record = applier.apply, applier.apply_record

        def apply_other(item: tuple, error: Exception | None) -> None:
            """An item the applier's loop left to Python (a record, or a store that needs its record), or one
            whose apply raised ``error``: applied, or dead-lettered with the reason. A CheckpointError is
            raised on: it stops the worker."""
            key, mark, buffer, start, end, event = item
            try:
                if error is not None:
                    raise error
                if type(event) is tuple:  # a store of a replicated source whose content digest is missing
                    try:
                        apply(key, mark, event)
                    except NeedsRecord:
                        apply_record(key, mark, decode(buffer[start:end]))
                else:
                    apply_record(key, mark, decode(buffer[start:end]) if event is None else event)
            except CheckpointError:  # never dead-letter a clear whose removals may be lost
                raise
            except (DecodeError, InvalidRecord) as exc:
                outputs.dead_letter(key.encode(), buffer[start:end], str(exc), where)
            except Exception as exc:  # a record this code cannot apply: keep it, say why, go on
                log.exception("could not apply %s", key)
                outputs.dead_letter(key.encode(), buffer[start:end],
                                    f"could not apply: {type(exc).__name__}: {exc}", where)

        try:
            applier.apply_all(items, apply_other)
        except CheckpointError as exc:
            log.error("stopping the worker: %s", exc)
            await app.crash(exc)
            raise
        applier.finish()

    return apply_message


def register_agent(app: faust.App, topic: faust.TopicT, apply_message) -> None:
    """Declare the agent on ``app``: every message of ``topic`` that Faust's consumer hands to its stream is
    applied with ``apply_message`` (:func:`message_applier`). With the worker's default reader
    (:class:`stream_apps.rekeyed_reader.RekeyedReader`) the stream stays empty: the agent is declared all the
    same, since its topic is what Faust's assignor gives the tables' partitions by."""

    async def materialize_residency(stream):
        async for batch in stream.events():
            message = batch.message
            await apply_message(message.topic, message.partition, message.offset, message.key, batch.value)

    app.agent(topic, name=AGENT_NAME)(materialize_residency)
