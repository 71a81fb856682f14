"""A user's own training loop on DistributedOptimizer, as `paramserver launch -- python
tests/own_loop_script.py OUT [options]` runs it: rank and servers from the environment.

The loop scales every gradient by 0.5 before step() (as gradient clipping or loss
scaling would change it), so with the servers' lr 0.2 sync training equals
single-process SGD at lr 0.1 on the union of the ranks' batches."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests` as a package

from paramserver import ClientConfig, DistributedOptimizer
from tests import exact_tasks as T


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--unequal", action="store_true")
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--raise-at", type=int, default=-1)
    ap.add_argument("--seed", type=int, default=None, help="local init seed (default: rank)")
    ap.add_argument("--scaler", action="store_true", help="torch.amp.GradScaler on the CPU")
    ap.add_argument("--inf-at", type=int, default=-1, help="an inf gradient at this step")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    # a different local initialization on every rank: the servers' weights win
    model = T.make_model(seed=rank if args.seed is None else args.seed)
    opt = DistributedOptimizer(model, backward_passes_per_step=args.passes,
                               overlap=args.overlap,
                               config=ClientConfig.from_env(bucket_bytes=64))
    n = T.batch_size(rank, args.unequal)
    scaler = torch.amp.GradScaler("cpu") if args.scaler else None
    outcomes = []
    with opt:
        for k in range(args.steps):
            if k == args.raise_at and rank == 1:
                raise RuntimeError(f"rank {rank} gave up at step {k}")
            opt.zero_grad()
            if args.overlap:
                opt.set_num_samples(n * args.passes)
            for p in range(args.passes):
                x, y = T.batch(rank, k * args.passes + p, n)
                loss = torch.nn.functional.mse_loss(model(x), y) / args.passes
                # with overlap the gradients leave during backward, so the loop scales
                # the loss; without, it scales the gradients after backward
                loss = loss * 0.5 if args.overlap else loss
                (scaler.scale(loss) if scaler else loss).backward()
            if not args.overlap and scaler is None:
                for param in model.parameters():
                    param.grad.mul_(0.5)
            if k == args.inf_at:
                next(model.parameters()).grad[0] = float("inf")
            if rank == args.slow_rank:
                time.sleep(0.05)  # a straggler: injected delay, not synchronisation
            before = opt.last
            if scaler is not None:
                scaler.step(opt)  # skips opt.step() when a gradient is not finite
                scaler.update()
            else:
                opt.step(num_samples=None if args.overlap else n * args.passes)
            if opt.last is not before:
                outcomes.append(opt.last)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(out / f"rank{rank}.safetensors"))
    (out / f"rank{rank}.txt").write_text("\n".join(
        f"{o.clock} {o.accepted} {o.staleness} {o.weight} {','.join(map(str, o.versions))}"
        for o in outcomes))


if __name__ == "__main__":
    main()
