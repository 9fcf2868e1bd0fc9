"""The kernel library's C sources, and their digest, which the build embeds in the library
(``setup.py``) so that the package can tell whether a build was made from the sources beside it
(:func:`tiny_mindie.kernels.library_path`). Standard library only: ``setup.py`` loads this file
by its path, before anything is installed."""

from __future__ import annotations

import hashlib
import os

#: The files compiled into the library, and the headers they include.
SOURCES = ("dispatch.c", "kern_portable.c", "kern_x86.c", "kern_x86_16.c", "kern_neon.c",
           "kern_gather.c", "ort_op.c")
DEPENDS = ("tm_kernels.h", "kern_impl.h", "kern_x86_512.h")

#: The bytes before the hexadecimal digest in the built library (``dispatch.c``'s ``tm_sources``).
MARKER = b"tm-sources-sha256:"


def digest(folder: str) -> str | None:
    """sha256 (hexadecimal) over :data:`SOURCES` and :data:`DEPENDS` in ``folder``: each file's
    name, a NUL byte and its bytes, in that order; ``None`` where ``folder`` holds none of the
    sources (an installed package: its wheel has the library, not the sources)."""
    if not any(os.path.isfile(os.path.join(folder, n)) for n in SOURCES):
        return None
    h = hashlib.sha256()
    for name in SOURCES + DEPENDS:
        path = os.path.join(folder, name)
        h.update(name.encode() + b"\0")
        if os.path.isfile(path):
            with open(path, "rb") as f:
                h.update(f.read())
        h.update(b"\0")
    return h.hexdigest()


def embedded(path: str) -> str | None:
    """The source digest the library file at ``path`` embeds; ``None`` where it embeds none
    (a build older than the digest) or cannot be read."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    at = data.find(MARKER)
    if at < 0:
        return None
    at += len(MARKER)
    return data[at:at + 64].decode("ascii", "replace")
