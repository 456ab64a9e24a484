"""The vLLM-protocol test publisher now lives in :mod:`producers.vllm_publisher` (``kvstream chaos`` uses it too)."""

from producers.vllm_publisher import (AllBlocksCleared, BlockRemoved, BlockStored, EventBatch,  # noqa: F401
                                      FakeVllmPublisher, KVCacheEvent)
