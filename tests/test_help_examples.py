"""Every command's ``--help`` has an ``Examples:`` section, and every example in it
parses: its options exist (issue 15: ``server --help`` showed ``--bind``, which
``server`` does not have). Help text shows what its source says: no RST double
backticks, and no ``[...]`` eaten as markup."""

from __future__ import annotations

import re
import shlex
import warnings
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from paramserver.cli.main import main
from paramserver.policies import available_policies


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = []
    for name, cmd in group.commands.items():
        found.append((*prefix, name))
        if isinstance(cmd, click.Group):
            found += _commands(cmd, (*prefix, name))
    return found


def _examples(text: str) -> list[list[str]]:
    """The ``paramserver ...`` command lines of an epilog, continuations joined; under
    ``torchrun``/``srun``, the ``paramserver run ...`` part."""
    lines, out, current = text.replace("\b", "").split("\n"), [], ""
    for raw in lines:
        line = raw.strip()
        if current:
            current += " " + line.rstrip("\\").strip()
        elif line.startswith(("paramserver ", "torchrun ", "srun ")):
            current = line.rstrip("\\").strip()
        else:
            continue
        if not line.endswith("\\"):
            launcher = re.search(r"\s(?:-m paramserver\.cli|paramserver) (run\s.*)$", current)
            if not current.startswith("paramserver ") and launcher:
                current = "paramserver " + launcher.group(1)
            elif not current.startswith("paramserver "):
                current = ""
                continue
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
    for name in ("run.toml", "grid.toml"):  # the --config and --spec files examples name
        (tmp_path / name).write_text("")
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


def _command(path: tuple[str, ...]) -> click.Command:
    cmd: click.Command = main
    for name in path:
        assert isinstance(cmd, click.Group)
        cmd = cmd.commands[name]
    return cmd


@pytest.mark.parametrize("path", COMMANDS, ids=[" ".join(p) for p in COMMANDS])
def test_every_command_has_examples(path: tuple[str, ...]) -> None:
    epilog = _command(path).epilog or ""
    assert "Examples:" in epilog, f"paramserver {' '.join(path)} --help has no Examples:"
    examples = _examples(epilog)
    assert examples, f"paramserver {' '.join(path)} --help: no paramserver command in Examples:"
    if len(path) == 1 or path[0] not in ("keys", "checkpoint"):
        # a command's own examples use it (a group's may show the subcommands)
        assert any(args[:len(path)] == list(path) for args in examples), examples


def _texts(cmd: click.Command) -> list[str]:
    texts = [cmd.help or "", cmd.epilog or ""]
    texts += [p.help or "" for p in cmd.params if isinstance(p, click.Option) and not p.hidden]
    return texts


def _flat(text: str) -> str:
    return " ".join(text.replace("\b", "").split())


@pytest.mark.parametrize("path", [(), *COMMANDS], ids=["paramserver",
                                                        *(" ".join(p) for p in COMMANDS)])
def test_help_shows_its_source_text(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(main, [*path, "--help"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    shown = _flat(result.output)
    assert "``" not in result.output, f"RST double backticks in {' '.join(path)} --help"
    brackets = [b for text in _texts(_command(path)) for b in re.findall(r"\[[^\]]+\]", text)]
    for bracket in brackets:
        assert _flat(bracket) in shown, f"{bracket!r} is missing from {' '.join(path)} --help"


def test_policy_listing_keeps_brackets() -> None:
    """``ssp-adaptive``'s "[s_min, s_max]" was lost to rich markup."""
    result = CliRunner(env={"COLUMNS": "400"}).invoke(main, ["policies"],
                                                      catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "[s_min, s_max]" in result.output
    for name, cls in available_policies().items():
        first = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        for bracket in re.findall(r"\[[^\]]+\]", first):
            assert bracket in result.output, (name, bracket)
