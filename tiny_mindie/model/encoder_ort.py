"""``EncoderSession``: the encoder graph (:mod:`.encoder_graph`) run by onnxruntime over
batches of texts, each padded to its length's bucket (:func:`.encoder_pool.bucket`) and run with
the texts of the same bucket, so a text's vector is the same alone and in any batch."""

from __future__ import annotations

import numpy as np

from .encoder_load import EncoderModel
from .encoder_pool import bucket, pool_weights

#: The most attention scores (float32 ``rows x heads x width x width``) one run may hold: long
#: texts run fewer rows at a time (one at least), so memory stays bounded whatever the batch.
MAX_SCORES = 1 << 27


class EncoderSession:
    """An embedding model's onnxruntime session.

    Args:
        model: the loaded model.
        threads: intra-op threads (0: onnxruntime's default).
        max_rows: at most this many texts per run (a bigger bucket group is run in pieces);
            fewer for long texts, so that a run holds at most :data:`MAX_SCORES` attention
            scores.
    """

    def __init__(self, model: EncoderModel, threads: int = 0, max_rows: int = 64) -> None:
        import onnxruntime as ort

        from .encoder_graph import build_encoder
        from .providers import session_options

        self.model, self.config, self.max_rows = model, model.config, max_rows
        proto = build_encoder(model.config, model.weights)
        so = session_options(threads, spinning=False)
        self.session = ort.InferenceSession(proto.SerializeToString(), so,
                                            providers=["CPUExecutionProvider"])

    def encode(self, batch: list[list[int]]) -> np.ndarray:
        """Pooled vectors (not normalized) of texts given as token ids (each 1 ..
        ``context`` ids, ``[CLS] ... [SEP]`` included): float32 ``[len(batch), hidden]``.

        Raises:
            ValueError: a text empty, longer than the context, or with an id outside the
                vocabulary.
        """
        cfg = self.config
        out = np.zeros((len(batch), cfg.hidden), dtype=np.float32)
        groups: dict[int, list[int]] = {}
        for i, ids in enumerate(batch):
            if not 0 < len(ids) <= cfg.context or min(ids) < 0 or max(ids) >= cfg.vocab:
                raise ValueError(f"text {i}: {len(ids)} ids (1 to {cfg.context}, each 0 to "
                                 f"{cfg.vocab - 1})")
            groups.setdefault(min(bucket(len(ids)), cfg.context), []).append(i)
        for width, rows in groups.items():
            step = max(1, min(self.max_rows, MAX_SCORES // (cfg.heads * width * width)))
            for start in range(0, len(rows), step):
                part = rows[start:start + step]
                out[part] = self._run([batch[i] for i in part], width)
        return out

    def _run(self, texts: list[list[int]], width: int) -> np.ndarray:
        n = len(texts)
        ids = np.full((n, width), self.config.pad_id, dtype=np.int64)
        mask = np.zeros((n, width), dtype=np.float32)
        for r, t in enumerate(texts):
            ids[r, :len(t)] = t
            mask[r, :len(t)] = 1.0
        pool = pool_weights([len(t) for t in texts], width, self.config.pooling)
        return self.session.run(["pooled"], {"input_ids": ids,
                                             "token_type_ids": np.zeros_like(ids),
                                             "attention_mask": mask, "pool": pool})[0]
