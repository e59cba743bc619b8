"""A training config's JSON values checked against the dataclass fields they fill, so that a wrong type is named
by its field (``"steps": "20"``, ``"batch_size": 4.0``) instead of failing later in arithmetic, or being taken
apart (``"tasks": "qa1"`` read as the tasks q, a and 1)."""

from __future__ import annotations

import types
import typing
from typing import Any


def check_fields(source: object, cls: type, raw: dict[str, Any], prefix: str = "") -> None:
    """Raises a ValueError naming ``source`` and the field for each value of ``raw`` its field's type refuses; a
    field whose type is not a plain one (a dict, a nested config) is left to its own checks."""
    hints = typing.get_type_hints(cls)
    for key, value in raw.items():
        hint = hints.get(key)
        if hint is not None and _accepts(hint, value) is False:
            raise ValueError(f"{source}: '{prefix}{key}' must be {_describe(hint)}, got {value!r}")


def _accepts(hint: Any, value: Any) -> bool | None:
    """Whether ``value`` (as JSON gives it) fills a field of type ``hint``; None where the type is not checked here."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None:
            return type(None) in args or None
        results = [_accepts(a, value) for a in args if a is not type(None)]
        return None if None in results else any(results)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return isinstance(value, list | tuple) and all(_accepts(args[0], v) is not False for v in value)
    return None


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_describe(a) for a in args)
    if origin is tuple:
        return f"a list of {_describe(args[0]).removeprefix('a ')}s"
    return {bool: "true or false", int: "a whole number", float: "a number", str: "a string",
            type(None): "null"}.get(hint, str(hint))
