"""The TLS settings of a configuration: :class:`~.load.Config` -> :class:`TLSFiles`,
and the start-up checks that need the configuration: what a first run may create, and whether
the server certificate and the CA files fit the listen addresses and their role.

The TLS machinery itself (contexts, certificates, CRLs) is :mod:`tiny_mindie.server.tls`, which
works on file paths and knows nothing of the configuration.
"""

from __future__ import annotations

import datetime
import ipaddress
import os

from ..server.tls import TLSConfigError, TLSFiles, _read_certificates
from ..server.tls_refusal import is_ca
from .load import Config, ConfigError, ServerConfig

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
        client connecting by another name the certificate holds is fine, so no refusal); a CA of
        ``tlsCaFile`` that has expired or is not valid yet while another CA there is valid (the
        clients of that CA are refused, the others served).

    Raises:
        TLSConfigError: the server certificate has expired or is not valid yet, or its extended
            key usage lacks serverAuth (or its key usage allows no TLS server key); a CA
            certificate after it in its file (the chain the server sends) is no CA, has expired
            or is not valid yet; a CA file holds a certificate that is no CA (a server or client
            certificate given as tlsCaFile); no CA of tlsCaFile is valid now.
    """
    now = now or datetime.datetime.now(datetime.UTC)
    chain = _read_certificates(files.cert, "TLS certificate")
    cert = chain[0]
    if cert.not_valid_after_utc < now:
        raise TLSConfigError(f"TLS certificate {files.cert} expired on "
                             f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: every client "
                             f"refuses it (issue a new one, e.g. python -m tiny_mindie certs "
                             f"--force)")
    if cert.not_valid_before_utc > now:
        raise TLSConfigError(f"TLS certificate {files.cert} is not valid before "
                             f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC: every client "
                             f"refuses it until then (check the clock)")
    _check_server_purpose(files.cert, cert)
    _check_server_chain(files.cert, chain[1:], now)
    warnings = _check_cas(files.ca, now)
    names = _names(cert)
    return warnings + [
        f"TLS certificate {files.cert} does not name the listen address {h} (it names "
        f"{', '.join(map(str, names)) or 'nothing'}): a client connecting by {h} and "
        f"checking the host name refuses it" for h in hosts if not _covers(names, h)]


def _check_server_purpose(path: str, cert) -> None:
    """Raise when ``cert`` is not for a TLS server as a client checks it: an extended key usage
    without serverAuth, or a key usage allowing none of digitalSignature, keyEncipherment and
    keyAgreement (OpenSSL: ``unsuitable certificate purpose``)."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        eku = None
    if eku is not None and ExtendedKeyUsageOID.SERVER_AUTH not in eku:
        usages = ", ".join(getattr(u, "_name", None) or u.dotted_string for u in eku)
        raise TLSConfigError(f"TLS certificate {path} is not a server certificate: its extended "
                             f"key usage ({usages or 'none'}) lacks serverAuth, so every client "
                             f"refuses it (unsuitable certificate purpose); issue one for a "
                             f"server, e.g. python -m tiny_mindie certs --force")
    try:
        ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        return
    if not (ku.digital_signature or ku.key_encipherment or ku.key_agreement):
        raise TLSConfigError(f"TLS certificate {path} is not a server certificate: its key usage "
                             f"allows none of digitalSignature, keyEncipherment, keyAgreement, "
                             f"so every client refuses it (unsuitable certificate purpose)")


def _out_of_date(cert, now: datetime.datetime) -> str:
    """Why ``cert`` is not valid at ``now`` (``"expired on ... UTC"``, ``"is not valid before
    ... UTC"``), or "" when it is."""
    if cert.not_valid_after_utc < now:
        return f"expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
    if cert.not_valid_before_utc > now:
        return f"is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC"
    return ""


def _check_server_chain(path: str, chain: list, now: datetime.datetime) -> None:
    """Raise when a certificate after the server's in its file (the intermediate CAs the server
    sends) is no CA, has expired or is not valid yet: clients refuse the chain."""
    for ca in chain:
        subject = ca.subject.rfc4514_string()
        if not is_ca(ca):
            raise TLSConfigError(f"TLS certificate {path} holds {subject!r} after the server "
                                 f"certificate, which is not a CA (basicConstraints CA:FALSE): "
                                 f"only the intermediate CAs of the server's chain belong there")
        why = _out_of_date(ca, now)
        if why:
            raise TLSConfigError(f"TLS certificate {path} holds the intermediate CA {subject!r}, "
                                 f"which {why}: every client refuses the server's chain "
                                 f"(install the intermediate's renewed certificate)")


def _check_cas(paths: tuple[str, ...], now: datetime.datetime) -> list[str]:
    """Check the certificates of the CA files: each is a CA; one out of date is a warning while
    a CA is valid with every CA above it in the files, an error when none is.

    Returns:
        Warnings, one line per CA that has expired or is not valid yet.
    """
    cas = [(path, ca) for path in paths for ca in _read_certificates(path, "TLS CA file")]
    for path, ca in cas:
        if not is_ca(ca):
            raise TLSConfigError(
                f"TLS CA file {path} holds {ca.subject.rfc4514_string()!r}, which is not a "
                f"CA (basicConstraints CA:FALSE): tlsCaFile must name the CA that issued "
                f"the client certificates, not a server or client certificate")
    stale = [(path, ca, why) for path, ca in cas if (why := _out_of_date(ca, now))]
    if not stale:
        return []
    if not any(_valid_path(ca, [c for _, c in cas], now) for _, ca in cas):
        path, ca, why = stale[0]
        until = "until then (check the clock)" if "before" in why else \
            "(install the CA's renewed certificate)"
        raise TLSConfigError(f"TLS CA file {path} holds the CA {ca.subject.rfc4514_string()!r}, "
                             f"which {why}, and tlsCaFile holds no CA valid now: every client "
                             f"certificate is refused {until}")
    return [f"TLS CA file {path} holds the CA {ca.subject.rfc4514_string()!r}, which {why}: "
            f"EVERY client certificate issued by it or through it will be refused ("
            + ("certificate is not yet valid) until then (check the clock)" if "before" in why
               else "certificate has expired) until its renewed certificate is installed")
            for path, ca, why in stale]


def _valid_path(ca, cas: list, now: datetime.datetime) -> bool:
    """Whether ``ca`` and every CA above it among ``cas`` (by issuer name, up to a self-issued
    one) are valid at ``now``."""
    seen: set = set()
    while ca is not None and ca.subject not in seen:
        if _out_of_date(ca, now):
            return False
        seen.add(ca.subject)
        if ca.issuer == ca.subject:
            return True
        ca = next((c for c in cas if c.subject == ca.issuer), None)
    return True


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
