"""The HF baselines of `bench e2e`: a static cache sized once for the longest prompt, so that the decode step HF
compiles for it (on CUDA) has one shape."""

from __future__ import annotations


def test_a_static_cache_is_sized_once_for_the_longest_prompt(demo_bundle, humaneval):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specrt.bench.e2e import E2EConfig, _HF

    cfg = E2EConfig(bundle=demo_bundle, max_new_tokens=8)
    tok = AutoTokenizer.from_pretrained(demo_bundle / "tokenizer")
    model = AutoModelForCausalLM.from_pretrained(demo_bundle / "hf/target", dtype=torch.float32).eval()
    prompts = sorted(humaneval[:4], key=lambda p: len(tok(p)["input_ids"]))  # the shortest first
    decoded = _HF(model, tok, cfg)(prompts)
    plain = decoded.outputs
    # the streamer marks each prompt's first new token: after its start, before its last
    assert len(decoded.first_s) == len(decoded.decode_s) == len(prompts)
    assert all(f > 0 and d > 0 for f, d in zip(decoded.first_s, decoded.decode_s)), decoded
    lengths, generate = [], model.generate

    def spy(*args, **kwargs):  # the static cache's length after each generate
        out = generate(*args, **kwargs)
        lengths.append(model._previous_max_cache_length)
        return out

    model.generate = spy
    static = _HF(model, tok, cfg, cache_implementation="static")
    assert static(prompts)[0] == plain and static(prompts)[0] == plain  # the same greedy tokens
    longest = len(tok(prompts[-1])["input_ids"])
    assert len(lengths) == 1 + 2 * len(prompts)  # the sizing call, then every prompt twice
    assert set(lengths) == {lengths[0]} and longest + 7 <= lengths[0] <= longest + 8  # one cache length from the first
