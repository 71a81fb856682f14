"""A user's own training script in a cell of `paramserver experiment ... -- python
tests/experiment_script.py OUT`: it records what its environment says and trains a tiny
model on DistributedOptimizer for PARAMSERVER_STEPS steps (the grid's hint)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from paramserver import DistributedOptimizer

ENV = ("RANK", "WORLD_SIZE", "PARAMSERVER_SEED", "PARAMSERVER_CELL", "PARAMSERVER_STEPS")


def main() -> None:
    rank, steps = int(os.environ["RANK"]), int(os.environ.get("PARAMSERVER_STEPS", "5"))
    seed = int(os.environ["PARAMSERVER_SEED"])
    out = Path(sys.argv[1]) / os.environ["PARAMSERVER_CELL"]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({k: os.environ.get(k) for k in ENV}))
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)
    g = torch.Generator().manual_seed(1000 * seed + rank)  # this rank's own data
    x = torch.randn(64, 4, generator=g)
    y = x.sum(1, keepdim=True)
    with DistributedOptimizer(model) as opt:
        for k in range(steps):
            batch = slice(8 * (k % 8), 8 * (k % 8) + 8)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
            loss.backward()
            opt.step(num_samples=8, loss=loss.item())
            print(f"rank {rank} step {k}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
