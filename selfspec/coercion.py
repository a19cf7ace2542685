"""Typed coercion: the one place externally supplied values get their field's type.

CLI flags, HTTP JSON, Ray Serve builder args (all strings) and profiles all construct the
configuration dataclasses (config.py), and every __post_init__ starts with coerce_fields(self).
"""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import fields

from selfspec.errors import SelfSpecError


class ConfigError(SelfSpecError):
    """A bad value for one configuration field (`field` names it, e.g. for an HTTP error's param)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class ConfigTypeError(ConfigError):
    """A value of the wrong type for its field (e.g. a string that is not a number)."""


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


@functools.cache
def _field_types(cls) -> dict[str, object]:
    return typing.get_type_hints(cls)


def _optional(tp) -> tuple[object, bool]:
    """X | None -> (X, True); X -> (X, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) < len(typing.get_args(tp))
    return tp, False


def coerce(name: str, tp, value, text: bool = True):
    """value as type tp (a field annotation); ConfigTypeError names the field. text=True: the
    value may be text to parse ("4", "false", "3,5"; CLI, Ray args); text=False: it must already
    have the type (JSON), except that an integer is a number."""
    if not text and isinstance(value, str) and _optional(tp)[0] is not str and typing.get_origin(_optional(tp)[0]) is not tuple:
        raise ConfigTypeError(f"{name} must be {_kind(tp)}, got {value!r}", name)
    tp, optional = _optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigTypeError(f"{name} must be set (got null)", name)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigTypeError(f"{name} must be true or false, got {value!r}", name)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ConfigTypeError(f"{name} must be an integer, got {value!r}", name)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ConfigTypeError(f"{name} must be a number, got {value!r}", name)
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigTypeError(f"{name} must be a string, got {value!r}", name)
    if typing.get_origin(tp) is tuple:
        item = typing.get_args(tp)[0]
        if isinstance(value, str) and text:
            value = [v for v in value.replace(" ", "").split(",") if v] if item is int else [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigTypeError(f"{name} must be a list, got {value!r}", name)
        try:
            return tuple(coerce(name, item, v, text) for v in value)
        except ConfigError:
            raise ConfigTypeError(f"{name} must be a list of {'integers' if item is int else 'strings'}, got {value!r}", name) from None
    if isinstance(tp, type) and hasattr(tp, "parse") and not isinstance(value, tp):
        return tp.parse(value, name)  # a small value type with its own text and JSON forms (LogitBias, Grammar)
    if isinstance(tp, type) and hasattr(tp, "from_dict") and isinstance(value, dict):
        return tp.from_dict(value)
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigTypeError(f"{name} has the wrong type: {value!r}", name)
    return value


def _kind(tp) -> str:
    tp = _optional(tp)[0]
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, "a list")


def typed(cls, d: dict, text: bool) -> dict:
    """d's values with the types of cls's fields (see coerce); unknown keys are left for from_dict."""
    hints = _field_types(cls)
    return {k: coerce(k, hints[k], v, text) if k in hints else v for k, v in d.items()}


def coerce_fields(obj) -> None:
    """Give every field of the dataclass instance `obj` its annotated type (see coerce)."""
    hints = _field_types(type(obj))
    for f in fields(obj):
        value = getattr(obj, f.name)
        new = coerce(f.name, hints[f.name], value)
        if new is not value:
            object.__setattr__(obj, f.name, new)


def from_dict(cls, d: dict, what: str = "option"):
    """cls(**d), with unknown keys reported as one line."""
    if not isinstance(d, dict):
        raise ConfigError(f"expected a mapping of {what}s, got {d!r}")
    unknown = set(d) - {f.name for f in fields(cls)}
    if unknown:
        raise ConfigError(f"unknown {what}(s): {', '.join(sorted(unknown))}", sorted(unknown)[0])
    return cls(**d)
