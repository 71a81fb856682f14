"""A user's own script that evaluates held-out data, as `paramserver experiment ... --
python tests/final_script.py [--no-final]` runs it in every cell: the evaluating rank
evaluates every 2 steps and, unless --no-final, once more after ``opt.final()`` (every
worker done, the final weights loaded). :func:`evaluate` is what a test compares the
report's final figures with, on the run's final_model.safetensors."""

from __future__ import annotations

import argparse
import os

import torch

from paramserver import DistributedOptimizer


def make_model() -> torch.nn.Module:
    return torch.nn.Linear(4, 3)


def held_out() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    x = torch.randn(256, 4, generator=g)
    return x, _labels(x)


def _labels(x: torch.Tensor) -> torch.Tensor:
    return (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


@torch.no_grad()
def evaluate(model: torch.nn.Module) -> dict[str, float]:
    x, y = held_out()
    out = model(x)
    return {"loss": float(torch.nn.functional.cross_entropy(out, y)),
            "accuracy": float((out.argmax(1) == y).float().mean())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-final", action="store_true")
    args = ap.parse_args()
    rank, steps = int(os.environ["RANK"]), int(os.environ.get("PARAMSERVER_STEPS", "8"))
    torch.manual_seed(int(os.environ.get("PARAMSERVER_SEED", "0")))
    model = make_model()
    g = torch.Generator().manual_seed(rank)  # this rank's own data
    x = torch.randn(64, 4, generator=g)
    y = _labels(x)
    with DistributedOptimizer(model) as opt:
        for k in range(steps):
            if opt.evaluates and k % 2 == 0:
                opt.log(**{f"eval_{n}": v for n, v in evaluate(model).items()})
            batch = slice(8 * (k % 8), 8 * (k % 8) + 8)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            opt.step(num_samples=8, loss=loss.item())
        if opt.evaluates and not args.no_final:
            opt.final()  # every worker done: the final weights are in the model
            opt.log(**{f"eval_{n}": v for n, v in evaluate(model).items()})


if __name__ == "__main__":
    main()
