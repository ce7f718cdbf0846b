"""Every pass over the ONNX step graphs, each a function from a model (or a graph file) to a model, with its test in
tests/graphs or beside its caller's: saving, bfloat16 upcasts and PPD's prompt embeddings (passes.py), parity against
PyTorch (parity.py), the rows a ragged step packs (packed_rows.py), the fusions ONNX Runtime runs faster
(ort_fusions.py: RMSNorms, merged projections; ort_attention.py: GroupQueryAttention) and the weight rewrites of
quantization (quantize.py)."""
