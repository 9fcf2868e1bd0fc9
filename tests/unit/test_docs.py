"""The documentation: README.md, docs/*.md and docs/design/*.md.

The README stays short (at most 400 lines) and says how to get the source before installing;
its test command is the one ``.ci/run`` runs; every relative link in the README and in docs/
points to a file that exists, and every ``#anchor`` to a heading of that file; no commit
hashes or review notes in user documentation; docs/design/architecture.md's module table names every
module of ``tiny_mindie/`` and no other, and its request path is at most 10 steps, each function
it names one that exists.
"""

from __future__ import annotations

import glob
import importlib
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(REPO, "README.md")
ARCHITECTURE = os.path.join(REPO, "docs", "design", "architecture.md")
PACKAGE = os.path.join(REPO, "tiny_mindie")
PAGES = [README] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))) \
    + sorted(glob.glob(os.path.join(REPO, "docs", "design", "*.md")))

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`]*`")
HEX40 = re.compile(r"\b[0-9a-f]{40}\b")
SHORT_HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
MODULE_PATH = re.compile(r"`((?:\w+/)*\w+\.py)`")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces -> ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated heading gets ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in _prose_lines(_read(path)):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: str) -> list[tuple[int, str]]:
    """(line number, target) of the relative links of a Markdown file, outside code."""
    found = []
    for number, line in _prose_lines(_read(path)):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):     # http:, https:, mailto: ...
                found.append((number, target))
    return found


def broken_links(path: str) -> list[str]:
    bad = []
    for number, target in links(path):
        file_part, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part \
            else path
        where = f"{os.path.relpath(path, REPO)}:{number}: {target}"
        if not os.path.exists(dest):
            bad.append(f"{where} (no such file)")
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            bad.append(f"{where} (no such heading)")
    return bad


def test_the_readme_is_at_most_400_lines():
    assert len(_read(README).splitlines()) <= 400


def test_the_readme_says_how_to_get_the_source_before_installing():
    text = _read(README)
    assert "git clone" in text
    assert text.index("git clone") < text.index("pip install")


def test_the_readmes_test_command_is_the_one_ci_runs():
    ci = [line for line in _read(os.path.join(REPO, ".ci", "run")).splitlines()
          if "python -m pytest" in line]
    assert ci and ci[-1] in _read(README)


@pytest.mark.parametrize("path", PAGES, ids=lambda p: os.path.relpath(p, REPO))
def test_every_relative_link_reaches_a_file_and_heading(path):
    assert broken_links(path) == []


@pytest.mark.parametrize("path", PAGES, ids=lambda p: os.path.relpath(p, REPO))
def test_no_commit_hashes_or_review_notes(path):
    bad = []
    for number, line in enumerate(_read(path).splitlines(), 1):
        if re.search(r"review(er|ed)\b", line, re.I):
            bad.append(f"{number}: review note: {line.strip()}")
        if HEX40.search(line) or (re.search(r"\bcommit", line, re.I) and SHORT_HASH.search(line)):
            bad.append(f"{number}: commit hash: {line.strip()}")
    assert bad == []


def test_the_checks_can_fail(tmp_path):
    """A broken link, a missing heading and a good link and heading, in a page of their own."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading: yes\n")
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[a](other.md#a-code-heading-yes) [b](missing.md) "
                    "[c](other.md#nope) [d](#title) [e](https://example.com/x)\n"
                    "```\n[f](inside-code.md)\n```\n")
    assert broken_links(str(page)) == [
        f"{os.path.relpath(str(page), REPO)}:3: missing.md (no such file)",
        f"{os.path.relpath(str(page), REPO)}:3: other.md#nope (no such heading)",
    ]
    assert slug("MindIE /infer") == "mindie-infer"
    assert slug("TGI and vLLM 0.2") == "tgi-and-vllm-02"


def package_modules(package: str) -> set[str]:
    """Every ``.py`` file under ``package``, as a path relative to it (``server/http.py``)."""
    return {os.path.relpath(path, package).replace(os.sep, "/")
            for path in glob.glob(os.path.join(package, "**", "*.py"), recursive=True)}


def module_table_drift(page: str, package: str) -> list[str]:
    """What the tables of the ``## Modules`` section of ``page`` get wrong against the files of
    ``package``: a module no row names in its first cell, or a row naming a ``.py`` path that is
    no module."""
    section = re.search(r"^## Modules\n(.*?)(?=^## |\Z)", _read(page), re.M | re.S)
    rows = [line.split("|")[1] for line in section.group(1).splitlines()
            if line.startswith("|")] if section else []
    named = {name for cell in rows for name in MODULE_PATH.findall(cell)}
    modules = package_modules(package)
    return [f"not in the table: {m}" for m in sorted(modules - named)] + \
           [f"no such module: {m}" for m in sorted(named - modules)]


def test_the_architecture_names_every_module_of_the_package():
    assert module_table_drift(ARCHITECTURE, PACKAGE) == []


def test_the_module_table_check_can_fail(tmp_path):
    """A module left out and a row for one that is gone are both caught."""
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    for name in ("pkg/__init__.py", "pkg/kept.py", "pkg/sub/new.py"):
        (tmp_path / name).write_text("")
    page = tmp_path / "architecture.md"
    page.write_text("# A\n\n## Modules\n\nSee `sub/new.py`.\n\n| module | job |\n|---|---|\n"
                    "| `__init__.py`, `kept.py` | x |\n| `sub/gone.py` | `sub/new.py` |\n\n"
                    "## Later\n\n| `sub/new.py` | outside the section |\n")
    assert module_table_drift(str(page), str(tmp_path / "pkg")) == [
        "not in the table: sub/new.py", "no such module: sub/gone.py"]


# ---- the request path ------------------------------------------------------------------------
# `server/listen.TCPListener._accept`, `drive.merged`, `LLM.stream_async`: a module (its path
# under tiny_mindie/, or the last part of one named before) or a class named before, then names
STEP_REFERENCE = re.compile(r"`([\w/]+(?:\.\w+)+)`")


def request_path(page: str) -> str:
    """The section "A request, top to bottom" of ``page``."""
    text = _read(page)
    return text.split("## A request, top to bottom", 1)[1].split("\n## ", 1)[0]


def path_drift(section: str) -> list[str]:
    """What is wrong with a request path: more than 10 numbered steps (or none), and each
    ``module.function`` it names that the package does not have."""
    steps = re.findall(r"^\d+\. ", section, re.M)
    bad = [] if 1 <= len(steps) <= 10 else [f"{len(steps)} steps"]
    known: dict[str, object] = {}
    for ref in STEP_REFERENCE.findall(section):
        if ref.endswith(".py"):     # a file
            continue
        head, *names = ref.split(".")
        if "/" in head or head not in known:
            try:
                known[head.rsplit("/", 1)[-1]] = obj = importlib.import_module(
                    "tiny_mindie." + head.replace("/", "."))
            except ImportError:
                bad.append(f"no such module: {ref}")
                continue
        else:
            obj = known[head]
        for name in names:
            obj = getattr(obj, name, None)
            if isinstance(obj, type):
                known[obj.__name__] = obj
        if obj is None:
            bad.append(f"no such function: {ref}")
    return bad


def test_the_request_path_is_ten_steps_naming_functions_that_exist():
    assert path_drift(request_path(ARCHITECTURE)) == []


def test_the_request_path_check_can_fail():
    """Eleven steps, a module that is gone and a function that is gone are all caught."""
    steps = "".join(f"{i}. step\n" for i in range(1, 12))
    assert path_drift(steps + "`api/drive.send_stream`, `drive.gone`, `api/gone.f`, "
                      "`server/routing.Router.handler_for`, `Router.nothing`") == [
        "11 steps", "no such function: drive.gone", "no such module: api/gone.f",
        "no such function: Router.nothing"]
