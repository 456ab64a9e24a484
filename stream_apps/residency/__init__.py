"""Residency semantics, in three modules of one concern each:

* :mod:`stream_apps.residency.rules`: what one event does to a block's residency entry (the rules, no Kafka and
  no Faust, so tests call them directly);
* :mod:`stream_apps.residency.keys`: the table's keys and their Kafka partitions;
* :mod:`stream_apps.residency.settings`: per-source settings (clear scope, aggregation) and tier weights.

The names below are the package's API; the materializing agent (:mod:`stream_apps.applier`), the repartition
stage, the views and the tests import them from here.
"""

from stream_apps.residency.keys import KAFKA_MURMUR2_SEED, PRIMARY, block_key, key_partition, residency_key
from stream_apps.residency.rules import (
    AGREEMENT_FIELDS,
    ApplyStats,
    aggregate_copies,
    apply_block,
    apply_block_event,
    apply_clear,
    apply_unregister,
    content_digest,
    needs_content,
    retire_epoch,
    source_aggregation,
)
from stream_apps.residency.settings import (
    ALL_TIERS,
    DEFAULT_CLEAR_TIERS,
    DEFAULT_TIER_WEIGHTS,
    SourceSettings,
    parse_tier_weights,
)

__all__ = [
    "AGREEMENT_FIELDS",
    "ALL_TIERS",
    "DEFAULT_CLEAR_TIERS",
    "DEFAULT_TIER_WEIGHTS",
    "KAFKA_MURMUR2_SEED",
    "PRIMARY",
    "ApplyStats",
    "SourceSettings",
    "aggregate_copies",
    "apply_block",
    "apply_block_event",
    "apply_clear",
    "apply_unregister",
    "block_key",
    "content_digest",
    "key_partition",
    "needs_content",
    "parse_tier_weights",
    "residency_key",
    "retire_epoch",
    "source_aggregation",
]
