"""Mooncake's conductor API, as its current document words it: the rules :class:`~stream_apps.index.api.IndexAPI`
applies to the conductor's endpoints, apart from the HTTP plumbing.

The document is ``docs/source/design/conductor/indexer-api-design.md`` of kvcache-ai/Mooncake (branch
``dev/conductor``, August 2026), with ``conductor-architecture-design.md`` beside it. What it says, and where
kvstream says otherwise on purpose, is in docs/querying.md ("Mooncake's conductor API"); in short:

* **errors** (:class:`APIError`): ``400`` with ``error``, a stable ``reason`` and the ``field`` (and ``index``)
  that caused it; ``404`` for ``/unregister`` of an unknown service key; ``405`` ``Method not allowed``;
* **``POST /register``** (:func:`parse_registration`, :func:`register_conflicts`): the document's fields and types,
  the four-field ``hash_profile``; the exact same registration again is a success that changes nothing, and a
  registration that conflicts with an active one (its service key, its endpoint, its context's hash profile) is a
  ``400`` ``invalid_registration``;
* **``POST /unregister``** (:func:`parse_unregistration`): ``instance_id`` and ``dp_rank``, ``tenant_id``; the
  answer names the service key ``<instance>|<tenant>|<rank>`` removed;
* **``POST /query``** (:func:`finish_answer`): every registered rank of the query's context is answered, with 0 when
  nothing is cached; ``instance_id`` selects one instance; kvstream's own section says why an instance was left
  out (``kvstream.left_out``);
* **``GET /services``** and **``GET /global_view``** (:func:`services`, :func:`global_view`).

kvstream keeps one registration per instance (the compacted topic ``kv-instances`` is keyed by instance id), so
its ranks share the instance's model, block size, tenant, LoRA, engine type and hash profile, and rank ``r``'s
endpoint is rank 0's offset by ``r`` (vLLM's data-parallel publishers; what ``kvstream bridge
--follow-registrations`` subscribes to). A registration that needs otherwise is refused with the reason.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from schemas.engine_hashes import ALGORITHMS, MAX_PYTHON_HASH_SEED, RANDOM_SEED, VLLM_DEFAULT_SEED, none_hash
from stream_apps.index.scoring import instance_row
from stream_apps.index.sources import DEFAULT_TENANT, SourceInfo, SourceRegistry

#: The document's ``reason`` values, and kvstream's own beside them (``invalid_json``, ``too_large``).
UNKNOWN_FIELD = "unknown_field"
MISSING_FIELD = "missing_field"
INVALID_TYPE = "invalid_type"
INVALID_VALUE = "invalid_value"
INVALID_MSGPACK = "invalid_msgpack"
INVALID_JSON = "invalid_json"
INVALID_REGISTRATION = "invalid_registration"
TOO_LARGE = "too_large"

#: The largest ``dp_rank`` (the platform's ``int``, as the conductor parses it).
MAX_DP_RANK = (1 << 31) - 1

#: ``POST /register``'s fields: the document's, required first.
REGISTER_REQUIRED = ("endpoint", "type", "modelname", "instance_id", "block_size", "dp_rank", "hash_profile")
REGISTER_OPTIONAL = ("replay_endpoint", "lora_name", "tenant_id", "cache_group")
#: ``POST /unregister``'s fields.
UNREGISTER_FIELDS = ("instance_id", "dp_rank", "tenant_id")
#: Engine kinds kvstream takes at ``/register``: the document's ``vLLM``, and ``SGLang``, whose publishers
#: kvstream's bridge reads too (a kvstream extension). The document's ``Mooncake`` (a Mooncake store's CPU and
#: disk events) is refused: kvstream reads no Mooncake store events, so the subscription would deliver nothing.
ENGINE_TYPES = ("vLLM", "SGLang")
#: ``hash_profile``: exactly these four fields.
PROFILE_FIELDS = ("strategy", "algorithm", "python_hash_seed", "index_projection")
#: Hash algorithms taken: the document's ``sha256_cbor``, and the other recipes kvstream recomputes (vLLM's
#: default ``sha256``, which Mooncake's own cache-aware proxy may register, and the two XXH3 ones).
PROFILE_ALGORITHMS = ALGORITHMS

#: The body of every ``405``.
METHOD_NOT_ALLOWED = "Method not allowed"


class APIError(ValueError):
    """A request the API refuses: an HTTP status and the document's error map.

    Args:
        error: the human-readable message (the map's ``error``).
        reason: the stable reason (``unknown_field``, ``invalid_type``, ...), or None for operational errors.
        field: the field that caused it, if one did (a dotted path inside ``hash_profile``).
        index: the element of ``field`` that caused it, if one did.
        status: the HTTP status (400 unless said).
    """

    def __init__(self, error: str, reason: str | None = None, field: str | None = None, index: int | None = None,
                 status: int = 400) -> None:
        super().__init__(error)
        self.error, self.reason, self.field, self.index, self.status = error, reason, field, index, status

    def body(self) -> dict:
        """The error map: ``error``, then ``reason``, ``field`` and ``index`` where they apply."""
        body: dict = {"error": self.error}
        for name in ("reason", "field", "index"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        return body


def service_key(instance_id: str, tenant_id: str, dp_rank: int) -> str:
    """The conductor's service key of one registered rank: ``<instance>|<tenant>|<rank>``."""
    return f"{instance_id}|{tenant_id}|{dp_rank}"


def unknown_fields(request: Mapping, allowed: Iterable[str], where: str = "") -> None:
    """Refuse a field ``allowed`` does not name, as the conductor refuses them on every endpoint.

    Raises:
        APIError: ``unknown_field`` naming the first such field (in sorted order).
    """
    known = set(allowed)
    unknown = sorted(str(name) for name in request if name not in known)
    if unknown:
        raise APIError(f"unsupported request field: {where}{unknown[0]}", UNKNOWN_FIELD, f"{where}{unknown[0]}")


def _missing(name: str) -> APIError:
    return APIError(f"missing required field: {name}", MISSING_FIELD, name)


def _string(request: Mapping, name: str, *, required: bool = False, empty: bool = True) -> str | None:
    """A string field; None when absent (or nil, for an optional one)."""
    if name not in request or (request[name] is None and not required):
        if required:
            raise _missing(name)
        return None
    value = request[name]
    if not isinstance(value, str):
        raise APIError(f"{name} must be a string", INVALID_TYPE, name)
    if not value and not empty:
        raise APIError(f"{name} must be a non-empty string", INVALID_VALUE, name)
    return value


def _integer(request: Mapping, name: str, minimum: int, maximum: int = MAX_DP_RANK) -> int:
    """A required integer field in ``[minimum, maximum]``."""
    if name not in request:
        raise _missing(name)
    value = request[name]
    if not isinstance(value, int) or isinstance(value, bool):
        raise APIError(f"{name} must be an integer", INVALID_TYPE, name)
    if not minimum <= value <= maximum:
        raise APIError(f"{name} must be an integer from {minimum} to {maximum}", INVALID_VALUE, name)
    return value


# -- POST /register ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Registration:
    """One ``POST /register`` body, checked: one service of the conductor (one instance's rank)."""

    endpoint: str
    engine_type: str
    model_name: str
    instance_id: str
    block_size: int
    dp_rank: int
    #: The four-field profile as given, or None (an ``SGLang`` registration may give none).
    hash_profile: dict | None
    #: None when omitted (or ``""``, the document's default: no replay socket).
    replay_endpoint: str | None
    #: ``""`` for the base model (the document's default).
    lora_name: str
    tenant_id: str
    #: Whether ``lora_name`` was in the body (an omitted one takes no side in a conflict check).
    lora_given: bool = True

    @property
    def key(self) -> str:
        """The service key."""
        return service_key(self.instance_id, self.tenant_id, self.dp_rank)


def parse_hash_profile(value: object) -> dict:
    """A ``hash_profile`` as the document states it: a map of exactly ``strategy`` (``vllm_v1``), ``algorithm``,
    ``python_hash_seed`` (the text ``random`` or ASCII decimal in 0..4294967295, kept as given) and
    ``index_projection`` (``low64_be``). kvstream also takes the algorithms it recomputes besides the document's
    ``sha256_cbor`` (:data:`PROFILE_ALGORITHMS`) and vLLM's unset-seed text ``vllm-none-hash``.

    Raises:
        APIError: ``invalid_type``, ``missing_field``, ``unknown_field`` or ``invalid_value``, with the field's
            dotted path (``hash_profile.python_hash_seed``).
    """
    if not isinstance(value, Mapping):
        raise APIError("hash_profile must be a map", INVALID_TYPE, "hash_profile")
    unknown_fields(value, PROFILE_FIELDS, "hash_profile.")
    for name in PROFILE_FIELDS:
        if name not in value:
            raise _missing(f"hash_profile.{name}")
        if not isinstance(value[name], str):
            raise APIError(f"hash_profile.{name} must be a string", INVALID_TYPE, f"hash_profile.{name}")
    if value["strategy"] != "vllm_v1":
        raise APIError(f"hash_profile.strategy must be 'vllm_v1', not {value['strategy'][:40]!r}", INVALID_VALUE,
                       "hash_profile.strategy")
    if value["algorithm"] not in PROFILE_ALGORITHMS:
        raise APIError(f"hash_profile.algorithm must be one of {', '.join(PROFILE_ALGORITHMS)}, not "
                       f"{value['algorithm'][:40]!r}", INVALID_VALUE, "hash_profile.algorithm")
    if value["index_projection"] != "low64_be":
        raise APIError(f"hash_profile.index_projection must be 'low64_be', not {value['index_projection'][:40]!r}",
                       INVALID_VALUE, "hash_profile.index_projection")
    seed = value["python_hash_seed"]
    decimal = seed.isascii() and seed.isdigit()
    if not (seed in (RANDOM_SEED, VLLM_DEFAULT_SEED) or decimal and int(seed) <= MAX_PYTHON_HASH_SEED):
        raise APIError(f"hash_profile.python_hash_seed must be 'random' or ASCII decimal text in "
                       f"0..{MAX_PYTHON_HASH_SEED}, not {seed[:40]!r}", INVALID_VALUE, "hash_profile.python_hash_seed")
    if seed == VLLM_DEFAULT_SEED and value["algorithm"] not in ("sha256", "sha256_cbor"):
        raise APIError(f"hash_profile.python_hash_seed {VLLM_DEFAULT_SEED!r} is vLLM's unset seed of sha256 and "
                       f"sha256_cbor only", INVALID_VALUE, "hash_profile.python_hash_seed")
    return {name: value[name] for name in PROFILE_FIELDS}


def parse_registration(request: Mapping) -> Registration:
    """A ``POST /register`` body, checked field by field as the document's table states them.

    Raises:
        APIError: the first field refused (``unknown_field``, ``missing_field``, ``invalid_type``,
            ``invalid_value``), with its name.
    """
    unknown_fields(request, REGISTER_REQUIRED + REGISTER_OPTIONAL)
    engine_type = _string(request, "type", required=True)
    if engine_type not in ENGINE_TYPES:
        why = (": kvstream reads no Mooncake store events, so a Mooncake subscription would deliver nothing"
               if engine_type == "Mooncake" else "")
        raise APIError(f"type must be one of {', '.join(ENGINE_TYPES)}, not {engine_type[:40]!r}{why}", INVALID_VALUE,
                       "type")
    endpoint = _string(request, "endpoint", required=True, empty=False)
    model = _string(request, "modelname", required=True, empty=False)
    instance = _string(request, "instance_id", required=True, empty=False)
    block_size = _integer(request, "block_size", 1)
    rank = _integer(request, "dp_rank", 0)
    if "hash_profile" in request and request["hash_profile"] is not None:
        profile = parse_hash_profile(request["hash_profile"])
    elif engine_type == "SGLang":
        profile = None  # SGLang hashes its blocks its own way: a vLLM profile would not describe it
    else:
        raise _missing("hash_profile")
    replay = _string(request, "replay_endpoint") or None
    lora = _string(request, "lora_name")
    tenant = _string(request, "tenant_id") or DEFAULT_TENANT
    if "cache_group" in request:
        group = request["cache_group"]
        if group is not None and (not isinstance(group, int) or isinstance(group, bool)):
            raise APIError("cache_group must be the integer 0 or null", INVALID_TYPE, "cache_group")
        if group not in (None, 0):
            raise APIError("cache_group must be 0 or null: only the default cache group is supported",
                           INVALID_VALUE, "cache_group")
    for name, value in (("endpoint", endpoint), ("replay_endpoint", replay)):
        if value is not None:
            try:
                base_endpoint(value, rank)
            except ValueError as exc:
                raise APIError(f"{name}: {exc}", INVALID_VALUE, name) from None
    return Registration(endpoint, engine_type, model, instance, block_size, rank, profile, replay, lora or "",
                        tenant, lora_given=lora is not None)


_TCP = re.compile(r"^(?P<head>tcp://.+:)(?P<port>\d+)$")


def rank_endpoint(base: str, rank: int) -> str:
    """Rank ``rank``'s endpoint from rank 0's, by vLLM's rule (``ZmqEventPublisher.offset_endpoint_port``, which
    ``producers.bridge_endpoints.offset_endpoint`` follows): a tcp port plus the rank (port 0 left alone), an inproc
    name with ``_dp<rank>``.

    Raises:
        ValueError: a rank above 0 on another transport (ipc), which vLLM refuses.
    """
    if rank == 0:
        return base
    match = _TCP.match(base)
    if match:
        port = int(match["port"])
        return base if port == 0 else f"{match['head']}{port + rank}"
    if base.startswith("inproc://"):
        return f"{base}_dp{rank}"
    raise ValueError(f"endpoint {base!r} of data-parallel rank {rank}: only tcp and inproc endpoints are offset per "
                     "rank (vLLM refuses others above rank 0)")


def base_endpoint(endpoint: str, rank: int) -> str:
    """Rank 0's endpoint of an instance whose rank ``rank`` publishes on ``endpoint``: :func:`rank_endpoint`'s
    inverse, which kvstream stores (one endpoint per instance, its ranks on the offset ports).

    Raises:
        ValueError: an endpoint that is not rank ``rank``'s of any rank 0 (a tcp port below the rank, an inproc
            name without ``_dp<rank>``, another transport above rank 0).
    """
    if rank == 0:
        return endpoint
    match = _TCP.match(endpoint)
    if match:
        port = int(match["port"])
        if port == 0:
            return endpoint
        if port - rank < 1:
            raise ValueError(f"port {port} is below data-parallel rank {rank}'s offset from rank 0's port")
        return f"{match['head']}{port - rank}"
    suffix = f"_dp{rank}"
    if endpoint.startswith("inproc://") and endpoint.endswith(suffix):
        return endpoint[:-len(suffix)]
    raise ValueError(f"{endpoint!r} is not data-parallel rank {rank}'s endpoint: kvstream derives each rank's "
                     "endpoint from rank 0's by vLLM's offset (tcp port + rank, inproc _dp<rank>)")


def _context(tenant: str, model: str | None, lora: str | None, block_size: int) -> tuple:
    return tenant, model, lora or "", block_size


def _conflict(error: str, field: str | None = None) -> APIError:
    return APIError(error, INVALID_REGISTRATION, field)


def register_conflicts(registry: SourceRegistry, reg: Registration) -> SourceInfo | None:
    """What registering ``reg`` makes of its instance's registration, or None when it is the exact same as an
    active one (a success that changes nothing).

    The checks, the document's and kvstream's:

    * the service key is active with another configuration (a field given on both sides that differs; fields a
      producer's registration left unset are filled in);
    * the endpoint is another active service's (any instance, any rank);
    * the context (tenant, model, LoRA, block size) has another hash profile;
    * kvstream's one registration per instance: another rank of the instance with another tenant, model, block
      size, LoRA, engine type or hash profile, or an endpoint that is not rank 0's offset by the rank.

    Raises:
        APIError: ``invalid_registration``, naming what conflicts and the field.
    """
    known = registry.get(reg.instance_id)
    size = registry.block_size
    base = base_endpoint(reg.endpoint, reg.dp_rank)
    replay = None if reg.replay_endpoint is None else base_endpoint(reg.replay_endpoint, reg.dp_rank)
    for other in registry.all():
        if other.instance_id == reg.instance_id or not other.endpoint:
            continue
        for rank in sorted(other.dp_ranks or {0}):
            try:
                taken = rank_endpoint(other.endpoint, rank)
            except ValueError:
                continue
            if taken == reg.endpoint:
                raise _conflict(f"endpoint {reg.endpoint} belongs to another active registration, "
                                f"{service_key(other.instance_id, other.tenant_id, rank)}", "endpoint")
    if reg.hash_profile is not None:
        context = _context(reg.tenant_id, reg.model_name, reg.lora_name, reg.block_size)
        for other in registry.all():
            if (other.instance_id != reg.instance_id and other.hash_profile is not None
                    and _context(other.tenant_id, other.model_name, other.lora_name, size(other.instance_id))
                    == context and other.hash_profile != reg.hash_profile):
                raise _conflict(f"hash_profile differs from the one registered for the context (tenant "
                                f"{reg.tenant_id!r}, model {reg.model_name!r}, LoRA {reg.lora_name!r}, block size "
                                f"{reg.block_size}) by {other.instance_id}: one context has one hash profile",
                                "hash_profile")
    if known is None:
        return SourceInfo(reg.instance_id, model_name=reg.model_name, block_size=reg.block_size,
                          tenant_id=reg.tenant_id, endpoint=base, replay_endpoint=replay,
                          engine_type=reg.engine_type, dp_ranks={reg.dp_rank}, lora_name=reg.lora_name,
                          hash_profile=reg.hash_profile)
    active = reg.dp_rank in known.dp_ranks
    what = (f"service {reg.key} is active with another" if active else
            f"instance {reg.instance_id} is registered (ranks {sorted(known.dp_ranks)}) with another")
    why = "" if active else ": kvstream keeps one registration per instance, which its ranks share"
    stored = known
    if known.tenant_id == DEFAULT_TENANT and known.hash_profile is None:
        known = _with_tenant(known, reg.tenant_id)  # a producer's registration (model, block size) names no tenant
    if known.tenant_id != reg.tenant_id:
        raise _conflict(f"instance {reg.instance_id} is registered under another tenant: kvstream keeps one "
                        f"tenant per instance", "tenant_id")
    for name, field_name, mine, theirs in (
            ("modelname", "modelname", reg.model_name, known.model_name),
            ("block_size", "block_size", reg.block_size, known.block_size),
            ("type", "type", reg.engine_type, known.engine_type),
            ("hash_profile", "hash_profile", reg.hash_profile, known.hash_profile),
            ("lora_name", "lora_name", reg.lora_name if reg.lora_given else None, known.lora_name),
            ("endpoint", "endpoint", base, known.endpoint),
            ("replay_endpoint", "replay_endpoint", replay, known.replay_endpoint)):
        if mine is not None and theirs is not None and mine != theirs:
            if name in ("endpoint", "replay_endpoint") and not active:
                raise _conflict(f"{name} {getattr(reg, name)} is not rank {reg.dp_rank}'s offset of rank 0's "
                                f"{theirs} (instance {reg.instance_id}){why}", field_name)
            raise _conflict(f"{what} {name}{why}", field_name)
    merged = SourceInfo(reg.instance_id, model_name=reg.model_name, block_size=reg.block_size,
                        tenant_id=reg.tenant_id, endpoint=base, replay_endpoint=replay or known.replay_endpoint,
                        engine_type=reg.engine_type, dp_ranks=known.dp_ranks | {reg.dp_rank},
                        lora_name=reg.lora_name if reg.lora_given or known.lora_name is None else known.lora_name,
                        hash_profile=reg.hash_profile if reg.hash_profile is not None else known.hash_profile)
    if _same_registration(merged, stored):
        return None
    return merged


def _with_tenant(info: SourceInfo, tenant: str) -> SourceInfo:
    return SourceInfo(info.instance_id, model_name=info.model_name, block_size=info.block_size, tenant_id=tenant,
                      endpoint=info.endpoint, replay_endpoint=info.replay_endpoint, engine_type=info.engine_type,
                      dp_ranks=set(info.dp_ranks), lora_name=info.lora_name, hash_profile=info.hash_profile)


def _same_registration(a: SourceInfo, b: SourceInfo) -> bool:
    fields = ("instance_id", "model_name", "block_size", "tenant_id", "endpoint", "replay_endpoint", "engine_type",
              "dp_ranks", "lora_name", "hash_profile")
    return all(getattr(a, name) == getattr(b, name) for name in fields)


# -- POST /unregister --------------------------------------------------------------------------------------------


def parse_unregistration(request: Mapping) -> tuple[str, int, str]:
    """A ``POST /unregister`` body: ``(instance_id, dp_rank, tenant_id)`` (``""`` or omitted: ``default``).

    Raises:
        APIError: an unknown field, a missing ``instance_id`` or ``dp_rank``, a field of the wrong type or value.
    """
    unknown_fields(request, UNREGISTER_FIELDS)
    instance = _string(request, "instance_id", required=True, empty=False)
    rank = _integer(request, "dp_rank", 0)
    tenant = _string(request, "tenant_id") or DEFAULT_TENANT
    return instance, rank, tenant


def service_not_found(instance_id: str, tenant_id: str, dp_rank: int | None) -> APIError:
    """The ``404`` of an unknown service key (``dp_rank`` None: every rank, written ``*``)."""
    rank = "*" if dp_rank is None else dp_rank
    return APIError(f"service not found: {instance_id}|{tenant_id}|{rank}", status=404)


# -- POST /query -------------------------------------------------------------------------------------------------

_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]+)`(?: - at `\$(?P<path>[^`]*)`)?$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`")
_EXPECTED = re.compile(r"^Expected `(?P<expected>[^`]+)`(?P<bound>(?: [<>=]+ -?\d+)?)(?:, got `(?P<got>[^`]+)`)?"
                       r"(?: - at `\$(?:\.(?P<field>\w+))?(?:\[(?P<index>\d+)\])?`)?$")
#: What a type in msgspec's words is in the document's.
_TYPE_WORDS = {"str | null": "a string", "str": "a string", "int | null": "an integer", "int": "an integer",
               "bytes | array": "a bin of little-endian int32 or an array of integers", "object": "a map"}


def validation_error(message: str, field: str | None = None) -> APIError:
    """A msgspec ``ValidationError``'s message as the document's error map (``field`` names the array a path
    ``$[i]`` is in, when the message comes from decoding that array alone).

    ``token_ids`` elements get the document's own words (``token_ids element must be an integer``, with the
    element's ``index``); a field of the wrong type is ``invalid_type``, one out of range ``invalid_value``, an
    unknown field ``unknown_field``, a missing one ``missing_field``.
    """
    message = message.split(" (expected ", 1)[0]
    if (match := _UNKNOWN.match(message)) is not None:
        return APIError(f"unsupported request field: {match['field']}", UNKNOWN_FIELD, match["field"])
    if (match := _MISSING.match(message)) is not None:
        return _missing(match["field"])
    if (match := _EXPECTED.match(message)) is not None:
        name = match["field"] or field
        index = None if match["index"] is None else int(match["index"])
        words = _TYPE_WORDS.get(match["expected"], f"`{match['expected']}`")
        if name is None:
            return APIError(f"request body must be {words}", INVALID_TYPE)
        if index is not None:
            if match["got"] is not None:
                return APIError(f"{name} element must be an integer", INVALID_TYPE, name, index)
            return APIError(f"{name} element must be an int32 or u32 token id (an integer{match['bound']})",
                            INVALID_VALUE, name, index)
        if match["got"] is not None:
            return APIError(f"{name} must be {words}, not {match['got']}", INVALID_TYPE, name)
        return APIError(f"{name} must be {words}{match['bound']}", INVALID_VALUE, name)
    return APIError(message, INVALID_VALUE, field)


def _leases(index) -> dict:
    return index.leases.states() if index.leases is not None else {}


def _mismatch(registry: SourceRegistry, info: SourceInfo, model: str | None, tenant: str | None,
              block_size: int | None) -> dict | None:
    """Why a query for (``model``, ``tenant``, ``block_size``) does not name ``info``'s instance, or None."""
    if info.tenant_id != (tenant or DEFAULT_TENANT):
        return {"reason": "tenant", "error": "registered under another tenant"}
    if model is not None and info.model_name is not None and info.model_name != model:
        return {"reason": "model", "error": f"registered for model {info.model_name!r}, the query asked for "
                                            f"{model!r}"}
    size = registry.block_size(info.instance_id)
    if block_size is not None and size != block_size:
        return {"reason": "block_size", "error": f"blocks of {size} tokens, the query asked for {block_size}"}
    return None


def finish_answer(index, answer: dict, *, model: str | None = None, tenant: str | None = None,
                  block_size: int | None = None, instance_id: str | None = None) -> dict:
    """The ``/query`` (and ``/query_by_hash``) answer as the document has it, from the index's
    (:func:`~stream_apps.index.scoring.instances_answer`'s, for the query's model, tenant and block size).

    * every registered rank of every registered instance the query may name is answered, with 0 when nothing of
      the prompt is cached there (``dp.keys == rank_matches.keys``, zero-hit ranks included);
    * ``instance_id`` keeps that instance alone (an unknown one: an empty ``instances``);
    * ``kvstream.left_out``: per instance the query did not name although it is registered or known from its
      events (a lease), why: ``tenant``, ``model``, ``block_size`` (the instance's registration, or for one
      never registered the default tenant and block size), or ``lease`` (its source was not heard of for a lease:
      ``ranks`` and ``down_since`` say which and since when; an instance with other ranks still live is answered
      for those).

    Args:
        index: the :class:`~stream_apps.index.fleet_index.FleetIndex` answered from (its registry and leases).
        answer: the index's answer, changed in place and returned.
    """
    registry = index.sources
    instances, scores = answer["instances"], answer["scores"]
    ranks = answer["kvstream"]["ranks"]
    left_out: dict[str, dict] = {}
    down: dict[str, list] = {}
    heard: set[str] = set()
    for (instance, rank), state in _leases(index).items():
        heard.add(instance)
        if not state.live:
            down.setdefault(instance, []).append((rank, state.down_since))
    with index.lock:
        registered = registry.all()
    for instance in sorted(heard - {info.instance_id for info in registered}):
        if instance_id is not None and instance != instance_id:
            continue  # known from its events alone: the default tenant, any model, the default block size
        reason = _mismatch(registry, SourceInfo(instance), model, tenant, block_size)
        if reason is not None:
            left_out[instance] = reason
    for info in registered:
        if instance_id is not None and info.instance_id != instance_id:
            continue
        reason = _mismatch(registry, info, model, tenant, block_size)
        if reason is not None:
            left_out[info.instance_id] = reason
            continue
        lapsed = {rank for rank, _ in down.get(info.instance_id, ())}
        live_ranks = [rank for rank in sorted(info.dp_ranks or {0}) if rank not in lapsed]
        row = instances.get(info.instance_id)
        known = dict(row["rank_matches"]) if row is not None else {}
        missing = [str(rank) for rank in live_ranks if str(rank) not in known]
        if missing:
            for rank in missing:
                known[rank] = {"gpu": 0, "cpu": 0, "disk": 0}
            instances[info.instance_id] = instance_row(dict(sorted(known.items(), key=lambda kv: int(kv[0]))))
    for instance, lapsed in down.items():
        if instance in left_out or (instance_id is not None and instance != instance_id):
            continue
        if registry.get(instance) is None and instance in instances:
            continue  # an unregistered instance answered by its live ranks needs no word
        left_out[instance] = {"reason": "lease", "error": "not heard of for a lease (--source-lease-s): its blocks "
                                                          "are left out until it is heard of again",
                              "ranks": sorted(rank for rank, _ in lapsed),
                              "down_since": min(since for _, since in lapsed)}
    if instance_id is not None:
        for part in (instances, scores, ranks):
            for instance in [i for i in part if i != instance_id]:
                del part[instance]
    if len(instances) > 1:
        answer["instances"] = dict(sorted(instances.items()))
    answer["kvstream"]["left_out"] = dict(sorted(left_out.items()))
    return answer


# -- GET /services and GET /global_view --------------------------------------------------------------------------


def resolved_profile(profile: Mapping | None) -> dict | None:
    """A registered ``hash_profile`` with its derived ``root_digest`` (lowercase hex of the algorithm's hash of the
    seed's text, as the conductor reports it), or None."""
    if profile is None:
        return None
    root = none_hash(profile["algorithm"], profile["python_hash_seed"]).hex()
    return {"strategy": profile["strategy"], "algorithm": profile["algorithm"],
            "python_hash_seed": profile["python_hash_seed"], "root_digest": root,
            "index_projection": profile["index_projection"]}


def _offset(endpoint: str | None, rank: int) -> str | None:
    if not endpoint:
        return endpoint
    try:
        return rank_endpoint(endpoint, rank)
    except ValueError:
        return None


def services(registry: SourceRegistry) -> dict:
    """``GET /services``: every registered rank (service key) with its configuration, in the document's casing.

    ``Endpoint`` and ``ReplayEndpoint`` are the rank's (rank 0's offset by the rank); ``ReplayEndpoint`` is ``""``
    without one, as the conductor reports it. A registration a producer wrote (``kvstream bridge --model-name``,
    ``kvstream simulate``) may lack fields: they are null. ``CacheGroup`` is null (kvstream takes only the default
    group, which 0 and null both name).
    """
    rows = []
    for info in sorted(registry.all(), key=lambda i: i.instance_id):
        profile = resolved_profile(info.hash_profile)
        for rank in sorted(info.dp_ranks or {0}):
            rows.append({"Endpoint": _offset(info.endpoint, rank),
                         "ReplayEndpoint": _offset(info.replay_endpoint, rank) or "",
                         "Type": info.engine_type, "ModelName": info.model_name, "LoraName": info.lora_name or "",
                         "TenantID": info.tenant_id, "InstanceID": info.instance_id,
                         "BlockSize": registry.block_size(info.instance_id), "DPRank": rank, "CacheGroup": None,
                         "HashProfile": profile})
    return {"count": len(rows), "services": rows}


def global_view(index) -> dict:
    """``GET /global_view``: the cache-sharing contexts of the registrations, (tenant, model, LoRA, block size),
    each with its hash profile, its instances' ranks and ``prefix_count``: the blocks of the index that a rank of
    the context holds on some tier (a walk over the whole index: a view to inspect, not to poll)."""
    registry = index.sources
    with index.lock:
        registered = registry.all()
    contexts: dict[tuple, dict] = {}
    context_of: dict[str, tuple] = {}
    for info in sorted(registered, key=lambda i: i.instance_id):
        size = registry.block_size(info.instance_id)
        key = _context(info.tenant_id, info.model_name, info.lora_name, size)
        context = contexts.setdefault(key, {"model_name": info.model_name, "lora_name": info.lora_name or "",
                                            "block_size": size, "tenant_id": info.tenant_id, "prefix_count": 0,
                                            "hash_profile": resolved_profile(info.hash_profile), "instances": {}})
        if context["hash_profile"] is None and info.hash_profile is not None:
            context["hash_profile"] = resolved_profile(info.hash_profile)
        context["instances"][info.instance_id] = sorted(info.dp_ranks or {0})
        context_of[info.instance_id] = key
    if context_of:
        for block in index.dump():
            for key in {context_of[h["instance_id"]] for h in block["holders"] if h["instance_id"] in context_of}:
                contexts[key]["prefix_count"] += 1
    return {"context_count": len(contexts), "contexts": list(contexts.values())}
