"""``paramserver policies``, ``tasks`` and ``compressors``: what can be named on the
command line."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from paramserver.errors import RegistryError
from paramserver.util.jsontypes import JSON, JSONObject

# heavy libraries (rich, torch, ...) are imported where a command runs, so that its
# --help answers at once (tests/test_cli_startup.py)

#: the entry-point groups listed here by name (paramserver.policies.ENTRY_POINT_GROUP and
#: paramserver.workers.tasks.ENTRY_POINT_GROUP, which a test keeps equal): named, not
#: imported, as those modules load torch
POLICY_GROUP = "paramserver.staleness_policies"
TASK_GROUP = "paramserver.tasks"
COMPRESSOR_GROUP = "paramserver.compressors"

__all__ = ["compressors", "policies", "tasks"]

_BUILTIN = ("paramserver.",)


def _annotation(annotation: Any) -> str:
    if annotation is inspect.Parameter.empty:
        return ""
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__",
                                                                   str(annotation))


def _param_text(name: str, annotation: Any, default: Any) -> str:
    kind = _annotation(annotation)
    text = f"{name}: {kind}" if kind else name
    return text + ("" if default is inspect.Parameter.empty else f" = {default!r}")


def _source(obj: Any) -> str:
    module = getattr(obj, "__module__", "") or ""
    return "built-in" if module.startswith(_BUILTIN) else module


def _first_line(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.splitlines()[0] if doc else ""


def _jsonable(value: object) -> JSON:
    """A parameter's default as ``json.dumps(..., default=repr)`` writes it."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _jsonable(v) for k, v in value.items()}
    return repr(value)


@dataclass(frozen=True)
class Listed:
    """One policy or task: its name, parameters, where it comes from, what it does."""

    name: str
    parameters: Mapping[str, inspect.Parameter]
    source: str  # "built-in" or the module
    description: str

    def to_json(self) -> JSONObject:
        params: JSONObject = {}
        for key, p in self.parameters.items():
            entry: JSONObject = {"type": _annotation(p.annotation)}
            if p.default is not p.empty:
                entry["default"] = _jsonable(p.default)
            params[key] = entry
        return {"name": self.name, "parameters": params, "from": self.source,
                "description": self.description}


def _print(rows: list[Listed], title: str, footer: str, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps([r.to_json() for r in rows], indent=2))
        return
    from rich.table import Table
    from rich.text import Text

    from paramserver.cli.progress import cli_console

    table = Table(title=title, show_lines=False)
    for column in ("name", "parameters", "from", "description"):
        table.add_column(column, overflow="fold")
    for row in rows:
        params = "\n".join(_param_text(k, p.annotation, p.default)
                           for k, p in row.parameters.items()) or "-"
        # text, not rich markup: "[s_min, s_max]" in a description would vanish as a tag
        table.add_row(*(Text(str(cell)) for cell in
                        (row.name, params, row.source, row.description)))
    console = cli_console()
    console.print(table)
    console.print(footer, highlight=False)


T = TypeVar("T")


def _resolve_all(names: tuple[str, ...], known: Mapping[str, T], resolve: Callable[[str], T]
                 ) -> dict[str, T]:
    if not names:
        return dict(known)
    try:
        return {name: resolve(name) for name in names}
    except RegistryError as exc:
        raise click.UsageError(str(exc)) from exc


@click.command("policies", short_help="Staleness policies and their parameters.", epilog=f"""\b
Examples:
  paramserver policies
  paramserver policies reject mypkg.policies:MyPolicy --json
  paramserver launch --policy reject --policy-arg max_staleness=4

\b
A policy of your own: subclass paramserver.policies.StalenessPolicy and name
it as module:Class, or register it as an entry point in the group
{POLICY_GROUP} to list it here by name.""")
@click.argument("names", nargs=-1, metavar="[NAME|module:Class]...")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def policies(names: tuple[str, ...], as_json: bool) -> None:
    """List the staleness policies (built-in and installed) and their parameters."""
    from paramserver.policies import available_policies, policy_parameters, resolve_policy

    classes = _resolve_all(names, available_policies(), resolve_policy)
    rows = []
    for name, cls in classes.items():
        params = policy_parameters(cls)
        rows.append(Listed(name, params, _source(cls), _first_line(cls)))
    _print(rows, "staleness policies", "Use: --policy NAME --policy-arg KEY=VALUE", as_json)


@click.command("compressors", short_help="Gradient compressors and their parameters.",
               epilog=f"""\b
Examples:
  paramserver compressors
  paramserver compressors topk sign --json
  paramserver launch --compression topk:ratio=0.01
  paramserver launch --compression sign:ef=0

\b
Every compressor takes ef (error feedback: what a push leaves out is added to
the next), on by default for the biased ones. One of your own: subclass
paramserver.compress.Compressor (it writes one of the wire formats of
paramserver.compress.formats, which the shards decode) and name it as
module:Class, or register it as an entry point in the group
{COMPRESSOR_GROUP} to list it here by name.""")
@click.argument("names", nargs=-1, metavar="[NAME|module:Class]...")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def compressors(names: tuple[str, ...], as_json: bool) -> None:
    """List the gradient compressors (built-in and installed) and their parameters."""
    from paramserver.compress import (
        available_compressors,
        compressor_parameters,
        resolve_compressor,
    )

    classes = _resolve_all(names, available_compressors(), resolve_compressor)
    rows = [Listed(name, compressor_parameters(cls), _source(cls), _first_line(cls))
            for name, cls in classes.items()]
    _print(rows, "gradient compressors", "Use: --compression NAME[:key=value,...]", as_json)


@click.command("tasks", short_help="Tasks and their parameters.", epilog=f"""\b
Examples:
  paramserver tasks
  paramserver tasks digits-mlp tests.tasks_fixture:make_task --json
  paramserver launch --task synthetic-mlp --task-arg params_mb=16

\b
A task of your own: a factory called as f(rank=..., world_size=..., **args)
returning model, batches and loss_fn (see workers/tasks.py); name it as
module:function, or register it as an entry point in the group {TASK_GROUP}
to list it here by name.""")
@click.argument("names", nargs=-1, metavar="[NAME|module:function]...")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def tasks(names: tuple[str, ...], as_json: bool) -> None:
    """List the tasks (built-in and installed) and their parameters."""
    from paramserver.workers.tasks import (
        available_tasks,
        resolve_task,
        task_description,
        task_parameters,
    )

    factories = _resolve_all(names, available_tasks(), resolve_task)
    rows = []
    for name, factory in factories.items():
        sig = inspect.signature(factory)
        params = {k: sig.parameters[k] for k in task_parameters(factory) if k in sig.parameters}
        rows.append(Listed(name, params, _source(factory), task_description(name)))
    _print(rows, "tasks", "Use: --task NAME --task-arg KEY=VALUE (rank and world_size are "
           "given by the launcher)", as_json)

