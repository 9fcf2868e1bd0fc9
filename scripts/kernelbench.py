"""Microbenchmark of tiny_mindie's GGUF kernels (tiny_mindie/kernels) against onnxruntime's
``MatMulNBits`` (MLAS: 4-bit, blocks of 32, int8 activations: ``accuracy_level`` 4) on the
matrices of a model's shapes, one product at a time, interleaved::

    python scripts/kernelbench.py [--types Q4_K,Q6_K] [--rows 1,2,4,8,64] [--threads 1]
                                  [--rounds 7] [--model FILE]
                                  [--json docs/design/results/kernelbench-NAME.json [--plot FIG]]

For each matrix shape ``N x K`` (default: Qwen2.5-Coder-1.5B's 1536x1536, 256x1536, 8960x1536,
1536x8960), each type and each row count ``M``, it times three products on random weights:

    ctypes    ``kernels.matmul`` (the library's direct entry, ``threads`` threads)
    op        the custom operator ``tiny_mindie::MatMulGGUF`` in a one-node onnxruntime graph
    mlas      ``MatMulNBits`` (4 bits, blocks of 32, ``accuracy_level`` 4) in a one-node graph

Each round runs every case once (a batch of calls, the median call kept), so a change of the
host's load touches all alike; a case's time is the median over rounds. The printed table and
the results file (kind ``kernelbench``, scripts/results.py) give each time and its ratios:
``vs_mlas`` (op / mlas at the same M) and ``vs_m1`` (op at M / op at M=1).

Results rows: ``{"type", "N", "K", "M", "ctypes_ms", "op_ms", "mlas_ms", "vs_mlas", "vs_m1"}``.

``--model FILE`` (a .gguf or a registry name) adds whole decode steps of that model on the
onnxruntime backend with its default kernels, interleaved with the products: ``M`` sequences
of 64 cached tokens each decode one token in one forward pass (``--threads`` threads), so the
model's weights are read from memory once per step, as in the server's continuous batching.
Their rows have ``"type": "step"``, ``N`` and ``K`` null, the step's time in ``op_ms``
(``ctypes_ms``, ``mlas_ms`` and ``vs_mlas`` null) and ``vs_m1`` the ratio to one sequence.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import results  # noqa: E402

from tiny_mindie import kernels  # noqa: E402

SHAPES = ((1536, 1536), (256, 1536), (8960, 1536), (1536, 8960))


def random_blocks(qtype: str, n: int, k: int, rng) -> np.ndarray:
    """Random blocks of ``qtype`` with finite float16 fields (uint8 ``[n, row bytes]``)."""
    elems, size = kernels.BLOCKS[qtype]
    b = rng.integers(0, 256, (n, k // elems, size), dtype=np.uint8)
    f16 = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2],
           "Q6_K": [208]}[qtype]
    for off in f16:
        d = (rng.standard_normal((n, k // elems)) * 0.02).astype(np.float16)
        b[..., off:off + 2] = d.view(np.uint8).reshape(n, k // elems, 2)
    return b.reshape(n, -1)


def _session(model, threads: int, custom: bool):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    if custom:
        so.register_custom_ops_library(kernels.library_path())
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def op_session(qtype: str, w: np.ndarray, n: int, k: int, threads: int):
    """A one-node graph of ``MatMulGGUF`` (X [M, K] -> Y [M, N])."""
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node(kernels.OP, ["X", "W"], ["Y"], domain=kernels.DOMAIN,
                            type=kernels.TYPES[qtype], N=n, K=k)
    g = helper.make_graph([node], "gguf", [helper.make_tensor_value_info(
        "X", TensorProto.FLOAT, ["M", k])], [helper.make_tensor_value_info(
            "Y", TensorProto.FLOAT, ["M", n])], [numpy_helper.from_array(w, "W")])
    return _session(helper.make_model(g, ir_version=10, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid(kernels.DOMAIN, 1)]), threads, True)


def mlas_session(n: int, k: int, threads: int, rng):
    """A one-node graph of ``MatMulNBits`` (4 bits, blocks of 32, accuracy_level 4)."""
    from onnx import TensorProto, helper, numpy_helper

    wq = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    sc = (rng.standard_normal(n * k // 32) * 0.02).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["X", "W", "S"], ["Y"], domain="com.microsoft",
                            K=k, N=n, bits=4, block_size=32, accuracy_level=4)
    g = helper.make_graph([node], "nbits", [helper.make_tensor_value_info(
        "X", TensorProto.FLOAT, ["M", k])], [helper.make_tensor_value_info(
            "Y", TensorProto.FLOAT, ["M", n])],
        [numpy_helper.from_array(wq, "W"), numpy_helper.from_array(sc, "S")])
    return _session(helper.make_model(g, ir_version=10, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]), threads, False)


def median_ms(fn, calls: int) -> float:
    """The median of ``calls`` timed calls of ``fn``, in milliseconds."""
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def cases(types, rows, threads, rng):
    """``[(key, {"ctypes": fn, "op": fn, "mlas": fn})]`` for every shape, type and M."""
    out = []
    for n, k in SHAPES:
        mlas = mlas_session(n, k, threads, rng)
        for qtype in types:
            w = random_blocks(qtype, n, k, rng)
            op = op_session(qtype, w, n, k, threads)
            for m in rows:
                x = rng.standard_normal((m, k)).astype(np.float32)
                out.append(((qtype, n, k, m), {
                    "ctypes": lambda q=qtype, x=x, w=w, n=n, k=k: kernels.matmul(
                        q, x, w, n, k, threads),
                    "op": lambda s=op, x=x: s.run(None, {"X": x}),
                    "mlas": lambda s=mlas, x=x: s.run(None, {"X": x})}))
    return out


def step_cases(model: str, rows, threads: int):
    """``[(key, {"op": fn})]``: a decode step of ``M`` sequences for each ``M`` of ``rows``."""
    from tiny_mindie.model.backend import SeqChunk
    from tiny_mindie.model.loader import load_model
    from tiny_mindie.model.options import BackendOptions
    from tiny_mindie.model.registry.catalog import resolve

    _, _, _, backend = load_model(resolve(model), BackendOptions(threads=threads),
                                  num_slots=max(rows), max_seq_len=128)
    prompt = np.arange(100, 164, dtype=np.int64)
    for slot in range(max(rows)):
        backend.forward([SeqChunk(slot, 0, prompt)])
    print(f"model: {model}, kernels: {backend.kernels}")
    token = np.array([7], np.int64)
    return [(("step", None, None, m), {
        "op": lambda m=m: backend.forward([SeqChunk(s, len(prompt), token) for s in range(m)])})
        for m in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="Q4_K,Q6_K,Q5_0,Q8_0,Q4_1")
    ap.add_argument("--rows", default="1,2,4,8,64")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=15, help="calls per case and round")
    ap.add_argument("--json", help="write a results file (kind kernelbench) here")
    ap.add_argument("--plot", help="draw the results file into this figure (scripts/plot.py)")
    ap.add_argument("--model", help="also time whole decode steps of this model (a .gguf or a "
                                    "registry name) at each M of --rows")
    args = ap.parse_args(argv)
    if args.plot:
        if not args.json:
            ap.error("--plot draws the results file: give --json too")
        results.can_draw()
    types = args.types.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    record = results.run_record("kernelbench", argv)
    rng = np.random.default_rng(0)
    todo = cases(types, rows, args.threads, rng)
    if args.model:
        todo += step_cases(args.model, rows, args.threads)
    times: dict = {key: {name: [] for name in fns} for key, fns in todo}
    for _ in range(args.rounds):
        for key, fns in todo:
            for name, fn in fns.items():
                fn()
                times[key][name].append(median_ms(fn, args.calls))
    med = {key: {name: statistics.median(v) for name, v in d.items()} for key, d in times.items()}
    out = []
    print(f"{'type':5} {'N':>5} {'K':>5} {'M':>3} {'ctypes':>8} {'op':>8} {'mlas':>8} "
          f"{'op/mlas':>8} {'op/M1':>6}")
    for (qtype, n, k, m), t in med.items():
        one = med.get((qtype, n, k, 1), {}).get("op")
        row = {"type": qtype, "N": n, "K": k, "M": m, "ctypes_ms": _ms(t.get("ctypes")),
               "op_ms": _ms(t["op"]), "mlas_ms": _ms(t.get("mlas")),
               "vs_mlas": round(t["op"] / t["mlas"], 3) if "mlas" in t else None,
               "vs_m1": round(t["op"] / one, 3) if one else None}
        out.append(row)
        print(f"{qtype:5} {n or '-':>5} {k or '-':>5} {m:3} {_cell(row['ctypes_ms'])} "
              f"{_cell(row['op_ms'])} {_cell(row['mlas_ms'])} {_cell(row['vs_mlas'], 2)} "
              f"{row['vs_m1'] or 0:6.2f}")
    if args.json:
        results.write(args.json, record, out, threads=args.threads, rounds=args.rounds,
                      calls=args.calls, isa=kernels.isa(), model=args.model)
        if args.plot:
            results.draw(args.json, args.plot)
    return 0


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _cell(value: float | None, places: int = 3) -> str:
    return f"{'-':>8}" if value is None else f"{value:8.{places}f}"


if __name__ == "__main__":
    sys.exit(main())
