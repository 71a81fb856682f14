"""The CLI answers at once: starting ``paramserver`` loads no heavy library until a command
that needs one runs (issue 30 item 6). Checked by what a fresh process holds in
sys.modules, not by timing it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from paramserver.cli.main import COMMANDS, LazyCommands, LazyGroup, main

HEAVY = ("torch", "numpy", "zmq", "matplotlib", "rich", "sklearn", "safetensors", "msgpack",
         "prometheus_client")


def _loaded_after(code: str, cwd: Path) -> list[str]:
    """The HEAVY modules a fresh interpreter holds after running ``code``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} " \
             "if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, text=True,
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _help(*args: str) -> str:
    """Run ``paramserver ARGS --help`` in-process as the console script would."""
    return ("import contextlib, io\nfrom paramserver.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    main([*{list(args)!r}, '--help'], prog_name='paramserver', "
            "standalone_mode=False)")


def test_importing_the_cli_loads_no_heavy_library(tmp_path):
    assert _loaded_after("import paramserver.cli.main", tmp_path) == []


def test_top_level_help_loads_no_heavy_library(tmp_path):
    assert _loaded_after(_help(), tmp_path) == []


@pytest.mark.parametrize("args", [("checkpoint",), ("checkpoint", "inspect"), ("keys",),
                                  ("keys", "generate"), ("bench",), ("policies",), ("tasks",)],
                         ids=" ".join)
def test_help_of_commands_that_need_no_config_class_is_light(tmp_path, args):
    assert _loaded_after(_help(*args), tmp_path) == []


def test_each_listed_line_is_the_commands_own_short_help():
    """``--help`` lists a command from COMMANDS without importing it: the line must be the
    command's own short help, so that the listing reads the same once it is imported."""
    for name, (module, summary) in COMMANDS.items():
        command = main.commands[name]
        assert command.name == name and command.callback is not None
        assert command.callback.__module__ == module, name
        assert command.short_help == summary, name


def test_every_command_module_is_in_the_table():
    """A command a module names in __all__ is listed, by its module."""
    for module in {m for m, _ in COMMANDS.values()}:
        names = {c.name for c in (getattr(__import__(module, fromlist=["_"]), a)
                                  for a in __import__(module, fromlist=["_"]).__all__)
                 if isinstance(c, click.Command)}
        assert names == {n for n, (m, _) in COMMANDS.items() if m == module}, module


def test_a_command_is_imported_when_looked_up_and_a_missing_module_is_skipped(tmp_path,
                                                                             monkeypatch):
    (tmp_path / "ps_lazy_cmds.py").write_text(
        "import click\n__all__ = ['hello']\n\n"
        "@click.command('hello')\ndef hello():\n    'Say hi.'\n    click.echo('hi')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    group = LazyGroup("g", lazy={"hello": ("ps_lazy_cmds", "Say hi."),
                                 "later": ("ps_not_written_yet", "Not yet.")})
    assert list(group.commands) == ["hello"]
    assert "ps_lazy_cmds" not in sys.modules
    runner = CliRunner()
    listing = runner.invoke(group, ["--help"]).output
    assert "hello  Say hi." in listing and "later" not in listing
    assert "ps_lazy_cmds" not in sys.modules
    assert runner.invoke(group, ["hello"]).output == "hi\n"
    assert "ps_lazy_cmds" in sys.modules
    assert isinstance(group.commands, LazyCommands) and group.commands.summary("hello") is None
    assert runner.invoke(group, ["later"]).exit_code == 2  # no such command


def test_listing_names_the_entry_point_groups_of_the_registries():
    from paramserver.cli import listing
    from paramserver.policies import ENTRY_POINT_GROUP as policy_group
    from paramserver.workers.tasks import ENTRY_POINT_GROUP as task_group

    assert (policy_group, task_group) == (listing.POLICY_GROUP, listing.TASK_GROUP)


@pytest.mark.parametrize("command", ["launch", "experiment", "simulate"])
def test_help_of_commands_that_draw_loads_no_drawing_library(tmp_path, command):
    """Their options come from the config classes (whose modules still load torch), but the
    progress bars, tables and plots load only when the command runs."""
    loaded = _loaded_after(_help(command), tmp_path)
    assert not {"rich", "matplotlib", "sklearn"} & set(loaded), loaded


# issue 30 item 6: these commands' options come from config dataclasses (ServerConfig,
# WorkerConfig, ClusterSpec, StragglerSpec) declared in light modules; the server loop,
# the training loop, the launcher, the rendezvous and the experiment runner load only
# when the command runs.
@pytest.mark.parametrize("command", ["server", "worker", "launch", "run", "experiment",
                                     "simulate", "status"])
def test_help_of_commands_that_need_a_config_class_loads_no_torch(tmp_path, command):
    loaded = _loaded_after(_help(command), tmp_path)
    assert not {"torch", "safetensors", "matplotlib"} & set(loaded), loaded


@pytest.mark.parametrize("module", ["paramserver.server.config", "paramserver.workers.config",
                                    "paramserver.workers.stragglerspec",
                                    "paramserver.workers.launch.clusterspec",
                                    "paramserver.cli.options", "paramserver.cli.grid"])
def test_the_config_modules_load_no_heavy_library(tmp_path, module):
    assert _loaded_after(f"import {module}", tmp_path) == []


def test_the_names_the_light_modules_list_are_the_registries_own():
    """--preset, --scenario and --wire-dtype offer names kept beside the flags, so that
    declaring them loads no torch: they must be the names of the real tables."""
    from paramserver.cli.grid import PRESET_NAMES, SCENARIO_NAMES
    from paramserver.util.dtypes import GRAD_WIRE_DTYPES
    from paramserver.workers.client import PART_BYTES
    from paramserver.workers.config import GRAD_WIRE_DTYPE_NAMES, WorkerConfig
    from paramserver.workers.experiments.spec import PRESETS, SCENARIOS

    assert tuple(sorted(PRESETS)) == PRESET_NAMES
    assert tuple(SCENARIOS) == SCENARIO_NAMES
    assert tuple(GRAD_WIRE_DTYPES) == GRAD_WIRE_DTYPE_NAMES
    assert WorkerConfig(servers=["127.0.0.1:1"]).part_bytes == PART_BYTES
