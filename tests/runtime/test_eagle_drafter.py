"""EAGLE in the runtime: a draft head on the target's hidden states (model/eagle.py, runtime/drafters/eagle.py) is
lossless on both backends, in batches that fill and drain, and it guesses what the head computes from the target's
true hidden states: each round's first guess is the head's guess at that position, teacher-forced."""

from __future__ import annotations

import json

import pytest

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\n\ndef", "class Stack:\n    def",
           "for i in range(10):"]


@pytest.fixture(scope="module")
def loaded(eagle_bundle):
    from specrt.runtime.pipeline import Pipeline

    return {b: Pipeline.load(eagle_bundle, backend=b, threads=2) for b in ("ort", "torch")}


def test_the_bundle_says_which_step_reads_and_which_gives_hidden_states(eagle_bundle):
    models = json.loads((eagle_bundle / "manifest.json").read_text())["models"]
    assert models["target"]["hidden"] and not models["target"]["features"]
    assert models["draft"]["features"] and models["draft"]["num_layers"] == 1
    assert models["draft"]["hidden_size"] == models["target"]["hidden_size"] > 0


@pytest.mark.parametrize("backend", ["ort", "torch"])
@pytest.mark.parametrize("method,options", [("sd", {}), ("sd", {"num_draft_tokens": 2}),
                                            ("tree", {}), ("sd", {"ngram_tokens": 3})])
def test_the_head_is_lossless_alone_and_in_batches_that_fill_and_drain(loaded, backend, method, options):
    p = loaded[backend]
    want = [r.token_ids for r in p.generate(PROMPTS, method="autoregressive", max_new_tokens=40)]
    batched = p.generate(PROMPTS, method=method, max_new_tokens=40, batch_size=5, **options)
    assert [r.token_ids for r in batched] == want
    assert [r.token_ids for r in p.generate(PROMPTS, method=method, max_new_tokens=40, batch_size=2, **options)] == want
    assert [p.generate([q], method=method, max_new_tokens=40, **options)[0].token_ids for q in PROMPTS[:2]] == want[:2]
    assert sum(r.stats.accepted for r in batched) > 0


def test_each_rounds_first_guess_is_the_heads_guess_from_the_targets_hidden_states(loaded, eagle_bundle):
    import torch

    from specrt.model.checkpoint import load_checkpoint
    from specrt.model.eagle import step_module

    p = loaded["torch"]
    target = step_module(load_checkpoint(eagle_bundle / "hf/target"), hidden=True).eval()
    head = step_module(load_checkpoint(eagle_bundle / "hf/draft")).eval()
    empty = lambda m: [torch.zeros(1, m.num_kv_heads, 0, m.head_dim)] * (2 * m.num_layers)  # noqa: E731
    for prompt, result in zip(PROMPTS, p.generate(PROMPTS, method="sd", max_new_tokens=40, num_draft_tokens=1)):
        ids = torch.tensor(p.encode(prompt) + list(result.token_ids))[None]
        length = ids.shape[1]
        pos, mask = torch.arange(length)[None], torch.ones(length, length, dtype=torch.bool).tril()[None]
        with torch.no_grad():
            hidden = target(ids, pos, mask, *empty(target))[-1]
            guesses = head(torch.roll(ids, -1, 1), pos, mask, hidden, *empty(head))[0].argmax(-1)[0]
        # entry q (x_{q+1} beside n_q) guesses x_{q+2}; a round at root position r drafts x_{r+1}, from entry r - 1
        root, accepted = result.prompt_tokens - 1, 0
        while root + 1 < length:
            hit = int(guesses[root - 1] == ids[0, root + 1])
            accepted, root = accepted + hit, root + 1 + hit
        assert result.stats.accepted == accepted, prompt


def test_methods_that_need_a_draft_model_say_the_head_is_not_one(loaded):
    from specrt.errors import InvalidRequestError

    for method in ("mtad", "dynamic"):
        with pytest.raises(InvalidRequestError, match="EAGLE"):
            loaded["ort"].generate(PROMPTS[:1], method=method, max_new_tokens=8)


def test_the_head_and_its_target_run_with_the_in_graph_kv_update(eagle_bundle, tmp_path):
    import shutil

    from specrt.export.inplace import InPlaceConfig, in_place
    from specrt.runtime.pipeline import Pipeline

    bundle = shutil.copytree(eagle_bundle, tmp_path / "eagle")
    graphs = in_place(InPlaceConfig(bundle=bundle), progress=False)
    assert set(graphs.graphs) == {"target", "draft"}
    runtime = Pipeline.load(bundle, backend="ort", threads=2)
    want = [r.token_ids for r in runtime.generate(PROMPTS, method="autoregressive", max_new_tokens=40)]
    p = Pipeline.load(bundle, backend="ort", threads=2, kv_update="inplace")
    for method, options in (("sd", {"num_draft_tokens": 3}), ("tree", {})):
        got = p.generate(PROMPTS, method=method, max_new_tokens=40, batch_size=3, **options)
        assert [r.token_ids for r in got] == want
        assert sum(r.stats.accepted for r in got) > 0
