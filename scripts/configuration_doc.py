#!/usr/bin/env python
"""The reference ``docs/configuration.md``, made from the settings table
(:data:`tiny_mindie.config.settings.SETTINGS`) and the ``serve`` flags:

    python scripts/configuration_doc.py > docs/configuration.md

``tests/unit/test_cli_config.py`` checks that the committed file is what this prints."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tiny_mindie.cli.main import serve_parser  # noqa: E402
from tiny_mindie.config.env import EPILOG, OTHER_VARIABLES, flag_variable, variables  # noqa: E402
from tiny_mindie.config.settings import SETTINGS, Setting  # noqa: E402


def _shown(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, tuple):
        return "[" + ", ".join(f'"{x}"' if isinstance(x, str) else str(x) for x in v) + "]"
    if isinstance(v, float):
        return f"{v:g}"
    return f'"{v}"' if isinstance(v, str) else str(v)


def _allowed(s: Setting) -> str:
    if s.choices:
        return ", ".join(s.choices)
    if s.kind == "port":
        return "0 or 1024..65535"
    if s.low is not None:
        return f"{_shown(s.low)}..{_shown(s.high)}{s.unit}"
    return ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _settings_table(section: str) -> list[str]:
    rows = ["| Key | Default | Allowed | Flag, variable | Meaning |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        if s.section != section:
            continue
        default = f"`{s.default_from.partition('.')[2]}`'s" if s.default_from else \
            f"`{_shown(s.default)}`"
        flags = "<br>".join(f"`{f.name}`, `{flag_variable(f.name)}"
                            f"{'' if f.sets is None else '=1'}`" for f in s.flags)
        key = f"`{s.leaf}`" + (" (tiny_mindie)" if s.ours else "")
        rows.append(f"| {key} | {default} | {_cell(_allowed(s))} | {flags} | {_cell(s.help)} |")
    return rows


def markdown(serve_parser: argparse.ArgumentParser) -> str:
    """``docs/configuration.md``: the settings by section, then every ``serve`` option with
    its variables (from ``serve_parser``, whose flags :func:`add_flags` made)."""
    out = ["# Configuration reference", "",
           "Generated from `tiny_mindie/config/settings.py` by "
           "`python scripts/configuration_doc.py > docs/configuration.md`; do not edit.", "",
           "A MindIE-style `config.json` (`--config FILE`) holds the settings below; keys "
           "marked (tiny_mindie) are this project's own, other keys MindIE defines are ignored. "
           "Relative paths are resolved against the file's folder. Without a file the built-in "
           "defaults apply. Cross-key rules: `maxPrefillTokens` >= the effective "
           "`maxInputTokenLen`, `maxPrefillBatchSize` <= `maxBatchSize`, `healthPort` differs "
           "from the other ports, `weights` compact needs the onnxruntime backend and the "
           "contrib graph, a `graph` other than auto needs the onnxruntime backend.", ""]
    for section in dict.fromkeys(s.section for s in SETTINGS):
        out += [f"## `{section}`", "", *_settings_table(section), ""]
    out += ["## Command line and environment", "", EPILOG, "",
            "| Flag | Variable | Meaning |", "|---|---|---|"]
    for action in serve_parser._actions:
        names = variables(action)
        if names:
            text = (action.help or "").split(" [env ")[0]
            out.append(f"| {', '.join(f'`{o}`' for o in action.option_strings)} | "
                       f"{', '.join(f'`{n}`' for n in names)} | {_cell(text)} |")
    out += ["", "## Other variables", "", "| Variable | Meaning |", "|---|---|"]
    out += [f"| `{name}` | {_cell(text)} |" for name, text in OTHER_VARIABLES.items()]
    return "\n".join(out) + "\n"


def main() -> int:
    """Print the reference (docs/configuration.md)."""
    sys.stdout.write(markdown(serve_parser()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
