"""``GET /metrics``: Prometheus text exposition (format 0.0.4), written by hand; and
:class:`RequestCounters`, the HTTP requests to generation routes, which the route wrapper
(:func:`tiny_mindie.api.drive.serve`) counts by the outcome their request record holds
(:mod:`tiny_mindie.server.routing`).

Series are MindIE's (spec §4, ``prometheus_metrics.cpp``) under the prefix ``tiny_mindie_``
(vLLM's ``vllm:`` style, with ``_`` instead of the ``:`` that Prometheus reserves for
recording rules, so that ``promtool check metrics`` passes), each with MindIE's ``model_name``
label:

=====================================================  =========  =================================
series                                                 type       meaning
=====================================================  =========  =================================
``tiny_mindie_request_received_total``                 counter    requests to generation routes
``tiny_mindie_request_success_total``                  counter    ... answered in full
``tiny_mindie_request_failed_total{reason=...}``       counter    ... failed: validation, too_long,
                                                                  timeout, cancelled, stopped,
                                                                  internal
``tiny_mindie_num_requests_running``                   gauge      sequences in the running batch
``tiny_mindie_num_requests_waiting``                   gauge      requests waiting for a KV slot
``tiny_mindie_prompt_tokens_total``                    counter    prompt tokens prefilled
``tiny_mindie_generation_tokens_total``                counter    tokens generated
``tiny_mindie_time_to_first_token_seconds``            histogram  submission to first token
``tiny_mindie_time_per_output_token_seconds``          histogram  between two tokens of a request
``tiny_mindie_e2e_request_latency_seconds``            histogram  submission to last token
                                                                  (completed requests)
``tiny_mindie_npu_cache_usage_perc``                   gauge      fraction of KV slots in use
                                                                  (0..1; the device may be a CPU)
``tiny_mindie_npu_prefix_cache_hit_rate``              gauge      fraction of admitted prompt
                                                                  tokens whose KV came from the
                                                                  prefix cache (0..1)
``tiny_mindie_prefix_cache_hit_tokens_total``          counter    ... those tokens
``tiny_mindie_prefix_cache_miss_tokens_total``         counter    ... the prompt tokens prefilled
``tiny_mindie_spec_decode_num_draft_tokens_total``     counter    tokens proposed by speculative
                                                                  decoding and verified, from
                                                                  both sources (prompt lookup
                                                                  and the draft model)
``tiny_mindie_spec_decode_num_accepted_tokens_total``  counter    ... those of them kept
``tiny_mindie_spec_decode_draft_model_tokens_total``   counter    the draft model's part of
                                                                  ``..._num_draft_tokens_total``
                                                                  (``--draft-model``)
``..._draft_model_accepted_tokens_total``              counter    ... those of them kept (part
                                                                  of ``..._num_accepted_...``)
``..._draft_model_seconds_total``                      counter    seconds the draft model ran
                                                                  (its share of the time: the
                                                                  rate of this series)
=====================================================  =========  =================================

With an embedding model (``--embedding-model``), its series, labelled with its name:

=====================================================  =========  =================================
``tiny_mindie_embedding_requests_total``               counter    embedding requests answered
``tiny_mindie_embedding_inputs_total``                 counter    ... their inputs (texts)
``tiny_mindie_embedding_tokens_total``                 counter    ... their tokens encoded
``tiny_mindie_embedding_batch_size``                   histogram  inputs per encoder run (its
                                                                  ``_count``: the runs)
``tiny_mindie_embedding_seconds_total``                counter    seconds the encoder ran
``tiny_mindie_embedding_num_requests_pending``         gauge      embedding requests waiting or
                                                                  running
=====================================================  =========  =================================

A server of an embedding model alone has only these (and the ``process_*`` series).

Token counters and histograms cover everything the engine runs (``/health/timed-N`` probes
included); the request counters cover HTTP requests to generation routes only, one count per
request (an OpenAI request with ``n=2`` is one request).

Then the standard ``process_*`` series of the server process (``process_cpu_seconds_total``,
``process_resident_memory_bytes``, ``process_virtual_memory_bytes``, ``process_open_fds``,
``process_max_fds``, ``process_start_time_seconds``), from prometheus_client's
``ProcessCollector``, which reads ``/proc``: on systems without it (macOS, Windows) there are
none.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest

from ..engine.counters import EngineCounters
from ..server.conn import Response, ResponseStream
from ..server.http import Request
from ..server.routing import METRICS, OUTCOMES, SUCCESS, Route

#: The ``reason`` label of ``request_failed_total``: every outcome of a request but success
#: (:data:`~tiny_mindie.server.routing.OUTCOMES`).
FAIL_REASONS = OUTCOMES[1:]

PREFIX = "tiny_mindie_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# The process_* series: a registry of their own (not prometheus_client's global one, which
# would also carry its python_gc_* / python_info series).
_PROCESS = CollectorRegistry(auto_describe=False)
ProcessCollector(registry=_PROCESS)


class RequestCounters:
    """The HTTP requests to generation routes, counted once each: received on arrival, then
    one outcome when the request ends -- ``success`` or a reason of :data:`FAIL_REASONS`, the
    same word as in its access record. Every method is safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.received = 0
        self.success = 0
        self.failed = dict.fromkeys(FAIL_REASONS, 0)

    def request_received(self) -> None:
        with self._lock:
            self.received += 1

    def request_done(self, outcome: str) -> None:
        """Count a request's outcome: ``"success"`` or a reason of :data:`FAIL_REASONS`.

        Raises:
            KeyError: ``outcome`` is neither.
        """
        with self._lock:
            if outcome == SUCCESS:
                self.success += 1
            else:
                self.failed[outcome] += 1

    @property
    def in_flight(self) -> int:
        """Requests received whose outcome is not counted yet."""
        with self._lock:
            return self.received - self.success - sum(self.failed.values())

    def snapshot(self) -> dict:
        """``{"received": int, "success": int, "failed": {reason: int}}``, consistent."""
        with self._lock:
            return {"received": self.received, "success": self.success,
                    "failed": dict(self.failed)}


# ---- exposition ---------------------------------------------------------------------------
def _label_value(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    return repr(float(v)) if isinstance(v, float) else str(v)


class _Exposition:
    """The lines of the exposition, each sample labelled with the model's name."""

    def __init__(self, model_name: str):
        self.label = f'model_name="{_label_value(model_name)}"'
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_: str) -> str:
        full = PREFIX + name
        self.lines.append(f"# HELP {full} {help_}")
        self.lines.append(f"# TYPE {full} {kind}")
        return full

    def simple(self, name: str, kind: str, help_: str, value) -> None:
        self.lines.append(f"{self.family(name, kind, help_)}{{{self.label}}} {_num(value)}")

    def histogram(self, name: str, help_: str, data) -> None:
        full = self.family(name, "histogram", help_)
        buckets, total, count = data
        for bound, n in buckets:
            self.lines.append(f'{full}_bucket{{{self.label},le="{_num(float(bound))}"}} {n}')
        self.lines.append(f"{full}_sum{{{self.label}}} {_num(float(total))}")
        self.lines.append(f"{full}_count{{{self.label}}} {count}")


def render(counters: EngineCounters | None, stats: dict | None, model_name: str,
           embedder=None, requests: RequestCounters | None = None) -> str:
    """The exposition text of the engine's ``counters`` and ``stats()`` (``None``: no chat
    model) with the ``requests`` counted (``None``: none), the embedding series of
    ``embedder`` (an :class:`~tiny_mindie.engine.embedder.Embedder`, or ``None``), then the
    ``process_*`` series of this process."""
    out = _Exposition(model_name)
    if counters is not None:
        snap = counters.snapshot()
        _requests(out, (requests or RequestCounters()).snapshot(), stats)
        _tokens(out, snap)
        _caches(out, snap, stats)
    if embedder is not None:
        out.lines += _embeddings(embedder)
    return "\n".join(out.lines) + "\n" + generate_latest(_PROCESS).decode("utf-8")


def _embeddings(embedder) -> list[str]:
    """The embedding model's series, labelled with its name."""
    out, s = _Exposition(embedder.name), embedder.stats
    out.simple("embedding_requests_total", "counter", "Number of embedding requests answered.",
               s.requests)
    out.simple("embedding_inputs_total", "counter",
               "Number of inputs (texts) of the embedding requests answered.", s.inputs)
    out.simple("embedding_tokens_total", "counter", "Number of tokens the embedding model "
               "encoded.", s.tokens)
    out.histogram("embedding_batch_size", "Histogram of the inputs per run of the embedding "
                  "model (requests of all clients batched together).", s.histogram())
    out.simple("embedding_seconds_total", "counter", "Seconds the embedding model ran.",
               s.seconds)
    out.simple("embedding_num_requests_pending", "gauge",
               "Number of embedding requests waiting or running.", embedder.pending)
    return out.lines


def _requests(out: _Exposition, snap: dict, stats: dict) -> None:
    """The request counters (a :meth:`RequestCounters.snapshot`) and the engine's running
    and waiting gauges."""
    out.simple("request_received_total", "counter", "Count of received requests.",
               snap["received"])
    out.simple("request_success_total", "counter", "Count of successfully processed requests.",
               snap["success"])
    full = out.family("request_failed_total", "counter", "Count of failed requests, by reason.")
    for reason, n in snap["failed"].items():
        out.lines.append(f'{full}{{{out.label},reason="{reason}"}} {n}')
    out.simple("num_requests_running", "gauge", "Number of requests in the running batch.",
               stats["running"])
    out.simple("num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
               stats["waiting"])


def _tokens(out: _Exposition, snap: dict) -> None:
    """The token counters and the latency histograms."""
    out.simple("prompt_tokens_total", "counter", "Number of prefill tokens processed.",
               snap["prompt_tokens"])
    out.simple("generation_tokens_total", "counter", "Number of generation tokens processed.",
               snap["generation_tokens"])
    out.histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                  snap["ttft"])
    out.histogram("time_per_output_token_seconds",
                  "Histogram of time per output token in seconds.", snap["tpot"])
    out.histogram("e2e_request_latency_seconds",
                  "Histogram of end to end latency of completed requests in seconds.",
                  snap["e2e"])


def _caches(out: _Exposition, snap: dict, stats: dict) -> None:
    """KV-cache use, the prefix cache and speculative decoding."""
    total = stats["total_slots"]
    out.simple("npu_cache_usage_perc", "gauge",
               "KV-cache usage: fraction of KV slots in use. 1 means 100 percent usage.",
               (total - stats["free_slots"]) / total if total else 0.0)
    hits, misses = snap["prefix_hit_tokens"], snap["prefix_miss_tokens"]
    out.simple("npu_prefix_cache_hit_rate", "gauge",
               "Prefix cache hit rate: fraction of prompt tokens whose KV was reused.",
               hits / (hits + misses) if hits + misses else 0.0)
    out.simple("prefix_cache_hit_tokens_total", "counter",
               "Number of prompt tokens whose KV came from the prefix cache.", hits)
    out.simple("prefix_cache_miss_tokens_total", "counter",
               "Number of prompt tokens prefilled (not in the prefix cache).", misses)
    out.simple("spec_decode_num_draft_tokens_total", "counter",
               "Number of tokens proposed by speculative decoding and verified, from both "
               "sources: prompt lookup and the draft model (whose part is "
               f"{PREFIX}spec_decode_draft_model_tokens_total).",
               snap["spec_proposed_tokens"])
    out.simple("spec_decode_num_accepted_tokens_total", "counter",
               "Number of proposed tokens that verification kept, from both sources: prompt "
               "lookup and the draft model (whose part is "
               f"{PREFIX}spec_decode_draft_model_accepted_tokens_total).",
               snap["spec_accepted_tokens"])
    out.simple("spec_decode_draft_model_tokens_total", "counter",
               "Number of tokens proposed by the draft model and verified: a part of "
               f"{PREFIX}spec_decode_num_draft_tokens_total, not in addition to it.",
               snap["spec_draft_proposed_tokens"])
    out.simple("spec_decode_draft_model_accepted_tokens_total", "counter",
               "Number of the draft model's proposed tokens that verification kept: a part "
               f"of {PREFIX}spec_decode_num_accepted_tokens_total, not in addition to it.",
               snap["spec_draft_accepted_tokens"])
    out.simple("spec_decode_draft_model_seconds_total", "counter",
               "Seconds spent running the draft model.", stats["draft_seconds"])


def routes(app) -> list[Route]:
    async def metrics_route(req: Request, stream: ResponseStream, params: dict) -> Response:
        llm = app.chat_model
        if llm is None:
            text = render(None, None, "", app.embedder)
        else:
            text = render(llm.engine.counters, llm.engine.stats(), llm.model_name, app.embedder,
                          app.requests)
        return Response(200, text.encode("utf-8"), CONTENT_TYPE)

    return [Route("GET", "/metrics", METRICS, metrics_route)]
