"""``EncoderSession``: the encoder graph (:mod:`.encoder_graph`) run by onnxruntime over
batches of texts, each padded to its length's bucket and run with the texts of the same bucket,
so a text's vector is the same alone and in any batch.

Two flavours, as the chat model's graph (``--graph``): ``contrib`` pads a text to
:func:`.encoder_pool.bucket` (steps of 16 tokens and more) and runs as many rows as there are
texts, on the CPU; ``standard`` runs only a fixed set of shapes
(:attr:`EncoderSession.static_shapes`), for a compiling execution provider (CANN's graph mode
builds one graph per set of input shapes): a text is padded to a length of
:attr:`~EncoderSession.widths` (16, 32, 64, ... up to the model's context) and a run's rows to
a power of two (up to ``max_rows``), the padding rows empty texts whose vectors are dropped; on
a provider other than the CPU's every shape is run once at start-up
(:meth:`~EncoderSession.warm_up`). The graph holds default-domain operators only in both.
"""

from __future__ import annotations

import numpy as np

from ..encoder_load import EncoderModel
from ..encoder_pool import MIN_BUCKET, bucket, pool_weights
from .shapes import bucket as static_bucket
from .shapes import buckets

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
        flavour: ``contrib`` (any shape, the CPU) or ``standard`` (the static shapes below,
            on ``providers``).
        providers: the execution providers of a ``standard`` session (names or ``(name,
            options)``, :func:`.providers.select_providers`); ``None``: the CPU's.

    Attributes:
        widths: the padded text lengths of a ``standard`` session (``()`` for ``contrib``).
        static_shapes: its ``(rows, width)`` input shapes, each width with the powers of two
            up to the rows it may run at once.
        shapes_run: the ``(rows, width)`` shapes the session has been given so far.

    Raises:
        ValueError: ``flavour`` is neither.
    """

    def __init__(self, model: EncoderModel, threads: int = 0, max_rows: int = 64,
                 flavour: str = "contrib", providers: list | None = None) -> None:
        import onnxruntime as ort

        from ..onnx.encoder_graph import build_encoder
        from .providers import CPU, session_options

        if flavour not in ("contrib", "standard"):
            raise ValueError(f"graph flavour {flavour!r}: contrib or standard")
        self.model, self.config, self.max_rows = model, model.config, max_rows
        self.flavour = flavour
        cfg = model.config
        self.widths: tuple[int, ...] = ()
        self.static_shapes: tuple[tuple[int, int], ...] = ()
        if flavour == "standard":
            self.widths = buckets(MIN_BUCKET, 2, cfg.context)
            self.static_shapes = tuple((r, w) for w in self.widths
                                       for r in buckets(1, 2, self._step(w)))
        self.shapes_run: set[tuple[int, int]] = set()
        proto = build_encoder(cfg, model.weights, standard=flavour == "standard")
        so = session_options(threads, spinning=False)
        chosen = list(providers) if flavour == "standard" and providers else [CPU]
        self.session = ort.InferenceSession(proto.SerializeToString(), so, providers=chosen)
        if self.session.get_providers()[0] != CPU and flavour == "standard":
            self.warm_up()

    def _step(self, width: int) -> int:
        """The most rows one run at ``width`` takes (:data:`MAX_SCORES`); a power of two in a
        ``standard`` session."""
        step = max(1, min(self.max_rows, MAX_SCORES // (self.config.heads * width * width)))
        return 1 << (step.bit_length() - 1) if self.flavour == "standard" else step

    def warm_up(self) -> int:
        """Run every shape of :attr:`static_shapes` once, padding only, so that a compiling
        provider builds its graphs now rather than when a request first needs one. Returns the
        number of runs."""
        for rows, width in self.static_shapes:
            self._run([], width, rows)
        return len(self.static_shapes)

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
            groups.setdefault(self._width(len(ids)), []).append(i)
        for width, rows in groups.items():
            step = self._step(width)
            for start in range(0, len(rows), step):
                part = rows[start:start + step]
                n = len(part) if not self.widths else static_bucket(
                    len(part), buckets(1, 2, step))
                out[part] = self._run([batch[i] for i in part], width, n)[:len(part)]
        return out

    def _width(self, n: int) -> int:
        """The padded length of a text of ``n`` tokens: chosen by ``n`` alone."""
        if self.widths:
            return static_bucket(n, self.widths)
        return min(bucket(n), self.config.context)

    def _run(self, texts: list[list[int]], width: int, n: int) -> np.ndarray:
        """One session run of ``n >= len(texts)`` rows of ``width`` tokens: the rows past the
        texts are empty (mask and pooling weights 0, a zero vector). Returns float32
        ``[n, hidden]``."""
        self.shapes_run.add((n, width))
        ids = np.full((n, width), self.config.pad_id, dtype=np.int64)
        mask = np.zeros((n, width), dtype=np.float32)
        for r, t in enumerate(texts):
            ids[r, :len(t)] = t
            mask[r, :len(t)] = 1.0
        pool = np.zeros((n, width), dtype=np.float32)
        pool[:len(texts)] = pool_weights([len(t) for t in texts], width, self.config.pooling)
        return self.session.run(["pooled"], {"input_ids": ids,
                                             "token_type_ids": np.zeros_like(ids),
                                             "attention_mask": mask, "pool": pool})[0]
