"""The CLI's own click parameter types: ``KEY=VALUE`` pairs and shard addresses (a
replicated shard's replicas joined by ``|``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import click

from paramserver.errors import ConfigError

__all__ = ["Address", "AddressList", "KeyValue", "ShardList", "flatten_addresses"]


class KeyValue(click.ParamType):
    """``KEY=VALUE`` -> ``(key, value)``, the value typed by the library's parser.

    With ``table`` a config file may give a TOML table instead; its pairs pass
    through with their TOML types. Without, it gives a list of strings.
    """

    name = "KEY=VALUE"

    def __init__(self, parse: Callable[[list[str]], Mapping[str, Any]],
                 table: bool = True) -> None:
        self.parse = parse
        self.table = table

    def render(self, pairs: Iterable[tuple[str, Any]]) -> Any:
        """The TOML form of the option's value (what --print-config shows)."""
        if self.table:
            return dict(pairs)
        return [f"{k}={v}" for k, v in pairs]

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if isinstance(value, tuple) and len(value) == 2:
            return value
        if not isinstance(value, str):
            self.fail(f"{value!r} is not KEY=VALUE", param, ctx)
        try:
            parsed = self.parse([value])
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)
        if len(parsed) != 1:
            self.fail(f"{value!r} is not KEY=VALUE", param, ctx)
        return next(iter(parsed.items()))


_ADDRESS = re.compile(r"^(?:tcp://)?(\[[0-9a-fA-F:]+\]|[^\s:/\[\]]+):(\d{1,5})$")


class Address(click.ParamType):
    """``HOST:PORT`` or ``tcp://HOST:PORT`` -> ``tcp://HOST:PORT``."""

    name = "HOST:PORT"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        text = str(value).strip()
        m = _ADDRESS.match(text)
        if m is None or not 1 <= int(m.group(2)) <= 65535:
            self.fail(f"{text!r} is not an address like HOST:PORT or tcp://HOST:PORT, e.g. "
                      "tcp://127.0.0.1:5600; ports are 1..65535", param, ctx)
        return f"tcp://{m.group(1)}:{int(m.group(2))}"


class AddressList(Address):
    """One or more comma-separated addresses -> a tuple of ``tcp://HOST:PORT``."""

    name = "HOST:PORT[,...]"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if isinstance(value, tuple):
            return value
        parts = [p for p in str(value).replace(",", " ").split() if p]
        if not parts:
            self.fail("give at least one server address", param, ctx)
        return tuple(super(AddressList, self).convert(p, param, ctx) for p in parts)


class ShardList(AddressList):
    """Comma-separated shards, each one address or its replicas' joined by ``|`` ->
    a tuple of ``tcp://HOST:PORT[|tcp://HOST:PORT...]``."""

    name = "HOST:PORT[|HOST:PORT][,...]"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if isinstance(value, tuple):
            return value
        entries = [e for e in str(value).replace(",", " ").split() if e]
        if not entries:
            self.fail("give at least one server address", param, ctx)
        return tuple("|".join(Address.convert(self, a, param, ctx) for a in e.split("|"))
                     for e in entries)


def flatten_addresses(value: Iterable[tuple[str, ...]]) -> list[str]:
    return [addr for group in value for addr in group]
