"""Config as data: every CLI flag comes from a dataclass field, and a config's flags parse back to it."""

from dataclasses import fields
from pathlib import Path

from types import SimpleNamespace

import pytest

from specrt.cli import build_parser, method_option_fields
from specrt.config import to_flags


def parse(verb: list[str], flags: str):
    import shlex

    return build_parser().parse_args(verb + shlex.split(flags))


def verbs(parser=None, path=()) -> list[tuple[tuple[str, ...], object]]:
    """Every (sub)command of the CLI with its parser, walked from build_parser()."""
    import argparse

    parser = parser or build_parser()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [(path, parser)]
    return [v for a in subs for name, p in a.choices.items() for v in verbs(p, (*path, name))]


REQUIRED = {("generate",): "--prompt x", ("models", "real"): "smollm2-135m"}  # flags a verb cannot parse without


def test_every_verb_but_one_takes_its_flags_from_configs():
    bare = [" ".join(path) for path, p in verbs() if not p.get_default("configs")]
    assert bare == ["models train"]  # one --out flag
    assert len(verbs()) >= 25


@pytest.mark.parametrize("path", [" ".join(path) for path, _ in verbs() if _.get_default("configs")])
def test_flags_round_trip(path):
    """For every verb the parser has and every config its flags come from: the parser's defaults are the
    dataclass's, and a config with every field changed parses back from its flags."""
    from dataclasses import replace

    from specrt.cli.args import config_from

    verb = path.split()
    parser = dict(verbs())[tuple(verb)]
    dests = {a.dest for a in parser._actions}
    for config_cls in parser.get_default("configs"):
        own = [f for f in fields(config_cls) if f.name in dests and f.metadata.get("cli", True)]
        defaults = parse(verb, REQUIRED.get(tuple(verb), ""))
        assert {f.name: getattr(defaults, f.name) for f in own} == {f.name: f.default for f in own}, config_cls
        changed = {}
        for f in own:  # change every field to a different valid value
            v = f.default
            if isinstance(v, bool):
                changed[f.name] = not v
            elif isinstance(v, int) and f.name != "settle_calls":
                changed[f.name] = v + 1
            elif isinstance(v, Path):
                changed[f.name] = v / "x"
            elif isinstance(v, tuple) and v and isinstance(v[0], int):
                changed[f.name] = v[:1]
        cfg = replace(config_cls(), **changed)
        args = parse(verb, to_flags(cfg) + " " + REQUIRED.get(tuple(verb), ""))
        assert {k: getattr(args, k) for k in changed} == changed, config_cls
        assert config_from(config_cls, args) == cfg


def test_every_method_option_is_one_flag_with_every_methods_default_in_its_help():
    help_text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    for name, uses in method_option_fields().items():
        assert "--" + name.replace("_", "-") in help_text
    assert "sd: drafted chain length (gamma) (default: 4)" in " ".join(help_text.split())
    assert "anpd: K: n-gram drafted tokens (tree nodes) per round (default: 7)" in " ".join(help_text.split())


def test_only_given_method_options_reach_the_method():
    from specrt.cli import method_options

    args = parse(["generate"], "--prompt x --method dynamic --num-draft-tokens 12 --no-ngram-hardware-aware")
    assert method_options(args) == {"num_draft_tokens": 12, "ngram_hardware_aware": False}


def test_a_list_flag_with_choices_takes_each_item_from_them(capsys):
    import argparse
    from dataclasses import dataclass

    from specrt.cli.args import add_config, config_from
    from specrt.config import option

    @dataclass(frozen=True)
    class Config:
        dtypes: tuple[str, ...] = option((), "dtypes", choices=("bfloat16", "float16"))

    parser = argparse.ArgumentParser()
    add_config(parser, Config)
    assert config_from(Config, parser.parse_args(["--dtypes", "bfloat16,float16"])).dtypes == ("bfloat16", "float16")
    assert config_from(Config, parser.parse_args([])).dtypes == ()
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtypes", "bfloat16,int8"])
    assert "invalid choice 'int8' (choose from bfloat16, float16)" in capsys.readouterr().err


@pytest.mark.parametrize("verb", ["generate", "inspect"])
def test_every_backend_flag_reaches_generate_and_inspect(verb, monkeypatch):
    """Both verbs once built their options by hand and dropped --kv-update after parsing it."""
    import specrt.bundle.manifest as manifest
    import specrt.runtime.loader as loader
    from specrt.runtime.pipeline import Pipeline

    seen = {}

    class Seen(Exception):
        pass

    def load(bundle, **kw):
        seen.update(kw)
        raise Seen

    monkeypatch.setattr(Pipeline, "load", staticmethod(load))
    monkeypatch.setattr(loader, "resolve", load)  # inspect resolves the bundle as Pipeline.load does
    monkeypatch.setattr(manifest, "load_manifest", lambda bundle, verify=True: SimpleNamespace(models={}, created=""))
    flags = "--bundle b --backend ort --threads 3 --quant int8-weights --kv-update inplace --no-packed-rows"
    args = parse([verb], flags + (" --prompt x" if verb == "generate" else ""))
    with pytest.raises(Seen):
        args.func(args)
    assert (seen["backend"], seen["threads"], seen["quant"], seen["kv_update"], seen["packed_rows"]) == \
        ("ort", 3, "int8-weights", "inplace", False)


def test_a_value_out_of_bounds_is_refused_as_the_flag_is_parsed(capsys):
    with pytest.raises(SystemExit) as e:
        parse(["profile"], "--batch-sizes 1,0")
    assert e.value.code == 2
    assert "argument --batch-sizes: item 2 must be an integer >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["generate"], "--prompt x --max-new-tokens 0")
    assert "argument --max-new-tokens: the value must be an integer >= 1, got 0" in capsys.readouterr().err


def test_errors_name_the_flags_a_cli_user_typed_not_the_python_fields(capsys, demo_bundle):
    from specrt.cli import main

    flags = ["--bundle", str(demo_bundle), "--prompt", "x", "--threads", "1"]
    assert main(["generate", *flags, "--method", "mtad", "--verify-beams", "9"]) == 2
    assert capsys.readouterr().err.strip() == ("specrt: error: --verify-beams must be an integer in [1, --num-beams=4], "
                                               "got 9")
    assert main(["generate", *flags, "--method", "ppd", "--ppd-budget", "3", "--ppd-tree", "{}"]) == 2
    assert capsys.readouterr().err.strip() == "specrt: error: give --ppd-budget or --ppd-tree, not both"


def test_only_field_names_become_flags():
    from specrt.cli.args import name_flags

    flags = {"max_new_tokens": "--max-new-tokens", "bundle": "--bundle", "threads": "--threads"}
    assert name_flags("max_new_tokens=3 in build/max_new_tokens/x, bundle b, threads=9 threads", flags) == (
        "--max-new-tokens=3 in build/max_new_tokens/x, bundle b, --threads=9 threads")
