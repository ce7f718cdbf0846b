"""`specrt profile`: every point timed in each pass, in a new order each pass; draft steps after a target step;
host work the median over passes; what is saved is what was measured."""

import shutil
import time

import numpy as np
import pytest

from specrt.bundle import artifacts
from specrt.bundle.artifacts import LatencyProfile
from specrt.calibration import latency
from specrt.calibration.latency import ProfileConfig, prefill_times, profile, step_times
from specrt.runtime.kv_cache import KVCache
from specrt.runtime.speculation import SPECULATION


class Recorder:
    """A runner that records its steps (and the context its cache was filled to) in a shared log."""

    def __init__(self, name, log):
        self.name, self.log = name, log
        self.entry = type("Entry", (), {"vocab_size": 10, "role": name})()

    def new_cache(self, batch, bucket=16):
        return KVCache(lambda shape: np.zeros(shape, np.float32), 1, batch, 1, 1, 64, bucket=bucket)

    busy_seconds = 0.0

    def step(self, ids, pos, mask, cache, head="logits", pick=None):
        self.log.append((self.name, ids.shape[1], int(cache.lengths[0]), head))
        self.busy_seconds += 0.001 * ids.shape[1]  # what the runner counts as its own time
        return None, np.zeros((1, 2, *ids.shape[:1], 1, ids.shape[1], 1), np.float32)  # logits, K/V [L, 2, B, H, T, D]

    def wait(self):  # a GPU's runner: the device still running the step
        self.log.append((self.name, "wait"))
        time.sleep(0.01)


def test_step_times_time_each_step_after_one_of_the_other_model():
    log = []
    draft, target = Recorder("draft", log), Recorder("target", log)
    times = step_times(draft, 1, 3, 5, repeats=2, warmup=1, before=target)
    assert times == pytest.approx([0.003, 0.003])  # the runner's own time of each timed step
    # warm-up included: the other model before every step, as greedy decoding steps it (its argmax to the host)
    assert log == [("target", 1, 5, "argmax"), ("draft", 3, 5, "logits")] * 3
    log.clear()
    step_times(target, 1, 4, 5, repeats=2, warmup=0, head="argmax")
    assert log == [("target", 4, 5, "argmax")] * 2


def test_profile_visits_every_point_once_a_pass_in_a_new_order_and_keeps_the_median(demo_bundle, tmp_path,
                                                                                    monkeypatch):
    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    visits, host_calls = [], []

    def fake_step_times(runner, batch, n, context, repeats, warmup, before=None, bucket=None, head=None):
        role = runner.entry.role
        assert bucket == 128  # the pipeline's: what its caches grow by
        assert head == ("argmax" if role == "target" else "logits")  # the target's step as greedy verification's
        visits.append((role, batch, context, n, before is not None))
        return [0.001 * n * (1 + len([v for v in visits if v[:4] == (role, batch, context, n)]))]  # 2, 3, 4 ms x n

    def fake_host_round_ms(pipe, kind, batch, nodes):
        host_calls.append((kind, batch, nodes))
        return float(len([c for c in host_calls if c == (kind, batch, nodes)]))  # 1 (untimed), 2, 3, 4

    def fake_prefill_times(runner, batch, n, repeats, warmup, bucket=None):
        prefills.append((runner.entry.role, batch, n, repeats))
        return [0.002 * batch * n] * repeats  # 2 ms per prompt token

    prefills = []
    monkeypatch.setattr(latency, "step_times", fake_step_times)
    monkeypatch.setattr(latency, "host_round_ms", fake_host_round_ms)
    monkeypatch.setattr(latency, "prefill_times", fake_prefill_times)
    bandwidths = iter([40e9, 30e9])  # the machine's memory slower at the end: said, and the end's kept
    monkeypatch.setattr(latency, "copy_bandwidth", lambda *a: next(bandwidths))
    cfg = ProfileConfig(bundle=b, threads=2, batch_sizes=(1, 2), contexts=(32,), num_tokens=(1, 2, 4), passes=3,
                        prefill_tokens=(16, 64, 300), max_prefill_tokens=64)
    with pytest.warns(RuntimeWarning, match="moved from 40.0 to 30.0 GB/s during the profile"):
        out = profile(cfg, progress=False)[None]
    assert out.copy_bandwidth == 30e9

    points = {(r, bs, 32, n) for r in ("target", "draft") for bs in (1, 2) for n in (1, 2, 4)}
    passes = [visits[i * len(points):(i + 1) * len(points)] for i in range(3)]
    assert len(visits) == 3 * len(points) and all({v[:4] for v in p} == points for p in passes)
    assert len({tuple(p) for p in passes}) == 3  # a new order each pass
    assert all(v[4] == (v[0] == "draft") for v in visits)  # the target's step precedes each draft step only
    # the median of the passes' 2, 3 and 4 ms per token
    assert out.models["target"][2][32] == {1: 3.0, 2: 6.0, 4: 12.0}
    assert out.models["draft"][1][32][4] == 12.0
    # host work: one untimed decode of each configuration, then one per pass; the median of 2, 3, 4
    configs = set(host_calls)
    assert len(host_calls) == 4 * len(configs) and out.host_ms["tree"][0] == 3.0 and out.host_batch["dynamic"][2][8] == 3.0
    assert set(host_calls[:len(configs)]) == configs
    assert set(out.host_ms) == {"tree", "dynamic", "merged", "ngram"}  # ANPD's own, not a draft tree's
    assert sorted(out.host_ms["ngram"]) == list(SPECULATION["ngram"].host_profile.sizes) and sorted(out.host_batch["ngram"][2]) == [3, 10]
    assert out.cache_bucket == 128  # what at_context prices a context by
    # prefill steps in the same passes: none above batch * tokens 64, none wider than the pipeline's chunk (256)
    assert sorted(prefills) == sorted([(r, bs, n, 1) for r in ("target", "draft") for bs, n in ((1, 16), (1, 64), (2, 16))] * 3)
    assert out.prefill["target"] == {1: {16: 32.0, 64: 128.0}, 2: {16: 64.0}} and out.prefill_chunk == 256
    assert out.prefill_step_ms("target", 2, [16, 8]) == pytest.approx(2.0 * 24)  # packed: 2 ms per real token
    assert artifacts.load(b, LatencyProfile) == out


def test_prefill_times_time_one_step_into_an_empty_cache_each():
    log = []
    target = Recorder("target", log)
    times = prefill_times(target, 3, 5, repeats=2, warmup=1)
    # 5 prompt tokens each, nothing cached before, no logits to the host (as prefill), timed until the device is
    # done (an H200 profiled a 6B target's 128-token prefill at 0.4 ms, a twentieth of its one-token step, without)
    assert log == [("target", 5, 0, "discard"), ("target", "wait")] * 3
    assert len(times) == 2 and min(times) >= 0.01


@pytest.mark.parametrize("passes", [0, -1])
def test_profile_refuses_no_passes(passes, tmp_path):
    from specrt.errors import InvalidRequestError

    with pytest.raises((InvalidRequestError, ValueError), match="passes"):
        ProfileConfig(bundle=tmp_path, passes=passes)


def test_ppd_host_work_is_profiled_where_the_bundle_has_prompt_tokens_and_costs_its_rounds(ppd_bundle, tmp_path,
                                                                                          monkeypatch):
    from specrt.bundle.artifacts import PromptTokens
    from specrt.runtime.cost import ppd_round_cost_ms

    b = tmp_path / "b"
    shutil.copytree(ppd_bundle, b)
    calls = []

    def fake_host_round_ms(pipe, kind, batch, nodes):
        calls.append((kind, batch, nodes))
        return 0.01 * nodes if kind == "ppd" else 1.0 + nodes  # PPD's own work, far below a draft tree's

    monkeypatch.setattr(latency, "step_times", lambda runner, batch, n, *a, **k: [0.001 * n])
    monkeypatch.setattr(latency, "host_round_ms", fake_host_round_ms)
    out = profile(ProfileConfig(bundle=b, threads=2, batch_sizes=(1, 2), contexts=(32,), num_tokens=(1, 4, 8, 16, 32),
                                passes=1), progress=False)[None]
    budgets = {t.budget for t in artifacts.load(b, PromptTokens).trees}  # (2, 4, 8, 16): those of its host profile
    assert sorted(out.host_ms["ppd"]) == sorted(budgets & set(SPECULATION["ppd"].host_profile.sizes)) == [2, 8]
    assert sorted(out.host_batch["ppd"][2]) == [4, 16]
    tree = artifacts.load(b, PromptTokens).tree(8)
    assert ppd_round_cost_ms(out, 1, tree)[1] == pytest.approx(0.08)  # its own kind, at its budget
    # profiled where the bundle had no prompt tokens: a draft tree's of as many rows
    without = LatencyProfile(**{**out.__dict__, "host_ms": {k: v for k, v in out.host_ms.items() if k != "ppd"},
                                "host_batch": {k: v for k, v in out.host_batch.items() if k != "ppd"}})
    assert ppd_round_cost_ms(without, 1, tree)[1] == pytest.approx(out.host(tree.expected_rows))
