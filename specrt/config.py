"""Config as data: each option is declared once, as a dataclass field with its default, bounds and help.

    @dataclass(frozen=True)
    class SdOptions(Config):
        num_draft_tokens: int = option(4, "draft chain length (gamma)", ge=1)

`Config.__post_init__` runs `check`, which validates every field against its annotation and bounds (one
message format for the API and the CLI: "num_draft_tokens must be an integer >= 1, got 1.5"); the CLI
derives its flags from the same fields (specrt.cli.args), so a default or a help text is written once.

Supported annotations: int, float, bool, str, Path, tuple[int, ...] / tuple[float, ...] / tuple[str, ...],
X | None of those, and `object` (not checked). Bools are never accepted as numbers.
"""

from __future__ import annotations

import math
import numbers
import types
import typing
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, is_dataclass
from functools import cache
from pathlib import Path

from specrt.errors import InvalidRequestError, SpecrtError


@dataclass(frozen=True)
class Config:
    """Base of config dataclasses (declare subclasses with @dataclass(frozen=True)): validated on construction."""

    def __post_init__(self):
        check(self)


def option(default=MISSING, help: str = "", *, ge=None, gt=None, le=None, lt=None, choices=None,
           cli: bool = True, flag: str | None = None, metavar: str | None = None, nonempty: bool = False) -> Field:
    """A dataclass field with what `check` and the CLI need: bounds, choices, help; `cli=False` keeps it
    off the command line, `flag` renames its CLI flag; `nonempty`: a list that must hold at least one item."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices, "cli": cli, "flag": flag,
            "metavar": metavar, "nonempty": nonempty}
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults: use a tuple")
    return field(default=default, metadata=meta)


@cache
def field_types(cls) -> dict[str, object]:
    """Resolved annotations of a dataclass's fields (strings under `from __future__ import annotations`)."""
    return typing.get_type_hints(cls)


def unwrap_optional(tp) -> tuple[object, bool]:
    """(X, True) for X | None, (tp, False) otherwise."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _bounds(meta) -> str:
    lo = (f">= {meta['ge']}" if meta.get("ge") is not None else f"> {meta['gt']}" if meta.get("gt") is not None else None)
    hi = (f"<= {meta['le']}" if meta.get("le") is not None else f"< {meta['lt']}" if meta.get("lt") is not None else None)
    if lo and hi:
        left = "[" if meta.get("ge") is not None else "("
        right = "]" if meta.get("le") is not None else ")"
        return f"in {left}{lo.split()[1]}, {hi.split()[1]}{right}"
    return lo or hi or ""


def _in_bounds(v, meta) -> bool:
    return not ((meta.get("ge") is not None and not v >= meta["ge"]) or (meta.get("gt") is not None and not v > meta["gt"])
                or (meta.get("le") is not None and not v <= meta["le"]) or (meta.get("lt") is not None and not v < meta["lt"]))


def coerce(name: str, tp, value, meta=None, error=InvalidRequestError):
    """`value` as type `tp` (ints as float, str as Path, lists as tuples), or `error` naming `name`."""
    meta = meta or {}
    tp, optional = unwrap_optional(tp)
    if tp is object or tp is typing.Any:
        return value  # the owner checks it
    if value is None:
        if optional:
            return None
        raise error(f"{name} must be given, got None")
    bounds = _bounds(meta)

    def fail(what: str):
        raise error(f"{name} must be {what}{' ' + bounds if bounds else ''}, got {value!r}")

    if tp is bool:
        if not isinstance(value, bool):
            raise error(f"{name} must be True or False, got {value!r}")
        return value
    if tp is int:
        if not _is_int(value) or not _in_bounds(value, meta):
            fail("an integer")
        return int(value)
    if tp is float:
        if not _is_number(value) or not math.isfinite(value) or not _in_bounds(value, meta):
            fail("a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            fail("a string")
        if meta.get("choices") and value not in meta["choices"]:
            raise error(f"{name} must be one of {', '.join(map(str, meta['choices']))}, got {value!r}")
        return value
    if tp is Path:
        if not isinstance(value, (str, Path)):
            fail("a path")
        return Path(value)
    if typing.get_origin(tp) is tuple:
        item = typing.get_args(tp)[0]
        if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
            fail(f"a list of {item.__name__}")
        if meta.get("nonempty") and not value:
            raise error(f"{name} must hold at least one {item.__name__}, got none")
        return tuple(coerce(f"{name}[{i}]", item, v, meta, error) for i, v in enumerate(value))
    raise TypeError(f"{name}: annotation {tp!r} is not supported by specrt.config")


def check(obj, error=InvalidRequestError) -> None:
    """Validate (and normalise in place) every field of a frozen dataclass instance."""
    hints = field_types(type(obj))
    for f in fields(obj):
        try:
            value = coerce(f.name, hints[f.name], getattr(obj, f.name), f.metadata, error)
        except SpecrtError as e:
            e.fields = (f.name,)  # the field it is about, as data
            raise
        object.__setattr__(obj, f.name, value)


def flag_name(f: Field) -> str:
    """The CLI flag of a field: --field-name, or --<metadata flag>."""
    return "--" + (f.metadata.get("flag") or f.name.replace("_", "-"))


def format_value(value) -> str:
    """A value as the CLI parses it back: lists comma-separated, pairs colon-separated."""
    if isinstance(value, (tuple, list)):
        return ",".join(":".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v) for v in value)
    return str(value)


def to_flags(cfg) -> str:
    """The CLI flags that rebuild `cfg` from the defaults: only fields that differ from theirs."""
    import shlex

    out = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if not f.metadata.get("cli", True) or value == f.default:
            continue
        if isinstance(value, bool):
            out.append(flag_name(f) if value else "--no-" + flag_name(f)[2:])
        elif value is not None:
            text = format_value(value)
            out.append(f"{flag_name(f)} {shlex.quote(text) if text else repr('')}")
    return " ".join(out)


def config_dict(cfg) -> dict:
    """A config dataclass as JSON-ready data (paths as strings, tuples as lists)."""
    def plain(v):
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return {k: plain(v) for k, v in asdict(cfg).items()} if is_dataclass(cfg) else plain(cfg)
