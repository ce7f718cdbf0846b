"""Pipeline.server: requests submitted over time, one continuously batched loop on its own thread."""

import asyncio
import threading

import numpy as np
import pytest

from specrt.errors import InvalidRequestError
from tests.fakes import PathBackend, fake_pipeline, noisy_copy, path_table

VOCAB = 12


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    table = path_table(VOCAB, seed=0)
    return fake_pipeline(tmp_path_factory.mktemp("fake"), PathBackend(table), PathBackend(noisy_copy(table, 1.0, 1), "draft"))


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=int(rng.integers(3, 30))).tolist() for _ in range(n)]


def alone(pipe, ps, caps, **kw):
    return [pipe.generate([p], max_new_tokens=c, **kw)[0] for p, c in zip(ps, caps)]


def spy_steps(server):
    """Batch sizes of the server's target steps."""
    sizes, runner = [], server._scheduler.target
    real = runner.step
    runner.step = lambda ids, *a, **k: (sizes.append(ids.shape[0]), real(ids, *a, **k))[1]
    return sizes


@pytest.mark.parametrize("kw", [dict(method="sd", num_draft_tokens=3), dict(method="dynamic", num_draft_tokens=6),
                                dict(method="anpd"), dict(method="autoregressive")], ids=lambda kw: kw["method"])
def test_each_request_gets_its_tokens_and_stats_as_alone(fake, kw):
    ps, caps = prompts(9, seed=1), [5 + 4 * i for i in range(9)]
    ar = alone(fake, ps, caps, method="autoregressive")
    ref = alone(fake, ps, caps, **kw)
    with fake.server(max_batch=3, **kw) as server:
        sizes = spy_steps(server)
        requests = [server.submit(p, max_new_tokens=c) for p, c in zip(ps, caps)]
        outs = [r.result(timeout=30) for r in requests]
    assert [r.index for r in requests] == list(range(9))
    assert [o.token_ids for o in outs] == [a.token_ids for a in ar]
    assert [o.stats.rounds for o in outs] == [r.stats.rounds for r in ref]  # per request, as when alone
    assert [o.finish_reason for o in outs] == ["length"] * 9
    assert max(sizes) == 3 and all(o.stats.seconds.finished > 0 for o in outs)


def test_requests_that_arrive_while_the_batch_runs_join_it(fake):
    ps = prompts(6, seed=2)
    ar = alone(fake, ps, [40] * 6, method="autoregressive")
    with fake.server(method="sd", max_batch=4) as server:
        sizes = spy_steps(server)
        first = server.submit(ps[0], max_new_tokens=40)
        got = []
        for i, piece in enumerate(first.stream(timeout=30)):  # submit the others while the first decodes
            got.append(piece)
            if i == 1:
                later = [server.submit(p, max_new_tokens=40) for p in ps[1:]]
        outs = [first.result()] + [r.result(timeout=30) for r in later]
    assert "".join(got) == outs[0].text
    assert [o.token_ids for o in outs] == [a.token_ids for a in ar]
    assert 1 in sizes and 4 in sizes  # alone at first, then joined by the later requests


def test_cancelled_requests_leave_and_the_others_are_undisturbed(fake):
    ps, caps = prompts(8, seed=3), [60] * 8
    ar = alone(fake, ps, caps, method="autoregressive")
    with fake.server(method="sd", max_batch=2) as server:
        gate = threading.Event()
        real = server._scheduler.target.step
        server._scheduler.target.step = lambda *a, **k: (gate.wait(30), real(*a, **k))[1]
        requests = [server.submit(p, max_new_tokens=c) for p, c in zip(ps, caps)]
        assert requests[6].cancel()  # still waiting: over at once, no token
        assert requests[6].result(timeout=5).finish_reason == "cancelled" and requests[6].token_ids() == []
        stream = requests[1].stream(timeout=30)
        gate.set()
        next(stream)  # request 1 is live: it has tokens
        assert requests[1].cancel()
        outs = [r.result(timeout=30) for r in requests]
        assert not requests[1].cancel()  # already over
    assert outs[1].finish_reason == "cancelled" and 0 < len(outs[1].token_ids) < 60
    assert ar[1].token_ids[:len(outs[1].token_ids)] == outs[1].token_ids
    kept = [i for i in range(8) if i not in (1, 6)]
    assert [outs[i].token_ids for i in kept] == [ar[i].token_ids for i in kept]


def test_a_bad_request_is_refused_at_submit_and_a_failed_round_fails_only_its_batch(fake):
    ps = prompts(4, seed=4)
    ar = alone(fake, ps, [20] * 4, method="autoregressive")
    with fake.server(method="sd", max_batch=2) as server:
        with pytest.raises(InvalidRequestError, match="prompt token ids must be in"):
            server.submit([1, VOCAB + 5])
        with pytest.raises(InvalidRequestError, match="empty prompt"):
            server.submit([])
        with pytest.raises(InvalidRequestError, match="max_new_tokens must be an integer >= 1"):
            server.submit(ps[0], max_new_tokens=0)
        real, calls = server._scheduler.target.step, []

        def fails_once(*a, **k):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("device lost")
            return real(*a, **k)

        server._scheduler.target.step = fails_once
        doomed = [server.submit(p, max_new_tokens=20) for p in ps[:2]]
        for r in doomed:
            with pytest.raises(RuntimeError, match="device lost"):
                r.result(timeout=30)
        fine = [server.submit(p, max_new_tokens=20) for p in ps]  # the server goes on
        assert [r.result(timeout=30).token_ids for r in fine] == [a.token_ids for a in ar]
    with pytest.raises(InvalidRequestError, match="this server is closed"):
        server.submit(ps[0])


def test_futures_serve_asyncio_and_close_cancels_on_request(fake):
    ps = prompts(5, seed=5)
    ar = alone(fake, ps, [30] * 5, method="autoregressive")
    server = fake.server(method="anpd", max_batch=2)

    async def main():
        return await asyncio.gather(*(asyncio.wrap_future(server.submit(p, max_new_tokens=30).future) for p in ps))

    outs = asyncio.run(main())
    assert [o.token_ids for o in outs] == [a.token_ids for a in ar]
    gate = threading.Event()
    real = server._scheduler.target.step
    server._scheduler.target.step = lambda *a, **k: (gate.wait(30), real(*a, **k))[1]
    pending = [server.submit(p, max_new_tokens=30) for p in ps]
    threading.Timer(0.2, gate.set).start()
    server.close(cancel=True, timeout=30)
    assert not server._thread.is_alive()
    reasons = [r.result(timeout=5).finish_reason for r in pending]
    assert reasons == ["cancelled"] * 5  # the live ones at the end of their round, the waiting ones at once
    server.close()  # idempotent
    with pytest.raises(InvalidRequestError, match="do not apply to method 'sd'"):
        fake.server(method="sd", tree=[[0]])


@pytest.mark.parametrize("kw", [dict(method="sd", num_draft_tokens=3), dict(method="mtad"),
                                dict(method="autoregressive")], ids=lambda kw: kw["method"])
def test_a_seeded_request_samples_what_it_samples_alone(fake, kw):
    """Each request draws from a generator of its own seed: its tokens do not depend on the batch it shares."""
    ps = prompts(6, seed=4)
    ref = [fake.generate([p], max_new_tokens=20, temperature=0.9, seed=10 + i, **kw)[0].token_ids
           for i, p in enumerate(ps)]
    with fake.server(max_batch=3, temperature=0.9, **kw) as server:
        requests = [server.submit(p, max_new_tokens=20, seed=10 + i) for i, p in enumerate(ps)]
        outs = [r.result(timeout=30).token_ids for r in requests]
        other = server.submit(ps[0], max_new_tokens=20, seed=11).result(timeout=30).token_ids
    assert outs == ref
    assert other != ref[0]  # the seed is what makes them: another gives other tokens
    with pytest.raises(InvalidRequestError, match="seed must be an integer >= 0, got -1"):
        fake.server().submit(ps[0], seed=-1)


def test_stats_count_rounds_by_batch_size_and_what_ended(fake):
    ps = prompts(7, seed=5)
    with fake.server(method="sd", max_batch=3) as server:
        outs = [r.result(timeout=30) for r in [server.submit(p, max_new_tokens=12) for p in ps]]
        with pytest.raises(InvalidRequestError):
            server.submit([], max_new_tokens=4)  # refused: not counted
        st = server.stats()
    assert (st.submitted, st.finished, st.failed, st.waiting, st.running) == (7, 7, 0, 0, 0)
    assert st.generated_tokens == sum(len(o.token_ids) for o in outs) == 7 * 12
    assert st.target_calls == sum(o.stats.target_calls for o in outs)
    assert st.accepted_tokens == sum(o.stats.accepted for o in outs) > 0
    assert max(st.rounds_by_batch) == 3  # rounds held several sequences
    assert sum(n * r for n, r in st.rounds_by_batch.items()) == sum(o.stats.rounds for o in outs)


def test_pieces_add_up_to_the_text_and_the_tokens(pipelines, humaneval):
    pipe = pipelines["ort"]
    want = pipe.generate(humaneval[4], method="sd", max_new_tokens=40)
    with pipe.server(method="sd") as server:
        pieces = list(server.submit(humaneval[4], max_new_tokens=40).pieces(timeout=60))
    assert len(pieces) > 1 and all(p.token_ids for p in pieces)
    assert "".join(p.text for p in pieces) == want.text
    assert [t for p in pieces for t in p.token_ids] == want.token_ids
