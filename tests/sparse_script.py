"""A float64 model whose embedding is a ShardedEmbedding, trained from the user's own
loop (`paramserver launch -- python tests/sparse_script.py OUT`); the same model with
nn.Embedding(sparse=True) is the single-process reference (tests/test_sparse_e2e.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests` as a package

from paramserver import DistributedOptimizer, ShardedEmbedding, TableSpec

ROWS, DIM, PER_SAMPLE, SEED, STD = 60, 5, 3, 7, 0.5


def spec() -> TableSpec:
    return TableSpec("emb", ROWS, DIM, "float64", "normal", STD, SEED)


class Net(nn.Module):
    def __init__(self, emb: nn.Module, seed: int = 0) -> None:
        super().__init__()
        self.emb = emb
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.out = nn.Linear(DIM, 1).double()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(ids)).sum(1)).squeeze(1)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    size = 3 + 2 * rank  # unequal batches: num_samples weighs them
    # skewed ids (hot small rows), repeated within and across workers
    ids = (torch.rand(size, PER_SAMPLE, generator=g) ** 3 * ROWS).long()
    return ids, torch.randn(size, generator=g, dtype=torch.float64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pretrained", action="store_true")
    ap.add_argument("--cache", type=int, default=0, help="rows each worker caches")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    if args.pretrained:
        from paramserver.sparse.shard import full_table
        emb = ShardedEmbedding.from_pretrained(full_table(spec()))
    else:
        emb = ShardedEmbedding(ROWS, DIM, dtype=torch.float64, std=STD, seed=SEED,
                               cache_rows=args.cache)
    model = Net(emb, seed=rank)  # ranks initialize apart: the servers' weights win
    opt = DistributedOptimizer(model)
    for k in range(args.steps):
        ids, y = batch(rank, k)
        opt.zero_grad()
        nn.functional.mse_loss(model(ids), y).backward()
        opt.step(num_samples=len(y))
    with torch.no_grad():
        table = model.emb(torch.arange(ROWS))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    save_file({"emb.weight": table.contiguous(), **{k: v.contiguous() for k, v in
                                                    model.state_dict().items()}},
              str(Path(args.out) / f"rank{rank}.safetensors"))
    opt.close()


if __name__ == "__main__":
    main()
