"""A script's own optimizer, wrapped by DistributedOptimizer, on real shard processes:
its class and hyper-parameters are the servers' when the launch named none, the
evaluating rank's lr change reaches them at its next step, and a worker wrapping
another optimizer is refused in one line (a launch that named another optimizer is
refused by the same check: tests/test_script_optimizer.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from paramserver import ClusterSpec, ServerConfig, WorkerConfig, run_cluster
from paramserver.observe.events import read_events
from tests import exact_tasks as T

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SCRIPT = [sys.executable, str(Path(__file__).resolve().parent / "wrapped_script.py")]
STEPS, LR, MOMENTUM, CHANGE_AT, NEW_LR = 8, 0.05, 0.9, 5, 0.0125


def _run(tmp_path: Path, server: ServerConfig, workers: int, *args: str):
    spec = ClusterSpec(num_servers=2, num_workers=workers, server=server,
                       worker=WorkerConfig(servers=[]),
                       command=[*SCRIPT, "--steps", str(STEPS), "--lr", str(LR),
                                "--momentum", str(MOMENTUM), *args])
    return run_cluster(spec, tmp_path / "run"), tmp_path / "run"


def _reference(workers: int, change_at: int = CHANGE_AT) -> dict[str, torch.Tensor]:
    """Single-process torch.optim.SGD(lr, momentum) on the union of the ranks' batches,
    its lr set to NEW_LR before step ``change_at``."""
    model = T.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for k in range(STEPS):
        if k == change_at:
            opt.param_groups[0]["lr"] = NEW_LR
        parts = [T.batch(r, k, T.batch_size(r, True)) for r in range(workers)]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.cat([p[0] for p in parts])),
                                     torch.cat([p[1] for p in parts])).backward()
        opt.step()
    return model.state_dict()


def test_the_scripts_optimizer_and_its_lr_change_run_on_the_servers(tmp_path):
    refused = tmp_path / "refused.txt"
    result, out = _run(tmp_path, ServerConfig(mode="sync", script_optimizer=True), 1,
                       "--change-at", str(CHANGE_AT), "--new-lr", str(NEW_LR),
                       "--refused", str(refused))
    assert list(result.updates_applied) == [STEPS, STEPS]
    got, want = load_file(str(out / "final_model.safetensors")), _reference(1)
    assert set(got) == set(want)
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=0, atol=1e-9), key
    assert any(not torch.allclose(T.make_model().state_dict()[k], want[k]) for k in want)
    # the change is on record, once per shard, from the evaluating rank, before its step
    for shard in (0, 1):
        changes = read_events(out / "events" / f"server{shard}.jsonl", "lr_changed")
        assert [(c["worker"], c["lr"], c["previous"], c["version"]) for c in changes] == [
            (0, NEW_LR, LR, CHANGE_AT)]
    # another worker's script wrapping Adam: refused at HELLO, in one line showing both
    line = refused.read_text()
    assert "optimizer_mismatch" in line and "\n" not in line
    assert "Adam(lr=0.05) is not the servers' SGD(lr=0.05, momentum=0.9)" in line
