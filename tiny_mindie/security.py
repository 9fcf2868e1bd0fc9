"""The TLS settings of a configuration: :class:`~tiny_mindie.config.Config` -> :class:`TLSFiles`,
and the start-up checks that need the configuration: what a first run may create, and whether
the server certificate and the CA files fit the listen addresses and their role.

The TLS machinery itself (contexts, certificates, CRLs) is :mod:`tiny_mindie.server.tls`, which
works on file paths and knows nothing of the configuration.
"""

from __future__ import annotations

import datetime
import ipaddress
import os

from .config import Config, ConfigError, ServerConfig
from .server.tls import TLSConfigError, TLSFiles, _read_certificates

WILDCARDS = ("0.0.0.0", "::")


def tls_files(cfg: Config) -> TLSFiles:
    """The TLS paths of ``cfg`` resolved against its home; the client pair sits beside the server's.

    Raises:
        ConfigError: ``tlsCaFile`` names no file (mutual TLS checks client certificates
            against a CA).
    """
    s = cfg.server
    if not s.tls_ca_files:
        raise ConfigError("ServerConfig.tlsCaFile must name at least one CA file (mutual TLS "
                          "checks client certificates against it; or use --no-tls)")
    cert, key = cfg.path(s.tls_cert), cfg.path(s.tls_pk)
    return TLSFiles(
        ca=tuple(os.path.normpath(os.path.join(cfg.path(s.tls_ca_path), f))
                 for f in s.tls_ca_files),
        cert=cert, key=key,
        crls=tuple(os.path.normpath(os.path.join(cfg.path(s.tls_crl_path), f))
                   for f in s.tls_crl_files),
        client_cert=os.path.join(os.path.dirname(cert), "client.pem"),
        client_key=os.path.join(os.path.dirname(key), "client.key.pem"),
    )


def uses_default_paths(cfg: Config) -> bool:
    """The CA, certificate and key keys of ``cfg`` are MindIE's defaults (``security/...`` in the
    config home): the only place where a first run may create them."""
    s, d = cfg.server, ServerConfig()
    return (s.tls_ca_path, s.tls_ca_files, s.tls_cert, s.tls_pk) == \
        (d.tls_ca_path, d.tls_ca_files, d.tls_cert, d.tls_pk)


def uses_default_crl(cfg: Config) -> bool:
    """The CRL keys of ``cfg`` are MindIE's defaults (``security/certs/server_crl.pem``)."""
    s, d = cfg.server, ServerConfig()
    return (s.tls_crl_path, s.tls_crl_files) == (d.tls_crl_path, d.tls_crl_files)


def listen_hosts(cfg: Config) -> tuple[str, ...]:
    """The listen addresses of ``cfg`` that name one host (wildcards left out), in order."""
    s = cfg.server
    return tuple(h for h in dict.fromkeys((s.ip_address, s.management_ip_address))
                 if h not in WILDCARDS)


def check_before_creating(cfg: Config, files: TLSFiles) -> None:
    """Before a first run creates a CA and certificates (none of the CA, certificate and key
    files exists at the default paths): the CRL files the configuration names itself must
    exist, or the start would fail on them after leaving a new CA behind.

    Raises:
        TLSConfigError: naming the first missing CRL file; nothing is created.
    """
    needed = (*files.ca, files.cert, files.key)
    if uses_default_crl(cfg) or not uses_default_paths(cfg) or any(map(os.path.exists, needed)):
        return
    for crl in files.crls:
        if not os.path.exists(crl):
            raise TLSConfigError(
                f"TLS CRL file not found: {crl} (fix tlsCrlPath / tlsCrlFiles, or set "
                f"\"tlsCrlFiles\": [] to check no CRL; nothing was created: a first run makes "
                f"a CRL only at the default path)")


def check_certificates(files: TLSFiles, hosts: tuple[str, ...] = (),
                       now: datetime.datetime | None = None) -> list[str]:
    """Check the server certificate and the CA files for what OpenSSL would only show later, one
    handshake at a time.

    Args:
        files: the server's TLS files (existing).
        hosts: the listen addresses clients may connect by (:func:`listen_hosts`).
        now: the time to check validity at (default: now, UTC).

    Returns:
        Warnings, one line each: a listen address the server certificate does not name (a
        client connecting by another name the certificate holds is fine, so no refusal).

    Raises:
        TLSConfigError: the server certificate has expired or is not valid yet; a CA file holds
            a certificate that is no CA (a server or client certificate given as tlsCaFile).
    """
    now = now or datetime.datetime.now(datetime.UTC)
    cert = _read_certificates(files.cert, "TLS certificate")[0]
    if cert.not_valid_after_utc < now:
        raise TLSConfigError(f"TLS certificate {files.cert} expired on "
                             f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: every client "
                             f"refuses it (issue a new one, e.g. python -m tiny_mindie certs "
                             f"--force)")
    if cert.not_valid_before_utc > now:
        raise TLSConfigError(f"TLS certificate {files.cert} is not valid before "
                             f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC: every client "
                             f"refuses it until then (check the clock)")
    for path in files.ca:
        for ca in _read_certificates(path, "TLS CA file"):
            if not _is_ca(ca):
                raise TLSConfigError(
                    f"TLS CA file {path} holds {ca.subject.rfc4514_string()!r}, which is not a "
                    f"CA (basicConstraints CA:FALSE): tlsCaFile must name the CA that issued "
                    f"the client certificates, not a server or client certificate")
    names = _names(cert)
    return [f"TLS certificate {files.cert} does not name the listen address {h} (it names "
            f"{', '.join(map(str, names)) or 'nothing'}): a client connecting by {h} and "
            f"checking the host name refuses it" for h in hosts if not _covers(names, h)]


def _is_ca(cert) -> bool:
    """A CA certificate: basicConstraints CA:TRUE, or (X.509 v1, no extension) self-issued, as
    OpenSSL counts it."""
    from cryptography import x509
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return cert.subject == cert.issuer


def _names(cert) -> list:
    """The subjectAltNames of ``cert``: DNS names (str) and IP addresses; clients read no CN."""
    from cryptography import x509
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [*san.get_values_for_type(x509.DNSName), *san.get_values_for_type(x509.IPAddress)]


def _covers(names: list, host: str) -> bool:
    """Whether one of ``names`` matches ``host`` as a TLS client checks it (RFC 6125: an IP
    address only by an IP entry; a DNS name case-insensitively, ``*`` for one leftmost label)."""
    try:
        ip = ipaddress.ip_address(host.partition("%")[0])
        return ip in names
    except ValueError:
        pass
    host = host.rstrip(".").lower()
    for name in names:
        if not isinstance(name, str):
            continue
        name = name.rstrip(".").lower()
        if name == host or (name.startswith("*.") and "." in host
                            and host.partition(".")[2] == name[2:]):
            return True
    return False
