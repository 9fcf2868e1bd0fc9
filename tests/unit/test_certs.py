"""``python -m tiny_mindie certs``: the files, their subjectAltNames, what it tells the user, no
overwriting without ``--force``; and a real TLS 1.3 handshake with them (the server's own context,
the made client certificate, the host names checked). The full server with files made this way:
tests/e2e/test_e2e_tls.py (its ``pki``)."""

from __future__ import annotations

import ipaddress
import os
import socket
import ssl
import subprocess
import sys
import threading
from dataclasses import replace

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID
from helpers import make_ca

from tiny_mindie.config.load import load_config
from tiny_mindie.config.tls import tls_files
from tiny_mindie.server.tls import client_context, issue_certificate, server_context

HOSTS = ("edge.local", "10.0.0.5", "fd00::5")


def certs(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiny_mindie", "certs", *args],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def load(path) -> x509.Certificate:
    with open(path, "rb") as fh:
        return x509.load_pem_x509_certificate(fh.read())


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A set made for HOSTS in a folder of its own; (the files, the command's output)."""
    home = tmp_path_factory.mktemp("certs")
    r = certs("--dir", str(home), *(a for h in HOSTS for a in ("--host", h)))
    assert r.returncode == 0, r.stderr
    return tls_files(replace(load_config(None), home=str(home))), r.stdout


def test_files_and_subject_alt_names(made):
    files, _ = made
    ca = load(files.ca[0])
    server = load(files.cert)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"localhost", "edge.local"}
    assert set(san.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address(a) for a in ("127.0.0.1", "127.0.0.2", "::1", "10.0.0.5", "fd00::5")}
    client = load(files.client_cert)
    for cert, usage in ((server, ExtendedKeyUsageOID.SERVER_AUTH),
                        (client, ExtendedKeyUsageOID.CLIENT_AUTH)):
        cert.verify_directly_issued_by(ca)
        assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == \
            [usage]
    for key in (files.ca_key, files.key, files.client_key):
        assert os.stat(key).st_mode & 0o777 == 0o600, key
    with open(files.crls[0], "rb") as fh:
        crl = x509.load_pem_x509_crl(fh.read())
    assert crl.is_signature_valid(ca.public_key()) and len(crl) == 0


def test_output_names_the_files_for_curl_nginx_and_kubernetes(made):
    files, out = made
    assert out.startswith("made a CA, a server certificate for localhost, 127.0.0.1, 127.0.0.2, "
                          "::1, edge.local, 10.0.0.5, fd00::5, a client certificate and an empty "
                          "CRL:\n")
    assert f"curl --cacert {files.ca[0]} --cert {files.client_cert} \\\n" in out
    assert f"--key {files.client_key} https://edge.local:1025/health" in out
    assert f"proxy_ssl_trusted_certificate {files.ca[0]};" in out
    assert f"proxy_ssl_certificate_key {files.client_key};" in out
    assert "proxy_ssl_name edge.local;" in out
    secret = out[out.index("kubectl create secret generic tiny-mindie-tls"):]
    for path in (files.ca[0], files.cert, files.key, files.client_cert, files.client_key,
                 files.crls[0]):
        assert f"--from-file={path}" in secret
    assert f"--from-file={files.ca_key}" not in secret
    home = os.path.dirname(os.path.dirname(os.path.dirname(files.ca[0])))
    assert f"the server uses them: TINY_MINDIE_HOME={home} python -m tiny_mindie" in out


def serve_tls(ctx: ssl.SSLContext, connections: int):
    """A loopback TLS server thread answering ``connections`` connections with b"hello"; its
    port, the thread, and the errors of its handshakes."""
    lsock = socket.create_server(("127.0.0.1", 0))
    errors: list[BaseException] = []

    def run() -> None:
        with lsock:
            for _ in range(connections):
                conn, _ = lsock.accept()
                try:
                    with ctx.wrap_socket(conn, server_side=True) as tls:
                        tls.sendall(b"hello")
                except (ssl.SSLError, OSError) as exc:
                    errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return lsock.getsockname()[1], thread, errors


def test_a_client_with_the_made_certificate_connects_by_every_name(made):
    files, _ = made
    port, thread, errors = serve_tls(server_context(files), 5)
    for name in ("edge.local", "10.0.0.5", "localhost"):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                client_context(files).wrap_socket(raw, server_hostname=name) as tls:
            assert tls.version() == "TLSv1.3" and tls.recv(5) == b"hello"
    with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"), \
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        client_context(files).wrap_socket(raw, server_hostname="other.example")
    anonymous = ssl.create_default_context(cafile=files.ca[0])      # no client certificate
    with pytest.raises((ssl.SSLError, ConnectionError)), \
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            anonymous.wrap_socket(raw, server_hostname="edge.local") as tls:
        tls.recv(5)
    thread.join(timeout=10)                   # its last handshake's error recorded
    assert len(errors) == 2 and "PEER_DID_NOT_RETURN_A_CERTIFICATE" in str(errors[-1]), errors


def test_existing_files_are_kept_without_force(tmp_path):
    assert certs("--dir", str(tmp_path), "--no-crl").returncode == 0
    sec = tmp_path / "security"
    assert not (sec / "certs" / "server_crl.pem").exists()
    before = (sec / "ca" / "ca.pem").read_bytes()
    r = certs("--dir", str(tmp_path), "--no-crl")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (f"tiny_mindie: error: {sec}/ca/ca.pem exists (and 5 more); use --force "
                        f"to replace\n")
    assert (sec / "ca" / "ca.pem").read_bytes() == before
    r = certs("--dir", str(tmp_path), "--force", "--host", "edge.local")
    assert r.returncode == 0 and (sec / "ca" / "ca.pem").read_bytes() != before
    assert (sec / "certs" / "server_crl.pem").exists()


def test_default_folder_is_the_config_home(tmp_path):
    r = certs(env={"TINY_MINDIE_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "security" / "certs" / "server.pem").is_file()
    assert "the server uses them: python -m tiny_mindie\n" in r.stdout


# ---- start-up checks of the files a server names ------------------------------------------------


def serve(home, server_config: dict) -> subprocess.CompletedProcess:
    """``serve`` with a config.json in ``home``; no model, so a start the TLS files pass ends
    at the model's one-line error."""
    import json
    path = os.path.join(home, "config.json")
    with open(path, "w") as fh:
        json.dump({"ServerConfig": {"port": 0, **server_config}}, fh)
    return subprocess.run([sys.executable, "-m", "tiny_mindie", "--config", path, "--model",
                           os.path.join(home, "no-model.gguf")],
                          capture_output=True, text=True, timeout=60)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("tiny_mindie: error: "), r.stderr
    return r.stderr[len("tiny_mindie: error: "):].strip()


def test_a_missing_crl_fails_before_a_first_run_creates_anything(tmp_path):
    r = serve(tmp_path, {"tlsCrlPath": "security/crl/", "tlsCrlFiles": ["mine.pem"]})
    message = one_line_error(r)
    assert message.startswith(f"TLS CRL file not found: {tmp_path}/security/crl/mine.pem"), message
    assert "nothing was created" in message
    assert os.listdir(tmp_path) == ["config.json"]


def test_an_expired_server_certificate_is_named_at_start(tmp_path):
    import datetime

    from cryptography.hazmat.primitives import hashes, serialization
    assert certs("--dir", str(tmp_path)).returncode == 0
    sec = tmp_path / "security"
    server, ca = load(sec / "certs/server.pem"), load(sec / "ca/ca.pem")
    ca_key = serialization.load_pem_private_key((sec / "ca/ca.key.pem").read_bytes(), None)
    key = serialization.load_pem_private_key((sec / "keys/server.key.pem").read_bytes(), None)
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder().subject_name(server.subject).issuer_name(ca.subject)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(days=30))
         .not_valid_after(now - datetime.timedelta(days=1)))
    for ext in server.extensions:
        b = b.add_extension(ext.value, ext.critical)
    (sec / "certs/server.pem").write_bytes(
        b.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    message = one_line_error(serve(tmp_path, {}))
    assert message.startswith(f"TLS certificate {sec}/certs/server.pem expired on "), message


@pytest.mark.parametrize("leaf", ["client.pem", "server.pem"])
def test_a_leaf_given_as_the_ca_file_is_named_not_the_crl(tmp_path, leaf):
    assert certs("--dir", str(tmp_path)).returncode == 0
    message = one_line_error(serve(tmp_path, {"tlsCaPath": "security/certs/",
                                              "tlsCaFile": [leaf]}))
    assert message.startswith(f"TLS CA file {tmp_path}/security/certs/{leaf} holds "), message
    assert "which is not a CA" in message and "CRL" not in message


def test_a_listen_address_the_certificate_does_not_name_is_a_warning(tmp_path):
    assert certs("--dir", str(tmp_path)).returncode == 0
    r = serve(tmp_path, {"ipAddress": "127.0.0.3", "managementIpAddress": "127.0.0.1"})
    warning = [line for line in r.stderr.splitlines() if "does not name" in line]
    assert len(warning) == 1 and "WARNING" in warning[0], r.stderr
    assert "the listen address 127.0.0.3 (it names localhost, 127.0.0.1" in warning[0]
    assert "model" in r.stderr.splitlines()[-1]          # the start went on to the model
    r = serve(tmp_path, {"ipAddress": "127.0.0.2"})
    assert "does not name" not in r.stderr


def test_host_names_are_matched_as_a_client_matches_them():
    import ipaddress as ip

    from tiny_mindie.config.tls import _covers
    names = ["svc.example", "*.pods.example", ip.ip_address("10.0.0.5")]
    assert _covers(names, "SVC.example.") and _covers(names, "a.pods.example")
    assert _covers(names, "10.0.0.5")
    assert not _covers(names, "a.b.pods.example") and not _covers(names, "pods.example")
    assert not _covers(names, "10.0.0.6") and not _covers(["10.0.0.5"], "10.0.0.5")


def warnings_of(r: subprocess.CompletedProcess, needle: str) -> list[str]:
    """The WARNING lines of a start's output that hold ``needle``; the start went on to the
    model (the last line is the model's error)."""
    assert "model" in r.stderr.splitlines()[-1], r.stderr
    return [line for line in r.stderr.splitlines() if needle in line and "WARNING" in line]


@pytest.mark.parametrize("valid, why", [((-30, -1), "expired on "),
                                        ((1, 30), "is not valid before ")])
def test_a_ca_out_of_date_alone_in_tlscafile_is_named_at_start(tmp_path, valid, why):
    assert certs("--dir", str(tmp_path)).returncode == 0
    sec = tmp_path / "security"
    make_ca(f"{sec}/ca/old.pem", f"{tmp_path}/old.key", "old CA", valid=valid)
    message = one_line_error(serve(tmp_path, {"tlsCaFile": ["old.pem"]}))
    assert message.startswith(f"TLS CA file {sec}/ca/old.pem holds the CA 'CN=old CA', which "
                              f"{why}"), message
    assert "tlsCaFile holds no CA valid now: every client certificate is refused" in message
    assert "CRL" not in message


def test_a_ca_out_of_date_beside_a_valid_one_is_a_warning(tmp_path):
    assert certs("--dir", str(tmp_path)).returncode == 0
    sec = tmp_path / "security"
    make_ca(f"{sec}/ca/old.pem", f"{tmp_path}/old.key", "old CA", valid=(-30, -1))
    r = serve(tmp_path, {"tlsCaFile": ["ca.pem", "old.pem"]})
    warning, = warnings_of(r, "TLS CA file")
    assert f"TLS CA file {sec}/ca/old.pem holds the CA 'CN=old CA', which expired on " in warning
    assert "EVERY client certificate issued by it or through it will be refused" in warning
    assert warnings_of(serve(tmp_path, {"tlsCaFile": ["ca.pem"]}), "TLS CA file") == []


@pytest.mark.parametrize("stale", ["root", "inter"])
def test_an_intermediate_ca_counts_with_the_ca_above_it(tmp_path, stale):
    """tlsCaFile holds a root and an intermediate under it: an expired intermediate beside a
    valid root is a warning; a valid intermediate under an expired root leaves no valid CA."""
    d = str(tmp_path)
    root = make_ca(f"{d}/root.pem", f"{d}/root.key", "root CA",
                   valid=(-30, -1) if stale == "root" else (-1, 30))
    make_ca(f"{d}/inter.pem", f"{d}/inter.key", "intermediate CA", root,
            valid=(-30, -1) if stale == "inter" else (-1, 30))
    issue_certificate(f"{d}/inter.pem", f"{d}/inter.key", f"{d}/server.pem", f"{d}/server.key",
                      "localhost", hosts=("localhost", "127.0.0.1"))
    r = serve(tmp_path, {"tlsCaPath": d, "tlsCaFile": ["root.pem", "inter.pem"],
                         "tlsCert": f"{d}/server.pem", "tlsPk": f"{d}/server.key",
                         "tlsCrlFiles": []})
    if stale == "root":
        message = one_line_error(r)
        assert message.startswith(f"TLS CA file {d}/root.pem holds the CA 'CN=root CA', which "
                                  f"expired on "), message
    else:
        warning, = warnings_of(r, "TLS CA file")
        assert f"{d}/inter.pem holds the CA 'CN=intermediate CA', which expired on " in warning


@pytest.mark.parametrize("after, error", [
    ("inter", None),
    ("stale", "holds the intermediate CA 'CN=stale CA', which expired on "),
    ("client", "holds 'CN=tiny_mindie client,O=tiny_mindie' after the server certificate, which "
               "is not a CA"),
])
def test_the_intermediate_cas_of_the_server_certificate_file_are_checked(tmp_path, after, error):
    """The server's file holds its certificate, then the intermediate CA that issued it (what
    the server sends): one out of date, or a leaf there, fails the start in one line."""
    assert certs("--dir", str(tmp_path)).returncode == 0
    sec, d = tmp_path / "security", str(tmp_path)
    ca = (load(sec / "ca/ca.pem"), serialization.load_pem_private_key(
        (sec / "ca/ca.key.pem").read_bytes(), None))
    make_ca(f"{d}/inter.pem", f"{d}/inter.key", "intermediate CA", ca)
    make_ca(f"{d}/stale.pem", f"{d}/stale.key", "stale CA", ca, valid=(-30, -1))
    issuer = "stale" if after == "stale" else "inter"
    issue_certificate(f"{d}/{issuer}.pem", f"{d}/{issuer}.key", f"{d}/server.pem",
                      f"{d}/server.key", "localhost", hosts=("localhost", "127.0.0.1"))
    extra = sec / "certs/client.pem" if after == "client" else tmp_path / f"{after}.pem"
    with open(f"{d}/server.pem", "ab") as fh:
        fh.write(extra.read_bytes())
    r = serve(tmp_path, {"tlsCert": f"{d}/server.pem", "tlsPk": f"{d}/server.key"})
    if error is None:
        assert warnings_of(r, "TLS") == [] and r.returncode == 2
    else:
        assert one_line_error(r).startswith(f"TLS certificate {d}/server.pem {error}")


def test_a_client_certificate_as_the_server_s_is_named_at_start(tmp_path):
    assert certs("--dir", str(tmp_path)).returncode == 0
    message = one_line_error(serve(tmp_path, {"tlsCert": "security/certs/client.pem",
                                              "tlsPk": "security/keys/client.key.pem"}))
    assert message.startswith(f"TLS certificate {tmp_path}/security/certs/client.pem is not a "
                              f"server certificate: its extended key usage (clientAuth) lacks "
                              f"serverAuth, so every client refuses it"), message
