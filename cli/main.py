"""The ``paramserver`` command line: a click group; each command lives in its own module.

Minimal entry point: register a command with one line, ``main.add_command(command)``.
"""

from __future__ import annotations

import logging
import os

import click

from .experiment import experiment
from .simulate import simulate

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="paramserver")
def main() -> None:
    """Sharded parameter servers for data-parallel deep learning."""
    logging.basicConfig(level=os.environ.get("PARAMSERVER_LOG_LEVEL", "WARNING"),
                        format="%(levelname)s %(name)s: %(message)s")


main.add_command(experiment)
main.add_command(simulate)

if __name__ == "__main__":
    main()
