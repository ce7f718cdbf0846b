"""The n-gram drafters' prior (`specrt ngram prior`): its table, how a sequence's memory falls back on it, the
artifact, and anpd / dynamic-ngram with it token-identical to autoregressive greedy."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from specrt.runtime.drafters.ngram import NgramMemory, NgramTable


def test_the_table_keeps_each_contexts_most_frequent_next_token_ties_to_the_smaller_id():
    table = NgramTable(3, [[1, 2, 3, 1, 2, 3, 1, 2, 4], [5, 9, 5, 7]])
    assert table.next_token((2,)) == 3  # 3 twice, 4 once
    assert table.next_token((1, 2)) == 3
    assert table.next_token((5,)) == 7  # 9 and 7 once each: the smaller id
    assert table.next_token((9, 9)) is None and table.next_token((8,)) is None
    # leave-one-out after 1 token: contexts seen twice or more are 1 (x3: 2,2,2), 2 (x3: 3,3,4), 3 (x2: 1,1), 5 (x2)
    # -> best counts 3, 2, 2, 1 less one each over 3 + 3 + 2 + 2 tries
    assert table.hits[0] == pytest.approx((2 + 1 + 1 + 0) / 10)


def test_a_memory_takes_the_longest_context_either_knows_its_own_first_at_equal_length():
    prior = NgramTable(4, [[10, 11, 12, 13], [20, 21, 22]])
    mem = NgramMemory(4, prior)
    mem.update([11, 12, 99, 7, 11])
    assert mem.query([5, 11, 12]) == 99  # own and prior know (11, 12): own wins
    assert mem.query([10, 11, 12]) == 13  # the prior knows the longer (10, 11, 12)
    assert mem.query([20, 21]) == 22  # the text never showed 21
    assert mem.query([30]) is None
    assert mem.continuations([20, 21], 3) == [(22, prior.hits[1])]  # one continuation, at the prior's hit rate
    assert mem.draft([20], 3) == [21, 22]
    assert NgramMemory(4).query([20, 21]) is None and NgramMemory(5, prior).query([20, 21]) is None  # a lower order


def test_drafts_of_the_prior_alone_stop_where_their_path_estimate_falls_below_the_floor():
    table = NgramTable(3, [[1, 2, 1, 3, 1, 4, 1, 5]])  # after 1: four tokens once each, so a leave-one-out rate of 0
    assert table.hits[0] == 0.0
    assert NgramMemory(3, table, prior_min_prob=0.2).draft([7, 1], 3) == []
    assert NgramMemory(3, table).draft([7, 1], 3) == [2, 1, 3]
    tokens, _, _ = NgramMemory(3, table, prior_min_prob=0.2).draft_tree([7, 1], 3, branches=2)
    assert tokens == []
    own = NgramMemory(3, table, prior_min_prob=0.2)
    own.update([1, 9])  # the text's own n-grams draft whatever their estimate
    assert own.draft([7, 1], 1) == [9]


def _with_prior(demo_bundle, tmp_path):
    from specrt.calibration.ngram_prior import NgramPriorConfig, build_prior

    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    prior = build_prior(NgramPriorConfig(bundle=b, prompts=6, new_tokens=24, source_windows=4, window=64, gen_batch=6,
                                         cache=tmp_path / "cache", threads=2), progress=False)
    return b, prior


def test_anpd_and_merged_ngram_drafts_with_the_prior_are_token_identical_to_autoregressive(demo_bundle, humaneval,
                                                                                           tmp_path):
    from specrt.runtime.pipeline import Pipeline

    b, prior = _with_prior(demo_bundle, tmp_path)
    assert prior.num_sequences == 10 and prior.num_tokens > 6 * 24
    pipe = Pipeline.load(b, threads=2)
    table = pipe.evidence.ngram_table(5)
    assert table is not None and len(table.tables[0]) > 10
    prompts = humaneval[:3]
    want = [o.token_ids for o in pipe.generate(prompts, method="autoregressive", max_new_tokens=40)]
    for method, options in (("anpd", {}), ("anpd", {"ngram_prior": False}), ("anpd", {"ngram_branches": 2}),
                            ("dynamic", {"ngram_tokens": 8})):
        got = pipe.generate(prompts, method=method, max_new_tokens=40, **options)
        assert [o.token_ids for o in got] == want, (method, options)
    on = pipe.generate(prompts, method="anpd", max_new_tokens=40)
    off = pipe.generate(prompts, method="anpd", max_new_tokens=40, ngram_prior=False)
    assert sum(o.stats.target_calls for o in on) < sum(o.stats.target_calls for o in off)  # it drafts what it knows


def test_a_changed_prior_is_refused_and_a_bundle_without_one_drafts_from_the_text(demo_bundle, tmp_path):
    from specrt.bundle import artifacts
    from specrt.bundle.artifacts import NgramPrior
    from specrt.errors import BundleError
    from specrt.runtime.pipeline import Pipeline

    assert Pipeline.load(demo_bundle, threads=2).evidence.ngram_table(5) is None
    b, prior = _with_prior(demo_bundle, tmp_path)
    assert dict(artifacts.status(b))[NgramPrior.FILE] == "ok"
    with np.load(b / prior.data) as z:
        ids, offsets = z["ids"], z["offsets"]
    np.savez(b / prior.data, ids=ids[::-1].copy(), offsets=offsets)
    with pytest.raises(BundleError, match="specrt ngram prior --bundle"):
        Pipeline.load(b, threads=2).evidence.ngram_table(5)
    record = json.loads((b / NgramPrior.FILE).read_text())
    assert record["source"]["sequences"] == {"code": 3, "prose": 3, "source": 4}


def test_a_prior_is_made_from_another_bundles_sequences_and_a_bad_corpus_is_refused(demo_bundle, tmp_path):
    from specrt.calibration.ngram_prior import NgramPriorConfig, build_prior
    from specrt.errors import SpecrtError

    b, prior = _with_prior(demo_bundle, tmp_path)
    other = tmp_path / "other"
    shutil.copytree(demo_bundle, other)
    again = build_prior(NgramPriorConfig(bundle=other, corpus=b / prior.data), progress=False)
    assert (again.num_tokens, again.num_sequences, again.data_sha256) == (prior.num_tokens, prior.num_sequences,
                                                                          prior.data_sha256)
    assert again.source["corpus"] == prior.data
    np.savez(tmp_path / "bad.npz", ids=np.arange(10), offsets=np.array([0, 4, 3, 10]))
    with pytest.raises(SpecrtError, match="do not split"):
        build_prior(NgramPriorConfig(bundle=other, corpus=tmp_path / "bad.npz"), progress=False)
    np.savez(tmp_path / "big.npz", ids=np.array([10 ** 6]), offsets=np.array([0, 1]))
    with pytest.raises(SpecrtError, match="beyond the bundle's vocabulary"):
        build_prior(NgramPriorConfig(bundle=other, corpus=tmp_path / "big.npz"), progress=False)
