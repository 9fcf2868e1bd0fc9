"""tiny_mindie: a small LLM inference server speaking Huawei MindIE Service's HTTP API."""

from ._version import __version__

__all__ = ["LLM", "GenerationParams", "__version__"]


def __getattr__(name):  # lazy: ``import tiny_mindie`` stays cheap for the CLI's --help
    if name == "LLM":
        from .llm import LLM
        return LLM
    if name == "GenerationParams":
        from .llm import GenerationParams
        return GenerationParams
    raise AttributeError(name)
