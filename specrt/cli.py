"""The `specrt` command line (also `python -m specrt`).

    specrt models train | inflate      the demo pair
    specrt export                      HF checkpoints -> bundle (step graphs, tokenizer, manifest)
    specrt generate                    run a method from a bundle
    specrt demo                        export the demo pair and compare methods on HumanEval prompts
    specrt calibrate | profile | tune  acceptance.json, latency.json, plan.json (for method="auto")
    specrt bench e2e|trees|ngram|mtad  end-to-end vs baselines; tree sizes vs prediction; ablations

Errors the user can act on (specrt.errors.SpecrtError) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specrt.errors import SpecrtError

from specrt.models import DEMO_DIR


# -- shared argument groups ----------------------------------------------------------------------
def add_bundle_args(p: argparse.ArgumentParser, default: str | None = "build/demo") -> None:
    p.add_argument("--bundle", type=Path, default=Path(default) if default else None,
                   required=default is None, help="bundle directory made by `specrt export` (default: %(default)s)")


def add_bench_args(p: argparse.ArgumentParser, num_prompts: int) -> None:
    """What every `specrt bench` verb takes: bundle, prompts, runs, threads and where results go."""
    add_bundle_args(p)
    g = p.add_argument_group("benchmark")
    g.add_argument("--label", default="demo", help="name used in output files (default: %(default)s)")
    g.add_argument("--out", type=Path, default=Path("build/bench"), help="results directory (default: %(default)s)")
    g.add_argument("--num-prompts", type=int, default=num_prompts, help="first N HumanEval prompts (default: %(default)s)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--runs", type=int, default=3, help="timed runs after one untimed warm-up (default: %(default)s)")
    g.add_argument("--threads", type=int, default=2)


def add_backend_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("backend")
    g.add_argument("--backend", choices=["ort", "torch"], default="ort", help="ort = ONNX Runtime (default), torch = PyTorch")
    g.add_argument("--threads", type=int, default=None, help="intra-op threads (default: the runtime's choice)")
    g.add_argument("--device", default=None, help="torch device, e.g. cuda:0 (default: cuda if present, else cpu)")


def add_generation_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("--method", default="sd", help="autoregressive | sd | tree | auto | dynamic | anpd | mtad (default: %(default)s)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--num-draft-tokens", type=int, default=None, help="sd, mtad: chain length (default 4); anpd: K (default 7); dynamic: tree nodes (default 8)")
    g.add_argument("--ngram-n", type=int, default=5, help="anpd: highest n-gram order N (default: %(default)s)")
    g.add_argument("--ngram-branches", type=int, default=1,
                   help="anpd: continuations per node of an n-gram tree (default: %(default)s, a chain)")
    g.add_argument("--ngram-min-prob", type=float, default=None,
                   help="anpd, --ngram-tokens: skip n-gram drafts whose estimated path probability is lower "
                        "(default: 0 for anpd, 0.3 when merged)")
    g.add_argument("--ngram-tokens", type=int, default=0,
                   help="sd, tree, dynamic: merge up to this many n-gram drafted tokens into the draft model's tree "
                        "(default: %(default)s, off)")
    g.add_argument("--ngram-hardware-aware", action="store_true",
                   help="anpd: per round, verify as many drafted tokens as pay off under the bundle's latency profile")
    g.add_argument("--num-beams", type=int, default=None,
                   help="mtad: beams W (default 4); dynamic: nodes expanded per depth (default max(4, nodes // 4))")
    g.add_argument("--tree-depth", type=int, default=None, help="dynamic: draft depth (default: min(nodes, 8))")
    g.add_argument("--draft-temperature", type=float, default=None,
                   help="dynamic: temperature of the draft's node scores (default: the calibrated one, else 1)")
    g.add_argument("--tau", type=float, default=0.5, help="mtad: joint-likelihood threshold (default: %(default)s)")
    g.add_argument("--verify-beams", type=int, default=1,
                   help="mtad: top beams verified as one tree (default: %(default)s, the best beam)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)


def add_export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=Path, default=DEMO_DIR / "target", help="target checkpoint dir (default: demo)")
    p.add_argument("--draft", type=Path, default=DEMO_DIR / "draft", help="draft checkpoint dir (default: demo)")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer dir (default: the target's, else the demo's)")
    p.add_argument("--out", type=Path, default=Path("build/demo"), help="bundle directory (default: %(default)s)")
    p.add_argument("--no-check", action="store_true", help="skip the ONNX-vs-PyTorch parity check")
    p.add_argument("--dtype", choices=["float32", "float16"], default="float32",
                   help="weights, activations and K/V cache (float16 is meant for GPUs; logits stay float32)")


def _tokenizer_dir(args) -> Path | None:
    if args.tokenizer:
        return args.tokenizer
    if (args.target / "tokenizer.json").is_file():
        return None
    demo = DEMO_DIR / "tokenizer"
    return demo if args.target.resolve().is_relative_to(DEMO_DIR.resolve()) else None


# -- verbs -------------------------------------------------------------------------------------
def cmd_models(args) -> None:
    if args.models_cmd == "train":
        from specrt.models.train import train_pair

        train_pair(args.out)
    else:
        from specrt.models.inflate import InflateConfig, inflate

        inflate(InflateConfig(src=args.src, out=args.out, hidden_size=args.hidden, intermediate_size=args.intermediate,
                              num_layers=args.layers, num_heads=args.heads, seed=args.seed))


def cmd_export(args) -> None:
    from specrt.export.onnx_export import ExportConfig, export_bundle

    cfg = ExportConfig(target=args.target, draft=args.draft, out=args.out, tokenizer=_tokenizer_dir(args),
                       check=not args.no_check, dtype=args.dtype)
    manifest = export_bundle(cfg)
    for role, p in manifest["parity"].items():
        print(f"{role}: parity vs PyTorch over {p['cases']} random cases: max |logit err| {p['max_logit_err']:.2e}")
    print(f"bundle written to {args.out}")


def cmd_generate(args) -> None:
    from specrt.runtime.pipeline import Pipeline

    pipe = Pipeline.load(args.bundle, backend=args.backend, threads=args.threads, device=args.device)
    kw = dict(method=args.method, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed, num_draft_tokens=args.num_draft_tokens, ngram_n=args.ngram_n,
              num_beams=args.num_beams, tau=args.tau, verify_beams=args.verify_beams,
              ngram_branches=args.ngram_branches, ngram_min_prob=args.ngram_min_prob, tree_depth=args.tree_depth,
              ngram_hardware_aware=args.ngram_hardware_aware, ngram_tokens=args.ngram_tokens,
              draft_temperature=args.draft_temperature)
    if args.stream:
        for piece in pipe.stream(args.prompt, **kw):
            print(piece, end="", flush=True)
        print()
        return
    out = pipe.generate(args.prompt, **kw)
    print(args.prompt + out.text)
    s = out.stats
    print(f"\n[{len(out.token_ids)} tokens, {s['target_calls']} target calls, "
          f"{len(out.token_ids) / max(1, s['rounds']):.2f} tokens per decode step, {s['seconds']['total']:.3f} s]", file=sys.stderr)


def cmd_demo(args) -> None:
    from specrt.bench.demo import DemoConfig, run_demo

    run_demo(DemoConfig(bundle=args.bundle, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                        threads=args.threads, backend=args.backend))


def cmd_calibrate(args) -> None:
    from specrt.calibration.acceptance import CalibrationConfig, calibrate

    from specrt.bench.report import number_list

    r = calibrate(CalibrationConfig(bundle=args.bundle, num_prompts=args.num_prompts, new_tokens=args.new_tokens,
                                    max_depth=args.max_depth, max_rank=args.max_rank, seed=args.seed, threads=args.threads,
                                    dynamic_sizes=number_list(args.dynamic_sizes),
                                    merged_sizes=number_list(args.merged_sizes)))
    print(f"{r['num_positions']} positions; rank-0 acceptance by depth: "
          + " ".join(f"{row[0]:.2f}" for row in r["depth_rank"]))
    for t in r["trees"]:
        if t["num_nodes"] in (1, 2, 4, 8, 16, 32, 64):
            print(f"best tree of {t['num_nodes']:>2} nodes: {t['expected_accepted']:.2f} accepted tokens expected per round")
    print(f"draft temperature {r['draft_temperature']}; dynamic trees, measured accepted tokens per round: "
          + ", ".join(f"{d['num_nodes']} nodes {d['expected_accepted']:.2f}" for d in r["dynamic"]))
    if r["merged"]:
        print("merged with n-gram drafts, measured accepted tokens per round (nodes verified): "
              + ", ".join(f"{d['num_nodes']} nodes {d['expected_accepted']:.2f} ({d['nodes_per_round']:.1f})"
                          for d in r["merged"]))
    print(f"wrote {args.bundle}/acceptance.json")


def cmd_profile(args) -> None:
    from specrt.bench.latency import ProfileConfig, latency_ms, profile

    data = profile(ProfileConfig(bundle=args.bundle, backend=args.backend, threads=args.threads, device=args.device,
                                 batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")), repeats=args.repeats))
    for b in data["models"]["target"]:
        print(f"batch {b}: target L(1) {latency_ms(data, 'target', int(b), 1):.2f} ms, "
              f"L(8) {latency_ms(data, 'target', int(b), 8):.2f} ms; draft L(1) {latency_ms(data, 'draft', int(b), 1):.2f} ms")
    print(f"wrote {args.bundle}/latency.json and latency.png")


def cmd_tune(args) -> None:
    from specrt.bench.tune import TuneConfig, describe_plan, tune

    plan = tune(TuneConfig(bundle=args.bundle))
    print(describe_plan(plan))
    print(f"wrote {args.bundle}/plan.json")


def cmd_bench(args) -> None:
    if args.bench_cmd == "trees":
        from specrt.bench.trees import main_from_args
    elif args.bench_cmd == "ngram":
        from specrt.bench.ngram import main_from_args
    elif args.bench_cmd == "mtad":
        from specrt.bench.mtad import main_from_args
    else:
        from specrt.bench.e2e import main_from_args
    main_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specrt", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    models = sub.add_parser("models", help="train or inflate the demo pair")
    msub = models.add_subparsers(dest="models_cmd", required=True)
    train = msub.add_parser("train", help="train tokenizer + target + draft on the stdlib source (CPU, ~30 min)")
    train.add_argument("--out", type=Path, default=Path("build/models"))
    inflate = msub.add_parser("inflate", help="function-preserving expansion of a checkpoint to a memory-bound size")
    inflate.add_argument("--src", type=Path, default=DEMO_DIR / "target")
    inflate.add_argument("--out", type=Path, default=Path("build/inflated/target"))
    inflate.add_argument("--hidden", type=int, default=768)
    inflate.add_argument("--intermediate", type=int, default=3072)
    inflate.add_argument("--layers", type=int, default=16)
    inflate.add_argument("--heads", type=int, default=12)
    inflate.add_argument("--seed", type=int, default=0)
    models.set_defaults(func=cmd_models)

    exp = sub.add_parser("export", help="export a target + draft pair into a bundle")
    add_export_args(exp)
    exp.set_defaults(func=cmd_export)

    gen = sub.add_parser("generate", help="generate from a bundle")
    add_bundle_args(gen)
    add_backend_args(gen)
    add_generation_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--stream", action="store_true", help="print text as it is accepted")
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="compare autoregressive and sd on HumanEval prompts")
    add_bundle_args(demo)
    add_backend_args(demo)
    demo.add_argument("--num-prompts", type=int, default=10)
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.set_defaults(func=cmd_demo)

    cal = sub.add_parser("calibrate", help="acceptance statistics on held-out text -> acceptance.json")
    add_bundle_args(cal)
    cal.add_argument("--num-prompts", type=int, default=24)
    cal.add_argument("--new-tokens", type=int, default=96)
    cal.add_argument("--max-depth", type=int, default=8)
    cal.add_argument("--max-rank", type=int, default=8)
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--threads", type=int, default=2)
    cal.add_argument("--dynamic-sizes", default="2,4,6,8,10,12,16,24,32",
                     help="dynamic tree sizes whose acceptance is measured by decoding ('' for none)")
    cal.add_argument("--merged-sizes", default="4,6,8,10,12,16",
                     help="dynamic tree sizes measured with n-gram drafts merged in ('' for none)")
    cal.set_defaults(func=cmd_calibrate)

    prof = sub.add_parser("profile", help="step latency L(n) of target and draft -> latency.json")
    add_bundle_args(prof)
    add_backend_args(prof)
    prof.add_argument("--batch-sizes", default="1,2,4,8")
    prof.add_argument("--repeats", type=int, default=5)
    prof.set_defaults(func=cmd_profile, threads=2)

    tun = sub.add_parser("tune", help="choose the tree per batch size from acceptance + latency -> plan.json")
    add_bundle_args(tun)
    tun.set_defaults(func=cmd_tune)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_cmd", required=True)
    from specrt.bench.e2e import add_e2e_args

    from specrt.bench.trees import add_trees_args

    add_e2e_args(bsub.add_parser("e2e", help="end-to-end tokens/s against HF and Optimum baselines"))
    add_trees_args(bsub.add_parser("trees", help="measured vs predicted tokens/s per tree size (after tune)"))
    from specrt.bench.ngram import add_ngram_args

    add_ngram_args(bsub.add_parser("ngram", help="ANPD ablation over n-gram order N and draft length K"))
    from specrt.bench.mtad import add_mtad_args

    add_mtad_args(bsub.add_parser("mtad", help="MTAD/MJSD speed and perplexity vs sd, tau and beam ablations"))
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except SpecrtError as e:
        print(f"specrt: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
