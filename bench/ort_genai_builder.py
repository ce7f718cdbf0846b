"""ONNX Runtime GenAI's model builder (`python -m onnxruntime_genai.models.builder`) as the peers' conversion runs it:
`python -m specrt.bench.ort_genai_builder ARGS` takes the builder's own arguments.

One difference, for the checkpoints transformers 5 writes: a Gemma 3 config's RoPE is per layer type there
(`rope_parameters` = {"full_attention": {...}, "sliding_attention": {...}}), while onnxruntime-genai 0.18's Gemma 3
builder reads the flat form of transformers 4 (`rope_parameters["rope_type"]`, `rope_local_base_freq`) and fails
with KeyError 'rope_type' (its Gemma 4 builder reads the nested form). Before the builder's Gemma 3 model reads the
config, the nested form is given to it flat: the global layers' parameters as the model's, the local layers' base as
`rope_local_base_freq`, which is what transformers 4 wrote for the same checkpoint. Every other model goes through
the builder untouched.
"""

from __future__ import annotations

import runpy
import sys


def _flatten_gemma3_rope(gemma3) -> None:
    init = gemma3.__init__

    def __init__(self, config, *args, **kwargs):
        rope = getattr(config, "rope_parameters", None)
        if type(self) is gemma3 and isinstance(rope, dict) and "sliding_attention" in rope:
            config.rope_local_base_freq = rope["sliding_attention"]["rope_theta"]
            config.rope_parameters = dict(rope["full_attention"])
            config.rope_theta = rope["full_attention"]["rope_theta"]
        init(self, config, *args, **kwargs)

    gemma3.__init__ = __init__


def main(argv: list[str]) -> None:
    # the builder imports its model classes as the top-level package `builders` (its own directory on sys.path):
    # importing it once puts them where its run below finds them
    import onnxruntime_genai.models.builder as builder

    _flatten_gemma3_rope(builder.Gemma3Model)
    sys.argv = ["builder", *argv]
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
