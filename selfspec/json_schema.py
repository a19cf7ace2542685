"""JSON schemas closed by default, as xgrammar (vLLM's default backend) compiles them: an object
that names its properties gets no others, and a tuple (`prefixItems`) no items past those it
names, unless the schema allows them explicitly (`additionalProperties: true` or a schema,
`items`). JSON Schema's own default is open, and a small model then writes key after key until
max_tokens; llguidance follows the standard, so the schema is rewritten before it compiles.

llguidance intersects a schema with its `allOf` branches (and with `anyOf`/`oneOf` alternatives
beside keywords of its own): a branch closed on its own names would refuse the names of the
others, so branches there stay open and the schema that holds them is closed on the union of
their names, or left open when those cannot be listed (a `$ref` or `patternProperties` among
them).
"""

from __future__ import annotations

from typing import Any

# keywords whose values are subschemas that stand alone (not intersected with their parent)
_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SINGLE = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems", "contains")
_ALTERNATIVES = ("anyOf", "oneOf")
_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties")


def closed(schema: Any) -> Any:
    """A copy of schema in which unnamed properties and items are not allowed unless the schema
    says so (module doc); schema itself is not modified."""
    return _close(schema, intersected=False)


def _close(s: Any, intersected: bool) -> Any:
    """s rewritten; intersected: s is an allOf branch (or an alternative beside sibling keywords),
    so its own level stays open for its parent to close."""
    if not isinstance(s, dict):
        return s  # true / false, or something malformed that llguidance reports
    out = dict(s)
    for k in _MAPS:
        if isinstance(s.get(k), dict):
            out[k] = {name: _close(v, False) for name, v in s[k].items()}
    for k in _SINGLE:
        if isinstance(s.get(k), dict):
            out[k] = _close(s[k], False)
    for k in ("prefixItems", "items"):
        if isinstance(s.get(k), list):
            out[k] = [_close(v, False) for v in s[k]]
    beside = intersected or any(k in s for k in ("properties", "patternProperties", "allOf"))
    joined = False  # s has branches intersected with it
    for k in ("allOf",) + _ALTERNATIVES:
        if isinstance(s.get(k), list):
            opened = k == "allOf" or beside
            out[k] = [_close(v, opened) for v in s[k]]
            joined = joined or opened
    if not intersected:
        _close_level(s, out, joined)
    return out


def _close_level(s: dict, out: dict, joined: bool) -> None:
    """Close out's own object and tuple keywords where s leaves them unsaid."""
    if not any(k in s for k in _OPEN_KEYS):
        if joined:
            names = _names(s)
            if names:  # the union of what the branches name (each allowed as its branch says)
                out["properties"] = {**{n: {} for n in names}, **out.get("properties", {})}
                out["additionalProperties"] = False
        elif ("properties" in s or "patternProperties" in s) and "$ref" not in s:
            out["additionalProperties"] = False
    if "prefixItems" in s and not any(k in s for k in ("items", "unevaluatedItems")):
        out["items"] = False
    elif isinstance(s.get("items"), list) and "additionalItems" not in s:  # draft 7's tuples
        out["additionalItems"] = False


def _names(s: Any) -> list[str] | None:
    """The property names s and the branches intersected with it name, in order; None when they
    cannot all be listed."""
    if not isinstance(s, dict):
        return []
    if "$ref" in s or "patternProperties" in s or s.get("additionalProperties", False) is not False:
        return None
    if not isinstance(s.get("properties", {}), dict):
        return None
    names = list(s.get("properties", {}))
    for k in ("allOf",) + _ALTERNATIVES:
        for branch in s.get(k, []) if isinstance(s.get(k), list) else []:
            more = _names(branch)
            if more is None:
                return None
            names += [n for n in more if n not in names]
    return names
