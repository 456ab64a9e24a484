"""Test doubles and helpers shared by the tests, the benchmark and the fault scenarios; not packaged.

- :mod:`harness.vllm_publisher`: a KV event publisher that speaks vLLM 0.33's ZMQ protocol.
- :mod:`harness.payloads`: real engine payloads, byte for byte.
"""
