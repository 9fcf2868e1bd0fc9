"""What the results files of scripts/bench.py and scripts/loadtest.py record (scripts/results.py),
and what a figure of scripts/plot.py looks like, for the tests of both."""

from __future__ import annotations

import os

#: the keys every results file has, whatever its kind
RECORD_KEYS = {"kind", "date", "cpu", "cpus", "machine", "versions", "source", "command", "cwd",
               "load_average", "results"}


def is_figure(path) -> bool:
    """Whether the file at ``path`` (str or path) is a drawn figure: an SVG or a PNG of over
    1 KB."""
    with open(path, "rb") as fh:
        head = fh.read(4096)
    return os.path.getsize(path) > 1000 and (b"<svg" in head or head.startswith(b"\x89PNG"))
