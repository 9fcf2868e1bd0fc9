"""Command line: ``python -m tiny_mindie [serve] ...``, ``pull NAME``, ``list-models``, ``certs``.

Bad configuration, a missing model file or a busy port end with one line on stderr and a
non-zero exit status; never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from . import __version__, health_probe
from .config import BACKENDS, DEFAULT_BACKEND, Config, ConfigError, load_config
from .envconfig import EnvError, apply_env, env_options
from .logs import add_log_options, fail, say
from .logs import setup as setup_logging
from .model.gguf import ModelFileError
from .model.registry import ModelDownloadError
from .server.listen import AddressError
from .server.tls import TLSConfigError

# Bad configuration, found by the config loader, the TLS set-up or the listen addresses: one line
# on stderr and exit status 2.
CONFIG_ERRORS = (ConfigError, TLSConfigError, AddressError, ModelFileError)

COMMANDS = ("serve", "pull", "list-models", "watermark-detect", "certs", "health")
# Subcommands whose options also come from TINY_MINDIE_* variables (envconfig.py), and whether
# an unknown TINY_MINDIE_* variable is reported to them.
ENV_COMMANDS = {"serve": True, "health": False}
EXAMPLE_BODY = ('{"inputs": "My name is Olivier and I", "stream": false, '
                '"parameters": {"temperature": 0.5, "top_k": 10, "top_p": 0.95, '
                '"max_new_tokens": 20, "do_sample": true, "details": true}}')


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag ends with one line (and a pointer to --help), not the usage."""

    def error(self, message: str):
        self.exit(2, f"tiny_mindie: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m tiny_mindie",
        description="A small LLM inference server speaking Huawei MindIE Service's HTTP API. "
                    "Without a command it serves (the 'serve' command).",
        epilog="The server's options: python -m tiny_mindie serve --help")
    p.add_argument("--version", action="version", version=f"tiny_mindie {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser,
                           metavar="{serve,pull,list-models,watermark-detect,certs,health}")

    s = sub.add_parser("serve", help="serve the HTTP API (the default)")
    s.add_argument("--config", metavar="FILE",
                   help="MindIE-style config.json; relative paths in it (TLS files) are resolved "
                        "against its folder (default: none, the built-in settings)")
    s.add_argument("--host",
                   help="business listen address (ServerConfig.ipAddress, default 127.0.0.1)")
    s.add_argument("--port", type=int,
                   help="business port (ServerConfig.port, default 1025; 0 = any free port)")
    s.add_argument("--management-port", type=int, help="management port (default: --port)")
    s.add_argument("--metrics-port", type=int, help="metrics port (default: --port)")
    s.add_argument("--model", help="a .gguf file or a registry name (see list-models); "
                                   "default smollm2-135m-instruct, pulled on first start")
    s.add_argument("--model-name", help="name clients use for the model (ModelConfig.modelName; "
                                        "default: the registry name or the file name)")
    s.add_argument("--backend", choices=BACKENDS,
                   help=f"model backend (default {DEFAULT_BACKEND}; "
                        "numpy is the reference decoder)")
    s.add_argument("--threads", type=int,
                   help="intra-op threads of the backend (default 0: the backend's choice)")
    s.add_argument("--parallel-runs", type=int,
                   help="onnxruntime runs executed at once, each on its own threads "
                        "(BackendConfig.parallelRuns; default 0 = CPUs // threads)")
    s.add_argument("--weights", choices=("exact", "compact"),
                   help="onnxruntime weights (BackendConfig.weights): exact, the GGUF's own "
                        "values (default), or compact, every matrix in 4-bit blocks of 64: "
                        "fewer bytes per token, faster decode, answers of about llama.cpp's "
                        "Q4_0 quality on 0.5B+ models, far worse on tiny ones (docs/weights.md)")
    s.add_argument("--max-seq-len", type=int,
                   help="prompt + output tokens per sequence (maxSeqLen, default 2560)")
    s.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt whole (ScheduleConfig.prefixCaching: false)")
    spec = s.add_mutually_exclusive_group()
    spec.add_argument("--speculation", action="store_true", dest="speculation", default=None,
                      help="speculative decoding (the default; ScheduleConfig."
                           "speculativeDecoding: true over a file's false)")
    spec.add_argument("--no-speculation", action="store_false", dest="speculation",
                      default=None,
                      help="one token per decode step, and a graph without the verification "
                           "path (ScheduleConfig.speculativeDecoding: false; by default tokens "
                           "proposed by prompt lookup are verified several at a time, "
                           "losslessly, when it pays)")
    s.add_argument("--no-tls", action="store_true",
                   help="plain HTTP, no TLS (MindIE's httpsEnabled: false); for local development")
    s.add_argument("--drain-timeout", type=float,
                   help="seconds SIGTERM/SIGINT let the requests in flight finish before the "
                        "rest are cancelled (ServerConfig.drainTimeout, default 30)")
    s.add_argument("--health-port", type=int,
                   help="plain-HTTP port serving only the health routes, for probes that have "
                        "no client certificate (ServerConfig.healthPort; default 0 = none)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="least severe log records written")
    add_log_options(s)

    pl = sub.add_parser("pull", help="fetch a registry model into the cache")
    pl.add_argument("name", help="registry model name (see list-models)")
    pl.add_argument("--force", action="store_true", help="download again even if present")

    sub.add_parser("list-models", help="list the models the registry knows")

    wd = sub.add_parser("watermark-detect",
                        help="z-score of the green-list watermark (Kirchenbauer et al. 2023) "
                             "in a text")
    wd.add_argument("text", nargs="?", default="-", help="the text, or - to read standard input")
    wd.add_argument("--model", default=None,
                    help="model whose tokenizer made the text (default: the default model)")
    wd.add_argument("--threshold", type=float, default=4.0,
                    help="z above which the text is called marked")
    from .certs import add_parser as add_certs
    add_certs(sub)
    health_probe.add_arguments(sub.add_parser(
        "health", help="exec probe: exit 0 when the server here answers its health route "
                       "with 200, else 1"))
    for name, warn in ENV_COMMANDS.items():     # last: every option of theirs gets a variable
        if name in sub.choices:
            env_options(sub.choices[name], warn_unknown=warn)
    return p


def _config_from_args(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config)
    over: dict = {}
    if args.host is not None:
        over["server.ip_address"] = args.host
        over["server.management_ip_address"] = args.host
    if args.port is not None:
        over["server.port"] = args.port
        # Planes sharing the business listener move with it; ports set apart in the file stay.
        if cfg.server.management_port == cfg.server.port:
            over["server.management_port"] = args.port
        if cfg.server.metrics_port == cfg.server.port:
            over["server.metrics_port"] = args.port
    if args.management_port is not None:
        over["server.management_port"] = args.management_port
    if args.metrics_port is not None:
        over["server.metrics_port"] = args.metrics_port
    if args.no_tls:
        over["server.https_enabled"] = False
    if args.drain_timeout is not None:
        over["server.drain_timeout"] = args.drain_timeout
    if args.health_port is not None:
        over["server.health_port"] = args.health_port
    if args.no_prefix_cache:
        over["schedule.prefix_caching"] = False
    if args.speculation is not None:
        over["schedule.speculative_decoding"] = args.speculation
    if args.model is not None:
        over["model.model_weight_path"] = args.model
        if args.model_name is None and cfg.source is None:
            from .model.registry import lookup
            known = lookup(args.model)
            over["model.model_name"] = known.name if known else \
                os.path.splitext(os.path.basename(args.model))[0]
    if args.model_name is not None:
        over["model.model_name"] = args.model_name
    if args.backend is not None:
        over["backend.backend"] = args.backend
    if args.threads is not None:
        over["backend.intra_op_threads"] = args.threads
    if args.parallel_runs is not None:
        over["backend.parallel_runs"] = args.parallel_runs
    if args.weights is not None:
        over["backend.weights"] = args.weights
    if args.max_seq_len is not None:
        over["model.max_seq_len"] = args.max_seq_len
        over["model.max_input_token_len"] = min(cfg.backend.model.max_input_token_len,
                                                args.max_seq_len - 1)
    return cfg.with_overrides(**over)      # validated whole, the overrides applied


def _say(msg: str) -> None:
    say(msg)


def serve(args: argparse.Namespace) -> int:
    """Bind the listeners, load the model, print the banner and serve until SIGINT/SIGTERM or
    ``/stopService`` (:mod:`.lifecycle`)."""
    from .app import check_ports_free
    from .lifecycle import serve as serve_until_stopped
    from .security import tls_files, uses_default_crl, uses_default_paths
    from .server.tls import ensure_certificates, server_context

    setup_logging(args.log_level, args.log_format)
    t0 = time.monotonic()
    cfg = _config_from_args(args)
    s = cfg.server
    check_ports_free(cfg)
    ssl_ctx, files = None, None
    if s.https_enabled:
        files = tls_files(cfg)
        hosts = tuple({s.ip_address, s.management_ip_address} - {"0.0.0.0", "::"})
        if ensure_certificates(files, hosts, may_create=uses_default_paths(cfg),
                               with_crls=uses_default_crl(cfg)):
            _say(f"created a CA and its key, a server and a client certificate"
                 f"{' and an empty CRL' if uses_default_crl(cfg) and files.crls else ''} in "
                 f"{os.path.dirname(os.path.dirname(files.ca[0]))} (first run)")
        ssl_ctx = server_context(files)
    return serve_until_stopped(cfg, ssl_ctx, files, t0, _say, log_bodies=args.log_requests)


def pull(args: argparse.Namespace) -> int:
    from .model.registry import pull as do_pull
    do_pull(args.name, force=args.force, log=_say, tty=sys.stdout.isatty())
    return 0


def list_models(args: argparse.Namespace) -> int:
    from .model.registry import DEFAULT_MODEL, MODELS, model_file
    for m in MODELS.values():
        here = "pulled" if os.path.isfile(model_file(m)) else "not pulled"
        star = " (default)" if m.name == DEFAULT_MODEL else ""
        _say(f"{m.name}{star}\n  {m.description}\n  {m.size / 1e6:.0f} MB, licence {m.licence}, "
             f"from PyPI {m.package}=={m.version}; {here}: {model_file(m)}")
    return 0


def watermark_detect(args: argparse.Namespace) -> int:
    """Print the watermark z-score of a text; exit 0 either way (the verdict is printed)."""
    from .engine.watermark import GAMMA, z_score
    from .model.gguf import GGUFFile
    from .model.registry import DEFAULT_MODEL, resolve
    from .model.tokenizer_load import load_tokenizer

    text = sys.stdin.read() if args.text == "-" else args.text
    if not text.strip():
        print("tiny_mindie: error: watermark-detect needs a non-empty text", file=sys.stderr)
        return 2
    tok = load_tokenizer(GGUFFile(resolve(args.model or DEFAULT_MODEL, log=_say)))
    ids = tok.encode(text, add_bos=False, parse_special=False)
    z, green, scored = z_score(ids, tok.vocab_size)
    verdict = "watermarked" if z > args.threshold else "no watermark found"
    _say(f"z = {z:.2f} (green {green} of {scored} tokens, gamma {GAMMA}): {verdict}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help", "--version")):
        argv.insert(0, "serve")
    parser = build_parser()
    try:
        unknown = apply_env(parser, argv, os.environ)
    except EnvError as exc:
        print(f"tiny_mindie: error: {exc}", file=sys.stderr)
        return 2
    for name in unknown:
        print(f"tiny_mindie: warning: ignoring {name}: no such option (see {argv[0]} --help)",
              file=sys.stderr)
    args = parser.parse_args(argv)
    try:
        if args.command == "certs":
            from .certs import run as certs
            return certs(args)
        return {"serve": serve, "pull": pull, "list-models": list_models,
                "watermark-detect": watermark_detect,
                "health": health_probe.run}[args.command](args)
    except ModelDownloadError as exc:   # the network: the package index, a download
        fail(str(exc))
        return 1
    except CONFIG_ERRORS as exc:
        fail(str(exc))
        return 2
    except OSError as exc:   # e.g. the port is in use
        fail(str(exc.strerror or exc))
        return 1
    except KeyboardInterrupt:
        return 130
