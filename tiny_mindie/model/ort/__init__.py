"""Running the graphs in onnxruntime: the decoder backend (:mod:`.ort_backend`, its session,
KV cache, shape policies and start-up checks), the encoder's
session, the execution providers and the memory a model needs."""
