"""A sync run of 3 workers checkpointed on 2 shards, resumed on 3 (``launch --resume`` on
another shard count reshards as it loads), then resharded to 1 (``paramserver
checkpoint reshard``) and resumed there, ends bit-identical to the same run kept on 2
shards (issue 47): for SGD with momentum on a model with ShardedEmbedding tables
(their rows and momentum move too), and for Adam."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_resume_e2e import ROOT, _assert_identical, _env, _final

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

def _launch(out: Path, shards: int, steps: int, args: list[str], *extra: str
            ) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "paramserver.cli", "launch", "-s", str(shards), "-n", "3",
           "--mode", "sync", "--steps", str(steps), "--out", str(out), "-q", "--no-eval",
           *args, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen[str]) -> str:
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    return output


def _on_the_fly(tmp_path: Path, args: list[str], steps: int, *extra: str) -> Path:
    """A run of ``steps`` on 2 shards checkpointed, then resumed on 3 until ``2 * steps``,
    checkpointing into the same directory: the shards reshard it as they load it, and
    the run checkpoints beside it (where, it says). Returns that directory."""
    ckpt = tmp_path / "ckpt"
    _finish(_launch(tmp_path / "on2", 2, steps, [*args, *extra, "--checkpoint-dir",
                                                 str(ckpt)]))
    said = _finish(_launch(tmp_path / "on3", 3, 2 * steps, [
        *args, *extra, "--checkpoint-dir", str(ckpt), "--resume", str(ckpt)]))
    beside = tmp_path / "ckpt.3shards"
    assert str(beside) in said.replace("\n", "")
    return beside


def test_sgd_momentum_with_embedding_tables_on_2_then_3_then_1_shards_ends_as_kept_on_2(
        tmp_path: Path) -> None:
    args = ["--task", "recsys", "--task-arg", "users=3000", "--task-arg", "items=700",
            "--task-arg", "samples=3000", "--task-arg", "batch_size=64",
            "--optimizer", "sgd", "--lr", "0.05", "--optimizer-arg", "momentum=0.9"]
    kept = _launch(tmp_path / "kept", 2, 6, args)
    on3 = _on_the_fly(tmp_path, args, 2)
    one = tmp_path / "ckpt1"
    done = subprocess.run([sys.executable, "-m", "paramserver.cli", "checkpoint", "reshard",
                           str(on3), "--to", "1", "--out", str(one)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    _finish(_launch(tmp_path / "on1", 1, 6, [*args, "--checkpoint-dir", str(one),
                                             "--resume", str(one)]))
    _finish(kept)
    _assert_identical(_final(tmp_path / "on1"), _final(tmp_path / "kept"))


def test_adam_replicated_on_2_then_3_shards_ends_as_kept_on_2(tmp_path: Path) -> None:
    # the backups write the checkpoints of a replicated run; each replica reshards them,
    # and each worker's reconstruction under compressed pulls moves with its slices
    args = ["--task", "digits-mlp", "--optimizer", "adam", "--lr", "0.01",
            "--pull-compression", "topk:ratio=0.1"]
    kept = _launch(tmp_path / "kept", 2, 4, args)
    _on_the_fly(tmp_path, args, 2, "--replicas", "1")
    _finish(kept)
    _assert_identical(_final(tmp_path / "on3"), _final(tmp_path / "kept"))
