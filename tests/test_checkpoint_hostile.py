"""Checkpoints against overflow, tampering and a rerun that would take them over (issue 29,
items 8, 9 and 13).

* A step that would make the weights or the optimizer's state NaN or Inf (finite
  gradients of 3e38) is undone and counted; the checkpointer never writes what
  ``--resume`` would refuse, so the newest resumable checkpoint is never pruned.
* A tampered checkpoint (a tensor's shape or dtype, a hyperparameter, a counter, a
  manifest lying about sizes, tensors missing or extra, symlinks) is refused at load
  with one line naming the file and the field.
* A server started again on a checkpoint directory holding its earlier run refuses to
  start unless told ``--resume`` (it says "resumed shard N from version V") or
  ``--fresh`` (the old run is moved aside).

The unit tests restore as the server does (Checkpointer.read, then the core); the e2e
tests run real shard processes over loopback sockets.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from paramserver.core.probe import all_finite
from paramserver.core.shard import CoreConfig, ModeSpec, ShardCore, SliceSpec
from paramserver.core.sharding import ParamSpec, ShardPlan
from paramserver.observe.events import EventLog
from paramserver.persist.checkpoint import CheckpointError, load_shard, save_shard
from paramserver.server.checkpointer import RESTORE_ERRORS, Checkpointer
from paramserver.server.loop import READY_PREFIX
from paramserver.workers.admin import server_stats, shutdown_servers
from paramserver.workers.client import PSClient
from tests.ports import free_port

PLAN = ShardPlan([ParamSpec("w", (128,), "float32"), ParamSpec("b", (16,), "float32")], 1)
HUGE = 3e38  # finite in float32; twelve steps of it at lr 0.1 overflow the weights


def _core(optimizer: str = "adam", mode: str = "async", check_finite: bool = True,
          **args: Any) -> ShardCore:
    slices = [SliceSpec(s.key, s.numel, s.dtype) for s in PLAN.shard_slices(0)]
    config = CoreConfig(mode=ModeSpec(mode), optimizer=optimizer,
                        optimizer_args={"lr": 0.1, **args}, check_finite=check_finite,
                        scheduler="step" if optimizer == "adam" else None,
                        scheduler_args={"step_size": 2} if optimizer == "adam" else {})
    core = ShardCore(slices, config)
    core.register(0, "a", 0.0)
    core.initialize({s.key: torch.linspace(-1, 1, s.numel) for s in slices})
    return core


def _push(core: ShardCore, value: float, times: int) -> list[Any]:
    outs = []
    for _ in range(times):
        state = core.workers[0]
        grads = {k: torch.full_like(p, value) for k, p in core.params.items()}
        outs.append(core.push(0, state.last_push_id + 1, state.clock, core.version, 1, grads,
                              0.0))
    return outs


def _finite(core: ShardCore) -> bool:
    tensors, _ = core.state_dict()
    return all(all_finite(t) for t in tensors.values() if t.is_floating_point())


# ------------------------------------------------------------------ item 8: overflow


@pytest.mark.parametrize(("optimizer", "mode", "args"), [
    ("sgd", "async", {}), ("sgd", "sync", {}), ("sgd", "async", {"momentum": 0.9}),
    ("adam", "async", {}), ("adamw", "sync", {}),
])
def test_finite_pushes_that_overflow_are_undone(optimizer: str, mode: str,
                                                args: dict[str, Any]) -> None:
    core = _core(optimizer, mode, **args)
    refused: list[int] = []
    core.on_refused = refused.append
    outs = _push(core, HUGE, 12)
    assert _finite(core)  # weights and optimizer state
    assert core.stepper.refused == len(refused) > 0
    version = core.version
    assert version < 12  # a refused step makes no version
    if mode == "async":
        assert sum(o.reason == "nonfinite_step" for o in outs) == len(refused)
    # the shard trains on: ordinary gradients still step
    _push(core, 0.01, 2)
    assert core.version == version + 2 and _finite(core)


def test_the_fused_step_is_proved_safe_without_a_copy() -> None:
    """Ordinary steps of plain SGD take the fused path with no copy kept: only one
    too close to the float range is checked after."""
    core = _core("sgd")
    kept: list[int] = []
    keep = core.stepper._keep
    core.stepper._keep = lambda params: (kept.append(1), keep(params))[1]  # type: ignore
    _push(core, 0.5, 50)
    assert core.version == 50 and not kept
    _push(core, HUGE, 12)
    assert kept and _finite(core)


def test_the_checkpointer_never_writes_what_resume_refuses(tmp_path: Path) -> None:
    """Without the finite check the weights overflow; the checkpoint of that state is
    not written, and the last good one stays LATEST (pruning keeps it)."""
    core = _core("sgd", check_finite=False)
    cp = Checkpointer(0, str(tmp_path), EventLog(None), keep=1)
    _push(core, HUGE, 1)
    good = cp.save(core, PLAN, {})
    assert good is not None
    _push(core, HUGE, 12)
    assert not _finite(core)
    with pytest.raises(CheckpointError, match=r"not written.*NaN or Inf"):
        cp.save(core, PLAN, {})
    _, meta = load_shard(tmp_path, 0)
    assert meta["version"] == 1 and Path(good).exists()
    restore(tmp_path, "sgd")  # and resume accepts it


# ------------------------------------------------------------------ item 9: tampering


def restore(directory: Path, optimizer: str = "adam") -> ShardCore:
    """What ShardServer._restore does: the checkpoint's plan, a core, its state."""
    cp = Checkpointer(0, None, EventLog(None))
    plan, tensors, meta = cp.read(str(directory), None)
    slices = [SliceSpec(s.key, s.numel, s.dtype) for s in plan.shard_slices(0)]
    core = _core(optimizer)
    assert [s.key for s in slices] == list(core.specs)
    core = ShardCore(slices, core.config)
    try:
        core.load_state_dict(tensors, meta, 0.0)
    except RESTORE_ERRORS as exc:
        raise cp.unusable(str(directory), exc) from exc
    return core


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real checkpoint: adam with a step scheduler, three steps in."""
    core = _core("adam")
    _push(core, 0.01, 3)
    folder = tmp_path_factory.mktemp("good")
    Checkpointer(0, str(folder), EventLog(None)).save(core, PLAN, {})
    return folder


def _files(folder: Path) -> tuple[Path, Path]:
    name = json.loads((folder / "LATEST").read_text())["name"]
    return folder / f"{name}.json", folder / f"{name}.safetensors"


def _meta(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        manifest, _ = _files(folder)
        meta = json.loads(manifest.read_text())
        edit(meta)
        manifest.write_text(json.dumps(meta))
    return damage


def _tensors(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    """Rewrite the tensors file, and the manifest's size with it (a consistent forgery)."""
    def damage(folder: Path) -> None:
        manifest, path = _files(folder)
        tensors = load_file(str(path))
        edit(tensors)
        save_file(tensors, str(path))
        meta = json.loads(manifest.read_text())
        meta["tensors_bytes"] = path.stat().st_size
        manifest.write_text(json.dumps(meta))
    return damage


def _set(d: dict[str, Any], key: str, value: Any) -> None:
    d[key] = value


def _group(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda m: _set(m["optimizer"]["param_groups"][0], key, value)


def _symlink(which: int) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        path = [*_files(folder), folder / "LATEST"][which]
        real = folder.parent / f"elsewhere-{path.name}"
        path.rename(real)
        path.symlink_to(real)
    return damage


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    # (damage, what the one line must name besides the file)
    "optim_wrong_shape": (_tensors(lambda t: _set(t, "optim/0/exp_avg", torch.zeros(3))),
                          "optimizer.state[0].exp_avg"),
    "optim_wrong_dtype": (_tensors(lambda t: _set(t, "optim/1/exp_avg_sq",
                                                  torch.zeros(16, dtype=torch.float64))),
                          "optimizer.state[1].exp_avg_sq"),
    "optim_missing": (_tensors(lambda t: t.pop("optim/0/exp_avg_sq")),
                      "optimizer.state[0]"),
    "optim_nan": (_tensors(lambda t: _set(t, "optim/0/exp_avg", torch.full((128,), math.nan))),
                  "optim/0/exp_avg"),
    "optim_index_past_the_slices": (_tensors(lambda t: _set(t, "optim/7/exp_avg",
                                                            torch.zeros(1))),
                                    "optimizer.state[7]"),
    "extra_tensor": (_tensors(lambda t: _set(t, "evil/x", torch.zeros(1))), "evil/x"),
    "extra_weight": (_tensors(lambda t: _set(t, "param/nope", torch.zeros(1))), "nope"),
    "missing_weight": (_tensors(lambda t: t.pop("param/b")), "missing keys"),
    "weight_wrong_shape": (_tensors(lambda t: _set(t, "param/b", torch.zeros(4, 4))), "'b'"),
    "read_wrong_shape": (_tensors(lambda t: _set(t, "read/0/w", torch.zeros(2))), "'w'"),
    "lr_nan": (_meta(_group("lr", math.nan)), "optimizer.param_groups[0].lr"),
    "lr_inf": (_meta(_group("lr", math.inf)), "optimizer.param_groups[0].lr"),
    "lr_negative": (_meta(_group("lr", -1.0)), "learning rate"),
    "betas_out_of_bounds": (_meta(_group("betas", [1.5, 0.999])), "beta"),
    "eps_a_string": (_meta(_group("eps", "tiny")), "optimizer.param_groups[0].eps"),
    "group_key_missing": (_meta(lambda m: m["optimizer"]["param_groups"][0].pop("lr")),
                          "optimizer.param_groups[0]"),
    "group_params_other": (_meta(_group("params", [0])), "optimizer.param_groups[0].params"),
    "step_count_nan": (_tensors(lambda t: _set(t, "optim/0/step", torch.tensor(math.inf))),
                       "optim/0/step"),
    "scheduler_extra_key": (_meta(lambda m: _set(m["scheduler"], "optimizer", 1)),
                            "scheduler"),
    "scheduler_nan": (_meta(lambda m: _set(m["scheduler"], "last_epoch", math.nan)),
                      "scheduler.last_epoch"),
    "version_a_string": (_meta(lambda m: _set(m, "version", "5")), "'version'"),
    "samples_negative": (_meta(lambda m: _set(m, "round_samples", -1)), "'round_samples'"),
    "bytes_lie": (_meta(lambda m: _set(m, "tensors_bytes", 10)), "tensors_bytes"),
    "file_lie": (_meta(lambda m: _set(m, "tensors_file", "../x.safetensors")), "tensors_file"),
    "manifest_symlink": (_symlink(0), "symlink"),
    "tensors_symlink": (_symlink(1), "symlink"),
    "latest_symlink": (_symlink(2), "symlink"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_tampered_checkpoint_is_refused_in_one_line(saved: Path, tmp_path: Path,
                                                      case: str) -> None:
    damage, field = CASES[case]
    copy = tmp_path / "ckpt"
    (copy / "shard0").mkdir(parents=True)
    for f in (saved / "shard0").iterdir():
        (copy / "shard0" / f.name).write_bytes(f.read_bytes())
    restore(copy)  # the copy is good
    damage(copy / "shard0")
    with pytest.raises(CheckpointError) as err:
        restore(copy)
    message = str(err.value)
    assert "\n" not in message
    assert str(copy / "shard0") in message, message
    assert field in message, message


# ------------------------------------------------------------------ e2e: real shards


def _command(port: int, ckpt: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "paramserver.cli", "server", "--port", str(port),
            "--mode", "async", "--optimizer", "sgd", "--lr", "0.1", "--checkpoint-dir",
            str(ckpt), "--checkpoint-every", "1", "--checkpoint-keep", "2", *extra]


@contextmanager
def _server(cmd: list[str]) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A shard process; its address once ready. Killed at the end if still running."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until ready (or the process ends)
        assert line.startswith(READY_PREFIX), (line, proc.communicate(timeout=60))
        yield proc, line.split()[1]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=60)


def _client(address: str) -> PSClient:
    return PSClient([address], PLAN, worker=0, heartbeat_interval=0.2, timeout=20)


def _train(client: PSClient, value: float, steps: int, clock: int) -> int:
    params = {"w": torch.linspace(-1, 1, 128), "b": torch.zeros(16)}
    for _ in range(steps):
        pulled = client.pull(params, clock)
        client.push({k: torch.full_like(v, value) for k, v in params.items()},
                    pulled.versions, 1, clock)
        clock += 1
    return clock


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def test_a_shard_fed_overflowing_pushes_keeps_finite_weights_and_a_resumable_checkpoint(
        tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    port = free_port()
    with _server(_command(port, ckpt)) as (proc, address):
        client = _client(address)
        try:
            clock = client.connect()
            client.initialize({"w": torch.linspace(-1, 1, 128), "b": torch.zeros(16)})
            clock = _train(client, HUGE, 12, clock)
            params = {"w": torch.zeros(128), "b": torch.zeros(16)}
            version = client.pull(params, clock).versions[0]
        finally:
            client.close()
        assert all(all_finite(p) for p in params.values())
        stats = server_stats([address])[0]
        assert stats.core.steps_refused > 0 and version == 12 - stats.core.steps_refused
        assert shutdown_servers([address]) == []
        assert proc.wait(timeout=60) == 0
    # every checkpoint kept holds finite weights, and the newest resumes
    tensors, meta = load_shard(ckpt, 0)
    assert meta["version"] == version
    assert all(all_finite(t) for t in tensors.values() if t.is_floating_point())
    with _server(_command(port, ckpt, "--resume", str(ckpt))) as (proc, address):
        assert shutdown_servers([address]) == []
        _, err = proc.communicate(timeout=60)
    assert f"resumed shard 0 from version {version}" in err


def test_a_rerun_without_resume_does_not_take_over_the_checkpoints(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    cmd = _command(free_port(), ckpt)
    with _server(cmd) as (proc, address):
        client = _client(address)
        try:
            clock = client.connect()
            client.initialize({"w": torch.linspace(-1, 1, 128), "b": torch.zeros(16)})
            _train(client, 0.01, 3, clock)
        finally:
            client.close()
        assert server_stats([address])[0].version == 3
        assert load_shard(ckpt, 0)[1]["version"] == 3  # checkpoint_every 1: written
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    before = _digest(ckpt / "shard0")
    # the same command again: refused, in one line, and nothing touched
    rerun = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert rerun.stdout is not None
        ready = rerun.stdout.readline()  # "" once it exits; the ready line if it serves
    finally:
        if rerun.poll() is None and ready:
            rerun.kill()
        _, err = rerun.communicate(timeout=60)
    assert not ready and rerun.returncode != 0, (ready, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "earlier run" in lines[0] and "--resume" in lines[0], err
    assert _digest(ckpt / "shard0") == before
    # told to resume: it says so and serves from version 3
    with _server([*cmd, "--resume", str(ckpt)]) as (proc, address):
        assert server_stats([address])[0].version == 3
        assert shutdown_servers([address]) == []
        _, err = proc.communicate(timeout=60)
    assert "resumed shard 0 from version 3" in err
    # told to start afresh: the old run is moved aside whole, not deleted
    before = _digest(ckpt / "shard0")
    with _server([*cmd, "--fresh"]) as (proc, address):
        assert server_stats([address])[0].version == 0
        assert shutdown_servers([address]) == []
    (moved,) = [p for p in ckpt.iterdir() if p.name.startswith("shard0.before-")]
    assert _digest(moved) == before


def test_resume_refuses_an_overflowed_checkpoint_written_by_hand(tmp_path: Path) -> None:
    """save_shard itself does not check (it is the file format); the resume does."""
    core = _core("sgd", check_finite=False)
    _push(core, HUGE, 12)
    tensors, meta = core.state_dict()
    meta.update(plan=PLAN.describe(), plan_hash=PLAN.hash)
    save_shard(tmp_path, 0, tensors, meta)
    with pytest.raises(CheckpointError, match="NaN or Inf"):
        restore(tmp_path, "sgd")
    assert os.path.exists(tmp_path / "shard0" / "LATEST")
