"""``python -m tiny_mindie check-graph``: where the onnxruntime graph's nodes run, and whether
its greedy answers are the numpy reference's.

For an Ascend user, whose machine this project cannot test on: one command loads the model on
the execution providers a server would choose (CANN where Ascend's runtime loads) with the
standard graph (``--graph``), as a server of ``--slots`` KV slots and ``--max-seq-len``
positions would, prints the placement of every node (per provider, with the operators of the
ones left to the CPU), the input shapes the runs use (each run once: a compiling provider
builds them all) and the start-up checks' outcomes, then decodes a few prompts greedily on it
and on the numpy reference decoder and compares tokens and logits (:func:`greedy_compare`).

It also prints, per node kind of the standard graph, the element types its nodes carry and
whether Ascend's page of the operator lists them (:func:`~.model.cann_ops.dtype_report`).

Exit status 0 when the graph agrees with the reference, 1 when not, 2 for bad arguments. The
float32 standard graph on the CPU provider (``--standard-dtype float32``) must give every token
of the reference and every logit within :data:`LOGITS_TOLERANCE`; the float16 graph, or any
graph on an NPU (which computes products in float16), the reference's next-token distribution
within a mean KL divergence of :data:`KL_TOLERANCE` per prompt, over the steps both decoded
alike and the first that differs (a greedy text may part from the reference's at a near tie:
both texts are printed). The contrib graph's matrix products take int8 activations, so its
tokens are compared for information only (exit 0).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

#: Prompts of the greedy check: English and code, whose next tokens are not borderline on the
#: registry models.
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n",
    "Water boils at a temperature of",
    "import numpy as np\n\n",
    "The three primary colors are",
    "SELECT name FROM users WHERE",
    "The largest planet in the solar system is",
    "class Stack:\n    def __init__(self):\n",
    "To make a cup of tea, first",
    "for i in range(10):\n",
)

#: Largest absolute difference of a logit from the reference's that :func:`greedy_compare`
#: accepts (float32 throughout: the products and sums only add in another order).
LOGITS_TOLERANCE = 2e-3
#: Largest mean KL(reference || graph), in nats per step, of a prompt's greedy steps that the
#: check accepts for the float16 graph and on an NPU
KL_TOLERANCE = 0.01


@dataclass(frozen=True)
class Comparison:
    """One prompt decoded greedily on a backend and on the reference.

    Attributes:
        prompt: the text.
        tokens: the backend's greedy tokens; ``reference``: the reference's.
        max_diff: the largest absolute logit difference over the steps both decoded alike.
        kl: the mean KL(reference || backend), nats, of the next-token distributions over the
            steps both decoded alike and the first that differs (the same prefix for both).
    """

    prompt: str
    tokens: list[int]
    reference: list[int]
    max_diff: float
    kl: float = 0.0

    @property
    def same(self) -> bool:
        return self.tokens == self.reference


def greedy(backend, prompts: list[list[int]], n: int) -> list[tuple[list[int], object]]:
    """``n`` greedy tokens after each of the ``prompts`` (token ids) on ``backend``, decoded
    together in groups of up to its ``num_slots`` rows (a batch per step: the weights read once
    for the group). Returns per prompt the tokens and the logits they were chosen from,
    float32 ``[n, V]``."""
    import numpy as np

    from ..model.backend import SeqChunk

    out = []
    for g in range(0, len(prompts), backend.num_slots):
        group = prompts[g:g + backend.num_slots]
        first = backend.forward([SeqChunk(s, 0, np.asarray(ids, np.int64))
                                 for s, ids in enumerate(group)])
        logits, tokens = [[row] for row in first], [[int(row.argmax())] for row in first]
        for k in range(n - 1):
            step = backend.forward([SeqChunk(s, len(ids) + k, np.array(t[-1:], np.int64))
                                    for s, (ids, t) in enumerate(zip(group, tokens,
                                                                     strict=True))])
            for row, lg, t in zip(step, logits, tokens, strict=True):
                lg.append(row)
                t.append(int(row.argmax()))
        out += [(t, np.stack(lg)) for t, lg in zip(tokens, logits, strict=True)]
    return out


def greedy_compare(backend, reference, tokenizer, prompts=PROMPTS, n: int = 32
                   ) -> list[Comparison]:
    """Each of ``prompts`` decoded ``n`` greedy tokens on ``backend`` and on ``reference``
    (:func:`greedy`; ``n + prompt`` must fit their ``max_seq_len``)."""
    import numpy as np

    ids = [tokenizer.encode(p) for p in prompts]
    out = []
    for prompt, (tokens, logits), (ref_tokens, ref_logits) in zip(
            prompts, greedy(backend, ids, n), greedy(reference, ids, n), strict=True):
        same = next((k for k, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True))
                     if a != b), n)
        diff = float(np.abs(logits[:same + 1] - ref_logits[:same + 1]).max())
        out.append(Comparison(prompt, tokens, ref_tokens, diff,
                              mean_kl(ref_logits[:same + 1], logits[:same + 1])))
    return out


def mean_kl(ref_logits, logits) -> float:
    """Mean over rows of KL(softmax(ref_logits) || softmax(logits)) in nats; both float
    ``[n, V]``, computed in float64."""
    import numpy as np

    def log_softmax(x):
        x = np.asarray(x, np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    p_log, q_log = log_softmax(ref_logits), log_softmax(logits)
    return float((np.exp(p_log) * (p_log - q_log)).sum(axis=-1).mean())


def _count(low: int, high: int):
    """An argparse type: an int in ``[low, high]``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in {low}..{high}")
        return value
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="registry name or .gguf path (default: the default model)")
    p.add_argument("--graph", default="standard", choices=("auto", "contrib", "standard"),
                   help="the graph to check (default standard; auto: standard on the CANN "
                        "execution provider, contrib on the CPU)")
    p.add_argument("--kernels", default="auto", choices=("onnxruntime", "custom", "auto"),
                   help="the contrib graph's matrix-product kernels (default auto: the "
                        "server's; custom: tiny_mindie's own, BackendConfig.kernels)")
    p.add_argument("--standard-dtype", default="float16", choices=("float16", "float32"),
                   help="the standard graph's weights, KV cache and products (default "
                        "float16; float32: the exact check on a CPU)")
    p.add_argument("--device-id", type=_count(0, 1023), default=0,
                   help="the NPU (CANN) to run on")
    p.add_argument("--slots", type=_count(1, 1024), default=4,
                   help="KV slots, as a server's (default 4): the decode row sizes")
    p.add_argument("--max-seq-len", type=_count(64, 1 << 20), default=2560,
                   help="positions per sequence, as a server's maxSeqLen (default 2560)")
    p.add_argument("--prompts", type=_count(1, len(PROMPTS)), default=3,
                   help=f"prompts to decode, 1..{len(PROMPTS)} (default 3)")
    p.add_argument("--tokens", type=_count(1, 1024), default=16,
                   help="greedy tokens per prompt (default 16)")


def run(args: argparse.Namespace, say) -> int:
    """The command (see the module docstring); ``say`` prints a line."""
    from ..model.loader import load_model
    from ..model.options import BackendOptions
    from ..model.registry.catalog import DEFAULT_MODEL, resolve

    if args.kernels == "custom" and args.graph == "standard":
        print("tiny_mindie: error: --kernels custom needs --graph contrib", file=sys.stderr)
        return 2
    if args.standard_dtype != "float16" and args.graph == "contrib":
        print("tiny_mindie: error: --standard-dtype shapes the standard graph; --graph "
              "contrib builds none", file=sys.stderr)
        return 2
    path = resolve(args.model or DEFAULT_MODEL, log=say)
    n = args.tokens
    say(f"loading {path} on onnxruntime (graph {args.graph}) ...")
    _, _, tok, be = load_model(path, BackendOptions(
        graph=args.graph, device_id=args.device_id, speculation=True, kernels=args.kernels,
        standard_dtype=args.standard_dtype), num_slots=args.slots, max_seq_len=args.max_seq_len)
    room = be.max_seq_len - max(len(tok.encode(p)) for p in PROMPTS[:args.prompts])
    if n > room:
        be.close()
        print(f"tiny_mindie: error: --tokens {n} does not fit: the model's sequences hold "
              f"{be.max_seq_len} positions, {room} after the longest prompt", file=sys.stderr)
        return 2
    _describe(be, say)
    say("loading the numpy reference ...")
    _, _, _, ref = load_model(path, BackendOptions(backend="numpy"), num_slots=args.prompts,
                              max_seq_len=be.max_seq_len)
    results = greedy_compare(be, ref, tok, PROMPTS[:args.prompts], n)
    for r in results:
        verdict = "same tokens" if r.same else "DIFFERENT tokens"
        say(f"greedy     {r.prompt!r}: {verdict}, largest logit difference {r.max_diff:.2g}, "
            f"mean KL {r.kl:.2g}"
            + ("" if r.same else f"\n           got {tok.decode(r.tokens)!r}\n"
               f"           reference {tok.decode(r.reference)!r}"))
    be.close()
    ref.close()
    return _verdict(be, results, n, say)


def _describe(be, say) -> None:
    """The loaded backend's graph, placement, kernels, node kinds' types, shapes and checks."""
    import onnx

    from ..model.onnx.cann_ops import dtype_report
    from ..model.ort.providers import placement_summary

    say(f"graph      {be.graph}, on {', '.join(be.providers)}")
    say(f"placement  {placement_summary(be.node_placement, be.placement_ops)}")
    say(f"kernels    {getattr(be, 'kernels', 'onnxruntime')}")
    if be.graph != "standard":
        return
    if getattr(be, "memory_need", None) is not None:
        say(f"memory     {be.memory_need.describe()}")
    for kind in dtype_report(onnx.load(be.graph_path, load_external_data=False)):
        verdict = ("NOT on the CANN list" if not kind.accepted else
                   "on the CANN list (float32 where it lists float16 only: computed in "
                   "float16 by the precision mode)" if kind.narrowed else "on the CANN list")
        say(f"dtypes     {kind.op_type} x{kind.nodes}: {', '.join(kind.types) or '-'}: "
            f"{verdict}")
    t0 = time.perf_counter()
    runs = be.warm_up()
    say(f"shapes     {runs} sets of input shapes, each run once in "
        f"{time.perf_counter() - t0:.1f} s (decode rows {list(be.shapes.decode_batches)}, "
        f"prompt pieces {list(be.shapes.chunk_lengths)}, spans {list(be.shapes.spans)})")
    say(f"checks     decode rows the same alone and in batches: {be.rows_per_decode_run != 1}; "
        f"prompt KV the same in any chunks: {be.prefix_split_invariant}; verification the "
        f"same as decoding: {be.fast_verify}")


def _verdict(be, results: list[Comparison], n: int, say) -> int:
    """The command's exit status from the comparisons (module docstring), said in a line."""
    from ..model.ort.providers import CPU

    if be.graph != "standard":
        say(f"check-graph: {be.graph} graph: its matrix products take int8 activations, so its "
            "tokens may differ from the reference's (shown for information); the exact check "
            "is the float32 standard graph's")
        return 0
    exact = be.providers[0] == CPU and be.shapes.dtype == "float32"
    if exact:
        ok = all(r.same and r.max_diff <= LOGITS_TOLERANCE for r in results)
        how = f"same tokens, logits within {LOGITS_TOLERANCE:g}"
    else:
        ok = all(r.kl <= KL_TOLERANCE for r in results)
        how = (f"mean KL within {KL_TOLERANCE:g} per prompt; products in float16"
               + ("" if be.providers[0] == CPU else " on the NPU"))
    say("check-graph: " + ("passed" if ok else "FAILED") + f" ({len(results)} prompts x {n} "
        f"greedy tokens against the numpy reference: {how})")
    return 0 if ok else 1
