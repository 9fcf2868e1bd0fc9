"""MindIE-style ``config.json`` -> frozen dataclasses, validated with one-line messages.

The keys and rules are MindIE Service's (spec §6); keys this project does not use are ignored, so
an existing MindIE config file works as it is. A few keys are tiny_mindie's own and say so.
Every key -- its type, default and range -- is defined once in :data:`.settings.SETTINGS`; the
dataclasses here, the reader and :func:`validate` are made from that table.
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
from dataclasses import dataclass, field, make_dataclass, replace
from typing import Any

from .errors import ConfigError
from .settings import ANNOTATIONS, BY_ATTR, SETTINGS, Setting, ranges


def _section_class(name: str, group: str, doc: str, *extra) -> type:
    """The frozen dataclass of one group of :data:`~.settings.SETTINGS`, fields in the table's
    order with its defaults; ``extra``: more ``(name, type, field)`` fields."""
    fields = [(s.name, ANNOTATIONS[s.kind], field(default=s.default))
              for s in SETTINGS if s.group == group]
    cls = make_dataclass(name, [*fields, *extra], frozen=True)
    cls.__module__, cls.__doc__ = __name__, doc
    return cls


ServerConfig = _section_class(
    "ServerConfig", "server",
    "``ServerConfig``: listeners, TLS and request limits. Times in seconds, sizes in MB.")
ModelDeployConfig = _section_class(
    "ModelDeployConfig", "model",
    "``BackendConfig.ModelDeployConfig``: sequence limits (tokens) and the model.")
ScheduleConfig = _section_class(
    "ScheduleConfig", "schedule",
    "``BackendConfig.ScheduleConfig``: continuous-batching limits (sequences, tokens).")
BackendConfig = _section_class(
    "BackendConfig", "backend", "``BackendConfig``: where and how the model runs.",
    ("model", "ModelDeployConfig", field(default_factory=ModelDeployConfig)),
    ("schedule", "ScheduleConfig", field(default_factory=ScheduleConfig)))


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

    def value(self, s: Setting) -> Any:
        """The value of setting ``s`` (:data:`~.settings.SETTINGS`) in this configuration."""
        v: Any = self
        for part in s.path.split("."):
            v = getattr(v, part)
        return v

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


def _read_file(path: str) -> dict:
    """The JSON object in ``path``, every number in it finite.

    Raises:
        ConfigError: unreadable file, bad JSON, not an object, a non-finite number, arrays or
            objects nested deeper than Python's recursion limit lets ``json`` read.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        raw = json.loads(text)
        if isinstance(raw, dict):
            _reject_non_finite(raw, "")
    except RecursionError:
        raise ConfigError(f"config file {path} is not valid: arrays or objects nested too "
                          "deep") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid JSON: {exc}") from None
    except ValueError:     # Python's limit of 4300 digits for an integer
        raise ConfigError(f"config file {path} is not valid: {_long_number(text)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a JSON object")
    return raw


def _sections(raw: dict) -> dict[str, dict]:
    """The file's sections by their dotted name (``BackendConfig.ScheduleConfig``, ...)."""
    b = _section(raw, "BackendConfig", "")
    md = _section(b, "ModelDeployConfig", "BackendConfig")
    models = md.get("ModelConfig", [{}])
    if not isinstance(models, list) or not models or not isinstance(models[0], dict):
        raise ConfigError("BackendConfig.ModelDeployConfig.ModelConfig must be a list of objects")
    return {"ServerConfig": _section(raw, "ServerConfig", ""), "BackendConfig": b,
            "BackendConfig.ModelDeployConfig": md,
            "BackendConfig.ModelDeployConfig.ModelConfig[0]": models[0],
            "BackendConfig.ScheduleConfig": _section(b, "ScheduleConfig", "BackendConfig")}


def _device_ids(section: dict, key: str, where: str) -> tuple[int, ...]:
    """``npuDeviceIds``, MindIE's list of lists of device ids, flattened."""
    ids = section.get(key, [[0]])
    flat = [i for group in ids for i in (group if isinstance(group, list) else [group])] \
        if isinstance(ids, list) else None
    if not flat or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in flat):
        raise ConfigError(f"{where}.{key} must be a list of lists of device ids, got {ids!r}")
    return tuple(flat)


_KINDS = {"int": int, "port": int, "float": float, "str": str, "host": str, "bool": bool,
          "strings": tuple}


def load_config(path: str | None = None) -> Config:
    """Read and validate ``path`` (MindIE ``config.json`` layout), or the defaults when ``None``.

    Raises:
        ConfigError: unreadable file, bad JSON, wrong types or values.
    """
    if path is None:
        cfg = Config(home=config_home())
        validate(cfg)
        return cfg
    sections = _sections(_read_file(path))
    values: dict[str, dict[str, Any]] = {group: {} for group in ("server", "model", "schedule",
                                                                 "backend")}
    for s in SETTINGS:
        section, key, where = sections[s.section], s.leaf, s.section
        if s.kind == "device ids":
            v = _device_ids(section, key, where)
        elif s.kind == "providers":
            v = _providers(section.get(key))
        else:
            default = s.default
            if s.default_from is not None:
                group, _, name = s.default_from.partition(".")
                default = values[group][name]
            v = _get(section, key, _KINDS[s.kind], default, where)
        values[s.group][s.name] = v
    backend = BackendConfig(**values["backend"], model=ModelDeployConfig(**values["model"]),
                            schedule=ScheduleConfig(**values["schedule"]))
    cfg = Config(server=ServerConfig(**values["server"]), backend=backend,
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


#: Allowed ranges of the numeric keys, inclusive: (name, attribute path, low, high, unit), from
#: :data:`~.settings.SETTINGS`. Floats must also be finite. Ports (1024..65535, or 0 for any free
#: port), device ids and the cross-key rules (maxPrefillTokens >= maxInputTokenLen, ...) are in
#: :func:`validate`.
RANGES = ranges()
_DEVICE_IDS = next(s for s in SETTINGS if s.kind == "device ids")
MAX_DEVICE_ID = int(_DEVICE_IDS.high)

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
                          f"use 0.0.0.0 to listen on every address)", key=f"ServerConfig.{key}")
    if _IP_LITERAL.fullmatch(host):
        try:
            ipaddress.ip_address(host)
            return
        except ValueError:
            pass
    if len(host) <= 253 and _HOSTNAME.fullmatch(host) and not host.replace(".", "").isdigit():
        return
    raise ConfigError(f"ServerConfig.{key} must be an IP address or a host name (letters, digits, "
                      f"hyphens and dots), got {show(host)[:80]}", key=f"ServerConfig.{key}")


def _check_backend(b) -> None:
    """The backend settings that do not go together (weights, graph, kernels, standard dtype);
    raises :class:`ConfigError`."""
    if b.weights != "exact" and b.backend != "onnxruntime":
        raise ConfigError(f"weights {b.weights!r} (--weights, BackendConfig.weights) needs the "
                          f"onnxruntime backend; the {b.backend} backend runs the exact weights")
    if b.graph != "auto" and b.backend != "onnxruntime":
        raise ConfigError(f"graph {b.graph!r} (--graph, BackendConfig.graph) needs the "
                          f"onnxruntime backend; the {b.backend} backend builds no graph")
    if b.kernels == "custom" and (
            b.backend != "onnxruntime" or b.weights != "exact" or b.graph == "standard"):
        raise ConfigError("kernels custom (--kernels, BackendConfig.kernels) needs the "
                          "onnxruntime backend, its contrib graph and the exact weights")
    if b.standard_dtype != "float16" and (b.graph == "contrib" or b.backend != "onnxruntime"):
        raise ConfigError(f"standard dtype {b.standard_dtype!r} (--standard-dtype, "
                          "BackendConfig.standardDtype) shapes the standard graph only; "
                          f"{'graph contrib' if b.graph == 'contrib' else 'the numpy backend'}"
                          " builds none")
    if b.graph == "standard" and b.weights != "exact":
        raise ConfigError(f"weights {b.weights!r} (--weights, BackendConfig.weights) needs the "
                          "contrib graph; the standard graph (--graph standard) holds float16 "
                          "or float32 weights (--standard-dtype)")


def validate(cfg: Config, *, combinations: bool = True) -> None:
    """Check MindIE's rules (spec §6) and tiny_mindie's own (:data:`RANGES`, listen addresses,
    choices); raises :class:`ConfigError` naming the key and what it may hold. ``combinations``:
    also the settings that must agree with another (``weights`` with ``backend``); a file read
    before the command line's overrides leaves them for :meth:`Config.with_overrides`."""
    for s in SETTINGS:
        if s.kind == "host":
            check_listen_address(s.leaf, cfg.value(s))
    for name, attr, lo, hi, unit in RANGES:
        v: Any = cfg
        for part in attr.split("."):
            v = getattr(v, part)
        if isinstance(v, float) and not math.isfinite(v):     # the words of _reject_non_finite
            raise ConfigError(f"{name} must be a finite number, got {show(v)}", key=name)
        if not lo <= v <= hi:
            raise ConfigError(f"{name} must be in {show(lo)}..{show(hi)}{unit}, got {show(v)}",
                              key=name)
    for s in SETTINGS:
        port = cfg.value(s)
        if s.kind == "port" and not (1024 <= port <= 65535 or port == 0):   # 0: any free port
            raise ConfigError(f"{s.key} must be 0 or in 1024..65535, got {show(port)}",
                              key=s.key)
    _check_pairs(cfg)
    for s in SETTINGS:
        if s.choices and cfg.value(s) not in s.choices:
            raise ConfigError(f"{s.key} must be one of {', '.join(s.choices)}, "
                              f"got {show(cfg.value(s))}", key=s.key)
    b = cfg.backend
    if combinations:
        _check_backend(b)
        if not b.model.model_weight_path and not b.model.embedding_model:
            key = BY_ATTR["model.model_weight_path"].key
            raise ConfigError(f"{key} must name a model (empty only with an embedding model: "
                              "--embedding-model, embeddingModelPath)", key=key)
    if combinations and b.model.draft_model and not (
            b.backend == "onnxruntime" and b.schedule.speculative_decoding):
        raise ConfigError("a draft model (--draft-model, ModelConfig.draftModelPath) needs "
                          "speculative decoding on the onnxruntime backend; it is off "
                          "(--no-speculation) or the backend is numpy")


def _check_pairs(cfg: Config) -> None:
    """The rules between keys, and the device ids."""
    s, b, sc = cfg.server, cfg.backend, cfg.backend.schedule
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
