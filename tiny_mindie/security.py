"""The TLS settings of a configuration: :class:`~tiny_mindie.config.Config` -> :class:`TLSFiles`.

The TLS machinery itself (contexts, certificates, CRLs) is :mod:`tiny_mindie.server.tls`, which
works on file paths and knows nothing of the configuration.
"""

from __future__ import annotations

import os

from .config import Config, ConfigError, ServerConfig
from .server.tls import TLSFiles


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
