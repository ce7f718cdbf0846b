"""PPD's prompt tokens in the step graphs: the graph pass (ordinary ids keep their logits, a table whose data file
has several hard links), the step's lookup, and the in-graph KV update's twin."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from specrt.bundle.artifacts import PromptTokens
from specrt.engines.ppd import PpdConfig, train_prompt_tokens
from specrt.errors import BundleError, SpecrtError



def test_a_prompt_token_graph_that_changes_ordinary_logits_is_refused(demo_bundle, tmp_path, monkeypatch):
    import onnx
    from onnx import numpy_helper

    from specrt.graphs import passes

    real = passes.add_prompt_embeddings

    def wrong(src, dest, prompts):  # a pass that also disturbs the ordinary rows of the table
        real(src, dest, prompts)
        model = onnx.load(str(dest))
        for i, init in enumerate(model.graph.initializer):
            if init.name == "ppd.embed_tokens_with_prompts":
                model.graph.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 2, init.name))
        onnx.save_model(model, str(dest))

    monkeypatch.setattr(passes, "add_prompt_embeddings", wrong)
    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    with pytest.raises(SpecrtError, match="gives other logits for ordinary ids"):
        train_prompt_tokens(PpdConfig(bundle=b, steps=1, val_windows=2, budgets=(4,)), progress=False)
    assert not (b / "target-ppd.onnx").exists() and not (b / PromptTokens.FILE).exists()


def test_the_step_looks_prompt_tokens_up_without_copying_the_embedding_table():
    """Ids >= V are prompt tokens: their rows, and the ordinary rows of every other id, as one table [V + P, hidden]
    would give them; but no step copies the vocabulary's embeddings into such a table (on a 7B-class target in
    float16 that would be ~0.25 GB moved each step)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from specrt.checkpoints import DEMO_DIR
    from specrt.model.checkpoint import load_checkpoint
    from specrt.model.step import StepModule

    hf = load_checkpoint(DEMO_DIR / "target", "float32", "cpu")
    table = hf.model.embed_tokens.weight.detach().clone()
    vocab, hidden = table.shape
    prompts = torch.randn(3, hidden)
    module = StepModule(hf, prompts).eval()
    ids = torch.tensor([[5, vocab, 7, vocab + 2], [vocab + 1, 0, vocab - 1, 9]])

    class Sizes(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Sizes.largest = max(Sizes.largest, t.numel())
            return out

    with torch.no_grad(), Sizes():
        got = module.embed(ids)
    assert torch.equal(got, torch.cat([table, prompts])[ids])
    assert Sizes.largest < table.numel()  # fails when the step concatenates the tables: checked


def test_ppd_runs_on_the_in_graph_kv_update_too_and_says_when_it_is_newer(inplace_bundle, ppd_bundle, humaneval,
                                                                           tmp_path):
    """Prompt tokens trained on a bundle with `specrt inplace`'s graphs get an in-graph twin of the target graph:
    ppd then runs with kv_update="inplace", token-identical to AR; in-graph graphs made after them are refused, saying
    what to re-run."""
    from specrt.export.inplace import InPlaceConfig, in_place
    from specrt.runtime.pipeline import Pipeline

    b = tmp_path / "b"
    shutil.copytree(inplace_bundle, b)
    t = train_prompt_tokens(PpdConfig(bundle=b, prompts_from=ppd_bundle, val_windows=4, budgets=(4, 8)),
                            progress=False)
    assert t.inplace_graph == "inplace/target-ppd.onnx" and (b / t.inplace_graph).is_file()
    pipe = Pipeline.load(b, kv_update="inplace", threads=2)
    ar = pipe.generate(humaneval[:3], method="autoregressive", max_new_tokens=32)
    for batch_size in (1, 3):
        got = pipe.generate(humaneval[:3], method="ppd", max_new_tokens=32, batch_size=batch_size)
        assert [o.token_ids for o in got] == [o.token_ids for o in ar], batch_size
    assert sum(o.stats.rounds for o in got) < 3 * 32  # guesses were accepted
    late = tmp_path / "late"  # prompt tokens trained first, then `specrt inplace`: they have no in-graph twin
    shutil.copytree(ppd_bundle, late)
    in_place(InPlaceConfig(bundle=late), progress=False)
    with pytest.raises(BundleError, match="newer than its PPD prompt tokens"):
        Pipeline.load(late, kv_update="inplace", threads=2).generate(humaneval[0], method="ppd", max_new_tokens=4)


def test_prompt_rows_join_a_table_whose_data_file_has_several_hard_links(tmp_path):
    """onnx's own external-data reader refuses a data file with several hard links (a bundle copied with `cp -al`);
    the graph pass reads the table itself, and the new graph shares the data file."""
    import os

    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from specrt.graphs.passes import add_prompt_embeddings

    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    graph = helper.make_graph([helper.make_node("Gather", ["table", "input_ids"], ["logits"])], "g",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [None])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, 4])],
                              [numpy_helper.from_array(table, "table")])
    src = tmp_path / "target.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src),
                    save_as_external_data=True, location="target.onnx.data", size_threshold=0)
    os.link(tmp_path / "target.onnx.data", tmp_path / "linked.data")
    extra = np.full((2, 4), -1.0, dtype=np.float32)
    add_prompt_embeddings(src, tmp_path / "target-ppd.onnx", extra)
    session = ort.InferenceSession(str(tmp_path / "target-ppd.onnx"), providers=["CPUExecutionProvider"])
    out = session.run(["logits"], {"input_ids": np.array([3, 10, 11])})[0]
    assert (out == np.concatenate([table[3:4], extra])).all()
