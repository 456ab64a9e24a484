"""Who may do what on the web port of a worker and of ``kvstream index`` (docs/security.md, "HTTP views").

One rule, for both servers (an aiohttp middleware: :func:`access_middleware`; Faust's web server is aiohttp too):

* what changes the fleet (``POST /register``, ``POST /unregister``: :data:`WRITE_PATHS`) needs a bearer token from
  the token file (``--api-token-file``), unless the peer is in a network of ``--register-allow-cidr`` and the path
  is ``/register`` (Mooncake's unmodified proxy registers with no credential);
* reads (``/query``, ``/prefix-match/``, ``/residency/``, ...) are open, or need a token too with
  ``--read-requires-token``;
* the probes (``/health``, ``/ready``) and ``/metrics`` are always open.

The token file holds one token a line (``TOKEN``, or ``NAME TOKEN``; ``#`` comments and blank lines skipped): every
token in it is valid at once, so a new one is added, the clients moved to it, the old one removed; the file is
read again whenever it changes (its modification time, size or inode), without a restart. A token is compared to
every valid one with :func:`hmac.compare_digest`. A refusal is a ``401`` (no token) or ``403`` (a wrong one, or a
peer not allowed), each with a JSON reason, a log line (never the token) and a count
(``kvstream_http_refusals_total``). Every change a write makes is logged with who made it, what it was, and the
state before and after (:func:`audit_change`).

Also here: the TLS contexts of the web port and of its clients (:func:`server_ssl_context`,
:func:`client_ssl_context`), and the refusal to serve a non-loopback address without a token file
(:func:`check_exposure`).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import ipaddress
import logging
import os
import ssl
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: Paths that write to Kafka or change shared state (any later one is added here), without a trailing slash.
WRITE_PATHS = frozenset({"/register", "/unregister"})
#: Paths a ``--register-allow-cidr`` network may call without a token.
REGISTER_PATHS = frozenset({"/register"})
#: Paths always open: the probes and the metrics.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})

#: Who made the request being served (set by :func:`access_middleware`, read by :func:`audit_change`).
current_principal: contextvars.ContextVar[str] = contextvars.ContextVar("kvstream_principal", default="anonymous")


def _fingerprint(token: bytes) -> str:
    return "sha256:" + hashlib.sha256(token).hexdigest()[:12]


class TokenFile:
    """The valid bearer tokens, read from ``path`` and read again whenever the file changes.

    A file that cannot be read, or holds no token, makes every token invalid (an error is logged once per
    change): a deleted file must not leave a rotated-out token working.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp: tuple | None = None
        #: (name, token bytes) of every valid token.
        self._tokens: list[tuple[str, bytes]] = []
        self.tokens()

    def tokens(self) -> list[tuple[str, bytes]]:
        """(name, token) of every valid token, re-read if the file changed since the last call."""
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError as exc:
            stamp = ("missing", str(exc))
        if stamp == self._stamp:
            return self._tokens
        with self._lock:
            if stamp != self._stamp:
                try:
                    tokens = _parse_tokens(self.path.read_text())
                except OSError as exc:
                    tokens = []
                    log.error("web access: the token file %s cannot be read (%s): every token is refused until it "
                              "can", self.path, exc.strerror or exc)
                else:
                    if not tokens:
                        log.error("web access: the token file %s holds no token: every token is refused", self.path)
                    elif self._stamp is not None:
                        log.info("web access: read %s again: %d valid token(s) (%s)", self.path, len(tokens),
                                 ", ".join(name for name, _ in tokens))
                self._tokens, self._stamp = tokens, stamp
        return self._tokens

    def match(self, presented: bytes) -> str | None:
        """The name of the valid token equal to ``presented``, or None; compared in constant time with every
        valid token (no early exit, so the time says nothing about which or how many matched)."""
        found = None
        for name, token in self.tokens():
            if hmac.compare_digest(presented, token) and found is None:
                found = name
        return found

    def first(self) -> str | None:
        """The first valid token (what this process sends to its peers), or None."""
        tokens = self.tokens()
        return tokens[0][1].decode() if tokens else None


def _parse_tokens(text: str) -> list[tuple[str, bytes]]:
    tokens = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        words = line.split()
        token = words[-1].encode()
        name = words[0] if len(words) > 1 else _fingerprint(token)
        tokens.append((name, token))
    return tokens


def parse_networks(values: Iterable[str]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """``--register-allow-cidr`` values (each comma-separated CIDRs, e.g. ``10.0.0.0/8,fd00::/8``) as networks.

    Raises:
        ValueError: not a network, naming the flag.
    """
    networks = []
    for value in values:
        for text in value.split(","):
            text = text.strip()
            if not text:
                continue
            try:
                networks.append(ipaddress.ip_network(text, strict=False))
            except ValueError as exc:
                raise ValueError(f"--register-allow-cidr {text!r}: {exc}") from None
    return networks


@dataclass(frozen=True)
class Verdict:
    """What to do with one request: ``allowed``, else ``status`` (401 or 403) and the JSON ``body`` of the
    refusal; ``who`` names the caller for the log (a token's name, a network, or ``anonymous``)."""

    allowed: bool
    who: str
    status: int = 200
    body: dict | None = None


def _normal(path: str) -> str:
    return path.rstrip("/") or "/"


class AccessPolicy:
    """The verdict of every request of one server (module docstring).

    Args:
        tokens: the token file, or None: no token exists, and what would need one is open (a server bound to a
            loopback address, or started with ``--insecure-http``).
        read_requires_token: reads need a token too (``--read-requires-token``).
        register_allow: networks whose peers may ``POST /register`` with no token (``--register-allow-cidr``).
    """

    def __init__(self, tokens: TokenFile | None = None, *, read_requires_token: bool = False,
                 register_allow: Sequence = ()) -> None:
        self.tokens = tokens
        self.read_requires_token = read_requires_token
        self.register_allow = list(register_allow)
        #: (path, status) -> refusals (``kvstream_http_refusals_total``).
        self.refusals: Counter[tuple[str, int]] = Counter()

    def _allowed_network(self, peer: str | None):
        if not peer or not self.register_allow:
            return None
        try:
            address = ipaddress.ip_address(peer.split("%", 1)[0])
        except ValueError:
            return None
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return next((net for net in self.register_allow if address.version == net.version and address in net),
                    None)

    def verdict(self, method: str, path: str, peer: str | None, authorization: str | None) -> Verdict:
        """Allow or refuse ``method path`` from ``peer`` (an IP address, or None) with this ``Authorization``
        header (or None); a refusal is counted and logged here."""
        path = _normal(path)
        if path in OPEN_PATHS:
            return Verdict(True, "anonymous")
        writes = path in WRITE_PATHS
        if not writes and not self.read_requires_token:
            return Verdict(True, "anonymous")
        if path in REGISTER_PATHS and (network := self._allowed_network(peer)) is not None \
                and not authorization:
            return Verdict(True, f"network {network} (peer {peer})")
        if self.tokens is None:
            return Verdict(True, f"anonymous (no --api-token-file; peer {peer})")
        scheme, _, presented = (authorization or "").strip().partition(" ")
        what = "changing the fleet" if writes else "reading"
        if not authorization:
            return self._refuse(path, peer, 401, "unauthorized",
                                f"{method} {path} needs a bearer token ({what}): send 'Authorization: Bearer "
                                "<token>'")
        if scheme.lower() != "bearer" or not presented.strip():
            return self._refuse(path, peer, 401, "unauthorized",
                                f"{method} {path}: the Authorization header is not 'Bearer <token>'")
        name = self.tokens.match(presented.strip().encode())
        if name is None:
            return self._refuse(path, peer, 403, "forbidden", f"{method} {path}: the bearer token is not valid "
                                                              "(unknown, or rotated out)")
        return Verdict(True, f"token {name}")

    def _refuse(self, path: str, peer: str | None, status: int, reason: str, message: str) -> Verdict:
        self.refusals[(path, status)] += 1
        log.warning("web access: refused %s from %s: %d %s", path, peer or "?", status, message)
        return Verdict(False, "anonymous", status, {"error": message, "reason": reason})

    def describe(self) -> str:
        """What this policy asks, for the start's log line (never a token)."""
        if self.tokens is None:
            return "no token file: changes are open to every client that reaches the port"
        parts = [f"changes need a token of {self.tokens.path}"]
        if self.read_requires_token:
            parts.append("reads too")
        if self.register_allow:
            parts.append("POST /register open to " + ", ".join(str(net) for net in self.register_allow))
        return "; ".join(parts)

    def peer_token(self) -> str | None:
        """The token this process sends when it calls another (the first of the file), or None."""
        return self.tokens.first() if self.tokens is not None else None


def access_middleware(policy: AccessPolicy):
    """An aiohttp middleware applying ``policy`` before every handler, and naming the caller for
    :func:`audit_change` (``kvstream index``'s application and the worker's Faust web application use it)."""
    from aiohttp import web

    @web.middleware
    async def check_access(request, handler):
        verdict = policy.verdict(request.method, request.path, request.remote, request.headers.get("Authorization"))
        if not verdict.allowed:
            headers = {"WWW-Authenticate": 'Bearer realm="kvstream"'} if verdict.status == 401 else None
            return refusal_response(request, verdict.body, verdict.status, headers)
        token = current_principal.set(f"{verdict.who}, peer {request.remote}")
        try:
            return await handler(request)
        finally:
            current_principal.reset(token)
    return check_access


class IncompleteBody(Exception):
    """The client's body stopped before its end (the connection closed, or the chunks were malformed)."""


async def read_body(request, limit: int) -> bytes:
    """The request body, or its first ``limit`` bytes if it is longer (the API then refuses it as too large);
    read chunk by chunk (``content.read(n)`` alone returns what has arrived so far, which under load is part of
    the body), so no more than ``limit`` bytes are ever held.

    Raises:
        IncompleteBody: the body stopped half-way (:func:`body_limit_middleware` answers 400).
    """
    from aiohttp import ClientConnectionError, ClientPayloadError

    body = bytearray()
    try:
        while len(body) < limit:
            chunk = await request.content.read(limit - len(body))
            if not chunk:
                break
            body += chunk
    except (ClientPayloadError, ClientConnectionError, ConnectionError) as exc:
        raise IncompleteBody(str(exc) or type(exc).__name__) from None
    return bytes(body)


def body_limit_middleware(limit=None):
    """An aiohttp middleware: a body whose ``Content-Length`` is over ``limit()`` bytes (default: the router
    APIs' ``--max-body-bytes``) is refused with a JSON 413 before any of it is read, and a body that stops
    half-way (:class:`IncompleteBody`) with a JSON 400."""
    from aiohttp import web

    def default_limit() -> int:
        from stream_apps.index import api
        return api.MAX_BODY_BYTES + 1024

    limit = limit or default_limit

    @web.middleware
    async def check_body(request, handler):
        allowed = limit()
        if request.content_length is not None and request.content_length > allowed:
            return refusal_response(request, {"error": f"request body of {request.content_length} bytes (limit "
                                                      f"{allowed - 1024})", "reason": "too_large"}, 413,
                                    {"Connection": "close"})
        try:
            return await handler(request)
        except IncompleteBody as exc:
            return refusal_response(request, {"error": f"the request body stopped before its end: {exc}",
                                              "reason": "incomplete_body"}, 400)
    return check_body


def refusal_response(request, body: dict, status: int, headers: dict | None = None):
    """An aiohttp response of a refusal's error map, in msgpack or JSON as the router APIs answer (``Accept``,
    else the request's own type: Mooncake's proxy reads msgpack)."""
    from aiohttp import web

    from stream_apps.index.api import encode, wants_msgpack

    reply = encode(body, wants_msgpack(request.headers.get("Content-Type"), request.headers.get("Accept")), status)
    return web.Response(status=status, body=reply.body, content_type=reply.content_type, headers=headers)


def refusals_family(policy: AccessPolicy | None):
    """The Prometheus family ``kvstream_http_refusals_total`` of ``policy`` (by path and status)."""
    from prometheus_client.core import CounterMetricFamily

    family = CounterMetricFamily("kvstream_http_refusals", "HTTP requests refused for want of a valid token or "
                                 "an allowed network, by path and status", labels=["path", "status"])
    for (path, status), n in sorted((policy.refusals if policy is not None else {}).items()):
        family.add_metric([path, str(status)], n)
    return family


def audit_change(what: str, subject: str, before, after) -> None:
    """Log one change of the fleet's state: who (the request's caller), what, and the state before and after."""
    log.warning("web access: change by %s: %s %s: before %s, after %s", current_principal.get(), what, subject,
                _state(before), _state(after))


def _state(value) -> str:
    if value is None:
        return "none"
    if hasattr(value, "__dataclass_fields__"):
        from dataclasses import asdict
        value = asdict(value)
    return repr(value)


# -- exposure and TLS --------------------------------------------------------------------------------------------

def is_loopback(bind: str) -> bool:
    """Whether ``bind`` (an address or ``localhost``) is a loopback address."""
    if bind.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(settings, log_to: logging.Logger | None = None) -> None:
    """Refuse to serve a non-loopback address without a token file, unless ``--insecure-http``; with it, log a
    warning (at every start). Also checks the token file can be read.

    Raises:
        ValueError: one line naming the flags.
    """
    out = log_to or log
    if settings.api_token_file is not None:
        read_token(settings.api_token_file)  # readable, and holds a token: else one line naming the flag
        return
    if is_loopback(settings.web_bind):
        return
    if not settings.insecure_http:
        raise ValueError(f"--web-bind {settings.web_bind} is not a loopback address and no --api-token-file "
                         "(KVSTREAM_API_TOKEN_FILE) is given: anyone reaching the port could register and "
                         "unregister instances for the whole fleet; give --api-token-file, or --insecure-http to "
                         "serve it anyway")
    out.warning("web access: --insecure-http: %s is served without a token file: any client reaching it can "
                "register and unregister instances for the whole fleet", settings.web_bind)


def policy_from_settings(settings) -> AccessPolicy:
    """The :class:`AccessPolicy` of a server's settings (``api_token_file``, ``read_requires_token``,
    ``register_allow_cidr``)."""
    tokens = TokenFile(settings.api_token_file) if settings.api_token_file is not None else None
    return AccessPolicy(tokens, read_requires_token=settings.read_requires_token,
                        register_allow=parse_networks(settings.register_allow_cidr))


def server_ssl_context(cert: Path | None, key: Path | None, client_ca: Path | None = None,
                       key_password_file: Path | None = None) -> ssl.SSLContext | None:
    """The web port's TLS context: ``cert`` and ``key`` (PEM, as ``kvstream broker start --tls-dir`` writes
    ``broker.pem`` and ``broker-key.pem``); with ``client_ca``, every client must present a certificate it signed
    (mutual TLS). None without a certificate.

    Raises:
        ValueError: a certificate without its key (or the other way), or a file that cannot be loaded.
    """
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError("--web-tls-client-ca needs --web-tls-cert and --web-tls-key (HTTPS)")
        return None
    if cert is None or key is None:
        raise ValueError("--web-tls-cert and --web-tls-key go together")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    password = key_password_file.read_text().strip() if key_password_file is not None else None
    try:
        context.load_cert_chain(str(cert), str(key), password=password)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--web-tls-cert {cert} / --web-tls-key {key}: {exc}") from None
    if client_ca is not None:
        try:
            context.load_verify_locations(cafile=str(client_ca))
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--web-tls-client-ca {client_ca}: {exc}") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_ssl_context(ca: Path | str | None = None, cert: Path | str | None = None, key: Path | str | None = None,
                       key_password: str | None = None) -> ssl.SSLContext:
    """A client's TLS context for the web port: the server checked against ``ca`` (PEM; None: the system's CAs)
    and its host name; ``cert`` and ``key``: the client's certificate, for a server that requires one."""
    context = ssl.create_default_context(cafile=str(ca) if ca is not None else None)
    if cert is not None:
        context.load_cert_chain(str(cert), str(key) if key is not None else None, password=key_password)
    return context


def peer_client_class(ssl_context: ssl.SSLContext | None):
    """A :class:`aiohttp.ClientSession` class (Faust's ``HttpClient`` setting) whose connections use
    ``ssl_context``: the worker's calls to the other workers over HTTPS."""
    import aiohttp

    class PeerHttpClient(aiohttp.ClientSession):
        """Faust's HTTP client of this worker, on the web port's client TLS context."""

        def __init__(self, **kwargs) -> None:
            if ssl_context is not None and "connector" not in kwargs:
                kwargs["connector"] = aiohttp.TCPConnector(ssl=ssl_context)
            super().__init__(**kwargs)
    return PeerHttpClient


def read_token(path: Path | str | None) -> str | None:
    """The first token of a token file (what a client sends), or None without a file.

    Raises:
        ValueError: the file cannot be read or holds no token.
    """
    if path is None:
        return None
    try:
        tokens = _parse_tokens(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"--api-token-file {path}: {exc.strerror or exc}") from None
    if not tokens:
        raise ValueError(f"--api-token-file {path}: holds no token (one a line: TOKEN, or NAME TOKEN)")
    return tokens[0][1].decode()
