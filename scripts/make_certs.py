#!/usr/bin/env python3
"""Create a CA, a server certificate (localhost, 127.0.0.1, 127.0.0.2, ::1 and --host names),
a client certificate and an empty CRL for mutual TLS, in MindIE's ``security/`` layout; or, with
the CA's key kept by the first run, issue another client certificate or revoke one.

    python scripts/make_certs.py [--dir DIR | --config FILE] [--host NAME_OR_IP ...] [--force]
    python scripts/make_certs.py [--dir DIR | --config FILE] --client NAME      # another client
    python scripts/make_certs.py [--dir DIR | --config FILE] --revoke CERT.pem  # add it to the CRL
    python scripts/make_certs.py [--dir DIR | --config FILE] --crl              # re-sign the CRL

The first form writes DIR/security/ca/{ca.pem,ca.key.pem}, DIR/security/certs/{server,client}.pem,
DIR/security/keys/{server,client}.key.pem (keys mode 0600) and DIR/security/certs/server_crl.pem.
``--client NAME`` writes DIR/security/certs/NAME.pem and DIR/security/keys/NAME.key.pem.
``--revoke`` re-signs the CRL with CERT's serial added (the entries already there are kept);
``--crl`` re-signs it as it is (or writes an empty one). A running server reads its CRL at
start-up, so restart it. DIR defaults to the config home
(``$TINY_MINDIE_HOME`` or ``~/.config/tiny_mindie``), where ``python -m tiny_mindie`` looks.

``--config FILE`` uses the files the server started with ``--config FILE`` uses instead: its
tlsCaPath/tlsCaFile, tlsCert, tlsPk and tlsCrlPath/tlsCrlFiles (relative to the file's folder);
the CA key is ``ca.key.pem`` beside the first CA file; ``--revoke`` and ``--crl`` write the first
of tlsCrlFiles; its listen addresses go into a new server certificate.
"""

import argparse
import os
import sys
from dataclasses import replace

from tiny_mindie.config import ConfigError, config_home, load_config
from tiny_mindie.security import tls_files
from tiny_mindie.server.tls import TLSConfigError, issue_certificate, issue_crl, make_certificates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--dir", default=config_home(),
                       help="folder that gets security/ (default: %(default)s)")
    where.add_argument("--config", metavar="FILE",
                       help="the server's config.json: write and read the TLS files it names")
    ap.add_argument("--host", action="append", default=[],
                    help="extra DNS name or IP for the server certificate")
    ap.add_argument("--force", action="store_true", help="overwrite existing files")
    ap.add_argument("--client", metavar="NAME", help="issue another client certificate (CN=NAME)")
    ap.add_argument("--revoke", metavar="CERT", action="append", default=[],
                    help="revoke this certificate (PEM file): add it to the CRL")
    ap.add_argument("--crl", action="store_true",
                    help="write the CRL again, signed by the CA key, keeping its entries")
    args = ap.parse_args()
    try:
        if args.config:
            cfg = load_config(args.config)
            hosts = tuple(dict.fromkeys(
                h for h in (cfg.server.ip_address, cfg.server.management_ip_address, *args.host)
                if h not in ("0.0.0.0", "::")))
        else:
            cfg = replace(load_config(None), home=os.path.abspath(args.dir))
            hosts = tuple(args.host)
        files = tls_files(cfg)
    except (ConfigError, TLSConfigError) as exc:
        print(f"make_certs: {exc}", file=sys.stderr)
        return 2
    try:
        if args.client:
            cert = os.path.join(os.path.dirname(files.client_cert), f"{args.client}.pem")
            key = os.path.join(os.path.dirname(files.client_key), f"{args.client}.key.pem")
            if (os.path.exists(cert) or os.path.exists(key)) and not args.force:
                print(f"make_certs: {cert} exists; use --force to replace", file=sys.stderr)
                return 1
            serial = issue_certificate(files.ca[0], files.ca_key, cert, key, args.client)
            print(f"{'client certificate':20} {cert} (serial {serial:x})\n{'client key':20} {key}")
        if (args.revoke or args.crl) and not files.crls:
            print("make_certs: the configuration names no CRL (\"tlsCrlFiles\": []); name one "
                  "to revoke certificates", file=sys.stderr)
            return 2
        if args.revoke or args.crl:
            n = issue_crl(files.crls[0], files.ca[0], files.ca_key, tuple(args.revoke))
            print(f"{'CRL':20} {files.crls[0]} ({n} revoked; restart the server to apply it)")
        if args.client or args.revoke or args.crl:
            return 0
    except (ConfigError, TLSConfigError) as exc:
        print(f"make_certs: {exc}", file=sys.stderr)
        return 2
    existing = [p for p in (*files.ca, files.cert, files.key) if os.path.exists(p)]
    if existing and not args.force:
        print(f"make_certs: {existing[0]} exists; use --force to replace", file=sys.stderr)
        return 1
    make_certificates(files, hosts)
    for label, path in (("CA", files.ca[0]), ("CA key", files.ca_key),
                        ("server certificate", files.cert), ("server key", files.key),
                        ("client certificate", files.client_cert), ("client key", files.client_key),
                        *(("CRL", crl) for crl in files.crls)):
        print(f"{label:20} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
