"""Mixed prompts a target is asked to continue, for the text a draft learns from (teacher.py): code, prose and chat.

Made offline and deterministically from this Python's standard library and a list of topics written here:

    code   a function's signature and docstring, as HumanEval poses a task (the function body is the target's)
    prose  the first half of a module's or class's docstring paragraph, to be continued
    chat   through the tokenizer's own chat template (only where it has one): a function to write from its docstring's
           first sentence, a piece of code to explain, or a question about a topic

Beside them, the teacher asks the target itself for requests (teacher.py, kind OWN_CHAT) from the opening of a user's
turn that `user_turn` finds in the template.

Each prompt comes from the train or the validation split: stdlib prompts by the corpus's path-hash split
(corpus.is_validation), topic questions by a hash of the topic. Validation prompts are never trained on. None of them
is a benchmark prompt (HumanEval's, or the chat prompts the bench poses).
"""

from __future__ import annotations

import ast
import functools
import hashlib
from dataclasses import dataclass

import numpy as np

from specrt.checkpoints.corpus import load_corpus
from specrt.errors import SpecrtError

KINDS = ("code", "prose", "chat")
OWN_CHAT = "own-chat"  # a chat whose request the target wrote itself (teacher.py)
MARK = "SPECRT-USER-TURN-7f3c"  # stands for a user's words where a template is cut at them
TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "machine learning", "compound interest",
    "the immune system", "plate tectonics", "the Roman Empire", "climate change", "vaccines", "the stock market",
    "renewable energy", "the printing press", "DNA", "the internet", "volcanoes", "the human brain", "electric cars",
    "the Moon landing", "inflation", "bees", "the Silk Road", "quantum computers", "coffee", "the Olympic Games",
    "recycling", "earthquakes", "the Renaissance", "antibiotics", "solar panels", "the ocean tides", "jazz",
    "the theory of evolution", "cryptocurrency", "sleep", "the Great Wall of China", "nuclear power", "rainforests",
    "the periodic table", "gravity", "democracy", "chess", "the Industrial Revolution", "bread baking", "glaciers",
    "the speed of light", "public transport", "meditation", "dinosaurs", "supply and demand", "hurricanes",
    "the Pyramids of Giza", "vitamins", "satellites", "languages", "friendship", "time management", "libraries",
    "marathon training", "bird migration", "the Mars rovers", "origami", "tea", "volunteering", "rivers",
)
QUESTIONS = ("What is {}?", "Explain {} to a beginner.", "Give three interesting facts about {}.",
             "Write a short paragraph about {}.", "How does {} affect everyday life?", "What are common myths about {}?")


@dataclass(frozen=True)
class Prompt:
    kind: str  # one of KINDS
    text: str  # the prompt as the target reads it (a chat already rendered through the template)


def _docstring_items(source: str):
    """(kind, name, signature+docstring source, first docstring paragraph) of each documented function and class."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node):
            doc = node.body[0]
            head = "\n".join(lines[node.lineno - 1:doc.end_lineno]).rstrip()
            paragraph = ast.get_docstring(node).split("\n\n")[0].replace("\n", " ").strip()
            yield ("def" if isinstance(node, ast.FunctionDef) else "class"), node.name, head, paragraph


@functools.lru_cache(maxsize=None)
def _file_items(text: str) -> tuple:
    """_docstring_items of one file's text, parsed once per process (the corpus is read for every mix drawn)."""
    return tuple(_docstring_items(text))


def as_chat(tokenizer, message: str) -> str:
    """One user turn through the (transformers) tokenizer's chat template, rendered by specrt.chat."""
    from specrt.chat import ChatTemplate

    template = ChatTemplate(tokenizer.chat_template, "tokenizer", dict(tokenizer.special_tokens_map))
    return template.render([{"role": "user", "content": message}])


def user_turn(tokenizer) -> tuple[str, str] | None:
    """(the text before a conversation's first user words, the text after them up to the assistant's turn) through the
    tokenizer's chat template, or None where it has none: the target continues the first to write a request itself,
    and the first token of the second ends it."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    before, _, after = as_chat(tokenizer, MARK).partition(MARK)
    return (before, after) if after else None


def _pools(tokenizer, files, kinds: list[str], validation: bool) -> dict[str, list[str]]:
    """Every prompt of each kind that the files (and the topics of the split) make, in file order."""
    pools: dict[str, list[str]] = {k: [] for k in kinds}
    for f in files:
        if f.rel_path.startswith(("test/", "idlelib/idle_test/")) or "/tests/" in f.rel_path:
            continue
        for what, name, head, paragraph in _file_items(f.text):
            sentence = paragraph.split(". ")[0].rstrip(".")
            if what == "def" and 20 < len(head) < 1200 and not name.startswith("_"):
                pools["code"].append(head + "\n")
                if "chat" in pools and len(sentence) > 20:
                    pools["chat"].append(as_chat(tokenizer, f"Write a Python function `{name}` that does this: "
                                                            f"{sentence}."))
            if len(paragraph) > 160:
                pools["prose"].append(paragraph[: len(paragraph) // 2].rsplit(" ", 1)[0])
    if "chat" in pools:
        for topic in TOPICS:
            if (int(hashlib.sha256(topic.encode()).hexdigest(), 16) % 10 == 0) == validation:
                pools["chat"].extend(as_chat(tokenizer, q.format(topic)) for q in QUESTIONS)
    return pools


def spread(mix: list[Prompt], others: list[Prompt]) -> list[Prompt]:
    """The prompts of `mix` with `others` spread evenly among them, in order: a file's first n prompts (what `specrt
    calibrate --prompts --num-prompts n` reads) hold both in proportion."""
    every = max(1, len(mix) // max(1, len(others)))
    out, rest = [], list(others)
    for i, p in enumerate(mix, start=1):
        out.append(p)
        if rest and i % every == 0:
            out.append(rest.pop(0))
    return out + rest


def mixed_prompts(tokenizer, num: int, split: str = "train", seed: int = 0) -> list[Prompt]:
    """`num` prompts of the split, as even a mix of KINDS as the tokenizer allows (no template: code and prose; a kind
    whose prompts run out leaves its turns to the others), drawn by a seeded generator. A validation prompt is never
    also a training one (the standard library repeats some functions in other files)."""
    rng = np.random.default_rng(seed)
    kinds = [k for k in KINDS if k != "chat" or getattr(tokenizer, "chat_template", None)]
    train, val = load_corpus()
    pools = _pools(tokenizer, train, kinds, validation=False)
    if split == "validation":
        seen = {text for pool in pools.values() for text in pool}
        pools = {k: [t for t in pool if t not in seen] for k, pool in _pools(tokenizer, val, kinds, True).items()}
    available = sum(len(p) for p in pools.values())
    if num > available:
        raise SpecrtError(f"asked for {num} {split} prompts; the mix has {available} "
                          f"({', '.join(f'{k} {len(p)}' for k, p in pools.items())})")
    picked, turn = [], 0
    while len(picked) < num:
        pool = pools[kinds[turn % len(kinds)]]
        turn += 1
        if pool:
            picked.append(Prompt(kinds[(turn - 1) % len(kinds)], pool.pop(int(rng.integers(len(pool))))))
    return picked
