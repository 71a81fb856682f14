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

STEPS = (3, 6, 9)  # on 2 shards, then 3, then 1


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


@pytest.mark.parametrize("args", [
    pytest.param(["--task", "recsys", "--task-arg", "users=3000", "--task-arg", "items=700",
                  "--task-arg", "samples=3000", "--task-arg", "batch_size=64",
                  "--optimizer", "sgd", "--lr", "0.05", "--optimizer-arg", "momentum=0.9"],
                 id="sgd-momentum-embedding"),
    pytest.param(["--task", "digits-mlp", "--optimizer", "adam", "--lr", "0.01"], id="adam"),
])
def test_resumed_on_3_then_1_shards_ends_as_kept_on_2(tmp_path: Path, args: list[str]) -> None:
    kept = _launch(tmp_path / "kept", 2, STEPS[2], args)
    ckpt = tmp_path / "ckpt"
    _finish(_launch(tmp_path / "on2", 2, STEPS[0], args, "--checkpoint-dir", str(ckpt)))
    # --resume on another count, checkpointing into the same directory: the shards
    # reshard it as they load it, and the run checkpoints beside it
    said = _finish(_launch(tmp_path / "on3", 3, STEPS[1], [*args, "--checkpoint-dir",
                                                          str(ckpt), "--resume", str(ckpt)]))
    (beside,) = tmp_path.glob("ckpt.3shards-*")
    assert str(beside) in said.replace("\n", "")
    one = tmp_path / "ckpt1"
    done = subprocess.run([sys.executable, "-m", "paramserver.cli", "checkpoint", "reshard",
                           str(beside), "--to", "1", "--out", str(one)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    _finish(_launch(tmp_path / "on1", 1, STEPS[2], [*args, "--checkpoint-dir", str(one),
                                                    "--resume", str(one)]))
    _finish(kept)
    _assert_identical(_final(tmp_path / "on1"), _final(tmp_path / "kept"))
