"""The PyTorch DDP tutorial's Trainer ported as the README says (tests/ddp_port_script.py),
under a real `paramserver launch -- python SCRIPT` (issue 29, items 14 and 16).

* The Trainer loads `snapshot` after DistributedOptimizer(model) is built: the servers
  must be seeded with the snapshot, not with rank 0's fresh weights, so training
  resumes from it (it used to be discarded by the first step's pull).
* The script keeps its DistributedSampler (paramserver's, as the README says): without
  a process group each rank must get its own share of every epoch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from tests import ddp_port_script as S
from tests import exact_tasks as T

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
WORKERS, EPOCHS, LR = 2, 2, 0.1


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    tmp = tmp_path_factory.mktemp("ddp_port")
    snapshot = T.make_model(seed=7).state_dict()  # neither rank's own initialization
    save_file({k: v.contiguous() for k, v in snapshot.items()}, str(tmp / "snapshot.st"))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PARAMSERVER_") and k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "paramserver.cli", "launch", "-s", "1", "-n", str(WORKERS),
         "--mode", "sync", "--optimizer", "sgd", "--lr", str(LR), "--out", str(tmp / "run"),
         "--", sys.executable, str(ROOT / "tests" / "ddp_port_script.py"), str(tmp / "ranks"),
         "--snapshot", str(tmp / "snapshot.st"), "--epochs", str(EPOCHS)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp, snapshot


def _shares(epoch: int) -> list[list[int]]:
    """torch's own DistributedSampler, told the replicas and rank, for each rank."""
    data = S.dataset()
    out = []
    for rank in range(WORKERS):
        sampler = TorchSampler(data, num_replicas=WORKERS, rank=rank)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


def _reference(snapshot: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Single-process SGD from the snapshot on the union of the ranks' batches; the
    weights after every step."""
    model = T.make_model()
    model.load_state_dict(snapshot)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = S.dataset().tensors
    after = []
    for epoch in range(EPOCHS):
        shares = _shares(epoch)
        for k in range(0, len(shares[0]), S.BATCH):
            idx = [i for share in shares for i in share[k:k + S.BATCH]]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
            opt.step()
            after.append({n: t.detach().clone() for n, t in model.state_dict().items()})
    return after


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=0, atol=1e-9), key


def test_a_snapshot_loaded_after_the_optimizer_is_what_training_resumes_from(run) -> None:
    tmp, snapshot = run
    want = _reference(snapshot)
    for rank in range(WORKERS):
        # after the first step every rank holds the servers' weights: the snapshot's,
        # stepped once, not a fresh initialization's
        _assert_close(load_file(str(tmp / "ranks" / f"rank{rank}_first.safetensors")), want[0])
    _assert_close(load_file(str(tmp / "run" / "final_model.safetensors")), want[-1])
    fresh = T.make_model(seed=1).state_dict()  # rank 0's own init, which used to win
    assert any(not torch.allclose(fresh[k], snapshot[k]) for k in snapshot)


def test_the_ported_distributed_sampler_gives_each_rank_its_share(run) -> None:
    tmp, _ = run
    got = [json.loads((tmp / "ranks" / f"rank{r}_indices.json").read_text())
           for r in range(WORKERS)]
    for epoch in range(EPOCHS):
        want = _shares(epoch)
        assert [got[r][epoch] for r in range(WORKERS)] == want
        assert sorted(i for share in want for i in share) == list(range(S.SAMPLES))
    assert got[0][0] != got[0][1]  # set_epoch reshuffles, as with a process group
