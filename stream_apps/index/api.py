"""The router APIs of the index, independent of the web framework that serves them.

Every worker (Faust's web server, :mod:`stream_apps.views`) and ``kvstream index`` (aiohttp,
:mod:`stream_apps.index.server`) serve the same handlers: each takes the request body and its headers and gives
a :class:`Reply`. The APIs are the ones routers already speak (docs/querying.md, "For router authors"):

* Mooncake's conductor API as its current document states it (``indexer-api-design.md``, the rules in
  :mod:`stream_apps.index.conductor`): ``POST /query`` ``{model, block_size, token_ids, tenant_id, lora_name,
  cache_salt, instance_id}`` (``token_ids`` a msgpack bin of little-endian int32, or an array), ``POST /register``,
  ``POST /unregister``, ``GET /services``, ``GET /global_view``; its error maps (``error``, ``reason``, ``field``,
  ``index``), ``404`` for an unknown service key, ``405`` for a wrong method;
* Dynamo's standalone indexer: ``/query`` with ``model_name``, and its ``scores``;
* ``POST /query_by_hash`` ``{seq_hashes}`` (``block_hashes`` too): a chain of the engines' own block hashes,
  answered like ``/query``;
* kvstream's own: ``POST /prefix-match/`` ``{block_hashes}`` (per rank, blocks per tier, a score), ``GET /workers``,
  ``GET /dump`` (JSON lines).

Bodies are msgpack (``Content-Type: application/msgpack``) or, more leniently than the conductor, JSON; the answer
has the type the request asked for (``Accept``), else the request's own type. Unknown fields are refused on every
endpoint, as the conductor refuses them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated, NamedTuple, Union

import msgspec

from schemas import InvalidBlockHash, canonical_block_hash, parse_block_hash
from schemas.compiled import choose
from schemas.content_hash import token_bytes
from stream_apps.index import conductor
from stream_apps.index.conductor import (
    INVALID_JSON,
    INVALID_MSGPACK,
    INVALID_TYPE,
    INVALID_VALUE,
    METHOD_NOT_ALLOWED,
    MISSING_FIELD,
    TOO_LARGE,
    APIError,
    finish_answer,
    service_key,
    service_not_found,
    unknown_fields,
    validation_error,
)
from stream_apps.index.fleet_index import DEFAULT_TENANT, FleetIndex, SourceInfo
from stream_apps.index.registrations import reduced_registration
from stream_apps.web_access import audit_change

#: Largest request body, bytes (Dynamo's standalone indexer takes 8 MiB).
MAX_BODY_BYTES = 8 << 20
#: Most blocks of one hash chain (``/query_by_hash``, ``/prefix-match/``).
MAX_CHAIN_BLOCKS = 65_536
#: Most tokens of one ``/query`` (2M tokens: beyond any context window served today).
MAX_TOKENS = 2 << 20
#: Deepest nesting of arrays and maps in a body decoded without a schema (``/query_by_hash``, ``/prefix-match/``,
#: ``/register``, ``/unregister``; ``/query``'s schema takes none beyond its ``token_ids`` array). A deeper body
#: is refused (400 ``too_deep``), as is one too deep for the decoder's own recursion limit.
MAX_NESTING_DEPTH = 32
#: The reason of a body nested too deep.
TOO_DEEP = "too_deep"


def configure_limits(max_body_bytes: int | None = None, max_tokens: int | None = None, max_hashes: int | None = None,
                     max_nesting_depth: int | None = None) -> None:
    """Set this process's body limits (``--max-body-bytes``, ``--max-tokens``, ``--max-hashes``,
    ``--max-nesting-depth``); None keeps a limit as it is."""
    global MAX_BODY_BYTES, MAX_TOKENS, MAX_CHAIN_BLOCKS, MAX_NESTING_DEPTH
    if max_body_bytes is not None:
        MAX_BODY_BYTES = max_body_bytes
    if max_tokens is not None:
        MAX_TOKENS = max_tokens
    if max_hashes is not None:
        MAX_CHAIN_BLOCKS = max_hashes
    if max_nesting_depth is not None:
        MAX_NESTING_DEPTH = max_nesting_depth


def _too_deep() -> APIError:
    return APIError(f"request body nested deeper than {MAX_NESTING_DEPTH} arrays and maps", TOO_DEEP)


def check_nesting(value, limit: int | None = None) -> None:
    """Refuse a decoded body whose arrays and maps nest deeper than ``limit`` (default
    :data:`MAX_NESTING_DEPTH`); iterative, so no depth costs the stack.

    Raises:
        APIError: 400 ``too_deep``.
    """
    limit = MAX_NESTING_DEPTH if limit is None else limit
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise _too_deep()
        children = item.values() if type(item) is dict else item
        kinds = set(map(type, children))  # in C: an array of 65,536 hashes costs no Python loop
        if list in kinds or dict in kinds:
            stack.extend((child, depth + 1) for child in children if type(child) is list or type(child) is dict)

JSON = "application/json"
MSGPACK = "application/msgpack"
_json_encode = msgspec.json.Encoder().encode
_msgpack_encode = msgspec.msgpack.Encoder().encode
_json_decode = msgspec.json.Decoder().decode
_msgpack_decode = msgspec.msgpack.Decoder().decode

#: A token id as engines send them: int32 (Mooncake's proxy), or u32.
_TokenId = Annotated[int, msgspec.Meta(ge=-(1 << 31), lt=1 << 32)]


class _QueryFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The fields of ``POST /query`` beside its token ids. An unknown field is refused, as the conductor refuses
    it (a misspelled ``modle`` would otherwise answer for every model)."""

    #: The model the request is for (``model`` is Mooncake's name, ``model_name`` Dynamo's); None: any (kvstream:
    #: the conductor requires it).
    model_name: str | None = None
    model: str | None = None
    #: The request's LoRA adapter and cache salt, which change its blocks' content hashes as vLLM's extra keys do.
    lora_name: str | None = None
    cache_salt: str | None = None
    #: Tokens per block; None: each instance's own.
    block_size: Annotated[int, msgspec.Meta(ge=1)] | None = None
    #: Mooncake's tenant namespace; None: ``default``.
    tenant_id: str | None = None
    #: The conductor's filter: answer for this instance alone (an unknown one: no instance).
    instance_id: str | None = None


class QueryRequest(_QueryFields, kw_only=True):
    """A msgpack body of ``POST /query``, checked by msgspec while it is decoded (a 4,096-token body checked
    token by token in Python cost more than the lookup)."""

    #: The prompt's token ids, or a bin of little-endian int32, as Mooncake's proxy sends them.
    token_ids: Union[list[_TokenId], bytes]


class JSONQueryRequest(_QueryFields, kw_only=True):
    """A JSON body of ``POST /query``. msgspec checks its structure and skips the token ids, whose array
    :func:`token_ids_bytes` reads straight into bytes: a Python int per token was the largest cost of the
    request."""

    #: The prompt's token ids as a JSON array of integers, unparsed.
    token_ids: msgspec.Raw


_query_json = msgspec.json.Decoder(JSONQueryRequest).decode
_query_msgpack = msgspec.msgpack.Decoder(QueryRequest).decode
_token_list_json = msgspec.json.Decoder(list[_TokenId]).decode


def _token_bytes_python(raw: bytes | memoryview) -> bytes:
    """The twin of ``schemas._hotpath.json_token_bytes``: a JSON array of token ids as little-endian u32 bytes.

    Raises:
        BadRequest: not an array of integers in [-2**31, 2**32), with msgspec's reason and the token's index.
    """
    try:
        return token_bytes(_token_list_json(raw))
    except msgspec.ValidationError as exc:  # its path as the whole body's decode gives it
        message = str(exc)
        at = " - at `$"
        message = message.replace(at, at + ".token_ids", 1) if at in message else f"{message}{at}.token_ids`"
        mapped = validation_error(message, "token_ids")
        raise BadRequest(f"{message} (expected an array of int32 or u32 token ids)", mapped.reason, mapped.field,
                         mapped.index) from None
    except msgspec.DecodeError as exc:  # msgspec.Raw holds valid JSON, so only a caller's own bytes get here
        raise BadRequest(f"token_ids is not JSON: {exc}", INVALID_JSON, "token_ids") from None


def token_ids_bytes(raw: bytes | memoryview, compiled: bool | None = None) -> bytes:
    """The JSON array ``raw`` of a ``/query``'s ``token_ids`` as little-endian u32 bytes, 4 per token (a negative
    id wraps to its u32 bits, as :func:`schemas.content_hash.token_bytes` does).

    Args:
        compiled: as :func:`schemas.compiled.choose`: None the compiled reader where built, False Python's.

    Raises:
        BadRequest: not an array of integers in [-2**31, 2**32); the Python twin names the fault.
    """
    hotpath = choose(compiled)
    if hotpath is not None:
        out = hotpath.json_token_bytes(raw)
        if out is not None:
            return out
    return _token_bytes_python(raw)


def read_json_query(body: bytes, compiled: bool | None = None) -> tuple[JSONQueryRequest, bytes]:
    """A JSON ``POST /query`` body: its fields, and its token ids as little-endian u32 bytes.

    The compiled reader (``schemas._hotpath.json_query_token_ids``) finds and reads the ``token_ids`` array in one
    pass, and msgspec decodes and checks the rest of the body with the array cut out; a body it does not take
    (see there) is decoded as a whole by msgspec, then its array by :func:`token_ids_bytes`. Both give the same
    answer for every body.

    Raises:
        msgspec.DecodeError: not JSON. msgspec.ValidationError: a field of the wrong type, or no ``token_ids``.
        BadRequest: ``token_ids`` not an array of integers in [-2**31, 2**32).
    """
    hotpath = choose(compiled)
    found = hotpath.json_query_token_ids(body) if hotpath is not None else None
    if found is not None:
        tokens, start, end = found
        try:
            return _query_json(body[:start] + b"[]" + body[end:]), tokens
        except msgspec.MsgspecError:
            pass  # decoded again whole below, so the error's positions are the body's own
    request = _query_json(body)
    return request, token_ids_bytes(request.token_ids, compiled)


class Reply(NamedTuple):
    """One answer: HTTP status, body bytes, content type."""

    status: int
    body: bytes
    content_type: str


class BadRequest(APIError):
    """A request the API refuses (HTTP 400): the message, and the conductor's ``reason``, ``field`` and ``index``
    where they apply (:class:`~stream_apps.index.conductor.APIError`)."""

    def __init__(self, error: str, reason: str | None = INVALID_VALUE, field: str | None = None,
                 index: int | None = None) -> None:
        super().__init__(error, reason, field, index)


def wants_msgpack(content_type: str | None, accept: str | None) -> bool:
    """Whether to answer in msgpack: asked for in ``Accept``, else the request was msgpack."""
    if accept and "msgpack" in accept:
        return True
    if accept and "json" in accept:
        return False
    return bool(content_type and "msgpack" in content_type)


def prefers_msgpack(content_type: str | None, accept: str | None) -> bool:
    """:func:`wants_msgpack` for the conductor's own views (``GET /services``, ``/global_view``, a ``405``), which
    answer msgpack unless JSON is asked for (in ``Accept``, or by a JSON request)."""
    if accept and "msgpack" in accept:
        return True
    if accept and "json" in accept:
        return False
    return not (content_type and "json" in content_type)


def encode(value, msgpack: bool, status: int = 200) -> Reply:
    """A :class:`Reply` of ``value`` in msgpack or JSON."""
    if msgpack:
        return Reply(status, _msgpack_encode(value), MSGPACK)
    return Reply(status, _json_encode(value), JSON)


def error_reply(exc: APIError, msgpack: bool) -> Reply:
    """The :class:`Reply` of a refusal: its status and error map."""
    return encode(exc.body(), msgpack, exc.status)


def _too_large(size: int, limit: int) -> BadRequest:
    return BadRequest(f"request body of {size} bytes (limit {limit})", TOO_LARGE)


def decode_body(body: bytes, content_type: str | None) -> dict:
    """The request's body as a dict, from msgpack or JSON.

    Raises:
        APIError: nested deeper than :data:`MAX_NESTING_DEPTH` (``too_deep``).
        BadRequest: too large (``too_large``), not decodable or not a map (the conductor's ``Invalid msgpack
            object``, ``invalid_msgpack``; for JSON ``invalid_json``, or ``invalid_type`` for another value).
    """
    if len(body) > MAX_BODY_BYTES:
        raise _too_large(len(body), MAX_BODY_BYTES)
    msgpack = bool(content_type and "msgpack" in content_type)
    try:
        value = _msgpack_decode(body) if msgpack else _json_decode(body)
    except RecursionError:
        raise _too_deep() from None
    except msgspec.DecodeError as exc:
        if msgpack:
            raise BadRequest("Invalid msgpack object", INVALID_MSGPACK) from None
        raise BadRequest(f"request body is not JSON (send Content-Type: application/msgpack for msgpack): {exc}",
                         INVALID_JSON) from None
    if not isinstance(value, dict):
        if msgpack:
            raise BadRequest("Invalid msgpack object", INVALID_MSGPACK)
        raise BadRequest(f"request body must be a map, not {type(value).__name__}", INVALID_TYPE)
    if _containers_at_most(body, msgpack) > MAX_NESTING_DEPTH:  # else no nesting can be deeper: no walk
        check_nesting(value)
    return value


#: Every byte that cannot start a JSON array or object, or a msgpack array or map (deleted to count the others).
_NOT_JSON_CONTAINER = bytes(b for b in range(256) if b not in b"[{")
_NOT_MSGPACK_CONTAINER = bytes(b for b in range(256) if not (0x80 <= b <= 0x9F or b in (0xDC, 0xDD, 0xDE, 0xDF)))


def _containers_at_most(body: bytes, msgpack: bool) -> int:
    """An upper bound of the arrays and maps in ``body`` (the bytes that could open one), counted in C."""
    return len(body.translate(None, _NOT_MSGPACK_CONTAINER if msgpack else _NOT_JSON_CONTAINER))


def _optional_str(request: dict, *names: str) -> str | None:
    for name in names:
        value = request.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise BadRequest(f"{name} must be a string", INVALID_TYPE, name)
            return value or None
    return None


def chain_of(request: dict, *names: str) -> list[bytes]:
    """A chain of engine block hashes under the first of ``names`` present: ints (vLLM's u64, SGLang's i64) or
    strings (hex or decimal, as :func:`schemas.parse_block_hash` reads them).

    Raises:
        BadRequest: missing, empty, too long, or a value that is not a block hash.
    """
    name = next((name for name in names if name in request), names[0])
    hashes = request.get(name)
    if name not in request:
        raise BadRequest(f'expected {{"{names[0]}": [hash, ...]}} with at least one hash (integer or hex)',
                         MISSING_FIELD, names[0])
    if not isinstance(hashes, list) or not hashes:
        raise BadRequest(f'expected {{"{names[0]}": [hash, ...]}} with at least one hash (integer or hex)',
                         INVALID_TYPE if not isinstance(hashes, list) else INVALID_VALUE, name)
    if len(hashes) > MAX_CHAIN_BLOCKS:
        raise BadRequest(f"{len(hashes)} block hashes (limit {MAX_CHAIN_BLOCKS})", TOO_LARGE, name)
    chain = []
    for position, value in enumerate(hashes):
        try:
            chain.append(parse_block_hash(value) if isinstance(value, str) else canonical_block_hash(value))
        except InvalidBlockHash as exc:
            raise BadRequest(str(exc), INVALID_VALUE, name, position) from None
    return chain


#: The fields of ``POST /query_by_hash`` and ``POST /prefix-match/``.
_BY_HASH_FIELDS = ("seq_hashes", "block_hashes", "model_name", "model", "tenant_id", "instance_id")
_PREFIX_MATCH_FIELDS = ("block_hashes",)


class IndexAPI:
    """The router APIs over one :class:`FleetIndex`.

    Args:
        index: the index answered from.
        not_ready: the reasons the index may not answer yet (empty: ready); lookups answer 503 with them.
        on_register: called with each registered :class:`SourceInfo`, ranks merged, before it is recorded.
        prefix_match_limits: (body bytes, block hashes) ``POST /prefix-match/`` takes at most.
        on_unregister: writes a ``SourceUnregistered`` of (instance, rank or None for all, reason) to ``kv-events``;
            None: ``/unregister`` answers 501.
        registrations: a :class:`~stream_apps.index.registrations.RegistrationWriter`, or None.
    """

    def __init__(self, index: FleetIndex, not_ready: Callable[[], list[str]],
                 on_register: Callable[[SourceInfo], None] | None = None,
                 prefix_match_limits: tuple[int, int] = (MAX_BODY_BYTES, MAX_CHAIN_BLOCKS),
                 on_unregister: Callable[[str, int | None, str], None] | None = None,
                 registrations=None) -> None:
        self.index = index
        #: A :class:`~stream_apps.index.registrations.RegistrationWriter`: every registration and unregistration
        #: is written to ``kv-instances``, which every process reads; None: they stay in this process.
        self._registrations = registrations
        #: Writes a ``SourceUnregistered`` of (instance, rank or None for all, reason) to ``kv-events``.
        self._on_unregister = on_unregister
        self._not_ready = not_ready
        self._on_register = on_register
        #: (body bytes, block hashes) ``POST /prefix-match/`` takes at most: the worker keeps its older, lower
        #: limits (256 KiB, 2,048 hashes), which its clients already know.
        self.prefix_match_limits = prefix_match_limits

    def _refusal(self, msgpack: bool) -> Reply | None:
        reasons = self._not_ready()
        if not reasons:
            return None
        return encode({"error": f"not ready: {'; '.join(reasons)}; retry", "reasons": reasons}, msgpack, 503)

    def _handle(self, body: bytes, content_type: str | None, accept: str | None, answer) -> Reply:
        msgpack = wants_msgpack(content_type, accept)
        try:
            request = decode_body(body, content_type)
            refusal = self._refusal(msgpack)
            if refusal is not None:
                return refusal
            return encode(answer(request), msgpack)
        except APIError as exc:
            return error_reply(exc, msgpack)

    def query(self, body: bytes, content_type: str | None = None, accept: str | None = None) -> Reply:
        """``POST /query``: per instance the cached prefix of these tokens, in tokens: the conductor's ordered
        tier boundaries per rank, every registered rank of the query's context (0 when nothing is cached), and
        kvstream's own breakdown with why instances were left out (docs/querying.md)."""
        msgpack = wants_msgpack(content_type, accept)
        if len(body) > MAX_BODY_BYTES:
            return error_reply(_too_large(len(body), MAX_BODY_BYTES), msgpack)
        is_msgpack = bool(content_type and "msgpack" in content_type)
        try:
            try:
                if is_msgpack:
                    request = _query_msgpack(body)
                    tokens = request.token_ids
                else:
                    request, tokens = read_json_query(body)
            except msgspec.ValidationError as exc:
                refused = validation_error(str(exc))
                if is_msgpack and refused.field is None and refused.reason == INVALID_TYPE:
                    raise BadRequest("Invalid msgpack object", INVALID_MSGPACK) from None  # not a map
                raise refused from None
            except RecursionError:
                raise _too_deep() from None
            except msgspec.DecodeError as exc:
                if is_msgpack:
                    raise BadRequest("Invalid msgpack object", INVALID_MSGPACK) from None
                raise BadRequest(f"request body is not JSON (send Content-Type: application/msgpack for msgpack): "
                                 f"{exc}", INVALID_JSON) from None
            for name in ("model", "model_name"):
                if getattr(request, name) == "":
                    raise BadRequest(f"{name} must be a non-empty string", INVALID_VALUE, name)
            if isinstance(tokens, bytes) and len(tokens) % 4:
                raise BadRequest(f"token_ids as bytes must be little-endian int32, 4 bytes per token "
                                 f"({len(tokens)} bytes given)", INVALID_VALUE, "token_ids")
            count = len(tokens) // 4 if isinstance(tokens, bytes) else len(tokens)
            if count > MAX_TOKENS:
                raise BadRequest(f"{count} token ids (limit {MAX_TOKENS})", TOO_LARGE, "token_ids")
        except APIError as exc:
            return error_reply(exc, msgpack)
        refusal = self._refusal(msgpack)
        if refusal is not None:
            return refusal
        model = request.model_name or request.model or None
        tenant = request.tenant_id or None
        answer = self.index.query_tokens(tokens, block_size=request.block_size, lora_name=request.lora_name or None,
                                         cache_salt=request.cache_salt or None, model_name=model, tenant_id=tenant)
        return encode(finish_answer(self.index, answer, model=model, tenant=tenant, block_size=request.block_size,
                                    instance_id=request.instance_id), msgpack)

    def query_by_hash(self, body: bytes, content_type: str | None = None, accept: str | None = None) -> Reply:
        """``POST /query_by_hash``: ``/query``'s answer for a chain of the engines' own block hashes."""
        def answer(request: dict) -> dict:
            unknown_fields(request, _BY_HASH_FIELDS)
            chain = chain_of(request, "seq_hashes", "block_hashes")
            model = _optional_str(request, "model_name", "model")
            tenant = _optional_str(request, "tenant_id")
            found = self.index.query_hashes(chain, model_name=model, tenant_id=tenant)
            return finish_answer(self.index, found, model=model, tenant=tenant,
                                 instance_id=_optional_str(request, "instance_id"))
        return self._handle(body, content_type, accept, answer)

    def prefix_match(self, body: bytes, content_type: str | None = None, accept: str | None = None) -> Reply:
        """``POST /prefix-match/``: per (instance, rank) the longest resident prefix per tier, and its score."""
        max_bytes, max_blocks = self.prefix_match_limits

        def answer(request: dict) -> dict:
            unknown_fields(request, _PREFIX_MATCH_FIELDS)
            chain = chain_of(request, "block_hashes")
            if len(chain) > max_blocks:
                raise BadRequest(f"{len(chain)} block hashes (limit {max_blocks})", TOO_LARGE, "block_hashes")
            return {"block_count": len(chain), "weights": self.index.weights,
                    "matches": self.index.prefix_match(chain)}
        if len(body) > max_bytes:
            return error_reply(_too_large(len(body), max_bytes), wants_msgpack(content_type, accept))
        return self._handle(body, content_type, accept, answer)

    def register(self, body: bytes, content_type: str | None = None, accept: str | None = None) -> Reply:
        """``POST /register`` with the conductor's body (``endpoint``, ``type``, ``modelname``, ``instance_id``,
        ``block_size``, ``dp_rank``, ``hash_profile``; ``replay_endpoint``, ``lora_name``, ``tenant_id``,
        ``cache_group``), checked as the document states: answers ``{"status": "registered successfully",
        "instance_id": ...}``; the exact same registration again changes nothing; one that conflicts with an
        active registration is a 400 ``invalid_registration`` (:func:`~stream_apps.index.conductor.
        register_conflicts`)."""
        msgpack = wants_msgpack(content_type, accept)
        try:
            registration = conductor.parse_registration(decode_body(body, content_type))
            with self.index.lock:
                info = conductor.register_conflicts(self.index.sources, registration)
        except APIError as exc:
            return error_reply(exc, msgpack)
        success = {"status": "registered successfully", "instance_id": registration.instance_id}
        if info is None:
            return encode(success, msgpack)  # the exact same active registration: nothing to write
        with self.index.lock:
            before = self.index.sources.get(registration.instance_id)
        if self._on_register is not None:
            self._on_register(info)
        if self._registrations is not None:
            try:
                self._registrations.write(info)
            except RuntimeError as exc:
                return encode({"error": f"the registration was not written: {exc}; retry"}, msgpack, 503)
        with self.index.lock:
            self.index.sources.put(info)
        audit_change("register", registration.instance_id, before, info)
        return encode(success, msgpack)

    def _known_from_events(self, instance: str, rank: int) -> bool:
        """Whether the index knows (instance, rank) from its events: a lease, or blocks it holds."""
        leases = self.index.leases
        if leases is not None and (instance, rank) in leases.states():
            return True
        return any(w["instance_id"] == instance and w["data_parallel_rank"] == rank and w["blocks"]
                   for w in self.index.workers())

    def unregister(self, body: bytes, content_type: str | None = None, accept: str | None = None) -> Reply:
        """``POST /unregister`` with the conductor's body (``instance_id``, ``dp_rank``, ``tenant_id``): writes a
        ``SourceUnregistered`` of the rank to ``kv-events``, so every worker and every index removes its rows on
        every tier, in order, and removes the rank from the instance's registration; answers ``{"status":
        "unregistered successfully", "removed_instances": ["<instance>|<tenant>|<rank>"]}``, or 404 ``service not
        found: ...`` for a service key neither registered nor known from events."""
        msgpack = wants_msgpack(content_type, accept)
        try:
            instance, rank, tenant = conductor.parse_unregistration(decode_body(body, content_type))
        except APIError as exc:
            return error_reply(exc, msgpack)
        with self.index.lock:
            known = self.index.sources.get(instance)
        registered = known is not None and known.tenant_id == tenant and rank in (known.dp_ranks or {0})
        if not registered and not (tenant == DEFAULT_TENANT and self._known_from_events(instance, rank)):
            return error_reply(service_not_found(instance, tenant, rank), msgpack)
        if self._on_unregister is None:
            return encode({"error": "this process cannot write to kv-events"}, msgpack, 501)
        remaining = None
        try:
            self._on_unregister(instance, rank, "POST /unregister")
            if registered:
                remaining = reduced_registration(known, rank)
                if self._registrations is not None:
                    if remaining is None:
                        self._registrations.remove(instance)
                    else:
                        self._registrations.write(remaining)
        except (RuntimeError, OSError) as exc:
            return encode({"error": f"the unregistration was not written: {exc}; retry"}, msgpack, 503)
        if registered:
            with self.index.lock:
                if remaining is None:
                    self.index.sources.unregister(instance)
                else:
                    self.index.sources.put(remaining)
        audit_change("unregister", service_key(instance, tenant, rank), known if registered else "known from events",
                     remaining if registered else "cleared on every tier")
        return encode({"status": "unregistered successfully",
                       "removed_instances": [service_key(instance, tenant, rank)]}, msgpack)

    def services(self, accept: str | None = None, content_type: str | None = None) -> Reply:
        """``GET /services``: every registered rank with its configuration, in the conductor's casing."""
        return encode(conductor.services(self.index.sources), prefers_msgpack(content_type, accept))

    def global_view(self, accept: str | None = None, content_type: str | None = None) -> Reply:
        """``GET /global_view``: the registrations' cache-sharing contexts, their hash profiles and ranks."""
        return encode(conductor.global_view(self.index), prefers_msgpack(content_type, accept))

    def method_not_allowed(self, accept: str | None = None, content_type: str | None = None) -> Reply:
        """The ``405`` of a path asked with a method it does not take (``GET /query``, ``POST /services``)."""
        return encode({"error": METHOD_NOT_ALLOWED}, prefers_msgpack(content_type, accept), 405)

    def workers(self, accept: str | None = None) -> Reply:
        """``GET /workers``: every instance and rank known, its blocks per tier, and the index's own figures."""
        return encode({"workers": self.index.workers(), "index": self.index.stats(),
                       "ready": not self._not_ready()}, wants_msgpack(None, accept))

    def dump(self) -> Iterator[bytes]:
        """``GET /dump``: the whole index as JSON lines, one block per line."""
        for block in self.index.dump():
            yield _json_encode(block) + b"\n"

