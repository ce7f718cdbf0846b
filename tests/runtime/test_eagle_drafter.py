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


def test_one_token_prompts_draft_nothing_until_the_target_has_committed_a_position(loaded):
    p = loaded["ort"]
    prompts = [[5], [5, 6, 7], [9]]
    want = [r.token_ids for r in p.generate(prompts, method="autoregressive", max_new_tokens=16)]
    for batch_size in (1, 3):
        got = p.generate(prompts, method="sd", max_new_tokens=16, batch_size=batch_size)
        assert [r.token_ids for r in got] == want


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

    from specrt.runtime.methods import METHODS, runs_with
    from specrt.runtime.speculation import SPECULATION

    for method in ("mtad", "dynamic"):
        with pytest.raises(InvalidRequestError, match="EAGLE"):
            loaded["ort"].generate(PROMPTS[:1], method=method, max_new_tokens=8)
    assert {m for m, cls in METHODS.items() if not cls.with_head} == {"mtad", "dynamic"}
    # calibrate and profile leave out the kinds those methods run (one answer, the method's)
    assert {k.name for k in SPECULATION.values() if not runs_with(k, loaded["ort"].draft)} == {"dynamic", "merged"}


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


def test_a_heads_greedy_chain_keeps_its_hidden_states_where_they_lie(loaded, monkeypatch):
    """Each draft step's hidden output feeds the next step beside its argmax on the device: the chain brings its
    tokens to the host once a round, as a draft model's does (what it drafts: the chain-ranks test below)."""
    from specrt.runtime.drafters.eagle import EagleDrafter
    from tests.drafting_syncs import host_copies_while_drafting

    p = loaded["torch"]
    copies, got = host_copies_while_drafting(monkeypatch, EagleDrafter, lambda: p.generate(
        PROMPTS[:3], method="sd", max_new_tokens=24, batch_size=3, num_draft_tokens=3))
    rounds = copies[::2]
    assert len(rounds) > 2 and rounds == [1] * len(rounds) and copies[1::2] == [None] * len(rounds)
    ar = p.generate(PROMPTS[:3], method="autoregressive", max_new_tokens=24)
    assert [r.token_ids for r in got] == [r.token_ids for r in ar] and sum(r.stats.accepted for r in got) > 0


@pytest.mark.gpu
def test_on_cuda_a_heads_greedy_chain_waits_for_the_device_only_for_its_tokens(request, monkeypatch):
    """On CUDA, under PyTorch's sync debug mode, a head's chain synchronises only in Runner.to_host."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    eagle_bundle = request.getfixturevalue("eagle_bundle")  # trained and exported only where the test runs
    from specrt.runtime.drafters.eagle import EagleDrafter
    from specrt.runtime.pipeline import Pipeline
    from tests.drafting_syncs import device_waits_while_drafting

    pipe = Pipeline.load(eagle_bundle, backend="torch", device="cuda")
    waits, out = device_waits_while_drafting(monkeypatch, EagleDrafter, lambda: pipe.generate(
        PROMPTS[:2], method="sd", max_new_tokens=16, batch_size=2, num_draft_tokens=3))
    assert waits
    ar = pipe.generate(PROMPTS[:2], method="autoregressive", max_new_tokens=16, batch_size=2)
    assert [g.token_ids for g in out] == [g.token_ids for g in ar]


def test_the_heads_steps_are_timed_as_a_drafts(loaded):
    from specrt.calibration.latency import prefill_times, step_times

    with loaded["ort"].draft.runner() as head:
        assert len(step_times(head, 2, 3, 16, repeats=2, warmup=1)) == 2
        assert len(prefill_times(head, 1, 8, repeats=2, warmup=1)) == 2


def test_a_heads_chain_ranks_are_what_each_chain_guesses_fed_its_own_hidden_states(loaded, eagle_bundle):
    """calibration/chains.py's every chain at once, against each chain run on its own through the torch modules."""
    import torch

    from specrt.calibration.chains import chain_ranks
    from specrt.model.checkpoint import load_checkpoint
    from specrt.model.eagle import step_module

    p = loaded["torch"]
    text = p.encode(PROMPTS[2])
    first = len(text)
    text += list(p.generate(PROMPTS[2], method="autoregressive", max_new_tokens=24).token_ids)
    with p.target.runner() as target, p.draft.runner() as head:
        ranks, rows = chain_ranks(target, head, text, first, 3)
    assert ranks.shape == (3, len(text) - first) and rows.shape[0] == len(text) - first
    t = step_module(load_checkpoint(eagle_bundle / "hf/target"), hidden=True).eval()
    h = step_module(load_checkpoint(eagle_bundle / "hf/draft")).eval()
    ids = torch.tensor(text)[None]
    causal = lambda n: torch.ones(1, n, n, dtype=torch.bool).tril()  # noqa: E731
    empty = lambda m: [torch.zeros(1, m.num_kv_heads, 0, m.head_dim)] * (2 * m.num_layers)  # noqa: E731
    with torch.no_grad():
        hidden = t(ids, torch.arange(len(text))[None], causal(len(text)), *empty(t))[-1][0]
        for s in (0, 5, 11):
            q = first + s - 2  # the last entry from the target's hidden states: its guess is output token s
            feats, tokens = list(hidden[:q + 1]), text[1:q + 2]
            for d in range(3):
                n = len(tokens)
                out = h(torch.tensor(tokens)[None], torch.arange(n)[None], causal(n), torch.stack(feats)[None],
                        *empty(h))
                logits, true = out[0][0, -1], text[q + d + 2]
                assert ranks[d, s] == int((logits > logits[true]).sum()), (s, d)
                feats.append(out[-1][0, -1])  # the chain feeds its own guess of the next hidden state
                tokens.append(text[q + d + 2])


def test_calibrate_profile_and_tune_a_head_bundle_and_auto_runs_what_they_chose(eagle_bundle, tmp_path):
    import shutil

    from specrt.calibration.acceptance import CalibrationConfig, calibrate
    from specrt.calibration.latency import ProfileConfig, profile
    from specrt.calibration.tune import TuneConfig, tune
    from specrt.runtime.pipeline import Pipeline

    b = shutil.copytree(eagle_bundle, tmp_path / "b")
    acc = calibrate(CalibrationConfig(bundle=b, num_prompts=3, new_tokens=24, max_depth=3, max_rank=3, max_nodes=6,
                                      ngram_sizes=(5,)), progress=False)
    assert set(acc.measured) == {"ngram"}  # the draft model's beam search (dynamic trees) is not the head's
    assert acc.depth_rank[0][0] > 0 and 0 < acc.chain_expected_accepted[0] <= acc.chain_expected_accepted[2]
    profile(ProfileConfig(bundle=b, batch_sizes=(1,), contexts=(32,), num_tokens=(1, 2, 4, 8), repeats=1, warmup=0,
                          passes=1), progress=False)
    plan = tune(TuneConfig(bundle=b, batch_sizes=(1,)))
    assert plan.choices[1].best.kind in ("autoregressive", "tree", "chain", "ngram")
    pipe = Pipeline.load(b, threads=2)
    want = [r.token_ids for r in pipe.generate(PROMPTS, method="autoregressive", max_new_tokens=24)]
    assert [r.token_ids for r in pipe.generate(PROMPTS, method="auto", max_new_tokens=24, batch_size=2)] == want


def test_the_head_runs_on_static_engines_lossless_and_as_the_eager_steps_draft(eagle_bundle, loaded, tmp_path):
    """The static engines (`specrt build`; eager on the CPU, CUDA graphs on a GPU) feed the head its features and give
    the target's hidden states at fixed addresses: a batch that fills a bucket and leaves the static cache, and
    requests admitted alone, draft what the eager torch steps draft."""
    import shutil

    from specrt.engines.build import BuildConfig, build
    from specrt.runtime.pipeline import Pipeline

    b = shutil.copytree(eagle_bundle, tmp_path / "b")
    build(BuildConfig(bundle=b, device="cpu", threads=2, token_profiles=(1, 4, 16), batch_buckets=(1, 2),
                      capacity=128, spans=(64,)), progress=False)
    static = Pipeline.load(b, backend="static", threads=2)
    want = [r.token_ids for r in loaded["torch"].generate(PROMPTS, method="autoregressive", max_new_tokens=32)]
    for options in ({"num_draft_tokens": 2}, {"num_draft_tokens": 3, "ngram_tokens": 3}):
        got = static.generate(PROMPTS, method="sd", max_new_tokens=32, batch_size=2, **options)
        assert [r.token_ids for r in got] == want
        eager = loaded["torch"].generate(PROMPTS, method="sd", max_new_tokens=32, batch_size=2, **options)
        assert sum(r.stats.accepted for r in got) == sum(r.stats.accepted for r in eager) > 0
    # calibration's chains in steps of at most the largest profile (16 rows) rank as the eager steps' one step each
    from specrt.calibration.chains import chain_ranks

    text = static.encode(PROMPTS[2]) + list(want[2])
    ranks = []
    for p in (static, loaded["torch"]):
        with p.target.runner() as target, p.draft.runner() as head:
            ranks.append(chain_ranks(target, head, text, len(text) - len(want[2]), 3)[0])
    assert static.target.max_step_tokens == 16 < len(text) and (ranks[0] == ranks[1]).all()


def test_a_head_short_of_a_weight_is_refused_by_name(eagle_head, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from specrt.errors import SpecrtError
    from specrt.model.checkpoint import load_checkpoint
    from specrt.model.eagle import assemble_eagle

    cfg, _ = eagle_head
    broken = shutil.copytree(cfg.dest, tmp_path / "broken")
    weights = load_file(str(broken / "model.safetensors"))
    del weights["model.norm.weight"]
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(SpecrtError, match="is not the head its config.json describes"):
        assemble_eagle(broken, load_checkpoint(cfg.target))


def test_the_heads_parity_check_catches_a_graph_that_ignores_its_features(eagle_bundle):
    import onnxruntime
    import torch

    from specrt.graphs.parity import check_parity, text_tokens
    from specrt.model.checkpoint import load_checkpoint, load_tokenizer
    from specrt.model.eagle import step_module

    session = onnxruntime.InferenceSession(str(eagle_bundle / "draft.onnx"), providers=["CPUExecutionProvider"])
    head = step_module(load_checkpoint(eagle_bundle / "hf/draft")).eval()
    tokens = text_tokens(load_tokenizer(eagle_bundle / "tokenizer"), head.hf.config.vocab_size)
    assert check_parity(session, head, tokens).ok()
    with torch.no_grad():
        head.fc.weight[:, head.fc.out_features:] = 0  # the module now ignores its features: as a wrong graph would
    assert not check_parity(session, head, tokens).ok()
