"""A sync run killed whole (every process, SIGKILL) and resumed with `launch --resume`
ends bit-identical to the same run never killed (issue 43, item 3): for the built-in
loop, and for the DDP tutorial's port (examples/ddp_port/train.py), which skips the
work already done by the documented resume point, `opt.clock`.

It takes every part of resuming: the shards resume from the newest round all of them
hold (one may have checkpointed a round the other had not); each worker's data goes on
at its clock; and no resumed round closes before every worker is back, so no worker
trains a round alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from paramserver.observe.events import read_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT_EVERY = 4


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PARAMSERVER_") and k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    return env


def _launch(args: list[str], out: Path, ckpt: Path, *extra: str) -> subprocess.Popen[str]:
    """`paramserver launch` in a session of its own: a kill of its group is a kill of
    every process of the run."""
    cmd = [sys.executable, "-m", "paramserver.cli", "launch", "-s", "2", "-n", "2",
           "--mode", "sync", "--checkpoint-dir", str(ckpt),
           "--checkpoint-every", str(CHECKPOINT_EVERY), "--out", str(out), "-q", *extra, *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen[str]) -> None:
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]


def _latest(ckpt: Path, shard: int) -> int:
    try:
        return int(json.loads((ckpt / f"shard{shard}" / "LATEST").read_text())["version"])
    except (OSError, ValueError, KeyError):
        return -1


def _kill_after_a_checkpoint(proc: subprocess.Popen[str], ckpt: Path) -> None:
    """SIGKILL the whole run once every shard has checkpointed (its first checkpoint,
    at CHECKPOINT_EVERY rounds) and one has gone past it."""
    deadline = time.monotonic() + 200
    while not (min(_latest(ckpt, s) for s in (0, 1)) >= CHECKPOINT_EVERY
               and max(_latest(ckpt, s) for s in (0, 1)) >= 2 * CHECKPOINT_EVERY):
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "no checkpoint came"
        time.sleep(0.02)  # polling files another process writes
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)


def _final(out: Path) -> dict:
    return load_file(str(out / "final_model.safetensors"))


def _resumed_and_uninterrupted(tmp: Path, args: list[str]) -> tuple[dict, dict, Path]:
    # the run never killed goes on beside the killed one and its resumption (own ports,
    # own folders; a sync run's weights do not depend on timing)
    whole = _launch(args, tmp / "whole", tmp / "ckpt-whole")
    killed = _launch(args, tmp / "killed", tmp / "ckpt")
    _kill_after_a_checkpoint(killed, tmp / "ckpt")
    resumed = _launch(args, tmp / "resumed", tmp / "ckpt", "--resume", str(tmp / "ckpt"))
    try:
        _finish(whole)
    finally:
        _finish(resumed)
    return _final(tmp / "resumed"), _final(tmp / "whole"), tmp / "resumed"


def _assert_identical(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].equal(want[name]), name


def _no_round_alone(run: Path, pushes: int) -> None:
    """Every resumed round held both workers' pushes: each shard's push records of the
    resumed run come in pairs per clock, and no worker was called dead."""
    for shard in (0, 1):
        pushes_seen = read_events(run / "events" / f"server{shard}.jsonl", "push")
        by_clock: dict[int, set[int]] = {}
        for p in pushes_seen:
            by_clock.setdefault(p["clock"], set()).add(p["worker"])
        assert by_clock and all(w == {0, 1} for w in by_clock.values()), by_clock
        assert max(by_clock) == pushes - 1
        assert read_events(run / "events" / f"server{shard}.jsonl", "worker_dead") == []


def test_the_built_in_loop_resumes_bit_identical(tmp_path: Path) -> None:
    # with compressed pulls (core/pullsqueeze.py): each worker's reconstruction is in the
    # checkpoint, and a resumed worker gets exactly the copy the run never killed holds
    steps = 3 * CHECKPOINT_EVERY
    got, want, run = _resumed_and_uninterrupted(tmp_path, [
        "--task", "digits-mlp", "--steps", str(steps), "--optimizer", "adam", "--lr", "0.01",
        "--min-step-time", "0.1", "--no-eval", "--pull-compression", "topk:ratio=0.1"])
    _assert_identical(got, want)
    _no_round_alone(run, steps)
    starts = [read_events(run / "events" / f"worker{r}.jsonl", "worker_start")[0]
              for r in (0, 1)]
    # both resumed at the round both shards held, not at the start
    assert starts[0]["clock"] == starts[1]["clock"] > 0


def test_the_ddp_port_resumes_bit_identical_by_opt_clock(tmp_path: Path) -> None:
    steps_per_epoch, epochs = 8, 2  # 256 samples, 2 ranks, batches of 16
    # no optimizer flags: the servers run the script's own SGD, and a resume keeps it
    got, want, run = _resumed_and_uninterrupted(tmp_path, [
        "--min-step-time", "0.1", "--",
        "python", "examples/ddp_port/train.py", "--epochs", str(epochs)])
    _assert_identical(got, want)
    _no_round_alone(run, steps_per_epoch * epochs)
    for rank in (0, 1):  # it skipped what was done: its steps end where the run does
        steps = read_events(run / "events" / f"worker{rank}.jsonl", "step")
        assert steps[0]["clock"] > 1 and steps[-1]["clock"] == steps_per_epoch * epochs
