"""Command-line flags derived from config dataclasses: one declaration of each option (specrt.config).

    add_config(parser, ProfileConfig)          --bundle, --backend, --threads, ... from the fields
    cfg = config_from(ProfileConfig, args)     the dataclass back, validated by its __post_init__

Types: int, float, str, Path (one value); tuple[...] (a comma list, '' for none; pairs as a:b); bool
(--flag / --no-flag); object (JSON). A malformed value is one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import re
import typing
from dataclasses import MISSING, fields
from pathlib import Path

from specrt.config import coerce, field_types, flag_name, format_value, unwrap_optional
from specrt.errors import InvalidRequestError


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit status 2), like every other error of specrt."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _scalar(tp):
    def parse(text: str):
        try:
            return tp(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {tp.__name__} value: {text!r}") from None
    parse.__name__ = tp.__name__
    return parse


def _value_parser(tp):
    """A function str -> value of type tp (for argparse's `type=`)."""
    tp, _ = unwrap_optional(tp)
    if tp in (int, float, str):
        return _scalar(tp)
    if tp is Path:
        return Path
    if typing.get_origin(tp) is tuple:
        item = typing.get_args(tp)[0]
        inner = typing.get_origin(item) is tuple

        def parse_list(text: str):
            parts = [p for p in text.split(",") if p.strip()] if text.lower() != "none" else []
            try:
                if inner:
                    kind = typing.get_args(item)[0]
                    return tuple(tuple(kind(x) for x in p.split(":")) for p in parts)
                return tuple(item(p.strip()) for p in parts)
            except ValueError:
                what = f"a:b pairs of {typing.get_args(item)[0].__name__}" if inner else item.__name__
                raise argparse.ArgumentTypeError(f"invalid list of {what}: {text!r}") from None
        return parse_list

    def parse_json(text: str):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {e}") from None
    return parse_json


def _each_of(parse, choices):
    """`parse` (text -> tuple), refusing an item that is not one of `choices`."""
    def parse_each(text: str):
        items = parse(text)
        wrong = [x for x in items if x not in choices]
        if wrong:
            raise argparse.ArgumentTypeError(f"invalid choice {', '.join(map(repr, wrong))} (choose from "
                                             f"{', '.join(map(str, choices))})")
        return items
    return parse_each


def _metavar(tp) -> str | None:
    tp, _ = unwrap_optional(tp)
    if typing.get_origin(tp) is tuple:
        item = typing.get_args(tp)[0]
        return "W:K,..." if typing.get_origin(item) is tuple else f"{item.__name__.upper()},..."
    return None


def _default_text(default) -> str:
    if default is None:
        return ""
    if isinstance(default, bool):
        return ""
    text = format_value(default)
    return f" (default: {text or repr('')})"


def add_config(parser, cls, *, exclude=(), defaults: dict | None = None) -> None:
    """Add a flag for every CLI field of the dataclass `cls` to `parser` (or an argument group)."""
    hints = field_types(cls)
    defaults = defaults or {}
    for f in fields(cls):
        if f.name in exclude or not f.metadata.get("cli", True):
            continue
        default = defaults.get(f.name, f.default)
        if default is MISSING:
            raise TypeError(f"{cls.__name__}.{f.name} has no default: CLI fields need one")
        help = f.metadata.get("help", "")
        if "(default:" not in help:  # a help that names its default in words (the demo target) keeps only that
            help += _default_text(default)
        add_flag(parser, f.name, flag_name(f), hints[f.name], default, help, f.metadata.get("choices"),
                 f.metadata.get("metavar"), f.metadata)
    # which configs a verb's flags come from (an argument group shares its parser's defaults): what the flag
    # round-trip test walks
    parser.set_defaults(configs=(*(parser.get_default("configs") or ()), cls))


def _checked(parse, tp, meta):
    """`parse`, refusing a value out of the field's bounds as argparse refuses a malformed one (naming the flag)."""
    base, _ = unwrap_optional(tp)
    item = typing.get_args(base)[0] if typing.get_origin(base) is tuple else None

    def parse_checked(text: str):
        value = parse(text)
        try:
            if item is not None:
                return tuple(coerce(f"item {i + 1}", item, v, meta) for i, v in enumerate(value))
            return coerce("the value", tp, value, meta)
        except InvalidRequestError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse_checked.__name__ = getattr(parse, "__name__", "value")
    return parse_checked


def add_flag(parser, dest: str, flag: str, tp, default, help: str, choices=None, metavar=None, meta=None) -> None:
    """One flag; `meta`: the field's metadata, whose bounds are checked as the flag is parsed."""
    # the flag each dest is typed as: what an error naming the field is rewritten to (name_flags)
    parser.set_defaults(flags={**(parser.get_default("flags") or {}), dest: flag})
    base, _ = unwrap_optional(tp)
    kw = {"dest": dest, "default": default, "help": help.replace("%", "%%")}
    if base is bool:
        kw["action"] = argparse.BooleanOptionalAction
    else:
        kw["type"] = _value_parser(tp)
        # named after the flag, not the field (a renamed flag's field would show), except where argparse lists choices
        kw["metavar"] = metavar or _metavar(tp) or (None if choices else flag.lstrip("-").replace("-", "_").upper())
        if choices and typing.get_origin(base) is tuple:  # a list: argparse would compare the whole tuple
            kw["type"] = _each_of(kw["type"], choices)
            kw["metavar"] = metavar or "{" + ",".join(map(str, choices)) + "},..."
        elif choices:
            kw["choices"] = choices
        if meta and any(meta.get(k) is not None for k in ("ge", "gt", "le", "lt")):
            kw["type"] = _checked(kw["type"], tp, meta)
    parser.add_argument(flag, **kw)


def name_flags(message: str, flags: dict[str, str]) -> str:
    """An error message with each field name a CLI user typed as a flag (max_new_tokens) named as the flag
    (--max-new-tokens): the configs and methods name their fields, shared with the Python API."""
    # a one-word field (threads) is a flag only as name=value: as a word it is English
    snake = sorted((d for d in flags if "_" in d), key=len, reverse=True)
    words = sorted((d for d in flags if "_" not in d), key=len, reverse=True)
    alternatives = [f"(?:{'|'.join(map(re.escape, snake))})(?![\\w/-])"] if snake else []
    alternatives += [f"(?:{'|'.join(map(re.escape, words))})(?==)"] if words else []
    if not alternatives:
        return message
    pattern = re.compile(r"(?<![\w/.-])(" + "|".join(alternatives) + ")")
    return pattern.sub(lambda m: flags[m.group(1)], message)


def config_from(cls, args: argparse.Namespace, **extra):
    """An instance of `cls` from parsed flags (fields absent from `args` keep their defaults)."""
    kw = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    return cls(**{**kw, **extra})
