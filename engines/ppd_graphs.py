"""PPD's prompt tokens in the ONNX step graphs: a copy of the target graph whose input embedding table has their rows
(graphs/passes.add_prompt_embeddings), for the exported graph and, where `specrt inplace` made one, its in-graph
variant; each checked to give the source graph's logits on ordinary ids before it replaces anything."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specrt.bundle import artifacts
from specrt.bundle.manifest import sha256_file
from specrt.errors import SpecrtError
from specrt.files import atomic_file

GRAPH = "target-ppd.onnx"  # beside target.onnx: it shares that graph's external data file, if any
PARITY = 1e-5  # per unit of the largest logit: the graph pass only appends embedding rows


def _feeds(session, vocab: int, rows: int = 5, capacity: int = 8) -> dict:
    """Ordinary ids at positions 0..rows-1 on an empty cache: exported graphs take past K/V of length 0, in-graph ones
    (`specrt inplace`) a cache of `capacity` slots written at write_indices 0."""
    rng = np.random.default_rng(0)
    names = {i.name for i in session.get_inputs()}
    inplace = "write_indices" in names
    feeds = {}
    for i in session.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(0, vocab, (1, rows)).astype(np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(rows, dtype=np.int64)[None]
        elif i.name == "attention_mask":
            width = capacity if inplace else rows
            feeds[i.name] = np.tri(rows, width, dtype=bool)[None]
        elif i.name == "write_indices":
            feeds[i.name] = np.zeros(1, dtype=np.int64)
        else:
            heads, dim = i.shape[1], i.shape[3]
            feeds[i.name] = np.zeros((1, heads, capacity if inplace else 0, dim),
                                     dtype=np.float16 if "16" in i.type else np.float32)
    return feeds


def prompt_graph(bundle: Path, onnx_name: str, dest: str, prompts: np.ndarray, vocab: int, threads: int = 2) -> float:
    """Write `dest` (beside `onnx_name`), the target graph `onnx_name` with the prompt tokens, atomically; returns its
    max |logit| difference from `onnx_name` on ordinary ids (the same weights: it must be ~0; a larger one is refused,
    nothing written)."""
    import onnxruntime as ort

    from specrt.graphs.passes import add_prompt_embeddings

    target = bundle / dest
    with atomic_file(target, suffix=".onnx") as tmp:
        add_prompt_embeddings(bundle / onnx_name, tmp, prompts)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        a, b = (ort.InferenceSession(str(g), opts, providers=["CPUExecutionProvider"])
                for g in (bundle / onnx_name, tmp))
        feeds = _feeds(a, vocab)
        want, got = a.run(["logits"], feeds)[0], b.run(["logits"], feeds)[0]
        diff = float(np.abs(want - got).max())
        if not diff <= PARITY * max(1.0, float(np.abs(want).max())):
            raise SpecrtError(f"the target graph with prompt tokens gives other logits for ordinary ids than "
                              f"{bundle / onnx_name} (max |difference| {diff:.3g}): the graph pass is wrong for this "
                              "graph")
    return diff


def inplace_graph(bundle: Path, prompts: np.ndarray, vocab: int) -> dict:
    """The in-graph variant with the prompt tokens (PromptTokens' inplace_* fields), where `specrt inplace` made
    one that is still valid; else nothing."""
    from specrt.bundle.artifacts import InPlaceGraphs

    if not (bundle / InPlaceGraphs.FILE).is_file():
        return {}
    try:
        source = artifacts.load(bundle, InPlaceGraphs).graphs["target"]
    except (SpecrtError, KeyError):
        return {}  # stale or broken: `specrt inplace` says so when it is asked for
    dest = str(Path(source.file).with_name(GRAPH))
    prompt_graph(bundle, source.file, dest, prompts, vocab)
    return {"inplace_graph": dest, "inplace_graph_sha256": sha256_file(bundle / dest),
            "inplace_source_sha256": source.sha256}
