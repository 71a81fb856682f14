"""A user's own training loop on DistributedOptimizer, launched with `paramserver launch --
COMMAND` (and `paramserver run -- COMMAND` under torchrun): real processes on loopback.

The script (tests/own_loop_script.py) scales every gradient by 0.5 before step();
with the servers' lr 0.2 the result must equal single-process torch at lr 0.1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from paramserver import ClusterSpec, ServerConfig, WorkerConfig, run_cluster
from paramserver.observe.events import read_events
from tests import exact_tasks as T
from tests.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = [sys.executable, str(ROOT / "tests" / "own_loop_script.py")]
STEPS = 12


def _run(tmp_path: Path, mode: str, workers: int, *args: str, servers: int = 2,
         optimizer: str = "sgd", optimizer_args: dict | None = None, **server: object):
    out = tmp_path / "run"
    spec = ClusterSpec(
        num_servers=servers, num_workers=workers,
        server=ServerConfig(mode=mode, optimizer=optimizer,
                            optimizer_args=optimizer_args or {"lr": 0.2}, **server),
        worker=WorkerConfig(servers=[]),
        command=[*SCRIPT, str(tmp_path / "ranks"), "--steps", str(STEPS), *args],
    )
    return run_cluster(spec, out), out


def _reference(workers: int, opt_cls, opt_args, passes: int = 1, unequal: bool = True,
               halve: bool = False):
    """Single-process torch on the union of every rank's micro-batches of each step
    (``halve``: with the gradient halved, as the script does; for SGD, halving at lr 0.2
    is lr 0.1 instead)."""
    model = T.make_model()
    opt = opt_cls(model.parameters(), **opt_args)
    for k in range(STEPS):
        parts = [T.batch(r, k * passes + p, T.batch_size(r, unequal))
                 for r in range(workers) for p in range(passes)]
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if halve:
            for p in model.parameters():
                p.grad.mul_(0.5)
        opt.step()
    return model.state_dict()


def _assert_equal(got, want) -> None:
    assert set(got) == set(want)
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=0, atol=1e-9), key
    init = T.make_model().state_dict()
    assert any(not torch.allclose(init[k], want[k]) for k in want)  # training moved them


def _outcomes(tmp_path: Path, rank: int) -> list[list[str]]:
    return [line.split() for line in
            (tmp_path / "ranks" / f"rank{rank}.txt").read_text().splitlines()]


@pytest.mark.parametrize(("optimizer", "cls", "args"), [
    ("sgd", torch.optim.SGD, {"lr": 0.1}),
    ("adam", torch.optim.Adam, {"lr": 0.01}),
])
def test_sync_through_the_users_loop_equals_single_process_torch(tmp_path, optimizer, cls,
                                                                 args):
    # 3 ranks with unequal batches (num_samples weighs them) and different local inits
    server_args = {"lr": 0.2} if optimizer == "sgd" else {"lr": 0.01}
    result, out = _run(tmp_path, "sync", 3, "--unequal", optimizer=optimizer,
                       optimizer_args=server_args)
    # Adam does not care about the gradient's scale but for eps: the reference halves too
    want = _reference(3, cls, args, halve=optimizer == "adam")
    _assert_equal(load_file(str(tmp_path / "ranks" / "rank0.safetensors")), want)
    _assert_equal(load_file(str(out / "final_model.safetensors")), want)
    assert list(result.updates_applied) == [STEPS, STEPS]
    for rank in range(3):  # every rank holds the servers' weights, whatever its init
        _assert_equal(load_file(str(tmp_path / "ranks" / f"rank{rank}.safetensors")), want)
        steps = read_events(out / "events" / f"worker{rank}.jsonl", "step")
        assert len(steps) == STEPS and all(s["accepted"] for s in steps)


def test_async_one_worker_equals_single_process(tmp_path):
    _, out = _run(tmp_path, "async", 1, "--unequal", servers=2)
    _assert_equal(load_file(str(out / "final_model.safetensors")),
                  _reference(1, torch.optim.SGD, {"lr": 0.1}))


def test_overlap_and_accumulation_give_the_same_sync_training(tmp_path):
    # two backward passes per step, gradients pushed from inside the second backward
    _, out = _run(tmp_path, "sync", 2, "--unequal", "--passes", "2", "--overlap")
    _assert_equal(load_file(str(out / "final_model.safetensors")),
                  _reference(2, torch.optim.SGD, {"lr": 0.1}, passes=2))


def test_ssp_keeps_its_bound_with_a_slowed_rank(tmp_path):
    result, _ = _run(tmp_path, "ssp", 3, "--slow-rank", "0", staleness_bound=1)
    for shard in result.servers:
        assert shard["max_answered_gap"] <= 1
    stale = [int(o[2]) for r in (1, 2) for o in _outcomes(tmp_path, r)]
    assert max(stale) > 0  # the fast ranks did run ahead, as far as the bound lets them


def test_a_staleness_policy_acts_on_the_users_pushes(tmp_path):
    # one shard: a push is refused or applied whole (with two, each shard decides)
    result, _ = _run(tmp_path, "async", 3, "--slow-rank", "0", policy="reject",
                     policy_args={"max_staleness": 0}, servers=1)
    accepted = [o[1] == "True" for r in range(3) for o in _outcomes(tmp_path, r)]
    assert not all(accepted) and any(accepted)  # stale pushes refused, fresh ones applied
    shard = result.servers[0]
    rejected = sum(sum(w["rejected"].values()) for w in shard["workers"].values())
    assert rejected == accepted.count(False)


def test_gradscaler_skips_a_step_with_inf_gradients(tmp_path):
    result, out = _run(tmp_path, "async", 1, "--scaler", "--inf-at", "3", servers=1)
    assert list(result.updates_applied) == [STEPS - 1]  # the inf step pushed nothing
    assert len(read_events(out / "events" / "worker0.jsonl", "step")) == STEPS - 1


def _env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("PARAMSERVER_", "TORCHELASTIC_"))
            and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    base["PYTHONPATH"] = str(ROOT)
    base["OMP_NUM_THREADS"] = "1"
    return {**base, **extra}


def test_launch_reports_the_rank_that_raised(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "paramserver.cli", "launch", "-s", "1", "-n", "2", "--mode",
         "async", "--quiet", "--out", str(out), "--", *SCRIPT, str(tmp_path / "ranks"),
         "--raise-at", "2"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "worker1" in proc.stderr
    assert "RuntimeError: rank 1 gave up at step 2" in proc.stderr


def test_run_under_torchrun_runs_the_users_script_and_saves_the_model(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
         "3", "--master-port", str(free_port()), "-m", "paramserver.cli", "run",
         "--num-servers", "1", "--mode", "sync", "--optimizer-arg", "lr=0.2", "--out",
         str(out), "--", *SCRIPT, str(tmp_path / "ranks"), "--steps", str(STEPS),
         "--unequal"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    want = _reference(2, torch.optim.SGD, {"lr": 0.1})
    _assert_equal(load_file(str(out / "final_model.safetensors")), want)
    _assert_equal(load_file(str(tmp_path / "ranks" / "rank1.safetensors")), want)
