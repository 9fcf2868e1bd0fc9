"""The embedding routes end to end: real server processes over mutual TLS with the real
all-MiniLM-L6-v2 (beside the chat model) and nomic-embed-text-v1.5 (alone), driven by the
clients their users run -- the ``openai`` SDK, LangChain's ``OpenAIEmbeddings``, LlamaIndex's
``OpenAILikeEmbedding``, ``huggingface_hub``'s ``InferenceClient.feature_extraction`` -- and by
hand-made requests for the wire shapes and the bad inputs."""

from __future__ import annotations

import base64
import copy
import json
import subprocess
import sys
import threading

import numpy as np
import pytest
from helpers import (
    TEST_CONFIG,
    access_line,
    debian_binary,
    openai_client,
    request,
    serving,
    start_server,
    wait_until,
)

from tiny_mindie.model.encoder_load import load_encoder
from tiny_mindie.model.encoder_pool import finish
from tiny_mindie.model.reference.encoder import encode_one

pytestmark = pytest.mark.e2e

NOMIC = "nomic-embed-text-v1.5"
MINILM = "all-minilm-l6-v2"
TEXTS = ["search_query: what is a KV cache?",
         "search_document: A KV cache keeps the keys and values of the tokens seen so far."]


@pytest.fixture(scope="module")
def both(tmp_path_factory, minilm_path, model_path):
    """The default chat model with all-MiniLM-L6-v2 beside it (a config file and the flag)."""
    srv = start_server(str(tmp_path_factory.mktemp("both")), TEST_CONFIG,
                       ["--embedding-model", MINILM])   # pulled by minilm_path
    yield from serving(srv)


@pytest.fixture(scope="module")
def alone(tmp_path_factory, nomic_path):
    """nomic-embed-text-v1.5 alone: a config file whose modelWeightPath is empty."""
    cfg = copy.deepcopy(TEST_CONFIG)
    cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"] = [
        {"modelName": "x", "modelWeightPath": "", "embeddingModelPath": NOMIC}]
    srv = start_server(str(tmp_path_factory.mktemp("alone")), cfg)
    yield from serving(srv)


@pytest.fixture(scope="module")
def nomic(nomic_path):
    return load_encoder(nomic_path)


def reference(model, text: str) -> np.ndarray:
    """The numpy reference's normalized vector of ``text``."""
    ids = model.tokenizer.encode(text).ids
    return finish(encode_one(ids, model.weights, model.config)[None])[0]


def post(server, path: str, body) -> tuple[int, object]:
    status, _, raw = request(server, "POST", path, body)
    return status, json.loads(raw)


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


# ---- OpenAI ------------------------------------------------------------------------------------

def test_the_openai_sdk_float_and_base64_match_the_reference(alone, nomic):
    want = [reference(nomic, t) for t in TEXTS]
    with openai_client(alone) as client:
        floats = client.embeddings.create(model=NOMIC, input=TEXTS, encoding_format="float")
        raw = client.embeddings.create(model=NOMIC, input=TEXTS, encoding_format="base64")
        decoded = client.embeddings.create(model=NOMIC, input=TEXTS)   # the SDK's own base64
    assert floats.model == NOMIC and floats.object == "list"
    assert [d.index for d in floats.data] == [0, 1]
    assert all(d.object == "embedding" for d in floats.data)
    n = sum(len(nomic.tokenizer.encode(t).ids) for t in TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == n
    for i, w in enumerate(want):
        f = np.asarray(floats.data[i].embedding, np.float32)
        b = np.frombuffer(base64.b64decode(raw.data[i].embedding), dtype="<f4")
        assert f.shape == b.shape == (768,)
        assert cosine(f, w) >= 0.9999
        assert np.array_equal(f, b)
        assert np.array_equal(np.asarray(decoded.data[i].embedding, np.float32), f)


def test_dimensions_cut_and_renormalize_on_nomic(alone, nomic):
    with openai_client(alone) as client:
        full = client.embeddings.create(model=NOMIC, input=TEXTS[0], encoding_format="float")
        cut = client.embeddings.create(model=NOMIC, input=TEXTS[0], dimensions=256,
                                       encoding_format="float")
    v = np.asarray(cut.data[0].embedding)
    assert v.shape == (256,) and abs(np.linalg.norm(v) - 1) < 1e-5
    pooled = encode_one(nomic.tokenizer.encode(TEXTS[0]).ids, nomic.weights, nomic.config)
    assert cosine(v, finish(pooled[None], dimensions=256)[0]) >= 0.9999
    assert len(full.data[0].embedding) == 768


def test_token_lists_are_inputs_too(alone, nomic):
    ids = nomic.tokenizer.encode(TEXTS[0]).ids
    status, by_ids = post(alone, "/v1/embeddings", {"input": [ids, ids[:3]]})
    status2, by_text = post(alone, "/v1/embeddings", {"input": TEXTS[0]})
    assert status == status2 == 200 and by_ids["usage"]["prompt_tokens"] == len(ids) + 3
    assert by_ids["data"][0]["embedding"] == by_text["data"][0]["embedding"]


# ---- TEI and llama-server ------------------------------------------------------------------

def test_tei_embed_shape_normalize_truncate_and_prompt_name(alone):
    status, one = post(alone, "/embed", {"inputs": "what is a KV cache?"})
    assert status == 200 and len(one) == 1 and len(one[0]) == 768
    assert abs(np.linalg.norm(one[0]) - 1) < 1e-5
    status, two = post(alone, "/embed", {"inputs": TEXTS, "normalize": False})
    assert status == 200 and len(two) == 2 and abs(np.linalg.norm(two[0]) - 1) > 1e-3
    status, named = post(alone, "/embed", {"inputs": "what is a KV cache?",
                                           "prompt_name": "search_query"})
    status2, prefixed = post(alone, "/embed", {"inputs": TEXTS[0]})
    assert status == status2 == 200 and named == prefixed
    long = "word " * 3000
    status, err = post(alone, "/embed", {"inputs": long})
    assert status == 413 and err["error_type"] == "Validation" and "2048" in err["error"]
    status, cut = post(alone, "/embed", {"inputs": long, "truncate": True,
                                         "truncation_direction": "Left"})
    assert status == 200 and len(cut[0]) == 768


def test_llama_server_embedding_shape(alone):
    status, out = post(alone, "/embedding", {"content": TEXTS[0]})
    assert status == 200 and len(out) == 1 and out[0]["index"] == 0
    (row,) = out[0]["embedding"]                   # the pooled vector as a one-row matrix
    status, many = post(alone, "/embedding", {"content": TEXTS, "embd_normalize": -1})
    assert status == 200 and [o["index"] for o in many] == [0, 1]
    raw = np.asarray(many[0]["embedding"][0])
    assert cosine(raw, row) >= 0.9999 and abs(np.linalg.norm(raw) - 1) > 1e-3


@pytest.mark.parametrize("path, body, status, words", [
    ("/v1/embeddings", {"input": ""}, 400, "empty"),
    ("/v1/embeddings", {"input": []}, 400, "empty"),
    ("/v1/embeddings", {"input": ["x"] * 10_000}, 400, "at most 2048"),
    ("/v1/embeddings", {"input": [[101, 40_000, 102]]}, 400, "token ids in [0,30521]"),
    ("/v1/embeddings", {"input": "x", "dimensions": 300}, 400, "dimensions"),
    ("/v1/embeddings", {"input": "x", "model": "other"}, 404, "other"),
    ("/v1/embeddings", {"input": "word " * 3000}, 400, "at most 2048 tokens"),
    ("/v1/embeddings", b'{"input": "\xff\xfe"}', 422, "json"),
    ("/v1/embeddings", b'{"input": "\\ud800 lone"}', 400, "lone surrogate"),
    ("/embed", {"inputs": ""}, 400, "empty"),
    ("/embed", {"inputs": ["x"] * 10_000}, 413, "at most 2048"),
    ("/embed", {"inputs": "x", "prompt_name": "query"}, 413, "search_query"),
    ("/embedding", {"content": []}, 400, "empty"),
    ("/embedding", {"content": "x", "n_predict": 3}, 400, "n_predict"),
])
def test_bad_inputs_get_the_family_error(alone, path, body, status, words):
    got, err = post(alone, path, body)
    assert got == status, err
    message = err["error"] if path == "/embed" else err["error"]["message"]
    assert words.lower() in message.lower(), message


# ---- batching ----------------------------------------------------------------------------------

def test_a_text_alone_and_in_a_concurrent_batch_gets_the_same_vector(alone):
    text = TEXTS[1]
    _, first = post(alone, "/v1/embeddings", {"input": text})
    results: dict[int, dict] = {}

    def client(i: int) -> None:
        inputs = [f"filler {i} " * (3 + 7 * i), text] if i % 2 else [text]
        results[i] = post(alone, "/v1/embeddings", {"input": inputs})[1]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = first["data"][0]["embedding"]
    for i, body in results.items():
        assert body["data"][-1]["embedding"] == want, i


# ---- a server of an embedding model alone ----------------------------------------------------

def test_alone_the_generation_routes_answer_404_in_their_family_shape(alone):
    status, err = post(alone, "/v1/chat/completions", {
        "model": NOMIC, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 404 and "no chat model" in err["error"]["message"]
    status, err = post(alone, "/infer", {"inputs": "hi"})
    assert status == 404 and err["error_type"] == "NotFoundError"
    status, err = post(alone, "/v1/messages", {"model": NOMIC, "max_tokens": 4,
                                               "messages": [{"role": "user", "content": "x"}]})
    assert status == 404 and err["type"] == "error"
    for path in ("/health", "/v2/health/live", "/v2/health/ready", f"/v2/models/{NOMIC}/ready"):
        assert request(alone, "GET", path)[0] == 200, path
    status, _, raw = request(alone, "GET", "/v1/models")
    (card,) = json.loads(raw)["data"]
    assert status == 200 and card["id"] == NOMIC and card["task"] == "embedding"
    assert card["dimensions"] == 768 and card["max_model_len"] == 2048
    status, _, raw = request(alone, "GET", "/metrics")
    text = raw.decode()
    assert status == 200 and "tiny_mindie_request_received_total" not in text
    assert f'tiny_mindie_embedding_requests_total{{model_name="{NOMIC}"}}' in text


def test_alone_stop_service_drains_and_exits_0(tmp_path, minilm_path):
    cfg = copy.deepcopy(TEST_CONFIG)
    cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = ""
    srv = start_server(str(tmp_path), cfg, ["--embedding-model", MINILM])
    try:
        assert post(srv, "/embed", {"inputs": "x"})[0] == 200
        assert request(srv, "GET", "/stopService")[0] == 200
        assert srv.proc.wait(timeout=60) == 0
    finally:
        srv.proc.kill()


def test_alone_on_the_standard_graph(tmp_path, minilm_path):
    """``--graph standard``: the embedding model's static-shape graph serves the reference's
    vectors."""
    cfg = copy.deepcopy(TEST_CONFIG)
    cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = ""
    srv = start_server(str(tmp_path), cfg, ["--embedding-model", MINILM, "--graph", "standard"])
    try:
        assert f"embedding model {MINILM} (standard graph)".lower() in srv.banner.lower()
        status, body = post(srv, "/v1/embeddings", {"model": MINILM, "input": TEXTS})
        model = load_encoder(minilm_path)
        assert status == 200
        for text, item in zip(TEXTS, body["data"], strict=True):
            assert cosine(item["embedding"], reference(model, text)) >= 0.9999
    finally:
        srv.proc.kill()


# ---- beside a chat model -------------------------------------------------------------------

def test_beside_the_chat_model(both):
    status, _, raw = request(both, "GET", "/v1/models")
    cards = json.loads(raw)["data"]
    assert status == 200 and [c["id"] for c in cards] == ["smollm2-135m-instruct", MINILM]
    assert "task" not in cards[0] and cards[1]["task"] == "embedding"
    with openai_client(both) as client:
        chat = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=4,
                                              messages=[{"role": "user", "content": "Hi"}])
        emb = client.embeddings.create(model=MINILM, input=["a cat", "a dog"])
    assert chat.choices[0].message.content and len(emb.data[1].embedding) == 384
    status, _, raw = request(both, "GET", "/v1/config")
    model_cfg = json.loads(raw)["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    assert status == 200 and model_cfg["embeddingModelPath"].endswith("all-MiniLM-L6-v2")
    status, err = post(both, "/v1/embeddings", {"input": "x", "dimensions": 128})
    assert status == 400 and err["error"]["param"] == "dimensions"
    status, err = post(both, "/v1/embeddings", {"input": "x", "model": "smollm2-135m-instruct"})
    assert status == 404 and MINILM in err["error"]["message"]


def test_the_chat_decodes_while_an_embedding_batch_runs(both):
    """The embedding model runs on its own thread: a chat completion of 8 decode steps, sent
    while a long embedding batch runs, is answered before that batch is (no encoder run has
    ended and the batch is still pending when its 8 tokens are in). Were the batch to hold the
    decode, the completion would come after it."""
    def series(name: str) -> float:
        text = request(both, "GET", "/metrics")[2].decode()
        line = next(x for x in text.splitlines()
                    if x.startswith(f'tiny_mindie_{name}{{model_name="{MINILM}"'))
        return float(line.rsplit(" ", 1)[1])

    wait_until(lambda: series("embedding_num_requests_pending") == 0, what="no embedding left")
    runs = series("embedding_batch_size_count")
    done: list[str] = []
    long = " ".join(f"passage {i} of the archive" for i in range(100))   # over 256 tokens
    batch = {"inputs": [f"{j} {long}" for j in range(64)], "truncate": True}

    def embed() -> None:
        status, vectors = post(both, "/embed", batch)
        done.append(f"embed {status} {len(vectors)}")

    worker = threading.Thread(target=embed)
    worker.start()
    try:
        wait_until(lambda: series("embedding_num_requests_pending") == 1, what="batch queued")
        status, answer = post(both, "/v1/completions", {
            "model": "smollm2-135m-instruct", "prompt": "Once upon a time", "max_tokens": 8,
            "ignore_eos": True, "temperature": 0})
        assert status == 200 and answer["usage"]["completion_tokens"] == 8
        assert done == []                                       # the batch is not answered
        assert series("embedding_num_requests_pending") == 1
        assert series("embedding_batch_size_count") == runs     # no encoder run has ended
    finally:
        worker.join()
    assert done == ["embed 200 64"]
    assert series("embedding_batch_size_count") == runs + 1


def test_metrics_and_the_access_log_count_embeddings(both):
    def series(name: str) -> float:
        text = request(both, "GET", "/metrics")[2].decode()
        line = next(x for x in text.splitlines()
                    if x.startswith(f'tiny_mindie_{name}{{model_name="{MINILM}"'))
        return float(line.rsplit(" ", 1)[1])

    before = {k: series(k) for k in ("embedding_requests_total", "embedding_inputs_total",
                                     "embedding_tokens_total", "embedding_batch_size_count",
                                     "embedding_batch_size_sum")}
    status, headers, raw = request(both, "POST", "/v1/embeddings",
                                   {"input": ["one two three", "four"]})
    tokens = json.loads(raw)["usage"]["prompt_tokens"]
    assert status == 200 and tokens == 5 + 3
    assert series("embedding_requests_total") == before["embedding_requests_total"] + 1
    assert series("embedding_inputs_total") == before["embedding_inputs_total"] + 2
    assert series("embedding_tokens_total") == before["embedding_tokens_total"] + tokens
    assert series("embedding_batch_size_sum") == before["embedding_batch_size_sum"] + 2
    assert series("embedding_batch_size_count") >= before["embedding_batch_size_count"] + 1
    assert series("embedding_seconds_total") > 0
    line = access_line(both, headers["x-request-id"])
    assert '"POST /v1/embeddings" 200' in line and f"prompt_tokens={tokens}" in line
    assert 'tiny_mindie_request_received_total{model_name="smollm2-135m-instruct"}' in \
        request(both, "GET", "/metrics")[2].decode()


def test_promtool_accepts_the_embedding_series(both):
    promtool = debian_binary("promtool", "prometheus")
    post(both, "/embed", {"inputs": "x"})
    status, _, body = request(both, "GET", "/metrics")
    assert status == 200 and b"tiny_mindie_embedding_batch_size_bucket" in body
    r = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True,
                       timeout=30)
    assert r.returncode == 0 and not r.stdout + r.stderr, (r.stdout + r.stderr).decode()


# ---- the clients of other ecosystems ---------------------------------------------------------

def test_langchain_openai_embeddings(both):
    lc = pytest.importorskip("langchain_openai")
    try:
        import httpx2 as httpx
    except ImportError:   # pragma: no cover
        import httpx
    http_client = httpx.Client(verify=both.ssl_context(), timeout=120)
    try:
        emb = lc.OpenAIEmbeddings(model=MINILM, base_url=both.url + "/v1", api_key="x",
                                  http_client=http_client, max_retries=0,
                                  check_embedding_ctx_length=False)
        docs = emb.embed_documents(["a cat sat on the mat", "stock prices fell"])
        query = emb.embed_query("where did the cat sit?")
    finally:
        http_client.close()
    assert len(docs) == 2 and len(query) == 384
    assert cosine(query, docs[0]) > cosine(query, docs[1])


def test_llamaindex_openai_like_embedding(both):
    li = pytest.importorskip("llama_index.embeddings.openai_like")
    import httpx
    http_client = httpx.Client(verify=both.ssl_context(), timeout=120)
    try:
        emb = li.OpenAILikeEmbedding(model_name=MINILM, api_base=both.url + "/v1", api_key="x",
                                     http_client=http_client, max_retries=0)
        docs = emb.get_text_embedding_batch(["a cat sat on the mat", "stock prices fell"])
        query = emb.get_query_embedding("where did the cat sit?")
    finally:
        http_client.close()
    status, own = post(both, "/v1/embeddings", {"model": MINILM,
                                                "input": "where did the cat sit?"})
    assert status == 200 and len(docs) == 2 and len(query) == 384
    assert cosine(query, own["data"][0]["embedding"]) > 0.99999
    assert cosine(query, docs[0]) > cosine(query, docs[1])


def test_huggingface_hub_feature_extraction(alone):
    hub = pytest.importorskip("huggingface_hub")
    import requests

    def tls_session() -> requests.Session:
        s = requests.Session()
        s.trust_env = False    # else REQUESTS_CA_BUNDLE from the environment overrides verify
        s.verify, s.cert = alone.ca, (alone.client_cert, alone.client_key)
        return s

    hub.configure_http_backend(backend_factory=tls_session)
    try:
        client = hub.InferenceClient(model=alone.url + "/embed", timeout=120)
        out = client.feature_extraction("what is a KV cache?", prompt_name="search_query")
    finally:
        hub.configure_http_backend()
    _, want = post(alone, "/embed", {"inputs": TEXTS[0]})
    assert out.shape == (1, 768) and np.allclose(out[0], want[0], atol=1e-6)


# ---- start-up ----------------------------------------------------------------------------------

@pytest.mark.parametrize("given, words", [
    ("/nonexistent/model.gguf", "embedding model: model file not found"),
    ("smollm2-135m-instruct", "embedding model: smollm2-135m-instruct is a chat model"),
    ("MODEL_PATH", "is a chat model, not an embedding model"),
])
def test_a_bad_embedding_model_is_one_line_and_exit_2(tmp_path, model_path, given, words):
    given = model_path if given == "MODEL_PATH" else given
    r = subprocess.run([sys.executable, "-m", "tiny_mindie", "serve", "--no-tls", "--port", "0",
                        "--embedding-model", given], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], r.stderr
