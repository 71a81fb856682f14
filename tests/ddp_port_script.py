"""The PyTorch DDP tutorial's Trainer (multigpu_torchrun.py), ported as the README says,
run by `paramserver launch -- python tests/ddp_port_script.py OUT [--snapshot FILE]`.

The port: no init_process_group, no DDP wrapper; DistributedOptimizer(model) in place of
the optimizer, built before the Trainer loads its snapshot (the tutorial's order); the
DistributedSampler kept (paramserver's, which reads RANK and WORLD_SIZE). Each rank
records the sample indices its sampler gave it, and its weights after its first step."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests` as a package

from paramserver import DistributedOptimizer, DistributedSampler
from tests import exact_tasks as T

SAMPLES, BATCH = 24, 4


def dataset() -> TensorDataset:
    x, y = T.batch(rank=99, step=0, size=SAMPLES)
    return TensorDataset(x, y)


class Trainer:
    def __init__(self, model: torch.nn.Module, train_data: DataLoader,
                 optimizer: DistributedOptimizer, snapshot: str | None, out: Path) -> None:
        self.rank = int(os.environ["RANK"])
        self.model, self.train_data, self.optimizer, self.out = model, train_data, optimizer, out
        self.epochs_run = 0
        if snapshot and os.path.exists(snapshot):
            self.model.load_state_dict(load_file(snapshot))  # after the optimizer is built
        self.indices: list[list[int]] = []
        self.steps = 0

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step(num_samples=len(targets))
        self.steps += 1
        if self.steps == 1:
            save_file({k: v.contiguous() for k, v in self.model.state_dict().items()},
                      str(self.out / f"rank{self.rank}_first.safetensors"))

    def _run_epoch(self, epoch: int) -> None:
        sampler = self.train_data.sampler
        assert isinstance(sampler, DistributedSampler)
        sampler.set_epoch(epoch)
        self.indices.append(list(sampler))
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
        (self.out / f"rank{self.rank}_indices.json").write_text(json.dumps(self.indices))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--snapshot", default=None)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = dataset()
    loader = DataLoader(data, batch_size=BATCH, shuffle=False, sampler=DistributedSampler(data))
    model = T.make_model(seed=int(os.environ["RANK"]) + 1)  # each rank its own init
    optimizer = DistributedOptimizer(model)
    with optimizer:
        Trainer(model, loader, optimizer, args.snapshot, out).train(args.epochs)


if __name__ == "__main__":
    main()
