"""Row-sparse tables against dense handling of the same table, and at scale.

``python -m paramserver.benchmarks.sparse`` (traffic): one worker, two async
shards. The same ``rows x dim`` float32 table trains as a dense ``nn.Embedding``
(pushed and pulled whole every step) and as a ``ShardedEmbedding`` (only the
batch's rows move), for several fractions of rows touched per step; it prints
bytes on the wire per step, step time, their ratios and the worker's RSS
growth. The goal: at 1% of rows touched, at least 50x fewer bytes.

``python -m paramserver.benchmarks.sparse scale``: a 4M x 64 float32 table
(1 GiB) over 4 sync Adagrad shards, 2 workers (``--rows``, ``--dim`` to
change). Each worker reports its RSS growth over its baseline (after
connecting, before its first row) against the table's size (goal < 10%); each
shard its peak RSS growth over its RSS at start against its share of the table
+ Adagrad state + per-row bookkeeping, + 15%.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paramserver.server.loop import ServerConfig
from paramserver.sparse.shard import owned_rows
from paramserver.util.jsontypes import JSONObject
from paramserver.workers.embedding import ShardedEmbedding
from paramserver.workers.launch.cluster import ClusterSpec, LocalCluster
from paramserver.workers.optimizer import ClientConfig, DistributedOptimizer
from paramserver.workers.worker import WorkerConfig

from .common import format_size, integer, number, peak_rss, reset_peak_rss, rss

__all__ = ["main", "scale", "traffic"]


class _Model(nn.Module):
    def __init__(self, emb: nn.Module, dim: int) -> None:
        super().__init__()
        self.emb = emb
        self.head = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids)).squeeze(1)


def _cluster(out: Path, servers: int, workers: int, mode: str, optimizer: str,
             command: list[str] | None = None) -> LocalCluster:
    spec = ClusterSpec(num_servers=servers, num_workers=workers,
                       server=ServerConfig(mode=mode, optimizer=optimizer,
                                           optimizer_args={"lr": 0.05},
                                           heartbeat_timeout=60.0),
                       worker=WorkerConfig(), command=command,
                       evaluate=False)
    return LocalCluster(spec, out)


@dataclass(frozen=True)
class Traffic:
    """One (handling, fraction of rows touched): bytes and time per step, worker RSS."""

    handling: str  # "sparse" or "dense"
    fraction: float
    rows_touched: int
    bytes_per_step: float
    step_s: float
    worker_rss_growth: int

    def to_json(self) -> JSONObject:
        return {"handling": self.handling, "fraction": self.fraction,
                "rows_touched": self.rows_touched, "bytes_per_step": self.bytes_per_step,
                "step_s": self.step_s, "worker_rss_growth": self.worker_rss_growth}


@dataclass(frozen=True)
class RankMemory:
    """One worker rank of the scale run (its ``rank{N}.json``)."""

    rank: int
    baseline_rss: int
    peak_rss: int
    seconds: float
    steps: int

    def to_json(self) -> JSONObject:
        return {"rank": self.rank, "baseline_rss": self.baseline_rss,
                "peak_rss": self.peak_rss, "seconds": self.seconds, "steps": self.steps}

    @classmethod
    def from_json(cls, d: JSONObject) -> RankMemory:
        return cls(integer(d, "rank"), integer(d, "baseline_rss"), integer(d, "peak_rss"),
                   number(d, "seconds"), integer(d, "steps"))


@dataclass(frozen=True)
class ShardMemory:
    """One shard of the scale run: its rows, what they need, how much its RSS grew."""

    shard: int
    rows: int
    need: int
    growth: int


@dataclass(frozen=True)
class Scale:
    workers: tuple[RankMemory, ...]
    shards: tuple[ShardMemory, ...]
    ok: bool


def _measure(addresses: list[str], sparse: bool, rows: int, dim: int, fractions: list[float],
             steps: int) -> list[Traffic]:
    emb = ShardedEmbedding(rows, dim, std=0.1) if sparse else nn.Embedding(rows, dim)
    model = _model = _Model(emb, dim)
    base = rss()
    opt = DistributedOptimizer(model, config=ClientConfig(servers=addresses, timeout=120))
    gen = torch.Generator().manual_seed(0)
    out = []
    try:
        for fraction in fractions:
            touched = max(1, int(rows * fraction))
            nbytes, seconds = 0, []
            for step in range(steps + 1):  # the first step warms up, not counted
                ids = torch.randperm(rows, generator=gen)[:touched]
                before = opt.sparse.nbytes if opt.sparse is not None else 0
                t0 = time.perf_counter()
                opt.zero_grad()
                nn.functional.mse_loss(_model(ids), torch.zeros(touched)).backward()
                opt.step(num_samples=touched)
                if step:
                    seconds.append(time.perf_counter() - t0)
                    assert opt.last is not None
                    nbytes += opt.last.nbytes + (
                        opt.sparse.nbytes - before if opt.sparse is not None else 0)
            out.append(Traffic("sparse" if sparse else "dense", fraction, touched,
                               nbytes / steps, sorted(seconds)[len(seconds) // 2],
                               rss() - base))
    finally:
        opt.close()
    return out


def traffic(rows: int, dim: int, fractions: list[float], steps: int, out: Path
            ) -> list[Traffic]:
    results: list[Traffic] = []
    for sparse in (False, True):
        with _cluster(out / ("sparse" if sparse else "dense"), 2, 1, "async", "sgd") as c:
            addresses = c.start_servers()
            results += _measure(addresses, sparse, rows, dim, fractions, steps)
    table = rows * dim * 4
    print(f"table {rows} x {dim} float32 ({format_size(table)}), 2 async shards, 1 worker")
    print(f"{'touched':>8} {'dense B/step':>14} {'sparse B/step':>14} {'ratio':>8} "
          f"{'dense s':>8} {'sparse s':>8} {'sparse RSS+':>12} {'dense RSS+':>12}")
    for f in fractions:
        d = next(r for r in results if r.handling == "dense" and r.fraction == f)
        s = next(r for r in results if r.handling == "sparse" and r.fraction == f)
        print(f"{f:>8.2%} {format_size(int(d.bytes_per_step)):>14} "
              f"{format_size(int(s.bytes_per_step)):>14} "
              f"{d.bytes_per_step / s.bytes_per_step:>7.1f}x {d.step_s:>8.3f} "
              f"{s.step_s:>8.3f} {format_size(max(0, s.worker_rss_growth)):>12} "
              f"{format_size(max(0, d.worker_rss_growth)):>12}")
    return results


def _worker(rows: int, dim: int, steps: int, batch: int, out: Path) -> None:
    """One rank of the scale run (started by ``launch``-style env): RSS before and after."""
    rank = int(os.environ["RANK"])
    model = _Model(ShardedEmbedding(rows, dim, std=0.01), dim)
    opt = DistributedOptimizer(model, config=ClientConfig.from_env(timeout=300))
    base = rss()
    reset_peak_rss()
    gen = torch.Generator().manual_seed(rank)
    t0 = time.perf_counter()
    for _ in range(steps):
        # Zipf-like ids: a few hot rows, a long tail
        ids = (torch.rand(batch, generator=gen) ** 3 * rows).long()
        opt.zero_grad()
        nn.functional.mse_loss(model(ids), torch.ones(batch)).backward()
        opt.step(num_samples=batch)
    seconds = time.perf_counter() - t0
    opt.close()
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(
        RankMemory(rank, base, peak_rss(), seconds, steps).to_json()))


def _proc_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def scale(rows: int, dim: int, servers: int, workers: int, steps: int, batch: int,
          out: Path) -> Scale:
    command = [sys.executable, "-m", "paramserver.benchmarks.sparse", "worker",
               "--rows", str(rows), "--dim", str(dim), "--steps", str(steps),
               "--batch", str(batch), "--out", str(out / "ranks")]
    table = rows * dim * 4
    with _cluster(out / "run", servers, workers, "sync", "adagrad", command) as cluster:
        cluster.start_servers()
        pids = [s.popen.pid for s in cluster.servers]
        base = [_proc_kib(p, "VmRSS") for p in pids]
        peak = list(base)

        def watch(_: Any) -> None:
            for i, p in enumerate(pids):
                peak[i] = max(peak[i], _proc_kib(p, "VmHWM"))

        cluster.start_workers()
        cluster.wait_workers(on_progress=watch)
        watch(None)
    ranks = [RankMemory.from_json(json.loads((out / "ranks" / f"rank{r}.json").read_text()))
             for r in range(workers)]
    print(f"table {rows} x {dim} float32 = {format_size(table)}, {servers} sync Adagrad "
          f"shards, {workers} workers, {steps} steps of {batch} ids")
    ok = True
    for r in ranks:
        growth = r.peak_rss - r.baseline_rss
        ok &= growth < 0.10 * table
        print(f"worker {r.rank}: baseline {format_size(r.baseline_rss)}, peak "
              f"{format_size(r.peak_rss)}, growth {format_size(growth)} = "
              f"{growth / table:.2%} of the table (goal < 10%), {r.seconds:.1f}s")
    shards = []
    for k in range(servers):
        n = len(owned_rows(rows, servers, k))
        # rows + Adagrad sums + owned ids and last-change versions (8 B each per row)
        need = n * dim * 4 * 2 + n * 16
        growth = peak[k] - base[k]
        ok &= growth <= need * 1.15
        shards.append(ShardMemory(k, n, need, growth))
        print(f"shard {k}: {n} rows, table+state+bookkeeping {format_size(need)}, peak growth "
              f"{format_size(growth)} = {growth / need:.2f}x (goal <= 1.15x)")
    print("goals met" if ok else "GOALS NOT MET")
    return Scale(tuple(ranks), tuple(shards), ok)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paramserver.benchmarks.sparse",
                                 description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("what", nargs="?", default="traffic", choices=["traffic", "scale", "worker"])
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--fractions", default="0.001,0.01,0.1")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = Path(args.out or f"runs/bench-sparse-{args.what}-{int(time.time())}")
    if args.what == "worker":
        _worker(args.rows, args.dim, args.steps, args.batch, out)
        return 0
    if args.what == "scale":
        result = scale(args.rows or 4_000_000, args.dim, 4, 2, args.steps or 20, args.batch,
                       out)
        return 0 if result.ok else 1
    fractions = [float(f) for f in args.fractions.split(",")]
    results = traffic(args.rows or 200_000, args.dim, fractions, args.steps or 5, out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps([r.to_json() for r in results], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
