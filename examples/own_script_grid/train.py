"""A training script compared across sync, async and SSP by `paramserver experiment`.

Every cell of the grid runs this script once per worker, with RANK, WORLD_SIZE,
PARAMSERVER_SEED (the cell's seed), PARAMSERVER_CELL (its folder under OUT/runs/)
and PARAMSERVER_STEPS (the grid's --steps, a hint) set:

    paramserver experiment --spec examples/own_script_grid/grid.toml --out runs/own-grid

or, from flags, `paramserver experiment --mode sync --mode async ... -- python
examples/own_script_grid/train.py`. `paramserver launch -- python
examples/own_script_grid/train.py` runs it once, as one cell.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paramserver import DistributedOptimizer


def make_data(n: int = 2048, features: int = 16, classes: int = 4) -> TensorDataset:
    """A synthetic classification problem, the same on every rank and in every cell."""
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(classes, features, generator=g) * 2
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(centers[y] + torch.randn(n, features, generator=g), y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=None,
                    help="steps of this worker (default: PARAMSERVER_STEPS, else 100)")
    args = ap.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    seed = int(os.environ.get("PARAMSERVER_SEED", 0))
    steps = args.steps or int(os.environ.get("PARAMSERVER_STEPS", 100))

    data = make_data()
    mine = torch.utils.data.Subset(data, range(rank, len(data), world))  # this rank's share
    # the cell's seed drives the shuffling: every mode of one seed sees the same batches
    loader = DataLoader(mine, batch_size=args.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(1000 * seed + rank))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    loss_fn = nn.CrossEntropyLoss()
    step = 0
    with DistributedOptimizer(model) as opt:  # servers and rank from the environment
        while step < steps:
            for inputs, targets in loader:
                opt.zero_grad()
                loss = loss_fn(model(inputs), targets)
                loss.backward()
                # the loss goes to this worker's step events: the report's training curves
                opt.step(num_samples=len(targets), loss=loss.item())
                step += 1
                if step == steps:
                    break
    print(f"rank {rank} of {world} in {os.environ.get('PARAMSERVER_CELL')}: {steps} steps, "
          f"last loss {loss.item():.3f}", flush=True)


if __name__ == "__main__":
    main()
