"""A Pipeline called from several threads at once gives each call what it gives that call alone."""

from concurrent.futures import ThreadPoolExecutor

import pytest


def jobs(prompts, new_tokens):
    """(kind, prompts, options): generate and stream, several methods and batch sizes."""
    return [
        ("generate", prompts[0:3], dict(method="sd", num_draft_tokens=4, batch_size=3)),
        ("stream", prompts[3], dict(method="sd")),
        ("generate", prompts[4:6], dict(method="autoregressive")),
        ("generate", prompts[6:8], dict(method="dynamic", num_draft_tokens=6, batch_size=2)),
        ("stream", prompts[8], dict(method="anpd")),
        ("generate", prompts[9:12], dict(method="tree", batch_size=2)),
        ("generate", prompts[12:14], dict(method="sd", temperature=0.8, top_p=0.9, seed=7)),
        ("generate", prompts[14:16], dict(method="mtad", temperature=1.0, seed=3)),
    ], new_tokens


def run(pipe, job, new_tokens):
    kind, prompts, options = job
    if kind == "stream":
        return "".join(pipe.stream(prompts, max_new_tokens=new_tokens, **options))
    return [o.token_ids for o in pipe.generate(prompts, max_new_tokens=new_tokens, **options)]


def check_concurrent(pipe, prompts, new_tokens, threads=4, repeats=2):
    work, n = jobs(prompts, new_tokens)
    alone = [run(pipe, job, n) for job in work]
    with ThreadPoolExecutor(threads) as ex:
        together = list(ex.map(lambda job: run(pipe, job, n), work * repeats))
    for i, (got, want) in enumerate(zip(together, alone * repeats)):
        assert got == want, f"job {i % len(work)} ({work[i % len(work)][2]}) differs when run with others"


@pytest.mark.parametrize("backend,new_tokens", [("ort", 32), ("torch", 12)])
def test_concurrent_generate_and_stream_match_single_threaded_runs(pipelines, humaneval, backend, new_tokens):
    check_concurrent(pipelines[backend], humaneval, new_tokens)


def test_concurrent_calls_on_fake_models(tmp_path):
    import numpy as np

    from tests.fakes import PathBackend, fake_pipeline, noisy_copy, path_table

    table = path_table(12, seed=2)
    pipe = fake_pipeline(tmp_path, PathBackend(table), PathBackend(noisy_copy(table, 1.0, 3), "draft"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 12, size=int(rng.integers(3, 30))).tolist() for _ in range(16)]
    check_concurrent(pipe, prompts, 24, threads=6, repeats=3)
