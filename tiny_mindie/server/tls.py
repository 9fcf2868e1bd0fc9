"""Mutual TLS with the stdlib ``ssl`` module, and first-run certificates made with ``cryptography``.

MindIE's defaults (spec §5): TLS 1.3 only, a client certificate is required and checked against
the CA file(s) and, when present, the CRL files. A failed handshake gets no HTTP answer.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from dataclasses import dataclass

from ..config import Config, ConfigError, ServerConfig

@dataclass(frozen=True)
class TLSFiles:
    """Absolute paths of the PEM files a server and its first client use."""

    ca: tuple[str, ...]
    cert: str
    key: str
    crls: tuple[str, ...]
    client_cert: str
    client_key: str


def tls_files(cfg: Config) -> TLSFiles:
    """The TLS paths of ``cfg`` resolved against its home; the client pair sits beside the server's."""
    s = cfg.server
    cert, key = cfg.path(s.tls_cert), cfg.path(s.tls_pk)
    return TLSFiles(
        ca=tuple(os.path.join(cfg.path(s.tls_ca_path), f) for f in s.tls_ca_files),
        cert=cert, key=key,
        crls=tuple(os.path.join(cfg.path(s.tls_crl_path), f) for f in s.tls_crl_files),
        client_cert=os.path.join(os.path.dirname(cert), "client.pem"),
        client_key=os.path.join(os.path.dirname(key), "client.key.pem"),
    )


def uses_default_paths(cfg: Config) -> bool:
    """The TLS file keys of ``cfg`` are MindIE's defaults (``security/...`` in the config home)."""
    s, d = cfg.server, ServerConfig()
    return (s.tls_ca_path, s.tls_ca_files, s.tls_cert, s.tls_pk) == \
        (d.tls_ca_path, d.tls_ca_files, d.tls_cert, d.tls_pk)


def ensure_certificates(files: TLSFiles, hosts: tuple[str, ...] = (), *,
                        may_create: bool = True) -> bool:
    """Create a CA, a server and a client certificate when none of the server's files exist.

    Args:
        files: where to put them.
        hosts: extra DNS names / IP addresses for the server certificate (localhost, 127.0.0.1,
            127.0.0.2 and ::1 are always in it).
        may_create: False when the user named the files: then missing files are an error
            (a typo must not silently start the server on a new CA).

    Returns:
        True when files were created, False when they all existed already.

    Raises:
        ConfigError: some but not all of the CA, certificate and key files exist, or none
            exist and ``may_create`` is False.
    """
    needed = (*files.ca, files.cert, files.key)
    present = [p for p in needed if os.path.exists(p)]
    if len(present) == len(needed):
        return False
    if not may_create:
        missing = [p for p in needed if not os.path.exists(p)]
        raise ConfigError(f"TLS file not found: {missing[0]} (certificates are created only at the "
                          f"default security/ paths; make them with scripts/make_certs.py, fix the "
                          f"path, or use --no-tls)")
    if present:
        missing = [p for p in needed if not os.path.exists(p)]
        raise ConfigError(f"TLS files incomplete: {', '.join(missing)} missing "
                          f"(remove the others to have new ones created, or use --no-tls)")
    make_certificates(files, hosts)
    return True


def make_certificates(files: TLSFiles, hosts: tuple[str, ...] = ()) -> None:
    """Write a fresh CA (``files.ca[0]``), server and client certificate with ECDSA P-256 keys.

    Keys are written with mode 0600, valid for 365 days (the CA for 10 years).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    start = now - datetime.timedelta(minutes=5)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tiny_mindie"),
                          x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(path: str, key) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)

    def write_cert(path: str, cert) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(cert.public_bytes(serialization.Encoding.PEM))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (x509.CertificateBuilder()
               .subject_name(name("tiny_mindie CA")).issuer_name(name("tiny_mindie CA"))
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(now + datetime.timedelta(days=3650))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .add_extension(ca_ski, critical=False)
               .sign(ca_key, hashes.SHA256()))

    def leaf(cn: str, usage, san: list | None):
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder()
             .subject_name(name(cn)).issuer_name(ca_cert.subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(start).not_valid_after(now + datetime.timedelta(days=365))
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                            critical=False))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return key, b.sign(ca_key, hashes.SHA256())

    san: list = [x509.DNSName("localhost")]
    for h in ("127.0.0.1", "127.0.0.2", "::1", *hosts):
        try:
            ip = x509.IPAddress(ipaddress.ip_address(h))
            if ip not in san:
                san.append(ip)
        except ValueError:
            if x509.DNSName(h) not in san:
                san.append(x509.DNSName(h))
    server_key, server_cert = leaf("localhost", ExtendedKeyUsageOID.SERVER_AUTH, san)
    client_key, client_cert = leaf("tiny_mindie client", ExtendedKeyUsageOID.CLIENT_AUTH, None)
    write_cert(files.ca[0], ca_cert)
    write_key(files.key, server_key)
    write_cert(files.cert, server_cert)
    write_key(files.client_key, client_key)
    write_cert(files.client_cert, client_cert)


def server_context(files: TLSFiles) -> ssl.SSLContext:
    """The server's ``SSLContext``: TLS 1.3 minimum, client certificate required (mutual TLS),
    CRLs checked for the client's certificate when CRL files exist. OpenSSL's TLS 1.3 suites
    are MindIE's three (AES-128-GCM, AES-256-GCM, ChaCha20-Poly1305).

    Raises:
        ConfigError: a file is missing or unreadable, or the key does not match the certificate.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_cert_chain(files.cert, files.key)
    except FileNotFoundError as exc:
        raise ConfigError(f"TLS file not found: {exc.filename}") from None
    except ssl.SSLError as exc:
        raise ConfigError(f"cannot load TLS certificate {files.cert} / key {files.key}: {exc.reason}") from None
    for ca in files.ca:
        try:
            ctx.load_verify_locations(cafile=ca)
        except FileNotFoundError:
            raise ConfigError(f"TLS CA file not found: {ca}") from None
        except ssl.SSLError as exc:
            raise ConfigError(f"cannot load TLS CA file {ca}: {exc.reason}") from None
    crls = [c for c in files.crls if os.path.isfile(c)]
    for crl in crls:
        try:
            ctx.load_verify_locations(cafile=crl)
        except ssl.SSLError as exc:
            raise ConfigError(f"cannot load CRL file {crl}: {exc.reason}") from None
    if crls:
        ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    return ctx


def client_context(files: TLSFiles) -> ssl.SSLContext:
    """A client ``SSLContext`` that trusts the CA and presents the client certificate."""
    ctx = ssl.create_default_context(cafile=files.ca[0])
    ctx.load_cert_chain(files.client_cert, files.client_key)
    return ctx
