"""The web port's access, TLS and body-limit settings, declared once and used by ``kvstream worker``
(:class:`stream_apps.settings.WorkerSettings`), ``kvstream index`` (:class:`stream_apps.index.settings.
IndexSettings`) and, for the client's side, ``kvstream query`` (:class:`kvstream.settings.QuerySettings`).

Each is an ``Annotated`` type carrying its pydantic ``Field``: a settings class declares ``name: Type = default``
and gets the flag, the variable and the help text (docs/configuration.md, docs/security.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BeforeValidator, Field

#: An empty value (``KVSTREAM_API_TOKEN_FILE=``) is no file, not the current directory.
_EMPTY_IS_NONE = BeforeValidator(lambda value: None if value == "" else value)

# -- servers: who may do what -------------------------------------------------------------------------------------

ApiTokenFile = Annotated[Path | None, _EMPTY_IS_NONE, Field(
    description="file of the bearer tokens that may change the fleet (POST /register, /unregister), one a line "
                "(TOKEN or NAME TOKEN), several valid at once, read again when it changes; required to bind a "
                "non-loopback address unless --insecure-http")]
ReadRequiresToken = Annotated[bool, Field(
    description="reads (/query, /prefix-match/, /residency/, ...) need a bearer token too; probes and /metrics "
                "stay open")]
RegisterAllowCidr = Annotated[str, Field(
    description="comma-separated client networks (CIDR) that may POST /register with no token, e.g. for "
                "Mooncake's unmodified proxy; empty: none")]
InsecureHttp = Annotated[bool, Field(
    description="serve a non-loopback --web-bind with no --api-token-file: anyone reaching the port may change "
                "the fleet (a warning is logged at every start)")]

# -- servers: HTTPS -----------------------------------------------------------------------------------------------

WebTlsCert = Annotated[Path | None, _EMPTY_IS_NONE, Field(
    description="PEM certificate (chain) of the web port: serve HTTPS (as kvstream broker start --tls-dir's "
                "broker.pem); none: plain HTTP")]
WebTlsKey = Annotated[Path | None, _EMPTY_IS_NONE, Field(
    description="PEM private key of --web-tls-cert (unencrypted)")]
WebTlsClientCa = Annotated[Path | None, _EMPTY_IS_NONE, Field(
    description="PEM CA certificate(s): every client must present a certificate they signed (mutual TLS); "
                "none: no client certificate asked")]
WebTlsCa = Annotated[Path | None, _EMPTY_IS_NONE, Field(
    description="PEM CA certificate(s) other workers' web certificates are checked against when this worker "
                "forwards a lookup (it presents its own --web-tls-cert); none: --web-tls-client-ca, else the "
                "system's CAs")]

# -- servers: body limits -----------------------------------------------------------------------------------------

MaxBodyBytes = Annotated[int, Field(ge=1024, description="largest request body of the router APIs, bytes; a "
                                                         "longer one is refused (413 or 400 too_large) unread")]
MaxTokens = Annotated[int, Field(ge=1, description="most token ids of one POST /query")]
MaxHashes = Annotated[int, Field(ge=1, description="most block hashes of one POST /query_by_hash or "
                                                   "/prefix-match/ (a worker's /prefix-match/ keeps its 2048)")]
MaxNestingDepth = Annotated[int, Field(ge=2, le=200, description="deepest nesting of arrays and maps in a request "
                                                                "body; deeper is refused (400 too_deep)")]

# -- clients ------------------------------------------------------------------------------------------------------

ClientTokenFile = Annotated[Path | None, _EMPTY_IS_NONE, Field(
    description="file whose first token is sent as 'Authorization: Bearer' (the servers' --api-token-file); "
                "none: no token")]
ClientCa = Annotated[Path | None, _EMPTY_IS_NONE, Field(
    description="PEM CA certificate(s) an https:// server's certificate is checked against; none: the system's CAs")]
ClientCert = Annotated[Path | None, _EMPTY_IS_NONE, Field(
    description="PEM client certificate, for a server that requires one (--web-tls-client-ca)")]
ClientKey = Annotated[Path | None, _EMPTY_IS_NONE, Field(
    description="PEM private key of --web-client-cert")]
ClientKeyPasswordFile = Annotated[Path | None, _EMPTY_IS_NONE, Field(
    description="file holding the password of an encrypted --web-client-key")]
