"""Weight bytes: what a built graph keeps resident and reads per decoded token, and what
llama.cpp reads per token of the same GGUF.

At batch 1, decode reads every matrix once per token, so ``tokens/s x bytes read per token``
is bounded by the machine's memory read bandwidth; these counts are the bytes side of that
product (``scripts/bench.py`` measures the bandwidth and prints each engine's share of it).

The graph's counts follow how onnxruntime's CPU kernels (MLAS, 1.24) hold a ``MatMulNBits``
weight once prepacked: the packed ``bits``-bit data, a float32 scale per block, and, for
``accuracy_level`` 4 (int8 activations), a float32 block sum per block with ``N`` rounded up
to 16 (MLAS ``QNBitGemmPackQuantBDataSize``, ``SQNBIT_CompInt8``), in place of the zero points;
other levels keep the scales and zero points as given. Every other initializer counts at its
stored size (a ``MatMulGGUF``'s GGUF blocks as they are). A table read by rows (a gather's data
and scales: the token embedding; the rotary cos/sin caches of ``GroupQueryAttention``) counts as
resident but not as read per token: a step reads only the rows of its tokens and positions --
unless another node reads it whole (a tied LM head sharing the embedding's GGUF blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tiny_mindie.model.gguf import GGUFFile

#: Operators that read only some rows of their tables (one per token or position): the
#: operator and the positions of its inputs read that way.
ROW_READS = {"Gather": (0,), "GatherElements": (0,), "GatherND": (0,),
             "GatherBlockQuantized": (0, 2, 3), "GatherGGUF": (0,),
             "GroupQueryAttention": (7, 8)}


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of weights: ``resident`` (held by the engine once loaded) and ``per_token`` (read
    by one batch-1 decode step); ``matrices``: the part of ``per_token`` that is matrix
    products (``MatMulNBits``, or every quantized GGUF matrix)."""

    resident: int
    per_token: int
    matrices: int


def _mlas_packed_bytes(node, shapes: dict[str, tuple[int, ...]]) -> int:
    """A ``MatMulNBits`` weight's bytes once MLAS prepacks it (see the module docstring)."""
    a = {x.name: x for x in node.attribute}
    n, k = a["N"].i, a["K"].i
    bits, block = a["bits"].i, a["block_size"].i
    level = a["accuracy_level"].i if "accuracy_level" in a else 0
    blocks = -(-k // block)
    data = n * blocks * block * bits // 8
    scales = n * blocks * 4
    if level == 4:
        return data + scales + -(-n // 16) * 16 * blocks * 4
    zp = 0
    if len(node.input) > 3 and node.input[3]:
        zp = int(np.prod(shapes.get(node.input[3], (0,))))
    return data + scales + zp


def _nodes(graph):
    """Every node of ``graph`` and of its subgraphs (``If`` branches)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.g is not None and attr.g.node:
                yield from _nodes(attr.g)


def graph_weight_bytes(path: str) -> WeightBytes:
    """The weights of the ONNX graph at ``path`` (a ``model.onnx`` of the graph cache, its
    external data not read), counted as the module docstring says.

    Raises:
        OSError: ``path`` cannot be read; ``onnx.onnx_cpp2py_export.checker`` errors for a file
            that is not an ONNX model.
    """
    import onnx

    model = onnx.load(path, load_external_data=False)
    dtype_size = {t: np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t)).itemsize
                  for t in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                            onnx.TensorProto.UINT8, onnx.TensorProto.INT8,
                            onnx.TensorProto.INT64, onnx.TensorProto.INT32)}
    shapes = {t.name: tuple(t.dims) for t in model.graph.initializer}
    sizes = {t.name: int(np.prod(t.dims, dtype=np.int64)) * dtype_size.get(t.data_type, 4)
             for t in model.graph.initializer}
    counted: dict[str, tuple[int, bool, bool]] = {}     # name -> (bytes, read per token, matrix)
    for node in _nodes(model.graph):
        if node.op_type == "MatMulNBits":
            packed = _mlas_packed_bytes(node, shapes)
            for name in node.input[1:4]:
                counted.setdefault(name, (0, True, True))
            counted[node.input[1]] = (packed, True, True)
            continue
        for j, name in enumerate(node.input):
            if name not in sizes:
                continue
            whole = j not in ROW_READS.get(node.op_type, ())
            matrix = node.op_type == "MatMulGGUF" and j == 1
            if name not in counted or whole and not counted[name][1]:
                counted[name] = (sizes[name], whole, matrix)
    resident = sum(b for b, _, _ in counted.values())
    per_token = sum(b for b, read, _ in counted.values() if read)
    matrices = sum(b for b, read, mat in counted.values() if read and mat)
    return WeightBytes(resident, per_token, matrices)


def gguf_weight_bytes(f: GGUFFile) -> WeightBytes:
    """What llama.cpp holds and reads per decoded token of ``f``: every tensor at its GGUF size;
    per token all but the token embedding, which it gathers, unless the model has no
    ``output.weight`` (tied embeddings: the embedding is the LM head and is read whole)."""
    total = per_token = matrices = 0
    tied = not f.has_tensor("output.weight")
    for name in f.tensor_names():
        raw = f.raw(name)
        size = int(raw.data.nbytes)
        total += size
        if name == "token_embd.weight" and not tied:
            continue
        per_token += size
        if len(raw.shape) == 2:
            matrices += size
    return WeightBytes(total, per_token, matrices)
