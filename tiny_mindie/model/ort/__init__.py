"""Running the graphs in onnxruntime: the decoder backend (:mod:`.ort_backend`, its session,
KV layout and start-up checks; :mod:`.ort_standard` for the standard graph), the encoder's
session, the execution providers and the memory a model needs."""
