"""The demo model pair: training (train.py), corpus (corpus.py), inflation (inflate.py).

The committed pair lives in DEMO_DIR: tokenizer/, target/, draft/ and training.json.
"""

from pathlib import Path

DEMO_DIR = Path(__file__).parent / "demo"
