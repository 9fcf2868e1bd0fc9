"""Mutual TLS with the stdlib ``ssl`` module, and first-run certificates made with ``cryptography``.

MindIE's defaults (spec §5): TLS 1.3 only, a client certificate is required and checked against
the CA file(s) and the CRL files. A failed handshake gets no HTTP answer.

Every TLS file the configuration names must exist and hold what its key says, or the server does
not start (:class:`TLSConfigError`, one line naming the file). A CRL is checked at
start-up against the CAs with ``cryptography``: another issuer or a bad signature is an error; an
expired CRL is a loud warning, since OpenSSL then refuses every client certificate of that CA.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import re
import ssl
from dataclasses import dataclass, replace

from .tls_refusal import ChainFacts, name_refused_clients, ssl_reason

log = logging.getLogger("tiny_mindie.tls")

CA_KEY_NAME = "ca.key.pem"      # written beside the first CA file


class TLSConfigError(Exception):
    """A TLS file is missing, unreadable or wrong; the message is one line naming the file."""


@dataclass(frozen=True)
class TLSFiles:
    """Absolute paths of the PEM files a server and its first client use."""

    ca: tuple[str, ...]
    cert: str
    key: str
    crls: tuple[str, ...]
    client_cert: str
    client_key: str

    @property
    def ca_key(self) -> str:
        """The CA's private key, beside the first CA file (``ca.key.pem``, mode 0600): what
        issues client certificates and CRLs for that CA later."""
        return os.path.join(os.path.dirname(self.ca[0]), CA_KEY_NAME)


def ensure_certificates(files: TLSFiles, hosts: tuple[str, ...] = (), *,
                        may_create: bool = True, with_crls: bool = True) -> bool:
    """Create a CA (and its key), a server and a client certificate, and an empty CRL, when none
    of the server's files exist.

    Args:
        files: where to put them.
        hosts: extra DNS names / IP addresses for the server certificate (localhost, 127.0.0.1,
            127.0.0.2 and ::1 are always in it).
        may_create: False when the user named the files: then missing files are an error
            (a typo must not silently start the server on a new CA).
        with_crls: write ``files.crls`` too (False when the user named CRL files of their own:
            those must exist, see :func:`server_context`).

    Returns:
        True when files were created, False when they all existed already.

    Raises:
        TLSConfigError: some but not all of the CA, certificate and key files exist, or none
            exist and ``may_create`` is False.
    """
    needed = (*files.ca, files.cert, files.key)
    present = [p for p in needed if os.path.exists(p)]
    if len(present) == len(needed):
        return False
    if not may_create:
        missing = [p for p in needed if not os.path.exists(p)]
        raise TLSConfigError(f"TLS file not found: {missing[0]} (certificates are created only "
                             "at the default security/ paths; make them with "
                             "python -m tiny_mindie certs, fix the path, or use --no-tls)")
    if present:
        missing = [p for p in needed if not os.path.exists(p)]
        raise TLSConfigError(f"TLS files incomplete: {', '.join(missing)} missing "
                          f"(remove the others to have new ones created, or use --no-tls)")
    make_certificates(files if with_crls else replace(files, crls=()), hosts)
    return True


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def make_certificates(files: TLSFiles, hosts: tuple[str, ...] = ()) -> None:
    """Write a fresh CA (``files.ca[0]``) and its key (:attr:`TLSFiles.ca_key`), a server and a
    client certificate, all with ECDSA P-256 keys, and an empty CRL signed by the CA at each of
    ``files.crls``.

    Keys are written with mode 0600. Certificates are valid for 365 days, the CA for 10 years;
    the CRL's nextUpdate is the CA's expiry (see :func:`issue_crl`).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    now = _utcnow()
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (x509.CertificateBuilder()
               .subject_name(_name("tiny_mindie CA")).issuer_name(_name("tiny_mindie CA"))
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=3650))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                            crl_sign=True, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, encipher_only=False,
                                            decipher_only=False),
                              critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                              critical=False)
               .sign(ca_key, hashes.SHA256()))
    server_key, server_cert = _leaf(ca_cert, ca_key, "localhost", ("localhost", "127.0.0.1",
                                                                   "127.0.0.2", "::1", *hosts))
    client_key, client_cert = _leaf(ca_cert, ca_key, "tiny_mindie client", None)
    _write_pem(files.ca[0], _pem(ca_cert))
    _write_pem(files.ca_key, _pem(ca_key), private=True)
    _write_pem(files.key, _pem(server_key), private=True)
    _write_pem(files.cert, _pem(server_cert))
    _write_pem(files.client_key, _pem(client_key), private=True)
    _write_pem(files.client_cert, _pem(client_cert))
    for crl in files.crls:
        issue_crl(crl, files.ca[0], files.ca_key)


def issue_certificate(ca_cert: str, ca_key: str, cert: str, key: str, common_name: str, *,
                      hosts: tuple[str, ...] | None = None, days: int = 365) -> int:
    """Issue a client certificate (or a server one, for ``hosts``) signed by the CA, with a new
    ECDSA P-256 key; writes ``cert`` and ``key`` (mode 0600).

    Args:
        ca_cert, ca_key: the CA's certificate and private key (PEM files).
        cert, key: where to write the new certificate and key.
        common_name: the subject's CN (``O=tiny_mindie`` beside it).
        hosts: DNS names / IP addresses of a server certificate; None for a client one.
        days: validity from now.

    Returns:
        The certificate's serial number (what a CRL revokes).

    Raises:
        TLSConfigError: the CA files cannot be read.
    """
    ca = _read_certificates(ca_cert, "CA certificate")[0]
    new_key, new_cert = _leaf(ca, _read_private_key(ca_key, "CA key"), common_name, hosts, days)
    _write_pem(key, _pem(new_key), private=True)
    _write_pem(cert, _pem(new_cert))
    return new_cert.serial_number


def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tiny_mindie"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _leaf(ca_cert, ca_key, cn: str, hosts: tuple[str, ...] | None, days: int = 365):
    """A new key and a certificate for it signed by the CA: a server certificate for ``hosts``
    (DNS names or IP addresses), a client certificate when ``hosts`` is None."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    now = _utcnow()
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if hosts is None else ExtendedKeyUsageOID.SERVER_AUTH
    b = (x509.CertificateBuilder()
         .subject_name(_name(cn)).issuer_name(ca_cert.subject)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=days))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
         .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),
                        critical=False))
    if hosts is not None:
        san: list = []
        for h in hosts:
            try:
                name = x509.IPAddress(ipaddress.ip_address(h))
            except ValueError:
                name = x509.DNSName(h)
            if name not in san:
                san.append(name)
        b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return key, b.sign(ca_key, hashes.SHA256())


def _pem(obj) -> bytes:
    """PEM bytes of a certificate, CRL or (unencrypted, PKCS#8) private key."""
    from cryptography.hazmat.primitives import serialization
    if hasattr(obj, "private_bytes"):
        return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
    return obj.public_bytes(serialization.Encoding.PEM)


def _write_pem(path: str, data: bytes, private: bool = False) -> None:
    """Write ``data`` to ``path`` (folders made as needed); mode 0600 when ``private``."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def issue_crl(path: str, ca_cert: str, ca_key: str, revoke: tuple[str, ...] = (), *,
              keep_revoked: bool = True, last_update: datetime.datetime | None = None,
              next_update: datetime.datetime | None = None) -> int:
    """Write a CRL signed by the CA at ``path``, revoking the certificates ``revoke`` names.

    Args:
        path: the CRL file (PEM) to write; replaced atomically.
        ca_cert, ca_key: the issuing CA's certificate and private key (PEM files).
        revoke: PEM files of certificates to revoke (issued by that CA).
        keep_revoked: keep the entries of the CRL already at ``path`` (when it is that CA's).
        last_update: the CRL's thisUpdate (default: now).
        next_update: its nextUpdate (default: the CA's expiry). OpenSSL refuses every client
            certificate of the CA once this date has passed, so a CRL meant to last is given
            the CA's whole life; issue a new one to revoke more.

    Returns:
        The number of revoked serials in the written CRL.

    Raises:
        TLSConfigError: a file cannot be read, or a certificate to revoke is not that CA's.
    """
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes

    ca = _read_certificates(ca_cert, "CA certificate")[0]
    key = _read_private_key(ca_key, "CA key")
    now = _utcnow()
    revoked: dict[int, datetime.datetime] = {}
    if keep_revoked and os.path.exists(path):
        for old in _read_crls(path):
            if old.issuer == ca.subject and _signed_by(old, ca):
                revoked.update((r.serial_number, r.revocation_date_utc) for r in old)
    for cert_path in revoke:
        for cert in _read_certificates(cert_path, "certificate to revoke"):
            try:
                cert.verify_directly_issued_by(ca)
            except (ValueError, TypeError, InvalidSignature):
                raise TLSConfigError(f"{cert_path} was not issued by the CA {ca_cert} "
                                  f"({ca.subject.rfc4514_string()})") from None
            revoked.setdefault(cert.serial_number, now)
    b = (x509.CertificateRevocationListBuilder().issuer_name(ca.subject)
         .last_update(last_update or now)
         .next_update(next_update or ca.not_valid_after_utc))
    for serial, when in sorted(revoked.items()):
        b = b.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build())
    crl = b.sign(key, hashes.SHA256())
    tmp = f"{path}.tmp{os.getpid()}"
    _write_pem(tmp, _pem(crl))
    os.replace(tmp, path)
    return len(revoked)


# ---- reading and checking the files a server names --------------------------------------------

def _read(path: str, what: str) -> bytes:
    """The bytes of ``path``; a one-line TLSConfigError naming the file and the cause otherwise."""
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        raise TLSConfigError(f"TLS file not found: {path} ({what})") from None
    except OSError as exc:
        raise TLSConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def _read_certificates(path: str, what: str) -> list:
    """The certificates of a PEM file (at least one)."""
    from cryptography import x509
    try:
        certs = x509.load_pem_x509_certificates(_read(path, what))
    except ValueError:
        certs = []
    if not certs:
        raise TLSConfigError(f"{what} {path} is not a PEM certificate "
                          f"(no valid -----BEGIN CERTIFICATE----- block)")
    return certs


def _read_private_key(path: str, what: str):
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    data = _read(path, what)
    try:
        return serialization.load_pem_private_key(data, password=None)
    except TypeError:   # cryptography: "Password was not given but private key is encrypted"
        raise TLSConfigError(f"{what} {path} is encrypted; tiny_mindie needs an unencrypted key "
                          f"(keep it readable by the server's user only)") from None
    except (ValueError, UnsupportedAlgorithm):
        raise TLSConfigError(f"{what} {path} is not a PEM private key") from None


_CRL_BLOCK = re.compile(rb"-----BEGIN X509 CRL-----.+?-----END X509 CRL-----", re.S)


def _read_crls(path: str) -> list:
    """The CRLs of a PEM file (a file may hold several, one per CA, as OpenSSL reads it)."""
    from cryptography import x509
    crls = []
    for block in _CRL_BLOCK.findall(_read(path, "TLS CRL file")):
        try:
            crls.append(x509.load_pem_x509_crl(block))
        except ValueError:
            raise TLSConfigError(f"TLS CRL file {path} holds a damaged CRL") from None
    if not crls:
        raise TLSConfigError(f"TLS CRL file {path} is not a PEM CRL "
                             "(no -----BEGIN X509 CRL----- block)")
    return crls


def check_crls(path: str, cas: list, now: datetime.datetime | None = None) -> list[str]:
    """Check the CRLs of ``path`` against the CA certificates ``cas``.

    Returns:
        Warnings, one line each: a CRL past its nextUpdate or before its thisUpdate (OpenSSL
        then refuses every client certificate of that CA).

    Raises:
        TLSConfigError: the file is missing, unreadable or not PEM; a CRL's issuer is none of the
            CAs, or no CA of that name signed it.
    """
    now = now or _utcnow()
    warnings = []
    for crl in _read_crls(path):
        issuer = crl.issuer.rfc4514_string()
        named = [ca for ca in cas if ca.subject == crl.issuer]
        if not named:
            raise TLSConfigError(f"TLS CRL file {path} is issued by {issuer}, which is not a CA of "
                              f"tlsCaFile")
        if not any(_signed_by(crl, ca) for ca in named):
            raise TLSConfigError(f"TLS CRL file {path} is not signed by the CA {issuer} "
                              f"(its signature does not verify with the CA's key)")
        if crl.next_update_utc is not None and crl.next_update_utc < now:
            warnings.append(f"TLS CRL file {path} expired on {crl.next_update_utc:%Y-%m-%d %H:%M} "
                            f"UTC: EVERY client certificate of {issuer} will be refused "
                            f"(certificate verify failed: CRL has expired) until a new CRL is "
                            f"installed")
        elif crl.last_update_utc > now:
            warnings.append(f"TLS CRL file {path} is not valid before "
                            f"{crl.last_update_utc:%Y-%m-%d %H:%M} UTC: EVERY client certificate "
                            f"of {issuer} will be refused until then (check the clock)")
    return warnings


def _signed_by(crl, ca) -> bool:
    try:
        return crl.is_signature_valid(ca.public_key())
    except (TypeError, ValueError):    # a key type that cannot sign CRLs
        return False


def server_context(files: TLSFiles) -> ssl.SSLContext:
    """The server's ``SSLContext``: TLS 1.3 minimum, client certificate required (mutual TLS),
    each certificate of the client's chain checked against the CRL files (when any are named).
    OpenSSL's TLS 1.3 suites are MindIE's three (AES-128-GCM, AES-256-GCM, ChaCha20-Poly1305).

    Every named file must exist and hold what its key says; a CRL must be issued and signed by
    one of the CAs. An expired CRL is logged as a warning (every client of its CA is refused).

    Raises:
        TLSConfigError: one line naming the file and what is wrong with it: missing, unreadable,
            a folder, not PEM, the key does not match the certificate, a CRL of another CA.
    """
    _read_certificates(files.cert, "TLS certificate")
    _read_private_key(files.key, "TLS private key")
    cas = [c for ca in files.ca for c in _read_certificates(ca, "TLS CA file")]
    crls = []
    for crl in files.crls:
        if not os.path.exists(crl):
            make = ("make one with python -m tiny_mindie certs --crl"
                    if os.path.exists(files.ca_key)
                    else f"no CA key at {files.ca_key} to make one: this folder predates kept CA "
                         f"keys; remove it to have a new CA, certificates and CRL made")
            raise TLSConfigError(f"TLS CRL file not found: {crl} (fix tlsCrlPath / tlsCrlFiles, "
                              f"{make}, or set \"tlsCrlFiles\": [] to check no CRL)")
        for warning in check_crls(crl, cas):
            log.warning("%s", warning)
        crls += _read_crls(crl)

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_cert_chain(files.cert, files.key)
    except (ssl.SSLError, OSError) as exc:
        raise TLSConfigError(f"cannot load TLS certificate {files.cert} with key {files.key}: "
                          f"{ssl_reason(exc)}") from None
    for path in (*files.ca, *files.crls):
        try:
            ctx.load_verify_locations(cafile=path)
        except (ssl.SSLError, OSError) as exc:
            raise TLSConfigError(f"cannot load TLS file {path}: {ssl_reason(exc)}") from None
    if files.crls:     # each CA of the chain: a CRL revoking an intermediate CA counts too
        ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_CHAIN
    name_refused_clients(ctx, ChainFacts.of(cas, crls))
    return ctx


def client_context(files: TLSFiles) -> ssl.SSLContext:
    """A client ``SSLContext`` that trusts the CA and presents the client certificate."""
    ctx = ssl.create_default_context(cafile=files.ca[0])
    ctx.load_cert_chain(files.client_cert, files.client_key)
    return ctx
