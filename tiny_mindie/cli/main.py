"""Command line: ``python -m tiny_mindie [serve] ...``, ``chat``, ``pull NAME``,
``list-models``, ``certs``, ``health``, ``watermark-detect``, ``check-graph``.

Bad configuration, a missing model file or a busy port end with one line on stderr and a
non-zero exit status; never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from .._version import __version__
from ..config.env import EnvError, apply_env, env_options
from ..config.load import Config, ConfigError, load_config
from ..config.settings import add_flags, with_flags
from ..model.gguf import ModelFileError
from ..model.registry.catalog import ModelDownloadError
from ..server.listen import AddressError
from ..server.tls import TLSConfigError
from ..service.logs import add_log_options, fail, say
from ..service.logs import setup as setup_logging
from . import check_graph, health

# Bad configuration, found by the config loader, the TLS set-up or the listen addresses: one line
# on stderr and exit status 2.
CONFIG_ERRORS = (ConfigError, TLSConfigError, AddressError, ModelFileError)

COMMANDS = ("serve", "chat", "pull", "list-models", "watermark-detect", "certs", "health",
            "check-graph")
# Subcommands whose options also come from TINY_MINDIE_* variables (config/env.py), and whether
# an unknown TINY_MINDIE_* variable is reported to them.
ENV_COMMANDS = {"serve": True, "chat": False, "health": False}


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
                           metavar="{serve,chat,pull,list-models,watermark-detect,certs,health,"
                                   "check-graph}")
    _add_serve(sub.add_parser("serve", help="serve the HTTP API (the default)"))
    from .chat import add_parser as add_chat
    add_chat(sub, _add_config_and_flags)
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
    health.add_arguments(sub.add_parser(
        "health", help="exec probe: exit 0 when the server here answers its health route "
                       "with 200, else 1 (2: a usage error)"))
    check_graph.add_arguments(sub.add_parser(
        "check-graph", help="where the graph's nodes run (CANN or CPU) and whether its greedy "
                            "tokens are the numpy reference's (exit 1 if not)"))
    for name, warn in ENV_COMMANDS.items():     # last: every option of theirs gets a variable
        if name in sub.choices:
            env_options(sub.choices[name], warn_unknown=warn)
    return p


def _add_serve(s: argparse.ArgumentParser) -> None:
    """``serve``'s options: ``--config``, the settings' flags (:mod:`..config.settings`),
    logging."""
    _add_config_and_flags(s)
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="least severe log records written")
    add_log_options(s)


def _add_config_and_flags(s: argparse.ArgumentParser) -> None:
    """``--config`` and the settings' flags (``serve``'s and ``chat``'s)."""
    s.add_argument("--config", metavar="FILE",
                   help="MindIE-style config.json; relative paths in it (TLS files) are resolved "
                        "against its folder (default: none, the built-in settings)")
    add_flags(s)


def serve_parser() -> argparse.ArgumentParser:
    """``serve``'s parser as :func:`main` uses it (its options' variables annotated)."""
    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subs.choices["serve"]


def _config_from_args(args: argparse.Namespace) -> Config:
    """The config file of ``args`` (or the defaults) with the flags given over it, validated
    (:func:`tiny_mindie.config.settings.with_flags`: a bad value names its flag or variable)."""
    return with_flags(load_config(args.config), args)


def _say(msg: str) -> None:
    say(msg)


def serve_command(args: argparse.Namespace) -> int:
    """Bind the listeners, load the model, print the banner and serve until SIGINT/SIGTERM or
    ``/stopService`` (:mod:`tiny_mindie.service.lifecycle`)."""
    from ..config.tls import (
        check_before_creating,
        check_certificates,
        listen_hosts,
        tls_files,
        uses_default_crl,
        uses_default_paths,
    )
    from ..server.tls import ensure_certificates, server_context
    from ..service.app import check_ports_free
    from ..service.lifecycle import run_server

    setup_logging(args.log_level, args.log_format)
    t0 = time.monotonic()
    cfg = _config_from_args(args)
    s = cfg.server
    check_ports_free(cfg)
    ssl_ctx, files = None, None
    if s.https_enabled:
        files = tls_files(cfg)
        hosts = listen_hosts(cfg)
        check_before_creating(cfg, files)
        if ensure_certificates(files, hosts, may_create=uses_default_paths(cfg),
                               with_crls=uses_default_crl(cfg)):
            _say(f"created a CA and its key, a server and a client certificate"
                 f"{' and an empty CRL' if uses_default_crl(cfg) and files.crls else ''} in "
                 f"{os.path.dirname(os.path.dirname(files.ca[0]))} (first run)")
        for warning in check_certificates(files, hosts):
            logging.getLogger("tiny_mindie.tls").warning("%s", warning)
        ssl_ctx = server_context(files)
    return run_server(cfg, ssl_ctx, files, t0, _say, log_bodies=args.log_requests)


def pull(args: argparse.Namespace) -> int:
    from ..model.registry.catalog import pull as do_pull
    do_pull(args.name, force=args.force, log=_say, tty=sys.stdout.isatty())
    return 0


def list_models(args: argparse.Namespace) -> int:
    from ..model.registry.catalog import DEFAULT_MODEL, MODELS, model_file
    for m in MODELS.values():
        here = "pulled" if os.path.exists(model_file(m)) else "not pulled"
        star = " (default)" if m.name == DEFAULT_MODEL else \
            " (embedding: --embedding-model)" if m.task == "embedding" else ""
        _say(f"{m.name}{star}\n  {m.description}\n  {m.size / 1e6:.0f} MB, licence {m.licence}, "
             f"from PyPI {m.package}=={m.version}; {here}: {model_file(m)}")
    return 0


def watermark_detect(args: argparse.Namespace) -> int:
    """Print the watermark z-score of a text; exit 0 either way (the verdict is printed)."""
    from ..engine.watermark import GAMMA, z_score
    from ..model.gguf import GGUFFile
    from ..model.registry.catalog import DEFAULT_MODEL, resolve
    from ..model.tokenizer_load import load_tokenizer

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
        if args.command == "chat":
            from .chat import run as chat
            setup_logging(args.log_level)
            return chat(args, _config_from_args(args))
        return {"serve": serve_command, "pull": pull, "list-models": list_models,
                "watermark-detect": watermark_detect,
                "check-graph": lambda a: check_graph.run(a, _say),
                "health": health.run}[args.command](args)
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
