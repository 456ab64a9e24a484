"""A small client of the index's router APIs, for routers written in Python (docs/querying.md, "For router
authors").

``IndexClient`` is synchronous and keeps one HTTP/1.1 connection alive (a router asks per request, so a new TCP
connection per query would cost more than the query); ``AsyncIndexClient`` does the same on aiohttp. Both speak
msgpack by default, with ``token_ids`` as little-endian int32 bytes, as Mooncake's cache-aware proxy does, and
work against ``kvstream index`` and every ``kvstream worker`` alike.

    with IndexClient("http://127.0.0.1:6080") as index:
        answer = index.query(token_ids, model_name="llama")
        best = max(answer["instances"].items(), key=lambda kv: kv[1]["longest_matched"], default=None)

An answer names every registered rank of the query's context (``longest_matched`` 0 when nothing of the prompt
is cached there), and ``answer["kvstream"]["left_out"]`` says why an instance was not named (model, block size,
tenant, lease).
"""

from __future__ import annotations

import array
import asyncio
import http.client
import ssl
import sys
import urllib.parse
from collections.abc import Sequence

import msgspec

_MSGPACK = "application/msgpack"
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


class IndexQueryError(RuntimeError):
    """The index answered with an error (HTTP 4xx/5xx): ``status``, the index's words and its error map."""

    def __init__(self, status: int, reason: str, body: dict | None = None) -> None:
        super().__init__(f"HTTP {status}: {reason}")
        #: HTTP status: 400 a request the index refused, 404 an unknown service, 405 a wrong method, 503 not
        #: ready yet (retry).
        self.status = status
        #: The index's own words (the error map's ``error``).
        self.reason = reason
        body = body or {}
        #: The stable reason of a refusal (Mooncake's conductor: ``unknown_field``, ``invalid_type``,
        #: ``invalid_value``, ``missing_field``, ``invalid_registration``, ...), or None.
        self.code = body.get("reason") if isinstance(body.get("reason"), str) else None
        #: The field that caused it, and the element of it, where one did.
        self.field = body.get("field")
        self.index = body.get("index")


class IndexUnreachableError(ConnectionError):
    """Nothing answered at the index's URL (refused, timed out, a TLS handshake that failed): ``url`` and the
    underlying ``OSError`` or aiohttp error as ``__cause__``. A ``ConnectionError``, so code that catches
    ``OSError`` keeps working."""

    def __init__(self, url: str, cause: BaseException) -> None:
        super().__init__(f"the index at {url} did not answer: {cause}")
        #: The URL asked.
        self.url = url


def _token_bytes(token_ids: Sequence[int] | bytes) -> bytes:
    if isinstance(token_ids, bytes):
        return token_ids
    packed = array.array("i", token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def query_body(token_ids: Sequence[int] | bytes, *, model_name: str | None = None, lora_name: str | None = None,
               cache_salt: str | None = None, block_size: int | None = None, tenant_id: str | None = None,
               instance_id: str | None = None) -> dict:
    """The body of ``POST /query``: Mooncake's field names, tokens as little-endian int32 bytes (``instance_id``:
    the answer for that instance alone)."""
    body: dict = {"token_ids": _token_bytes(token_ids)}
    for name, value in (("model", model_name), ("lora_name", lora_name), ("cache_salt", cache_salt),
                        ("block_size", block_size), ("tenant_id", tenant_id), ("instance_id", instance_id)):
        if value is not None:
            body[name] = value
    return body


def _hash_value(block_hash: bytes | int | str) -> int | str:
    if isinstance(block_hash, bytes):
        return block_hash.hex()
    return block_hash


def _answer(status: int, data: bytes):
    try:
        value = _decode(data) if data else {}
    except msgspec.DecodeError:  # not msgpack: a proxy's or a server's own page
        if status >= 400:
            raise IndexQueryError(status, data[:200].decode(errors="replace")) from None
        raise
    if status >= 400:
        if isinstance(value, dict):
            raise IndexQueryError(status, value.get("error", ""), value)
        raise IndexQueryError(status, str(value))
    return value


def _unregister_body(instance_id: str, dp_rank: int, tenant_id: str | None) -> dict:
    return {"instance_id": instance_id, "dp_rank": dp_rank, **({"tenant_id": tenant_id} if tenant_id else {})}


def _tls_context(ssl_context: ssl.SSLContext | None, ca_file, cert_file, key_file, key_password) -> ssl.SSLContext:
    if ssl_context is not None:
        return ssl_context
    from stream_apps.web_access import client_ssl_context

    return client_ssl_context(ca_file, cert_file, key_file, key_password)


def _auth_headers(token: str | None) -> dict:
    return {"Authorization": f"Bearer {token}"} if token else {}


class IndexClient:
    """Synchronous client of ``/query``, ``/query_by_hash``, ``/prefix-match/``, ``/register``, ``/unregister``,
    ``/services``, ``/global_view`` and ``/workers``.

    Args:
        url: the index's or a worker's base URL (``http://HOST:PORT`` or ``https://HOST:PORT``).
        timeout_s: per request (Mooncake's proxy waits 1 s).
        token: sent as ``Authorization: Bearer <token>`` (one of the servers' ``--api-token-file``); needed for
            ``register`` and ``unregister``, and for reads of a server started with ``--read-requires-token``.
        ssl_context: the TLS context of an ``https://`` URL; else one built from ``ca_file`` (PEM; None: the
            system's CAs), and ``cert_file``, ``key_file``, ``key_password`` for a server that requires a client
            certificate (mutual TLS).

    Raises (from every call):
        IndexQueryError: the index answered 4xx or 5xx (``status`` 503: not caught up yet, retry).
        IndexUnreachableError: nothing answered at ``url``.
    """

    def __init__(self, url: str, timeout_s: float = 1.0, *, token: str | None = None,
                 ssl_context: ssl.SSLContext | None = None, ca_file=None, cert_file=None, key_file=None,
                 key_password: str | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https", "") or not parts.hostname:
            raise ValueError(f"index URL {url!r}: expected http://HOST:PORT or https://HOST:PORT")
        self._https = parts.scheme == "https"
        self._host, self._port, self._timeout = parts.hostname, parts.port or (443 if self._https else 80), timeout_s
        self._tls = _tls_context(ssl_context, ca_file, cert_file, key_file, key_password) if self._https else None
        self._auth = _auth_headers(token)
        self._connection: http.client.HTTPConnection | None = None
        self._url = url.rstrip("/")

    def _connect(self) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(self._host, self._port, timeout=self._timeout, context=self._tls)
        return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)

    def _request(self, method: str, path: str, body: dict | None = None):
        data = None if body is None else _encode(body)
        headers = {"Accept": _MSGPACK, **self._auth, **({"Content-Type": _MSGPACK} if data is not None else {})}
        for attempt in (0, 1):  # one retry: a kept-alive connection the server closed meanwhile
            if self._connection is None:
                self._connection = self._connect()
            try:
                self._connection.request(method, path, body=data, headers=headers)
                response = self._connection.getresponse()
                return _answer(response.status, response.read())
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                self.close()
                if attempt:
                    raise IndexUnreachableError(self._url, exc) from exc
            except OSError as exc:
                self.close()
                raise IndexUnreachableError(self._url, exc) from exc
        raise AssertionError("unreachable")

    def query(self, token_ids: Sequence[int] | bytes, **options) -> dict:
        """``POST /query``: ``{"instances": {id: {"longest_matched", "gpu", "cpu", "disk", "dp", "rank_matches",
        ...}}, "scores": ..., "kvstream": {"ranks", "left_out"}}`` in tokens; ``options`` are :func:`query_body`'s."""
        return self._request("POST", "/query", query_body(token_ids, **options))

    def query_by_hash(self, block_hashes: Sequence[bytes | int | str], **options) -> dict:
        """``POST /query_by_hash`` with the engines' own block hashes (canonical bytes, ints or hex)."""
        return self._request("POST", "/query_by_hash", {"seq_hashes": [_hash_value(h) for h in block_hashes],
                                                         **options})

    def prefix_match(self, block_hashes: Sequence[bytes | int | str]) -> dict:
        """``POST /prefix-match/``: ``{"block_count", "weights", "matches": [...]}``."""
        return self._request("POST", "/prefix-match/", {"block_hashes": [
            h.hex() if isinstance(h, bytes) else str(h) for h in block_hashes]})

    def register(self, instance_id: str, **metadata) -> dict:
        """``POST /register`` with Mooncake's fields (``endpoint``, ``type``, ``modelname``, ``block_size``,
        ``dp_rank``, ``hash_profile``, ...)."""
        return self._request("POST", "/register", {"instance_id": instance_id, **metadata})

    def unregister(self, instance_id: str, dp_rank: int, tenant_id: str | None = None) -> dict:
        """``POST /unregister`` of one registered rank: ``{"status", "removed_instances": ["<id>|<tenant>|<rank>"]}``
        (an unknown service key: :class:`IndexQueryError` 404)."""
        return self._request("POST", "/unregister", _unregister_body(instance_id, dp_rank, tenant_id))

    def services(self) -> dict:
        """``GET /services``: ``{"count", "services": [{"Endpoint", "InstanceID", "DPRank", ...}]}``."""
        return self._request("GET", "/services")

    def global_view(self) -> dict:
        """``GET /global_view``: ``{"context_count", "contexts": [...]}``."""
        return self._request("GET", "/global_view")

    def workers(self) -> dict:
        """``GET /workers``."""
        return self._request("GET", "/workers")

    def close(self) -> None:
        """Close the kept-alive connection (the next call opens another)."""
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def __enter__(self) -> IndexClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncIndexClient:
    """:class:`IndexClient` on aiohttp, for routers built on asyncio; use as ``async with`` (the same arguments)."""

    def __init__(self, url: str, timeout_s: float = 1.0, *, token: str | None = None,
                 ssl_context: ssl.SSLContext | None = None, ca_file=None, cert_file=None, key_file=None,
                 key_password: str | None = None) -> None:
        import aiohttp

        self._url = url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._tls = _tls_context(ssl_context, ca_file, cert_file, key_file, key_password) \
            if self._url.startswith("https://") else None
        self._auth = _auth_headers(token)
        self._session: aiohttp.ClientSession | None = None

    async def _request(self, method: str, path: str, body: dict | None = None):
        import aiohttp

        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._tls) if self._tls is not None else None
            self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector)
        data = None if body is None else _encode(body)
        headers = {"Accept": _MSGPACK, **self._auth, **({"Content-Type": _MSGPACK} if data is not None else {})}
        try:
            async with self._session.request(method, self._url + path, data=data, headers=headers) as response:
                return _answer(response.status, await response.read())
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            raise IndexUnreachableError(self._url, exc) from exc
        raise aiohttp.ClientError("unreachable")

    async def query(self, token_ids: Sequence[int] | bytes, **options) -> dict:
        """:meth:`IndexClient.query`."""
        return await self._request("POST", "/query", query_body(token_ids, **options))

    async def query_by_hash(self, block_hashes: Sequence[bytes | int | str], **options) -> dict:
        """:meth:`IndexClient.query_by_hash`."""
        return await self._request("POST", "/query_by_hash",
                                   {"seq_hashes": [_hash_value(h) for h in block_hashes], **options})

    async def prefix_match(self, block_hashes: Sequence[bytes | int | str]) -> dict:
        """:meth:`IndexClient.prefix_match`."""
        return await self._request("POST", "/prefix-match/", {"block_hashes": [
            h.hex() if isinstance(h, bytes) else str(h) for h in block_hashes]})

    async def register(self, instance_id: str, **metadata) -> dict:
        """:meth:`IndexClient.register`."""
        return await self._request("POST", "/register", {"instance_id": instance_id, **metadata})

    async def unregister(self, instance_id: str, dp_rank: int, tenant_id: str | None = None) -> dict:
        """:meth:`IndexClient.unregister`."""
        return await self._request("POST", "/unregister", _unregister_body(instance_id, dp_rank, tenant_id))

    async def services(self) -> dict:
        """:meth:`IndexClient.services`."""
        return await self._request("GET", "/services")

    async def global_view(self) -> dict:
        """:meth:`IndexClient.global_view`."""
        return await self._request("GET", "/global_view")

    async def workers(self) -> dict:
        """:meth:`IndexClient.workers`."""
        return await self._request("GET", "/workers")

    async def close(self) -> None:
        """Close the session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> AsyncIndexClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
