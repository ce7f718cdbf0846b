"""Local Hugging Face checkpoints: read, checked against what the step graph supports, paired.

Nothing is downloaded: every load is `local_files_only`.
"""

from __future__ import annotations

from pathlib import Path

from specrt.contract import EAGLE_HEAD, TOKENIZER_FILES
from specrt.errors import SpecrtError, UnsupportedModelError

DTYPES = ("float32", "float16", "bfloat16")


# checkpoints whose language model is one part of a larger model (an image-text model), exported as that text model
TEXT_MODEL_OF = {"gemma3": "Gemma3ForCausalLM"}


def load_config(path: Path):
    """The checkpoint's config (its text model's, for a TEXT_MODEL_OF checkpoint), refused early if the step graph
    cannot express its architecture."""
    from transformers import AutoConfig

    from specrt.model.step import check_supported

    if not (Path(path) / "config.json").is_file():
        raise SpecrtError(f"{path} is not a Hugging Face checkpoint directory (no config.json)")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise UnsupportedModelError(f"{path}: cannot read config.json ({str(e).splitlines()[0]})") from None
    if config.model_type in TEXT_MODEL_OF:
        config = config.get_text_config()
    check_supported(config)
    return config


def load_checkpoint(path: Path, dtype: str = "float32", device: str = "cpu"):
    """The model in eval mode, weights in `dtype` (float32 or float16), on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise SpecrtError(f"unsupported dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    from transformers.utils import logging

    head = getattr(load_config(path), EAGLE_HEAD, None) is not None  # a feature-level draft head (model/eagle.py)
    level = logging.get_verbosity()
    if head:  # its fc.weight is put back below, not a weight transformers should report as unexpected
        logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=getattr(torch, dtype))
    except (OSError, RuntimeError, ValueError) as e:
        raise SpecrtError(f"cannot load the checkpoint in {path}: {str(e).splitlines()[0]}") from None
    finally:
        logging.set_verbosity(level)
    if head:
        from specrt.model.eagle import attach_fc

        attach_fc(model, path)
    return text_model(model).eval().to(device)


def text_model(model):
    """A TEXT_MODEL_OF model's language model as its own ...ForCausalLM, sharing the weights (the rest, e.g. a
    vision tower, dropped); any other model as it is."""
    import torch
    import transformers

    name = TEXT_MODEL_OF.get(model.config.model_type)
    if name is None:
        return model
    with torch.device("meta"):  # no weights allocated: both parts are replaced by the loaded ones
        text = getattr(transformers, name)(model.config.get_text_config())
    text.model, text.lm_head = model.model.language_model, model.lm_head
    return text


def has_tokenizer(path: Path) -> bool:
    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not has_tokenizer(path):
        raise SpecrtError(f"no tokenizer in {path} (give one with --tokenizer DIR)")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def check_pair(target_config, draft_config, tokenizer, draft_tokenizer=None) -> None:
    """Refuse a pair that cannot share token ids."""
    tv, dv = target_config.vocab_size, draft_config.vocab_size
    if tv != dv:
        raise SpecrtError(f"draft and target vocabularies differ (target vocab_size={tv}, draft vocab_size={dv}); "
                          "speculative decoding needs one tokenizer for both")
    if len(tokenizer) > tv:
        raise SpecrtError(f"tokenizer has {len(tokenizer)} tokens but the target's vocab_size is {tv}")
    if draft_tokenizer is not None and draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise SpecrtError(f"draft and target tokenizers differ: {_id_disagreements(tokenizer, draft_tokenizer)}; "
                          "speculative decoding needs one tokenizer for both")


def _id_disagreements(target, draft, shown: int = 3) -> str:
    """Which ids the two tokenizers disagree on, the first `shown` of them: "id 7 is 'ab' in the target, 'a' in the
    draft", or "no token" where one of them lacks the id."""
    t = {i: w for w, i in target.get_vocab().items()}
    d = {i: w for w, i in draft.get_vocab().items()}
    ids = sorted(i for i in t.keys() | d.keys() if t.get(i) != d.get(i))
    said = [f"id {i} is {_token(t.get(i))} in the target, {_token(d.get(i))} in the draft" for i in ids[:shown]]
    more = f" (and {len(ids) - shown} more ids)" if len(ids) > shown else ""
    return "; ".join(said) + more


def _token(word: str | None) -> str:
    return "no token" if word is None else repr(word)


def sliding_window(config) -> int | None:
    """The attention window of a model that uses one in every layer (Mistral; Qwen2/3 with use_sliding_window), else
    None; one that windows some layers only (its config's layer_types) is refused: the runtime's mask is one for
    all layers.

    The step graph itself attends to whatever the mask allows; the runtime puts the window in the mask
    (KVCache.window), so contexts may be as long as max_position_embeddings."""
    from specrt.model.step import family_of

    if not getattr(config, "use_sliding_window", True) or family_of(config).layer_windows:
        return None  # no window, or the family's own, per layer, in the step graph (Gemma 2)
    kinds = set(getattr(config, "layer_types", None) or ())
    if kinds == {"full_attention"}:
        return None
    if len(kinds) > 1:
        sliding = list(config.layer_types).count("sliding_attention")
        raise UnsupportedModelError(f"model_type={config.model_type!r} windows some layers only ({sliding} of "
                                    f"{len(config.layer_types)} sliding, e.g. max_window_layers): per-layer sliding "
                                    "windows are not supported yet")
    window = getattr(config, "sliding_window", None)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise SpecrtError(f"sliding_window must be a positive integer or null, got {window!r}")
    return window if window and window < config.max_position_embeddings else None
