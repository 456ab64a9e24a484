"""Topic names of the pipeline: part of the contract, named after the domain (STYLE.md)."""

#: Block-level KV events from every producer, Avro ``kv_event``, key = canonical block hash.
KV_EVENTS = "kv-events"
#: The same events re-keyed by ``<ownership>/<block hash hex>`` (stream app repartition topic).
KV_EVENTS_BY_OWNERSHIP = "kv-events-by-ownership"
#: Records that could not be decoded or applied, with the reason in the ``kvstream-error`` header.
KV_EVENTS_DEAD_LETTER = "kv-events-dead-letter"
