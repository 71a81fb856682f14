"""A script that wraps its own optimizer, as `paramserver launch -- python
tests/wrapped_script.py [options]` runs it: torch.optim.SGD with the script's lr and
momentum, and (``--change-at K --new-lr L``) the evaluating rank's plateau rule,
``param_groups[...]["lr"] = L`` before step K. No launch optimizer flags.

``--refused FILE``: before it leaves, rank 0 also tries a second worker (rank 1) wrapping
another optimizer, and writes what refused it into FILE."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests` as a package

from paramserver import ClientConfig, DistributedOptimizer
from paramserver.errors import OptimizerMismatchError
from tests import exact_tasks as T


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--change-at", type=int, default=-1)
    ap.add_argument("--new-lr", type=float, default=0.0)
    ap.add_argument("--refused", default=None)
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    model = T.make_model(seed=rank)  # the servers' weights (rank 0's) win
    opt = DistributedOptimizer(
        model, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum))
    with opt:
        for k in range(args.steps):
            if k == args.change_at:  # every rank runs it; the evaluating rank's counts
                for group in opt.param_groups:
                    group["lr"] = args.new_lr
            opt.zero_grad()
            x, y = T.batch(rank, k, T.batch_size(rank, True))
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step(num_samples=len(y))
        if args.refused and rank == 0:
            try:
                DistributedOptimizer(model, torch.optim.Adam(model.parameters(), lr=args.lr),
                                     config=ClientConfig.from_env(rank=1, world_size=2))
            except OptimizerMismatchError as exc:
                Path(args.refused).write_text(str(exc))


if __name__ == "__main__":
    main()
