"""The router APIs of the index, independent of the web framework that serves them.

Every worker (Faust's web server, :mod:`stream_apps.views`) and ``kvstream index`` (aiohttp,
:mod:`stream_apps.index.server`) serve the same handlers: each takes the request body and its headers and gives
a :class:`Reply`. The APIs are the ones routers already speak (docs/querying.md, "For router authors"):

* ``POST /query`` ``{token_ids, model_name|model, lora_name, cache_salt, block_size, tenant_id}``: Mooncake's
  indexer API (RFC #1403) and Dynamo's standalone indexer; ``token_ids`` may be a msgpack bin of little-endian
  int32, as Mooncake's cache-aware proxy sends it;
* ``POST /query_by_hash`` ``{seq_hashes}`` (Mooncake's name; ``block_hashes`` too): a chain of the engines' own
  block hashes, answered like ``/query``;
* ``POST /prefix-match/`` ``{block_hashes}``: kvstream's own answer (per rank, blocks per tier, a score);
* ``POST /register``: Mooncake's conductor body; ``GET /workers``; ``GET /dump`` (JSON lines).

Bodies are JSON or msgpack (``Content-Type: application/msgpack``); the answer has the type the request asked
for (``Accept``), else the request's own type.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated, NamedTuple, Union

import msgspec

from schemas import InvalidBlockHash, canonical_block_hash, parse_block_hash
from schemas.compiled import choose
from schemas.content_hash import token_bytes
from stream_apps.index.fleet_index import FleetIndex, SourceInfo

#: Largest request body, bytes (Dynamo's standalone indexer takes 8 MiB).
MAX_BODY_BYTES = 8 << 20
#: Most blocks of one hash chain (``/query_by_hash``, ``/prefix-match/``).
MAX_CHAIN_BLOCKS = 65_536
#: Most tokens of one ``/query`` (2M tokens: beyond any context window served today).
MAX_TOKENS = 2 << 20

JSON = "application/json"
MSGPACK = "application/msgpack"
_json_encode = msgspec.json.Encoder().encode
_msgpack_encode = msgspec.msgpack.Encoder().encode
_json_decode = msgspec.json.Decoder().decode
_msgpack_decode = msgspec.msgpack.Decoder().decode

#: A token id as engines send them: int32 (Mooncake's proxy), or u32.
_TokenId = Annotated[int, msgspec.Meta(ge=-(1 << 31), lt=1 << 32)]


class _QueryFields(msgspec.Struct, kw_only=True):
    """The fields of ``POST /query`` beside its token ids. Unknown fields are ignored, as Mooncake's and
    Dynamo's are."""

    #: The model the request is for (``model`` is Mooncake's proxy's name, ``model_name`` Dynamo's); None: any.
    model_name: str | None = None
    model: str | None = None
    #: The request's LoRA adapter and cache salt, which change its blocks' content hashes as vLLM's extra keys do.
    lora_name: str | None = None
    cache_salt: str | None = None
    #: Tokens per block; None: each instance's own.
    block_size: Annotated[int, msgspec.Meta(ge=1)] | None = None
    #: Mooncake's tenant namespace; None: ``default``.
    tenant_id: str | None = None


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
        raise BadRequest(f"{message} (expected an array of int32 or u32 token ids)") from None
    except msgspec.DecodeError as exc:  # msgspec.Raw holds valid JSON, so only a caller's own bytes get here
        raise BadRequest(f"token_ids is not JSON: {exc}") from None


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


class BadRequest(ValueError):
    """A request the API refuses (HTTP 400); the message is the reason."""


def wants_msgpack(content_type: str | None, accept: str | None) -> bool:
    """Whether to answer in msgpack: asked for in ``Accept``, else the request was msgpack."""
    if accept and "msgpack" in accept:
        return True
    if accept and "json" in accept:
        return False
    return bool(content_type and "msgpack" in content_type)


def encode(value, msgpack: bool, status: int = 200) -> Reply:
    """A :class:`Reply` of ``value`` in msgpack or JSON."""
    if msgpack:
        return Reply(status, _msgpack_encode(value), MSGPACK)
    return Reply(status, _json_encode(value), JSON)


def decode_body(body: bytes, content_type: str | None) -> dict:
    """The request's body as a dict, from msgpack or JSON.

    Raises:
        BadRequest: too large, not decodable, or not a map.
    """
    if len(body) > MAX_BODY_BYTES:
        raise BadRequest(f"request body of {len(body)} bytes (limit {MAX_BODY_BYTES})")
    msgpack = bool(content_type and "msgpack" in content_type)
    try:
        value = _msgpack_decode(body) if msgpack else _json_decode(body)
    except msgspec.DecodeError as exc:
        kind = "msgpack" if msgpack else "JSON (send Content-Type: application/msgpack for msgpack)"
        raise BadRequest(f"request body is not {kind}: {exc}") from None
    if not isinstance(value, dict):
        raise BadRequest(f"request body must be a map, not {type(value).__name__}")
    return value


def _optional_str(request: dict, *names: str) -> str | None:
    for name in names:
        value = request.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise BadRequest(f"{name} must be a string")
            return value or None
    return None


def _optional_int(request: dict, name: str, minimum: int) -> int | None:
    value = request.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise BadRequest(f"{name} must be an integer of at least {minimum}")
    return value


def chain_of(request: dict, *names: str) -> list[bytes]:
    """A chain of engine block hashes under the first of ``names`` present: ints (vLLM's u64, SGLang's i64) or
    strings (hex or decimal, as :func:`schemas.parse_block_hash` reads them).

    Raises:
        BadRequest: missing, empty, too long, or a value that is not a block hash.
    """
    hashes = next((request[name] for name in names if name in request), None)
    if not isinstance(hashes, list) or not hashes:
        raise BadRequest(f'expected {{"{names[0]}": [hash, ...]}} with at least one hash (integer or hex)')
    if len(hashes) > MAX_CHAIN_BLOCKS:
        raise BadRequest(f"{len(hashes)} block hashes (limit {MAX_CHAIN_BLOCKS})")
    try:
        return [parse_block_hash(h) if isinstance(h, str) else canonical_block_hash(h) for h in hashes]
    except InvalidBlockHash as exc:
        raise BadRequest(str(exc)) from None


def _instance_request(body: bytes, content_type: str | None) -> tuple[dict, str, int | None]:
    """The body of ``/register`` or ``/unregister`` (Mooncake's conductor body), its ``instance_id`` and its
    ``dp_rank`` (None when not given).

    Raises:
        BadRequest: not a map, no ``instance_id``, or a ``dp_rank`` that is not an integer of at least 0.
    """
    request = decode_body(body, content_type)
    instance = _optional_str(request, "instance_id")
    if instance is None:
        raise BadRequest("instance_id is required")
    return request, instance, _optional_int(request, "dp_rank", 0)


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
        except BadRequest as exc:
            return encode({"error": str(exc)}, msgpack, 400)

    def query(self, body: bytes, content_type: str | None = None, accept: str | None = None) -> Reply:
        """``POST /query``: who holds the longest prefix of these tokens (tokens per instance, tier class, rank)."""
        msgpack = wants_msgpack(content_type, accept)
        if len(body) > MAX_BODY_BYTES:
            return encode({"error": f"request body of {len(body)} bytes (limit {MAX_BODY_BYTES})"}, msgpack, 400)
        is_msgpack = bool(content_type and "msgpack" in content_type)
        try:
            if is_msgpack:
                request = _query_msgpack(body)
                tokens = request.token_ids
            else:
                request, tokens = read_json_query(body)
        except BadRequest as exc:
            return encode({"error": str(exc)}, msgpack, 400)
        except msgspec.ValidationError as exc:
            return encode({"error": f"{exc} (expected {{\"token_ids\": [int32, ...], \"model\": ..., "
                                    f"\"block_size\": int >= 1, ...}})"}, msgpack, 400)
        except msgspec.DecodeError as exc:
            kind = "msgpack" if is_msgpack else "JSON (send Content-Type: application/msgpack for msgpack)"
            return encode({"error": f"request body is not {kind}: {exc}"}, msgpack, 400)
        count = len(tokens) // 4 if isinstance(tokens, bytes) else len(tokens)
        if isinstance(tokens, bytes) and len(tokens) % 4:
            return encode({"error": f"token_ids as bytes must be little-endian int32, 4 bytes per token "
                                    f"({len(tokens)} bytes given)"}, msgpack, 400)
        if count > MAX_TOKENS:
            return encode({"error": f"{count} token ids (limit {MAX_TOKENS})"}, msgpack, 400)
        refusal = self._refusal(msgpack)
        if refusal is not None:
            return refusal
        answer = self.index.query_tokens(tokens, block_size=request.block_size, lora_name=request.lora_name or None,
                                         cache_salt=request.cache_salt or None,
                                         model_name=request.model_name or request.model or None,
                                         tenant_id=request.tenant_id or None)
        return encode(answer, msgpack)

    def query_by_hash(self, body: bytes, content_type: str | None = None, accept: str | None = None) -> Reply:
        """``POST /query_by_hash``: ``/query``'s answer for a chain of the engines' own block hashes."""
        def answer(request: dict) -> dict:
            chain = chain_of(request, "seq_hashes", "block_hashes")
            return self.index.query_hashes(chain, model_name=_optional_str(request, "model_name", "model"),
                                           tenant_id=_optional_str(request, "tenant_id"))
        return self._handle(body, content_type, accept, answer)

    def prefix_match(self, body: bytes, content_type: str | None = None, accept: str | None = None) -> Reply:
        """``POST /prefix-match/``: per (instance, rank) the longest resident prefix per tier, and its score."""
        max_bytes, max_blocks = self.prefix_match_limits

        def answer(request: dict) -> dict:
            chain = chain_of(request, "block_hashes")
            if len(chain) > max_blocks:
                raise BadRequest(f"{len(chain)} block hashes (limit {max_blocks})")
            return {"block_count": len(chain), "weights": self.index.weights,
                    "matches": self.index.prefix_match(chain)}
        if len(body) > max_bytes:
            return encode({"error": f"request body of {len(body)} bytes (limit {max_bytes})"},
                          wants_msgpack(content_type, accept), 400)
        return self._handle(body, content_type, accept, answer)

    def register(self, body: bytes, content_type: str | None = None, accept: str | None = None) -> Reply:
        """``POST /register`` with Mooncake's conductor body (``endpoint``, ``type``, ``modelname``,
        ``instance_id``, ``block_size``, ``dp_rank``, ``tenant_id``, ``lora_name``, ``hash_profile``): records the
        instance's metadata; answers ``{"status": "registered successfully", "instance_id": ...}``."""
        msgpack = wants_msgpack(content_type, accept)
        try:
            request, instance, rank = _instance_request(body, content_type)
            profile = request.get("hash_profile")
            if profile is not None and not isinstance(profile, dict):
                raise BadRequest("hash_profile must be a map")
            info = SourceInfo(instance, model_name=_optional_str(request, "modelname", "model_name", "model"),
                              block_size=_optional_int(request, "block_size", 1),
                              tenant_id=_optional_str(request, "tenant_id") or "default",
                              endpoint=_optional_str(request, "endpoint"),
                              replay_endpoint=_optional_str(request, "replay_endpoint"),
                              engine_type=_optional_str(request, "type"),
                              dp_ranks=set() if rank is None else {rank},
                              lora_name=_optional_str(request, "lora_name"), hash_profile=profile)
            try:
                with self.index.lock:
                    info = self.index.sources.merged(info)
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
        except BadRequest as exc:
            return encode({"error": str(exc)}, msgpack, 400)
        if self._on_register is not None:
            self._on_register(info)
        if self._registrations is not None:
            try:
                self._registrations.write(info)
            except RuntimeError as exc:
                return encode({"error": f"the registration was not written: {exc}; retry"}, msgpack, 503)
        with self.index.lock:
            self.index.sources.put(info)
        return encode({"status": "registered successfully", "instance_id": instance}, msgpack)

    def unregister(self, body: bytes, content_type: str | None = None, accept: str | None = None) -> Reply:
        """``POST /unregister`` with Mooncake's conductor body (``instance_id``, and optionally ``dp_rank``,
        ``type``, ``modelname``, ``block_size``, ``tenant_id``): writes a ``SourceUnregistered`` to ``kv-events``,
        so every worker and every index removes the instance's rows on every tier, in order; answers
        ``{"status": "unregistered successfully", "removed_instances": [...]}``."""
        msgpack = wants_msgpack(content_type, accept)
        try:
            _, instance, rank = _instance_request(body, content_type)
        except BadRequest as exc:
            return encode({"error": str(exc)}, msgpack, 400)
        if self._on_unregister is None:
            return encode({"error": "this process cannot write to kv-events"}, msgpack, 501)
        try:
            self._on_unregister(instance, rank, "POST /unregister")
            if self._registrations is not None:
                self._registrations.remove(instance)
        except (RuntimeError, OSError) as exc:
            return encode({"error": f"the unregistration was not written: {exc}; retry"}, msgpack, 503)
        with self.index.lock:
            self.index.sources.unregister(instance)
        return encode({"status": "unregistered successfully", "removed_instances": [instance]}, msgpack)

    def workers(self, accept: str | None = None) -> Reply:
        """``GET /workers``: every instance and rank known, its blocks per tier, and the index's own figures."""
        return encode({"workers": self.index.workers(), "index": self.index.stats(),
                       "ready": not self._not_ready()}, wants_msgpack(None, accept))

    def dump(self) -> Iterator[bytes]:
        """``GET /dump``: the whole index as JSON lines, one block per line."""
        for block in self.index.dump():
            yield _json_encode(block) + b"\n"
