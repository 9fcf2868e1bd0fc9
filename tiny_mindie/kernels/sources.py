"""The digest of the kernel library's C sources, which the build embeds in the library
(``setup.py``) so that a source tree with no build of its own can tell whether the installed
build was made from the same sources (:func:`tiny_mindie.kernels.library_path`). Standard
library only: ``setup.py`` loads this file by its path, before anything is installed."""

from __future__ import annotations

import hashlib
import os

#: The bytes before the hexadecimal digest in the built library (``dispatch.c``'s ``tm_sources``).
MARKER = b"tm-sources-sha256:"


def digest(folder: str) -> str | None:
    """sha256 (hexadecimal) over the ``*.c`` and ``*.h`` files of ``folder``, each file's name,
    a NUL byte and its bytes, in name order; ``None`` where ``folder`` holds no ``*.c`` file (an
    installed package: its wheel has the library, not the sources)."""
    names = sorted(n for n in os.listdir(folder) if n.endswith((".c", ".h")))
    if not any(n.endswith(".c") for n in names):
        return None
    h = hashlib.sha256()
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()
