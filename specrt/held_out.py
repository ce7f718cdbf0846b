"""Text a benchmark poses, which no text a model learns from may contain: the chat prompts of `specrt bench
--prompt-set chat` (bench/prompts.py), and the test of whether a text written elsewhere is too close to one of them.

Here, at the bottom of the layers, so that the makers of training text (checkpoints/) can keep out what the bench
asks without importing the bench.
"""

from __future__ import annotations

import re

# Written here (no chat set ships in a package on the index): everyday requests of the kinds chat models get, none of
# them among the questions a draft is distilled on (checkpoints/prompt_mix.py, checkpoints/teacher.py's self-asked).
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
CLOSE = 0.6  # word-set overlap (Jaccard) at which a text counts as a benchmark prompt reworded


def words(text: str) -> frozenset[str]:
    """The set of lower-cased words of a text."""
    return frozenset(re.findall(r"[a-z0-9']+", text.lower()))


def near_benchmark(text: str) -> bool:
    """Whether `text` shares at least CLOSE of its and a benchmark chat prompt's words (Jaccard): that prompt, or it
    reworded, which a model may not learn the answer to."""
    mine = words(text)
    return any(len(mine & w) >= CLOSE * len(mine | w) for w in map(words, CHAT) if mine | w)
