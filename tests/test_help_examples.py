"""Every ``Examples:`` command in a ``--help`` parses: its options exist (issue 15:
``server --help`` showed ``--bind``, which ``server`` does not have)."""

from __future__ import annotations

import shlex
import warnings
from pathlib import Path

import click
import pytest

from paramserver.cli.main import main


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = []
    for name, cmd in group.commands.items():
        found.append((*prefix, name))
        if isinstance(cmd, click.Group):
            found += _commands(cmd, (*prefix, name))
    return found


def _examples(text: str) -> list[list[str]]:
    """The ``paramserver ...`` command lines of an epilog, continuations joined."""
    lines, out, current = text.replace("\b", "").split("\n"), [], ""
    for raw in lines:
        line = raw.strip()
        if current:
            current += " " + line.rstrip("\\").strip()
        elif line.startswith("paramserver "):
            current = line.rstrip("\\").strip()
        else:
            continue
        if not line.endswith("\\"):
            words = shlex.split(current.split(" -- ", 1)[0], comments=True)
            for stop in ("|", ">", "&&", "&"):  # the shell's part of the line
                if stop in words:
                    words = words[:words.index(stop)]
            out.append(words[1:])
            current = ""
    return out


def _parse(args: list[str]) -> None:
    """Parse ``args`` the way ``paramserver`` would, without running the command."""
    warnings.simplefilter("ignore", DeprecationWarning)  # click 8.2: protected_args
    ctx = main.make_context("paramserver", list(args), resilient_parsing=False)
    cmd: click.Command = main
    rest = ctx.protected_args + ctx.args
    while isinstance(cmd, click.Group) and rest:
        _, sub, rest = cmd.resolve_command(ctx, rest)
        assert sub is not None
        cmd, ctx = sub, sub.make_context(sub.name or "", rest, parent=ctx)
        rest = ctx.protected_args + ctx.args if isinstance(sub, click.Group) else []


COMMANDS = _commands(main)


@pytest.mark.parametrize("path", COMMANDS, ids=[" ".join(p) for p in COMMANDS])
def test_help_examples_parse(path: tuple[str, ...], tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text("")  # the --config file the examples name
    cmd: click.Command = main
    for name in path:
        assert isinstance(cmd, click.Group)
        cmd = cmd.commands[name]
    for args in _examples(cmd.epilog or ""):
        try:
            _parse(args)
        except click.UsageError as exc:
            pytest.fail(f"paramserver {' '.join(path)} --help example "
                        f"`paramserver {shlex.join(args)}`: {exc.format_message()}")
