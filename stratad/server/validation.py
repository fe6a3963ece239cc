"""msgspec's validation errors said in our words, naming the field.

`Expected `int` <= 8 - at `$.n`` becomes "n must be at most 8"; the field's path (as
`messages[0].role`) goes to the error body's `param`. A message of a shape we do not know
still names the field and never quotes msgspec.
"""

from __future__ import annotations

import math
import re
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

_TYPES = {
    "int": "an integer",
    "float": "a number",
    "number": "a number",
    "str": "a string",
    "bool": "true or false",
    "array": "a list",
    "object": "an object",
    "null": "null",
}
_BOUNDS = {"<=": "at most", ">=": "at least", "<": "less than", ">": "greater than"}
_UNITS = {"array": "items", "str": "characters", "object": "entries"}
_ENUMS = {  # the allowed values of enumerated fields, by the last part of their path
    "role": "system, user, assistant, developer or tool",
}

_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_GOT = re.compile(r"^Expected `(?P<want>[^`]+)`, got `(?P<got>[^`]+)`$")
_BOUND = re.compile(r"^Expected `(?P<type>[^`]+)` (?P<op><=|>=|<|>) (?P<value>\S+)$")
_LENGTH = re.compile(r"^Expected `(?P<type>[^`]+)` of length (?P<op><=|>=|<|>) (?P<value>\d+)$")
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]+)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]+)`$")
_ENUM = re.compile(r"^Invalid enum value (?P<value>.+)$")


def _types(spec: str) -> str:
    names = [_TYPES.get(t.strip(), t.strip()) for t in spec.split("|")]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _number(value: str) -> str:
    return value[:-2] if value.endswith(".0") else value


def _join(path: str | None, name: str) -> str:
    return f"{path}.{name}" if path else name


def explain(message: str) -> tuple[str, str | None]:
    """(our sentence, the field's path or None for the body) for a msgspec ValidationError."""
    at = _AT.search(message)
    path = at["path"].lstrip(".").replace("[...]", "") if at else None
    path = path or None
    what = message[: at.start()] if at else message
    field = path or "the body"
    if m := _GOT.match(what):
        return f"{field} must be {_types(m['want'])}, not {_types(m['got'])}", path
    if m := _LENGTH.match(what):
        unit = _UNITS.get(m["type"], "items")
        return f"{field} must have {_BOUNDS[m['op']]} {m['value']} {unit}", path
    if m := _BOUND.match(what):
        return f"{field} must be {_BOUNDS[m['op']]} {_number(m['value'])}", path
    if m := _MISSING.match(what):
        name = _join(path, m["name"])
        return f"{name} is required", name
    if m := _UNKNOWN.match(what):
        name = _join(path, m["name"])
        return f"{name} is not a field of this object", name
    if m := _ENUM.match(what):
        last = (path or "").rsplit(".", 1)[-1]
        allowed = _ENUMS.get(last)
        tail = f" (it may be {allowed})" if allowed else ""
        return f"{field} may not be {m['value']}{tail}", path
    return f"{field} has a value we cannot accept", path


def decode_json(body: bytes, kind: type[T]) -> T:
    """A request body decoded into `kind`. JSON Schema counts a number with a zero fraction
    (`3.0`) as an integer, and so do we: where the strict decode fails, integral floats are
    taken as integers and the body is converted again (its error, if any, is the one raised).
    """
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError:
        return msgspec.convert(_integral(msgspec.json.decode(body)), kind)


def _integral(value: Any) -> Any:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    return value
