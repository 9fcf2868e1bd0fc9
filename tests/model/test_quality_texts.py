"""scripts/quality.py's two fixed texts (scripts/texts/) are 300+ tokens with the default model's
tokenizer (the script's arithmetic: tests/unit/test_quality_script.py)."""

from __future__ import annotations

import numpy as np
from script_modules import load_script

quality = load_script("quality", "quality_script")


def test_fixed_texts_tokenize_to_300_tokens_or_more(tokenizer):
    for name in quality.TEXTS:
        ids = quality.text_ids(tokenizer, name)
        assert ids.dtype == np.int64 and len(ids) >= 300, (name, len(ids))
        assert quality.text_ids(tokenizer, name, 64).tolist() == ids[:64].tolist()
