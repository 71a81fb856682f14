"""When and where a shard server checkpoints, and how it resumes from one.

:class:`Checkpointer` writes a shard core's snapshot with
:func:`~paramserver.persist.checkpoint.save_shard` (the file format lives in
checkpoint.py, the snapshot's content in snapshot.py): every
``checkpoint_every`` versions or ``checkpoint_seconds`` seconds, on the
CHECKPOINT op (only at a place inside the configured directory: the server
never writes where a message tells it to) and at shutdown. It also reads a
shard's checkpoint back for ``--resume``, refusing one whose plan is unusable
or another's.

It never writes a checkpoint that ``--resume`` would refuse (weights or state
not finite, anything :func:`paramserver.core.snapshot.check` refuses): the last
good one stays LATEST, and pruning, which keeps LATEST, never removes the
newest resumable checkpoint. At startup (:meth:`Checkpointer.claim`) a
directory holding an earlier run of this shard is refused unless the server
resumes it or was told ``--fresh`` (the old run is then moved aside).

A checkpoint is taken in two parts: :meth:`Checkpointer.capture` (the state at one
version, checked; copied when it is written while the core moves on) and
:meth:`Checkpointer.write`. With replicas, paramserver/server/replicackpt.py decides
which replica writes, and writes on a thread.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paramserver.core import snapshot
from paramserver.core.reshard import ReshardError, reshard
from paramserver.core.shard import ShardCore
from paramserver.core.sharding import ShardPlan
from paramserver.errors import ConfigError, ErrorCode, ParamServerError, ProtocolError
from paramserver.observe import records as ev
from paramserver.observe.events import EventLog
from paramserver.persist.checkpoint import (
    CheckpointDirInUse,
    CheckpointError,
    earlier_run,
    latest_path,
    load_shard,
    move_aside,
    resume_point,
    save_shard,
    supersede,
)
from paramserver.persist.reshard import load_all, shard_count
from paramserver.sparse.shard import SparseShard

__all__ = ["RESTORE_ERRORS", "Capture", "Checkpointer"]

log = logging.getLogger(__name__)

#: what building a core from a checkpoint may raise: the checkpoint is unusable
RESTORE_ERRORS = (ParamServerError, KeyError, TypeError, ValueError, AttributeError,
                  IndexError, RuntimeError)


@dataclass(frozen=True)
class Capture:
    """A shard's checkpoint taken at one version, not written yet."""

    version: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]


class Checkpointer:
    """Shard ``shard``'s checkpoints in ``directory`` (None: only where asked),
    keeping ``keep``, due every ``every`` versions or ``seconds`` seconds (0: never)."""

    def __init__(self, shard: int, directory: str | None, events: EventLog, *,
                 keep: int = 2, every: int = 0, seconds: float = 0.0) -> None:
        self.shard = shard
        self.directory = directory
        self.events = events
        self.keep = keep
        self.every = every
        self.seconds = seconds
        self.last = (time.monotonic(), -1)  # (when, version) of the latest one
        self.resumed_from: str | None = None  # the checkpoint read() chose, by name

    def save(self, core: ShardCore | None, plan: ShardPlan | None, extra: Mapping[str, Any],
             directory: str | None = None, sparse: SparseShard | None = None) -> str | None:
        """Write ``core``'s checkpoint now, ``extra`` added to its metadata, and the
        shard's sparse tables with it (one file, one atomic write); returns the
        manifest path (None: nothing to save)."""
        if (directory or self.directory) is None:
            raise ConfigError("no checkpoint directory configured")
        return self.store(self.capture(core, plan, extra, sparse), directory)

    def store(self, taken: Capture | None, directory: str | None = None) -> str | None:
        """Write ``taken`` now, in ``directory`` or the configured one; the manifest
        path (None: nothing to save)."""
        target = directory or self.directory
        if target is None:
            raise ConfigError("no checkpoint directory configured")
        if taken is None:
            return None
        path = self.write(taken, target)
        self.written(taken.version, path)
        return path

    def capture(self, core: ShardCore | None, plan: ShardPlan | None,
                extra: Mapping[str, Any], sparse: SparseShard | None = None, *,
                copy: bool = False) -> Capture | None:
        """``core``'s checkpoint as it is now (None: nothing to save), checked as a
        resume checks it; ``copy``: its tensors copied, to be written while the
        core moves on (paramserver/server/replicackpt.py)."""
        if core is None or plan is None:
            return None
        tensors, meta = core.state_dict()
        try:  # what resume would refuse is not written: the last good one stays
            snapshot.check(core, tensors, meta)
        except (ConfigError, ProtocolError) as exc:
            why = exc.reason if isinstance(exc, ProtocolError) else str(exc)
            self.events.write(ev.CheckpointRefused(shard=self.shard, version=core.version,
                                                   error=why[:300]))
            raise CheckpointError(f"shard {self.shard}: the checkpoint at version "
                                  f"{core.version} was not written, resume would refuse it: "
                                  f"{why}") from exc
        meta.update(plan=plan.describe(), plan_hash=plan.hash, **extra)
        if sparse is not None:
            rows, meta["sparse"] = sparse.state_dict()
            tensors.update(rows)
        if copy:  # (the manifest is JSON: a round trip is a deep copy of what is written)
            tensors = {k: t.detach().clone() for k, t in tensors.items()}
            meta = json.loads(json.dumps(meta))
        return Capture(core.version, tensors, meta)

    def write(self, taken: Capture, directory: str) -> str:
        """Write a capture as this shard's checkpoint in ``directory`` (any thread:
        no event is written here); the manifest's path."""
        return str(save_shard(directory, self.shard, taken.tensors, taken.meta,
                              keep=self.keep))

    def written(self, version: int, path: str) -> None:
        """A checkpoint at ``version`` is on disk at ``path`` (the event, the clock)."""
        self.last = (time.monotonic(), version)
        self.events.write(ev.Checkpoint(shard=self.shard, version=version, path=path))

    def due(self, core: ShardCore | None) -> bool:
        """Whether a periodic checkpoint of ``core`` is due now."""
        if core is None or not self.directory:
            return False
        when, version = self.last
        if version == core.version:
            return False
        if not core.between_rounds:
            # a sync shard checkpoints between rounds, where the other shards' checkpoints
            # of the same round stand too: they resume together (persist/checkpoint.py)
            return False
        every, seconds = self.every, self.seconds
        return bool((every and core.version % every == 0) or (
            seconds and time.monotonic() - when >= seconds))

    def target(self, path: str | None) -> str:
        """Where the CHECKPOINT op writes: ``path`` inside the checkpoint directory
        (the directory itself without one); anything else is refused."""
        base = self.directory
        if base is None:
            raise ProtocolError(ErrorCode.BAD_FIELD,
                                "this server has no checkpoint directory (--checkpoint-dir)")
        if not path:
            return base
        try:
            root = Path(base).resolve()
            candidate = (root / path).resolve()
        except (OSError, ValueError) as exc:  # a NUL byte, a loop of links
            raise ProtocolError(ErrorCode.BAD_FIELD, f"bad checkpoint path: {exc}") from exc
        if candidate != root and root not in candidate.parents:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"checkpoint path must lie inside {base}")
        return str(candidate)

    def read(self, directory: str, plan: ShardPlan | None, alone: bool = False,
             num_shards: int | None = None
             ) -> tuple[ShardPlan, dict[str, torch.Tensor], dict[str, Any]]:
        """This shard's checkpoint in ``directory`` that the run resumes from: (its plan,
        tensors, metadata). The whole run resumes where every shard's checkpoint stands
        at the same sync round (:func:`resume_point`; a newer one of this shard is
        moved aside, see :func:`supersede`); ``alone``: this shard restarts in a run
        that goes on, from its latest. A run checkpointed on another number of shards
        than ``num_shards`` is resharded, this shard's part of it taken
        (persist/reshard.py). Refused (:class:`CheckpointError`) if its plan is
        unusable or not ``plan``, or the shards hold no common round."""
        if not alone and num_shards is not None:
            count = shard_count(directory)
            if count != num_shards:
                return self._resharded(directory, count, num_shards)
        name = None
        if not alone:
            point = resume_point(directory)
            name = point["names"].get(self.shard)
            if not point["consistent"]:
                print(f"shard {self.shard}: {point['note']}", file=sys.stderr, flush=True)
                self.events.write(ev.CheckpointRoundsDiffer(shard=self.shard, round=point["round"],
                                                            checkpoint=name, note=point["note"]))
        tensors, meta = load_shard(directory, self.shard, name)
        try:
            theirs = ShardPlan.from_description(meta["plan"])
        except (ConfigError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{self._where(directory)}: unusable plan: {exc}") from exc
        if plan is not None and theirs.hash != plan.hash:
            raise CheckpointError(f"checkpoint in {directory} has another plan: "
                                  f"{plan.diff(meta['plan'])}")
        self.resumed_from = name
        return theirs, tensors, meta

    def _resharded(self, directory: str, count: int, num_shards: int
                   ) -> tuple[ShardPlan, dict[str, torch.Tensor], dict[str, Any]]:
        """This shard's part of ``directory``'s checkpoint of ``count`` shards, resharded
        to ``num_shards`` (nothing written: every shard takes its own part)."""
        if self.directory is not None and Path(self.directory).resolve() == \
                Path(directory).resolve():
            raise CheckpointError(
                f"{directory} holds a run on {count} shard(s), resumed here on {num_shards}: "
                f"its checkpoints would mix two plans; give --checkpoint-dir another "
                f"directory, or reshard it first (paramserver checkpoint reshard {directory} "
                f"--to {num_shards} --out DIR2)")
        try:
            tensors, meta = reshard(load_all(directory), num_shards, only=self.shard)[0]
        except ReshardError as exc:
            raise CheckpointError(str(exc)) from exc
        self.resumed_from = None  # (no checkpoint of this shard's to settle on)
        version = meta.get("version")
        self.events.write(ev.CheckpointResharded(
            shard=self.shard, directory=str(directory), shards=count, to=num_shards,
            version=version if isinstance(version, int) else None))
        print(f"shard {self.shard}: resharding {directory} from {count} to {num_shards} "
              "shard(s)", file=sys.stderr, flush=True)
        return ShardPlan.from_description(meta["plan"]), tensors, meta

    def unusable(self, directory: str, exc: BaseException) -> CheckpointError:
        """The error for a checkpoint a core could not be built from: one sentence
        naming the file (and the field, where the check names one)."""
        what = exc.reason if isinstance(exc, ProtocolError) else str(exc)
        return CheckpointError(f"{self._where(directory)}: {type(exc).__name__}: {what}")

    def claim(self, resume: str | None, fresh: bool) -> Path | None:
        """Before the shard serves: refuse (:class:`CheckpointDirInUse`) a checkpoint
        directory holding an earlier run of this shard, which the new run's
        checkpoints would replace and prune, unless the shard resumes that very run
        (``resume``) or ``fresh`` (the run is then moved aside: returns where)."""
        if self.directory is None:
            return None
        earlier = earlier_run(self.directory, self.shard)
        if earlier is None:
            return None
        if resume is not None and Path(resume).resolve() == Path(self.directory).resolve():
            return None
        folder = Path(self.directory) / f"shard{self.shard}"
        if not fresh:
            raise CheckpointDirInUse(
                f"{folder} holds an earlier run's checkpoints ({earlier}); resume it with "
                f"--resume {self.directory}, or start afresh with --fresh (moves them aside)")
        moved = move_aside(self.directory, self.shard)
        log.warning("shard %d: --fresh: moved the earlier run's checkpoints (%s) to %s",
                    self.shard, earlier, moved)
        self.events.write(ev.CheckpointsMoved(shard=self.shard, earlier=earlier, path=str(moved)))
        return moved

    def resumed(self, directory: str, version: int, settle: bool = True) -> None:
        """The shard resumed at ``version`` from what :meth:`read` gave. ``settle``: the
        checkpoint it took is made LATEST again, those after it moved aside (the run
        goes on from there: they are another timeline); one replica of a shard does it."""
        if settle and self.resumed_from is not None:
            moved = supersede(directory, self.shard, self.resumed_from)
            if moved is not None:
                log.warning("shard %d: resumed from %s; the later checkpoints are in %s",
                            self.shard, self.resumed_from, moved)
        self.last = (time.monotonic(), version)
        # stderr, whatever the logging setup: an operator must see which state serves
        print(f"resumed shard {self.shard} from version {version} ({directory})",
              file=sys.stderr, flush=True)
        log.info("shard %d resumed from %s at version %d", self.shard, directory, version)

    def _where(self, directory: str) -> str:
        try:
            return f"checkpoint {latest_path(directory, self.shard)}.json"
        except CheckpointError:
            return f"checkpoint of shard {self.shard} in {directory}"
