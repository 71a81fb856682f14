"""The compressors by name: the built-ins, installed entry points (group
``paramserver.compressors``), :func:`register_compressor` and ``module:Class``; and
:func:`parse_compression`, which reads a ``--compression NAME[:key=value,...]`` spec.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from paramserver.compress.base import Compressor
from paramserver.compress.builtins import BUILTINS, NoCompression
from paramserver.errors import ConfigError, ParamServerError, RegistryError
from paramserver.util.coerce import MISSING, coerce
from paramserver.util.plugins import Registry, register_subclass, subclass_check

__all__ = [
    "COMPRESSORS",
    "ENTRY_POINT_GROUP",
    "Compression",
    "available_compressors",
    "compressor_parameters",
    "parse_compression",
    "register_compressor",
    "resolve_compressor",
    "with_wire_dtype",
]

ENTRY_POINT_GROUP = "paramserver.compressors"

_REGISTRY: dict[str, type[Compressor]] = {}


#: the compressors by name (built-ins, installed entry points, register_compressor)
COMPRESSORS: Registry[type[Compressor]] = Registry(
    "compressor", group=ENTRY_POINT_GROUP, check=subclass_check(Compressor),
    hint="or give module:Class", store=lambda: _REGISTRY)


def register_compressor(cls: type[Compressor]) -> type[Compressor]:
    """Register a compressor class under ``cls.name``; refuses duplicates. A decorator too."""
    return register_subclass(COMPRESSORS, Compressor, cls)


for _builtin in BUILTINS:
    register_compressor(_builtin)


def available_compressors() -> dict[str, type[Compressor]]:
    """Built-in and installed compressors by name."""
    return COMPRESSORS.available()


def resolve_compressor(name: str) -> type[Compressor]:
    """A compressor class by registered name or ``module:Class``."""
    return COMPRESSORS.resolve(name)


def compressor_parameters(cls: type[Compressor]) -> dict[str, inspect.Parameter]:
    """The constructor parameters of a compressor class, and ``ef`` (every one's)."""
    sig = inspect.signature(cls.__init__)
    params = {k: p for k, p in sig.parameters.items() if k != "self"
              and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    ef = inspect.Parameter("ef", inspect.Parameter.KEYWORD_ONLY, default=cls.biased,
                           annotation="bool")
    return {**params, "ef": ef}


_BOOLS = {"1": True, "true": True, "on": True, "yes": True,
          "0": False, "false": False, "off": False, "no": False}


@dataclass(frozen=True)
class Compression:
    """A parsed ``--compression``: the compressor, and whether error feedback is on."""

    compressor: Compressor
    ef: bool

    @property
    def wire_dtype(self) -> str | None:
        """The 16-bit dtype the push narrows to instead of encoding (bf16/fp16, no ef)."""
        return None if self.ef else type(self.compressor).wire_dtype

    @property
    def encodes(self) -> bool:
        """Whether the push goes through the encoder (not as it is, nor only narrowed)."""
        return not isinstance(self.compressor, NoCompression) and self.wire_dtype is None


def _split(spec: str) -> tuple[str, str]:
    """``NAME[:args]`` -> (NAME, args); NAME may be ``module:Class`` (no ``=`` in it)."""
    head, sep, tail = spec.rpartition(":")
    if sep and ("=" in tail or not tail.strip()):
        return head.strip(), tail
    return spec.strip(), ""


def compressor_name(spec: str) -> str:
    """The compressor a ``NAME[:key=value,...]`` spec names."""
    return _split(spec)[0]


def parse_compression(spec: str) -> Compression:
    """``NAME[:key=value,...]`` -> :class:`Compression`; ConfigError/RegistryError in one
    line for an unknown name, key or value."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"compression must look like NAME[:key=value,...], got {spec!r}")
    name, text = _split(spec)
    cls = resolve_compressor(name)
    params = compressor_parameters(cls)
    kwargs: dict[str, Any] = {}
    ef = cls.biased
    for item in (i for i in text.split(",") if i.strip()):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not key:
            raise ConfigError(f"compression {spec!r}: {item.strip()!r} must look like key=value")
        if key not in params:
            raise ConfigError(f"compressor {name!r} has no parameter {key!r}; accepted: "
                              f"{', '.join(params)}")
        if key == "ef":
            if value.lower() not in _BOOLS:
                raise ConfigError(f"compression {spec!r}: ef must be 0 or 1, got {value!r}")
            ef = _BOOLS[value.lower()]
            continue
        p = params[key]
        kwargs[key] = coerce(value, p.annotation, p.default if p.default is not p.empty
                             else MISSING, what=f"compressor argument {key}")
    try:
        compressor = cls(**kwargs)
    except (ConfigError, RegistryError):
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"cannot create compressor {name!r} with {kwargs}: {exc}") from exc
    except ParamServerError:
        raise
    except Exception as exc:  # a user's __init__ may raise anything: one line
        raise ConfigError(f"compressor {name} failed to construct: "
                          f"{str(exc) or type(exc).__name__}") from exc
    return Compression(compressor, ef)


def with_wire_dtype(spec: str | None, wire_dtype: str | None
                    ) -> tuple[Compression | None, str | None]:
    """What a push does for ``--compression spec`` beside ``--wire-dtype``: (the
    compression to encode with, None where the push goes as it is or only narrowed; the
    16-bit dtype it narrows to). bf16/fp16 without error feedback are ``--wire-dtype``,
    to the byte; ``none`` changes nothing; the two given at odds are refused."""
    if spec is None:
        return None, wire_dtype
    compression = parse_compression(spec)
    dtype = compression.wire_dtype
    if dtype is not None and wire_dtype in (None, dtype):
        return None, dtype
    if wire_dtype is not None and (dtype is not None or compression.encodes):
        raise ConfigError(f"compression {spec!r} and wire_dtype {wire_dtype!r}: give one "
                          "(--wire-dtype bfloat16 is --compression bf16)")
    return (compression if compression.encodes else None), wire_dtype
