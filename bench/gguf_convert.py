"""llama.cpp's own converter (convert_hf_to_gguf.py, as vendored by the llama-cpp-python sdist), run on a checkpoint
whose tokenizer it does not know by hash.

The converter names a BPE tokenizer's pre-tokenizer by hashing what the tokenizer makes of a fixed text, and refuses
one it has no hash for ("BPE pre-tokenizer was not recognized"): a tokenizer trained here, as the demo pair's, has
none. Where tokenizer.json says it is exactly GPT-2's byte-level BPE (a ByteLevel pre-tokenizer with its regex, no
normalizer, no byte fallback, a ByteLevel decoder), that is llama.cpp's `gpt-2` pre-tokenizer, and it is named so;
anything else stays refused.

    python -m specrt.bench.gguf_convert LLAMA_CPP_DIR CHECKPOINT OUTFILE OUTTYPE
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def gpt2_byte_level(tokenizer_json: Path) -> bool:
    """Whether a tokenizer.json is GPT-2-style byte-level BPE, as llama.cpp's `gpt-2` pre-tokenizer splits text."""
    try:
        t = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    pre, model, decoder = t.get("pre_tokenizer") or {}, t.get("model") or {}, t.get("decoder") or {}
    return (t.get("normalizer") is None and model.get("type") == "BPE" and not model.get("byte_fallback")
            and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space")
            and decoder.get("type") == "ByteLevel")


def main(argv: list[str]) -> None:
    llama_cpp, checkpoint, outfile, outtype = argv
    sys.path[:0] = [llama_cpp, str(Path(llama_cpp) / "gguf-py")]
    from conversion import base

    recognised = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return recognised(self, tokenizer)
        except NotImplementedError:
            if gpt2_byte_level(Path(self.dir_model) / "tokenizer.json"):
                return "gpt-2"
            raise

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    import convert_hf_to_gguf

    sys.argv = ["convert_hf_to_gguf.py", checkpoint, "--outfile", outfile, "--outtype", outtype]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main(sys.argv[1:])
