"""A server's life after its configuration is read: listen at once, load the model, serve, drain.

1. The listeners are bound first (a busy port fails before anything slow) and accept at once:
   while the model is pulled or loaded, ``/v2/health/live`` answers 200 and every other route
   503 ``The model is loading: <the load's last progress line>`` (:class:`~.app.Loading`).
2. The model loads on a thread of its own; when it is in, the banner says ``ready in N s``. A
   load that fails ends the process with its one-line error (the caller's ``main`` prints it).
3. ``SIGTERM`` or ``SIGINT`` starts a graceful stop, as ``/stopService`` does: no new requests
   (503, so a proxy retries them elsewhere), readiness 503, liveness still 200; the queued
   requests no free slot takes get that 503 at once; the running ones may finish for
   ``ServerConfig.drainTimeout`` seconds, then what is left is cancelled.
   A second signal cancels at once. Either way the process exits with status 0. A signal while
   the model is still loading exits at once (status 0): there is nothing to drain.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import ssl
import sys
import threading
import time
from collections.abc import Callable

from .._version import __version__
from ..config.load import Config

log = logging.getLogger("tiny_mindie")

EXAMPLE_BODY = ('{"inputs": "My name is Olivier and I", "stream": false, '
                '"parameters": {"temperature": 0.5, "top_k": 10, "top_p": 0.95, '
                '"max_new_tokens": 20, "do_sample": true, "details": true}}')
EMBEDDING_EXAMPLE_BODY = '{"input": ["What is a KV cache?"]}'
#: Seconds a forced stop waits for the cancelled requests' handlers to write their last words.
FORCE_WAIT_S = 5.0


def run_server(cfg: Config, ssl_ctx: ssl.SSLContext | None, files, t0: float,
               say: Callable[[str], None], *, log_bodies: bool = False) -> int:
    """Run the server until it is stopped; returns the exit status (0).

    Args:
        cfg: the configuration; ``ssl_ctx`` its server TLS context (``None``: plain HTTP);
            ``files`` its TLS files (for the banner), or ``None``.
        t0: ``time.monotonic()`` at the start of the command (the banner's "ready in").
        say: where the banner and the progress lines go.
        log_bodies: access records carry request bodies and outputs (``--log-requests``).

    Raises:
        ModelFileError: a model path that is missing, a directory or not a GGUF file (before
            the listeners are bound: :func:`check_model_files`); the model cannot be pulled or
            loaded, or the draft's vocabulary is not the model's (after the listeners are
            closed).
        AddressError, OSError: a listen address cannot be bound.
    """
    from .app import App
    from .shutdown import ShutdownControl

    check_model_files(cfg)
    ctl = ShutdownControl()
    app = App(cfg, shutdown=ctl, echo=say)
    app.router.log_bodies = log_bodies
    try:
        import uvloop  # optional: a faster event loop when installed
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    run(_main(app, ctl, cfg, ssl_ctx, files, t0, say))
    return 0


def check_model_files(cfg: Config) -> None:
    """Before anything is bound or loaded: the model and the draft model, when they are paths,
    must be GGUF files (not missing, not a directory, starting with the GGUF magic); a name
    must be the registry's (:func:`~.model.registry.check_model`). Their vocabularies are
    compared once both are on disk, before either graph is built (``LLM``).

    Raises:
        ModelFileError: one line; the draft's starts ``draft model:``, the embedding model's
            ``embedding model:``.
    """
    from ..model.gguf import ModelFileError
    from ..model.registry.catalog import check_model

    m = cfg.backend.model
    if m.model_weight_path:
        check_model(m.model_weight_path)
    for what, path, task in (("draft model", m.draft_model, "chat"),
                             ("embedding model", m.embedding_model, "embedding")):
        if not path:
            continue
        try:
            check_model(path, task)
            if task == "embedding" and os.path.isfile(path):
                check_encoder_file(path)
        except ModelFileError as exc:
            raise ModelFileError(f"{what}: {exc}") from None


def check_encoder_file(path: str) -> None:
    """A GGUF given as the embedding model must be an encoder (its header alone is read).

    Raises:
        ModelFileError: another architecture (a chat model)."""
    from ..model.gguf import GGUFFile, ModelFileError

    arch = GGUFFile(path).architecture
    if arch != "nomic-bert":
        raise ModelFileError(f"{path}: architecture {arch!r} is a chat model, not an "
                             "embedding model (give it as --model)")


async def _main(app, ctl, cfg: Config, ssl_ctx, files, t0: float, say) -> None:
    from .app import start_configured_listeners

    listeners = await start_configured_listeners(app, cfg, ssl_ctx)
    say(listening(cfg, listeners, files))
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        forced = ctl.signal()
        if app.loading is not None:
            say(f"{sig.name}: stopping while the model loads")
        elif forced:
            say(f"{sig.name} again: cancelling the requests in flight")
        else:
            say(f"{sig.name}: stopping; no new requests, the ones in flight may finish "
                f"within {cfg.server.drain_timeout:g} s (another signal cancels them)")

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)

    load = _start_load(loop, cfg, app.loading.log)
    stop = asyncio.ensure_future(ctl.requested.wait())
    await asyncio.wait({load, stop}, return_when=asyncio.FIRST_COMPLETED)
    if not load.done():
        # Stopped while loading: nothing to drain, and a load (a pull, a graph build) cannot be
        # interrupted -- leave without waiting for it.
        for lst in listeners:
            lst.server.close()
        say("stopped before the model was loaded")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if load.exception() is not None:
        stop.cancel()
        for lst in listeners:
            lst.server.close()
        raise load.exception()
    llm, embedder = load.result()
    app.loaded(llm, embedder)
    if llm is not None:
        ctl.serving(llm.engine, app.requests)
        threading.Thread(target=_prepare_constraints, args=(llm,), daemon=True,
                         name="tiny_mindie-grammar-vocabulary").start()
    say(banner(cfg, llm, listeners, files, time.monotonic() - t0, embedder))
    await stop
    if not ctl.signals:       # /stopService (a signal has said it already)
        say("stopping: " + ("cancelling the requests in flight" if ctl.force else
                            "no new requests; letting the ones in flight finish within "
                            f"{cfg.server.drain_timeout:g} s"))
    await ctl.drain(force_wait_s=FORCE_WAIT_S, graceful_s=cfg.server.drain_timeout,
                    idle=embedder.idle if embedder is not None else None)
    await asyncio.sleep(0.2)   # the last answers (/stopService's too) reach their sockets
    say("shutting down")
    for lst in listeners:
        lst.server.close()
    if llm is not None:
        llm.close()


def _start_load(loop: asyncio.AbstractEventLoop, cfg: Config,
                log_line: Callable[[str], None]) -> asyncio.Future:
    """Load the models of ``cfg`` on a thread of its own; the future (of ``loop``) gets
    ``(LLM or None, Embedder or None)`` or the load's exception."""
    load: asyncio.Future = loop.create_future()

    def load_model() -> None:
        m = cfg.backend.model
        try:
            embedder = load_embedder(cfg, log_line) if m.embedding_model else None
            llm = load_llm(cfg, log_line) if m.model_weight_path else None
        except BaseException as exc:       # noqa: BLE001  handed to the event loop
            loop.call_soon_threadsafe(_settle, load, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, load, (llm, embedder), None)

    threading.Thread(target=load_model, daemon=True, name="tiny_mindie-load").start()
    return load


def _settle(fut: asyncio.Future, result, exc: BaseException | None) -> None:
    """The load's outcome, on the event loop."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def load_llm(cfg: Config, log_line: Callable[[str], None]):
    """The model of ``cfg`` (an :class:`~.llm.LLM`), pulled if needed, loaded, its engine
    started; progress lines to ``log_line``. The settings that go to the ``LLM`` as they are
    name their keyword in :data:`~.settings.SETTINGS` (``llm``); the rest are derived here.
    Of them the backend's options (:class:`~.model.options.BackendOptions`) and the engine's
    limits are made here, once (:func:`~.llm.resolve_settings`), and passed down.
    Raises what :class:`~.llm.LLM` raises."""
    from ..config.settings import SETTINGS
    from ..engine.scheduler import SchedulerLimits
    from ..llm import LLM, resolve_settings

    b, sc = cfg.backend, cfg.backend.schedule
    given = {s.llm: cfg.value(s) for s in SETTINGS if s.llm}
    options, limits, own = resolve_settings(dict(
        given, max_input_len=cfg.max_input_len, device_id=b.npu_device_ids[0],
        providers=tuple(b.execution_providers), schedule=SchedulerLimits(
            max_batch_size=sc.max_batch_size,
            max_prefill_batch_size=sc.max_prefill_batch_size,
            max_prefill_tokens=min(sc.max_prefill_tokens, sc.prefill_chunk_size))))
    return LLM(b.model.model_weight_path, options=options, limits=limits, log=log_line, **own)


def load_embedder(cfg: Config, log_line: Callable[[str], None]):
    """The embedding model of ``cfg`` (``embeddingModelPath``), pulled if needed, loaded into
    its onnxruntime session (``intraOpThreads`` threads; the ``graph`` flavour and providers
    the chat model gets, :func:`~.model.providers.graph_flavour`) and its batching thread
    started: an :class:`~.engine.embedder.Embedder`.

    Raises:
        ModelFileError: the model cannot be had or is not an embedding model (one line,
            ``embedding model: ...``)."""
    from ..engine.embedder import Embedder
    from ..model.encoder_load import load_encoder
    from ..model.gguf import ModelFileError
    from ..model.ort.encoder_ort import EncoderSession
    from ..model.ort.providers import graph_flavour, select_providers
    from ..model.registry.catalog import lookup, resolve

    b = cfg.backend
    chosen = select_providers(list(b.execution_providers) or None, b.npu_device_ids[0])
    flavour = graph_flavour(b.graph, chosen)
    spec = cfg.backend.model.embedding_model
    try:
        path = resolve(spec, log=log_line, task="embedding")
        known = lookup(spec)
        name = known.name if known else os.path.splitext(
            os.path.basename(os.path.normpath(spec)))[0]
        log_line(f"loading the embedding model {name} ({flavour} graph)")
        model = load_encoder(path, name)
    except ModelFileError as exc:
        raise ModelFileError(f"embedding model: {exc}") from None
    return Embedder(EncoderSession(model, threads=b.intra_op_threads, flavour=flavour,
                                   providers=chosen))


def _prepare_constraints(llm) -> None:
    """Build the grammar engine's vocabulary now (:func:`~.engine.constraint.prepare`), so
    that the first request with ``response_format``, ``tools`` or ``grammar`` does not stall
    every other client while it is built."""
    from ..engine.constraint import prepare

    try:
        seconds = prepare(llm.tokenizer)
    except Exception:       # a vocabulary llguidance refuses: the first such request says so
        log.exception("building the grammar vocabulary failed")
        return
    log.info("constrained decoding ready (grammar vocabulary built in %.1f s)", seconds)


# ---- what the server says ----------------------------------------------------------------
def _threads(backend) -> str:
    """`` (1 thread x 2 parallel runs)`` for backends that have intra-op threads."""
    threads, runs = getattr(backend, "threads", None), getattr(backend, "parallel_runs", 1)
    if not threads:
        return ""
    return f" ({threads} thread{'s' if threads > 1 else ''}" + (
        f" x {runs} parallel runs)" if runs > 1 else ")")


def _listener_lines(listeners, files) -> list[str]:
    from ..server.routing import HEALTH

    lines = []
    for lst in listeners:
        if lst.planes == {HEALTH}:
            lines.append(f"  health   http://{_hostport(lst.host, lst.bound_port)}  "
                         "(GET /health, /v2/health/live, /v2/health/ready; plain HTTP)")
            continue
        line = (f"  listens  {'https' if files else 'http'}://"
                f"{_hostport(lst.host, lst.bound_port)}  ({', '.join(sorted(lst.planes))})")
        bound = lst.bound_addresses
        if bound != [lst.host]:      # a host name: the addresses it resolved to
            line += f"  bound to {', '.join(_hostport(a, lst.bound_port) for a in bound)}"
        lines.append(line)
    return lines


def listening(cfg: Config, listeners, files) -> str:
    """The first lines, said as soon as the listeners are bound (the model not loaded yet)."""
    m = cfg.backend.model
    names = " and ".join(filter(None, (m.model_weight_path and f"the model {m.model_name}",
                                       m.embedding_model and f"the embedding model "
                                                             f"{m.embedding_model}")))
    return "\n".join([f"tiny_mindie {__version__} listening; loading "
                      f"{names} (/v2/health/live answers 200, the other "
                      "routes 503 until it is ready)", *_listener_lines(listeners, files)])


def banner(cfg: Config, llm, listeners, files, startup_s: float, embedder=None) -> str:
    """The banner said when the models are in: the chat model (``llm``, or ``None``) and the
    embedding model (``embedder``, or ``None``), backend, listeners, TLS files, a curl."""
    scheme = "https" if files else "http"
    lines = [f"tiny_mindie {__version__} ready in {startup_s:.1f} s",
             *(_model_lines(cfg, llm) if llm is not None else []),
             *_embedding_lines(embedder),
             *_listener_lines(listeners, files)]
    business = next(lst for lst in listeners if "business" in lst.planes)
    base = f"{scheme}://{_hostport(_reachable(cfg.server.ip_address), business.bound_port)}"
    path, body = ("/infer", EXAMPLE_BODY) if llm is not None else (
        "/v1/embeddings", EMBEDDING_EXAMPLE_BODY)
    tls = ""
    if files:
        lines.append(f"  mTLS     CA {files.ca[0]}")
        lines.append(f"           client certificate {files.client_cert}")
        lines.append(f"           client key {files.client_key}")
        tls = f"--cacert {files.ca[0]} --cert {files.client_cert} --key {files.client_key} "
    lines.append("try it:")
    lines.append(f"  curl -H 'Content-Type: application/json' {tls}-X POST \\\n"
                 f"    -d '{body}' \\\n    {base}{path}")
    return "\n".join(lines + (_chat_lines(cfg, base, files) if llm is not None else []))


def _model_lines(cfg: Config, llm) -> list[str]:
    """The banner's lines for the chat model: its file, KV slots, backend, kernels, draft."""
    return [f"  model    {llm.model_name} ({os.path.basename(llm.model_path)}, "
            f"{llm.config.architecture}, {llm.backend.num_slots} KV slots x "
            f"{llm.backend.max_seq_len} tokens)",
            f"  backend  {llm.backend.name} on {llm.backend.device}{_threads(llm.backend)}"
            + (f", {llm.backend.graph} graph, {cfg.backend.weights} weights"
               if llm.backend.name == "onnxruntime" else ""),
            *([f"  kernels  {llm.backend.kernels}"] if getattr(llm.backend, "kernels", None)
              else []),
            *_draft_lines(llm.draft)]


def _embedding_lines(embedder) -> list[str]:
    """The banner's line for the embedding model; none without one."""
    if embedder is None:
        return []
    c = embedder.model.config
    return [f"  embed    {c.name} ({os.path.basename(embedder.model.path)}, {c.arch}, "
            f"{c.hidden} dimensions, {c.context} tokens; POST /v1/embeddings, /embed, "
            "/embedding)"]


def _chat_lines(cfg: Config, base: str, files) -> list[str]:
    """The banner's lines for the chat page (unless ``--no-webui``) and the chat command."""
    config = f" --config {cfg.source}" if cfg.source else ""
    lines = [f"  chat     python -m tiny_mindie chat --url {base}{config}"]
    if cfg.server.webui:
        lines.insert(0, f"  page     {base}/" + (
            "   (a browser needs the client certificate: python -m tiny_mindie certs --p12 "
            f"FILE{config})" if files else ""))
    return lines


def _draft_lines(draft) -> list[str]:
    """The banner's line for a draft model: its file, slots and memory; none without one."""
    if draft is None:
        return []
    return [f"  draft    {os.path.basename(draft.path)} proposes tokens for speculative "
            f"decoding ({draft.backend.num_slots} KV slots, "
            f"{draft.resident_bytes / 1e6:.0f} MB of memory)"]


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reachable(host: str) -> str:
    """An address of this machine a client can connect to for a listen address: the loopback
    one for a wildcard (0.0.0.0, ::)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
