"""Registrations (stream_apps/index/registrations.py): the record round trip and the producers' merge."""

from __future__ import annotations

import pytest

from schemas import AvroCodec
from stream_apps.index.fleet_index import SourceInfo
from stream_apps.index.registrations import merge_registration, registration_of, registration_record

PROFILE = {"strategy": "vllm_v1", "algorithm": "sha256", "python_hash_seed": "0", "index_projection": "low64_be"}


def test_a_registration_survives_its_avro_record():
    info = SourceInfo("e1", model_name="llama-3", block_size=16, tenant_id="team-a", endpoint="tcp://h:5557",
                      replay_endpoint="tcp://h:5567", engine_type="vLLM", dp_ranks={2, 0}, lora_name="sql",
                      hash_profile=PROFILE)
    codec = AvroCodec("instance_registration")
    record = codec.decode(codec.encode(registration_record(info, now=12.5)))
    assert record["dp_ranks"] == [0, 2] and record["registered_at"] == 12.5
    assert registration_of(record) == info


def test_a_hash_profile_that_is_not_a_json_map_is_refused():
    record = registration_record(SourceInfo("e1"), now=1.0)
    with pytest.raises(ValueError, match="not a JSON map"):
        registration_of({**record, "hash_profile": "[1, 2]"})


def test_a_producers_registration_adds_to_a_routers_and_erases_nothing():
    router = SourceInfo("e1", tenant_id="team-a", dp_ranks={1}, hash_profile=PROFILE, endpoint="tcp://old:1")
    bridge = SourceInfo("e1", model_name="qwen-2", block_size=32, endpoint="tcp://new:5557", dp_ranks={0})
    merged = merge_registration(router, bridge)
    assert (merged.model_name, merged.block_size, merged.tenant_id, merged.dp_ranks, merged.hash_profile,
            merged.endpoint) == ("qwen-2", 32, "team-a", {0, 1}, PROFILE, "tcp://new:5557")
    assert merge_registration(None, bridge) is bridge
