"""The ``--out`` folder of ``launch``, ``experiment`` and ``simulate``: one rule for all.

A missing or empty folder is used. A folder that holds an earlier run or experiment,
or anything else, is refused (exit 2, one line) unless ``--overwrite`` is given: then
its contents are deleted first. Nothing outside the folder is ever deleted, and
neither a symbolic link, the working directory (or a folder above it) nor the home
folder is cleared, whatever the flag says.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

import click

__all__ = ["EXPERIMENT_MARKERS", "RUN_MARKERS", "claim_out_dir"]

log = logging.getLogger(__name__)

#: what a launched run writes first (LocalCluster makes logs/ and configs/ before any
#: process starts, result.json at the end)
RUN_MARKERS = ("result.json", "events", "logs", "configs")
#: what an experiment (or a simulated one) writes first
EXPERIMENT_MARKERS = ("experiment.json", "spec.toml")


def _never_cleared(folder: Path) -> str | None:
    """Why ``folder`` must not be cleared, or None."""
    real = folder.resolve()
    cwd = Path.cwd().resolve()
    if folder.is_symlink():
        return "it is a symbolic link"
    if real == cwd or real in cwd.parents:
        return "it is the working directory or a folder above it"
    if real == Path.home().resolve() or real == Path(real.anchor):
        return "it is the home folder or the file system's root"
    return None


def claim_out_dir(out: Path, *, what: str, markers: Sequence[str], overwrite: bool,
                  flag: str = "--out") -> Path:
    """Make ``out`` an empty folder for a new ``what`` (``"run"``, ``"experiment"``), or
    raise a one-line usage error naming ``flag``; ``markers``: the names an earlier
    ``what`` leaves there."""
    if out.exists() and not out.is_dir():
        raise click.BadParameter(f"{out} is a file, not a folder", param_hint=flag)
    if out.is_dir() and any(out.iterdir()):
        earlier = any((out / m).exists() for m in markers)
        held = f"holds an earlier {what}" if earlier else f"is not empty and holds no {what}"
        if not overwrite:
            raise click.BadParameter(f"{out} {held}; give --overwrite to delete what it holds, "
                                     "or choose another directory", param_hint=flag)
        why = _never_cleared(out)
        if why:
            raise click.BadParameter(f"{out} {held}, and --overwrite will not clear it: {why}",
                                     param_hint=flag)
        log.warning("--overwrite: deleting what %s holds", out)
        for child in out.iterdir():  # the folder itself stays (it may be a mount point)
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    out.mkdir(parents=True, exist_ok=True)
    return out
