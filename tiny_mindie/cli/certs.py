"""``python -m tiny_mindie certs``: the certificates mutual TLS needs, for this host or others.

    python -m tiny_mindie certs [--dir DIR | --config FILE] [--host NAME_OR_IP ...] [--no-crl]
                                [--force]
    python -m tiny_mindie certs [--dir DIR | --config FILE] --client NAME     # another client
    python -m tiny_mindie certs [--dir DIR | --config FILE] --revoke CERT.pem # add it to the CRL
    python -m tiny_mindie certs [--dir DIR | --config FILE] --crl             # re-sign the CRL
    python -m tiny_mindie certs [--dir DIR | --config FILE] --p12 FILE [--p12-password PW]

The first form makes a CA (and keeps its key), a server certificate for localhost, 127.0.0.1,
127.0.0.2, ::1 and every ``--host`` (DNS names and IP addresses become subjectAltNames), a client
certificate, and an empty CRL (unless ``--no-crl``), where the server reads them: MindIE's
``security/`` layout in DIR (default: the config home, ``$TINY_MINDIE_HOME`` or
``~/.config/tiny_mindie``), or the files ``--config FILE`` names (its listen addresses join the
hosts). Existing files are never replaced without ``--force``. It then says which files go to
curl, nginx and a Kubernetes Secret. The certificates are made by
:mod:`tiny_mindie.server.tls` (``cryptography``), as on a server's first run.

``--client NAME`` issues another client certificate (``certs/NAME.pem``, ``keys/NAME.key.pem``)
with the kept CA key; ``--revoke`` re-signs the CRL with CERT's serial added (the entries already
there are kept); ``--crl`` re-signs it as it is. A server reads its CRL at start-up: restart it.
``--p12 FILE`` exports the client certificate, its key and the CA as a password-protected
PKCS#12 file for a browser's certificate store (:mod:`.p12`; the password is asked for when
``--p12-password`` is not given).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

from ..config.load import ConfigError, config_home, load_config
from ..config.tls import tls_files
from ..server.tls import (
    TLSConfigError,
    TLSFiles,
    issue_certificate,
    issue_crl,
    make_certificates,
)

ALWAYS = ("localhost", "127.0.0.1", "127.0.0.2", "::1")   # in every server certificate
SECRET = "tiny-mindie-tls"                                 # deploy/kubernetes's Secret
DESCRIPTION = (
    "Make a CA (its key kept, to issue and revoke later), a server certificate for localhost, "
    "127.0.0.1, 127.0.0.2, ::1 and every --host (subjectAltNames), a client certificate and an "
    "empty CRL, where the server reads them: security/ in --dir (default: the config home) or "
    "the files --config FILE names. Existing files are kept unless --force. Prints which files "
    "go to curl, nginx and a Kubernetes Secret. With --client, --revoke or --crl: issue another "
    "client certificate, or re-sign the CRL, with the kept CA key.")


def add_parser(sub) -> None:
    """Add the ``certs`` command to the CLI's subparsers."""
    c = sub.add_parser("certs", help="make a CA, server and client certificates and a CRL for "
                                     "mutual TLS (for other host names: --host)",
                       description=DESCRIPTION)
    where = c.add_mutually_exclusive_group()
    where.add_argument("--dir", help="folder that gets security/ (default: the config home, "
                                     "$TINY_MINDIE_HOME or ~/.config/tiny_mindie)")
    where.add_argument("--config", metavar="FILE",
                       help="the server's config.json: write and read the TLS files it names")
    c.add_argument("--host", action="append", default=[], metavar="NAME_OR_IP",
                   help="a DNS name or IP address clients use for the server (repeatable)")
    c.add_argument("--no-crl", action="store_true",
                   help="make no CRL (the server then needs \"tlsCrlFiles\": [])")
    c.add_argument("--force", action="store_true", help="replace existing files")
    c.add_argument("--client", metavar="NAME", help="issue another client certificate (CN=NAME)")
    c.add_argument("--revoke", metavar="CERT", action="append", default=[],
                   help="revoke this certificate (PEM file): add it to the CRL")
    c.add_argument("--crl", action="store_true",
                   help="write the CRL again, signed by the CA key, keeping its entries")
    c.add_argument("--p12", metavar="FILE",
                   help="export the client certificate, its key and the CA as a "
                        "password-protected PKCS#12 file (for a browser)")
    c.add_argument("--p12-password", metavar="PW",
                   help="the PKCS#12 file's password (default: asked for)")


def run(args: argparse.Namespace) -> int:
    """Carry out ``certs``; messages on stdout, errors as one line on stderr.

    Returns:
        0 done; 1 a file exists (and no ``--force``); 2 a configuration or TLS file error.
    """
    try:
        if args.config:
            cfg = load_config(args.config)
            hosts = tuple(dict.fromkeys(
                h for h in (cfg.server.ip_address, cfg.server.management_ip_address, *args.host)
                if h not in ("0.0.0.0", "::")))
        else:
            cfg = replace(load_config(None), home=os.path.abspath(args.dir or config_home()))
            hosts = tuple(args.host)
        files = tls_files(cfg)
        if args.p12:
            from .p12 import run as export_p12
            return export_p12(args.p12, args.p12_password, files, force=args.force)
        if args.client or args.revoke or args.crl:
            return _more(args, files)
    except (ConfigError, TLSConfigError) as exc:
        return _error(str(exc), 2)
    if args.no_crl:
        files = replace(files, crls=())
    made = (*files.ca, files.ca_key, files.cert, files.key, files.client_cert, files.client_key,
            *files.crls)
    existing = [p for p in made if os.path.exists(p)]
    if existing and not args.force:
        more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
        return _error(f"{existing[0]} exists{more}; use --force to replace", 1)
    make_certificates(files, hosts)
    _report(args, cfg, files, hosts)
    return 0


def _error(message: str, status: int) -> int:
    print(f"tiny_mindie: error: {message}", file=sys.stderr)
    return status


def _more(args: argparse.Namespace, files: TLSFiles) -> int:
    """``--client``, ``--revoke``, ``--crl``: with the kept CA key."""
    if args.client:
        cert = os.path.join(os.path.dirname(files.client_cert), f"{args.client}.pem")
        key = os.path.join(os.path.dirname(files.client_key), f"{args.client}.key.pem")
        if (os.path.exists(cert) or os.path.exists(key)) and not args.force:
            return _error(f"{cert} exists; use --force to replace", 1)
        serial = issue_certificate(files.ca[0], files.ca_key, cert, key, args.client)
        print(f"{'client certificate':20} {cert} (serial {serial:x})\n{'client key':20} {key}")
    if args.revoke or args.crl:
        if not files.crls:
            return _error("the configuration names no CRL (\"tlsCrlFiles\": []); name one to "
                          "revoke certificates", 2)
        n = issue_crl(files.crls[0], files.ca[0], files.ca_key, tuple(args.revoke))
        print(f"{'CRL':20} {files.crls[0]} ({n} revoked; restart the server to apply it)")
    return 0


def _report(args: argparse.Namespace, cfg, files: TLSFiles, hosts: tuple[str, ...]) -> None:
    names = list(dict.fromkeys((*ALWAYS, *hosts)))
    print(f"made a CA, a server certificate for {', '.join(names)}, a client certificate"
          f"{' and an empty CRL' if files.crls else ''}:")
    rows = [("CA", files.ca[0]), ("CA key", files.ca_key + "   (private: keep it out of "
                                                           "servers and Secrets)"),
            ("server certificate", files.cert), ("server key", files.key),
            ("client certificate", files.client_cert), ("client key", files.client_key),
            *(("CRL", crl) for crl in files.crls)]
    for label, path in rows:
        print(f"  {label:20} {path}")
    if args.config:
        serve = f"python -m tiny_mindie --config {args.config}"
    elif args.dir is None:
        serve = "python -m tiny_mindie"
    else:
        serve = f"TINY_MINDIE_HOME={cfg.home} python -m tiny_mindie   (or --config FILE in it)"
    host = hosts[0] if hosts else "localhost"
    url = f"https://{f'[{host}]' if ':' in host else host}:{cfg.server.port}/health"
    print(f"\nthe server uses them: {serve}"
          + ("" if files.crls else "  with \"tlsCrlFiles\": [] in its config (no CRL)"))
    print(f"curl:       curl --cacert {files.ca[0]} --cert {files.client_cert} \\\n"
          f"                 --key {files.client_key} {url}")
    print(f"nginx:      proxy_ssl_trusted_certificate {files.ca[0]};\n"
          f"            proxy_ssl_certificate {files.client_cert};\n"
          f"            proxy_ssl_certificate_key {files.client_key};\n"
          f"            proxy_ssl_verify on; proxy_ssl_name {host}; proxy_ssl_protocols TLSv1.3;"
          + (f"\n            ssl_crl {files.crls[0]};   # nginx refuses revoked clients itself"
             if files.crls else ""))
    secret = [files.ca[0], files.cert, files.key, files.client_cert, files.client_key,
              *files.crls]
    print(f"Kubernetes: kubectl create secret generic {SECRET} \\\n"
          + " \\\n".join(f"              --from-file={p}" for p in secret)
          + "\n            (every file but the CA key: the probes use the client pair)")
    print("more clients, revoking: python -m tiny_mindie certs [same --dir/--config] "
          "--client NAME | --revoke CERT.pem")
