"""Drafters: each proposes one token tree per sequence per round (see base.py for the protocol).

    DraftModelDrafter   the draft model fills a static TreeSpec (chain or tree)      draft_model.py
    BeamDrafter         the draft model's beam search / beam sampling (MTAD)           beam.py
    EagleDrafter        a draft head on the target's hidden states fills it (EAGLE)   eagle.py
    DynamicTreeDrafter  the likeliest nodes of the draft's beam search (EAGLE-2)       dynamic.py
    NgramDrafter        multi-level n-gram memory of the prompt and output (ANPD)      ngram.py
    MergedDrafter       several drafters' trees merged by token path (SpecInfer)       merge.py
    PromptTokenDrafter  the target's own prompt-token guesses (PPD)                    ppd.py
"""

from specrt.runtime.drafters.base import Drafter, ModelDrafter
from specrt.runtime.drafters.beam import BeamDrafter
from specrt.runtime.drafters.draft_model import DraftModelDrafter
from specrt.runtime.drafters.dynamic import DynamicTreeDrafter
from specrt.runtime.drafters.eagle import EagleDrafter
from specrt.runtime.drafters.merge import MergedDrafter
from specrt.runtime.drafters.ngram import NgramDrafter
from specrt.runtime.drafters.ppd import PromptTokenDrafter

__all__ = ["BeamDrafter", "DraftModelDrafter", "Drafter", "DynamicTreeDrafter", "EagleDrafter", "MergedDrafter",
           "ModelDrafter", "NgramDrafter", "PromptTokenDrafter"]
