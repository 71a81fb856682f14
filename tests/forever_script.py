"""A script that trains until something stops it, as `paramserver launch -- python
tests/forever_script.py` runs it: what is left of a run whose launcher was killed."""

from __future__ import annotations

import torch

from paramserver import DistributedOptimizer


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = DistributedOptimizer(model)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with opt:
        while True:  # only its launcher's end (or a signal) ends it
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()


if __name__ == "__main__":
    main()
