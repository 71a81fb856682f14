"""``paramserver checkpoint inspect DIR``, ``export DIR OUT`` and ``reshard DIR --to S --out DIR2``.

Only argument handling and display live here; the work is done by
:mod:`paramserver.persist.checkpoint`.
"""

from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path
from typing import Any

import click

from paramserver.errors import ParamServerError

# rich, torch and safetensors are imported where a command runs, so that --help answers at
# once (tests/test_cli_startup.py)

__all__ = ["checkpoint"]

log = logging.getLogger(__name__)

_SHOWN_WORKERS = 8  # clocks listed per shard; the rest are summarised


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "?"
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _when(created: float | None) -> str:
    if created is None:
        return "?"
    return datetime.datetime.fromtimestamp(created).strftime("%Y-%m-%d %H:%M:%S")


def _clocks(workers: dict[str, dict[str, Any]]) -> str:
    items = sorted(workers.items(), key=lambda kv: int(kv[0]))
    text = " ".join(f"w{w}={s['clock']}" for w, s in items[:_SHOWN_WORKERS])
    if len(items) > _SHOWN_WORKERS:
        rest = [s["clock"] for _, s in items[_SHOWN_WORKERS:]]
        text += f" (+{len(rest)}: {min(rest)}..{max(rest)})"
    return text or "-"


def _round(shard: dict[str, Any]) -> str:
    """A sync shard's closed rounds, and who is in its open round ("-": another mode)."""
    if shard.get("round") is None or not str(shard.get("mode", "")).startswith("sync"):
        return "-"
    members = shard.get("open_round") or []
    return f"{shard['round']}" + (f" +{members}" if members else "")


EPILOG = """\b
Examples:
  # a run that checkpoints every 50 versions
  paramserver launch -s 2 -n 3 --checkpoint-dir runs/ckpt --checkpoint-every 50
\b
  # what is there, and whether the shards form a whole model
  paramserver checkpoint inspect runs/ckpt
\b
  # one state_dict file of the latest complete checkpoint
  paramserver checkpoint export runs/ckpt model.safetensors
\b
  # go on training from it
  paramserver launch -s 2 -n 3 --resume runs/ckpt --steps 100
\b
  # the same run on 3 shards: weights, optimizer state, clocks all moved
  paramserver checkpoint reshard runs/ckpt --to 3 --out runs/ckpt3
  paramserver launch -s 3 -n 3 --resume runs/ckpt3 --steps 100
"""


@click.group(epilog=EPILOG, short_help="Look into checkpoints, reshard them, export a model.")
def checkpoint() -> None:
    """Look into checkpoints, reshard them to another shard count, export a model."""


@checkpoint.command(epilog="""\b
Examples:
  paramserver checkpoint inspect runs/ckpt
  paramserver checkpoint inspect runs/ckpt --json
""")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def inspect(directory: Path, as_json: bool) -> None:
    """Show each shard's latest checkpoint in DIRECTORY and whether they form a whole.

    A sync run's shards form a whole only at one round (ROUND: the rounds closed,
    +[workers] in the open one); where they differ, it names the round `--resume`
    takes, the newest all of them hold."""
    from rich.table import Table

    from paramserver.cli.progress import cli_console
    from paramserver.persist.checkpoint import inspect_checkpoint

    try:
        info = inspect_checkpoint(directory)
    except (ParamServerError, OSError, ValueError, KeyError) as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True))
        return
    console = cli_console()
    table = Table(title=f"checkpoint {directory}")
    for column in ("shard", "version", "mode", "round", "size", "created", "workers' clocks"):
        table.add_column(column, justify="right" if column in ("shard", "version", "size")
                         else "left")
    for s in info["shards"]:
        table.add_row(str(s["shard"]), str(s["version"]), str(s["mode"]), _round(s),
                      _size(s["bytes"]), _when(s["created"]), _clocks(s["workers"]))
    console.print(table)
    hashes = {s["plan_hash"] for s in info["shards"]}
    if info["complete"]:
        console.print(f"[green]complete[/]: {len(info['shards'])} shard(s), plan "
                      f"{next(iter(hashes)) or '?'}"[:120], highlight=False)
    else:
        why = []
        if info["missing_shards"]:
            why.append(f"no checkpoint for shard(s) {info['missing_shards']}")
        if len(hashes) > 1:
            why.append("shards come from different plans")
        if not info["consistent"]:  # a sync run's shards at different rounds
            why.append(info["note"])
        console.print(f"[red]incomplete[/]: {'; '.join(why)}", highlight=False)


@checkpoint.command(epilog="""\b
Examples:
  paramserver checkpoint export runs/ckpt model.safetensors
\b
Then, in Python:
  model.load_state_dict(safetensors.torch.load_file("model.safetensors"))
""")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
def export(directory: Path, out: Path) -> None:
    """Assemble every shard's weights in DIRECTORY into one state_dict file OUT.

    Load it with model.load_state_dict(safetensors.torch.load_file(OUT)).
    """
    from paramserver.cli.progress import cli_console
    from paramserver.persist.checkpoint import export_model

    try:
        result = export_model(directory, out)
    except (ParamServerError, OSError, ValueError, KeyError) as exc:
        raise click.ClickException(str(exc)) from exc
    cli_console().print(f"wrote {result['path']}: {result['parameters']} parameter tensors from "
                    f"shard versions {result['versions']}", highlight=False)


@checkpoint.command(epilog="""\b
Examples:
  # a run checkpointed on 2 shards, resumed on 3
  paramserver checkpoint reshard runs/ckpt --to 3 --out runs/ckpt3
  paramserver launch -s 3 -n 3 --resume runs/ckpt3 --steps 100
\b
`launch --resume DIR -s S` (and `run`, and a server started by hand) does the
same on the fly when S is not the checkpoint's shard count; with --checkpoint-dir
DIR the run then checkpoints into DIR.<S>shards, beside DIR.
""")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--to", "to", type=click.IntRange(min=1), required=True, metavar="S",
              help="The new number of shards.")
@click.option("--out", "out", type=click.Path(path_type=Path), required=True, metavar="DIR2",
              help="Where the resharded checkpoint goes: a new directory (refused if it "
                   "exists).")
def reshard(directory: Path, to: int, out: Path) -> None:
    """Move the checkpoint in DIRECTORY, written by S shards, to a plan on --to shards.

    Everything a shard keeps moves with its slices: the weights, the optimizer's
    state per element (momentum, Adam's moments, step counts), the open sync round,
    the sparse tables' rows with their optimizer state; and what every shard holds
    alike (version, round, clocks, push-id windows, scheduler, learning rate) is
    checked to agree. A run resumed from DIR2 ends bit-identical to the same run kept
    on S shards (sync). DIRECTORY is read as --resume reads it (a tampered file is
    refused) and is not changed; DIR2 appears only once all of it is written.
    Refused, in one line, for what cannot move: an optimizer whose step is not
    element by element, or shards that disagree (a push that reached one of them).
    """
    from paramserver.cli.progress import cli_console
    from paramserver.persist.reshard import reshard_checkpoint

    try:
        result = reshard_checkpoint(directory, to, out)
    except (ParamServerError, OSError, ValueError, KeyError) as exc:
        raise click.UsageError(str(exc)) from exc
    cli_console().print(
        f"resharded {directory} ({result['from']} shard(s), version {result['version']}) "
        f"to {result['path']} ({result['to']} shard(s), {_size(result['bytes'])}) in "
        f"{result['seconds']:.2f}s; resume it with --resume {result['path']} "
        f"--num-servers {result['to']}", highlight=False)
