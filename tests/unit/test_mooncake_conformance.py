"""Mooncake's conductor API, rule by rule, as its current document states it, with the document's own examples.

The document: ``docs/source/design/conductor/indexer-api-design.md`` of kvcache-ai/Mooncake (branch
``dev/conductor``, August 2026), and the query semantics of ``conductor-architecture-design.md`` ("What query
fields mean") beside it. Each test is one rule the document states (its words in the docstring), driving
:class:`~stream_apps.index.api.IndexAPI` directly in msgpack, as the conductor speaks. Where kvstream differs on
purpose, the test says so and asserts what kvstream does instead (docs/querying.md, "Mooncake's conductor API").
The same rules over real HTTP, against a real broker: tests/integration/test_index.py.
"""

from __future__ import annotations

import struct

import msgspec
import pytest

from schemas.content_hash import content_hash, query_extra_keys
from stream_apps.index.api import IndexAPI
from stream_apps.index.fleet_index import FleetIndex
from stream_apps.index.liveness import SourceLeases

MSGPACK = "application/msgpack"
BLOCK = 16
PROFILE = {"strategy": "vllm_v1", "algorithm": "sha256_cbor", "python_hash_seed": "0",
           "index_projection": "low64_be"}
#: The document's minimal /register body.
MINIMAL_REGISTER = {"endpoint": "tcp://127.0.0.1:5557", "type": "vLLM", "modelname": "test-model",
                    "instance_id": "engine-a", "block_size": 16, "dp_rank": 0, "hash_profile": PROFILE}
#: The document's resolved profile (``/services``, ``/global_view``): the seed's root derived.
RESOLVED = {"strategy": "vllm_v1", "algorithm": "sha256_cbor", "python_hash_seed": "0",
            "root_digest": "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e",
            "index_projection": "low64_be"}
TOKENS = list(range(64))  # four blocks of 16


class Writer:
    """A stand-in for the ``kv-instances`` writer: records what the API wrote."""

    def __init__(self) -> None:
        self.written, self.removed = [], []

    def write(self, info) -> None:
        self.written.append(info)

    def remove(self, instance_id: str) -> None:
        self.removed.append(instance_id)


@pytest.fixture
def index():
    return FleetIndex(default_block_size=BLOCK)


@pytest.fixture
def unregistered():
    return []


@pytest.fixture
def api(index, unregistered):
    return IndexAPI(index, list, on_unregister=lambda instance, rank, reason: unregistered.append((instance, rank)),
                    registrations=Writer())


def call(handler, body, content_type: str | None = MSGPACK) -> tuple[int, dict, str]:
    """``(status, decoded body, content type)`` of one handler call with a msgpack (or raw bytes) body."""
    data = body if isinstance(body, bytes) else msgspec.msgpack.encode(body)
    reply = handler(data, content_type, None)
    decode = msgspec.msgpack.decode if reply.content_type == MSGPACK else msgspec.json.decode
    return reply.status, decode(reply.body), reply.content_type


def register(api, **changes) -> tuple[int, dict]:
    status, body, _ = call(api.register, {**MINIMAL_REGISTER, **changes})
    return status, body


def query(api, tokens=TOKENS, **fields) -> tuple[int, dict]:
    body = {"model": "test-model", "block_size": BLOCK, "token_ids": struct.pack(f"<{len(tokens)}i", *tokens),
            **fields}
    status, answer, _ = call(api.query, body)
    return status, answer


def with_older_names(instances: dict) -> dict:
    """The document's ``instances`` with the figures under its older API's names beside (``GPU``, ``CPU``,
    ``DISK``, ``DP``: the same values), as kvstream answers them for older clients."""
    return {instance: {**row, "GPU": row["gpu"], "CPU": row["cpu"], "DISK": row["disk"], "DP": dict(row["dp"])}
            for instance, row in instances.items()}


def store(index, instance: str, layout: list[set[str]], rank: int = 0, seed: int = 1, tokens=TOKENS) -> None:
    """Residency entries as the workers write them: block ``i`` of ``tokens`` held by (``instance``, ``rank``) on
    the tiers ``layout[i]`` (an empty set: not held), each block under an engine hash of ``seed``'s chain."""
    parent = None
    for i, tiers in enumerate(layout):
        block = tokens[i * BLOCK:(i + 1) * BLOCK]
        engine_hash = (seed * 1_000_003 + i + 1).to_bytes(8, "big")
        rows = [{"instance_id": instance, "data_parallel_rank": rank, "tier": tier, "copies": 1}
                for tier in sorted(tiers)]
        index.apply_entry(f"primary/{engine_hash.hex()}", {
            "block_hash": engine_hash, "ownership": None, "rows": rows, "parent_block_hash": parent,
            "content_hash": content_hash(block, query_extra_keys(i, None, None))})
        parent = engine_hash


# -- Common request and response rules ---------------------------------------------------------------------------


def test_success_answers_are_msgpack_maps_with_the_msgpack_content_type(api):
    """"success responses and error bodies are msgpack maps with Content-Type: application/msgpack"."""
    for handler, body in ((api.register, MINIMAL_REGISTER), (api.query, {"model": "test-model", "block_size": 16,
                                                                         "token_ids": b""}),
                          (api.unregister, {"instance_id": "engine-a", "dp_rank": 0})):
        status, answer, content_type = call(handler, body)
        assert (status, content_type, type(answer)) == (200, MSGPACK, dict)
    status, answer, content_type = call(api.unregister, {"instance_id": "engine-a", "dp_rank": 0})
    assert (status, content_type, type(answer)) == (404, MSGPACK, dict)


@pytest.mark.parametrize("endpoint, body", [
    ("register", {**MINIMAL_REGISTER, "root_digest": "00"}),
    ("unregister", {"instance_id": "engine-a", "dp_rank": 0, "root_digest": "00"}),
    ("query", {"model": "test-model", "block_size": 16, "token_ids": b"", "root_digest": "00"}),
])
def test_unknown_fields_are_rejected_on_every_endpoint(api, endpoint, body):
    """"Unknown fields are rejected on every endpoint." The document's example error map, exactly."""
    assert call(getattr(api, endpoint), body)[:2] == (400, {"error": "unsupported request field: root_digest",
                                                            "reason": "unknown_field", "field": "root_digest"})


def test_an_array_element_error_carries_its_index(api):
    """"index is also present when one array element caused it": the document's string element of token_ids."""
    body = {"model": "test-model", "block_size": 16, "token_ids": ["1"]}
    assert call(api.query, body)[:2] == (400, {"error": "token_ids element must be an integer",
                                               "reason": "invalid_type", "field": "token_ids", "index": 0})
    # the first bad element is named, wherever it is
    body["token_ids"] = [1, 2, "3"]
    assert call(api.query, body)[1]["index"] == 2


@pytest.mark.parametrize("endpoint", ["register", "unregister", "query"])
@pytest.mark.parametrize("body", [b"\xc1", b"\x92\x01\x02", b"\xa3abc", b""])
def test_malformed_msgpack_or_a_non_map_body_is_invalid_msgpack(api, endpoint, body):
    """"Malformed msgpack body or a non-map body on any POST endpoint": 400 ``Invalid msgpack object``."""
    assert call(getattr(api, endpoint), body)[:2] == (400, {"error": "Invalid msgpack object",
                                                            "reason": "invalid_msgpack"})


def test_a_json_body_is_taken_where_the_conductor_refuses_it(api):
    """The document: "Any POST endpoint with a non-msgpack Content-Type": 400 ``unsupported_content_type``.
    kvstream differs on purpose: it also reads JSON (and answers it in JSON), which curl and Dynamo's clients
    send; msgpack stays what it answers msgpack requests in."""
    status, answer, content_type = call(api.register, msgspec.json.encode(MINIMAL_REGISTER), "application/json")
    assert (status, answer, content_type) == (200, {"status": "registered successfully", "instance_id": "engine-a"},
                                              "application/json")


@pytest.mark.parametrize("accept, content_type, expected", [
    (None, None, MSGPACK), (MSGPACK, None, MSGPACK), ("application/json", None, "application/json")])
def test_a_wrong_method_is_405_method_not_allowed(api, accept, content_type, expected):
    """"GET on /register, /unregister, or /query; POST on /global_view or /services": 405 ``{"error":"Method not
    allowed"}`` (the routes: tests/integration/test_index.py)."""
    reply = api.method_not_allowed(accept, content_type)
    decode = msgspec.msgpack.decode if reply.content_type == MSGPACK else msgspec.json.decode
    assert (reply.status, reply.content_type, decode(reply.body)) == (405, expected, {"error": "Method not allowed"})


# -- POST /register ----------------------------------------------------------------------------------------------


def test_the_minimal_registration_answers_registered_successfully(api):
    """The minimal request: status 200 and ``{"status": "registered successfully", "instance_id": "engine-a"}``."""
    assert register(api) == (200, {"status": "registered successfully", "instance_id": "engine-a"})


@pytest.mark.parametrize("field", ["endpoint", "type", "modelname", "instance_id", "block_size", "dp_rank",
                                   "hash_profile"])
def test_every_required_registration_field_is_required(api, field):
    """The table's "Required: Yes" fields: each missing one is refused by name."""
    body = {name: value for name, value in MINIMAL_REGISTER.items() if name != field}
    assert call(api.register, body)[:2] == (400, {"error": f"missing required field: {field}",
                                                  "reason": "missing_field", "field": field})


@pytest.mark.parametrize("field", ["endpoint", "modelname", "instance_id"])
def test_registration_names_must_be_non_empty_strings(api, field):
    """``endpoint``: "Non-empty ZeroMQ live-publisher endpoint"; ``modelname``: "Non-empty registered model name";
    ``instance_id``: "Non-empty inference engine name"."""
    assert register(api, **{field: ""}) == (400, {"error": f"{field} must be a non-empty string",
                                                  "reason": "invalid_value", "field": field})
    assert register(api, **{field: 7}) == (400, {"error": f"{field} must be a string", "reason": "invalid_type",
                                                 "field": field})


@pytest.mark.parametrize("value", ["vllm", "VLLM", "sglang-x", ""])
def test_type_is_exactly_one_of_the_engine_kinds(api, value):
    """``type``: "Exactly vLLM or Mooncake"; another spelling is refused."""
    status, body = register(api, type=value)
    assert (status, body["reason"], body["field"]) == (400, "invalid_value", "type")


def test_a_mooncake_subscription_is_refused_where_the_conductor_takes_it(api, index):
    """The document takes ``type: "Mooncake"``, a Mooncake store's CPU/Disk events, which "does not create an
    inference-instance row in /query". kvstream differs on purpose: it reads no Mooncake store events, so it
    refuses the subscription, saying why, rather than answer 200 for one that would deliver nothing. (kvstream
    also takes ``SGLang``, whose publishers its bridge reads.)"""
    status, body = register(api, type="Mooncake", instance_id="pool")
    assert (status, body["reason"], body["field"]) == (400, "invalid_value", "type")
    assert "reads no Mooncake store events" in body["error"]
    assert index.sources.get("pool") is None
    assert register(api, type="SGLang", hash_profile=None)[0] == 200


@pytest.mark.parametrize("value, reason", [(0, "invalid_value"), (-16, "invalid_value"), ("16", "invalid_type"),
                                           (True, "invalid_type"), (16.0, "invalid_type")])
def test_block_size_is_a_positive_integer(api, value, reason):
    """``block_size``: "Positive registered token count per block"."""
    status, body = register(api, block_size=value)
    assert (status, body["reason"], body["field"]) == (400, reason, "block_size")


def test_dp_rank_is_an_integer_from_0_through_the_platform_int(api):
    """``dp_rank``: "Integer from 0 through the platform's maximum int"."""
    assert register(api, dp_rank=(1 << 31) - 1, endpoint="tcp://127.0.0.1:0")[0] == 200
    for value, reason in ((-1, "invalid_value"), (1 << 31, "invalid_value"), ("0", "invalid_type"),
                          (None, "invalid_type")):
        status, body = register(api, dp_rank=value, instance_id="engine-b", endpoint="tcp://127.0.0.1:6000")
        assert (status, body["reason"], body["field"]) == (400, reason, "dp_rank")


@pytest.mark.parametrize("profile, reason, field", [
    ({**PROFILE, "root_digest": RESOLVED["root_digest"]}, "unknown_field", "hash_profile.root_digest"),
    ({k: v for k, v in PROFILE.items() if k != "index_projection"}, "missing_field", "hash_profile.index_projection"),
    ({k: v for k, v in PROFILE.items() if k != "strategy"}, "missing_field", "hash_profile.strategy"),
    ("vllm_v1", "invalid_type", "hash_profile"),
    ({**PROFILE, "strategy": "vllm_v0"}, "invalid_value", "hash_profile.strategy"),
    ({**PROFILE, "algorithm": "md5"}, "invalid_value", "hash_profile.algorithm"),
    ({**PROFILE, "index_projection": "low64_le"}, "invalid_value", "hash_profile.index_projection"),
])
def test_hash_profile_is_exactly_the_four_supported_fields(api, profile, reason, field):
    """"The input object must contain exactly those four fields": ``strategy`` ``vllm_v1``, ``algorithm``,
    ``python_hash_seed``, ``index_projection`` ``low64_be``."""
    status, body = register(api, hash_profile=profile)
    assert (status, body["reason"], body["field"]) == (400, reason, field)


def test_algorithms_beside_sha256_cbor_are_taken(api):
    """The document supports ``algorithm`` ``sha256_cbor`` only. kvstream differs on purpose: it also takes the
    recipes it recomputes, vLLM's default ``sha256`` first (Mooncake's own cache-aware proxy may register it:
    ``--hash-algorithm sha256``)."""
    for i, algorithm in enumerate(("sha256", "xxhash", "xxhash_cbor")):
        assert register(api, instance_id=f"e{i}", endpoint=f"tcp://127.0.0.1:{7000 + i}", modelname=f"m{i}",
                        hash_profile={**PROFILE, "algorithm": algorithm})[0] == 200


@pytest.mark.parametrize("seed, reason", [
    ("", "invalid_value"), ("-1", "invalid_value"), ("+1", "invalid_value"), (" 0", "invalid_value"),
    ("0 ", "invalid_value"), ("4294967296", "invalid_value"), ("0x10", "invalid_value"), ("٣", "invalid_value"),
    (0, "invalid_type"), (None, "invalid_type")])
def test_a_seed_is_random_or_ascii_decimal_text_in_the_uint32_range(api, seed, reason):
    """``python_hash_seed``: "String containing exactly random or ASCII decimal text whose numeric value is in
    0..4294967295 ... Empty, signed, whitespace-padded, non-string, invalid UTF-8, and out-of-range seeds are
    rejected ... numeric JSON 0 is invalid." (Invalid UTF-8 never decodes as a msgpack str.)"""
    status, body = register(api, hash_profile={**PROFILE, "python_hash_seed": seed})
    assert (status, body["reason"], body["field"]) == (400, reason, "hash_profile.python_hash_seed")


def test_seed_text_is_kept_as_given_so_0_and_00_are_distinct(api):
    """"The original accepted text, including leading zeroes, is preserved ... "0" and "00" are distinct"."""
    for i, seed in enumerate(("4294967295", "random", "00")):
        assert register(api, instance_id=f"e{i}", modelname=f"m{i}", endpoint=f"tcp://127.0.0.1:{7100 + i}",
                        hash_profile={**PROFILE, "python_hash_seed": seed})[0] == 200
    seeds = {s["InstanceID"]: s["HashProfile"]["python_hash_seed"] for s in _services(api)["services"]}
    assert seeds == {"e0": "4294967295", "e1": "random", "e2": "00"}
    # one context has one profile: "00" is not "0"
    status, body = register(api, instance_id="e3", modelname="m2", endpoint="tcp://127.0.0.1:7199")
    assert (status, body["reason"], body["field"]) == (400, "invalid_registration", "hash_profile")


def test_a_registration_time_root_digest_is_a_legacy_unknown_field(api):
    """"Registration-time root_digest is a legacy unknown field and is rejected."""
    assert register(api, root_digest=RESOLVED["root_digest"]) == (400, {
        "error": "unsupported request field: root_digest", "reason": "unknown_field", "field": "root_digest"})


def test_optional_fields_default_as_the_document_says(api):
    """``replay_endpoint`` "Defaults to ``""``"; ``lora_name`` "default ``""``"; ``tenant_id`` "Omitted or ``""``
    becomes ``"default"``"; ``cache_group`` "Omission also means no explicit group"."""
    assert register(api, tenant_id="")[0] == 200
    [service] = _services(api)["services"]
    assert (service["ReplayEndpoint"], service["LoraName"], service["TenantID"], service["CacheGroup"]) == (
        "", "", "default", None)


@pytest.mark.parametrize("value, status", [(0, 200), (None, 200), (1, 400), ([0], 400), ("0", 400), (False, 400)])
def test_cache_group_is_0_or_null(api, value, status):
    """``cache_group``: "Integer 0 or null ... Other values and arrays are rejected"."""
    code, body = register(api, cache_group=value)
    assert code == status
    if status == 400:
        assert body["field"] == "cache_group" and body["reason"] in ("invalid_type", "invalid_value")


def test_the_exact_same_registration_again_is_the_same_success_and_changes_nothing(api):
    """"Submitting the exact same active registration again returns the same success without starting another
    subscriber." Nothing more is written to kv-instances, and ``/services`` still lists one service."""
    assert register(api) == register(api) == (200, {"status": "registered successfully", "instance_id": "engine-a"})
    assert len(api._registrations.written) == 1
    assert _services(api)["count"] == 1


@pytest.mark.parametrize("changes, field", [
    ({"modelname": "other-model"}, "modelname"), ({"block_size": 32}, "block_size"),
    ({"endpoint": "tcp://127.0.0.1:6001"}, "endpoint"), ({"lora_name": "adapter-1"}, "lora_name"),
    ({"hash_profile": {**PROFILE, "python_hash_seed": "1"}}, "hash_profile"),
    ({"replay_endpoint": "tcp://127.0.0.1:5567", "type": "SGLang"}, "type")])
def test_a_conflicting_service_key_is_invalid_registration(api, changes, field):
    """"A conflicting service key ... returns a msgpack 400 with reason invalid_registration": the same
    ``instance_id``, ``tenant_id`` and ``dp_rank`` with another configuration."""
    assert register(api, lora_name="")[0] == 200
    status, body = register(api, **changes)
    assert (status, body["reason"], body["field"]) == (400, "invalid_registration", field)
    assert "engine-a|default|0" in body["error"]


def test_an_endpoint_of_another_active_registration_is_invalid_registration(api):
    """``endpoint``: "It must not already belong to another active registration" (an ``endpoint`` under another
    id)."""
    assert register(api)[0] == 200
    status, body = register(api, instance_id="engine-b")
    assert (status, body["reason"], body["field"]) == (400, "invalid_registration", "endpoint")
    assert body["error"] == ("endpoint tcp://127.0.0.1:5557 belongs to another active registration, "
                             "engine-a|default|0")


def test_one_context_has_one_hash_profile(api):
    """"Each four-field cache-sharing group must use one identical resolved hash profile": another engine of the
    same tenant, model, LoRA and block size with another profile is refused; of another model it is not."""
    assert register(api)[0] == 200
    other = {"instance_id": "engine-b", "endpoint": "tcp://127.0.0.1:6000",
             "hash_profile": {**PROFILE, "python_hash_seed": "1"}}
    status, body = register(api, **other)
    assert (status, body["reason"], body["field"]) == (400, "invalid_registration", "hash_profile")
    assert register(api, **other, modelname="other-model")[0] == 200


def test_ranks_of_one_instance_register_apart_on_the_offset_endpoints(api):
    """"Register each vLLM data-parallel (DP) rank with a separate endpoint." kvstream keeps one registration per
    instance, its ranks on rank 0's endpoint offset by the rank (vLLM's data-parallel publishers, what a following
    bridge subscribes to): rank 1 on port 5558 is taken, and another port is refused, saying why."""
    assert register(api)[0] == 200
    assert register(api, dp_rank=1, endpoint="tcp://127.0.0.1:5558")[0] == 200
    assert [(s["DPRank"], s["Endpoint"]) for s in _services(api)["services"]] == [
        (0, "tcp://127.0.0.1:5557"), (1, "tcp://127.0.0.1:5558")]
    status, body = register(api, dp_rank=2, endpoint="tcp://127.0.0.1:6000")
    assert (status, body["reason"], body["field"]) == (400, "invalid_registration", "endpoint")


# -- POST /unregister --------------------------------------------------------------------------------------------


def test_the_minimal_unregistration_names_the_service_key_removed(api, unregistered):
    """The minimal request: status 200 with "the exact service key that was removed"."""
    assert register(api)[0] == 200
    assert call(api.unregister, {"instance_id": "engine-a", "dp_rank": 0})[:2] == (200, {
        "status": "unregistered successfully", "removed_instances": ["engine-a|default|0"]})
    assert unregistered == [("engine-a", 0)]  # the rank's SourceUnregistered, to kv-events
    assert api._registrations.removed == ["engine-a"]


def test_an_unknown_service_key_is_404_naming_it(api, unregistered):
    """"/unregister service key not found": 404 ``{"error":"service not found: engine-a|default|0"}``; nothing is
    written."""
    assert call(api.unregister, {"instance_id": "engine-a", "dp_rank": 0})[:2] == (404, {
        "error": "service not found: engine-a|default|0"})
    assert register(api)[0] == 200
    assert call(api.unregister, {"instance_id": "engine-a", "dp_rank": 1})[:2] == (404, {
        "error": "service not found: engine-a|default|1"})
    assert call(api.unregister, {"instance_id": "engine-a", "dp_rank": 0, "tenant_id": "t1"})[:2] == (404, {
        "error": "service not found: engine-a|t1|0"})
    assert unregistered == []


@pytest.mark.parametrize("body, reason, field", [
    ({"dp_rank": 0}, "missing_field", "instance_id"), ({"instance_id": "engine-a"}, "missing_field", "dp_rank"),
    ({"instance_id": "", "dp_rank": 0}, "invalid_value", "instance_id"),
    ({"instance_id": "engine-a", "dp_rank": -1}, "invalid_value", "dp_rank"),
    ({"instance_id": "engine-a", "dp_rank": "0"}, "invalid_type", "dp_rank"),
    ({"instance_id": "engine-a", "dp_rank": 0, "tenant_id": 3}, "invalid_type", "tenant_id"),
    ({"instance_id": "engine-a", "dp_rank": 0, "type": "vLLM"}, "unknown_field", "type")])
def test_unregistration_fields_are_the_three_documented(api, body, reason, field):
    """``instance_id`` (required, non-empty string), ``dp_rank`` (required, non-negative integer), ``tenant_id``
    (optional string); "No other fields are accepted."""
    status, answer, _ = call(api.unregister, body)
    assert (status, answer["reason"], answer["field"]) == (400, reason, field)


def test_an_empty_tenant_unregisters_the_default_one_and_the_rank_leaves_the_answers(api, index):
    """``tenant_id``: "Omitted or ``""`` becomes ``"default"``". "A vLLM unregister also removes that rank from
    query results": the other rank stays, registered and answered."""
    assert register(api)[0] == 200
    assert register(api, dp_rank=1, endpoint="tcp://127.0.0.1:5558")[0] == 200
    assert call(api.unregister, {"instance_id": "engine-a", "dp_rank": 1, "tenant_id": ""})[:2] == (200, {
        "status": "unregistered successfully", "removed_instances": ["engine-a|default|1"]})
    assert list(query(api)[1]["instances"]["engine-a"]["dp"]) == ["0"]
    assert [s["DPRank"] for s in _services(api)["services"]] == [0]
    assert [info.dp_ranks for info in api._registrations.written][-1] == {0}


def test_an_instance_known_from_its_events_alone_is_unregistered_too(api, index, unregistered):
    """kvstream beside the document: an instance that publishes events but was never registered (a bridge run by
    hand) has no service key, yet ``/unregister`` of it clears its blocks, as ``kvstream unregister`` does."""
    store(index, "bridged", [{"GPU"}])
    assert call(api.unregister, {"instance_id": "bridged", "dp_rank": 0})[:2] == (200, {
        "status": "unregistered successfully", "removed_instances": ["bridged|default|0"]})
    assert unregistered == [("bridged", 0)]


# -- POST /query -------------------------------------------------------------------------------------------------


def test_a_registered_rank_with_nothing_cached_is_answered_with_zero(api):
    """The minimal request: "If engine-a rank 0 is registered and no matching cache event has arrived, the response
    is" the document's, exactly (the older names beside)."""
    assert register(api)[0] == 200
    status, answer = query(api, list(range(16)))
    assert status == 200
    assert answer["instances"] == with_older_names({"engine-a": {
        "longest_matched": 0, "dp": {"0": 0}, "gpu": 0, "cpu": 0, "disk": 0,
        "rank_matches": {"0": {"gpu": 0, "cpu": 0, "disk": 0}}}})
    assert answer["scores"] == {} and answer["kvstream"] == {"ranks": {}, "left_out": {}}


def test_the_two_instance_example_is_answered_exactly(api, index):
    """"instance 1 rank 0 has a 32-token GPU prefix, instance 2 rank 1 has none, and both see 48-token shared CPU
    and Disk prefixes. The exact response is" the document's. (kvstream's CPU and disk copies are each instance's
    own, not a shared pool: each instance holds them here.)"""
    for instance, rank, seed in (("1", 0, 1), ("2", 1, 2)):
        assert register(api, instance_id=instance, dp_rank=rank, endpoint=f"tcp://127.0.0.1:{5600 + 10 * seed}")[0] \
            == 200
        shared = {"CPU", "STORAGE"}
        store(index, instance, [shared | ({"GPU"} if instance == "1" else set())] * 2 + [shared], rank, seed)
    status, answer = query(api)
    assert status == 200 and answer["instances"] == with_older_names({
        "1": {"longest_matched": 48, "gpu": 32, "dp": {"0": 32}, "cpu": 48, "disk": 48,
              "rank_matches": {"0": {"gpu": 32, "cpu": 48, "disk": 48}}},
        "2": {"longest_matched": 48, "gpu": 0, "dp": {"1": 0}, "cpu": 48, "disk": 48,
              "rank_matches": {"1": {"gpu": 0, "cpu": 48, "disk": 48}}}})


def test_the_ordered_tier_example_is_answered_exactly(api, index):
    """"suppose rank 0 has the first two 16-token blocks only on GPU, the third only in shared CPU, and the fourth
    only in shared Disk. That instance returns" the document's, exactly; kvstream's own breakdown beside it."""
    assert register(api)[0] == 200
    store(index, "engine-a", [{"GPU"}, {"GPU"}, {"CPU"}, {"STORAGE"}])
    status, answer = query(api)
    assert status == 200 and answer == {
        "instances": with_older_names({"engine-a": {
            "longest_matched": 64, "gpu": 32, "dp": {"0": 32}, "cpu": 48, "disk": 64,
            "rank_matches": {"0": {"gpu": 32, "cpu": 48, "disk": 64}}}}),
        "scores": {"engine-a": {"0": 64}},
        "kvstream": {"ranks": {"engine-a": {"0": {"matched_blocks": 4, "block_size": 16,
                                                  "prefix_blocks": {"GPU": 2}, "score": 3.3}}},
                     "left_out": {}}}


def test_the_walk_never_returns_to_a_higher_tier(api, index):
    """"It never returns to a higher tier after entering a lower tier": blocks on GPU, CPU only, GPU, GPU give a
    ``cpu`` of 32 (the CPU phase misses at block 2, which Disk misses too), not 64."""
    assert register(api)[0] == 200
    store(index, "engine-a", [{"GPU"}, {"CPU"}, {"GPU"}, {"GPU"}])
    row = query(api)[1]["instances"]["engine-a"]
    assert (row["gpu"], row["cpu"], row["disk"], row["longest_matched"], row["dp"]) == (16, 32, 32, 32, {"0": 16})
    assert query(api)[1]["kvstream"]["ranks"]["engine-a"]["0"]["matched_blocks"] == 4  # kvstream's any-tier prefix


def test_an_empty_cpu_phase_falls_through_to_disk_at_the_same_block(api, index):
    """"An empty CPU phase can therefore fall through to Disk at the same block, while a later GPU or CPU block is
    ignored after the query has entered Disk and then missed." """
    assert register(api)[0] == 200
    store(index, "engine-a", [{"GPU"}, {"STORAGE"}, {"CPU"}, {"GPU"}])
    row = query(api)[1]["instances"]["engine-a"]
    assert row["rank_matches"] == {"0": {"gpu": 16, "cpu": 16, "disk": 32}} and row["longest_matched"] == 32


def test_a_higher_tier_covering_the_input_sets_every_boundary(api, index):
    """"If a higher tier covers the complete input, later cumulative boundaries inherit that complete length even
    when no lower-tier copy exists ... If GPU covers all 64 tokens ... all three rank boundaries are still 64"."""
    assert register(api)[0] == 200
    store(index, "engine-a", [{"GPU"}] * 4)
    assert query(api)[1]["instances"]["engine-a"]["rank_matches"] == {"0": {"gpu": 64, "cpu": 64, "disk": 64}}


def test_only_complete_query_blocks_count(api, index):
    """"Only complete groups of this many tokens are hashed"; "All boundaries count only complete query blocks"."""
    assert register(api)[0] == 200
    store(index, "engine-a", [{"GPU"}] * 4)
    assert query(api, TOKENS[:40])[1]["instances"]["engine-a"]["longest_matched"] == 32


def test_blocks_of_different_ranks_are_never_joined(api, index):
    """"Blocks from different ranks are never joined to make a longer GPU prefix"; the instance's ``gpu``, ``cpu``,
    ``disk`` are "the maxima of the corresponding rank-level boundaries"."""
    assert register(api)[0] == 200
    assert register(api, dp_rank=1, endpoint="tcp://127.0.0.1:5558")[0] == 200
    store(index, "engine-a", [{"GPU"}, {"CPU"}], rank=0, seed=1)
    store(index, "engine-a", [{"GPU"}, {"GPU"}, {"STORAGE"}], rank=1, seed=2)  # the same tokens
    row = query(api)[1]["instances"]["engine-a"]
    assert row["rank_matches"] == {"0": {"gpu": 16, "cpu": 32, "disk": 32}, "1": {"gpu": 32, "cpu": 32, "disk": 48}}
    assert (row["gpu"], row["cpu"], row["disk"], row["longest_matched"], row["dp"]) == (32, 32, 48, 48,
                                                                                        {"0": 16, "1": 32})


def test_every_answer_keeps_the_documented_invariants(api, index):
    """"dp.keys == rank_matches.keys; dp[rank] == rank_matches[rank].gpu; 0 <= gpu <= cpu <= disk <=
    complete_query_tokens; longest_matched == disk", zero-hit ranks included."""
    for rank in range(3):
        assert register(api, dp_rank=rank, endpoint=f"tcp://127.0.0.1:{5557 + rank}")[0] == 200
    store(index, "engine-a", [{"CPU"}, {"GPU", "STORAGE"}, {"STORAGE"}], rank=1)
    for tokens in (TOKENS, TOKENS[:20], []):
        row = query(api, tokens)[1]["instances"]["engine-a"]
        assert row["dp"].keys() == row["rank_matches"].keys() == {"0", "1", "2"}
        for rank, bounds in row["rank_matches"].items():
            assert row["dp"][rank] == bounds["gpu"]
            assert 0 <= bounds["gpu"] <= bounds["cpu"] <= bounds["disk"] <= len(tokens) // BLOCK * BLOCK
        assert row["longest_matched"] == row["disk"] == max(b["disk"] for b in row["rank_matches"].values())


def test_token_ids_as_a_bin_of_int32_or_an_array_answer_alike(api, index):
    """``token_ids``: "msgpack bin of little-endian int32, or an array of signed 32-bit integers"."""
    assert register(api)[0] == 200
    store(index, "engine-a", [{"GPU"}] * 2)
    as_bin = query(api)[1]
    status, as_array, _ = call(api.query, {"model": "test-model", "block_size": 16, "token_ids": TOKENS})
    assert status == 200 and as_array == as_bin and as_bin["instances"]["engine-a"]["longest_matched"] == 32


def test_empty_token_ids_report_zero_hits_for_registered_ranks(api):
    """"An empty value is valid and reports zero hits for compatible registered ranks"."""
    assert register(api)[0] == 200
    assert query(api, [])[1]["instances"]["engine-a"]["rank_matches"] == {"0": {"gpu": 0, "cpu": 0, "disk": 0}}


@pytest.mark.parametrize("field", ["algorithm", "python_hash_seed", "root_digest", "strategy", "index_projection",
                                   "hash_profile"])
def test_no_hash_profile_override_is_accepted(api, field):
    """"The request cannot override the strategy, algorithm, python_hash_seed, derived root digest, or
    final-eight-byte lookup rule ... No hash-profile override fields are accepted."""
    status, answer = query(api, **{field: "x"})
    assert (status, answer) == (400, {"error": f"unsupported request field: {field}", "reason": "unknown_field",
                                      "field": field})


def test_a_misspelled_field_is_refused_not_ignored(api):
    """Unknown fields are rejected (issue 49 item 5: ``"modle"`` was ignored, so the query answered for every
    model)."""
    assert query(api, modle="test-model") == (400, {"error": "unsupported request field: modle",
                                                    "reason": "unknown_field", "field": "modle"})


@pytest.mark.parametrize("fields, reason, field", [
    ({"model": ""}, "invalid_value", "model"), ({"model": 3}, "invalid_type", "model"),
    ({"block_size": 0}, "invalid_value", "block_size"), ({"block_size": "16"}, "invalid_type", "block_size"),
    ({"tenant_id": 1}, "invalid_type", "tenant_id"), ({"lora_name": []}, "invalid_type", "lora_name"),
    ({"cache_salt": 5}, "invalid_type", "cache_salt"), ({"instance_id": 5}, "invalid_type", "instance_id"),
    ({"token_ids": b"\x01\x02\x03"}, "invalid_value", "token_ids"),
    ({"token_ids": "abc"}, "invalid_type", "token_ids")])
def test_query_fields_are_checked_as_the_table_states(api, fields, reason, field):
    """``model`` "Non-empty model name string"; ``block_size`` "Positive integer"; ``tenant_id``, ``lora_name``,
    ``cache_salt``, ``instance_id`` strings; ``token_ids`` a bin of int32 (4 bytes a token) or an array."""
    status, answer = query(api, **fields)
    assert (status, answer["reason"], answer["field"]) == (400, reason, field)


def test_model_and_block_size_may_be_left_out(api, index):
    """The document requires ``model`` and ``block_size``. kvstream differs on purpose: without ``model`` every
    model's instances are answered, without ``block_size`` each instance with its own block size (Dynamo's
    clients send neither)."""
    assert register(api)[0] == 200
    store(index, "engine-a", [{"GPU"}])
    status, answer, _ = call(api.query, {"token_ids": TOKENS})
    assert status == 200 and answer["instances"]["engine-a"]["longest_matched"] == 16


def test_an_empty_or_omitted_tenant_is_the_default_one(api, index):
    """``tenant_id``: "Omitted or ``""`` becomes ``"default"``"."""
    assert register(api)[0] == 200
    store(index, "engine-a", [{"GPU"}])
    assert query(api)[1] == query(api, tenant_id="")[1] == query(api, tenant_id="default")[1]
    assert query(api, tenant_id="other")[1]["instances"] == {}


def test_nil_empty_and_omitted_cache_salt_select_the_no_salt_path(api, index):
    """``cache_salt``: "nil, ``""``, and omission all select the no-salt hash path; a non-empty value must match
    the producer"; ``lora_name`` "Defaults to ``""`` for the base model"."""
    assert register(api)[0] == 200
    store(index, "engine-a", [{"GPU"}] * 2)
    plain = query(api)[1]
    assert plain["instances"]["engine-a"]["longest_matched"] == 32
    assert query(api, cache_salt=None)[1] == query(api, cache_salt="")[1] == query(api, lora_name="")[1] == plain
    # another salt or LoRA is another hash chain: the registered rank is answered, with nothing cached
    for fields in ({"cache_salt": "tenant-1"}, {"lora_name": "adapter-1"}):
        assert query(api, **fields)[1]["instances"]["engine-a"]["longest_matched"] == 0


def test_instance_id_selects_one_instance_and_an_unknown_one_none(api, index):
    """``instance_id``: "A matching registered instance is returned alone; an unknown value returns an empty
    instances object"."""
    assert register(api)[0] == 200
    assert register(api, instance_id="engine-b", endpoint="tcp://127.0.0.1:6000")[0] == 200
    store(index, "engine-a", [{"GPU"}])
    store(index, "engine-b", [{"GPU"}] * 2, seed=2)
    assert set(query(api)[1]["instances"]) == {"engine-a", "engine-b"}
    alone = query(api, instance_id="engine-b")[1]
    assert list(alone["instances"]) == ["engine-b"] and list(alone["scores"]) == ["engine-b"]
    assert alone["instances"]["engine-b"]["longest_matched"] == 32
    assert query(api, instance_id="engine-z")[1] == {"instances": {}, "scores": {},
                                                    "kvstream": {"ranks": {}, "left_out": {}}}


def test_a_missing_cache_sharing_group_is_an_empty_answer_and_creates_no_state(api, index):
    """"A missing cache-sharing group also returns status 200 with an empty instances object and does not create
    state." kvstream's own section says why each registered instance was left out (issue 49 item 5)."""
    assert register(api)[0] == 200
    for fields, reason in (({"model": "other-model"}, "model"), ({"block_size": 32}, "block_size"),
                           ({"tenant_id": "t1"}, "tenant")):
        status, answer = query(api, **fields)
        assert status == 200 and answer["instances"] == {}
        assert answer["kvstream"]["left_out"]["engine-a"]["reason"] == reason
    assert query(api, model="other-model")[1]["kvstream"]["left_out"] == {"engine-a": {
        "reason": "model", "error": "registered for model 'test-model', the query asked for 'other-model'"}}
    assert [info.instance_id for info in index.sources.all()] == ["engine-a"]


def test_an_instance_known_from_its_events_alone_says_why_it_was_left_out(api, index):
    """kvstream beside the document: an instance never registered is in the default tenant, of any model, with the
    index's default block size; a query it does not fit says so in ``kvstream.left_out``."""
    index.leases = SourceLeases(30.0, clock=lambda: 100.0)
    index.leases.note("0/bridged/0/-1", "bridged", 0, 99.0)
    store(index, "bridged", [{"GPU"}])
    assert query(api)[1]["instances"]["bridged"]["longest_matched"] == 16
    status, answer = query(api, block_size=32)
    assert (status, answer["instances"]) == (200, {})
    assert answer["kvstream"]["left_out"] == {"bridged": {
        "reason": "block_size", "error": "blocks of 16 tokens, the query asked for 32"}}
    assert query(api, tenant_id="t1")[1]["kvstream"]["left_out"]["bridged"]["reason"] == "tenant"


def test_a_source_whose_lease_lapsed_is_left_out_and_says_so(api, index):
    """kvstream beside the document: a source not heard of for a lease is left out of the answers (its blocks
    kept), and ``kvstream.left_out`` names its ranks and since when; its live ranks are still answered."""
    now = 10_000.0
    index.leases = SourceLeases(30.0, clock=lambda: now)
    assert register(api)[0] == 200
    assert register(api, dp_rank=1, endpoint="tcp://127.0.0.1:5558")[0] == 200
    store(index, "engine-a", [{"GPU"}], rank=0)
    index.leases.note("0/engine-a/0/-1", "engine-a", 0, now - 1)
    index.leases.note("0/engine-a/1/-1", "engine-a", 1, now - 100)
    answer = query(api)[1]
    assert answer["instances"]["engine-a"]["rank_matches"] == {"0": {"gpu": 16, "cpu": 16, "disk": 16}}
    assert answer["kvstream"]["left_out"] == {"engine-a": {
        "reason": "lease", "error": "not heard of for a lease (--source-lease-s): its blocks are left out until it "
                                    "is heard of again", "ranks": [1], "down_since": now - 70}}


# -- GET /services and GET /global_view --------------------------------------------------------------------------


def _services(api) -> dict:
    reply = api.services()
    assert (reply.status, reply.content_type) == (200, MSGPACK)
    return msgspec.msgpack.decode(reply.body)


def test_services_after_the_minimal_registration_is_the_documents(api):
    """"After the minimal register example, status 200 returns a msgpack map" exactly the document's."""
    assert register(api)[0] == 200
    assert _services(api) == {"count": 1, "services": [{
        "Endpoint": "tcp://127.0.0.1:5557", "ReplayEndpoint": "", "Type": "vLLM", "ModelName": "test-model",
        "LoraName": "", "TenantID": "default", "InstanceID": "engine-a", "BlockSize": 16, "DPRank": 0,
        "CacheGroup": None, "HashProfile": RESOLVED}]}


def test_services_counts_the_active_service_keys(api):
    """"count is the number of active service keys"."""
    assert _services(api) == {"count": 0, "services": []}
    assert register(api)[0] == 200
    assert register(api, dp_rank=1, endpoint="tcp://127.0.0.1:5558", replay_endpoint="tcp://127.0.0.1:5568")[0] \
        == 200
    services = _services(api)
    assert services["count"] == 2 and [s["ReplayEndpoint"] for s in services["services"]] == [
        "tcp://127.0.0.1:5567", "tcp://127.0.0.1:5568"]  # rank 0's offset by the rank, as the ranks publish
    assert call(api.unregister, {"instance_id": "engine-a", "dp_rank": 0})[0] == 200
    assert _services(api)["count"] == 1


def test_global_view_of_two_ranks_before_cache_events_is_the_documents(api):
    """"After registering engine-a ranks 0 and 1, before cache events arrive, a one-context response" is the
    document's, exactly."""
    assert register(api)[0] == 200
    assert register(api, dp_rank=1, endpoint="tcp://127.0.0.1:5558")[0] == 200
    reply = api.global_view()
    assert (reply.status, reply.content_type) == (200, MSGPACK)
    assert msgspec.msgpack.decode(reply.body) == {"context_count": 1, "contexts": [{
        "model_name": "test-model", "lora_name": "", "block_size": 16, "tenant_id": "default", "prefix_count": 0,
        "hash_profile": RESOLVED, "instances": {"engine-a": [0, 1]}}]}


def test_global_view_counts_the_lookup_values_a_context_holds(api, index):
    """"prefix_count counts distinct final-eight-byte lookup values that still have at least one GPU, CPU, or
    Disk record"; ``context_count`` "is the number of entries in contexts"."""
    assert register(api)[0] == 200
    assert register(api, instance_id="engine-b", modelname="other-model", endpoint="tcp://127.0.0.1:6000")[0] == 200
    store(index, "engine-a", [{"GPU", "CPU"}, {"CPU"}, {"STORAGE"}])
    store(index, "engine-b", [{"GPU"}], seed=2)
    view = msgspec.msgpack.decode(api.global_view().body)
    assert view["context_count"] == 2
    assert {c["model_name"]: (c["prefix_count"], c["instances"]) for c in view["contexts"]} == {
        "test-model": (3, {"engine-a": [0]}), "other-model": (1, {"engine-b": [0]})}
