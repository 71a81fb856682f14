"""The rules of resuming a whole run (issue 43, item 3), without sockets:

* which checkpoint each shard of a sync run resumes from: the newest round all of them
  hold, not each one's latest (a SIGTERM or a kill between two shards' steps leaves them
  a round apart), and `checkpoint inspect` says so;
* pruning keeps what that needs, and a sync shard checkpoints between rounds;
* a resumed shard awaits every worker: none is dead while it starts, and no round
  closes, and no pull is answered, before all are back (or reported dead);
* the built-in loop's data goes on at the batch where it stopped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from paramserver.cli.checkpoint import checkpoint as checkpoint_cli
from paramserver.core.shard import CoreConfig, ModeSpec, ShardCore, SliceSpec
from paramserver.observe.events import EventLog
from paramserver.persist.checkpoint import (
    CheckpointError,
    inspect_checkpoint,
    load_shard,
    resume_point,
    save_shard,
    supersede,
)
from paramserver.server.checkpointer import Checkpointer
from paramserver.workers.tasks import EpochBatches
from paramserver.workers.worker import cycle_batches

KEYS = [SliceSpec("w", 4, "float32")]


def _meta(version: int, rounds: int, members: list[int] | None = None) -> dict[str, Any]:
    return {"version": version, "mode": "sync", "plan_hash": "abc", "workers": {},
            "rounds_closed": rounds, "round": members or [], "round_void": False,
            "between_rounds": not members}


def _save(root: Path, shard: int, version: int, members: list[int] | None = None,
          keep: int = 2) -> None:
    save_shard(root, shard, {"param/w": torch.full((4,), float(version))},
               _meta(version, version, members), keep=keep)


def test_shards_a_round_apart_resume_from_the_round_both_hold(tmp_path):
    for v in (4, 8):
        _save(tmp_path, 0, v)
        _save(tmp_path, 1, v)
    _save(tmp_path, 0, 9)  # shard 0 closed round 9 and was stopped there ...
    _save(tmp_path, 1, 8, members=[0])  # ... shard 1 had worker 0's push of it only
    point = resume_point(tmp_path)
    assert not point["consistent"] and point["round"] == 8
    assert point["names"] == {0: "v0000000008", 1: "v0000000008"}
    assert "shard 0 at round 9" in point["note"] and "[0] in the open round" in point["note"]
    info = inspect_checkpoint(tmp_path)
    assert not info["complete"] and not info["consistent"]
    assert info["resume"]["versions"] == [8, 8]
    out = CliRunner().invoke(checkpoint_cli, ["inspect", str(tmp_path)])
    assert "incomplete" in out.output and "round 8" in out.output, out.output


def test_shards_at_one_round_are_consistent_and_a_single_shard_always_is(tmp_path):
    for shard in (0, 1):
        _save(tmp_path, shard, 4)
        _save(tmp_path, shard, 5, members=[1])  # the same push reached both
    point = resume_point(tmp_path)
    assert point["consistent"] and point["names"] == {0: "v0000000005", 1: "v0000000005"}
    assert inspect_checkpoint(tmp_path)["complete"]
    _save(tmp_path / "one", 0, 7, members=[0])
    assert resume_point(tmp_path / "one")["consistent"]


def test_no_common_round_is_refused_in_one_line(tmp_path):
    _save(tmp_path, 0, 9, keep=1)
    _save(tmp_path, 1, 8, keep=1)
    with pytest.raises(CheckpointError, match="cannot resume together"):
        resume_point(tmp_path)


def test_pruning_keeps_the_last_two_rounds_between_rounds(tmp_path):
    """The final checkpoint (a round open) does not push out the round the other shard
    may stand at."""
    _save(tmp_path, 1, 4)
    _save(tmp_path, 1, 8)
    _save(tmp_path, 1, 9)
    _save(tmp_path, 1, 9, members=[0])  # at SIGTERM, a push in the open round
    kept = sorted(p.name for p in (tmp_path / "shard1").glob("*.json"))
    assert kept == ["v0000000008.json", "v0000000009-1.json", "v0000000009.json"]


def test_resuming_an_older_checkpoint_moves_the_later_ones_aside(tmp_path):
    for v in (4, 8):
        _save(tmp_path, 0, v)
    moved = supersede(tmp_path, 0, "v0000000004")
    assert moved is not None and sorted(p.name for p in moved.iterdir()) == [
        "v0000000008.json", "v0000000008.safetensors"]
    assert load_shard(tmp_path, 0)[1]["version"] == 4


def _core(workers: int = 2) -> ShardCore:
    cfg = CoreConfig(mode=ModeSpec("sync"), optimizer="sgd", optimizer_args={"lr": 1.0},
                     expected_workers=workers, heartbeat_timeout=1.0)
    core = ShardCore(KEYS, cfg)
    for w in range(workers):
        core.register(w, f"old{w}", 0.0)
    core.initialize({"w": torch.zeros(4)})
    return core


def _resumed(core: ShardCore) -> ShardCore:
    tensors, meta = core.state_dict()
    meta = json.loads(json.dumps(meta))  # as a checkpoint's manifest holds it
    fresh = ShardCore(KEYS, core.config)
    fresh.load_state_dict(tensors, meta, now=100.0)
    fresh.members.await_restored()
    return fresh


def _push(core: ShardCore, worker: int, clock: int, push_id: int, now: float):
    return core.push(worker, push_id, clock, core.version, 1, {"w": torch.ones(4)}, now)


def test_a_resumed_shard_awaits_every_worker_before_a_round_closes():
    core = _core()
    for w in (0, 1):
        _push(core, w, 0, 0, 1.0)
    assert core.version == 1 and core.between_rounds
    core = _resumed(core)
    # long past the heartbeat timeout: a worker still starting is not dead
    assert core.expire(150.0) == []
    state = core.register(0, "new0", 150.0)  # a new process takes its id at once
    assert state.clock == 1 and core.members.awaited == {1}
    core.request_pull(0, 1, "t0", 150.0)
    assert core.ready_pulls(150.0) == []  # the start barrier stands again
    _push(core, 0, 1, 0, 151.0)
    assert core.version == 1  # worker 0 does not train the round alone
    core.register(1, "new1", 152.0)
    assert core.members.awaited == set() and core.started
    _push(core, 1, 1, 0, 152.0)
    assert core.version == 2


def test_a_worker_reported_dead_before_it_came_back_releases_the_round():
    core = _resumed(_core())
    core.register(0, "new0", 101.0)
    _push(core, 0, 0, 0, 101.0)
    assert core.version == 0
    assert core.declare_dead(1)
    assert core.version == 1 and core.started


def test_a_sync_shard_checkpoints_between_rounds_only(tmp_path):
    core = _core()
    ckpt = Checkpointer(0, str(tmp_path), EventLog(None), every=1)
    _push(core, 0, 0, 0, 1.0)
    _push(core, 1, 0, 0, 1.0)
    _push(core, 0, 1, 1, 2.0)  # round 2 opened: version 1 is no longer between rounds
    assert core.version == 1 and not core.between_rounds and not ckpt.due(core)
    _push(core, 1, 1, 1, 2.0)
    assert core.between_rounds and ckpt.due(core)


def test_the_built_in_loop_draws_on_from_where_it_stopped():
    class Task:
        batches = EpochBatches(torch.arange(10.0)[:, None], torch.arange(10), 3, seed=1,
                               rank=0)

    whole = cycle_batches(Task())
    drawn = [next(whole)[1].tolist() for _ in range(9)]
    Task.batches = EpochBatches(torch.arange(10.0)[:, None], torch.arange(10), 3, seed=1,
                                rank=0)
    resumed = cycle_batches(Task(), skip=5)  # 4 batches an epoch: epoch 1, batch 1
    assert [next(resumed)[1].tolist() for _ in range(4)] == drawn[5:]


def test_a_run_that_ended_and_is_resumed_awaits_every_worker_again():
    core = _core()
    for w in (0, 1):
        _push(core, w, 0, 0, 1.0)
        core.members.workers[w].finished = True  # each said BYE: the run ended
    core = _resumed(core)
    assert core.members.awaited == {0, 1}
    core.register(0, "new0", 150.0)
    _push(core, 0, 1, 1, 150.0)
    assert core.version == 1  # no round closes with worker 0 alone: it goes on --steps further
