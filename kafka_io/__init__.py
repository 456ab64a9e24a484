"""Kafka plumbing shared by the producers, the stream app and the tools, one place each.

- :mod:`kafka_io.config`: client and producer settings, security (TLS, SASL), librdkafka's log.
- :mod:`kafka_io.admin`: create topics, partition counts, consumer group progress.
- :mod:`kafka_io.produce`: produce with back-pressure.
- :mod:`kafka_io.reader`: read a topic to its end without a consumer group.

Imports only :mod:`schemas` and client libraries; never the producers, the stream app or the CLI.
"""
