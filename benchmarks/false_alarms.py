"""The watchdog's false-alarm rate on healthy runs, in virtual time.

    python -m paramserver.benchmarks.false_alarms --out runs/false_alarms          # the full grid
    python -m paramserver.benchmarks.false_alarms --steps 300 --seeds 1            # a quick slice

Every cell of (task x optimizer x mode x seed) is a healthy run of 2 shards and
3 workers, simulated by :mod:`paramserver.workers.launch.virtual` (real gradients, the real
shard core, virtual time), with each shard's :class:`~paramserver.observe.watchdog.Watchdog`
fed what a real shard feeds it: every push (loss, gradient norm and cosine,
staleness, decision), every optimizer step (update and weight norms) and the live
clocks. Healthy runs must raise no alarm; ``loss_converged`` hints are counted
apart. Writes ``false_alarms.json`` (one row per run) and prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paramserver.core.shard import GradStats, StepStats
from paramserver.observe import records as ev
from paramserver.observe.watchdog import PushObservation, StepObservation, Watchdog
from paramserver.server.loop import ServerConfig
from paramserver.util.jsontypes import JSONObject
from paramserver.workers.launch.cluster import ClusterSpec
from paramserver.workers.launch.virtual import SimSpec, Simulator
from paramserver.workers.worker import WorkerConfig

log = logging.getLogger(__name__)

#: (name, optimizer, its arguments): the learning rates the docs' healthy runs use
OPTIMIZERS: dict[str, tuple[str, dict[str, float]]] = {
    "sgd": ("sgd", {"lr": 0.1}),
    "momentum": ("sgd", {"lr": 0.05, "momentum": 0.9}),
    "adam": ("adam", {"lr": 1e-3}),
}
MODES = ("sync", "async", "ssp")
TASKS = ("digits-mlp", "synthetic-logreg")


class WatchedSimulator(Simulator):
    """A simulation whose shards each run a watchdog, as a real shard does."""

    def _dog(self, shard: int) -> Watchdog:
        dogs: dict[int, Watchdog] = self.__dict__.setdefault("dogs", {})
        if shard not in dogs:
            server = self.spec.server
            dog = Watchdog(shard, server.watchdog_config(), bounded_lag=server.mode != "async")
            dog.elements = sum(s.numel for s in self.plan.shard_slices(shard))
            dogs[shard] = dog
        return dogs[shard]

    def _observer(self, shard: int) -> Any:
        keep = super()._observer(shard)

        def both(stats: GradStats | StepStats) -> None:
            keep(stats)
            if isinstance(stats, StepStats):
                self._dog(shard).observe_step(StepObservation(
                    stats.version, stats.update_norm, stats.weight_norm, stats.lr))
        return both

    def _build(self) -> None:
        super()._build()
        for shard, events in enumerate(self.server_events):
            write = events.write

            def tee(record: ev.Event, t: float | None = None, _write: Any = write,
                    _shard: int = shard) -> None:
                _write(record, t)
                if isinstance(record, ev.Push):
                    self._observe_push(_shard, record)
            events.write = tee  # type: ignore[method-assign]

    def _observe_push(self, shard: int, p: ev.Push) -> None:
        """A push record to shard ``shard``'s dog."""
        dog = self._dog(shard)
        dog.observe_push(PushObservation(p.worker, p.version, p.accepted, p.staleness, p.reason,
                                         p.weight, p.grad_norm, p.cosine, p.loss))
        live = {w.worker: w.clock for w in self.cores[shard].workers.values()
                if w.live and not w.finished}
        if dog.pushes % max(1, len(live)) == 0:  # about once a round, as the server does
            dog.observe_clocks(live, self.now)


@dataclass(frozen=True)
class CellRun:
    """One healthy run and the alarms and hints its watchdogs raised."""

    task: str
    optimizer: str
    mode: str
    seed: int
    steps: int
    alarms: int
    signals: dict[str, int]  # alarms by signal
    alarm_messages: tuple[str, ...]  # the first few
    hints: int
    final_train_loss: tuple[float, ...]  # each worker's
    wall_seconds: float

    def to_json(self) -> JSONObject:
        return {"task": self.task, "optimizer": self.optimizer, "mode": self.mode,
                "seed": self.seed, "steps": self.steps, "alarms": self.alarms,
                "signals": {k: v for k, v in self.signals.items()},
                "alarm_messages": list(self.alarm_messages), "hints": self.hints,
                "final_train_loss": list(self.final_train_loss),
                "wall_seconds": self.wall_seconds}


def run_cell(task: str, optimizer: str, mode: str, seed: int, steps: int) -> CellRun:
    name, args = OPTIMIZERS[optimizer]
    spec = ClusterSpec(
        num_servers=2, num_workers=3,
        server=ServerConfig(mode=mode, staleness_bound=2, optimizer=name, optimizer_args=args),
        worker=WorkerConfig(task=task, steps=steps, seed=seed),
        evaluate=False,
    )
    t0 = time.perf_counter()
    sim = WatchedSimulator(spec, SimSpec(), None)
    result = sim.run()
    dogs: dict[int, Watchdog] = sim.__dict__.get("dogs", {})
    alarms = [a for d in dogs.values() for a in d.alarms]
    hints = [h for d in dogs.values() for h in d.hints]
    losses = tuple(math.nan if w.final_train_loss is None else w.final_train_loss
                   for w in result.finished)
    return CellRun(task, optimizer, mode, seed, steps, len(alarms),
                   dict(Counter(a.signal for a in alarms)),
                   tuple(a.message for a in alarms)[:5], len(hints), losses,
                   time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paramserver.benchmarks.false_alarms",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000, help="steps per worker")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default=None, help="directory for false_alarms.json")
    opts = parser.parse_args(argv)
    rows = []
    grid = itertools.product(opts.tasks.split(","), opts.optimizers.split(","),
                             opts.modes.split(","), range(opts.seeds))
    for task, optimizer, mode, seed in grid:
        row = run_cell(task, optimizer, mode, seed, opts.steps)
        rows.append(row)
        print(f"{task:18} {optimizer:9} {mode:6} seed {seed}: {row.alarms} alarm(s) "
              f"{row.signals or ''} {row.hints} hint(s), final loss "
              f"{min(row.final_train_loss):.4g}..{max(row.final_train_loss):.4g} "
              f"({row.wall_seconds:.0f}s)", flush=True)
    total = sum(r.alarms for r in rows)
    print(f"{len(rows)} healthy runs x {opts.steps} steps: {total} alarm(s), "
          f"{sum(1 for r in rows if r.alarms)} run(s) with any; "
          f"{sum(r.hints for r in rows)} loss_converged hint(s)")
    if opts.out:
        out = Path(opts.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "false_alarms.json").write_text(json.dumps(
            {"args": vars(opts), "runs": [r.to_json() for r in rows]}, indent=2))
    return 1 if total else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    raise SystemExit(main())


__all__ = ["CellRun", "WatchedSimulator", "main", "run_cell"]
