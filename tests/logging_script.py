"""A user's own loop that reports with ``opt.log`` and leaves the launcher's options to
DistributedOptimizer: `paramserver launch [flags] -- python tests/logging_script.py OUT
--steps N`. Each rank writes OUT/seen<rank>.json: the options its optimizer took."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests` as a package

from paramserver import DistributedOptimizer
from paramserver.errors import ConfigError
from tests import exact_tasks as T


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    model = T.make_model()
    opt = DistributedOptimizer(model)
    try:  # training figures describe the latest step: there is none yet
        opt.log(loss=1.0)
        early_log_refused = False
    except ConfigError:
        early_log_refused = True
    with opt:
        for k in range(args.steps):
            x, y = T.batch(rank, k, 5)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step(num_samples=5)
            # joins this step's record; the optimizer's own fields and non-finite
            # figures are dropped, not kept
            opt.log(loss=loss.detach(), grad_norm=1.5, worker=float("nan"),
                    clock=float("inf"), junk=float("nan"))
            if opt.evaluates and k % 2 == 1:  # held-out figures: the latest is the result's
                with torch.no_grad():
                    x, y = T.batch(99, k, 8)
                    opt.log(eval_loss=float(torch.nn.functional.mse_loss(model(x), y)),
                            eval_accuracy=k / 10)
        seen = {"seed": os.environ.get("PARAMSERVER_SEED"), "early_log_refused": early_log_refused,
                "evaluator": os.environ.get("PARAMSERVER_EVALUATOR"), "evaluates": opt.evaluates,
                "chunk_bytes": opt.plan.chunk_bytes, "early_parts": opt.client.early_parts,
                "slowdown": opt.straggler.spec.slowdown if opt.straggler else None,
                "min_step_time": opt.straggler.spec.min_step_time if opt.straggler else None}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"seen{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
