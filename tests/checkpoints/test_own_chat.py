"""The requests a chat target asks itself (teacher.py, Magpie): cut from its own template, ended by its own end of a
turn, kept out of the benchmark's chat prompts, each in one split only, and answered greedily into the corpus."""

from __future__ import annotations

from specrt.checkpoints import DEMO_DIR

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_benchmark_prompt_and_its_rewording_are_near_it_and_other_requests_are_not():
    from specrt.held_out import CHAT, near_benchmark

    assert all(near_benchmark(p) for p in CHAT)
    assert near_benchmark("what's the capital of France and what is it famous for")
    assert near_benchmark("Write a haiku about the autumn leaves")
    assert not near_benchmark("Write a haiku about the sea.")
    assert not near_benchmark("Can you help me plan a trip to the Amazon rainforest?")
    assert not near_benchmark("")


def test_the_opening_of_a_users_turn_is_cut_from_the_template_and_no_template_has_none():
    from transformers import AutoTokenizer

    from specrt.checkpoints.prompt_mix import as_chat, user_turn

    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "tokenizer")
    assert user_turn(tokenizer) is None  # the demo tokenizer has no chat template
    tokenizer.chat_template = CHATML
    before, after = user_turn(tokenizer)
    assert (before, after) == ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    assert as_chat(tokenizer, "Hi there") == before + "Hi there" + after


def test_the_real_target_asks_itself_requests_and_answers_them_into_its_corpus(smollm2, tmp_path):
    from transformers import AutoTokenizer

    from specrt.checkpoints.prompt_mix import OWN_CHAT, as_chat
    from specrt.checkpoints.teacher import ASK_TOKENS, TeacherConfig, build_corpus, split_of
    from specrt.held_out import near_benchmark, words

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    cfg = TeacherConfig(prompts=0, own_chats=4, new_tokens=8, source_windows=0, gen_batch=16, top_k=4)
    made = {}
    for split in ("train", "validation"):
        corpus, record = build_corpus(smollm2, smollm2, cfg, tmp_path, split, threads=2, progress=False)
        asked = record["asked"]
        requests = asked["requests"]
        assert len(requests) == 4 and corpus.kinds == [OWN_CHAT] * 4, asked
        assert asked["drawn"] == len(requests) + sum(asked["dropped"].values()) + asked["other_split"]
        for s, request in enumerate(requests):
            assert split_of(request) == split and len(words(request)) >= 3 and not near_benchmark(request)
            assert 0 < len(tokenizer.encode(request, add_special_tokens=False)) <= ASK_TOKENS
            ids, first, _ = corpus.sequence(s)
            prompt = tokenizer.encode(as_chat(tokenizer, request), add_special_tokens=False)
            assert ids[:first + 1].tolist() == prompt  # the request through the template, then the target's answer
        made[split] = {frozenset(words(r)) for r in requests}
    assert not made["train"] & made["validation"]



def test_the_held_out_requests_are_spread_among_the_mix_so_a_files_first_prompts_hold_both():
    from specrt.checkpoints.prompt_mix import OWN_CHAT, Prompt, spread

    mix = [Prompt("code", f"m{i}") for i in range(8)]
    own = [Prompt(OWN_CHAT, f"o{i}") for i in range(3)]
    got = [p.text for p in spread(mix, own)]
    assert got == ["m0", "m1", "o0", "m2", "m3", "o1", "m4", "m5", "o2", "m6", "m7"]
    assert [p.text for p in spread(mix[:1], own)] == ["m0", "o0", "o1", "o2"]
    assert spread(mix, []) == mix and spread([], own) == own
