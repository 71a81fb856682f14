"""Your own training loop on paramserver: a complete script.

Run it once per worker with the launcher, which starts the servers and sets
PARAMSERVER_SERVERS, RANK and WORLD_SIZE for each copy:

    paramserver launch -s 2 -n 3 --mode sync --optimizer sgd --lr 0.1 \
        --out runs/own -- python examples/own_loop/train.py --epochs 2

It has what real scripts have: a DataLoader over this rank's share of the data,
gradient clipping, mixed precision (bfloat16 autocast on the CPU; use a
GradScaler with float16 on CUDA), an evaluation every N steps, and rank 0
saving the model. The optimizer (SGD here, from --optimizer) runs on the servers.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paramserver import DistributedOptimizer


def make_data(seed: int = 0, n: int = 4096, features: int = 20, classes: int = 4):
    """A synthetic classification problem, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, features, generator=g) * 2
    y = torch.randint(0, classes, (n,), generator=g)
    x = centers[y] + torch.randn(n, features, generator=g)
    return x, y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--eval-every", type=int, default=20, help="steps between evaluations")
    ap.add_argument("--clip", type=float, default=1.0, help="max gradient norm")
    ap.add_argument("--out", default="runs/own-model", help="where rank 0 saves the model")
    args = ap.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))

    x, y = make_data()
    train, held_out = TensorDataset(x[:3584], y[:3584]), (x[3584:], y[3584:])
    mine = torch.utils.data.Subset(train, range(rank, len(train), world))  # this rank's share
    loader = DataLoader(mine, batch_size=args.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(rank))

    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    # registers with every shard; every rank starts from the servers' weights
    opt = DistributedOptimizer(model)
    loss_fn = nn.CrossEntropyLoss()

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            accuracy = (model(held_out[0]).argmax(1) == held_out[1]).float().mean().item()
        model.train()
        return accuracy

    step = 0
    with opt:  # says goodbye to the servers at the end
        for epoch in range(args.epochs):
            for inputs, targets in loader:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = loss_fn(model(inputs), targets)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                opt.step(num_samples=len(targets))  # push, then pull the new weights
                opt.log(loss=loss.item())  # into the worker's event log (report, curves)
                step += 1
                if rank == 0 and step % args.eval_every == 0:
                    accuracy = evaluate()
                    opt.log(eval_accuracy=accuracy)
                    print(f"epoch {epoch} step {step}: loss {loss.item():.4f}, "
                          f"held-out accuracy {accuracy:.3f}, "
                          f"staleness {opt.last.staleness if opt.last else 0}", flush=True)
        if rank == 0:  # every worker done, the final weights in the model: result.json's eval
            opt.final()
        final = evaluate()
        if rank == 0:
            opt.log(eval_accuracy=final)
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        save_file(model.state_dict(), str(out / "model.safetensors"))
        print(f"held-out accuracy {final:.3f}; model saved to {out / 'model.safetensors'}")


if __name__ == "__main__":
    main()
