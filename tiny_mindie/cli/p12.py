"""``python -m tiny_mindie certs --p12 FILE``: the client certificate, its key and the CA as one
password-protected PKCS#12 file, which browsers import (Chrome/Chromium: Settings, Privacy and
security, Manage certificates, Your certificates, Import; Firefox: Settings, Privacy & Security,
View Certificates, Your Certificates, Import), so that the chat page of a server with mutual
TLS opens in them. Written by ``cryptography`` (AES-256 and PBKDF2, readable by NSS, OpenSSL 3
and browsers).
"""

from __future__ import annotations

import getpass
import os
import sys

from ..server.tls import TLSFiles

#: Shortest password accepted (a PKCS#12 file holds the client's private key).
MIN_PASSWORD = 4


def export(path: str, password: str, files: TLSFiles) -> None:
    """Write the client certificate and key of ``files``, with the CA certificates, to ``path``
    (mode 0600) as PKCS#12 encrypted with ``password``.

    Raises:
        OSError: a file cannot be read or written.
        ValueError: a file is not a PEM certificate or key, or the key is not the
            certificate's.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.serialization import pkcs12

    with open(files.client_cert, "rb") as fh:
        cert = x509.load_pem_x509_certificate(fh.read())
    with open(files.client_key, "rb") as fh:
        key = serialization.load_pem_private_key(fh.read(), password=None)
    if key.public_key().public_bytes(serialization.Encoding.DER,
                                     serialization.PublicFormat.SubjectPublicKeyInfo) != \
            cert.public_key().public_bytes(serialization.Encoding.DER,
                                           serialization.PublicFormat.SubjectPublicKeyInfo):
        raise ValueError(f"{files.client_key} is not the key of {files.client_cert}")
    cas = []
    for ca in files.ca:
        with open(ca, "rb") as fh:
            cas += x509.load_pem_x509_certificates(fh.read())
    name = cert.subject.rfc4514_string().encode()
    data = pkcs12.serialize_key_and_certificates(
        name, key, cert, cas, serialization.BestAvailableEncryption(password.encode()))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def run(path: str, password: str | None, files: TLSFiles, *, force: bool = False) -> int:
    """``certs --p12``: ask for the password when not given (twice), export, say what to do.

    Returns:
        0 written; 1 ``path`` exists (no ``--force``) or the files cannot be read; 2 a
        password too short, not confirmed, or not given (standard input ended).
    """
    if os.path.exists(path) and not force:
        return _error(f"{path} exists; use --force to replace", 1)
    if password is None:
        try:
            password = getpass.getpass("PKCS#12 password: ")
            again = getpass.getpass("the same again: ")
        except (EOFError, KeyboardInterrupt):
            return _error("no password given (--p12-password PW, or type it when asked)", 2)
        if again != password:
            return _error("the passwords differ", 2)
    if len(password) < MIN_PASSWORD:
        return _error(f"the password needs at least {MIN_PASSWORD} characters", 2)
    try:
        export(path, password, files)
    except (OSError, ValueError) as exc:
        return _error(str(exc), 1)
    print(f"wrote {path}: the client certificate {files.client_cert}, its key and the CA\n"
          "import it: Chrome/Chromium: Settings > Privacy and security > Security > Manage "
          "certificates > Your certificates > Import\n"
          "           Firefox: Settings > Privacy & Security > View Certificates > Your "
          "Certificates > Import")
    return 0


def _error(message: str, status: int) -> int:
    print(f"tiny_mindie: error: {message}", file=sys.stderr)
    return status
