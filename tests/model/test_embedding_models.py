"""The two registry embedding models as files: nomic-embed-text-v1.5 (GGUF, nomic-bert) and
all-MiniLM-L6-v2 (a sentence-transformers folder), read into one encoder configuration, their
weights in one layout, and their WordPiece tokenizers agreeing with each other (the same
bert-base-uncased vocabulary, one from GGUF metadata, one from tokenizer.json)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from tiny_mindie.model.encoder_load import load_encoder
from tiny_mindie.model.gguf import ModelFileError
from tiny_mindie.model.registry import catalog as registry
from tiny_mindie.model.registry.assemble import sha256_of

TEXTS = ["Hello World, naïve café! search_query: what is TSNE?",
         "日本語 テキスト 123,456 x##y [CLS] [SEP] [UNK] [MASK] [PAD]", "", "  \t\n", "a" * 300,
         "Unbelievably tokenization-heavy hyperparameterization"]


@pytest.fixture(scope="module")
def minilm(minilm_path):
    return load_encoder(minilm_path)


@pytest.fixture(scope="module")
def nomic(nomic_path):
    return load_encoder(nomic_path)


def test_the_registry_files_are_where_the_registry_says(minilm_path, nomic_path):
    assert minilm_path == registry.model_file(registry.MODELS["all-minilm-l6-v2"])
    assert os.path.isdir(minilm_path)
    assert sha256_of(os.path.join(minilm_path, "model.safetensors")) == \
        registry.MODELS["all-minilm-l6-v2"].sha256
    assert os.path.getsize(nomic_path) == registry.MODELS["nomic-embed-text-v1.5"].size
    with pytest.raises(ModelFileError, match="is an embedding model: give it as "
                                             "--embedding-model"):
        registry.check_model("all-minilm-l6-v2")
    with pytest.raises(ModelFileError, match="is a chat model: give it as --model"):
        registry.check_model("smollm2", task="embedding")


def test_minilm_config_and_weights(minilm):
    c, w = minilm.config, minilm.weights
    assert (c.arch, c.hidden, c.layers, c.heads, c.ffn) == ("bert", 384, 6, 12, 1536)
    assert (c.pooling, c.normalize, c.context, c.vocab) == ("mean", True, 256, 30522)
    assert c.matryoshka == () and c.prefixes == {}
    assert w.tokens.shape == (30522, 384) and w.positions.shape == (512, 384)
    layer = w.layers[0]
    assert layer.qkv.shape == (384, 1152) and layer.up.shape == (384, 1536)
    assert layer.down.shape == (1536, 384) and layer.gate is None
    assert all(a.dtype == np.float32 for a in (w.tokens, layer.qkv, layer.qkv_b))


def test_nomic_config_and_weights(nomic):
    c, w = nomic.config, nomic.weights
    assert (c.arch, c.hidden, c.layers, c.heads, c.ffn) == ("nomic-bert", 768, 12, 12, 3072)
    assert (c.pooling, c.normalize, c.context, c.rope_base) == ("mean", True, 2048, 1000.0)
    assert c.matryoshka == (512, 256, 128, 64)
    assert c.prefixes["search_query"] == "search_query: "
    assert w.positions is None and w.types.shape == (2, 768)
    layer = w.layers[11]
    assert layer.qkv.shape == (768, 2304) and layer.gate.shape == (768, 3072)
    assert layer.down.shape == (3072, 768) and not layer.qkv_b.any()


def test_the_gguf_wordpiece_is_the_sentence_transformers_one(minilm, nomic):
    for text in TEXTS:
        assert nomic.tokenizer.encode(text).ids == minilm.tokenizer.encode(text).ids, text
    ids = nomic.tokenizer.encode("search_query: embeddings").ids
    assert ids[0] == 101 and ids[-1] == 102 and 100 not in ids


def test_a_folder_that_is_not_a_bert_is_refused(minilm_path, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(minilm_path, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "roberta"}))
    with pytest.raises(ModelFileError, match="'roberta' is not an embedding model"):
        load_encoder(str(folder))
    (folder / "config.json").write_text(json.dumps(cfg))
    os.unlink(folder / "model.safetensors")
    with pytest.raises(ModelFileError, match="model.safetensors"):
        load_encoder(str(folder))


def test_a_chat_gguf_is_not_an_encoder(model_path):
    with pytest.raises(ModelFileError, match="is not an embedding model"):
        load_encoder(model_path)
