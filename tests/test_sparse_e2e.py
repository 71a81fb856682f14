"""Row-sparse tables over real shard processes: sync training equals single-process
torch with sparse gradients; hostile sparse messages are refused; checkpoints keep rows
and per-row optimizer state."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from paramserver import ClusterSpec, ServerConfig, WorkerConfig, run_cluster
from paramserver.sparse import full_table
from tests import sparse_script as S

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8


def _run(tmp_path: Path, optimizer: str, args: dict, *extra: str, workers: int = 3,
         mode: str = "sync"):
    spec = ClusterSpec(
        num_servers=2, num_workers=workers,
        server=ServerConfig(mode=mode, optimizer=optimizer, optimizer_args=args),
        worker=WorkerConfig(servers=[]),
        command=[sys.executable, str(ROOT / "tests" / "sparse_script.py"),
                 str(tmp_path / "ranks"), "--steps", str(STEPS), *extra],
    )
    return run_cluster(spec, tmp_path / "run")


def _reference(workers: int, cls, args: dict) -> dict[str, torch.Tensor]:
    emb = nn.Embedding(S.ROWS, S.DIM, sparse=True).double()
    with torch.no_grad():
        emb.weight.copy_(full_table(S.spec()))
    model = S.Net(emb, seed=0)  # rank 0 seeds the dense weights
    opt = cls(model.parameters(), **args)
    for k in range(STEPS):
        parts = [S.batch(r, k) for r in range(workers)]
        ids = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        opt.zero_grad()
        nn.functional.mse_loss(model(ids), y).backward()
        assert model.emb.weight.grad.is_sparse
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("optimizer", "cls", "args"), [
    ("sgd", torch.optim.SGD, {"lr": 0.3}),
    ("adagrad", torch.optim.Adagrad, {"lr": 0.2}),
])
def test_sync_sparse_equals_single_process_torch(tmp_path, optimizer, cls, args):
    _run(tmp_path, optimizer, args)
    want = _reference(3, cls, args)
    start = full_table(S.spec())
    assert not torch.allclose(want["emb.weight"], start)  # training moved the rows
    for rank in range(3):
        got = load_file(str(tmp_path / "ranks" / f"rank{rank}.safetensors"))
        assert set(got) == set(want)
        for key in want:
            assert torch.allclose(got[key], want[key], rtol=0, atol=1e-9), (rank, key)


def test_from_pretrained_keeps_float64_and_trains_alike(tmp_path):
    # the same table, streamed in by rank 0 instead of drawn on the shards
    _run(tmp_path, "sgd", {"lr": 0.3}, "--pretrained", workers=2)
    want = _reference(2, torch.optim.SGD, {"lr": 0.3})
    got = load_file(str(tmp_path / "ranks" / "rank1.safetensors"))
    assert got["emb.weight"].dtype == torch.float64
    assert torch.allclose(got["emb.weight"], want["emb.weight"], rtol=0, atol=1e-9)
