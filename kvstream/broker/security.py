"""The broker's secured client listener (SASL SCRAM-SHA-512, TLS, or both) and the client settings that reach it.

:func:`secure_client_listener` rewrites the PLAINTEXT client listener of a generated server.properties;
:func:`probe_client` gives the librdkafka settings with which :func:`kvstream.broker.start` asks the broker whether
it answers.
"""

from __future__ import annotations

from pathlib import Path

from kvstream.broker.ports import free_port
from kvstream.tls import TlsMaterial


def probe_client(scram_user: tuple[str, str] | None, tls: TlsMaterial | None,
                 require_client_certificate: bool) -> dict:
    """librdkafka settings that reach the client listener :func:`kvstream.broker.start` configures (none for
    PLAINTEXT)."""
    client: dict = {}
    if scram_user is not None:
        client.update({"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-512",
                       "sasl.username": scram_user[0], "sasl.password": scram_user[1]})
    if tls is not None:
        client.update({"security.protocol": "SASL_SSL" if scram_user is not None else "SSL",
                       "ssl.ca.location": str(tls.ca_certificate)})
        if require_client_certificate:
            client.update({"ssl.certificate.location": str(tls.client_certificate),
                           "ssl.key.location": str(tls.client_key), "ssl.key.password": tls.client_key_password})
    return client


def _properties_value(text: str) -> str:
    """``text`` escaped as a java.util.Properties value on one line (PEM blocks keep their newlines)."""
    return text.strip().replace("\\", "\\\\").replace("\n", "\\n")


def secure_client_listener(props: Path, port: int, *, scram: bool, tls: TlsMaterial | None,
                           require_client_certificate: bool) -> None:
    """Make the client listener on ``port`` SASL_PLAINTEXT, SSL or SASL_SSL; brokers get a PLAINTEXT one of their own.

    SASL means SCRAM-SHA-512 (users come from the storage format, see
    :func:`kvstream.broker.config.format_storage`). TLS uses PEM material inline (``ssl.keystore.type=PEM``: no
    keytool, no keystore password; the file is made readable by its owner only) and trusts ``tls.ca_certificate``
    for client certificates.
    """
    protocol = ("SASL_" if scram else "") + ("SSL" if tls is not None else "PLAINTEXT")
    internal_port = free_port()
    lines = []
    for line in props.read_text().splitlines():
        if line.startswith("listeners="):
            line = line.replace(f"PLAINTEXT://127.0.0.1:{port}",
                                f"{protocol}://127.0.0.1:{port},INTERNAL://127.0.0.1:{internal_port}")
        elif line.startswith("advertised.listeners="):
            line = f"advertised.listeners={protocol}://127.0.0.1:{port},INTERNAL://127.0.0.1:{internal_port}"
        elif line.startswith("inter.broker.listener.name="):
            line = "inter.broker.listener.name=INTERNAL"
        elif line.startswith("listener.security.protocol.map="):
            line = f"listener.security.protocol.map=CONTROLLER:PLAINTEXT,INTERNAL:PLAINTEXT,{protocol}:{protocol}"
        lines.append(line)
    if scram:
        lines.append("sasl.enabled.mechanisms=SCRAM-SHA-512")
        # the server side of SCRAM needs a login module but no credentials of its own (brokers use INTERNAL)
        lines.append(f"listener.name.{protocol.lower()}.scram-sha-512.sasl.jaas.config="
                     "org.apache.kafka.common.security.scram.ScramLoginModule required;")
    if tls is not None:
        chain = tls.broker_certificate.read_text().strip() + "\n" + tls.ca_certificate.read_text().strip()
        lines += [
            "ssl.keystore.type=PEM",
            f"ssl.keystore.certificate.chain={_properties_value(chain)}",
            f"ssl.keystore.key={_properties_value(tls.broker_key.read_text())}",
            "ssl.truststore.type=PEM",
            f"ssl.truststore.location={tls.ca_certificate}",
            f"ssl.client.auth={'required' if require_client_certificate else 'none'}",
        ]
    props.chmod(0o600)
    props.write_text("\n".join(lines) + "\n")
