"""The one string-to-value coercer: a ``KEY=VALUE`` text becomes what an annotation says.

Every place that turns text from a flag, an environment variable or a config
file into a typed value goes through :func:`coerce`: the policies' arguments
(``--policy-arg``), the tasks' (``--task-arg``), the optimizers' and
schedulers' (``--optimizer-arg``, ``--scheduler-arg``), the watchdog's
(``--watchdog-arg``) and the config dataclasses' fields. So ``on``, ``yes``,
``true`` and ``1`` mean the same everywhere a bool is expected.

The target type comes from an annotation (a type, ``X | None``,
``Optional[X]``, ``list[X]``, ``tuple[X, ...]``, or the text of one under
``from __future__ import annotations``), else from the default's type; with
neither, :func:`guess` types the text the way ``parse_kwargs`` always has.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from paramserver.errors import ConfigError

__all__ = ["FALSE", "MISSING", "TRUE", "coerce", "guess", "parse_bool", "parse_kwargs",
           "parse_policy_args", "parse_task_args", "target_type"]

TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off"})
NONE = frozenset({"none", "null"})
MISSING: Any = inspect.Parameter.empty

_SCALARS: dict[str, type] = {"int": int, "float": float, "bool": bool, "str": str}
_INT = re.compile(r"[+-]?\d+")


def parse_bool(text: str) -> bool:
    """``true/false``, ``yes/no``, ``on/off``, ``1/0`` (any case) -> bool; else ValueError."""
    low = text.strip().lower()
    if low in TRUE:
        return True
    if low in FALSE:
        return False
    raise ValueError(f"{text!r} is not a bool (true/false, yes/no, on/off, 1/0)")


def _number(text: str) -> int | float | None:
    text = text.strip()
    if _INT.fullmatch(text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return None


def guess(text: str) -> Any:
    """Type a value nothing declares: int, float, bool (true/false), None (none/null), a
    tuple of numbers (comma list; ``"10,"`` is a one-element tuple), else the string."""
    s = text.strip()
    low = s.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in NONE:
        return None
    if "," in s:
        parts = s.split(",")
        if parts and parts[-1].strip() == "":  # "10," is a one-element tuple
            parts = parts[:-1]
        numbers = [_number(p) for p in parts]
        if parts and all(n is not None for n in numbers):
            return tuple(numbers)
        return s
    number = _number(s)
    return s if number is None else number


def _from_text(annotation: str) -> Any:
    """``"int"``, ``"float | None"``, ``"Optional[bool]"``, ``"list[int]"`` -> a type form."""
    text = annotation.strip()
    if text.startswith("Optional[") and text.endswith("]"):
        return _from_text(text[len("Optional["):-1] + " | None")
    parts = [p.strip() for p in _split_top(text, "|")]
    if len(parts) > 1:
        members = [_from_text(p) for p in parts]
        return typing.Union[tuple(members)]  # noqa: UP007 - built at run time
    if text == "None":
        return type(None)
    for seq in ("list", "tuple", "List", "Tuple", "Sequence"):
        if text.startswith(seq + "[") and text.endswith("]"):
            inner = _split_top(text[len(seq) + 1:-1], ",")[0].strip()
            origin = tuple if seq.lower() == "tuple" else list
            return origin[_from_text(inner)]
    return _SCALARS.get(text, Any)


def _split_top(text: str, sep: str) -> list[str]:
    """Split at ``sep`` outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == sep and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [*out, cur]


def target_type(annotation: Any, default: Any = MISSING) -> Any:
    """The type form a text value becomes: the annotation, else the default's scalar type,
    else ``Any`` (guess)."""
    if isinstance(annotation, str):
        annotation = _from_text(annotation)
    if annotation is MISSING or annotation is Any or annotation is None:
        if default is not MISSING and default is not None and type(default) in _SCALARS.values():
            return type(default)
        return Any
    return annotation


def _members(form: Any) -> list[Any]:
    origin = typing.get_origin(form)
    if origin is typing.Union or origin is types.UnionType:
        return list(typing.get_args(form))
    return [form]


def _convert(text: str, form: Any, untyped: Callable[[str], Any] = guess) -> Any:
    """One text -> the type form; ValueError names the kind it is not."""
    members = _members(form)
    optional = type(None) in members
    members = [m for m in members if m is not type(None)]
    if optional and text.strip().lower() in NONE:
        return None
    usable = [m for m in members if m in _SCALARS.values()
              or typing.get_origin(m) in (list, tuple) or m in (list, tuple) or m is Any]
    if not usable:  # only types text cannot become (a Tensor, a class): leave it to guess
        return untyped(text)
    errors = []
    # a union tries its members narrowest first (bool before int before float before str)
    order = {bool: 0, int: 1, float: 2}
    for member in sorted(usable, key=lambda m: order.get(m, 3)):
        try:
            return _one(text, member, untyped)
        except ValueError as exc:
            errors.append(exc)
    raise errors[0] if len(errors) == 1 else ValueError(
        f"{text!r} is not a valid {' or '.join(_kind(m) for m in usable)}")


def _kind(form: Any) -> str:
    return getattr(form, "__name__", None) or str(form)


def _one(text: str, form: Any, untyped: Callable[[str], Any] = guess) -> Any:
    if form is Any:
        return untyped(text)
    if form is bool:
        return parse_bool(text)
    if form is str:
        return text
    origin = typing.get_origin(form) or (form if form in (list, tuple) else None)
    if origin in (list, tuple):
        args = [a for a in typing.get_args(form) if a is not Ellipsis]
        inner = args[0] if args else Any
        parts = [p for p in text.split(",")]
        if parts and parts[-1].strip() == "":
            parts = parts[:-1]
        items = [_convert(p.strip(), inner) for p in parts]
        return tuple(items) if origin is tuple else items
    try:
        if form is int:
            if not _INT.fullmatch(text.strip()):
                raise ValueError
            return int(text.strip())
        return form(text.strip())
    except ValueError:
        if form is float:
            raise ValueError(f"must be a number, not {text!r}") from None
        raise ValueError(f"{text!r} is not a valid {_kind(form)}") from None


def coerce(value: Any, annotation: Any = MISSING, default: Any = MISSING, *,
           what: str = "value", untyped: Callable[[str], Any] = guess) -> Any:
    """Turn a text ``value`` into what ``annotation`` (else ``default``'s type) says.

    Values that are not strings pass unchanged (a TOML file or Python caller typed
    them already). A text that does not fit raises :class:`ConfigError`, naming
    ``what`` (e.g. ``"policy argument max_staleness"``). A text nothing declares a
    type for goes to ``untyped`` (:func:`guess`, or ``str`` to keep it as it is).
    """
    if not isinstance(value, str):
        return value
    try:
        return _convert(value, target_type(annotation, default), untyped)
    except ValueError as exc:
        # "momentum must be a number, not 'abc'"; else "argument x: 'abc' is not a valid int"
        sep = " " if str(exc).startswith("must ") else ": "
        raise ConfigError(f"{what}{sep}{exc}") from None


# The key=value parsers of the flags live here, not beside what they configure (torch's
# optimizers, the policies), so that declaring a flag loads neither.


def parse_kwargs(items: Sequence[str]) -> dict[str, Any]:
    """``["lr=0.1", "nesterov=true", "betas=0.9,0.999"]`` -> typed keyword arguments.

    Values become int, float, bool (true/false), None (none/null), a tuple of
    numbers (comma list; ``"10,"`` is a one-element tuple), else stay str.
    """
    if isinstance(items, str):
        raise ConfigError(f"expected a list of key=value strings, got the string {items!r}")
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ConfigError(f"argument {item!r} must look like key=value (e.g. lr=0.1)")
        if key in out:
            raise ConfigError(f"argument {key!r} is given twice")
        out[key] = guess(value)
    return out


def parse_policy_args(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """Parse ``key=value`` strings into a dict (values stay strings)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"policy argument {item!r} must look like key=value")
        out[key.strip()] = value.strip()
    return out


def parse_task_args(items: list[str]) -> dict[str, str]:
    """``key=value`` -> {key: "value"}; the task converts by its factory's annotations."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ConfigError(f"task argument {item!r} must look like key=value (e.g. hidden=128)")
        out[key.strip()] = value.strip()
    return out
