"""Speculative decoding with a draft model (``--draft-model``): the answer is the same token for
token with and without the draft, greedy and seeded, alone and in a batch; the draft's KV slots
are reused; a draft of another vocabulary, missing, a directory or not a GGUF ends the start with
one line (the vocabulary's naming the first difference) before anything is built.

The model tests let SmolLM2 draft for itself (its proposals are the target's own greedy
choices from its weights in 4-bit blocks, the draft's weight mode: many are kept) with the
policy's costs pinned (the measured costs of a draft
as large as its target would rightly turn the draft off); the ``realsize`` test runs the real
pair, Qwen2.5-Coder 0.5B drafting for 1.5B, with the costs measured as a server measures them.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from helpers import TEST_CONFIG, start_server
from tiny_qwen2 import write_tiny_qwen2

from tiny_mindie.engine.draft import vocabulary_difference
from tiny_mindie.model.gguf import ModelFileError
from tiny_mindie.model.tokenizer import TOKEN_CONTROL, TOKEN_NORMAL, Tokenizer, Vocabulary

# ---- unit ------------------------------------------------------------------------------------


def _tok(tokens: list[str], eos: int = 1, control: tuple[int, ...] = (0, 1)) -> Tokenizer:
    types = [TOKEN_CONTROL if i in control else TOKEN_NORMAL for i in range(len(tokens))]
    vocab = Vocabulary(tokens=tokens, types=types, bos_id=0, eos_id=eos, eog_ids=frozenset({eos}))
    return Tokenizer(vocab, kind="gpt2",
                     token_bytes=[b"" if i in control else t.encode() for i, t in
                                  enumerate(tokens)],
                     add_bos=False, chat_template=None)


def test_the_vocabulary_check_names_the_first_difference():
    base = ["<s>", "</s>", "a", "b", "c"]
    assert vocabulary_difference(_tok(base), _tok(list(base))) is None
    assert vocabulary_difference(_tok(base), _tok(base + ["d"])) == \
        "the draft has 6 tokens, the target 5"
    assert vocabulary_difference(_tok(base), _tok(["<s>", "</s>", "a", "x", "y"])) == \
        "token 3: the target's is 'b', the draft's 'x'"
    assert vocabulary_difference(_tok(base), _tok(base, eos=2, control=(0, 2))) == \
        "eos_id: the target's is 1, the draft's 2"
    assert vocabulary_difference(_tok(base), _tok(base, control=(0, 1, 4))) == \
        "token 4: the target's is 'c', the draft's 'c'"   # same text, another kind


# ---- model: SmolLM2 drafting for itself ------------------------------------------------------


@pytest.fixture(scope="module")
def pair(model_path):
    from tiny_mindie.llm import LLM

    llm = LLM(model_path, max_seq_len=512, max_input_len=400, num_slots=4, threads=1,
              draft_model=model_path, log=None)
    # pinned costs: a draft step a fifth of a decode step, verifications at the prior; and
    # every drafted token proposed, however unsure the draft
    llm.engine._speculator.draft_steps = lambda k: 0.2 * k
    llm.draft.p_min = 0.0
    llm.engine._speculator.cost_model.decode = lambda seconds: None
    yield llm
    llm.close()


PROMPTS = ["The three primary colours are", "def add(a, b):\n    return",
           "Once upon a time, in a small village by the sea,",
           "Edge devices have little memory, so"]


def _run(llm, draft: bool, concurrent: bool, **params) -> list[tuple]:
    llm.engine._speculator.draft = llm.draft if draft else None

    async def one(p):
        c = await llm.generate_async(llm.make_request(p, **params))
        return tuple(c.token_ids), tuple(c.logprobs), c.finish_reason

    async def all_at_once():
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    try:
        if concurrent:
            return asyncio.run(all_at_once())
        return [asyncio.run(one(p)) for p in PROMPTS]
    finally:
        llm.engine._speculator.draft = llm.draft


@pytest.mark.parametrize("params", [dict(do_sample=False),
                                    dict(do_sample=True, temperature=0.7, top_p=0.95, seed=5)],
                         ids=["greedy", "seeded"])
def test_the_answer_is_the_same_with_and_without_the_draft(pair, params):
    before = pair.engine.counters.snapshot()
    drafted = _run(pair, True, concurrent=False, max_new_tokens=40, ignore_eos=True, **params)
    after = pair.engine.counters.snapshot()
    assert drafted == _run(pair, False, concurrent=False, max_new_tokens=40, ignore_eos=True,
                           **params)
    assert drafted == _run(pair, True, concurrent=True, max_new_tokens=40, ignore_eos=True,
                           **params)
    proposed = after["spec_draft_proposed_tokens"] - before["spec_draft_proposed_tokens"]
    accepted = after["spec_draft_accepted_tokens"] - before["spec_draft_accepted_tokens"]
    assert proposed >= 40, proposed
    if not params["do_sample"]:   # the target's greedy choices, but from 4-bit weights
        assert accepted > 0.25 * proposed, (accepted, proposed)
    assert after["spec_accepted_tokens"] - before["spec_accepted_tokens"] >= accepted


def test_a_request_reports_its_proposals_and_the_draft_its_time(pair):
    seconds = pair.engine.stats()["draft_seconds"]
    events = list(pair.stream(PROMPTS[2], max_new_tokens=30, do_sample=False, ignore_eos=True))
    last = events[-1]
    assert 0 < last.accepted_tokens <= last.proposed_tokens < 30 + 4
    assert pair.engine.stats()["draft_seconds"] > seconds


def test_the_draft_reuses_its_slots_and_proposes_its_greedy_continuation(pair):
    draft = pair.draft
    ids = pair.encode(PROMPTS[0])
    assert draft.p_min == 0.0
    first = draft.propose(ids, 4)
    assert len(first) == 4
    slot, reused = draft._slot_for([*ids, *first])
    assert reused == len(ids) + 3                 # the 4th proposal was never fed
    # another sequence takes the other slot; the first one's KV is still there after it
    other = pair.encode(PROMPTS[3])
    draft.propose(other, 2)
    assert draft._slot_for([*ids, *first]) == (slot, len(ids) + 3)
    # on from held KV: the same greedy chain as from scratch
    assert draft.propose([*ids, *first[:2]], 2) == first[2:4]
    draft._held = [[] for _ in draft._held]        # forget every slot: a fresh prefill
    assert draft.propose(ids, 4) == first


def test_a_missing_or_foreign_draft_ends_the_load_with_one_line_before_any_load(model_path,
                                                                                 tmp_path):
    from tiny_mindie.llm import LLM

    tiny = str(tmp_path / "tiny-qwen2.gguf")
    write_tiny_qwen2(tiny)
    (tmp_path / "models").mkdir()
    (tmp_path / "notes.gguf").write_text("not a model")
    for draft, message in [
            (model_path, r"^draft model SmolLM2.*\.gguf: its vocabulary is not the model's: "
                         r"the draft has 49152 tokens, the target 300$"),
            (str(tmp_path / "nope.gguf"), r"^draft model: model file not found: .*nope\.gguf$"),
            (str(tmp_path / "models"), r"^draft model: model file .*models is a directory, not "
                                       r"a file: give a \.gguf file$"),
            (str(tmp_path / "notes.gguf"), r"^draft model: not a readable GGUF file: "
                                           r".*notes\.gguf \(it does not start with 'GGUF'\)$")]:
        said: list[str] = []
        with pytest.raises(ModelFileError, match=message):
            LLM(tiny, max_seq_len=64, num_slots=1, draft_model=draft, log=said.append)
        assert said == [], said             # refused before the model's load began
    with pytest.raises(ValueError, match="needs speculative decoding"):
        LLM(tiny, max_seq_len=64, num_slots=1, speculation=False, draft_model=model_path,
            log=None)
    with pytest.raises(ValueError, match="needs speculative decoding"):
        LLM(tiny, max_seq_len=64, num_slots=1, backend="numpy", draft_model=model_path,
            log=None)


def test_the_header_check_reads_what_the_tokenizer_holds(model_path, gemma_path):
    """The vocabulary read from a file's metadata (no tokenizer built) is the one its built
    tokenizer holds: the same texts, kinds and special ids, so that the check before the load
    and the one after it agree (SmolLM2: byte-level BPE; Gemma 3: SentencePiece)."""
    from tiny_mindie.model.gguf import GGUFFile
    from tiny_mindie.model.tokenizer_load import load_tokenizer, read_vocabulary

    for path in (model_path, gemma_path):
        f = GGUFFile(path)
        vocab, tok = read_vocabulary(f), load_tokenizer(f)
        assert vocabulary_difference(tok, vocab) is None
        assert (vocab.vocab_size, vocab.bos_id, vocab.eos_id, vocab.eog_ids) == \
            (tok.vocab_size, tok.bos_id, tok.eos_id, tok.eog_ids)
    assert vocabulary_difference(read_vocabulary(GGUFFile(model_path)),
                                 read_vocabulary(GGUFFile(gemma_path))) == \
        "the draft has 262144 tokens, the target 49152"


# ---- e2e -------------------------------------------------------------------------------------


def test_the_server_says_the_draft_is_on_and_counts_it(tmp_path, model_path):
    from helpers import request, serving

    srv = start_server(str(tmp_path), TEST_CONFIG, ["--model", model_path, "--draft-model",
                                                    model_path])
    for s in serving(srv):
        assert "  draft    " in s.banner and "proposes tokens for speculative decoding" in \
            s.banner and "MB of memory" in s.banner
        status, _, raw = request(s, "GET", "/metrics")
        text = raw.decode()
        for name in ("spec_decode_draft_model_tokens_total",
                     "spec_decode_draft_model_accepted_tokens_total",
                     "spec_decode_draft_model_seconds_total"):
            assert f"\ntiny_mindie_{name}{{" in text, name


@pytest.mark.e2e
def test_a_draft_without_speculation_is_a_one_line_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tiny_mindie", "--no-speculation",
                          "--draft-model", "x.gguf", "--port", "0"], capture_output=True,
                         text=True, cwd=tmp_path, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs speculative decoding" in lines[0], out.stderr


def _serve(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``python -m tiny_mindie --no-tls --port 0 ARGS`` run to its end (a start that fails)."""
    return subprocess.run([sys.executable, "-m", "tiny_mindie", "--no-tls", "--port", "0",
                           "--management-port", "0", "--metrics-port", "0", *args],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ, "TINY_MINDIE_HOME": str(tmp_path)})


@pytest.mark.e2e
def test_a_bad_draft_or_model_file_ends_the_start_before_anything_is_built(tmp_path, model_path,
                                                                         gemma_path):
    """Exit 2 and one line: a missing draft, a directory, a file that is not a GGUF before the
    listeners are bound; a draft of another vocabulary (Gemma 3's for SmolLM2) once the model
    file is known, before the model's load begins (so no graph is built)."""
    (tmp_path / "models").mkdir()
    (tmp_path / "notes.txt").write_text("not a model")
    cases = [
        (["--draft-model", gemma_path], False,
         "draft model gemma-3-270m-q4_k_m.gguf: its vocabulary is not the model's: the draft "
         "has 262144 tokens, the target 49152"),
        (["--draft-model", str(tmp_path / "nope.gguf")], True,
         f"draft model: model file not found: {tmp_path / 'nope.gguf'}"),
        (["--draft-model", str(tmp_path / "models")], True,
         f"draft model: model file {tmp_path / 'models'} is a directory, not a file: give a "
         ".gguf file"),
        (["--draft-model", str(tmp_path / "notes.txt")], True,
         f"draft model: not a readable GGUF file: {tmp_path / 'notes.txt'} (it does not start "
         "with 'GGUF')"),
        (["--model", str(tmp_path / "models")], True,
         f"model file {tmp_path / 'models'} is a directory, not a file: give a .gguf file"),
    ]
    for args, before_listening, message in cases:
        out = _serve(tmp_path, "--model", model_path, *args)
        assert out.returncode == 2, (args, out.stderr[-2000:])
        assert out.stderr.strip().splitlines()[-1] == f"tiny_mindie: error: {message}"
        assert "Traceback" not in out.stderr
        assert ("listening" not in out.stdout) is before_listening, (args, out.stdout)
        assert "on the onnxruntime backend" not in out.stdout, (args, out.stdout)  # no load
        assert "ONNX graph" not in out.stderr, (args, out.stderr)


# ---- realsize: Qwen2.5-Coder 0.5B drafting for 1.5B ------------------------------------------

REAL_PROMPTS = [
    "<|im_start|>user\nWrite a Python function that returns the n-th Fibonacci number."
    "<|im_end|>\n<|im_start|>assistant\n",
    "import json\n\n\ndef load_config(path):\n",
    "<|im_start|>user\nSummarize in one sentence: A KV cache stores the keys and values of the "
    "tokens seen so far, so each new token attends to them without recomputing them."
    "<|im_end|>\n<|im_start|>assistant\n",
]


def test_the_real_pair_gives_the_same_answers(qwen_coder_15b_path, qwen_coder_path):
    from tiny_mindie.llm import LLM

    llm = LLM(qwen_coder_15b_path, max_seq_len=384, max_input_len=256, num_slots=2,
              draft_model=qwen_coder_path, log=None)
    try:
        prompts = [llm.encode(p) for p in REAL_PROMPTS]
        for params in (dict(do_sample=False),
                       dict(do_sample=True, temperature=0.7, seed=11)):
            runs = []
            for draft, concurrent in ((True, False), (False, False), (True, True)):
                llm.engine._speculator.draft = llm.draft if draft else None

                async def one(p, params=params):
                    c = await llm.generate_async(llm.make_request(p, max_new_tokens=32,
                                                                  **params))
                    return tuple(c.token_ids)

                async def both(ps):
                    return await asyncio.gather(*(one(p) for p in ps))

                runs.append(asyncio.run(both(prompts)) if concurrent else
                            [asyncio.run(one(p)) for p in prompts])
            llm.engine._speculator.draft = llm.draft
            assert runs[0] == runs[1] == runs[2], params
        snap = llm.engine.counters.snapshot()
        assert snap["spec_draft_accepted_tokens"] > 0.5 * snap["spec_draft_proposed_tokens"] > 0
    finally:
        llm.close()
