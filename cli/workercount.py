"""The number of workers is one number, with three names: ``--world-size`` of a worker,
``--expected-workers`` of a server and ``--num-workers`` of ``launch`` (``run`` takes it
from the job's ranks). A config file shared by the commands may give any of them, in
any table; each command takes its own value from the others where it has none, and a
value given two ways, differently, is one usage error (exit 2) before anything starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import click
from click.core import ParameterSource

__all__ = ["COUNT_KEYS", "agree_worker_count", "check_job_workers", "file_worker_counts"]

#: the config-file keys (normalised) that give the number of workers
COUNT_KEYS = ("num_workers", "world_size", "expected_workers")
#: ctx.meta key: [(where, value)] of the counts the --config file gives
_META = "paramserver.worker_counts"

_FLAGS = {"num_workers": "--num-workers", "world_size": "--world-size",
          "expected_workers": "--expected-workers"}


def file_worker_counts(ctx: click.Context, data: Mapping[str, Any], source: str) -> None:
    """Note every worker count in the TOML ``data`` (top level and every table) on the
    context, for :func:`agree_worker_count`; refuse one that is not a count."""
    found: list[tuple[str, str, int]] = []  # (key, where in words, value)
    tables = [("", data)] + [(f" [{k}]", v) for k, v in data.items() if isinstance(v, Mapping)]
    for where, table in tables:
        for raw, value in table.items():
            key = raw.strip().lower().replace("-", "_")
            if key not in COUNT_KEYS:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise click.BadParameter(f"{source}{where}: {raw} = {value!r} is not a number "
                                         "of workers (an integer >= 1)", ctx=ctx,
                                         param_hint="--config")
            found.append((key, f"{raw} = {value} in {source}{where}", value))
    ctx.meta[_META] = found


def _given(ctx: click.Context, name: str, value: int) -> str | None:
    """How the command's own option was given, in words; None: its default, or the config
    file (whose keys :func:`file_worker_counts` has noted already)."""
    source = ctx.get_parameter_source(name)
    if source is ParameterSource.COMMANDLINE:
        return f"{_FLAGS[name]} {value}"
    if source is ParameterSource.ENVIRONMENT:
        return f"PARAMSERVER_{name.upper()}={value}"
    return None


def _disagree(found: list[tuple[str, str, int]]) -> None:
    if len({value for _, _, value in found}) > 1:
        raise click.UsageError(
            f"the number of workers is given differently: "
            f"{'; '.join(w for _, w, _ in found)}. "
            "--world-size, --expected-workers and --num-workers are one number: give it once")


def agree_worker_count(ctx: click.Context, opts: dict[str, Any], name: str) -> int:
    """The command's option ``name`` (num_workers, world_size or expected_workers), from
    its flag or environment variable, else from any worker count in the config file,
    else its default; two of those that differ are a usage error. (The file's value of
    ``name`` itself yields to its flag and variable, as every option's does.)"""
    found = list(ctx.meta.get(_META, []))
    given = _given(ctx, name, opts[name])
    if given:
        found = [(name, given, opts[name]), *(f for f in found if f[0] != name)]
    _disagree(found)
    if found and found[0][2] != opts[name]:
        opts[name] = ctx.params[name] = found[0][2]
        ctx.set_parameter_source(name, ParameterSource.DEFAULT_MAP)  # for --print-config
    return int(opts[name])


def check_job_workers(ctx: click.Context, workers: int, how: str) -> None:
    """``run``: the job's worker ranks (``how``: where that number comes from) against
    the counts in the config file."""
    _disagree([*ctx.meta.get(_META, []), ("", how, workers)])
