#!/usr/bin/env python3
"""Create a CA, a server certificate (localhost, 127.0.0.1, 127.0.0.2, ::1 and --host names)
and a client certificate for mutual TLS, in MindIE's ``security/`` layout.

    python scripts/make_certs.py [--dir DIR] [--host NAME_OR_IP ...] [--force]

Writes DIR/security/ca/ca.pem, DIR/security/certs/{server,client}.pem and
DIR/security/keys/{server,client}.key.pem (keys mode 0600). DIR defaults to the config home
(``$TINY_MINDIE_HOME`` or ``~/.config/tiny_mindie``), where ``python -m tiny_mindie`` looks.
"""

import argparse
import os
import sys
from dataclasses import replace

from tiny_mindie.config import config_home, load_config
from tiny_mindie.server.tls import make_certificates, tls_files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=config_home(), help="folder that gets security/ (default: %(default)s)")
    ap.add_argument("--host", action="append", default=[], help="extra DNS name or IP for the server certificate")
    ap.add_argument("--force", action="store_true", help="overwrite existing files")
    args = ap.parse_args()
    files = tls_files(replace(load_config(None), home=os.path.abspath(args.dir)))
    existing = [p for p in (*files.ca, files.cert, files.key) if os.path.exists(p)]
    if existing and not args.force:
        print(f"make_certs: {existing[0]} exists; use --force to replace", file=sys.stderr)
        return 1
    make_certificates(files, tuple(args.host))
    for label, path in (("CA", files.ca[0]), ("server certificate", files.cert), ("server key", files.key),
                        ("client certificate", files.client_cert), ("client key", files.client_key)):
        print(f"{label:20} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
