"""Checkpoints: round trips, pruning, inspection, export, the CLI, and a writer killed
(SIGKILL, in a forked process) after every step of the write."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from torch import nn

from paramserver.cli.checkpoint import checkpoint as checkpoint_cli
from paramserver.core.shard import CoreConfig, ModeSpec, ShardCore, SliceSpec
from paramserver.core.sharding import ShardPlan
from paramserver.persist.checkpoint import (
    WRITE_STEPS,
    CheckpointError,
    export_model,
    inspect_checkpoint,
    load_shard,
    save_shard,
    set_write_hook,
)


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "param/w": torch.randn(64, 33, generator=g),
        "param/b": torch.randn(7, generator=g, dtype=torch.float64),
        "optim/0/exp_avg": torch.randn(64, 33, generator=g).to(torch.bfloat16),
        "optim/0/step": torch.tensor(float(seed)),
        "agg/w": torch.randint(0, 100, (5,), generator=g),
    }


def meta(version: int, **extra: Any) -> dict[str, Any]:
    return {"version": version, "mode": "async", "plan_hash": "abc",
            "workers": {"0": {"clock": version, "applied": version, "rejected": {"x": 1}}},
            **extra}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ------------------------------------------------------------------ round trips


def test_round_trip_is_bit_exact(tmp_path):
    t = tensors(1)
    path = save_shard(tmp_path, 3, t, meta(12, policy={"name": "none", "state": {}}))
    assert path == tmp_path / "shard3" / "v0000000012.json"
    got, m = load_shard(tmp_path, 3)
    assert_same(got, t)
    assert m["version"] == 12 and m["format"] == 1 and m["policy"]["name"] == "none"
    assert m["tensors_bytes"] == (tmp_path / "shard3" / "v0000000012.safetensors").stat().st_size
    assert json.loads((tmp_path / "shard3" / "LATEST").read_text())["name"] == "v0000000012"


def test_steps_are_reported_in_order(tmp_path):
    seen: list[str] = []
    previous = set_write_hook(lambda step, path: seen.append(step))
    try:
        save_shard(tmp_path, 0, tensors(1), meta(1))
    finally:
        set_write_hook(previous)
    assert tuple(seen) == WRITE_STEPS


def test_pruning_keeps_latest_and_the_newest_before_it(tmp_path):
    for v in (1, 2, 3, 4):
        save_shard(tmp_path, 0, tensors(v), meta(v), keep=2)
    assert files(tmp_path / "shard0") == ["LATEST", "v0000000003.json",
                                          "v0000000003.safetensors", "v0000000004.json",
                                          "v0000000004.safetensors"]
    save_shard(tmp_path, 0, tensors(5), meta(5), keep=0)  # 0: keep everything
    assert len(files(tmp_path / "shard0")) == 1 + 2 * 3


def test_a_second_save_at_one_version_never_overwrites_the_first(tmp_path):
    save_shard(tmp_path, 0, tensors(1), meta(7), keep=2)
    path = save_shard(tmp_path, 0, tensors(2), meta(7), keep=2)
    assert path.name == "v0000000007-1.json"
    assert_same(load_shard(tmp_path, 0)[0], tensors(2))
    save_shard(tmp_path, 0, tensors(3), meta(8), keep=2)
    assert files(tmp_path / "shard0") == ["LATEST", "v0000000007-1.json",
                                          "v0000000007-1.safetensors", "v0000000008.json",
                                          "v0000000008.safetensors"]


def test_missing_or_broken_checkpoints_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="LATEST is missing"):
        load_shard(tmp_path, 0)
    save_shard(tmp_path, 0, tensors(1), meta(1))
    (tmp_path / "shard0" / "v0000000001.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(CheckpointError, match="unreadable"):
        load_shard(tmp_path, 0)
    save_shard(tmp_path, 0, tensors(1), meta(2))
    m = json.loads((tmp_path / "shard0" / "v0000000002.json").read_text())
    m["format"] = 99
    (tmp_path / "shard0" / "v0000000002.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="format 99"):
        load_shard(tmp_path, 0)
    with pytest.raises(CheckpointError, match="no shard checkpoints"):
        inspect_checkpoint(tmp_path / "nothing")


def test_core_state_with_adam_and_a_scheduler_resumes_bit_exactly(tmp_path):
    """Weights, optimizer moments, scheduler position, clocks: the resumed shard takes the
    same next steps as the one that never stopped."""
    slices = [SliceSpec("w", 6, "float32"), SliceSpec("b", 2, "float32")]

    def core() -> ShardCore:
        cfg = CoreConfig(mode=ModeSpec("async"), optimizer="adam",
                         optimizer_args={"lr": 0.01}, scheduler="step",
                         scheduler_args={"step_size": 2, "gamma": 0.5})
        return ShardCore(slices, cfg)

    def grads(i: int) -> dict[str, torch.Tensor]:
        return {"w": torch.linspace(-1, 1, 6) * (i + 1), "b": torch.tensor([0.5, -0.5]) * i}

    a = core()
    a.register(0, "inc", 0.0)
    a.initialize({"w": torch.ones(6), "b": torch.zeros(2)})
    for i in range(5):
        assert a.push(0, i + 1, i, a.version, 4, grads(i), 0.0).applied
    t, m = a.state_dict()
    save_shard(tmp_path, 0, t, m)
    b = core()
    bt, bm = load_shard(tmp_path, 0)
    b.load_state_dict(bt, bm, 0.0)
    assert b.version == 5 and b.lr == a.lr and b.workers[0].clock == 5
    for i in range(5, 9):
        for c in (a, b):
            assert c.push(0, i + 1, i, c.version, 4, grads(i), 0.0).applied
    for key in a.params:
        assert torch.equal(a.params[key], b.params[key]), key
    # a retried push from before the checkpoint is still recognised
    assert b.push(0, 9, 8, b.version, 4, grads(8), 0.0).duplicate


# ------------------------------------------------------------------ inspect / export / CLI


def two_shard_checkpoint(root: Path) -> tuple[nn.Module, ShardPlan]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 30), nn.ReLU(), nn.Linear(30, 3))
    plan = ShardPlan.from_module(model, 2, chunk_bytes=1024)  # splits the big weight
    parts = plan.split_tensors({k: v.detach() for k, v in model.named_parameters()})
    for shard in range(2):
        t = {f"param/{k}": v for k, v in parts.get(shard, {}).items()}
        save_shard(root, shard, t, meta(10 + shard, plan=plan.describe(), plan_hash=plan.hash,
                                        optimizer_name="sgd"))
    return model, plan


def test_inspect_and_export_assemble_every_shard(tmp_path):
    model, _ = two_shard_checkpoint(tmp_path / "ck")
    info = inspect_checkpoint(tmp_path / "ck")
    assert info["complete"] and info["num_shards"] == 2 and info["versions"] == [10, 11]
    assert info["shards"][0]["workers"] == {"0": {"clock": 10, "applied": 10, "rejected": 1}}
    out = export_model(tmp_path / "ck", tmp_path / "model.safetensors")
    assert out["parameters"] == 4
    fresh = nn.Sequential(nn.Linear(40, 30), nn.ReLU(), nn.Linear(30, 3))
    fresh.load_state_dict(load_file(str(tmp_path / "model.safetensors")))
    for (name, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    # one shard gone: inspect says so and export refuses
    (tmp_path / "ck" / "shard1" / "LATEST").unlink()
    assert inspect_checkpoint(tmp_path / "ck")["missing_shards"] == [1]
    with pytest.raises(CheckpointError, match=r"shard\(s\) \[1\]"):
        export_model(tmp_path / "ck", tmp_path / "again.safetensors")


def test_checkpoint_cli_inspect_and_export(tmp_path):
    two_shard_checkpoint(tmp_path / "ck")
    runner = CliRunner()
    table = runner.invoke(checkpoint_cli, ["inspect", str(tmp_path / "ck")])
    assert table.exit_code == 0, table.output
    assert "shard" in table.output and "complete" in table.output
    as_json = runner.invoke(checkpoint_cli, ["inspect", str(tmp_path / "ck"), "--json"])
    assert as_json.exit_code == 0
    assert json.loads(as_json.output)["versions"] == [10, 11]
    exported = runner.invoke(checkpoint_cli, ["export", str(tmp_path / "ck"),
                                              str(tmp_path / "m.safetensors")])
    assert exported.exit_code == 0, exported.output
    assert set(load_file(str(tmp_path / "m.safetensors"))) == {"0.weight", "0.bias",
                                                               "2.weight", "2.bias"}
    missing = runner.invoke(checkpoint_cli, ["inspect", str(tmp_path / "none")])
    assert missing.exit_code != 0 and "no shard checkpoints" in missing.output


# ------------------------------------------------------------------ killed mid-write


def save_killed_at(directory: Path, t: dict[str, torch.Tensor], m: dict[str, Any], keep: int,
                   step: str) -> None:
    """Run save_shard in a forked child that SIGKILLs itself right after ``step``."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 3
        try:
            def hook(name: str, path: Path) -> None:
                if name == step:
                    os.kill(os.getpid(), signal.SIGKILL)
            set_write_hook(hook)
            save_shard(directory, 0, t, m, keep=keep)
            code = 0  # the step never came
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


COMMITTED_AT = WRITE_STEPS.index("latest_renamed")  # from this step on, the new one is live


@pytest.mark.integration  # forks a writer process per case
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("step", WRITE_STEPS)
@pytest.mark.parametrize("case", ["next version", "same version", "resumed below the orphan"])
def test_writer_killed_after_each_step(tmp_path, step, case):
    old_t, old_m = tensors(1), meta(5)
    save_shard(tmp_path, 0, old_t, old_m, keep=2)
    new_t = tensors(2)
    new_version = {"next version": 6, "same version": 5, "resumed below the orphan": 9}[case]
    new_m = meta(new_version, note="new")
    save_killed_at(tmp_path, new_t, new_m, 2, step)

    # whatever the step, a reader sees one whole checkpoint: the old, or (once LATEST
    # moved) the new
    got_t, got_m = load_shard(tmp_path, 0)
    committed = WRITE_STEPS.index(step) >= COMMITTED_AT
    if not committed:
        assert_same(got_t, old_t)
        assert got_m["version"] == 5 and "note" not in got_m
    else:
        assert_same(got_t, new_t)
        assert got_m["version"] == new_m["version"] and got_m["note"] == "new"
    assert inspect_checkpoint(tmp_path)["complete"]

    # a restarted writer then completes a checkpoint, and that one loads
    if case == "resumed below the orphan":
        # restarted from version 5, the shard reaches 7 (< 9, the killed write's) and
        # saves keeping one: the killed write's leftovers must go, not the new checkpoint
        final_t, final_m, keep = tensors(3), meta(10 if committed else 7), 1
    else:
        final_t, final_m, keep = new_t, new_m, 2
    save_shard(tmp_path, 0, final_t, final_m, keep=keep)
    got_t, got_m = load_shard(tmp_path, 0)
    assert_same(got_t, final_t)
    assert got_m["version"] == final_m["version"]
    left = files(tmp_path / "shard0")
    assert not [f for f in left if f.endswith(".tmp")], left
    assert len(left) <= 1 + 2 * keep, left
