"""Model files, the backends that run them, and the registry that pulls them.

The backends' names are here rather than in :mod:`.backend` so that the configuration can name
them without importing numpy (``python -m tiny_mindie health`` reads the configuration and must
start in a few tens of milliseconds).
"""

BACKENDS = ("onnxruntime", "numpy")
DEFAULT_BACKEND = "onnxruntime"   # the numpy decoder is the reference and the fallback

#: The weight modes of the onnxruntime backend (``--weights``), as ``GraphOptions.compact``:
#: ``exact`` keeps the GGUF's own blocks, ``compact`` requantizes every matrix to 4-bit blocks
#: of 64 (docs/design/weights.md).
WEIGHT_MODES = {"exact": 0, "compact": 64}
#: the onnxruntime backend's graph choices (``auto``: ``standard`` on the CANN execution
#: provider, ``contrib`` elsewhere; see :mod:`.graph` and :mod:`.graph_standard`)
GRAPH_FLAVOURS = ("auto", "contrib", "standard")
#: the matrix-product kernels of the onnxruntime backend's contrib graph (``--kernels``):
#: onnxruntime's ``MatMulNBits``, tiny_mindie's own on the GGUF's blocks
#: (:mod:`tiny_mindie.kernels`), or ``auto`` (the own kernels where the library loads)
KERNEL_MODES = ("onnxruntime", "custom", "auto")
#: the standard graph's dtypes (``--standard-dtype``; :data:`.graph_standard.DTYPES`): its
#: weights, KV cache and matrix products; the default first
STANDARD_DTYPES = ("float16", "float32")
