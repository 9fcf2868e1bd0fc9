"""``python -m tiny_mindie check-graph``: where the onnxruntime graph's nodes run, and whether
its greedy answers are the numpy reference's.

For an Ascend user, whose machine this project cannot test on: one command loads the model on
the execution providers a server would choose (CANN where Ascend's runtime loads) with the graph
it would build (``--graph``, default ``auto``: the standard graph on CANN), prints the placement
of every node (per provider, with the operators of the ones left to the CPU), the number of
input shapes the runs use and the start-up checks' outcomes, then decodes a few prompts greedily
on it and on the numpy reference decoder and compares tokens and logits
(:func:`greedy_compare`). Exit status 0 when every token is the reference's, 1 when one is not.
"""

from __future__ import annotations

import argparse
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


@dataclass(frozen=True)
class Comparison:
    """One prompt decoded greedily on a backend and on the reference.

    Attributes:
        prompt: the text.
        tokens: the backend's greedy tokens; ``reference``: the reference's.
        max_diff: the largest absolute logit difference over the steps both decoded alike.
    """

    prompt: str
    tokens: list[int]
    reference: list[int]
    max_diff: float

    @property
    def same(self) -> bool:
        return self.tokens == self.reference


def greedy(backend, ids: list[int], n: int, slot: int = 0) -> tuple[list[int], object]:
    """``n`` greedy tokens after the prompt ``ids`` on ``backend`` (its ``slot``): the tokens
    and the logits they were chosen from, float32 ``[n, V]``."""
    import numpy as np

    from .model.backend import SeqChunk

    logits = [backend.forward([SeqChunk(slot, 0, np.asarray(ids, np.int64))])[0]]
    tokens = [int(logits[-1].argmax())]
    for k in range(n - 1):
        logits.append(backend.forward([SeqChunk(slot, len(ids) + k,
                                                np.array(tokens[-1:], np.int64))])[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, np.stack(logits)


def greedy_compare(backend, reference, tokenizer, prompts=PROMPTS, n: int = 32
                   ) -> list[Comparison]:
    """Each of ``prompts`` decoded ``n`` greedy tokens on ``backend`` and on ``reference`` (one
    prompt at a time in slot 0; ``n + prompt`` must fit their ``max_seq_len``)."""
    import numpy as np

    out = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        tokens, logits = greedy(backend, ids, n)
        ref_tokens, ref_logits = greedy(reference, ids, n)
        same = next((k for k, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True))
                     if a != b), n)
        diff = float(np.abs(logits[:same + 1] - ref_logits[:same + 1]).max())
        out.append(Comparison(prompt, tokens, ref_tokens, diff))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="registry name or .gguf path (default: the default model)")
    p.add_argument("--graph", default="auto", choices=("auto", "contrib", "standard"),
                   help="the graph to check (default auto: standard on the CANN execution "
                        "provider, contrib on the CPU)")
    p.add_argument("--device-id", type=int, default=0, help="the NPU (CANN) to run on")
    p.add_argument("--prompts", type=int, default=3, choices=range(1, len(PROMPTS) + 1),
                   metavar=f"1..{len(PROMPTS)}", help="prompts to decode (default 3)")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt (default 16)")


def run(args: argparse.Namespace, say) -> int:
    """The command (see the module docstring); ``say`` prints a line."""
    from .model.loader import load_model
    from .model.providers import placement_summary
    from .model.registry import DEFAULT_MODEL, resolve

    path = resolve(args.model or DEFAULT_MODEL, log=say)
    n = max(1, args.tokens)
    seq = n + 200           # room for the start-up checks' prompts
    say(f"loading {path} on onnxruntime (graph {args.graph}) ...")
    _, _, tok, be = load_model(path, graph=args.graph, device_id=args.device_id, num_slots=4,
                               max_seq_len=seq, speculation=True)
    say(f"graph      {be.graph}, on {', '.join(be.providers)}")
    say(f"placement  {placement_summary(be.node_placement, be.placement_ops)}")
    if be.graph == "standard":
        say(f"shapes     at most {be.static_shapes()} sets of input shapes (decode rows "
            f"{list(be.decode_batches)}, prompt pieces {list(be.chunk_lengths)}, spans "
            f"{list(be.spans)})")
    say(f"checks     decode rows the same alone and in batches: {be.rows_per_decode_run != 1}; "
        f"prompt KV the same in any chunks: {be.prefix_split_invariant}; verification the "
        f"same as decoding: {be.fast_verify}")
    say("loading the numpy reference ...")
    _, _, _, ref = load_model(path, backend="numpy", num_slots=1, max_seq_len=seq)
    results = greedy_compare(be, ref, tok, PROMPTS[:args.prompts], n)
    for r in results:
        verdict = "same tokens" if r.same else "DIFFERENT tokens"
        say(f"greedy     {r.prompt!r}: {verdict}, largest logit difference {r.max_diff:.2g}"
            + ("" if r.same else f"\n           got {tok.decode(r.tokens)!r}\n"
               f"           reference {tok.decode(r.reference)!r}"))
    be.close()
    ref.close()
    ok = all(r.same for r in results)
    say("check-graph: " + ("passed" if ok else "FAILED") + f" ({len(results)} prompts x {n} "
        "greedy tokens against the numpy reference)")
    return 0 if ok else 1
