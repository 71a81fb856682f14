"""A user's own local-SGD loop, as `paramserver launch -- python tests/localsgd_script.py
OUT` runs it: rank r takes 2 + 2r AdamW steps between pushes (sync_every per worker)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests` as a package

from paramserver import DistributedOptimizer
from tests import exact_tasks as T


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    model = T.make_model()
    sync_every = 2 + 2 * rank
    opt = DistributedOptimizer(model, local=torch.optim.AdamW(model.parameters(), lr=0.01),
                               sync_every=sync_every)
    n = T.batch_size(rank, unequal=True)
    clocks = []
    with opt:
        for k in range(args.steps):
            opt.zero_grad()
            x, y = T.batch(rank, k, n)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step(num_samples=n)
            clocks.append(opt.clock)
        state = opt.state_dict()["local"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "sync_every": sync_every, "clocks": clocks, "taken": state["taken"],
        "inner_steps": [int(s["step"]) for s in state["inner"]["state"].values()]}))


if __name__ == "__main__":
    main()
