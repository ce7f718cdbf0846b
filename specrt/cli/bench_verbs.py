"""`specrt bench VERB`: the benchmark verbs, each a module of specrt.bench with its config and its run function."""

from __future__ import annotations

import importlib

from specrt.cli.args import config_from


def cmd_bench(args) -> None:
    module, cls, run, _ = BENCH_VERBS[args.bench_cmd]
    mod = importlib.import_module(f"specrt.bench.{module}")
    getattr(mod, run)(config_from(getattr(mod, cls), args))


# verb -> (module, config class, function)
BENCH_VERBS = {
    "e2e": ("e2e", "E2EConfig", "run_e2e", "end-to-end tokens/s against HF and Optimum baselines"),
    "trees": ("trees", "TreesConfig", "run_trees", "measured vs predicted tokens/s per tree size (after tune)"),
    "ngram": ("ngram", "NgramConfig", "run_ngram", "ANPD ablation over n-gram order N and draft length K"),
    "mtad": ("mtad", "MtadConfig", "run_mtad", "MTAD/MJSD speed and perplexity vs sd, tau and beam ablations"),
    "soak": ("soak", "SoakConfig", "run_soak", "resident memory over many calls with random prompt lengths"),
    "quant": ("quant", "QuantBenchConfig", "run_quant", "quantized variants: bytes, tokens/s, tokens per call, "
                                                        "perplexity and greedy agreement against the exported pair"),
    "ppd": ("ppd", "PpdBenchConfig", "run_ppd", "PPD against AR, sd, dynamic and anpd; its trees' ablations; accepted "
                                                "length by distance (after `specrt ppd train`)"),
    "batch": ("batch", "BatchBenchConfig", "run_batch", "throughput, request latency and the cost model's predictions "
                                                      "by batch size: continuous against static, unpadded against "
                                                      "padded batches"),
    "load": ("load", "LoadBenchConfig", "run_load", "fresh process to first token: import, Pipeline.load and the "
                                                    "first token, against other bundles (--vs)"),
    "serve": ("serve", "ServeBenchConfig", "run_serve", "concurrent clients over a real Triton server against the same "
                                                        "load in process and served one request at a time: "
                                                        "throughput, time to first token, inter-token latency"),
    "fusions": ("fusions", "FusionsConfig", "run_fusions", "the target's step by the ort backend's projection merges "
                                                           "(q/k/v, gate/up, none), interleaved in one run"),
    "kernels": ("kernels", "KernelsConfig", "run_kernels", "where a target step's time goes, kernel by kernel "
                                                           "(torch.profiler): host work, weight GEMMs against the "
                                                           "bandwidth roofline, other kernels, gaps"),
    "docs": ("docs", "DocsConfig", "run_docs", "the full results page and the README's results table, generated "
                                               "from bench/results/*.json"),
}
