"""Kafka client configuration shared by every client of the project, in one place.

Producers (confluent-kafka), the admin helpers and the tools build their
settings here, so a setting such as the bootstrap servers or security is given
once. The Faust stream app takes the same bootstrap servers through
``kvstream worker --bootstrap-servers`` and the same security settings through
:func:`aiokafka_security` (``stream_apps.app.broker_credentials``).

Security settings come from the environment only (:data:`SECURITY_ENVIRONMENT`),
are read at each call and are never logged or put on a command line.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Annotated

from pydantic import AfterValidator, Field

#: Default bootstrap servers: the embedded broker of ``kvstream broker start``. Commands take theirs from
#: their settings object (flag, then ``KVSTREAM_BOOTSTRAP_SERVERS``, then this).
DEFAULT_BOOTSTRAP_SERVERS = "127.0.0.1:9092"

#: Default partition count of kv-events; the stream app's internal topics and
#: tables use the same count (Faust requires co-partitioning).
DEFAULT_PARTITIONS = 8

#: Environment variables of the replication of every topic kvstream creates (:func:`topic_replication`).
REPLICATION_FACTOR_ENV = "KVSTREAM_REPLICATION_FACTOR"
MIN_INSYNC_REPLICAS_ENV = "KVSTREAM_MIN_INSYNC_REPLICAS"


def topic_replication(brokers: int) -> tuple[int, int | None]:
    """(``replication.factor``, ``min.insync.replicas`` or None) of the topics kvstream creates on a cluster of
    ``brokers`` brokers: ``min(3, brokers)`` replicas, and a min ISR of 2 once that factor is 3 or more (None:
    the broker's default, as on one broker). ``KVSTREAM_REPLICATION_FACTOR`` and ``KVSTREAM_MIN_INSYNC_REPLICAS``
    override them; what Kafka then refuses (more replicas than brokers) it refuses with its own error.

    Raises:
        ValueError: a variable that is not a positive integer.
    """
    def positive(name: str) -> int | None:
        value = os.environ.get(name, "").strip()
        if not value:
            return None
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{name}={value!r} is not a positive integer")
        return int(value)

    factor = positive(REPLICATION_FACTOR_ENV) or min(3, max(1, brokers))
    min_isr = positive(MIN_INSYNC_REPLICAS_ENV)
    return factor, min_isr if min_isr is not None else (2 if factor >= 3 else None)


#: Seconds a command waits for the bootstrap servers' first answer (their metadata) before it fails, naming
#: them: a wrong address or a broker that is down fails in seconds, not after librdkafka's 30 s retries.
CONNECT_TIMEOUT_S = 5.0


def check_bootstrap_servers(servers: str) -> str:
    """``servers`` if it is a bootstrap list Kafka clients take: ``HOST:PORT[,HOST:PORT...]``.

    Raises:
        ValueError: empty, a URL scheme (``kafka://``, ``PLAINTEXT://``: librdkafka would try to resolve it as
            a host name and only time out), or an entry without a port; the message shows the accepted form.
    """
    entries = [entry.strip() for entry in servers.split(",")]
    for entry in entries:
        if "://" in entry:
            raise ValueError(f"bootstrap server {entry!r} has a URL scheme; give HOST:PORT, e.g. "
                             f"{entry.split('://', 1)[1] or '127.0.0.1:9092'!r} (security goes in "
                             "KVSTREAM_SECURITY_PROTOCOL)")
        host, _, port = entry.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"bootstrap server {entry!r} is not HOST:PORT (e.g. 127.0.0.1:9092)")
    return ",".join(entries)


#: The type of every command's ``bootstrap_servers`` setting (``KVSTREAM_BOOTSTRAP_SERVERS``): checked by
#: :func:`check_bootstrap_servers` (``HOST:PORT[,HOST:PORT...]``, no URL scheme).
BootstrapServers = Annotated[str, AfterValidator(check_bootstrap_servers),
                             Field(description="Kafka bootstrap servers, HOST:PORT[,...]")]


class _OncePerMessage(logging.Filter):
    """Let each librdkafka message through once (digits ignored): a down broker otherwise logs every retry."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        text = re.sub(r"\d+", "#", record.getMessage())
        if text in self._seen:
            return False
        self._seen.add(text)
        return True


#: librdkafka's log of every client of the project (errors only, each message once).
LIBRDKAFKA_LOG = logging.getLogger("kvstream.librdkafka")
LIBRDKAFKA_LOG.setLevel(logging.ERROR)
LIBRDKAFKA_LOG.addFilter(_OncePerMessage())


#: Environment variable -> librdkafka setting, for the security settings every client takes.
SECURITY_ENVIRONMENT = {
    "KVSTREAM_SECURITY_PROTOCOL": "security.protocol",  # PLAINTEXT (default), SSL, SASL_PLAINTEXT, SASL_SSL
    "KVSTREAM_SASL_MECHANISM": "sasl.mechanism",  # e.g. SCRAM-SHA-512, SCRAM-SHA-256, PLAIN
    "KVSTREAM_SASL_USERNAME": "sasl.username",
    "KVSTREAM_SASL_PASSWORD": "sasl.password",
    "KVSTREAM_SSL_CA_LOCATION": "ssl.ca.location",  # CA certificate (PEM) that signed the brokers'
    "KVSTREAM_SSL_CERTIFICATE_LOCATION": "ssl.certificate.location",  # client certificate (PEM), for mTLS
    "KVSTREAM_SSL_KEY_LOCATION": "ssl.key.location",  # client key (PEM), for mTLS
    "KVSTREAM_SSL_KEY_PASSWORD": "ssl.key.password",  # password of an encrypted client key
}

#: The values KVSTREAM_SECURITY_PROTOCOL may take (any case).
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")


def security_config() -> dict:
    """The security settings given in the environment (:data:`SECURITY_ENVIRONMENT`), as librdkafka settings.

    Read at each call, never logged. Empty when none is set (PLAINTEXT).

    Returns:
        librdkafka setting -> value (strings); ``security.protocol`` upper-cased.

    Raises:
        ValueError: KVSTREAM_SECURITY_PROTOCOL is not one of :data:`SECURITY_PROTOCOLS`, or a
            ``KVSTREAM_SSL_*_LOCATION`` names no readable file (the message names the variable and the
            path, never a password), or only one of the client certificate and key is given.
    """
    settings = {key: os.environ[name] for name, key in SECURITY_ENVIRONMENT.items() if os.environ.get(name)}
    if "security.protocol" in settings:
        settings["security.protocol"] = settings["security.protocol"].upper()
        if settings["security.protocol"] not in SECURITY_PROTOCOLS:
            raise ValueError(f"KVSTREAM_SECURITY_PROTOCOL={os.environ['KVSTREAM_SECURITY_PROTOCOL']!r} is not one of "
                             f"{', '.join(SECURITY_PROTOCOLS)}")
    for name, key in SECURITY_ENVIRONMENT.items():
        if key.endswith(".location") and key in settings and not os.access(settings[key], os.R_OK):
            raise ValueError(f"{name}={settings[key]!r}: no such readable file")
    if ("ssl.certificate.location" in settings) != ("ssl.key.location" in settings):
        raise ValueError("KVSTREAM_SSL_CERTIFICATE_LOCATION and KVSTREAM_SSL_KEY_LOCATION go together "
                         "(a client certificate needs its key)")
    return settings


def aiokafka_security() -> dict:
    """The same security settings as keyword arguments of aiokafka clients (and of Faust's credentials).

    Returns:
        ``security_protocol``; with SASL ``sasl_mechanism``, ``sasl_plain_username``,
        ``sasl_plain_password``; with SSL or SASL_SSL an ``ssl_context`` made by aiokafka's
        ``create_ssl_context`` (hostname checked; the CA file, else the system's CAs; the client
        certificate and key, decrypted with the key password, when given). Empty for PLAINTEXT.

    Raises:
        ValueError: as :func:`security_config`; or the client certificate and key do not load
            (wrong key password, key not matching the certificate).
    """
    settings = security_config()
    kwargs: dict = {}
    if "security.protocol" in settings:
        kwargs["security_protocol"] = settings["security.protocol"]
    if "sasl.mechanism" in settings:
        kwargs.update(sasl_mechanism=settings["sasl.mechanism"], sasl_plain_username=settings.get("sasl.username"),
                      sasl_plain_password=settings.get("sasl.password"))
    if kwargs.get("security_protocol", "").endswith("SSL"):
        import ssl

        from aiokafka.helpers import create_ssl_context

        try:
            kwargs["ssl_context"] = create_ssl_context(cafile=settings.get("ssl.ca.location"),
                                                       certfile=settings.get("ssl.certificate.location"),
                                                       keyfile=settings.get("ssl.key.location"),
                                                       password=settings.get("ssl.key.password"))
        except ssl.SSLError as exc:
            raise ValueError(f"the TLS settings do not load ({exc}): KVSTREAM_SSL_CA_LOCATION and "
                             "KVSTREAM_SSL_CERTIFICATE_LOCATION must be PEM certificates, KVSTREAM_SSL_KEY_PASSWORD "
                             "must decrypt KVSTREAM_SSL_KEY_LOCATION, and that key must match the certificate"
                             ) from None
    return kwargs


def unreachable(client, bootstrap_servers: str, exc: Exception, waited_s: float | None = None) -> RuntimeError:
    """The error to raise when a confluent-kafka ``client`` got no answer from ``bootstrap_servers``.

    librdkafka hands its log lines (e.g. ``SSL handshake failed: ... certificate verify failed``,
    ``SASL authentication error``) to :data:`LIBRDKAFKA_LOG` only when the client is polled; this polls
    ``client`` once, so the reason is logged before the error is raised.

    Args:
        client: the Producer, Consumer or AdminClient that failed (not subscribed: polling consumes nothing).
        exc: the KafkaException it raised.
        waited_s: how long it waited, said in the message when given.

    Returns:
        A RuntimeError naming the servers, with a hint: the security settings when some are set, else whether
        a broker runs there at all (a refused connection is not a TLS problem).
    """
    try:
        client.poll(0.2)
    except Exception:  # a closed client: the reason is lost, the error still stands
        pass
    if security_config().get("security.protocol", "PLAINTEXT") == "PLAINTEXT":
        hint = "is a broker listening there? ('kvstream broker start' runs one on 127.0.0.1:9092)"
    else:
        hint = ("if the reason logged above is a TLS or SASL error, check KVSTREAM_SECURITY_PROTOCOL and the "
                "KVSTREAM_SASL_*, KVSTREAM_SSL_* settings")
    error = exc.args[0] if exc.args else None
    reason = error.str() if hasattr(error, "str") else str(exc)  # a KafkaError's text, without its codes
    within = "" if waited_s is None else f" within {waited_s:g} s"
    return RuntimeError(f"Kafka at {bootstrap_servers} did not answer{within}: {reason} ({hint})")


def client_config(bootstrap_servers: str = DEFAULT_BOOTSTRAP_SERVERS, **overrides) -> dict:
    """Base librdkafka settings for any confluent-kafka client of the project, security included."""
    return {"bootstrap.servers": bootstrap_servers, "client.id": "kvstream", "logger": LIBRDKAFKA_LOG,
            "log.connection.close": False, **security_config(), **overrides}


def producer_config(bootstrap_servers: str = DEFAULT_BOOTSTRAP_SERVERS, **overrides) -> dict:
    """Settings of the event producers (docs/contract.md, "Partitioning": idempotent, ``acks=all``, lz4, murmur2).

    ``partitioner=murmur2_random`` is librdkafka's Java-compatible murmur2 for
    keyed messages, so a key lands on the partition that Faust (aiokafka) and
    Java clients compute for it.

    ``linger.ms=5`` is librdkafka's default and, since Kafka 4.0 (KIP-1030),
    the Java producer's: an event waits at most that long for its batch. A
    live engine's events reach the residency tables and the index that much
    sooner (bench/HISTORY.md, "2026-12-04 night"); at full speed batches fill
    by size and count first, so a longer linger gains little throughput.
    """
    return client_config(
        bootstrap_servers,
        **{
            "enable.idempotence": True,
            "acks": "all",
            "compression.type": "lz4",
            "partitioner": "murmur2_random",
            "linger.ms": 5,
            "batch.num.messages": 10000,
            "batch.size": 1_000_000,
            "queue.buffering.max.messages": 500_000,
            "queue.buffering.max.kbytes": 512 * 1024,
            **overrides,
        },
    )
