"""scripts/quality.py's two fixed texts (scripts/texts/) are 300+ tokens with the default model's
tokenizer (the script's arithmetic: tests/unit/test_quality_script.py)."""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("quality_script",
                                               os.path.join(_REPO, "scripts", "quality.py"))
quality = importlib.util.module_from_spec(_spec)
sys.modules["quality_script"] = quality
_spec.loader.exec_module(quality)


def test_fixed_texts_tokenize_to_300_tokens_or_more(tokenizer):
    for name in quality.TEXTS:
        ids = quality.text_ids(tokenizer, name)
        assert ids.dtype == np.int64 and len(ids) >= 300, (name, len(ids))
        assert quality.text_ids(tokenizer, name, 64).tolist() == ids[:64].tolist()
