"""Typed artifacts to and from JSON data, checked field by field against their annotations.

`to_data(obj)` turns frozen dataclasses (nested, with tuples and dicts) into JSON-ready data;
`from_data(cls, data)` rebuilds them and raises DataError naming the first field that is missing, has
the wrong type or is not part of the format, e.g. "choices.1.num_nodes: expected an integer, got 'x'".
Dict keys are strings in JSON; `dict[int, ...]` keys come back as ints.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

from specrt.config import field_types, unwrap_optional


class DataError(ValueError):
    pass


def to_data(obj):
    if is_dataclass(obj):
        return {f.name: to_data(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [to_data(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_data(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def from_data(tp, data, where: str = ""):
    tp, optional = unwrap_optional(tp)
    here = where or "(top)"
    if data is None:
        if optional:
            return None
        raise DataError(f"{here}: missing value")
    if is_dataclass(tp):
        if not isinstance(data, dict):
            raise DataError(f"{here}: expected an object, got {type(data).__name__}")
        hints = field_types(tp)
        names = {f.name for f in fields(tp)}
        extra = sorted(set(data) - names)
        if extra:
            raise DataError(f"{here}: unexpected field(s) {', '.join(extra)}")
        kw = {}
        for f in fields(tp):
            key = f"{where}.{f.name}" if where else f.name
            if f.name in data:
                kw[f.name] = from_data(hints[f.name], data[f.name], key)
            elif f.default is MISSING and f.default_factory is MISSING:
                raise DataError(f"{key}: missing")
        return tp(**kw)
    origin = typing.get_origin(tp)
    if origin is tuple:
        if not isinstance(data, list):
            raise DataError(f"{here}: expected a list, got {type(data).__name__}")
        args = typing.get_args(tp)
        item = args[0] if len(args) == 2 and args[1] is Ellipsis else None
        if item is None:
            if len(args) != len(data):
                raise DataError(f"{here}: expected {len(args)} items, got {len(data)}")
            return tuple(from_data(a, v, f"{where}.{i}") for i, (a, v) in enumerate(zip(args, data)))
        return tuple(from_data(item, v, f"{where}.{i}") for i, v in enumerate(data))
    if origin is dict:
        if not isinstance(data, dict):
            raise DataError(f"{here}: expected an object, got {type(data).__name__}")
        key_tp, val_tp = typing.get_args(tp)
        out = {}
        for k, v in data.items():
            if key_tp is int:
                try:
                    k2 = int(k)
                except ValueError:
                    raise DataError(f"{where}.{k}: expected an integer key") from None
            else:
                k2 = k
            out[k2] = from_data(val_tp, v, f"{where}.{k}")
        return out
    if tp is bool:
        if not isinstance(data, bool):
            raise DataError(f"{here}: expected true or false, got {data!r}")
        return data
    if tp is int:
        if not isinstance(data, int) or isinstance(data, bool):
            raise DataError(f"{here}: expected an integer, got {data!r}")
        return data
    if tp is float:
        if not isinstance(data, (int, float)) or isinstance(data, bool):
            raise DataError(f"{here}: expected a number, got {data!r}")
        return float(data)
    if tp is str:
        if not isinstance(data, str):
            raise DataError(f"{here}: expected a string, got {data!r}")
        return data
    if tp is Path:
        if not isinstance(data, str):
            raise DataError(f"{here}: expected a path, got {data!r}")
        return Path(data)
    return data  # object / Any
