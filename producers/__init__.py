"""How events get into Kafka: engine batches split per block and produced as Avro.

* :mod:`producers.engine_events`: one engine event parsed and checked (vLLM's and SGLang's fields);
* :mod:`producers.split`: engine events -> block-level ``kv_event`` records; :mod:`producers.rebuild` the way back;
* :mod:`producers.kafka_sink`: the Kafka producer every source shares;
* :mod:`producers.bridge` (and its ``bridge_*`` modules): live engine publishers over ZMQ;
* :mod:`producers.capture`: capture files;
* :mod:`producers.trace` and :mod:`producers.simulator`: the Mooncake trace and the cluster simulator that
  replays it.
"""
