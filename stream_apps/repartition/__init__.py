"""The repartition process of the stream app: re-key ``kv-events`` by ownership and block hash, off Faust's
per-message path.

Every block event is one Kafka message (docs/contract.md, "One Kafka message per
block-level event"), and Faust spends more on each message it consumes than the
whole re-keying costs, so this stage is a confluent-kafka consumer loop in a
child process of the worker (:class:`RepartitionProcess`, started by the
worker), in its own consumer group ``<app id>-repartition``. It reads batches
of up to ``batch_size`` messages (whole batches while the input is backlogged; otherwise what arrived
within ``linger_s``, longer while the agent is still applying the previous batch: :meth:`Repartitioner._read`)
and, per batch:

1. decodes each event and computes its residency key
   ``<ownership or primary>/<block hash hex>`` and the key's partition (Kafka's
   murmur2, as Faust's router computes it, so the tables stay co-partitioned
   with the re-keyed topic and HTTP lookups route by key), and writes the
   fields the residency rules read as the item's block fields
   (:mod:`schemas.block_event`), so that the materializing stage, the
   worker's bottleneck, does not decode the record again. A store written
   without a content hash (by a producer of before ``kv_event`` v4, or from
   an old capture) but with token ids gets the one its tokens and extra keys
   give there (:meth:`schemas.block_event.BlockFieldsWriter.block`), so every
   store with tokens that says its extra keys reaches the agent with its
   content keys (a vLLM store without ``extra_keys`` does not, and gets none:
   :func:`schemas.content_hash.says_extra_keys`); only such records pay for it;
2. stamps it with its source's latest ``AllBlocksCleared`` before it on its
   kv-events partition (the *clear mark*: after re-keying, a clear's copy and
   a block's events can reach a partition in either order);
3. makes one ``ownership_batch`` message per destination partition (split at
   :data:`MAX_BATCH_BYTES`); source-wide events (clears, the bridge's
   ``PublisherRestarted``, ``SourceStale`` and ``SourceDisconnected``, the producers'
   ``SourceHeartbeat``, ``SourceUnregistered``) keep their partition number;
4. runs the worker's checkpoint protocol (:class:`stream_apps.checkpoint.Checkpoint`, whose docstring has the order
   and why): produce the batch's messages and changed clear histories, wait for every acknowledgement, and only
   then commit the batch's offsets (asynchronously: the next batch does not wait for the commit): at least once.
   A redelivered event reaches the materializing agent again and is ignored there (idempotent rows,
   :mod:`stream_apps.residency`).

Clear marks survive restarts and rebalances: each source's last clears on a
partition, with their offsets, are written to the compacted topic
``<app id>-repartition-source-clears`` and read back when the partition is
assigned. An event's mark is the latest clear *before its offset*, so a
replayed event gets the mark it got the first time.

Undecodable or contract-breaking records go to ``kv-events-dead-letter`` with
the reason in the ``kvstream-error`` header and the original bytes.

Modules: :mod:`~stream_apps.repartition.clear_history`, :mod:`~stream_apps.repartition.batches`,
:mod:`~stream_apps.repartition.loop` and :mod:`~stream_apps.repartition.process`; the names below are the
package's API.
"""

from stream_apps.repartition.batches import MAX_BATCH_BYTES, PartitionBatch
from stream_apps.repartition.clear_history import CLEAR_HISTORY, ClearHistory
from stream_apps.repartition.loop import AGENT_CHECK_S, NOT_READ_HERE, Repartitioner, repartition_group
from stream_apps.repartition.process import RepartitionProcess, RepartitionService, new_agent_progress

__all__ = ["AGENT_CHECK_S", "CLEAR_HISTORY", "MAX_BATCH_BYTES", "NOT_READ_HERE", "ClearHistory", "PartitionBatch",
           "RepartitionProcess", "RepartitionService", "Repartitioner", "new_agent_progress", "repartition_group"]
