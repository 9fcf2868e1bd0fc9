"""MindIE-style ``config.json`` -> frozen dataclasses, validated with one-line messages.

The keys and rules are MindIE Service's (spec §6); keys this project does not use are ignored, so
an existing MindIE config file works as it is. A few keys are tiny_mindie's own and say so.
Relative paths in the file are resolved against the file's folder ("config home"); without a file
the config home is ``$TINY_MINDIE_HOME``, else ``$XDG_CONFIG_HOME/tiny_mindie``
(default ``~/.config/tiny_mindie``).
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field, replace
from typing import Any

from .model import BACKENDS, DEFAULT_BACKEND, WEIGHT_MODES


class ConfigError(Exception):
    """The configuration is invalid; the message is one line for the user."""


@dataclass(frozen=True)
class ServerConfig:
    """``ServerConfig``: listeners, TLS and request limits. Times in seconds, sizes in MB."""

    ip_address: str = "127.0.0.1"
    management_ip_address: str = "127.0.0.1"
    port: int = 1025
    management_port: int = 1025
    metrics_port: int = 1025
    max_link_num: int = 1000
    https_enabled: bool = True
    tls_ca_path: str = "security/ca/"
    tls_ca_files: tuple[str, ...] = ("ca.pem",)
    tls_cert: str = "security/certs/server.pem"
    tls_pk: str = "security/keys/server.key.pem"
    tls_crl_path: str = "security/certs/"
    tls_crl_files: tuple[str, ...] = ("server_crl.pem",)
    token_timeout: float = 600.0
    e2e_timeout: float = 600.0
    max_request_length: int = 40     # MB
    # tiny_mindie: seconds a new connection has for its TLS handshake
    tls_handshake_timeout: float = 10.0
    # tiny_mindie: KB a stream's client may leave unread; 0 = no limit
    max_stream_backlog_kb: int = 64
    # tiny_mindie: seconds a stop (SIGTERM, SIGINT) lets the requests in flight finish
    drain_timeout: float = 30.0
    # tiny_mindie: seconds a kept-alive connection may sit idle between two requests
    keep_alive_timeout: float = 65.0
    # tiny_mindie: seconds a request's header section may take, counted from its first byte
    header_timeout: float = 60.0
    # tiny_mindie: plain-HTTP listener for the health routes only; 0 = none
    health_port: int = 0
    health_ip_address: str = "127.0.0.1"


@dataclass(frozen=True)
class ModelDeployConfig:
    """``BackendConfig.ModelDeployConfig``: sequence limits (tokens) and the model."""

    max_seq_len: int = 2560
    max_input_token_len: int = 2048
    truncation: bool = False
    parse_special_tokens: bool = True   # tiny_mindie: raw prompts' <|im_start|> etc. as tokens
    model_name: str = "smollm2-135m-instruct"
    model_weight_path: str = "smollm2-135m-instruct"   # a .gguf path or a registry name


@dataclass(frozen=True)
class ScheduleConfig:
    """``BackendConfig.ScheduleConfig``: continuous-batching limits (sequences, tokens)."""

    cache_block_size: int = 128
    max_prefill_batch_size: int = 50
    max_prefill_tokens: int = 8192
    max_batch_size: int = 200
    max_iter_times: int = 512
    max_queue_delay_microseconds: int = 5000
    prefill_chunk_size: int = 512  # tiny_mindie: prompt tokens per step, so decode keeps flowing
    prefix_caching: bool = True    # tiny_mindie: reuse the KV of a prompt prefix seen before
    speculative_decoding: bool = True   # tiny_mindie: prompt lookup, verified losslessly


@dataclass(frozen=True)
class BackendConfig:
    """``BackendConfig``: where and how the model runs."""

    npu_device_ids: tuple[int, ...] = (0,)
    backend: str = DEFAULT_BACKEND      # tiny_mindie: "onnxruntime" or "numpy"
    intra_op_threads: int = 0           # tiny_mindie: 0 = the backend's default
    parallel_runs: int = 0              # tiny_mindie: onnxruntime runs at once; 0 = CPUs // threads
    kv_cache_mb: int = 1024             # tiny_mindie: KV-cache budget, bounds the running batch
    batch_invariant: bool = True        # tiny_mindie: a row's logits the same alone and in a batch
    weights: str = "exact"              # tiny_mindie: "exact" or "compact" (4-bit blocks of 64)
    execution_providers: tuple = ()     # tiny_mindie: onnxruntime EPs, names or [name, {options}]
    model: ModelDeployConfig = field(default_factory=ModelDeployConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)


@dataclass(frozen=True)
class Config:
    """The whole configuration. ``home`` is the folder relative paths are resolved against."""

    server: ServerConfig = field(default_factory=ServerConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    home: str = ""
    source: str | None = None   # path of the config file, if any

    def path(self, p: str) -> str:
        """``p`` resolved against the config home."""
        return p if os.path.isabs(p) else os.path.normpath(os.path.join(self.home, p))

    @property
    def max_input_len(self) -> int:
        """Effective maxInputTokenLen: MindIE uses min(maxInputTokenLen, maxSeqLen - 1)."""
        m = self.backend.model
        return min(m.max_input_token_len, m.max_seq_len - 1)

    def with_overrides(self, **kw: Any) -> Config:
        """A copy with dotted overrides, e.g. ``{"server.port": 8080}``; validated again."""
        server, backend = self.server, self.backend
        model, sched = backend.model, backend.schedule
        for key, value in kw.items():
            part, _, name = key.partition(".")
            if part == "server":
                server = replace(server, **{name: value})
            elif part == "backend":
                backend = replace(backend, **{name: value})
            elif part == "model":
                model = replace(model, **{name: value})
            elif part == "schedule":
                sched = replace(sched, **{name: value})
            else:
                raise KeyError(key)
        cfg = replace(self, server=server,
                      backend=replace(backend, model=model, schedule=sched))
        validate(cfg)
        return cfg


def config_home() -> str:
    """Default folder for the configuration and the ``security/`` folder."""
    home = os.environ.get("TINY_MINDIE_HOME")
    if home:
        return os.path.abspath(home)
    xdg = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(xdg, "tiny_mindie")


# ---- reading ---------------------------------------------------------------------------------
def _get(section: dict, key: str, kind, default, where: str):
    if key not in section or section[key] is None:
        return default
    v = section[key]
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        try:
            return float(v)
        except OverflowError:     # an integer beyond a float's range (about 1.8e308)
            raise ConfigError(f"{where}.{key} must be a finite number, got {show(v)}") from None
    if kind is tuple:
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ConfigError(f"{where}.{key} must be a list of strings, got {v!r}")
        return tuple(v)
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        json_kind = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
        raise ConfigError(f"{where}.{key} must be {json_kind.get(kind, kind.__name__)}, "
                          f"got {json.dumps(v)}")
    return v


def show(v) -> str:
    """``v`` for a one-line message: an integer of more than 20 digits is described, not written."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10 ** 20:
        return f"an integer of {len(str(abs(v)))} digits"
    if isinstance(v, float):
        return f"{v:g}"
    return json.dumps(v) if isinstance(v, str) else str(v)


def _reject_non_finite(v, where: str) -> None:
    """Python's ``json`` reads ``NaN``, ``Infinity`` and numbers too large for a float (``1e999``)
    although JSON has no such values; none of them means anything in a config.

    Raises:
        ConfigError: naming the first key that holds one.
    """
    if isinstance(v, float) and not math.isfinite(v):
        raise ConfigError(f"{where} must be a finite number, got {v}")
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, x in items:
        _reject_non_finite(x, f"{where}[{k}]" if isinstance(k, int) else
                           f"{where}.{k}" if where else str(k))


def _long_number(text: str) -> str:
    """Where the integer too long for Python's int() (more than 4300 digits) is in ``text``."""
    m = re.search(r"\d{%d,}" % (MAX_DIGITS + 1), text)
    if m is None:
        return f"a number has more than {MAX_DIGITS} digits"
    line = text.count("\n", 0, m.start()) + 1
    col = m.start() - (text.rfind("\n", 0, m.start()) + 1) + 1
    return (f"a number of {len(m.group())} digits at line {line} column {col} "
            f"(char {m.start()}); numbers may have at most {MAX_DIGITS} digits")


MAX_DIGITS = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 4300


def _section(d: dict, key: str, where: str) -> dict:
    v = d.get(key, {})
    if not isinstance(v, dict):
        raise ConfigError(f"{where}.{key} must be an object")
    return v


def load_config(path: str | None = None) -> Config:
    """Read and validate ``path`` (MindIE ``config.json`` layout), or the defaults when ``None``.

    Raises:
        ConfigError: unreadable file, bad JSON, wrong types or values.
    """
    if path is None:
        cfg = Config(home=config_home())
        validate(cfg)
        return cfg
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        raw = json.loads(text)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid JSON: {exc}") from None
    except ValueError:     # Python's limit of 4300 digits for an integer
        raise ConfigError(f"config file {path} is not valid: {_long_number(text)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a JSON object")
    _reject_non_finite(raw, "")
    s = _section(raw, "ServerConfig", "")
    b = _section(raw, "BackendConfig", "")
    md = _section(b, "ModelDeployConfig", "BackendConfig")
    sc = _section(b, "ScheduleConfig", "BackendConfig")
    models = md.get("ModelConfig", [{}])
    if not isinstance(models, list) or not models or not isinstance(models[0], dict):
        raise ConfigError("BackendConfig.ModelDeployConfig.ModelConfig must be a list of objects")
    mc = models[0]
    S, B, M, SC = ServerConfig(), BackendConfig(), ModelDeployConfig(), ScheduleConfig()
    W = "ServerConfig"
    port = _get(s, "port", int, S.port, W)
    server = ServerConfig(
        ip_address=_get(s, "ipAddress", str, S.ip_address, W),
        management_ip_address=_get(s, "managementIpAddress", str, S.management_ip_address, W),
        port=port,
        management_port=_get(s, "managementPort", int, port, W),
        metrics_port=_get(s, "metricsPort", int, port, W),
        max_link_num=_get(s, "maxLinkNum", int, S.max_link_num, W),
        https_enabled=_get(s, "httpsEnabled", bool, S.https_enabled, W),
        tls_ca_path=_get(s, "tlsCaPath", str, S.tls_ca_path, W),
        tls_ca_files=_get(s, "tlsCaFile", tuple, S.tls_ca_files, W),
        tls_cert=_get(s, "tlsCert", str, S.tls_cert, W),
        tls_pk=_get(s, "tlsPk", str, S.tls_pk, W),
        tls_crl_path=_get(s, "tlsCrlPath", str, S.tls_crl_path, W),
        tls_crl_files=_get(s, "tlsCrlFiles", tuple, S.tls_crl_files, W),
        token_timeout=_get(s, "tokenTimeout", float, S.token_timeout, W),
        e2e_timeout=_get(s, "e2eTimeout", float, S.e2e_timeout, W),
        max_request_length=_get(s, "maxRequestLength", int, S.max_request_length, W),
        tls_handshake_timeout=_get(s, "tlsHandshakeTimeout", float, S.tls_handshake_timeout, W),
        max_stream_backlog_kb=_get(s, "maxStreamBacklogKB", int, S.max_stream_backlog_kb, W),
        drain_timeout=_get(s, "drainTimeout", float, S.drain_timeout, W),
        keep_alive_timeout=_get(s, "keepAliveTimeout", float, S.keep_alive_timeout, W),
        header_timeout=_get(s, "headerTimeout", float, S.header_timeout, W),
        health_port=_get(s, "healthPort", int, S.health_port, W),
        health_ip_address=_get(s, "healthIpAddress", str, S.health_ip_address, W),
    )
    W = "BackendConfig.ModelDeployConfig"
    name = _get(mc, "modelName", str, M.model_name, W + ".ModelConfig[0]")
    model = ModelDeployConfig(
        max_seq_len=_get(md, "maxSeqLen", int, M.max_seq_len, W),
        max_input_token_len=_get(md, "maxInputTokenLen", int, M.max_input_token_len, W),
        truncation=_get(md, "truncation", bool, M.truncation, W),
        parse_special_tokens=_get(md, "parseSpecialTokens", bool, M.parse_special_tokens, W),
        model_name=name,
        model_weight_path=_get(mc, "modelWeightPath", str, M.model_weight_path,
                               W + ".ModelConfig[0]"),
    )
    W = "BackendConfig.ScheduleConfig"
    sched = ScheduleConfig(
        cache_block_size=_get(sc, "cacheBlockSize", int, SC.cache_block_size, W),
        max_prefill_batch_size=_get(sc, "maxPrefillBatchSize", int, SC.max_prefill_batch_size, W),
        max_prefill_tokens=_get(sc, "maxPrefillTokens", int, SC.max_prefill_tokens, W),
        max_batch_size=_get(sc, "maxBatchSize", int, SC.max_batch_size, W),
        max_iter_times=_get(sc, "maxIterTimes", int, SC.max_iter_times, W),
        max_queue_delay_microseconds=_get(sc, "maxQueueDelayMicroseconds", int,
                                          SC.max_queue_delay_microseconds, W),
        prefill_chunk_size=_get(sc, "prefillChunkSize", int, SC.prefill_chunk_size, W),
        prefix_caching=_get(sc, "prefixCaching", bool, SC.prefix_caching, W),
        speculative_decoding=_get(sc, "speculativeDecoding", bool, SC.speculative_decoding, W),
    )
    W = "BackendConfig"
    ids = b.get("npuDeviceIds", [[0]])
    flat = [i for group in ids for i in (group if isinstance(group, list) else [group])] \
        if isinstance(ids, list) else None
    if not flat or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in flat):
        raise ConfigError("BackendConfig.npuDeviceIds must be a list of lists of device ids, "
                          f"got {ids!r}")
    backend = BackendConfig(
        npu_device_ids=tuple(flat),
        backend=_get(b, "backend", str, B.backend, W),
        intra_op_threads=_get(b, "intraOpThreads", int, B.intra_op_threads, W),
        parallel_runs=_get(b, "parallelRuns", int, B.parallel_runs, W),
        kv_cache_mb=_get(b, "kvCacheMB", int, B.kv_cache_mb, W),
        batch_invariant=_get(b, "batchInvariant", bool, B.batch_invariant, W),
        weights=_get(b, "weights", str, B.weights, W),
        execution_providers=_providers(b.get("executionProviders")),
        model=model, schedule=sched,
    )
    cfg = Config(server=server, backend=backend,
                 home=os.path.dirname(os.path.abspath(path)), source=os.path.abspath(path))
    validate(cfg, combinations=False)     # flags and variables may still change the pairs
    return cfg




def _providers(v) -> tuple:
    """``BackendConfig.executionProviders``: ``["CPUExecutionProvider", ["CANNExecutionProvider",
    {"device_id": "0"}], ...]`` -> tuple of names / ``(name, options)``."""
    if v is None:
        return ()
    ok = isinstance(v, list) and all(
        isinstance(p, str) or (isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                               and isinstance(p[1], dict)) for p in v)
    if not ok:
        raise ConfigError("BackendConfig.executionProviders must be a list of provider names or "
                          f"[name, {{options}}] pairs, got {v!r}")
    return tuple(p if isinstance(p, str) else (p[0], p[1]) for p in v)


#: Allowed ranges of the numeric keys, inclusive: (name, attribute path, low, high, unit).
#: Floats must also be finite. Ports (1024..65535, or 0 for any free port), device ids and the
#: cross-key rules (maxPrefillTokens >= maxInputTokenLen, ...) are in :func:`validate`.
RANGES: tuple[tuple[str, str, float, float, str], ...] = (
    ("ServerConfig.maxLinkNum", "server.max_link_num", 1, 4096, ""),
    ("ServerConfig.tokenTimeout", "server.token_timeout", 0.001, 86400, " seconds"),
    ("ServerConfig.e2eTimeout", "server.e2e_timeout", 0.001, 86400, " seconds"),
    ("ServerConfig.maxRequestLength", "server.max_request_length", 1, 100, " MB"),
    ("ServerConfig.tlsHandshakeTimeout", "server.tls_handshake_timeout", 0.1, 600, " seconds"),
    ("ServerConfig.maxStreamBacklogKB", "server.max_stream_backlog_kb", 0, 1 << 20, " KB"),
    ("ServerConfig.drainTimeout", "server.drain_timeout", 0.0, 86400, " seconds"),
    ("ServerConfig.keepAliveTimeout", "server.keep_alive_timeout", 0.1, 86400, " seconds"),
    ("ServerConfig.headerTimeout", "server.header_timeout", 0.1, 600, " seconds"),
    ("BackendConfig.ModelDeployConfig.maxSeqLen", "backend.model.max_seq_len",
     2, 1 << 20, " tokens"),
    ("BackendConfig.ModelDeployConfig.maxInputTokenLen", "backend.model.max_input_token_len",
     1, 1 << 20, " tokens"),
    ("BackendConfig.ScheduleConfig.cacheBlockSize", "backend.schedule.cache_block_size",
     1, 4096, " tokens"),
    ("BackendConfig.ScheduleConfig.maxPrefillBatchSize", "backend.schedule.max_prefill_batch_size",
     1, 5000, " sequences"),
    ("BackendConfig.ScheduleConfig.maxPrefillTokens", "backend.schedule.max_prefill_tokens",
     1, 1 << 24, " tokens"),
    ("BackendConfig.ScheduleConfig.maxBatchSize", "backend.schedule.max_batch_size", 1, 5000,
     " sequences"),
    ("BackendConfig.ScheduleConfig.maxIterTimes", "backend.schedule.max_iter_times", 1, 1 << 20,
     " tokens"),
    ("BackendConfig.ScheduleConfig.maxQueueDelayMicroseconds",
     "backend.schedule.max_queue_delay_microseconds", 0, 1_000_000, " microseconds"),
    ("BackendConfig.ScheduleConfig.prefillChunkSize", "backend.schedule.prefill_chunk_size",
     1, 1 << 20, " tokens"),
    ("BackendConfig.intraOpThreads", "backend.intra_op_threads", 0, 1024, ""),
    ("BackendConfig.parallelRuns", "backend.parallel_runs", 0, 1024, ""),
    ("BackendConfig.kvCacheMB", "backend.kv_cache_mb", 1, 1 << 20, " MB"),
)
MAX_DEVICE_ID = 1023

#: What ipAddress / managementIpAddress may hold besides an IP literal: a host name.
_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")
_IP_LITERAL = re.compile(r"[0-9A-Fa-f.:]+(%[A-Za-z0-9_.-]+)?")


def check_listen_address(key: str, host: str) -> None:
    """``host`` must be an IPv4 / IPv6 literal (``ipaddress``; an IPv6 scope ``%eth0`` allowed)
    or a host name: ASCII letters, digits and hyphens in dot-separated labels of 1..63
    characters, 253 characters at most.

    Raises:
        ConfigError: naming ``key`` (e.g. ``ServerConfig.ipAddress``).
    """
    if host == "":
        raise ConfigError(f"ServerConfig.{key} must not be empty (MindIE requires an address; "
                          f"use 0.0.0.0 to listen on every address)")
    if _IP_LITERAL.fullmatch(host):
        try:
            ipaddress.ip_address(host)
            return
        except ValueError:
            pass
    if len(host) <= 253 and _HOSTNAME.fullmatch(host) and not host.replace(".", "").isdigit():
        return
    raise ConfigError(f"ServerConfig.{key} must be an IP address or a host name (letters, digits, "
                      f"hyphens and dots), got {show(host)[:80]}")


def validate(cfg: Config, *, combinations: bool = True) -> None:
    """Check MindIE's rules (spec §6) and tiny_mindie's own (:data:`RANGES`, listen addresses);
    raises :class:`ConfigError` naming the key and what it may hold. ``combinations``: also
    the settings that must agree with another (``weights`` with ``backend``); a file read
    before the command line's overrides leaves them for :meth:`Config.with_overrides`."""
    s, b, sc = cfg.server, cfg.backend, cfg.backend.schedule
    for key, host in (("ipAddress", s.ip_address), ("managementIpAddress", s.management_ip_address),
                      ("healthIpAddress", s.health_ip_address)):
        check_listen_address(key, host)
    for name, attr, lo, hi, unit in RANGES:
        v: Any = cfg
        for part in attr.split("."):
            v = getattr(v, part)
        finite = not isinstance(v, float) or math.isfinite(v)   # NaN fails every comparison
        if not (finite and lo <= v <= hi):
            raise ConfigError(f"{name} must be in {show(lo)}..{show(hi)}{unit}, got {show(v)}")
    for key, port in (("port", s.port), ("managementPort", s.management_port),
                      ("metricsPort", s.metrics_port), ("healthPort", s.health_port)):
        if not (1024 <= port <= 65535 or port == 0):   # 0: any free port (tiny_mindie)
            raise ConfigError(f"ServerConfig.{key} must be in 1024..65535, got {show(port)}")
    if s.health_port and s.health_port in (s.port, s.management_port, s.metrics_port):
        raise ConfigError(f"ServerConfig.healthPort ({s.health_port}) must differ from port, "
                          "managementPort and metricsPort: it serves plain HTTP (0 = no health "
                          "listener)")
    if sc.max_prefill_tokens < cfg.max_input_len:
        raise ConfigError("BackendConfig.ScheduleConfig.maxPrefillTokens "
                          f"({sc.max_prefill_tokens}) must be >= maxInputTokenLen "
                          f"({cfg.max_input_len})")
    if sc.max_prefill_batch_size > sc.max_batch_size:
        raise ConfigError(f"BackendConfig.ScheduleConfig.maxPrefillBatchSize "
                          f"({sc.max_prefill_batch_size}) must be in 1..maxBatchSize "
                          f"({sc.max_batch_size})")
    if not all(0 <= i <= MAX_DEVICE_ID for i in b.npu_device_ids):
        raise ConfigError(f"BackendConfig.npuDeviceIds must hold device ids in 0..{MAX_DEVICE_ID}, "
                          f"got {', '.join(show(i) for i in b.npu_device_ids)}")
    if b.backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {b.backend!r}")
    if b.weights not in WEIGHT_MODES:
        raise ConfigError(f"BackendConfig.weights must be one of {', '.join(WEIGHT_MODES)}, "
                          f"got {show(b.weights)}")
    if combinations and b.weights != "exact" and b.backend != "onnxruntime":
        raise ConfigError(f"weights {b.weights!r} (--weights, BackendConfig.weights) needs the "
                          f"onnxruntime backend; the {b.backend} backend runs the exact weights")
