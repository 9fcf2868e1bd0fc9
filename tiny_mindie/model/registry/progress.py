"""Progress lines for slow start-up steps: a step that is still running after 2 s says so in the
log, and says how long it took when it ends; a quicker step says nothing."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

#: seconds a step runs before it is announced
SLOW_STEP_S = 2.0


@contextmanager
def slow_step(log: logging.Logger, what: str, after: float = SLOW_STEP_S) -> Iterator[None]:
    """Log ``"<what> ..."`` (info) once the body has run ``after`` seconds, and
    ``"<what>: done in N s"`` when a body that was announced ends (or ``"<what>: failed after
    N s"`` when it raises)."""
    t0 = time.perf_counter()
    lock = threading.Lock()
    announced = []

    def announce() -> None:
        with lock:
            log.info("%s ...", what)
            announced.append(True)

    timer = threading.Timer(after, announce)
    timer.daemon = True
    timer.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        timer.cancel()
        with lock:              # an announcement under way is logged before the end
            done = bool(announced)
        if done:
            log.info("%s: %s %.1f s", what, "done in" if ok else "failed after",
                     time.perf_counter() - t0)
