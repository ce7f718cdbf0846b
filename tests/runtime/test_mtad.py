"""MTAD / MJSD: joint-likelihood acceptance, beam search, and tau = 1 reducing to greedy decoding."""

import itertools

import numpy as np
import pytest

from specrt.manifest import ModelEntry
from specrt.runtime.backends import Backend
from specrt.runtime.beam import BeamDrafter
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.scheduler import SeqState
from specrt.runtime.tree import DraftTree
from specrt.runtime.verify import JointLikelihoodVerifier


@pytest.mark.parametrize("tau,ratios,expected", [
    (0.5, [0.9, 0.4, 0.6, 0.3], 3),  # prefix 2 fails, prefix 3 passes: the longest passing prefix wins
    (0.5, [0.5, 0.5], 0),            # strict: a ratio equal to tau fails
    (0.5, [2.0, 1.5, 0.51], 3),      # p > q counts as ratio 1
    (0.0, [1e-9, 1e-9], 2),          # tau = 0 accepts any prefix with p > 0
    (1.0, [1.0, 3.0], 0),            # tau = 1 accepts nothing
])
def test_acceptance_rule_on_hand_built_tables(tau, ratios, expected):
    logq = np.zeros(len(ratios))  # q = 1, so the ratio is exactly p (no rounding at the boundary)
    logp = logq + np.log(ratios)
    assert JointLikelihoodVerifier(tau).accepted_length(logp, logq) == expected


def test_verify_computes_joint_likelihoods_from_target_logits():
    # target: p(x1 = 1) = 0.5, p(x2 = 2 | x1) = 0.1; draft said q(x1) = 0.5, q(x1, x2) = 0.4
    probs = np.array([[0.1, 0.5, 0.2, 0.2], [0.3, 0.3, 0.1, 0.3], [0.7, 0.1, 0.1, 0.1]])
    tree = DraftTree(np.array([1, 2]), np.array([-1, 0]), is_chain=True, joint_logq=np.log([0.5, 0.4]))
    greedy = SamplingParams()
    v = JointLikelihoodVerifier(0.2).verify(tree, np.log(probs), greedy, None)
    assert v.path == [0] and v.bonus == 0  # ratio 1.0 passes, 0.05 / 0.4 = 0.125 fails; bonus argmax row 1
    v = JointLikelihoodVerifier(0.1).verify(tree, np.log(probs), greedy, None)
    assert v.path == [0, 1] and v.bonus == 0  # 0.125 > 0.1: both accepted; bonus from row 2


class MarkovBackend(Backend):
    """A hand-built 'model' whose next-token logits depend only on the current token (a bigram table)."""

    name = "markov"

    def __init__(self, table):
        self.table = np.asarray(table, dtype=np.float32)
        vocab = self.table.shape[0]
        super().__init__(ModelEntry("draft", "", "", "llama", 1, 1, 1, 1, vocab, 256, "float32", 0))

    def allocate(self, shape):
        return np.zeros(shape, dtype=np.float32)

    def _run(self, input_ids, position_ids, attention_mask, cache):
        b, t = input_ids.shape
        return self.table[input_ids], np.zeros((1, 2, b, 1, t, 1), np.float32)


def test_beam_search_finds_the_top_joint_likelihood_sequence():
    rng = np.random.default_rng(3)
    vocab, gamma = 5, 3
    table = rng.normal(size=(vocab, vocab)) * 2
    table[0] = [0, 3.0, 2.9, -5, -5]  # greedy takes 1, but 2 leads to a much likelier continuation
    table[1] = [0, 0, 0, 0, 0.2]
    table[2] = [-5, -5, -5, -5, 6.0]
    backend = MarkovBackend(table)
    logq = table - np.log(np.exp(table).sum(axis=1, keepdims=True))

    def joint(seq, prev=0):
        total = 0.0
        for tok in seq:
            total += logq[prev, tok]
            prev = tok
        return total

    best = max(itertools.product(range(vocab), repeat=gamma), key=joint)
    drafter = BeamDrafter(backend, num_beams=vocab, gamma=gamma)
    seqs = [SeqState(0, [3, 0], 8, 32)]
    drafter.start(seqs)
    tree = drafter.propose(seqs, SamplingParams(), None)[0]
    assert tuple(tree.tokens) == best
    assert np.allclose(tree.joint_logq, np.cumsum([logq[p, t] for p, t in zip((0,) + best[:-1], best)]))
    assert best[0] != int(np.argmax(table[0]))  # the test would catch a greedy drafter
    assert drafter.num_calls == gamma  # root step + one step per fed depth


@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_tau_one_is_greedy_decoding(pipelines, humaneval, backend):
    pipe = pipelines[backend]
    ar = pipe.generate(humaneval[:8], method="autoregressive", max_new_tokens=40)
    mtad = pipe.generate(humaneval[:8], method="mtad", tau=1.0, max_new_tokens=40)
    assert [a.token_ids for a in ar] == [m.token_ids for m in mtad]


def test_mtad_accepts_more_as_tau_falls(pipelines, humaneval):
    pipe = pipelines["ort"]
    per_call = []
    for tau in (0.9, 0.5, 0.1):
        outs = pipe.generate(humaneval[:6], method="mtad", tau=tau, num_beams=2, max_new_tokens=40, batch_size=3)
        per_call.append(sum(len(o.token_ids) for o in outs) / sum(o.stats["rounds"] for o in outs))
    assert per_call[0] < per_call[2]


def test_beams_never_take_impossible_tokens():
    from specrt.runtime.beam import top_beams

    with np.errstate(divide="ignore"):
        logq = np.log(np.array([[0.6, 0.4, 0.0, 0.0]]))  # a warped draft: two tokens have probability 0
    par, tok, sc = top_beams(np.zeros(1), logq, width=4)
    assert sorted(tok.tolist()) == [0, 1] and np.isfinite(sc).all()
