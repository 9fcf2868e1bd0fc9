"""Test data that lives outside the repository, fetched from PyPI, cached and sha256-checked.

llama.cpp's ``models/`` folder (MIT licence) holds vocabulary-only GGUF files with reference
tokenizations (``ggml-vocab-*.gguf`` plus ``.inp``/``.out``) and chat templates
(``templates/*.jinja``). It ships inside the PyPI source distribution of
``llama-cpp-python==0.3.36`` as ``vendor/llama.cpp/models/``. The first use downloads that
sdist (77 MB), keeps only those files under ``<cache root>/testdata/llama-cpp-python-0.3.36/``
(cache root: ``$TINY_MINDIE_CACHE``, else ``~/.cache/tiny_mindie``) and deletes the tarball.

Format of the vectors: ``X.gguf.inp`` holds the test texts, each followed by a line
``__ggml_vocab_test__``; ``X.gguf.out`` holds, line by line, the token ids of each text (space
separated), tokenized with no BOS/EOS added and special tokens not parsed.

``$TINY_MINDIE_TESTDATA``, if set, names a local folder whose ``tokenizers/`` subfolder holds the
vocabulary files and vectors (same names); :func:`tokenizer_vectors_dir` then uses it and fetches
nothing.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request

from tiny_mindie.model.registry.catalog import cache_root, sha256_of

SDIST_NAME = "llama_cpp_python-0.3.36.tar.gz"
SDIST_URL = ("https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f65"
             "21aae45ca773a59fe7cf3/" + SDIST_NAME)
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST_SIZE = 76_589_250                          # bytes
SDIST_REQUIREMENT = "llama-cpp-python==0.3.36"
MODELS_PREFIX = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/"
WANTED = ("ggml-vocab-*.gguf", "ggml-vocab-*.gguf.inp", "ggml-vocab-*.gguf.out",
          "templates/*.jinja")                   # relative to MODELS_PREFIX
MARKER = ".complete"                             # written last: its presence means a whole cache
NETWORK_TIMEOUT = 30                             # seconds without progress before giving up


class DataUnavailable(RuntimeError):
    """The test data could not be had (no network, wrong checksum, ...); the message says why."""


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def llama_cpp_models_dir() -> str:
    """Local directory holding the needed files of llama.cpp's ``models/`` folder.

    Returns the path of a directory with ``ggml-vocab-*.gguf`` and their ``.inp``/``.out``
    vectors, and ``templates/*.jinja``, taken from the ``llama-cpp-python==0.3.36`` sdist. The
    first call downloads the sdist (77 MB; progress on stderr), later calls only check the cache.
    Safe when several processes fetch at once: each extracts into a temporary directory and
    renames it into place; a loser of that race uses the winner's copy.

    Raises:
        DataUnavailable: neither the pinned URL nor ``pip download`` gave the sdist with the
            expected size and sha256, or it lacks the expected files.
    """
    base = os.path.join(cache_root(), "testdata")
    final = os.path.join(base, "llama-cpp-python-0.3.36")
    models = os.path.join(final, "models")
    if os.path.isfile(os.path.join(final, MARKER)):
        return models
    os.makedirs(base, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=base, prefix=".fetch-")
    try:
        _log(f"fetching llama.cpp tokenizer vectors (77 MB) from PyPI "
             f"({SDIST_REQUIREMENT} sdist) ...")
        tarball = _download(tmp)
        staged = os.path.join(tmp, "llama-cpp-python-0.3.36")
        count = _extract(tarball, os.path.join(staged, "models"))
        os.unlink(tarball)
        with open(os.path.join(staged, MARKER), "w") as fh:
            fh.write(f"{SDIST_NAME} sha256 {SDIST_SHA256}\n")
        if os.path.isdir(final) and not os.path.isfile(os.path.join(final, MARKER)):
            shutil.rmtree(final, ignore_errors=True)        # a stale copy without its marker
        try:
            os.rename(staged, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, MARKER)):
                raise
        _log(f"  {count} files ready in {models}")
        return models
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def tokenizer_vectors_dir() -> str:
    """Directory holding ``ggml-vocab-*.gguf`` and their ``.inp``/``.out`` reference vectors.

    Returns ``$TINY_MINDIE_TESTDATA/tokenizers`` if that variable is set, else
    :func:`llama_cpp_models_dir` (fetched on first use).

    Raises:
        DataUnavailable: as :func:`llama_cpp_models_dir`, or ``$TINY_MINDIE_TESTDATA`` is set
            but has no ``tokenizers/`` folder.
    """
    local = os.environ.get("TINY_MINDIE_TESTDATA")
    if local:
        path = os.path.join(local, "tokenizers")
        if not os.path.isdir(path):
            raise DataUnavailable(f"$TINY_MINDIE_TESTDATA has no tokenizers/ folder: {path}")
        return path
    return llama_cpp_models_dir()


def vocab_dir_or_skip(config) -> str:
    """:func:`tokenizer_vectors_dir` for a pytest fixture, with its progress lines shown.

    ``config`` is the pytest config (``request.config``); output capture is suspended while
    fetching so a first run shows what it downloads. Returns the directory's path.

    Raises:
        pytest.skip.Exception: the vectors cannot be had; the one-line reason says why.
    """
    import pytest

    capman = config.pluginmanager.getplugin("capturemanager")
    try:
        with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
            return tokenizer_vectors_dir()
    except DataUnavailable as exc:
        pytest.skip(f"llama.cpp tokenizer vectors unavailable: {exc} "
                    f"(they come from PyPI's {SDIST_REQUIREMENT} sdist)")


def _download(tmp: str) -> str:
    """Path of the verified sdist in ``tmp``: from the pinned URL, else via ``pip download``."""
    try:
        return _download_url(tmp)
    except (OSError, DataUnavailable) as exc:           # URLError and timeouts are OSErrors
        url_error = exc
        _log(f"  direct download failed ({exc}); trying pip download (slower, ~80 s) ...")
    try:
        return _download_pip(tmp)
    except (OSError, subprocess.SubprocessError, DataUnavailable) as exc:
        raise DataUnavailable(f"download: {url_error}; pip: {exc}") from None


def _download_url(tmp: str) -> str:
    path = os.path.join(tmp, SDIST_NAME)
    with (urllib.request.urlopen(SDIST_URL, timeout=NETWORK_TIMEOUT) as resp,
          open(path, "wb") as out):
        shutil.copyfileobj(resp, out, 1 << 20)
    _verify(path)
    return path


def _download_pip(tmp: str) -> str:
    dest = os.path.join(tmp, "pip")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "--progress-bar", "off", "--retries", "2",
           "--timeout", str(NETWORK_TIMEOUT), SDIST_REQUIREMENT, "--dest", dest]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    path = os.path.join(dest, SDIST_NAME)
    if proc.returncode != 0 or not os.path.isfile(path):
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no sdist found"]
        raise DataUnavailable(f"pip download {SDIST_REQUIREMENT} failed: {last[0]}")
    _verify(path)
    return path


def _verify(path: str) -> None:
    """Check size and sha256 of the downloaded sdist; delete it and raise if either differs."""
    size = os.path.getsize(path)
    digest = sha256_of(path) if size == SDIST_SIZE else None
    if digest != SDIST_SHA256:
        os.unlink(path)
        got = f"sha256 {digest}" if digest else f"{size} bytes"
        raise DataUnavailable(f"{SDIST_NAME}: expected {SDIST_SIZE} bytes with sha256 "
                                  f"{SDIST_SHA256}, got {got}")


def _extract(tarball: str, dest: str) -> int:
    """Copy the wanted members of ``models/`` into ``dest``; return how many files were copied."""
    count = 0
    with tarfile.open(tarball, "r:gz") as tf:
        for member in tf:
            if not (member.isfile() and member.name.startswith(MODELS_PREFIX)):
                continue
            rel = member.name[len(MODELS_PREFIX):]
            if not any(fnmatch.fnmatchcase(rel, pat) and rel.count("/") == pat.count("/")
                       for pat in WANTED):
                continue
            target = os.path.join(dest, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with tf.extractfile(member) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            count += 1
    if not os.path.isdir(dest) or not any(n.endswith(".gguf") for n in os.listdir(dest)):
        raise DataUnavailable(f"{SDIST_NAME} holds no {MODELS_PREFIX}ggml-vocab-*.gguf")
    return count
