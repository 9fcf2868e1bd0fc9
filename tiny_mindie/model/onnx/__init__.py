"""Building the ONNX graphs: the decoder's contrib graph (:mod:`.graph`, its nodes and layers),
the standard graph of default-domain operators (:mod:`.graph_standard`), the weights' packing
(:mod:`.weights`, :mod:`.graph_weights`), the encoder's graph, the CANN operator lists and the
graph cache."""
