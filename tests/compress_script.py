"""A user's loop with a compressed push, as `paramserver launch -- python
tests/compress_script.py SPEC` runs it: DistributedOptimizer(compression=SPEC) on the
exact task, sync SGD (the servers', or with --wrap the script's own); at step
--restart-at rank 1 restarts its compression as a new process would (no residuals), then
loads the state_dict it saved just before; --overlap pushes from inside backward."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests` as a package

from paramserver import ClientConfig, DistributedOptimizer
from paramserver.compress import Encoder
from tests import exact_tasks as T


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--restart-at", type=int, default=3)
    ap.add_argument("--wrap", action="store_true", help="the script's own SGD(lr=0.1)")
    ap.add_argument("--overlap", action="store_true", help="push from inside backward")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    model = T.make_model()
    own = torch.optim.SGD(model.parameters(), lr=0.1) if args.wrap else None
    opt = DistributedOptimizer(model, own, overlap=args.overlap,
                               config=ClientConfig.from_env(compression=args.spec))
    with opt:
        for k in range(args.steps):
            if rank == 1 and k == args.restart_at:
                saved = opt.state_dict()
                encoder = opt.client.encoder
                assert encoder is not None and saved["compression"]["residuals"]
                # what a restarted worker holds before it loads its state: nothing
                opt.client.encoder = Encoder(encoder.compression, seed=rank)
                opt.load_state_dict(saved)
            opt.zero_grad()
            x, y = T.batch(rank, k, T.batch_size(rank, unequal=False))
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()


if __name__ == "__main__":
    main()
