"""A checkpoint directory resharded into another: ``paramserver checkpoint reshard`` and
``--resume DIR --num-servers S`` on another shard count.

The rule is paramserver/core/reshard.py's; here the shards' checkpoints are read
through the verified loader (:func:`~paramserver.persist.checkpoint.load_shard`, at
the point a resume takes: :func:`~paramserver.persist.checkpoint.resume_point`), and
the new ones are written into a temporary directory beside the target, renamed to it
once every shard's checkpoint is whole: nothing is left at the target unless all of
it is.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from paramserver.core.reshard import ReshardError, ShardState, reshard
from paramserver.errors import ConfigError
from paramserver.persist.checkpoint import (
    CheckpointError,
    inspect_checkpoint,
    load_shard,
    resume_point,
    save_shard,
)

__all__ = ["load_all", "reshard_checkpoint", "resume_elsewhere", "shard_count", "sibling"]


def shard_count(directory: str | Path) -> int:
    """How many shards the run checkpointed in ``directory`` was planned on."""
    info = inspect_checkpoint(directory)
    count = info["num_shards"]
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise CheckpointError(f"{directory}: the checkpoint's plan names no shard count")
    return count


def load_all(directory: str | Path) -> list[ShardState]:
    """Every shard's checkpoint at the point a resume takes, through the verified loader."""
    count = shard_count(directory)
    point = resume_point(directory)
    missing = sorted(set(range(count)) - set(point["names"]))
    if missing:
        raise CheckpointError(f"{directory}: shard(s) {missing} of {count} have no checkpoint")
    extra = sorted(set(point["names"]) - set(range(count)))
    if extra:
        raise CheckpointError(f"{directory}: shard folder(s) {extra} lie beyond the plan's "
                              f"{count} shards")
    return [load_shard(directory, s, point["names"][s]) for s in range(count)]


def reshard_checkpoint(directory: str | Path, to: int, out: str | Path) -> dict[str, Any]:
    """Write ``directory``'s checkpoint, planned on S shards, as one planned on ``to``
    shards in ``out`` (which must not exist yet); a summary. Refused
    (:class:`CheckpointError`, one line) if it cannot be read, is tampered with, or
    cannot move (:class:`~paramserver.core.reshard.ReshardError`)."""
    started = time.perf_counter()
    target = Path(out)
    if target.exists() or target.is_symlink():
        raise CheckpointError(f"{target} exists; give a new directory for the resharded "
                              "checkpoint")
    if not target.parent.is_dir():
        raise CheckpointError(f"{target.parent} is not a directory")
    shards = load_all(directory)
    try:
        moved = reshard(shards, to)
    except ReshardError as exc:
        raise CheckpointError(str(exc)) from exc
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for k, (tensors, meta) in enumerate(moved):
            save_shard(tmp, k, tensors, meta, keep=1)
        os.rename(tmp, target)  # whole, or not there
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"from": len(shards), "to": to, "path": str(target),
            "version": moved[0][1].get("version"), "round": moved[0][1].get("rounds_closed"),
            "bytes": sum(t.numel() * t.element_size() for ts, _ in moved for t in ts.values()),
            "seconds": time.perf_counter() - started}


def sibling(directory: str | Path, to: int) -> Path:
    """Where a run that resumes ``directory`` on ``to`` shards checkpoints when it was
    told to checkpoint into ``directory`` itself: ``DIR.<to>shards`` beside it (the
    same name in every process of a job)."""
    base = Path(directory).resolve()
    return base.with_name(f"{base.name}.{to}shards")


def resume_elsewhere(resume: str | None, checkpoint_dir: str | None, num_shards: int
                     ) -> Path | None:
    """Where a run that resumes ``resume`` on ``num_shards`` shards writes its
    checkpoints, when that differs from ``checkpoint_dir``: a run resumed on another
    shard count than its checkpoint's must not write into the old run's folders (two
    plans in one directory), so it writes beside it (:func:`sibling`). None: as asked.
    Refused (:class:`ConfigError`) when that place holds a run already (an
    earlier resume of the same directory, which went on from there)."""
    if resume is None or checkpoint_dir is None or \
            Path(resume).resolve() != Path(checkpoint_dir).resolve():
        return None
    try:
        count = shard_count(resume)
    except CheckpointError:
        return None  # the shards say what is wrong with it, as for any resume
    if count == num_shards:
        return None
    target = sibling(resume, num_shards)
    if target.exists() and any(target.glob("shard*")):
        raise ConfigError(
            f"{resume} holds a run on {count} shard(s); resumed on {num_shards} it would "
            f"checkpoint into {target}, which holds a run already (an earlier resume on "
            f"{num_shards}): resume that with --resume {target}, or give --checkpoint-dir "
            "another directory")
    return target
