"""Command-line options from the environment: every option of an opted-in subcommand (``serve``,
``health``) has a variable ``TINY_MINDIE_<OPTION_IN_UPPER_SNAKE>`` (``--no-tls`` ->
``TINY_MINDIE_NO_TLS``), derived from the argparse definitions themselves, so an option added
later has its variable at once.

Precedence: a flag on the command line > its variable > the config file > the built-in default.
The variables become the parser's defaults before parsing, so a flag still wins; the config
file is read after parsing, under both.

``--config`` also reads MindIE's ``MIES_CONFIG_JSON_PATH``; ``TINY_MINDIE_CONFIG`` wins when
both are set. An empty variable counts as unset. A switch (``store_true`` option) takes
``1/true/yes/on`` or ``0/false/no/off`` (any case); other values are converted and checked like
the flag's own (type, choices).

Usage: :func:`env_options` marks a subparser (and annotates each option's help with its
variable); :func:`apply_env` (in ``main``, before ``parse_args``) sets the chosen subcommand's
defaults from the environment.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

PREFIX = "TINY_MINDIE_"

#: More variable names for an option (by ``dest``), read when ``TINY_MINDIE_*`` is not set.
ALIASES: dict[str, tuple[str, ...]] = {"config": ("MIES_CONFIG_JSON_PATH",)}

#: ``TINY_MINDIE_*`` variables that are not options (read elsewhere), with what they mean, and
#: the prefix of the test suite's own: not reported as unknown.
OTHER_VARIABLES = {
    "TINY_MINDIE_HOME": "the config home without a config file: its security/ folder holds the "
                        "TLS files (default $XDG_CONFIG_HOME/tiny_mindie, else "
                        "~/.config/tiny_mindie)",
    "TINY_MINDIE_CACHE": "where pulled models and built graphs are kept (default "
                         "$XDG_CACHE_HOME/tiny_mindie, else ~/.cache/tiny_mindie)",
    "TINY_MINDIE_KERNEL_ISA": "the ISA path of tiny_mindie's own kernels (--kernels): "
                              "avx512vnni, avxvnni, avx2, neon or portable (default: the best "
                              "this CPU and its OS run; docs/design/weights.md)",
}
TEST_PREFIX = "TINY_MINDIE_TEST_"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
#: Attribute of the parsed arguments: ``{dest: variable name}`` of the options whose value came
#: from the environment (:func:`env_defaults`), so an error about the value can name the variable.
FROM_ENV = "from_env"
_MARK = "tiny_mindie_env"          # attribute set on an opted-in parser: warn about unknown names
_DONE = "tiny_mindie_env_help"     # attribute set on an action whose help is annotated


EPILOG = ("Each option can also be set by the environment variable shown beside it ([env NAME]; "
          "empty = unset). Precedence: the command line, then the environment, then the config "
          "file, then the built-in default.")


class EnvError(ValueError):
    """A variable's value is not valid for its option; the message names the variable."""


def flag_variable(flag: str) -> str:
    """``--no-tls`` -> ``TINY_MINDIE_NO_TLS``."""
    return PREFIX + flag[2:].replace("-", "_").upper()


def env_name(action: argparse.Action) -> str | None:
    """``TINY_MINDIE_<UPPER_SNAKE>`` of an option's first long flag; ``None`` for positionals,
    ``--help`` and ``--version``."""
    if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return None
    longs = [s for s in action.option_strings if s.startswith("--")]
    if not longs:
        return None
    return flag_variable(longs[0])


def variables(action: argparse.Action) -> tuple[str, ...]:
    """The variables that set ``action``'s option, first the one that wins; ``()``: none."""
    name = env_name(action)
    return () if name is None else (name, *ALIASES.get(action.dest, ()))


def _is_switch(action: argparse.Action) -> bool:
    return isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))


def env_options(parser: argparse.ArgumentParser, *, warn_unknown: bool = False) -> None:
    """Give every option of ``parser`` (a subcommand's) its environment variable: annotate its
    help with the name (and its default when the help does not say it) and mark the parser
    for :func:`apply_env`. Call it after the options are added. ``warn_unknown``: report
    ``TINY_MINDIE_*`` variables that match no option of this parser (``serve``'s).

    Raises:
        TypeError: an option of a kind the environment cannot set (append, count, nargs);
            a programming error, caught by the unit tests.
    """
    setattr(parser, _MARK, warn_unknown)
    if EPILOG not in (parser.epilog or ""):
        parser.epilog = f"{parser.epilog}\n\n{EPILOG}" if parser.epilog else EPILOG
    for action in parser._actions:
        names = variables(action)
        if not names or getattr(action, _DONE, False):
            continue
        if not _is_switch(action) and (not isinstance(action, argparse._StoreAction)
                                       or action.nargs is not None):
            raise TypeError(f"{action.option_strings[0]}: only single-value options and "
                            "switches can come from the environment")
        shown = " or ".join(f"{n}=1" if _is_switch(action) else n for n in names)
        text = action.help or ""
        if "default" not in text.lower():
            if _is_switch(action):
                text += "; default off" if text else "default off"
            elif action.default is not None:
                text += f" (default {action.default})"
        action.help = f"{text} [env {shown}]".strip()
        setattr(action, _DONE, True)


def env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> dict:
    """``{dest: value}`` of the options of ``parser`` whose variable is set (non-empty) in
    ``environ``, converted and checked like the flag would be, and under :data:`FROM_ENV`
    ``{dest: variable name}`` of the same options: the parser's defaults (``set_defaults``).

    Raises:
        EnvError: a value the option does not take, e.g. ``TINY_MINDIE_PORT: invalid int
            value 'x'``; or two switches of one setting both turned on, e.g.
            ``TINY_MINDIE_SPECULATION`` and ``TINY_MINDIE_NO_SPECULATION``.
    """
    out, turned_on, names = {}, {}, {}
    for action in parser._actions:
        name = next((n for n in variables(action) if environ.get(n)), None)
        if name is None:
            continue
        names[action.dest] = name
        raw = environ[name]
        if _is_switch(action):
            word = raw.strip().lower()
            if word not in _TRUE | _FALSE:
                raise EnvError(f"{name}: expected 1/true/yes/on or 0/false/no/off, got {raw!r}")
            if word in _FALSE:
                out.setdefault(action.dest, action.default)
                continue
            other = turned_on.get(action.dest)
            if other is not None and out[action.dest] != action.const:   # --x and --no-x
                raise EnvError(f"{other} and {name} contradict each other; set one of them")
            turned_on[action.dest] = name
            out[action.dest] = action.const
            continue
        try:
            value = action.type(raw) if callable(action.type) else raw
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            kind = getattr(action.type, "__name__", "")
            why = f"invalid {kind} value {raw!r}" if kind else str(exc)
            raise EnvError(f"{name}: {why}") from None
        if action.choices is not None and value not in action.choices:
            raise EnvError(f"{name}: invalid choice {raw!r} (choose from "
                           f"{', '.join(map(str, action.choices))})")
        out[action.dest] = value
    return {**out, FROM_ENV: names} if names else out


def unknown_variables(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> list[str]:
    """``TINY_MINDIE_*`` names in ``environ`` that are no option of ``parser`` and none of
    :data:`OTHER_VARIABLES` (typos such as ``TINY_MINDIE_PROT``)."""
    known = {n for a in parser._actions for n in variables(a)} | set(OTHER_VARIABLES)
    return sorted(n for n in environ if n.startswith(PREFIX) and n not in known
                  and not n.startswith(TEST_PREFIX))


def apply_env(parser: argparse.ArgumentParser, argv: list[str],
              environ: Mapping[str, str]) -> list[str]:
    """Set the defaults of the subcommand ``argv[0]`` of ``parser`` from ``environ``, when that
    subcommand was marked by :func:`env_options`. Returns the unknown ``TINY_MINDIE_*``
    variables to warn about (for a subcommand marked ``warn_unknown``), else ``[]``.

    Raises:
        EnvError: a variable's value is not valid for its option.
    """
    subs = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    sub = subs.choices.get(argv[0]) if subs is not None and argv else None
    if sub is None or not hasattr(sub, _MARK):
        return []
    sub.set_defaults(**env_defaults(sub, environ))
    return unknown_variables(sub, environ) if getattr(sub, _MARK) else []
