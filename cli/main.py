"""The ``paramserver`` command: a click group whose commands live one module each.

The commands only build configs and call the library (paramserver/, workers/);
nothing here speaks ZeroMQ.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

import click

# Command modules, tried in this order. Each module names its click commands in
# __all__; adding the module's name here, one line, registers them. A module
# that does not exist is skipped, so a command still being written (bench, say)
# appears as soon as its file lands; a module that exists but fails to import
# is an error, never silently hidden.
COMMAND_MODULES = [
    "paramserver.cli.server",
    "paramserver.cli.worker",
    "paramserver.cli.launch",
    "paramserver.cli.status",
    "paramserver.cli.listing",
    "paramserver.cli.distributed",
    "paramserver.cli.experiment",
    "paramserver.cli.bench",
    "paramserver.cli.checkpoint",
    "paramserver.cli.keys",
    "paramserver.cli.simulate",
]

EPILOG = """\b
Start here:
  paramserver launch -s 2 -n 3 --mode sync      a whole cluster on this machine
  paramserver server / paramserver worker       one process each, e.g. per terminal
  paramserver run --num-servers 2               under torchrun or srun, across hosts
  paramserver status --servers HOST:PORT,...    what each shard is doing
  paramserver policies / paramserver tasks      what can be named in --policy / --task

\b
Every option of server, worker, launch and run can also come from a TOML
file (--config FILE) or an environment variable PARAMSERVER_<OPTION>; flags
win over the environment, which wins over the file. See docs/cli.md.
"""


@click.group("paramserver", epilog=EPILOG,
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
    """Add the click commands each module names in ``__all__``; skip modules not written yet."""
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


register_commands(main, COMMAND_MODULES)

if __name__ == "__main__":
    main()
