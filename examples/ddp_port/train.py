"""The PyTorch DDP tutorial's trainer (``multigpu_torchrun.py``) ported to paramserver.

One script, two ways to run it: under torchrun with DDP (``--ddp``, the tutorial's
code, gloo on the CPU), or as every worker of a paramserver run::

    torchrun --nproc-per-node 2 examples/ddp_port/train.py --ddp
    paramserver launch -s 1 -n 2 --mode sync -- python examples/ddp_port/train.py --lr 0.05
    paramserver experiment --spec examples/ddp_port/grid.toml   # sync, async, ssp:2

The port is the lines marked ``# port``: no process group and no DDP wrapper;
the tutorial's ``torch.optim.SGD`` wrapped in ``DistributedOptimizer`` (the servers run
it, with this script's ``--lr``), built before the snapshot is loaded (the tutorial's order); a run
resumed from the servers' checkpoints (``launch --resume DIR``) goes on at
``opt.clock``, the steps this rank has done, skipping them (and the snapshot); the
DistributedSampler is told the replicas and rank from torchrun's environment, which
``paramserver launch`` and ``run`` set as well; ``opt.log`` reports the loss and, on
the worker that evaluates (``opt.evaluates``), the held-out loss and accuracy, and at
the end, after ``opt.final()`` (every worker done, the final weights in the model), the
run's final figures. The snapshot is a safetensors file, not a pickle.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from paramserver import DistributedOptimizer


def make_data(n: int, seed: int) -> TensorDataset:
    """A small 4-class problem (the tutorial's MyTrainDataset is random numbers); every
    seed draws other samples of the same classes (seed 1 trains, seed 2 is held out)."""
    centers = torch.randn(4, 20, generator=torch.Generator().manual_seed(0),
                          dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    x = (centers[y] + 1.5 * torch.randn(n, 20, generator=g, dtype=torch.float64)).float()
    return TensorDataset(x, y)


class Trainer:
    def __init__(self, model: torch.nn.Module, train_data: DataLoader,
                 optimizer: torch.optim.Optimizer, save_every: int, snapshot_path: str | None,
                 ddp: bool, held_out: Dataset) -> None:
        self.rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.held_out = held_out
        self.epochs_run = 0
        self.skip = 0  # batches of epochs_run done already
        self.losses: list[float] = []
        self.opt = optimizer if isinstance(optimizer, DistributedOptimizer) else None  # port
        if self.opt is not None and self.opt.clock:  # port: a resumed run (launch --resume):
            # the servers' checkpoint says where training stands, and the model holds its
            # weights: skip the steps done, not the snapshot's epochs
            self.epochs_run, self.skip = divmod(self.opt.clock, len(train_data))
            print(f"rank {self.rank}: resuming at step {self.opt.clock} (epoch "
                  f"{self.epochs_run}, batch {self.skip})")
        elif snapshot_path and os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)
        if ddp:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model = DDP(self.model)

    def _load_snapshot(self, path: str) -> None:
        self.model.load_state_dict(load_file(path))
        with open(path + ".json") as fh:
            self.epochs_run = json.load(fh)["EPOCHS_RUN"]
        print(f"rank {self.rank}: resuming from the snapshot at epoch {self.epochs_run}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        self.losses.append(loss.item())
        if self.opt is not None:
            self.opt.log(loss=loss.item())  # port: the step's loss, for the report

    def _run_epoch(self, epoch: int) -> None:
        assert isinstance(self.train_data.sampler, DistributedSampler)
        self.train_data.sampler.set_epoch(epoch)
        for i, (source, targets) in enumerate(self.train_data):
            if epoch == self.epochs_run and i < self.skip:
                continue  # port: done before the run was resumed
            self._run_batch(source, targets)
        self._evaluate()

    def _evaluate(self) -> None:
        if self.opt is not None and self.opt.evaluates:  # port: held-out figures
            x, y = self.held_out[:]
            with torch.no_grad():
                out = self.model(x)
            self.opt.log(eval_loss=F.cross_entropy(out, y).item(),
                         eval_accuracy=(out.argmax(1) == y).double().mean().item())

    def _save_snapshot(self, epoch: int) -> None:
        assert self.snapshot_path is not None
        model = getattr(self.model, "module", self.model)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  self.snapshot_path)
        Path(self.snapshot_path + ".json").write_text(json.dumps({"EPOCHS_RUN": epoch + 1}))

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.snapshot_path and self.rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)
        if self.opt is not None and self.opt.evaluates:
            # port: wait for every worker (a straggler's last pushes count), then the
            # final weights' figures are the run's final ones (result.json, the report)
            self.opt.final()
            self._evaluate()


def main() -> None:
    ap = argparse.ArgumentParser(description="the DDP tutorial's trainer, ported")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--save-every", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.05,
                    help="SGD's learning rate (under paramserver the servers run it)")
    ap.add_argument("--snapshot", default=None, help="default: none (a fresh start)")
    ap.add_argument("--ddp", action="store_true", help="the tutorial as it was: torchrun + DDP")
    ap.add_argument("--losses", default=None, help="write this rank's step losses as JSON here")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.ddp:
        torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    if not args.ddp:
        optimizer = DistributedOptimizer(model, optimizer)  # port: the servers step
    data = make_data(256, seed=1)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=False,
                        sampler=DistributedSampler(data, num_replicas=world, rank=rank))
    trainer = Trainer(model, loader, optimizer, args.save_every,
                      args.snapshot, args.ddp, make_data(256, seed=2))
    trainer.train(args.epochs)
    if args.losses:
        Path(args.losses).mkdir(parents=True, exist_ok=True)
        (Path(args.losses) / f"rank{rank}.json").write_text(json.dumps(trainer.losses))
    if isinstance(optimizer, DistributedOptimizer):
        optimizer.close()  # port: goodbye to the servers (at exit, it would be said anyway)
    else:
        torch.distributed.destroy_process_group()
    print(f"rank {rank}: {len(trainer.losses)} steps, last loss {trainer.losses[-1]:.4f}")


if __name__ == "__main__":
    main()
