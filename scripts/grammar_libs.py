"""Compare grammar-constrained decoding libraries on our own tokenizers (issue 16's choice).

For each library and each vocabulary (SmolLM2's 49,152 and Gemma 3's 262,144 tokens, built
from tiny_mindie's Tokenizer token bytes), measures: building the library's tokenizer, compiling
a realistic JSON schema (cold, no cache), and the per-token mask time while walking a valid
instance of that schema token by token. llguidance is a dependency of tiny_mindie; the others
are tried only when importable (xgrammar needs torch and transformers, so run this in a
throwaway venv that has them: ``pip install xgrammar outlines-core torch transformers``).

    python scripts/grammar_libs.py [--models smollm2-135m-instruct gemma3-270m]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from tiny_mindie.model.gguf import GGUFFile
from tiny_mindie.model.registry.catalog import ensure_model
from tiny_mindie.model.tokenizer_load import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "maxLength": 20},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "email": {"type": "string"},
                "vip": {"type": "boolean"},
            },
            "required": ["name", "email"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "status": {"enum": ["pending", "paid", "shipped"]},
        "note": {"type": ["string", "null"]},
    },
    "required": ["order_id", "customer", "items", "status"],
    "additionalProperties": False,
}
INSTANCE = {"order_id": "A-1042", "customer": {"name": "Ada Lovelace",
                                                "email": "ada@example.com", "vip": True},
            "items": [{"sku": "PEN-7", "quantity": 3, "price": 1.25},
                      {"sku": "INK-2", "quantity": 1, "price": 12.5}],
            "status": "paid", "note": None}
TEXT = json.dumps(INSTANCE, separators=(",", ":"))


def vocab_bytes(tok) -> list[bytes]:
    """Token bytes; control tokens as 0xFF + piece (llguidance's special-token mark)."""
    return [b"\xff" + tok.token_text(i).encode() if tok.is_special(i) or not tok.token_bytes(i)
            else tok.token_bytes(i) for i in range(tok.vocab_size)]


def eos_of(tok) -> list[int]:
    return sorted(tok.eog_ids)


def walk(ids, fill, consume) -> list[float]:
    times = []
    for i in ids:
        t = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t)
        consume(i)
    return times


def run_llguidance(tok, ids):
    import llguidance
    import llguidance.numpy

    from tiny_mindie.engine import constraint
    t = time.perf_counter()
    ll = constraint._ll_tokenizer(tok)
    t_tok = time.perf_counter() - t
    t = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA,
                                                            defaults=constraint.JSON_OPTIONS)
    m = llguidance.LLMatcher(ll, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    t_comp = time.perf_counter() - t
    bm = llguidance.numpy.allocate_token_bitmask(1, tok.vocab_size)
    times = walk(ids, lambda: llguidance.numpy.fill_next_token_bitmask(m, bm, 0),
                 lambda i: m.consume_token(i) or (_ for _ in ()).throw(AssertionError(i)))
    return t_tok, t_comp, times


def run_xgrammar(tok, ids):
    import xgrammar as xgr
    t = time.perf_counter()
    info = xgr.TokenizerInfo(vocab_bytes(tok), xgr.VocabType.RAW, vocab_size=tok.vocab_size,
                             stop_token_ids=eos_of(tok))
    t_tok = time.perf_counter() - t
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t = time.perf_counter()
    cg = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                     separators=(",", ":"))
    t_comp = time.perf_counter() - t
    m = xgr.GrammarMatcher(cg)
    bm = xgr.allocate_token_bitmask(1, tok.vocab_size).numpy()
    times = walk(ids, lambda: m.fill_next_token_bitmask(bm, 0),
                 lambda i: m.accept_token(i) or (_ for _ in ()).throw(AssertionError(i)))
    return t_tok, t_comp, times


def run_outlines_core(tok, ids):
    import outlines_core as oc
    t = time.perf_counter()
    eos = eos_of(tok)
    mapping: dict[bytes, list[int]] = {}
    for i, b in enumerate(vocab_bytes(tok)):
        if i not in eos and not tok.is_special(i):
            mapping.setdefault(b, []).append(i)
    vocab = oc.Vocabulary(eos[0], mapping)
    t_tok = time.perf_counter() - t
    t = time.perf_counter()
    regex = oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern="")
    index = oc.Index(regex, vocab)
    t_comp = time.perf_counter() - t
    g = oc.Guide(index)
    bm = np.zeros(((tok.vocab_size + 31) // 32,), np.int32)
    times = walk(ids, lambda: g.write_mask_into(bm.ctypes.data, bm.size, 4), g.advance)
    return t_tok, t_comp, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    args = ap.parse_args()
    print(f"schema: {len(json.dumps(SCHEMA))} chars; instance: {TEXT}")
    for name in args.models:
        tok = load_tokenizer(GGUFFile(ensure_model(name)))
        ids = tok.encode(TEXT, add_bos=False, parse_special=False)
        print(f"\n{name}: vocab {tok.vocab_size}, instance {len(ids)} tokens")
        for lib, fn in [("llguidance", run_llguidance), ("xgrammar", run_xgrammar),
                        ("outlines-core", run_outlines_core)]:
            try:
                t_tok, t_comp, times = fn(tok, ids)
            except ImportError as exc:
                print(f"  {lib:14s} not importable: {exc}")
                continue
            us = [t * 1e6 for t in times]
            print(f"  {lib:14s} tokenizer {t_tok * 1e3:8.1f} ms  compile {t_comp * 1e3:9.1f} ms  "
                  f"mask/token mean {statistics.mean(us):7.0f} us  median "
                  f"{statistics.median(us):7.0f} us  max {max(us):7.0f} us")


if __name__ == "__main__":
    main()
