"""``python -m tiny_mindie chat``: talk to the model in the terminal.

    python -m tiny_mindie chat [--model NAME|PATH] [--config FILE] [serve's flags] [--verbose]
    python -m tiny_mindie chat --url https://HOST:PORT [--config FILE]
    python -m tiny_mindie chat --prompt TEXT        # or: echo TEXT | python -m tiny_mindie chat

Without ``--url`` the model is loaded in this process as ``serve`` loads it (the same
configuration, flags and loader: :func:`~.lifecycle.load_llm`); with it, a running server's
``/v1/chat/completions`` answers, over mutual TLS with the configuration's client certificate.
Either way each turn goes through the model's chat template (:mod:`.chat_client`).

In a terminal: the answer streams as it is generated; Ctrl-C stops it (the chat goes on with
what was said), Ctrl-D or ``/bye`` quits; a line starting with ``\"\"\"`` opens a block that
the next ``\"\"\"`` closes; the input history is kept in ``chat_history`` under the config home.
Reasoning (a model that thinks) is shown apart, before the answer. Commands: :data:`HELP`.

With ``--prompt`` or a standard input that is no terminal: one answer on stdout (reasoning on
stderr), exit 0; an error is one line on stderr, exit 1 (2: bad configuration).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .chat_client import Answerer, ChatError, Stats

HELP = """commands:
  /help                 this list
  /bye                  quit (or Ctrl-D)
  /reset                forget the conversation (the system prompt stays)
  /system [TEXT]        set the system prompt (no TEXT: show it; /system - clears it)
  /set [NAME VALUE]     set temperature, top_p, top_k, seed or max_tokens (no NAME: show them;
                        VALUE - unsets one)
  /save FILE            write the conversation as OpenAI-style JSON messages
  /load FILE            read a conversation written by /save (or any such JSON list)
  /stats                prompt tokens, cached tokens, TTFT and tokens/s of the last answer
Ctrl-C stops an answer; \"\"\" opens a multi-line block, another \"\"\" closes it."""

#: ``/set`` names: their type and the values they take.
OPTIONS = {"temperature": (float, lambda v: v >= 0, ">= 0"),
           "top_p": (float, lambda v: 0 < v <= 1, "in (0, 1]"),
           "top_k": (int, lambda v: v >= 0, ">= 0"),
           "seed": (int, lambda v: v >= 0, ">= 0"),
           "max_tokens": (int, lambda v: v >= 1, ">= 1")}
PROMPT, MORE = ">>> ", "... "
ROLES = ("system", "user", "assistant")


def add_parser(sub, add_serve_options) -> None:
    """Add ``chat`` to the CLI's subparsers; ``add_serve_options(parser)`` adds serve's
    ``--config`` and settings flags."""
    c = sub.add_parser("chat", help="chat with the model in the terminal (in process, or a "
                                    "running server with --url)",
                       description=__doc__.split("\n\n")[2].replace("``", ""))
    add_serve_options(c)
    c.add_argument("--url", metavar="https://HOST:PORT",
                   help="talk to a running server's /v1/chat/completions instead of loading "
                        "the model (mutual TLS with the configuration's client certificate)")
    c.add_argument("--prompt", metavar="TEXT",
                   help="answer TEXT on stdout and exit (as does text piped on stdin)")
    c.add_argument("--verbose", action="store_true",
                   help="after each answer: prompt and cached tokens, TTFT, tokens/s")
    for name, (kind, _, allowed) in OPTIONS.items():
        c.add_argument("--" + name.replace("_", "-"), type=kind, dest=name, metavar="N",
                       help=f"sampling: {name} ({allowed}; /set changes it)")
    c.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"],
                   help="least severe log records written (default warning)")


def run(args: argparse.Namespace, config) -> int:
    """Carry out ``chat`` with the validated ``config``
    (:class:`~tiny_mindie.config.load.Config`); returns the exit status. Raises what loading
    the model raises (the CLI's ``main`` says it in one line).
    """
    scripted = args.prompt is not None or not sys.stdin.isatty()
    text = None
    if scripted:
        text = args.prompt if args.prompt is not None else sys.stdin.read()
        if not text.strip():
            print("tiny_mindie: error: chat needs a non-empty prompt", file=sys.stderr)
            return 2
    try:
        answerer = _answerer(args, config)
    except ChatError as exc:
        print(f"tiny_mindie: error: {exc}", file=sys.stderr)
        return 1
    options = {name: getattr(args, name) for name in OPTIONS
               if getattr(args, name) is not None}
    for name, value in options.items():
        if not OPTIONS[name][1](value):
            print(f"tiny_mindie: error: --{name.replace('_', '-')} must be {OPTIONS[name][2]}",
                  file=sys.stderr)
            return 2
    try:
        if scripted:
            return _one_answer(answerer, text, options, args.verbose)
        session = Session(answerer, args.verbose)
        session.options = options
        return session.loop()
    finally:
        answerer.close()


def _answerer(args: argparse.Namespace, config) -> Answerer:
    """The server at ``--url``, or the model of ``config`` loaded here (progress on stderr)."""
    from .chat_client import LocalChat, RemoteChat

    if args.url:
        ctx = None
        if args.url.startswith("https:"):
            from ..config.tls import tls_files
            from ..server.tls import client_context
            files = tls_files(config)
            for path in (files.ca[0], files.client_cert, files.client_key):
                if not os.path.isfile(path):
                    raise ChatError(f"{path} is missing (the server's first run, or python -m "
                                    "tiny_mindie certs, makes it; --config FILE names others)")
            try:
                ctx = client_context(files)
            except (OSError, ValueError) as exc:
                raise ChatError(f"the client certificate {files.client_cert}: {exc}") from None
        return RemoteChat(args.url, ctx)
    from ..service.lifecycle import check_model_files, load_llm

    check_model_files(config)
    return LocalChat(load_llm(config, lambda line: print(line, file=sys.stderr, flush=True)))


def _one_answer(answerer: Answerer, text: str, options: dict, verbose: bool) -> int:
    """``--prompt`` / piped text: the answer on stdout, reasoning on stderr."""
    said = []

    def on_piece(kind: str, piece: str) -> None:
        out = sys.stdout if kind == "content" else sys.stderr
        out.write(piece)
        out.flush()
        said.append(kind)

    try:
        stats = answerer.answer([{"role": "user", "content": text}], options, on_piece)
    except ChatError as exc:
        print(("\n" if said else "") + f"tiny_mindie: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    sys.stdout.write("\n")
    if verbose:
        print(stats.line(), file=sys.stderr)
    return 0


class Session:
    """An interactive chat: the conversation, the ``/set`` options, the terminal's I/O."""

    def __init__(self, answerer: Answerer, verbose: bool = False):
        self.answerer = answerer
        self.verbose = verbose
        self.system: str | None = None
        self.messages: list[dict] = []        # user and assistant turns
        self.options: dict = {}
        self.last: Stats | None = None
        self.tty = sys.stdout.isatty()
        self.history = _History()

    def loop(self) -> int:
        """Read and answer until Ctrl-D or ``/bye``; returns 0."""
        print(f"chatting with {self.answerer.model}; /help for commands, /bye or Ctrl-D to "
              "quit", flush=True)
        try:
            while True:
                try:
                    line = self.read()
                except KeyboardInterrupt:
                    print("\n(Ctrl-D or /bye quits)", flush=True)
                    continue
                except EOFError:
                    print(flush=True)
                    return 0
                if line.strip() == "/bye":
                    return 0
                if line.startswith("/"):
                    self.command(line.strip())
                elif line.strip():
                    self.turn(line)
        finally:
            self.history.save()

    def read(self) -> str:
        """One input: a line, or a ``\"\"\"`` block (its lines joined, the quotes dropped)."""
        line = input(PROMPT)
        if not line.lstrip().startswith('"""'):
            return line
        rest = line.lstrip()[3:]
        if rest.rstrip().endswith('"""') and rest.strip():
            return rest.rstrip()[:-3]
        lines = [rest] if rest else []
        while True:
            more = input(MORE)
            if more.rstrip().endswith('"""'):
                lines.append(more.rstrip()[:-3])
                return "\n".join(lines).strip("\n")
            lines.append(more)

    def conversation(self) -> list[dict]:
        """The messages sent: the system prompt first when set."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def turn(self, text: str) -> None:
        """Answer ``text``; Ctrl-C stops the answer, keeping what was said of it."""
        self.messages.append({"role": "user", "content": text})
        shown = _Shown(self.tty)
        try:
            self.last = self.answerer.answer(self.conversation(), self.options, shown.piece)
        except KeyboardInterrupt:
            shown.end()
            print("(stopped)", flush=True)
        except ChatError as exc:
            shown.end()
            print(f"error: {exc}", file=sys.stderr, flush=True)
            self.messages.pop()
            return
        else:
            shown.end()
            if self.verbose:
                print(self.last.line(), file=sys.stderr, flush=True)
        self.messages.append({"role": "assistant", "content": "".join(shown.content)})

    def command(self, line: str) -> None:
        """A ``/`` command (:data:`HELP`); an unknown one says so."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        handlers = {"/help": lambda: print(HELP), "/reset": self.reset,
                    "/system": lambda: self.set_system(arg), "/set": lambda: self.set(arg),
                    "/save": lambda: self.save(arg), "/load": lambda: self.load(arg),
                    "/stats": lambda: print(self.last.line() if self.last else
                                            "no answer yet")}
        handler = handlers.get(name)
        if handler is None:
            print(f"unknown command {name}; /help lists them")
        else:
            handler()
        sys.stdout.flush()

    def reset(self) -> None:
        self.messages = []
        print("conversation cleared")

    def set_system(self, text: str) -> None:
        if not text:
            print(f"system prompt: {self.system!r}" if self.system else "no system prompt")
            return
        self.system = None if text == "-" else text
        print("system prompt cleared" if self.system is None else "system prompt set")

    def set(self, arg: str) -> None:
        """``/set NAME VALUE`` (``-``: unset), or the options in force."""
        if not arg:
            print(", ".join(f"{k} {v}" for k, v in self.options.items()) or "defaults")
            return
        name, _, value = arg.partition(" ")
        value = value.strip()
        if name not in OPTIONS or not value:
            print(f"usage: /set NAME VALUE with NAME one of {', '.join(OPTIONS)}")
            return
        if value == "-":
            self.options.pop(name, None)
            print(f"{name} unset")
            return
        kind, ok, allowed = OPTIONS[name]
        try:
            number = kind(value)
        except ValueError:
            number = None
        if number is None or not ok(number):
            print(f"{name} must be {'an integer' if kind is int else 'a number'} {allowed}")
            return
        self.options[name] = number
        print(f"{name} {number}")

    def save(self, path: str) -> None:
        if not path:
            print("usage: /save FILE")
            return
        try:
            with open(os.path.expanduser(path), "w", encoding="utf-8") as fh:
                json.dump(self.conversation(), fh, ensure_ascii=False, indent=1)
        except OSError as exc:
            print(f"cannot write {path}: {exc.strerror or exc}")
            return
        print(f"saved {len(self.conversation())} messages to {path}")

    def load(self, path: str) -> None:
        if not path:
            print("usage: /load FILE")
            return
        try:
            with open(os.path.expanduser(path), encoding="utf-8") as fh:
                messages = check_messages(json.load(fh))
        except OSError as exc:
            print(f"cannot read {path}: {exc.strerror or exc}")
            return
        except ValueError as exc:
            print(f"{path}: {exc}")
            return
        self.system = next((m["content"] for m in messages if m["role"] == "system"), None)
        self.messages = [m for m in messages if m["role"] != "system"]
        print(f"loaded {len(messages)} messages from {path}")
        for m in self.messages:
            print(f"{m['role']}: {m['content']}")


def check_messages(obj) -> list[dict]:
    """``obj`` as chat messages: a JSON list of ``{"role", "content"}`` objects, roles
    :data:`ROLES`, contents strings.

    Raises:
        ValueError: naming the first message that is not one (``json.JSONDecodeError`` is one
            too).
    """
    if not isinstance(obj, list):
        raise ValueError("not a JSON list of messages")
    for i, m in enumerate(obj):
        if not (isinstance(m, dict) and m.get("role") in ROLES
                and isinstance(m.get("content"), str)):
            raise ValueError(f"message {i} is not {{\"role\": one of {', '.join(ROLES)}, "
                             "\"content\": a string}")
    return [{"role": m["role"], "content": m["content"]} for m in obj]


class _Shown:
    """An answer as it is printed: reasoning dimmed between ``Thinking...`` and ``...done
    thinking.``, then the content (kept for the conversation)."""

    def __init__(self, tty: bool):
        self.tty = tty
        self.content: list[str] = []
        self.thinking = False
        self.any = False

    def piece(self, kind: str, text: str) -> None:
        if kind == "reasoning" and not self.thinking:
            self.thinking = True
            self._write(("\x1b[2m" if self.tty else "") + "Thinking...\n")
        elif kind == "content" and self.thinking:
            self.thinking = False
            self._write("\n...done thinking.\n" + ("\x1b[0m" if self.tty else "") + "\n")
        if kind == "content":
            self.content.append(text)
        self._write(text)

    def _write(self, text: str) -> None:
        self.any = True
        sys.stdout.write(text)
        sys.stdout.flush()

    def end(self) -> None:
        """Close the answer's line (and the dimming)."""
        if self.thinking and self.tty:
            sys.stdout.write("\x1b[0m")
        sys.stdout.write("\n" if self.any else "")
        sys.stdout.flush()


class _History:
    """Readline's line editing, with the history in ``chat_history`` under the config home
    (mode 0600; nothing where Python has no ``readline``)."""

    LENGTH = 1000

    def __init__(self):
        from ..config.load import config_home

        self.path = os.path.join(config_home(), "chat_history")
        try:
            import readline
        except ImportError:
            self.readline = None
            return
        self.readline = readline
        readline.set_history_length(self.LENGTH)
        try:
            readline.read_history_file(self.path)
        except OSError:
            pass

    def save(self) -> None:
        if self.readline is None:
            return
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.readline.write_history_file(self.path)
            os.chmod(self.path, 0o600)          # the prompts are the user's business
        except OSError as exc:
            print(f"tiny_mindie: warning: history not saved: {exc.strerror or exc}",
                  file=sys.stderr)
