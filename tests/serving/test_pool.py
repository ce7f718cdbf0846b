"""ServerPool: one continuously batched loop per (method, sampling parameters) that requests use."""

import pytest

from specrt.runtime.options import DecodeRequest as R
from tests.fakes import PathBackend, fake_pipeline, noisy_copy, path_table
from tests.runtime.test_server import VOCAB, prompts


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    table = path_table(VOCAB, seed=0)
    return fake_pipeline(tmp_path_factory.mktemp("fake"), PathBackend(table), PathBackend(noisy_copy(table, 1.0, 1), "draft"))


def test_requests_of_one_kind_share_a_server_and_each_kind_gets_its_tokens(fake):
    from specrt.serving.pool import ServerPool

    pool = ServerPool(fake, max_batch=4, default_method="sd")
    ps = prompts(6, seed=7)
    ar = [fake.generate([p], method="autoregressive", max_new_tokens=10)[0].token_ids for p in ps]
    sampled = [fake.generate([p], method="sd", max_new_tokens=10, temperature=0.7, seed=3)[0].token_ids for p in ps]
    try:
        greedy = [pool.submit(R.of(p, 10)) for p in ps] + [pool.submit(R.of(p, 10, method="anpd")) for p in ps]
        assert [r.result(30).token_ids for r in greedy] == ar + ar
        assert [pool.submit(R.of(p, 10, temperature=0.7, seed=3)).result(30).token_ids for p in ps] == sampled
        stats = pool.stats()
        assert set(stats) == {"sd", "anpd"}
        assert stats["sd"].finished == 12 and stats["anpd"].finished == 6  # the idle servers given back: still counted
        assert stats["sd"].generated_tokens == 120 and max(stats["sd"].rounds_by_batch) == 4
        assert len(pool._servers) <= 2  # each new kind gave back the idle ones
    finally:
        pool.close()


@pytest.mark.parametrize("kwargs,inputs,match", [
    (dict(method="beam"), ("method",), "unknown method 'beam'"),
    (dict(temperature=-1.0), ("temperature",), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), ("top_p",), "top_p must be"),
    (dict(max_new_tokens=0), ("max_new_tokens",), "max_new_tokens must be an integer >= 1, got 0"),
    (dict(seed=-2), ("seed",), "seed must be an integer >= 0"),
    (dict(prompt=[]), ("prompt",), "empty prompt"),
    (dict(max_new_tokens=10**6), ("prompt", "max_new_tokens"), "more than the context of"),
    (dict(method="ppd"), ("method",), "has no PPD prompt tokens"),
])
def test_a_refusal_names_the_inputs_it_is_about(fake, kwargs, inputs, match):
    """The request's own checks as it is made, then the pool's and the bundle's as it is submitted: each error names
    its fields as data (SpecrtError.fields)."""
    from specrt.errors import InvalidRequestError
    from specrt.serving.pool import ServerPool

    pool = ServerPool(fake)
    try:
        with pytest.raises(InvalidRequestError, match=match) as e:
            pool.submit(R.of(**{"prompt": [1, 2, 3], **kwargs}))
        assert e.value.fields == inputs
    finally:
        pool.close()


def test_at_most_max_servers_kinds_decode_at_once(fake):
    from specrt.serving.pool import Refused, ServerPool

    pool = ServerPool(fake, max_batch=1, max_servers=1)
    try:
        busy = [pool.submit(R.of([1, 2, 3], max_new_tokens=480)) for _ in range(4)]  # one after another: ~0.5 s here
        with pytest.raises(Refused, match="1 kinds of request are decoding") as e:
            pool.submit(R.of([1, 2, 3], 5, method="anpd"))
        assert e.value.fields == ("method",)
        for r in busy:
            r.cancel()
            r.result(30)
        assert pool.submit(R.of([1, 2, 3], 5, method="anpd")).result(30).finish_reason == "length"
    finally:
        pool.close(cancel=True)
