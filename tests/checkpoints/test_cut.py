"""specrt models cut: a draft of its target's first layers computes what the target's residual stream holds after
them, through the target's own final norm and head."""

import pytest

from tests.export.test_architectures import _tiny


@pytest.mark.parametrize("kind", ["llama3", "gemma3"])
def test_a_cut_draft_is_the_targets_first_layers_under_its_head(tmp_path, kind):
    import torch
    from transformers import AutoModelForCausalLM

    from specrt.checkpoints.cut import CutConfig, cut

    _tiny(kind, tmp_path / "t", num_hidden_layers=3,
          **({"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]} if kind == "gemma3" else {}))
    dest = cut(CutConfig(target=tmp_path / "t", layers=2, out=tmp_path / "d"))
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "t").eval()
    draft = AutoModelForCausalLM.from_pretrained(dest).eval()
    assert draft.config.num_hidden_layers == 2 and len(draft.model.layers) == 2
    if kind == "gemma3":
        assert draft.config.layer_types == ["sliding_attention", "full_attention"]
    ids = torch.arange(1, 12)[None]
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[2]  # the residual stream after 2 layers
        want = target.lm_head(target.model.norm(hidden))  # (neither tiny config soft-caps its logits)
        got = draft(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (dest / "cut.json").is_file()


def test_a_cut_as_deep_as_its_target_is_refused(tmp_path):
    from specrt.checkpoints.cut import CutConfig, cut
    from specrt.errors import SpecrtError

    _tiny("llama3", tmp_path / "t")
    with pytest.raises(SpecrtError, match="the target has 2 layers: a draft of 2 would be no smaller"):
        cut(CutConfig(target=tmp_path / "t", layers=2, out=tmp_path / "d"))
    assert not (tmp_path / "d").exists()
