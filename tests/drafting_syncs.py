"""What a drafter's rounds bring to the host, counted: the tests of a greedy chain that waits for its device once a
round (a draft model's, tests/runtime/test_pipeline.py; an EAGLE head's, tests/runtime/test_eagle_drafter.py)."""

from __future__ import annotations


def host_copies_while_drafting(monkeypatch, drafter, run, on_round=None) -> tuple[list, object]:
    """(copies, what run() returned): copies alternates, per round, the tensors `drafter._propose` brought to the
    host (Tensor.cpu) and None (the verification's copies between rounds are not the drafter's). on_round(drafter,
    seqs, trees): called after each round's drafting."""
    import torch

    copies, real_cpu, real_propose = [], torch.Tensor.cpu, drafter._propose

    def cpu(self, *args, **kw):
        if copies and copies[-1] is not None:
            copies[-1] += 1
        return real_cpu(self, *args, **kw)

    def propose(self, seqs, params, rng):
        copies.append(0)
        trees = real_propose(self, seqs, params, rng)
        copies.append(None)
        if on_round is not None:
            on_round(self, seqs, trees)
        return trees

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    monkeypatch.setattr(drafter, "_propose", propose)
    try:
        return copies, run()
    finally:
        monkeypatch.undo()


def device_waits_while_drafting(monkeypatch, drafter, run) -> tuple[int, object]:
    """(waits, what run() returned) on CUDA: `drafter._propose` runs under PyTorch's sync debug mode, which raises at
    any call that synchronises with the device, but for Runner.to_host's (counted in waits)."""
    import torch

    from specrt.runtime.backends.base import Runner

    real_to_host, real_propose = Runner.to_host, drafter._propose
    waits = []

    def to_host(self, tokens):
        torch.cuda.set_sync_debug_mode(0)
        try:
            waits.append(1)
            return real_to_host(self, tokens)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    def propose(self, seqs, params, rng):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real_propose(self, seqs, params, rng)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(Runner, "to_host", to_host)
    monkeypatch.setattr(drafter, "_propose", propose)
    try:
        out = run()
    finally:
        monkeypatch.undo()
    return len(waits), out
