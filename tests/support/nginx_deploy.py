"""deploy/nginx/tiny_mindie.conf made runnable here: certificates in MindIE's layout plus the
files nginx names, and a whole nginx.conf under a test prefix that includes the deploy file with
test paths, port and replicas (tests/unit/test_deploy.py checks its syntax,
tests/e2e/test_deploy_nginx.py serves through it)."""

from __future__ import annotations

import os
import shutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NGINX_CONF = os.path.join(REPO, "deploy", "nginx", "tiny_mindie.conf")

#: What the nginx file says that the tests replace: its replicas, its files, its port.
NGINX_REPLICAS = ("server 10.0.0.11:1025 ", "server 10.0.0.12:1025 ")
NGINX_FILES_DIR = "/etc/nginx/tiny_mindie/"
NGINX_LOG_DIR = "/var/log/nginx/"
NGINX_LISTEN = "listen 8443 ssl;"


def nginx_certificates(directory: str) -> str:
    """One CA, a server certificate also naming ``tiny-mindie`` (nginx's proxy_ssl_name), a
    client certificate and an empty CRL, in MindIE's security/ layout under ``directory``; the
    config keys naming them (absolute paths) are returned as a ServerConfig fragment."""
    from tiny_mindie.server.tls import TLSFiles, issue_certificate, issue_crl, make_certificates

    sec = os.path.join(directory, "security")
    files = TLSFiles(ca=(f"{sec}/ca/ca.pem",), cert=f"{sec}/certs/server.pem",
                     key=f"{sec}/keys/server.key.pem", crls=(f"{sec}/certs/server_crl.pem",),
                     client_cert=f"{sec}/certs/client.pem",
                     client_key=f"{sec}/keys/client.key.pem")
    make_certificates(files, ("tiny-mindie",))
    # a client the CRL revokes: the replicas and nginx (ssl_crl) both refuse it
    issue_certificate(files.ca[0], files.ca_key, f"{sec}/certs/revoked.pem",
                      f"{sec}/keys/revoked.key.pem", "revoked client")
    issue_crl(files.crls[0], files.ca[0], files.ca_key, revoke=(f"{sec}/certs/revoked.pem",))
    # the files nginx names (deploy/nginx/tiny_mindie.conf): its front certificate is the
    # replicas' own in this test
    nginx_dir = os.path.join(directory, "nginx")
    os.makedirs(nginx_dir)
    for src, name in ((files.cert, "front.pem"), (files.key, "front.key.pem"),
                      (files.ca[0], "ca.pem"), (files.crls[0], "crl.pem"),
                      (files.client_cert, "client.pem"),
                      (files.client_key, "client.key.pem")):
        shutil.copy(src, os.path.join(nginx_dir, name))
    return sec


def render_nginx(prefix: str, port: int, replicas: list[str]) -> str:
    """A whole nginx.conf under ``prefix`` that includes deploy/nginx's file with test paths:
    its certificate files from ``prefix``/nginx, its log in ``prefix``/logs, listening on
    127.0.0.1:``port``, ``replicas`` (host:port) as its upstream servers."""
    with open(NGINX_CONF) as fh:
        text = fh.read()
    for needle in (*NGINX_REPLICAS, NGINX_FILES_DIR, NGINX_LOG_DIR, NGINX_LISTEN):
        assert needle in text, f"{NGINX_CONF} no longer says {needle!r}: update the test"
    text = text.replace(NGINX_REPLICAS[0], "".join(f"server {r} " for r in replicas[:1]))
    text = text.replace(NGINX_REPLICAS[1], "".join(f"server {r} " for r in replicas[1:]))
    text = text.replace(NGINX_FILES_DIR, os.path.join(prefix, "nginx") + "/")
    text = text.replace(NGINX_LOG_DIR, os.path.join(prefix, "logs") + "/")
    text = text.replace(NGINX_LISTEN, f"listen 127.0.0.1:{port} ssl;")
    os.makedirs(os.path.join(prefix, "logs"), exist_ok=True)
    site = os.path.join(prefix, "tiny_mindie.conf")
    with open(site, "w") as fh:
        fh.write(text)
    temp = os.path.join(prefix, "temp")
    main = os.path.join(prefix, "nginx.conf")
    user = "user root root;\n" if os.geteuid() == 0 else ""   # workers read the tmp files
    with open(main, "w") as fh:
        fh.write(f"{user}daemon off;\nworker_processes 1;\npid {prefix}/nginx.pid;\n"
                 f"error_log {prefix}/logs/error.log info;\n"
                 "events { worker_connections 512; }\n"
                 "http {\n"
                 f"  access_log off;\n"
                 f"  client_body_temp_path {temp}/body;\n  proxy_temp_path {temp}/proxy;\n"
                 f"  fastcgi_temp_path {temp}/fastcgi;\n  uwsgi_temp_path {temp}/uwsgi;\n"
                 f"  scgi_temp_path {temp}/scgi;\n"
                 f"  include {site};\n"
                 "}\n")
    os.makedirs(temp, exist_ok=True)
    return main


def nginx_cmd(nginx: str, prefix: str, conf: str) -> list[str]:
    return [nginx, "-p", prefix, "-c", conf, "-e", os.path.join(prefix, "logs", "error.log")]
