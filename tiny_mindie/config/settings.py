"""Every setting of the server, defined once: its ``config.json`` key, type, default, allowed
values, command-line flag (and so its ``TINY_MINDIE_*`` variable), the ``LLM`` keyword it feeds
and its help text.

From :data:`SETTINGS` come the configuration dataclasses and the file's reader and checks
(:mod:`.load`), the ``serve`` flags (:func:`add_flags`), their variables (:mod:`.env` derives
one per flag), the flags' overrides of a file (:func:`flag_overrides`) and the reference
``docs/configuration.md`` (``python scripts/configuration_doc.py > docs/configuration.md``).

The keys are MindIE Service's where MindIE has them (spec §6); ``ours=True`` marks the keys that
are tiny_mindie's own. This module imports nothing heavy: the health probe builds flags from it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..model import BACKENDS, DEFAULT_BACKEND, GRAPH_FLAVOURS, KERNEL_MODES, WEIGHT_MODES
from ..model import STANDARD_DTYPES as DTYPES
from .env import FROM_ENV
from .errors import ConfigError

#: Attribute path in :class:`~.load.Config` of each group of settings.
GROUPS = {"server": "server", "model": "backend.model", "schedule": "backend.schedule",
          "backend": "backend"}

#: Python type of each kind (the dataclass annotation). ``port``: an int in 1024..65535 or 0;
#: ``host``: an IP literal or a host name; ``strings``: a JSON list of strings.
ANNOTATIONS = {"int": "int", "port": "int", "float": "float", "str": "str", "host": "str",
               "bool": "bool", "strings": "tuple[str, ...]", "device ids": "tuple[int, ...]",
               "providers": "tuple"}


@dataclass(frozen=True)
class Flag:
    """A command-line flag of a setting. ``sets``: for a switch (no value), the setting's value it
    sets; ``None``: the flag takes a value of the setting's kind. ``also``: more overrides the
    flag's value implies, ``(config read from the file, value) -> {attr: value}``; a flag that
    names one of those settings itself wins."""

    name: str
    help: str
    sets: bool | None = None
    also: Callable[[Any, Any], dict] | None = None


@dataclass(frozen=True)
class Setting:
    """One setting. ``attr``: ``group.field`` (a :meth:`~.config.Config.with_overrides` key);
    ``key``: its full ``config.json`` key; ``low``/``high``: the inclusive range of a number
    (``unit`` says in what); ``default_from``: the attr whose file value is the default when
    the key is absent; ``llm``: the :class:`~.llm.LLM` keyword the value is passed as."""

    attr: str
    key: str
    kind: str
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    unit: str = ""
    choices: tuple = ()
    flags: tuple[Flag, ...] = ()
    ours: bool = False
    default_from: str | None = None
    llm: str | None = None

    @property
    def group(self) -> str:
        return self.attr.partition(".")[0]

    @property
    def name(self) -> str:
        """The dataclass field's name."""
        return self.attr.partition(".")[2]

    @property
    def path(self) -> str:
        """Attribute path in a :class:`~.load.Config`, e.g. ``backend.model.max_seq_len``."""
        return f"{GROUPS[self.group]}.{self.name}"

    @property
    def section(self) -> str:
        """Where the key is in the file, e.g. ``BackendConfig.ScheduleConfig``."""
        return self.key.rpartition(".")[0]

    @property
    def leaf(self) -> str:
        """The key's own name in its section, e.g. ``maxBatchSize``."""
        return self.key.rpartition(".")[2]


def _port_moves_planes(cfg, port: int) -> dict:
    """Planes sharing the business listener move with it; ports set apart in the file stay."""
    s = cfg.server
    return {f"server.{p}": port for p in ("management_port", "metrics_port")
            if getattr(s, p) == s.port}


def _model_name_of(cfg, model: str) -> dict:
    """Without a config file, ``--model`` names the model too: its registry name, or the file's
    name without ``.gguf``."""
    if cfg.source is not None:
        return {}
    from ..model.registry.catalog import lookup
    known = lookup(model)
    return {"model.model_name": known.name if known else
            os.path.splitext(os.path.basename(model))[0]}


def _embedding_alone(cfg, model: str) -> dict:
    """Without a config file, ``--embedding-model`` alone serves no chat model (``--model``
    given too serves both)."""
    return {"model.model_weight_path": ""} if cfg.source is None and model else {}


_S, _MD, _MC, _SC, _B = ("ServerConfig", "BackendConfig.ModelDeployConfig",
                    "BackendConfig.ModelDeployConfig.ModelConfig[0]",
                    "BackendConfig.ScheduleConfig", "BackendConfig")
_SEC = " seconds"

SETTINGS: tuple[Setting, ...] = (
    # ---- ServerConfig: listeners, TLS and request limits
    Setting("server.ip_address", f"{_S}.ipAddress", "host", "127.0.0.1",
            "business listen address (an IP literal or a host name; 0.0.0.0 = every address)",
            flags=(Flag("--host", "business listen address (ServerConfig.ipAddress, default "
                                  "127.0.0.1)",
                        also=lambda cfg, host: {"server.management_ip_address": host}),)),
    Setting("server.management_ip_address", f"{_S}.managementIpAddress", "host", "127.0.0.1",
            "management listen address (--host sets it too)"),
    Setting("server.port", f"{_S}.port", "port", 1025, "business port (0 = any free port)",
            flags=(Flag("--port", "business port (ServerConfig.port, default 1025; 0 = any free "
                                  "port)", also=_port_moves_planes),)),
    Setting("server.management_port", f"{_S}.managementPort", "port", 1025,
            "management port; the same as port = one listener for both",
            default_from="server.port",
            flags=(Flag("--management-port", "management port (default: --port)"),)),
    Setting("server.metrics_port", f"{_S}.metricsPort", "port", 1025,
            "metrics port; the same as port = one listener for both",
            default_from="server.port",
            flags=(Flag("--metrics-port", "metrics port (default: --port)"),)),
    Setting("server.max_link_num", f"{_S}.maxLinkNum", "int", 1000,
            "connections open at once (capped by the open files limit)", 1, 4096),
    Setting("server.https_enabled", f"{_S}.httpsEnabled", "bool", True,
            "mutual TLS on the listeners; false = plain HTTP",
            flags=(Flag("--no-tls", "plain HTTP, no TLS (MindIE's httpsEnabled: false); for "
                                    "local development", sets=False),)),
    Setting("server.tls_ca_path", f"{_S}.tlsCaPath", "str", "security/ca/",
            "folder of the CA files (relative to the config home)"),
    Setting("server.tls_ca_files", f"{_S}.tlsCaFile", "strings", ("ca.pem",),
            "CA certificates client certificates are checked against"),
    Setting("server.tls_cert", f"{_S}.tlsCert", "str", "security/certs/server.pem",
            "the server's certificate"),
    Setting("server.tls_pk", f"{_S}.tlsPk", "str", "security/keys/server.key.pem",
            "the server certificate's private key"),
    Setting("server.tls_crl_path", f"{_S}.tlsCrlPath", "str", "security/certs/",
            "folder of the CRL files"),
    Setting("server.tls_crl_files", f"{_S}.tlsCrlFiles", "strings", ("server_crl.pem",),
            "certificate revocation lists; [] = none"),
    Setting("server.token_timeout", f"{_S}.tokenTimeout", "float", 600.0,
            "seconds allowed between two tokens of one request", 0.001, 86400, _SEC,
            llm="token_timeout_s"),
    Setting("server.e2e_timeout", f"{_S}.e2eTimeout", "float", 600.0,
            "seconds allowed for a whole request", 0.001, 86400, _SEC,
            llm="e2e_timeout_s"),
    Setting("server.max_request_length", f"{_S}.maxRequestLength", "int", 1,
            "largest request body, in MB (MindIE's default is 40; see docs/security.md)",
            1, 100, " MB"),
    Setting("server.tls_handshake_timeout", f"{_S}.tlsHandshakeTimeout", "float", 10.0,
            "seconds a new connection has for its TLS handshake", 0.1, 600, _SEC, ours=True),
    Setting("server.max_stream_backlog_kb", f"{_S}.maxStreamBacklogKB", "int", 64,
            "KB a stream's client may leave unread; 0 = no limit", 0, 1 << 20, " KB", ours=True),
    Setting("server.drain_timeout", f"{_S}.drainTimeout", "float", 30.0,
            "seconds a stop (SIGTERM, SIGINT, /stopService) lets the requests in flight finish",
            0.0, 86400, _SEC, ours=True,
            flags=(Flag("--drain-timeout", "seconds SIGTERM/SIGINT let the requests in flight "
                                           "finish before the rest are cancelled "
                                           "(ServerConfig.drainTimeout, default 30)"),)),
    Setting("server.keep_alive_timeout", f"{_S}.keepAliveTimeout", "float", 65.0,
            "seconds a kept-alive connection may sit idle between two requests",
            0.1, 86400, _SEC, ours=True),
    Setting("server.header_timeout", f"{_S}.headerTimeout", "float", 60.0,
            "seconds a request's header section may take, counted from its first byte",
            0.1, 600, _SEC, ours=True),
    Setting("server.health_port", f"{_S}.healthPort", "port", 0,
            "plain-HTTP listener for the health routes only; 0 = none", ours=True,
            flags=(Flag("--health-port", "plain-HTTP port serving only the health routes, for "
                                         "probes that have no client certificate "
                                         "(ServerConfig.healthPort; default 0 = none)"),)),
    Setting("server.health_ip_address", f"{_S}.healthIpAddress", "host", "127.0.0.1",
            "listen address of the health listener", ours=True),
    Setting("server.webui", f"{_S}.webUI", "bool", True,
            "the chat page at GET / of the business port (docs/chat.md)", ours=True,
            flags=(Flag("--no-webui", "no chat page at GET / (ServerConfig.webUI: false)",
                        sets=False),)),
    # ---- BackendConfig.ModelDeployConfig: sequence limits (tokens) and the model
    Setting("model.max_seq_len", f"{_MD}.maxSeqLen", "int", 2560,
            "prompt + output tokens per sequence", 2, 1 << 20, " tokens", llm="max_seq_len",
            flags=(Flag("--max-seq-len", "prompt + output tokens per sequence (maxSeqLen, "
                                         "default 2560)",
                        also=lambda cfg, n: {"model.max_input_token_len": min(
                            cfg.backend.model.max_input_token_len, n - 1)}),)),
    Setting("model.max_input_token_len", f"{_MD}.maxInputTokenLen", "int", 2048,
            "prompt tokens per request; the limit used is min(maxInputTokenLen, maxSeqLen - 1)",
            1, 1 << 20, " tokens"),
    Setting("model.truncation", f"{_MD}.truncation", "bool", False,
            "MindIE's key; read, checked and reported by the management API"),
    Setting("model.parse_special_tokens", f"{_MD}.parseSpecialTokens", "bool", True,
            "raw prompts' special tokens (<|im_start|> etc.) become their token ids", ours=True,
            llm="parse_special_tokens"),
    Setting("model.model_name", f"{_MC}.modelName", "str", "smollm2-135m-instruct",
            "the name clients use for the model", llm="model_name",
            flags=(Flag("--model-name", "name clients use for the model (ModelConfig.modelName; "
                                        "default: the registry name or the file name)"),)),
    Setting("model.model_weight_path", f"{_MC}.modelWeightPath", "str", "smollm2-135m-instruct",
            "a .gguf file or a registry name (python -m tiny_mindie list-models); empty: no "
            "chat model (with embeddingModelPath only)",
            flags=(Flag("--model", "a .gguf file or a registry name (see list-models); default "
                                   "smollm2-135m-instruct, pulled on first start",
                        also=_model_name_of),)),
    Setting("model.draft_model", f"{_MC}.draftModelPath", "str", "",
            "a smaller model with the same vocabulary (a .gguf file or a registry name) that "
            "proposes tokens for speculative decoding; empty: prompt lookup alone",
            ours=True, llm="draft_model",
            flags=(Flag("--draft-model", "a draft model (a .gguf file or a registry name) with "
                                         "the model's vocabulary, proposing tokens the model "
                                         "verifies; the answers stay the same (ModelConfig."
                                         "draftModelPath; default none)"),)),
    Setting("model.embedding_model", f"{_MC}.embeddingModelPath", "str", "",
            "an embedding model served beside the chat model (a .gguf file, a "
            "sentence-transformers folder or a registry name; docs/embeddings.md); empty: none. "
            "With one, modelWeightPath may be empty: no chat model", ours=True,
            flags=(Flag("--embedding-model", "an embedding model (a .gguf file, a "
                                             "sentence-transformers folder or a registry name) "
                                             "served on /v1/embeddings, /embed and /embedding "
                                             "(ModelConfig.embeddingModelPath; default none); "
                                             "without --model or a config file it is served "
                                             "alone",
                        also=_embedding_alone),)),
    # ---- BackendConfig.ScheduleConfig: continuous-batching limits (sequences, tokens)
    Setting("schedule.cache_block_size", f"{_SC}.cacheBlockSize", "int", 128,
            "tokens per KV-cache block, as the management API counts blocks", 1, 4096, " tokens"),
    Setting("schedule.max_prefill_batch_size", f"{_SC}.maxPrefillBatchSize", "int", 50,
            "prompts prefilled in one step; at most maxBatchSize", 1, 5000, " sequences"),
    Setting("schedule.max_prefill_tokens", f"{_SC}.maxPrefillTokens", "int", 8192,
            "prompt tokens prefilled in one step; at least maxInputTokenLen",
            1, 1 << 24, " tokens"),
    Setting("schedule.max_batch_size", f"{_SC}.maxBatchSize", "int", 200,
            "sequences decoded at once", 1, 5000, " sequences"),
    Setting("schedule.max_iter_times", f"{_SC}.maxIterTimes", "int", 512,
            "output tokens per request at most", 1, 1 << 20, " tokens", llm="max_iter_times"),
    Setting("schedule.max_queue_delay_microseconds", f"{_SC}.maxQueueDelayMicroseconds", "int",
            5000, "MindIE's key; read, checked and reported by the management API",
            0, 1_000_000, " microseconds"),
    Setting("schedule.prefill_chunk_size", f"{_SC}.prefillChunkSize", "int", 512,
            "prompt tokens per step, so decode keeps flowing during a long prefill",
            1, 1 << 20, " tokens", ours=True),
    Setting("schedule.prefix_caching", f"{_SC}.prefixCaching", "bool", True,
            "reuse the KV of a prompt prefix seen before", ours=True, llm="prefix_cache",
            flags=(Flag("--no-prefix-cache", "prefill every prompt whole "
                                             "(ScheduleConfig.prefixCaching: false)",
                        sets=False),)),
    Setting("schedule.speculative_decoding", f"{_SC}.speculativeDecoding", "bool", True,
            "tokens proposed by prompt lookup, verified several at a time, losslessly",
            ours=True, llm="speculation",
            flags=(Flag("--speculation", "speculative decoding (the default; ScheduleConfig."
                                         "speculativeDecoding: true over a file's false)",
                        sets=True),
                   Flag("--no-speculation", "one token per decode step, and a graph without the "
                                            "verification path (ScheduleConfig."
                                            "speculativeDecoding: false; by default tokens "
                                            "proposed by prompt lookup are verified several at "
                                            "a time, losslessly, when it pays)", sets=False))),
    # ---- BackendConfig: where and how the model runs
    Setting("backend.npu_device_ids", f"{_B}.npuDeviceIds", "device ids", (0,),
            "device ids, as MindIE's list of lists; the first is used", 0, 1023),
    Setting("backend.backend", f"{_B}.backend", "str", DEFAULT_BACKEND,
            "the model backend; numpy is the reference decoder", choices=BACKENDS, ours=True,
            llm="backend",
            flags=(Flag("--backend", f"model backend (default {DEFAULT_BACKEND}; numpy is the "
                                     "reference decoder)"),)),
    Setting("backend.intra_op_threads", f"{_B}.intraOpThreads", "int", 0,
            "intra-op threads of the backend; 0 = the backend's default", 0, 1024, ours=True,
            llm="threads",
            flags=(Flag("--threads", "intra-op threads of the backend (default 0: the backend's "
                                     "choice)"),)),
    Setting("backend.parallel_runs", f"{_B}.parallelRuns", "int", 0,
            "onnxruntime runs at once, each on its own threads; 0 = CPUs // threads",
            0, 1024, ours=True, llm="parallel_runs",
            flags=(Flag("--parallel-runs", "onnxruntime runs executed at once, each on its own "
                                           "threads (BackendConfig.parallelRuns; default 0 = "
                                           "CPUs // threads)"),)),
    Setting("backend.kv_cache_mb", f"{_B}.kvCacheMB", "int", 1024,
            "KV-cache budget; bounds the running batch", 1, 1 << 20, " MB", ours=True,
            llm="kv_cache_mb"),
    Setting("backend.batch_invariant", f"{_B}.batchInvariant", "bool", True,
            "a row's logits the same alone and in a batch", ours=True, llm="batch_invariant"),
    Setting("backend.weights", f"{_B}.weights", "str", "exact",
            "onnxruntime weights: exact (the GGUF's own) or compact (4-bit blocks of 64; "
            "docs/design/weights.md); compact needs the onnxruntime backend",
            choices=tuple(WEIGHT_MODES), ours=True, llm="weights",
            flags=(Flag("--weights", "onnxruntime weights (BackendConfig.weights): exact, the "
                                     "GGUF's own values (default), or compact, every matrix in "
                                     "4-bit blocks of 64: fewer bytes per token, faster decode, "
                                     "answers of about llama.cpp's Q4_0 quality on 0.5B+ models, "
                                     "far worse on tiny ones (docs/design/weights.md)"),)),
    Setting("backend.graph", f"{_B}.graph", "str", "auto",
            "onnxruntime graph: contrib (onnxruntime's contrib operators: the CPU's fast path), "
            "standard (default-domain ONNX operators only, static shapes: for the CANN "
            "execution provider), or auto (standard when the CANN provider loads, else contrib)",
            choices=GRAPH_FLAVOURS, ours=True, llm="graph",
            flags=(Flag("--graph", "onnxruntime graph (BackendConfig.graph): auto (default: "
                                   "standard on the CANN execution provider, contrib on the "
                                   "CPU), contrib, or standard (default-domain ONNX operators "
                                   "only; slower on a CPU, docs/models.md)"),)),
    Setting("backend.standard_dtype", f"{_B}.standardDtype", "str", DTYPES[0],
            "the standard graph's weights, KV cache and products: float16, or float32 (exact on "
            "a CPU; not with graph contrib)", choices=DTYPES, ours=True, llm="standard_dtype",
            flags=(Flag("--standard-dtype", "the standard graph's dtype (BackendConfig."
                                            "standardDtype): float16 (default) or float32"),)),
    Setting("backend.kernels", f"{_B}.kernels", "str", "auto",
            "onnxruntime matrix-product kernels: onnxruntime (its MatMulNBits), custom "
            "(tiny_mindie's own on the GGUF's blocks; the contrib graph and exact weights "
            "only), or auto (custom where the kernel library is built and loads)",
            choices=KERNEL_MODES, ours=True, llm="kernels",
            flags=(Flag("--kernels", "onnxruntime matrix-product kernels "
                                     "(BackendConfig.kernels): auto (default: custom where the "
                                     "library was built and the weights are exact), custom "
                                     "(tiny_mindie's own, reading the GGUF's blocks as they "
                                     "are) or onnxruntime (its MatMulNBits)"),)),
    Setting("backend.execution_providers", f"{_B}.executionProviders", "providers", (),
            "onnxruntime execution providers: names or [name, {options}] pairs", ours=True),
)

BY_ATTR = {s.attr: s for s in SETTINGS}
BY_KEY = {s.key: s for s in SETTINGS}


def ranges() -> tuple[tuple[str, str, float, float, str], ...]:
    """``(key, path, low, high, unit)`` of the numbers with a range (device ids aside)."""
    return tuple((s.key, s.path, s.low, s.high, s.unit) for s in SETTINGS
                 if s.low is not None and s.kind in ("int", "float"))


# ---- flags ----------------------------------------------------------------------------------
#: Attribute of the parsed arguments: ``{dest: flag}`` of the settings' flags given on the
#: command line, so an error about the value can name the flag.
FROM_FLAG = "from_flag"


class _Recorded:
    """An argparse action that also notes its flag in ``args.from_flag`` (:data:`FROM_FLAG`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        given = dict(getattr(namespace, FROM_FLAG, None) or {})
        given[self.dest] = self.option_strings[0]
        setattr(namespace, FROM_FLAG, given)


#: argparse's store actions, each noting its flag (:class:`_Recorded`)
_Store, _StoreTrue, _StoreFalse = (type(name, (_Recorded, base), {}) for name, base in (
    ("_Store", argparse._StoreAction), ("_StoreTrue", argparse._StoreTrueAction),
    ("_StoreFalse", argparse._StoreFalseAction)))


def _dest(s: Setting) -> str:
    """The argparse ``dest`` a setting's flags share: its first flag's."""
    return s.flags[0].name[2:].replace("-", "_")


def add_flags(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None,
              helps: dict[str, str] | None = None) -> None:
    """The flags of :data:`SETTINGS` on ``parser``, in the table's order; ``only``: just these
    flag names; ``helps``: other help texts by flag name. A flag given leaves its setting's
    value (a switch: ``Flag.sets``) in ``args.<dest>``; not given: ``None``."""
    types = {"int": int, "port": int, "float": float}
    for s in SETTINGS:
        flags = [f for f in s.flags if only is None or f.name in only]
        target = parser.add_mutually_exclusive_group() if len(flags) > 1 else parser
        for f in flags:
            text = (helps or {}).get(f.name, f.help)
            if f.sets is not None:
                target.add_argument(f.name, action=_StoreTrue if f.sets else _StoreFalse,
                                    dest=_dest(s), default=None, help=text)
            else:
                target.add_argument(f.name, action=_Store, dest=_dest(s),
                                    type=types.get(s.kind), choices=s.choices or None, help=text)


def flag_overrides(args: argparse.Namespace, cfg) -> dict:
    """``{attr: value}`` of the flags given in ``args`` over ``cfg`` (the file's config), for
    :meth:`~.config.Config.with_overrides`; a flag's implied settings (``Flag.also``) under
    the ones named by flags themselves."""
    given: dict = {}
    implied: dict = {}
    for s in SETTINGS:
        value = getattr(args, _dest(s), None) if s.flags else None
        if value is None:
            continue
        given[s.attr] = value
        for f in s.flags:
            if f.also is not None:
                implied.update(f.also(cfg, value))
    return {**implied, **given}


def with_flags(cfg, args: argparse.Namespace):
    """``cfg`` (a :class:`~.load.Config`, the file's) with the flags of ``args`` over it
    (:func:`flag_overrides`), validated.

    Raises:
        ConfigError: as :meth:`~.load.Config.with_overrides`; a bad value that came from a
            flag or its variable is led by that name, e.g. ``TINY_MINDIE_PORT: ServerConfig.port
            must be in 1024..65535, got 80``.
    """
    try:
        return cfg.with_overrides(**flag_overrides(args, cfg))
    except ConfigError as exc:
        s = BY_KEY.get(exc.key)
        dest = _dest(s) if s is not None and s.flags else None
        origin = ((getattr(args, FROM_FLAG, None) or {}).get(dest)
                  or (getattr(args, FROM_ENV, None) or {}).get(dest))
        if origin is None:
            raise
        raise ConfigError(f"{origin}: {exc}", key=exc.key) from None
