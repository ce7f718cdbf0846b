"""`specrt bench VERB`: the benchmark verbs (specrt.bench.catalog.VERBS), each a module of specrt.bench with its config
and its run function."""

from __future__ import annotations

import importlib

from specrt.cli.args import config_from


def cmd_bench(args) -> None:
    from specrt.bench.catalog import VERBS

    verb = VERBS[args.bench_cmd]
    mod = importlib.import_module(f"specrt.bench.{args.bench_cmd}")
    getattr(mod, verb.run)(config_from(getattr(mod, verb.config), args))
