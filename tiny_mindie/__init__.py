"""tiny_mindie: a small LLM inference server speaking Huawei MindIE Service's HTTP API."""

__version__ = "0.1.0"
