"""Throwaway TLS material (a CA, a broker certificate, a client certificate) for the embedded broker.

For development and tests only: the CA's key is kept next to the certificates
it signed, and nothing is ever revoked. Production brokers get their
certificates from the operator's own CA; the clients then only need the
``KVSTREAM_SSL_*`` settings (docs/security.md).

Layout of a TLS directory written by :func:`generate_tls_material` (all PEM)::

    ca.pem                  CA certificate: clients trust the broker with it (KVSTREAM_SSL_CA_LOCATION),
                            the broker trusts client certificates with it
    ca-key.pem              CA private key (unencrypted; only needed to sign more certificates)
    broker.pem              broker certificate, SAN DNS:localhost and IP:127.0.0.1, signed by the CA
    broker-key.pem          broker private key, unencrypted PKCS#8 (Kafka reads it inline, without a password)
    client.pem              client certificate (CN kvstream-client), for mutual TLS
                            (KVSTREAM_SSL_CERTIFICATE_LOCATION)
    client-key.pem          client private key, PKCS#8 encrypted with the password below (KVSTREAM_SSL_KEY_LOCATION)
    client-key.password     that password, one line (KVSTREAM_SSL_KEY_PASSWORD)

Private keys and the password file are written with mode 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TlsMaterial", "generate_tls_material", "load_tls_material"]

#: File names of a TLS directory (see the module docstring).
_FILES = {
    "ca_certificate": "ca.pem",
    "ca_key": "ca-key.pem",
    "broker_certificate": "broker.pem",
    "broker_key": "broker-key.pem",
    "client_certificate": "client.pem",
    "client_key": "client-key.pem",
    "client_key_password_file": "client-key.password",
}


@dataclass(frozen=True)
class TlsMaterial:
    """Paths of the PEM files of one TLS directory (absolute).

    Every path exists once :func:`generate_tls_material` or :func:`load_tls_material` has returned.
    """

    # CA certificate (PEM): what clients trust the broker with, and the broker trusts client certificates with.
    ca_certificate: Path
    # CA private key (PEM, unencrypted).
    ca_key: Path
    # Broker certificate (PEM), SAN DNS:localhost, IP:127.0.0.1 (plus any extra hosts asked for).
    broker_certificate: Path
    # Broker private key (PEM, unencrypted PKCS#8).
    broker_key: Path
    # Client certificate (PEM) for mutual TLS, subject CN=kvstream-client.
    client_certificate: Path
    # Client private key (PEM, PKCS#8 encrypted with the password in client_key_password_file).
    client_key: Path
    # One line: the password of client_key.
    client_key_password_file: Path

    @property
    def client_key_password(self) -> str:
        """The client key's password (read from :attr:`client_key_password_file` at each call)."""
        return self.client_key_password_file.read_text().strip()

    def client_environment(self, *, client_certificate: bool = True) -> dict[str, str]:
        """The ``KVSTREAM_SSL_*`` variables a client of a broker using this material needs.

        Args:
            client_certificate: include the client certificate, key and key password
                (needed when the broker requires client certificates).

        Returns:
            Variable name -> value; ``KVSTREAM_SECURITY_PROTOCOL`` and the SASL variables are not included.
            The key password is included as a value: put it in an environment, never in a log.
        """
        env = {"KVSTREAM_SSL_CA_LOCATION": str(self.ca_certificate)}
        if client_certificate:
            env.update(KVSTREAM_SSL_CERTIFICATE_LOCATION=str(self.client_certificate),
                       KVSTREAM_SSL_KEY_LOCATION=str(self.client_key),
                       KVSTREAM_SSL_KEY_PASSWORD=self.client_key_password)
        return env


def _paths(directory: Path) -> TlsMaterial:
    d = Path(directory).expanduser().resolve()
    return TlsMaterial(**{field: d / name for field, name in _FILES.items()})


def load_tls_material(directory: Path) -> TlsMaterial:
    """The material of a TLS directory written earlier by :func:`generate_tls_material`.

    Raises:
        FileNotFoundError: a file of the layout is missing (the message names it).
    """
    material = _paths(directory)
    for field in _FILES:
        path = getattr(material, field)
        if not path.is_file():
            raise FileNotFoundError(f"TLS directory {material.ca_certificate.parent} has no {path.name} "
                                    f"(generate it with kvstream.tls.generate_tls_material or "
                                    f"'kvstream broker start --tls-dir DIR' on an empty DIR)")
    return material


def generate_tls_material(directory: Path, *, hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
                          valid_days: int = 30) -> TlsMaterial:
    """Write a fresh CA, broker certificate and client certificate into ``directory`` (see the module docstring).

    Args:
        directory: created if missing; existing files of the layout are overwritten.
        hosts: names and IP addresses the broker certificate is valid for (its SAN; clients verify the
            host they connect to against it). IP addresses become IP SAN entries, the rest DNS entries.
        valid_days: validity of every certificate, from one hour ago (clock skew) on.

    Returns:
        The paths of the written files.

    Keys are ECDSA P-256 (fast to generate; Kafka, librdkafka and Python's ssl all accept them).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    material = _paths(directory)
    material.ca_certificate.parent.mkdir(parents=True, exist_ok=True)
    not_before = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(hours=1)
    validity = (not_before, not_before + datetime.timedelta(days=valid_days, hours=1))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _subject("kvstream throwaway CA")
    ca_cert = _certificate(ca_name, ca_key, ca_name, ca_key, validity, ca=True).sign(ca_key, hashes.SHA256())
    broker_key = ec.generate_private_key(ec.SECP256R1())
    broker_cert = (_certificate(_subject(hosts[0]), broker_key, ca_cert.subject, ca_key, validity, ca=False)
                   .add_extension(x509.SubjectAlternativeName(_alternative_names(hosts)), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                         ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                   .sign(ca_key, hashes.SHA256()))
    client_key = ec.generate_private_key(ec.SECP256R1())
    client_cert = (_certificate(_subject("kvstream-client"), client_key, ca_cert.subject, ca_key, validity, ca=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                   .sign(ca_key, hashes.SHA256()))
    password = secrets.token_urlsafe(24)

    pkcs8 = serialization.PrivateFormat.PKCS8
    pem = serialization.Encoding.PEM
    _write_private(material.ca_key, ca_key.private_bytes(pem, pkcs8, serialization.NoEncryption()))
    _write_private(material.broker_key, broker_key.private_bytes(pem, pkcs8, serialization.NoEncryption()))
    _write_private(material.client_key, client_key.private_bytes(
        pem, pkcs8, serialization.BestAvailableEncryption(password.encode())))
    _write_private(material.client_key_password_file, (password + "\n").encode())
    material.ca_certificate.write_bytes(ca_cert.public_bytes(pem))
    material.broker_certificate.write_bytes(broker_cert.public_bytes(pem))
    material.client_certificate.write_bytes(client_cert.public_bytes(pem))
    return material


def _subject(common_name: str):
    """The X.509 name of a throwaway certificate: the kvstream organization and ``common_name``."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvstream (throwaway)"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject, key, issuer, issuer_key, validity: tuple, *, ca: bool):
    """A certificate builder of ``subject`` (public key of ``key``) signed by ``issuer``: basic constraints, key
    usage (signing; certificate and CRL signing for a CA) and key identifiers; ``validity`` is (from, to)."""
    from cryptography import x509

    not_before, not_after = validity
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(not_before).not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=ca, crl_sign=ca,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
                           critical=False))


def _alternative_names(hosts: tuple[str, ...]) -> list:
    """The broker certificate's SAN entries: an IP entry for an address, a DNS entry for a name."""
    from cryptography import x509

    names: list = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _write_private(path: Path, data: bytes) -> None:
    """Write a key or password readable by its owner only (created 0600, never first world-readable)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
