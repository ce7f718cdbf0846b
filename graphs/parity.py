"""Parity of a step graph (or an engine) against its PyTorch StepModule on feeds from real text and real caches.

Feeds cover what the runtime will send: B > 1 with ragged cache lengths, random token trees in the new-token block
(each node sees its ancestors and itself), and capacity S = 0 (prefill). They are made as the runtime makes them:
the token ids come from real text (`text_tokens`: prose, code and, where the tokenizer has a chat template, a chat),
and the cache holds the model's own K/V of that text, computed by a prefill of the reference module. A cache slot at
or past a sequence's length holds the K/V of later text (what a rejected draft leaves there) and is masked out.
Random N(0, 1) caches are not what a trained model reads: its attention sharpens on them, and its logits reach
20-85 where a random model's stay near 1, so one absolute tolerance cannot hold on both (the tolerance below scales).

Verdict (`compare`, through Polygraphy's comparator: the same comparison for ONNX Runtime, the static engines and
TensorRT): each output's largest |difference| over all cases within `contract.parity_tolerance` (the dtype's
tolerance per unit of that output's largest |value|), and the top token of every row the same where the reference's
top two are further apart than twice the logits' tolerance (closer, either token is a correct rounding).

An in-graph variant (kv_update "inplace", contract.py) is checked against the same module on the same feeds,
rewritten to its inputs (`in_graph_feeds`): its logits must match, its present cache must hold the module's new K/V at
each sequence's write index, and every other slot must be as it was.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt import contract

PARITY_TOL = contract.PARITY_TOL  # per dtype, per unit of an output's largest |value|

# Prose for the check's text (code comes from this Python's standard library, a chat from the tokenizer's template).
PROSE = (
    "The harbour was quiet in the early morning. Fishing boats came back one after another, and the buyers walked "
    "along the quay comparing prices before the market opened. By nine o'clock the fog had lifted, the cafes were "
    "full, and a ferry to the islands left with more bicycles on board than passengers.\n"
    "Speculative decoding drafts several tokens cheaply and verifies them with one call of the large model; the "
    "tokens it accepts are exactly those the large model would have chosen, so the output does not change.\n"
)
CHAT = [{"role": "user", "content": "What is the capital of France, and what river runs through it?"},
        {"role": "assistant", "content": "The capital of France is Paris. The Seine runs through it."},
        {"role": "user", "content": "Write a Python function that reverses a string."}]
CODE_FILES = ("textwrap.py", "json/encoder.py")


@dataclass(frozen=True)
class ParityReport:
    cases: int
    dtype: str  # whose tolerance applies
    max_logit_err: float  # max |candidate - reference| over logits
    max_kv_err: float  # max |candidate - reference| over new (or present) K/V
    logit_scale: float  # max |logit| of the reference
    kv_scale: float  # max |K/V| of the reference
    passed: bool  # every output within its tolerance (Polygraphy's verdict)
    worst: str  # the output furthest beyond its tolerance (or nearest to it)
    rows: int  # logit rows compared
    top1_agreement: float  # share of rows with the same top token
    top1_mismatches: int  # rows whose top token differs where the reference's top two are not a tie
    per_unit: float  # the tolerance per unit of the largest |value|

    @property
    def logit_tol(self) -> float:
        return contract.parity_tolerance(self.per_unit, self.logit_scale)

    @property
    def kv_tol(self) -> float:
        return contract.parity_tolerance(self.per_unit, self.kv_scale)

    def ok(self) -> bool:
        return self.passed and self.top1_mismatches == 0

    def __str__(self) -> str:
        return (f"{self.cases} cases from real text: max |logit err| {self.max_logit_err:.2e} (tolerance "
                f"{self.logit_tol:.2e}: {self.per_unit:g} per unit of the largest logit, {self.logit_scale:.1f}), max "
                f"|K/V err| {self.max_kv_err:.2e} (largest |K/V| {self.kv_scale:.1f}), worst {self.worst}; top token "
                f"the same on {100 * self.top1_agreement:.1f}% of {self.rows} rows ({self.top1_mismatches} differ "
                f"beyond a tie)")

    def record(self) -> dict:
        """What the manifest and the artifacts keep of it."""
        return {"cases": self.cases, "feeds": "real text", "max_logit_err": self.max_logit_err,
                "max_kv_err": self.max_kv_err, "logit_scale": round(self.logit_scale, 3),
                "kv_scale": round(self.kv_scale, 3), "tolerance_per_unit": self.per_unit,
                "top1_agreement": round(self.top1_agreement, 5), "top1_mismatches": self.top1_mismatches}


def describe(record: dict) -> str:
    """One line of a ParityReport.record() (a manifest's or inplace.json's)."""
    if "logit_scale" not in record:  # written before the feeds came from real text
        return f"parity vs PyTorch over {record['cases']} random cases: max |logit err| {record['max_logit_err']:.2e}"
    tol = contract.parity_tolerance(record["tolerance_per_unit"], record["logit_scale"])
    return (f"parity vs PyTorch over {record['cases']} cases of real text: max |logit err| "
            f"{record['max_logit_err']:.2e} (tolerance {tol:.2e} at a largest logit of {record['logit_scale']:.1f}), max "
            f"|K/V err| {record['max_kv_err']:.2e}; top token the same on {100 * record['top1_agreement']:.2f}% of rows")


def text_tokens(tokenizer, vocab_size: int, limit: int = 4096) -> np.ndarray:
    """Token ids [n] of mixed real text: prose, this Python's standard-library source and, where the tokenizer has a
    chat template, a chat rendered by it; ids the model's vocabulary lacks are dropped."""
    parts = [PROSE]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts += [(stdlib / f).read_text(errors="replace")[:6000] for f in CODE_FILES if (stdlib / f).is_file()]
    if getattr(tokenizer, "chat_template", None):
        parts.insert(1, tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))
    ids = [i for part in parts for i in tokenizer(part, add_special_tokens=False)["input_ids"] if i < vocab_size]
    return np.asarray(ids[:limit], dtype=np.int64)


def random_tree_mask(rng: np.random.Generator, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(mask [T, T] bool, depth [T]) of a random tree whose node i has a parent < i (or none)."""
    mask = np.zeros((num_tokens, num_tokens), dtype=bool)
    depth = np.zeros(num_tokens, dtype=np.int64)
    for i in range(num_tokens):
        parent = int(rng.integers(-1, i)) if i else -1
        if parent >= 0:
            mask[i] = mask[parent]
            depth[i] = depth[parent] + 1
        mask[i, i] = True
    return mask, depth


def real_feeds(module, tokens: np.ndarray, rng: np.random.Generator, dims: tuple[int, int, int], batch: int,
               num_tokens: int, capacity: int, dtype=np.float32, device: str = "cpu", full: bool = False
               ) -> dict[str, np.ndarray]:
    """One step's feeds: `batch` windows of `tokens`, each with a random cache length in [0, capacity] whose cache
    holds the module's own K/V of the window (a prefill of `capacity` tokens; slots past the length hold later text's
    K/V, masked out), then a random tree of `num_tokens` new tokens continuing the text at the true positions.
    `module`: the reference, a function of the step's inputs as torch tensors on `device`; `dims`: its (layers,
    KV heads, head dim); `full`: the first sequence's cache is full (its length is `capacity`). A module that
    reads_features (a draft head: model/eagle.py) gets standard normal features of its width, in the cache's prefill
    too."""
    span = capacity + num_tokens + 1
    stream = np.resize(tokens, max(len(tokens), span + 1))  # repeated where the text is shorter than a window
    starts = rng.integers(0, len(stream) - span + 1, size=batch)
    windows = np.stack([stream[s:s + span] for s in starts])  # [B, capacity + T + 1]
    lengths = rng.integers(0, capacity + 1, size=batch)
    if full:
        lengths[0] = capacity
    ids = np.zeros((batch, num_tokens), dtype=np.int64)
    mask = np.zeros((batch, num_tokens, capacity + num_tokens), dtype=bool)
    positions = np.zeros((batch, num_tokens), dtype=np.int64)
    for b in range(batch):
        tree, depth = random_tree_mask(rng, num_tokens)
        first = {}  # the first node at each depth continues the text; its siblings are other tokens of it
        for i, d in enumerate(depth.tolist()):
            ids[b, i] = windows[b, lengths[b] + d] if first.setdefault(d, i) == i else rng.choice(windows[b])
        mask[b, :, : lengths[b]] = True
        mask[b, :, capacity:] = tree
        positions[b] = lengths[b] + depth
    feeds = {contract.INPUT_IDS: ids, contract.POSITION_IDS: positions, contract.ATTENTION_MASK: mask}
    width = module.fc.out_features if getattr(module, "reads_features", False) else 0
    if width:
        feeds[contract.FEATURES] = rng.standard_normal((batch, num_tokens, width)).astype(dtype)
    past = prefill_cache(module, windows[:, :capacity], dims, np.dtype(dtype), device, width)
    feeds.update(zip(contract.input_names(dims[0])[3:], past))
    return feeds


def prefill_cache(module, ids: np.ndarray, dims: tuple[int, int, int], dtype: np.dtype, device: str = "cpu",
                  features: int = 0) -> list[np.ndarray]:
    """The module's K/V [B, Hkv, S, D] of `ids` [B, S] in `dtype` (past_key.0, past_value.0, ...): one causal step
    from an empty cache (`features`: the width of a draft head's features, standard normal ones fed)."""
    import torch

    num_layers, num_kv_heads, head_dim = dims
    batch, length = ids.shape
    empty = np.zeros((batch, num_kv_heads, 0, head_dim), dtype=dtype)
    if length == 0:
        return [empty] * (2 * num_layers)
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool)).expand(batch, length, length)
    pos = torch.arange(length).expand(batch, length)
    with torch.inference_mode():
        past = [torch.from_numpy(empty).to(device)] * (2 * num_layers)
        fed = [torch.from_numpy(np.random.default_rng(length).standard_normal((batch, length, features))
                                .astype(dtype)).to(device)] if features else []
        out = module(torch.from_numpy(ids).to(device), pos.to(device), causal.to(device), *fed, *past)
    return [t.float().cpu().numpy().astype(dtype, copy=False) for t in out[1:1 + 2 * num_layers]]


def in_graph_feeds(feeds: dict[str, np.ndarray], num_layers: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The same step for an in-graph variant: capacity C = S + T (garbage beyond each length), the new tokens'
    slots at write_indices = each sequence's length."""
    mask = feeds[contract.ATTENTION_MASK]
    num_tokens = mask.shape[1]
    capacity = mask.shape[2] - num_tokens
    lengths = mask[:, 0, :capacity].sum(axis=1).astype(np.int64)  # each row sees exactly its sequence's cached slots
    out = {contract.INPUT_IDS: feeds[contract.INPUT_IDS], contract.POSITION_IDS: feeds[contract.POSITION_IDS],
           contract.ATTENTION_MASK: contract.in_graph_mask(mask, lengths, capacity + num_tokens),
           contract.WRITE_INDICES: lengths}
    if contract.FEATURES in feeds:
        out[contract.FEATURES] = feeds[contract.FEATURES]
    for layer in range(num_layers):
        for name in (contract.past_key(layer), contract.past_value(layer)):
            past = feeds[name]
            garbage = rng.standard_normal((*past.shape[:2], num_tokens, past.shape[3])).astype(past.dtype)
            out[name] = np.concatenate([past, garbage], axis=2)
    return out


def _unscored(outputs: list[dict[str, np.ndarray]], reference: list[dict[str, np.ndarray]] | None = None) -> list[dict]:
    """`outputs` with the logits the reference leaves unscored (contract.UNSCORED_LOGIT) measured from that value: 0
    where an output has it too, about 1e30 where it does not, so that no statistic over them overflows."""
    out = []
    for i, o in enumerate(outputs):
        unscored = (reference or outputs)[i][contract.LOGITS] <= contract.UNSCORED_LOGIT / 2
        logits = np.where(unscored, o[contract.LOGITS] - np.float32(contract.UNSCORED_LOGIT), o[contract.LOGITS])
        out.append({**o, contract.LOGITS: logits} if unscored.any() else o)
    return out


def compare(candidate: list[dict[str, np.ndarray]], reference: list[dict[str, np.ndarray]], dtype: str,
            per_unit: float | None = None) -> ParityReport:
    """Each case's outputs (by name; `contract.LOGITS` first) of a candidate against a reference, through
    Polygraphy's comparator: each output's largest |difference| within `per_unit` (default: the dtype's parity
    tolerance) per unit of that output's largest |value| over the cases; and the top-token check on the logits."""
    from polygraphy.comparator import Comparator, IterationResult, RunResults
    from polygraphy.logger import G_LOGGER

    try:
        from polygraphy.comparator import SimpleCompareFunc
    except ImportError:  # Polygraphy < 0.53
        from polygraphy.comparator import CompareFunc
        SimpleCompareFunc = CompareFunc.simple

    per_unit = PARITY_TOL[dtype] if per_unit is None else per_unit
    names = list(reference[0])
    # a head over some of the vocabulary leaves the rest at UNSCORED_LOGIT (contract.HEAD_VOCABULARY): not a scale
    scale = {n: max(float(np.abs(r[n][r[n] > contract.UNSCORED_LOGIT / 2]).max(initial=0.0)) for r in reference)
             for n in names}
    atol = {n: contract.parity_tolerance(per_unit, scale[n]) for n in names}
    cast = [{n: np.ascontiguousarray(c[n], dtype=np.float32) for n in names} for c in candidate]
    reference = [{n: np.ascontiguousarray(r[n], dtype=np.float32) for n in names} for r in reference]
    results = RunResults([
        ("candidate", [IterationResult(c, runner_name="candidate") for c in _unscored(cast, reference)]),
        ("reference", [IterationResult(r, runner_name="reference") for r in _unscored(reference)])])
    severity, colors = G_LOGGER.module_severity, G_LOGGER.colors
    G_LOGGER.module_severity, G_LOGGER.colors = G_LOGGER.CRITICAL, False  # the verdict is ours to say, in one line
    try:
        accuracy = Comparator.compare_accuracy(results, compare_func=SimpleCompareFunc(
            atol=atol, rtol=0.0, check_error_stat="max"))
    finally:
        G_LOGGER.module_severity, G_LOGGER.colors = severity, colors
    per_case = list(accuracy[0].values())[0]  # [case] -> {name: OutputCompareResult}
    err = {n: max(case[n].max_absdiff for case in per_case) for n in names}
    worst = max(names, key=lambda n: err[n] / atol[n])
    rows = agree = mismatches = 0
    for c, r in zip(cast, reference):
        got, want = c[contract.LOGITS].reshape(-1, c[contract.LOGITS].shape[-1]), r[contract.LOGITS]
        want = want.reshape(-1, want.shape[-1])
        top2 = np.sort(np.partition(want, -2, axis=-1)[:, -2:], axis=-1)
        same = got.argmax(-1) == want.argmax(-1)
        rows, agree = rows + len(same), agree + int(same.sum())
        mismatches += int((~same & (top2[:, 1] - top2[:, 0] > 2 * atol[contract.LOGITS])).sum())
    kv = [n for n in names if n != contract.LOGITS]
    return ParityReport(
        cases=len(reference), dtype=dtype, max_logit_err=err[contract.LOGITS],
        max_kv_err=max((err[n] for n in kv), default=0.0), logit_scale=scale[contract.LOGITS],
        kv_scale=max((scale[n] for n in kv), default=0.0), passed=bool(accuracy),
        worst=f"{worst} ({err[worst]:.2e} against {atol[worst]:.2e})", rows=rows,
        top1_agreement=agree / max(1, rows), top1_mismatches=mismatches, per_unit=per_unit)


def check_parity(session, step_module, tokens: np.ndarray, num_cases: int = 6, seed: int = 0,
                 kv_update: str = "runtime") -> ParityReport:
    """Run `num_cases` feeds from real text (`tokens`, e.g. `text_tokens`) through an onnxruntime session and the
    StepModule, and one more past the longest window where the family windows layers in the graph (Gemma 2 and 3);
    compare. kv_update "inplace": the session runs the in-graph variant (contract.py) of the same step."""
    import torch

    rng = np.random.default_rng(seed)
    m = step_module
    dtype = str(next(m.parameters()).dtype).removeprefix("torch.")
    names = contract.output_names(m.num_layers, kv_update, m.hidden)
    shapes = [(1, 1, 0), (2, 5, 0)] + [
        (int(rng.integers(1, 4)), int(rng.integers(1, 9)), int(rng.integers(1, 40))) for _ in range(max(0, num_cases - 2))
    ][:num_cases]
    windows = [w for w in m.family.layer_windows if w is not None]
    if windows:  # layers windowed in the graph: a context past the longest window, where the windows take effect
        shapes.append((2, 4, max(windows) + 8))
    candidate, reference = [], []
    for case, (batch, num_tokens, capacity) in enumerate(shapes):
        feeds = real_feeds(m, tokens, rng, (m.num_layers, m.num_kv_heads, m.head_dim), batch, num_tokens, capacity,
                           np.dtype(dtype), full=case >= num_cases)
        with torch.no_grad():
            ref = m(*(torch.from_numpy(feeds[n]) for n in m.input_names))
        wanted = [r.float().numpy() for r in ref]
        if kv_update == "inplace":
            feeds = in_graph_feeds(feeds, m.num_layers, rng)
            slots = feeds[contract.WRITE_INDICES][:, None] + np.arange(num_tokens)  # [B, T]
            past = contract.input_names(m.num_layers, kv_update, m.reads_features)[-2 * m.num_layers:]
            for i, new in enumerate(wanted[1:1 + 2 * m.num_layers]):  # the past, the module's new K/V written in
                present = feeds[past[i]].astype(np.float32)
                present[np.arange(batch)[:, None], :, slots] = new.transpose(0, 2, 1, 3)
                wanted[1 + i] = present
        candidate.append(dict(zip(names, session.run(names, feeds))))
        reference.append(dict(zip(names, wanted)))
    return compare(candidate, reference, dtype)
