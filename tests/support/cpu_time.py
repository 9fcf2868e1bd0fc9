"""CPU time of a call, for the tests that check an algorithm's growth by ratios across sizes.

CPU time of this thread, not wall-clock, so other processes on a loaded host do not count. The
cyclic garbage collector is paused while the call runs: a full collection scans every live object
of the test process, so in a long suite it adds a cost that grows with the suite, not the input.
"""

from __future__ import annotations

import gc
import time


def least_cpu_seconds(call, rounds: int = 3) -> float:
    """Least CPU seconds (float) of ``rounds`` runs of ``call()``: the run least disturbed."""
    best = float("inf")
    for _ in range(rounds):
        gc.collect()
        gc.disable()
        try:
            start = time.thread_time()
            call()
            best = min(best, time.thread_time() - start)
        finally:
            gc.enable()
    return best
