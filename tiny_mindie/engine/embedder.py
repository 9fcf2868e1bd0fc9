"""``Embedder``: embedding jobs from any number of clients batched on a thread of its own.

Jobs wait in one queue; the thread takes every job waiting (up to ``max_batch_tokens`` tokens,
at least one job), runs their texts through the encoder session together and hands each job its
vectors. The chat model's engine runs on its own thread and is never held by it. The counters
(requests, inputs, tokens, batches, batch sizes, seconds) are read by ``/metrics``.
"""

from __future__ import annotations

import bisect
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

#: The upper bounds of the batch-size histogram (inputs per encoder run).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass
class EmbedderStats:
    """Totals since start: jobs, inputs, tokens, encoder runs, seconds encoding; how many
    inputs each run held (``batch_sizes``: a list, newest last, at most 1,000 kept;
    ``size_counts``: runs per bucket of :data:`BATCH_BUCKETS`, the last one for bigger runs)."""

    requests: int = 0
    inputs: int = 0
    tokens: int = 0
    batches: int = 0
    seconds: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)
    size_counts: list[int] = field(default_factory=lambda: [0] * (len(BATCH_BUCKETS) + 1))

    def histogram(self) -> tuple[list[tuple[float, int]], int, int]:
        """The batch sizes as a Prometheus histogram: ``([(le, cumulative count), ...,
        (inf, batches)], sum of sizes, batches)``."""
        out, total = [], 0
        for bound, n in zip((*BATCH_BUCKETS, float("inf")), self.size_counts, strict=True):
            total += n
            out.append((bound, total))
        return out, self.inputs, self.batches


class Embedder:
    """Batches jobs across clients for one encoder session.

    Args:
        session: an object with ``encode(list[list[int]]) -> ndarray [n, hidden]``
            (:class:`~tiny_mindie.model.ort.encoder_ort.EncoderSession`).
        max_batch_tokens: the most tokens one run takes (a bigger job runs alone).
    """

    def __init__(self, session, max_batch_tokens: int = 16384) -> None:
        self.session, self.max_batch_tokens = session, max_batch_tokens
        self.stats = EmbedderStats()
        self._pending = 0                    # jobs submitted and not answered yet
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="embedder", daemon=True)
        self._thread.start()

    def submit(self, ids: list[list[int]]) -> Future:
        """A future of the pooled vectors (float32 ``[len(ids), hidden]``) of the texts' ids;
        its exception is the encoder's ``ValueError`` for ids it refuses."""
        fut: Future = Future()
        with self._lock:
            self._pending += 1
        fut.add_done_callback(self._answered)
        self._jobs.put((ids, fut))
        return fut

    def _answered(self, fut: Future) -> None:
        with self._lock:
            self._pending -= 1

    @property
    def model(self):
        """The :class:`~tiny_mindie.model.encoder_load.EncoderModel` the session runs."""
        return self.session.model

    @property
    def name(self) -> str:
        """The model's name (``/v1/models``, the ``model`` field)."""
        return self.session.model.config.name

    @property
    def alive(self) -> bool:
        """The batching thread is running."""
        return self._thread.is_alive()

    @property
    def pending(self) -> int:
        """Jobs waiting or running."""
        return self._pending

    def idle(self) -> bool:
        """No job waiting or running."""
        return self._pending == 0

    def close(self) -> None:
        """Stop the thread once the jobs queued are done."""
        self._jobs.put(None)
        self._thread.join()

    def _take(self) -> list | None:
        first = self._jobs.get()
        if first is None:
            return None
        jobs, tokens = [first], sum(len(i) for i in first[0])
        while tokens < self.max_batch_tokens:
            try:
                nxt = self._jobs.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                self._jobs.put(None)
                break
            jobs.append(nxt)
            tokens += sum(len(i) for i in nxt[0])
        return jobs

    def _run(self) -> None:
        while (jobs := self._take()) is not None:
            texts = [ids for job, _ in jobs for ids in job]
            t0 = time.perf_counter()
            try:
                vectors = self.session.encode(texts)
            except ValueError:                    # one job's ids: run each alone
                for job, fut in jobs:
                    self._one(job, fut)
                continue
            except Exception as exc:              # noqa: BLE001  the clients get it; go on
                for _, fut in jobs:
                    fut.set_exception(exc)
                continue
            self._count(jobs, texts, time.perf_counter() - t0)
            start = 0
            for job, fut in jobs:
                fut.set_result(vectors[start:start + len(job)])
                start += len(job)

    def _one(self, job: list[list[int]], fut: Future) -> None:
        t0 = time.perf_counter()
        try:
            fut.set_result(self.session.encode(job))
        except ValueError as exc:
            fut.set_exception(exc)
            return
        self._count([(job, fut)], job, time.perf_counter() - t0)

    def _count(self, jobs: list, texts: list, seconds: float) -> None:
        s = self.stats
        s.requests += len(jobs)
        s.inputs += len(texts)
        s.tokens += sum(len(t) for t in texts)
        s.batches += 1
        s.seconds += seconds
        s.batch_sizes = (s.batch_sizes + [len(texts)])[-1000:]
        s.size_counts[bisect.bisect_left(BATCH_BUCKETS, len(texts))] += 1
