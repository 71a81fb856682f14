"""The ``paramserver`` command: a click group whose commands live one module each.

The commands only build configs and call the library (paramserver/, workers/);
nothing here speaks ZeroMQ.

A command's module is imported only when that command runs (or its own ``--help``
is asked for): ``paramserver --help`` lists the commands from :data:`COMMANDS`
alone, so it answers without loading torch, ZeroMQ or rich
(tests/test_cli_startup.py checks both that and that each listed line is the
command's own short help).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator, Mapping, MutableMapping

import click

# The commands: name -> (module, short help). The module names the command in __all__;
# adding one line here registers it. The short help is what `paramserver --help` lists
# before the module is imported: the command's own short_help, which a test keeps equal.
# A module that does not exist is skipped, so a command still being written appears as
# soon as its file lands; a module that exists but fails to import is an error, never
# silently hidden.
COMMANDS: dict[str, tuple[str, str]] = {
    "server": ("paramserver.cli.server", "One shard server (holds a slice of the weights)."),
    "worker": ("paramserver.cli.worker", "One worker (pulls weights, pushes gradients)."),
    "launch": ("paramserver.cli.launch", "A whole cluster on this machine, start to finish."),
    "status": ("paramserver.cli.status", "Each shard's version, workers, clocks, counts."),
    "policies": ("paramserver.cli.listing", "Staleness policies and their parameters."),
    "tasks": ("paramserver.cli.listing", "Tasks and their parameters."),
    "compressors": ("paramserver.cli.listing", "Gradient compressors and their parameters."),
    "run": ("paramserver.cli.distributed", "One rank of a torchrun or Slurm job."),
    "experiment": ("paramserver.cli.experiment",
                   "Compare sync, async and bounded-staleness training on a task or script."),
    "bench": ("paramserver.cli.bench",
              "Measure push + pull against raw pyzmq, torch rpc, gloo and Ray."),
    "checkpoint": ("paramserver.cli.checkpoint",
                   "Look into checkpoints, reshard them, export a model."),
    "reshard": ("paramserver.cli.reshard",
                "Move a running job to another number of shards, live."),
    "keys": ("paramserver.cli.keys",
             "CURVE keys: encryption and authentication between workers and servers."),
    "simulate": ("paramserver.cli.simulate",
                 "Run an experiment grid in virtual time, in this process."),
    "plan": ("paramserver.cli.plan",
             "Predict each mode's time to a target loss, fitted on real runs."),
}


class LazyCommands(MutableMapping[str, click.Command]):
    """A group's commands by name, each imported from its module on first lookup.

    Iterating gives the names (of modules that exist) without importing anything;
    ``commands[name]`` imports the command's module. A command added the usual way
    (``group.add_command``) is kept as it is.
    """

    def __init__(self, table: Mapping[str, tuple[str, str]]) -> None:
        self.table = dict(table)
        self.loaded: dict[str, click.Command] = {}

    def summary(self, name: str) -> str | None:
        """The line ``--help`` lists for a command not imported yet (None once it is)."""
        return None if name in self.loaded else self.table[name][1]

    def _exists(self, name: str) -> bool:
        return importlib.util.find_spec(self.table[name][0]) is not None

    def __getitem__(self, name: str) -> click.Command:
        if name not in self.loaded:
            if name not in self.table or not self._exists(name):
                raise KeyError(name)
            self.loaded[name] = _command_in(self.table[name][0], name)
        return self.loaded[name]

    def __setitem__(self, name: str, command: click.Command) -> None:
        self.loaded[name] = command

    def __delitem__(self, name: str) -> None:
        if name not in self.loaded and name not in self.table:
            raise KeyError(name)
        self.loaded.pop(name, None)
        self.table.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        yield from self.loaded
        yield from (n for n in self.table if n not in self.loaded and self._exists(n))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _command_in(module_name: str, name: str) -> click.Command:
    """The click command called ``name`` among those ``module_name`` names in __all__."""
    module = importlib.import_module(module_name)
    for attr in getattr(module, "__all__", ()):
        command = getattr(module, attr)
        if isinstance(command, click.Command) and command.name == name:
            return command
    raise RuntimeError(f"{module_name} names no click command {name!r} in __all__ "
                       "(paramserver.cli.main.COMMANDS says it does)")


class LazyGroup(click.Group):
    """A click group over :class:`LazyCommands`: its ``--help`` lists a command not
    imported yet by its short help from the table, as click lists a loaded one."""

    def __init__(self, *args: object, lazy: Mapping[str, tuple[str, str]], **kwargs: object
                 ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.commands = LazyCommands(lazy)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        commands = self.commands
        assert isinstance(commands, LazyCommands)
        names = [n for n in self.list_commands(ctx)
                 if commands.summary(n) is not None or not commands[n].hidden]
        if not names:
            return
        limit = formatter.width - 6 - max(len(n) for n in names)
        rows = []
        for name in names:
            summary = commands.summary(name)
            command = commands[name] if summary is None else click.Command(name, short_help=summary)
            rows.append((name, command.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


EPILOG = """\b
Start here:
  paramserver launch -s 2 -n 3 --mode sync      a whole cluster on this machine
  paramserver server / paramserver worker       one process each, e.g. per terminal
  paramserver run --num-servers 2               under torchrun or srun, across hosts
  paramserver status --servers HOST:PORT,...    what each shard is doing
  paramserver policies / paramserver tasks      what can be named in --policy / --task
  paramserver compressors                       what can be named in --compression

\b
Every option of server, worker, launch and run can also come from a TOML
file (--config FILE) or an environment variable PARAMSERVER_<OPTION>; flags
win over the environment, which wins over the file. See docs/cli.md.
"""


@click.group("paramserver", cls=LazyGroup, lazy=COMMANDS, epilog=EPILOG,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="paramserver", prog_name="paramserver")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"],
                                               case_sensitive=False),
              default=None, envvar="PARAMSERVER_LOG_LEVEL", show_envvar=True,
              help="Log level of this process and of the processes it starts [default: "
                   "WARNING here, INFO in the logs of started processes].")
def main(log_level: str | None) -> None:
    """Sharded parameter servers: sync, async and bounded-staleness training."""
    if log_level is not None:
        os.environ["PARAMSERVER_LOG_LEVEL"] = log_level.upper()  # `launch`'s processes inherit it
    # `--task mymod:make` / `--policy mymod:MyPolicy` find mymod.py in the working directory,
    # as `python -m` would; appended, so that a local file never shadows an installed package
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    logging.basicConfig(level=(log_level or "WARNING").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def register_commands(group: click.Group, modules: list[str]) -> None:
    """Add, now, the click commands each module names in ``__all__`` (for a group built
    elsewhere; ``main`` loads its own from :data:`COMMANDS` as they are asked for); skip
    modules not written yet."""
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        for attr in getattr(module, "__all__", ()):
            command = getattr(module, attr)
            if isinstance(command, click.Command):
                group.add_command(command)


if __name__ == "__main__":
    main()
