"""TLS material for QUIC: the configured cert+key, or a self-signed pair kept under the state dir.

The self-signed certificate is made once (ECDSA P-256, 10 years, names: localhost, this host's
name, 127.0.0.1, ::1 and any extra names given) and reused on every later start, so clients can
pin it with `edged chat --ca-file <state_dir>/tls/cert.pem`.
"""
from __future__ import annotations

import datetime as dt
import ipaddress
import logging
import os
import socket
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from edged.log import fields

log = logging.getLogger("edged.server")

CERT_NAME = "cert.pem"
KEY_NAME = "key.pem"
VALID_DAYS = 3650


class TLSConfigError(ValueError):
    """Configured certificate/key missing or unreadable; the message names the file."""


def tls_dir(state_dir: str | os.PathLike[str]) -> Path:
    return Path(state_dir) / "tls"


def default_ca_file(state_dir: str | os.PathLike[str]) -> str | None:
    """The daemon's self-signed certificate, if it exists: what `edged chat` trusts by default."""
    path = tls_dir(state_dir) / CERT_NAME
    return str(path) if path.is_file() else None


def ensure_cert(
    state_dir: str | os.PathLike[str],
    certfile: str | None = None,
    keyfile: str | None = None,
    extra_names: list[str] | None = None,
) -> tuple[str, str]:
    """Return (certfile, keyfile) to serve with.

    Both configured: checked to exist and load, then used as they are. One without the other: an error.
    Neither: `<state_dir>/tls/{cert,key}.pem`, created on first start and reused while valid.
    """
    if certfile or keyfile:
        if not (certfile and keyfile):
            raise TLSConfigError("tls: set both server.certfile and server.keyfile, or neither (a self-signed "
                                 "pair is then created under the state directory)")
        for what, path in (("server.certfile", certfile), ("server.keyfile", keyfile)):
            if not os.path.isfile(path):
                raise TLSConfigError(f"tls: {what} {path} does not exist")
        _check_loads(certfile, keyfile)
        return certfile, keyfile

    d = tls_dir(state_dir)
    cert_path, key_path = d / CERT_NAME, d / KEY_NAME
    if cert_path.is_file() and key_path.is_file():
        try:
            cert = _check_loads(str(cert_path), str(key_path))
            if cert.not_valid_after_utc > dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1):
                return str(cert_path), str(key_path)
            log.warning("tls self-signed certificate expired, replacing %s", fields(path=cert_path))
        except TLSConfigError as e:
            log.warning("tls self-signed pair unreadable, replacing %s", fields(path=cert_path, error=str(e)))

    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _self_signed(key, extra_names or [])
    _write_atomic(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()), 0o600)
    _write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    log.info("tls created self-signed certificate %s", fields(
        path=cert_path, sha256=cert.fingerprint(hashes.SHA256()).hex()[:16]))
    return str(cert_path), str(key_path)


def _check_loads(certfile: str, keyfile: str) -> x509.Certificate:
    try:
        with open(certfile, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
    except (OSError, ValueError) as e:
        raise TLSConfigError(f"tls: cannot read certificate {certfile}: {e}") from None
    try:
        with open(keyfile, "rb") as f:
            key = serialization.load_pem_private_key(f.read(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise TLSConfigError(f"tls: cannot read private key {keyfile} (must be PEM, unencrypted): {e}") from None
    if key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) != \
            cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo):
        raise TLSConfigError(f"tls: private key {keyfile} does not match certificate {certfile}")
    return cert


def _self_signed(key: ec.EllipticCurvePrivateKey, extra_names: list[str]) -> x509.Certificate:
    host = socket.gethostname() or "localhost"
    dns = ["localhost"]
    ips: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = [ipaddress.ip_address("127.0.0.1"),
                                                                ipaddress.ip_address("::1")]
    for name in [host, *extra_names]:
        try:
            ip = ipaddress.ip_address(name)
        except ValueError:
            if name and name not in dns:
                dns.append(name)
        else:
            if ip not in ips:
                ips.append(ip)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"edged on {host}"[:64]),
                         x509.NameAttribute(NameOID.ORGANIZATION_NAME, "edged self-signed")])
    now = dt.datetime.now(dt.timezone.utc)
    san = [x509.DNSName(n) for n in dns] + [x509.IPAddress(ip) for ip in ips]
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, content_commitment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
