"""``--print-config``: a command's resolved options as TOML, each with where its value came from.

The options themselves, their groups and the precedence of flags, environment
and config file are declared in options.py; this module only renders what click
resolved, in the format a ``--config`` file reads back (so a printed
configuration round-trips). It is apart because it is one output, written with
tomli-w, that no other part of the option machinery needs; options.py re-exports
its two functions, the names the commands call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import click
import tomli_w
from click.core import ParameterSource

from .paramtypes import AddressList, KeyValue, flatten_addresses

#: options of the command line only: --print-config leaves them out
_COMMAND_LINE_ONLY = ("print_config", "help", "overwrite")

_SOURCES = {
    ParameterSource.COMMANDLINE: "flag",
    ParameterSource.ENVIRONMENT: "env",
    ParameterSource.DEFAULT_MAP: "config file",
    ParameterSource.DEFAULT: "default",
}


def _toml_line(key: str, value: Any, source: str) -> list[str]:
    """``key = value`` as tomli-w writes it, the value's source as a comment on its first
    line (a table, which tomli-w writes as a section, gets it on its header)."""
    text = tomli_w.dumps({key: value}).rstrip("\n").split("\n")
    return [text[0].ljust(40) + f"  # {source}", *text[1:]]


def render_config(ctx: click.Context) -> str:
    """The command's resolved options as TOML (tomli-w), each with where its value came
    from; ``KEY=VALUE`` options given as tables come last, as TOML sections."""
    lines = [f"# paramserver {ctx.command.name}: resolved configuration",
             "# precedence: flags > PARAMSERVER_<OPTION> > --config file > defaults"]
    tables: list[str] = []
    for param in ctx.command.params:
        if not isinstance(param, click.Option) or param.name in _COMMAND_LINE_ONLY \
                or not param.expose_value or param.name is None or param.hidden:
            continue
        key = next(o for o in param.opts if o.startswith("--"))[2:]
        value = ctx.params.get(param.name)
        source = _SOURCES.get(ctx.get_parameter_source(param.name), "default")  # type: ignore[arg-type]
        if source == "env" and param.envvar:
            source = f"env {param.envvar}"
        if isinstance(param.type, KeyValue):
            value = param.type.render(value or ())
        elif isinstance(param.type, AddressList):
            value = flatten_addresses(value or ())
        elif param.multiple:
            value = list(value or ())
        if value is None:
            lines.append(f"# {key} = (not set)".ljust(40) + f"  # {source}")
        elif isinstance(value, Mapping):
            tables += ["", *_toml_line(key, dict(value), source)]
        else:
            lines += _toml_line(key, value, source)
    return "\n".join([*lines, *tables]) + "\n"


def maybe_print_config(ctx: click.Context, opts: Mapping[str, Any]) -> None:
    """Handle ``--print-config``: print and exit."""
    if opts.get("print_config"):
        click.echo(render_config(ctx), nl=False)
        ctx.exit(0)
