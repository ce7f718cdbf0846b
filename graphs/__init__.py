"""Passes over step graphs: structural check and shape inference (passes.py), parity against PyTorch
(parity.py)."""
