"""Throw-away TLS material for tests: a CA and a server certificate it signed, for 127.0.0.1
and localhost (PEM files), made with the `cryptography` package; skips the test without it."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class TlsFiles:
    ca_file: Path    # the CA a client trusts
    cert_file: Path  # the server's certificate (signed by the CA)
    key_file: Path   # the server's private key


def write_tls_files(folder: Path) -> TlsFiles:
    """A fresh CA and a server certificate for 127.0.0.1 / localhost, valid for a day."""
    x509 = pytest.importorskip("cryptography.x509", reason="TLS tests need `cryptography`")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def build(subject: str, issuer: str, public_key: object, signer: object, *, is_ca: bool,
              sans: list[x509.GeneralName]) -> x509.Certificate:
        b = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
             .public_key(public_key).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = build("bulkhead test CA", "bulkhead test CA", ca_key.public_key(), ca_key, is_ca=True,
               sans=[])
    key = ec.generate_private_key(ec.SECP256R1())
    cert = build("127.0.0.1", "bulkhead test CA", key.public_key(), ca_key, is_ca=False,
                 sans=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                       x509.DNSName("localhost")])
    folder.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(folder / "ca.pem", folder / "server.pem", folder / "server.key")
    files.ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key_file.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return files
