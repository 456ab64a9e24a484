"""How events get into Kafka: engine batches split per block and produced as Avro.

* :mod:`producers.split`: engine events -> block-level ``kv_event`` records.
* :mod:`producers.kafka_sink`: the Kafka producer every source shares.
* :mod:`producers.simulator`: the cluster simulator that replays the Mooncake trace.
"""
