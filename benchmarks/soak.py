"""Soak test: many async workers against real shards for minutes; watch for deadlock,
memory growth and counters that do not add up.

Run (not part of the test suite)::

    .venv/bin/python -m paramserver.benchmarks.soak --workers 16 --duration 180 --out runs/soak

Every ``--sample`` seconds it reads each server's resident memory (``VmRSS`` in
``/proc/<pid>/status``), the shards' versions (STATS) and every worker's step
count (its event log). At the end it stops the workers (SIGINT), lets the
shards settle and checks:

* progress: every shard's version grew in every ``--window`` seconds, and every
  worker made steps in the second half of the run (no deadlock, no starvation);
* memory: the servers' median RSS in the second half is within ``--max-growth``
  of the first half (after a warm-up), and the RSS trend of the second half is
  under ``--max-slope`` MiB per minute;
* counters: per shard and worker, pushes = applied + rejected; the shard's
  version = the sum of applied pushes (async: one step per push); and the
  server saw each worker's pushes that the worker logged, plus at most the one
  in flight when it was stopped.

It writes ``soak.json`` (samples and verdicts) and ``soak.png`` in ``--out``
and exits non-zero if a check fails.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from paramserver.errors import ConfigError, RequestTimeoutError
from paramserver.observe.events import read_events
from paramserver.server.loop import ServerConfig
from paramserver.util.jsontypes import JSONObject
from paramserver.wire.stats import ShardStats
from paramserver.workers.admin import server_stats
from paramserver.workers.launch.cluster import ClusterSpec, LocalCluster
from paramserver.workers.stragglers import StragglerSpec
from paramserver.workers.worker import WorkerConfig

__all__ = ["Sample", "SoakChecks", "SoakConfig", "SoakResult", "main", "rss_of", "run_soak"]

log = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass
class SoakConfig:
    workers: int = 16
    servers: int = 2
    duration: float = 180.0  # seconds of training measured
    mode: str = "async"
    task: str = "digits-mlp"
    sample: float = 1.0  # seconds between samples
    window: float = 10.0  # every shard must advance within each window this long
    warmup: float = 0.1  # fraction of the run left out of the memory comparison
    max_growth: float = 0.05  # allowed growth of the median RSS, second half vs first
    max_slope: float = 2.0  # allowed RSS trend in the second half, MiB per minute
    out: str = "runs/soak"

    def __post_init__(self) -> None:
        if self.workers < 1 or self.servers < 1:
            raise ConfigError("a soak needs at least one worker and one server")
        if self.duration < 4 * self.window or self.sample <= 0:
            raise ConfigError(f"duration must be >= 4 x window ({4 * self.window:g}s) and "
                              f"sample > 0")


def rss_of(pid: int) -> int:
    """Resident set size of process ``pid`` in bytes (Linux /proc)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"VmRSS not in /proc/{pid}/status")


def _slope(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over ts."""
    if len(ts) < 2:
        return 0.0
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    den = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / den if den else 0.0


def _spec(cfg: SoakConfig) -> ClusterSpec:
    return ClusterSpec(
        num_servers=cfg.servers, num_workers=cfg.workers,
        server=ServerConfig(mode=cfg.mode, heartbeat_timeout=30.0),
        # more steps than the run can take: the soak stops the workers itself
        worker=WorkerConfig(task=cfg.task, steps=10**9,
                            straggler=StragglerSpec(), timeout=120.0),
        startup_timeout=300.0, evaluate=False,
    )


@dataclass(frozen=True)
class Sample:
    """One reading during the soak: seconds since the start, RSS of every process, each
    shard's version and each worker's steps (by rank, as a string: JSON's keys)."""

    t: float
    server_rss: tuple[int, ...]
    worker_rss: tuple[int, ...]
    versions: tuple[int, ...]
    steps: dict[str, int]

    def to_json(self) -> JSONObject:
        return {"t": self.t, "server_rss": list(self.server_rss),
                "worker_rss": list(self.worker_rss), "versions": list(self.versions),
                "steps": {k: v for k, v in self.steps.items()}}


@dataclass(frozen=True)
class ProgressCheck:
    """No deadlock: every shard advanced in every window; every worker in the second half."""

    ok: bool
    windows: int
    stalled_windows: int
    idle_workers_second_half: tuple[str, ...]
    min_versions_per_window: int
    updates_per_second: float

    def to_json(self) -> JSONObject:
        return {"ok": self.ok, "windows": self.windows, "stalled_windows": self.stalled_windows,
                "idle_workers_second_half": list(self.idle_workers_second_half),
                "min_versions_per_window": self.min_versions_per_window,
                "updates_per_second": self.updates_per_second}


@dataclass(frozen=True)
class ShardMemory:
    """One shard's median RSS in each half of the run and its trend in the second."""

    shard: int
    first_half_mib: float
    second_half_mib: float
    growth: float
    slope_mib_per_min: float
    ok: bool

    def to_json(self) -> JSONObject:
        return {"shard": self.shard, "first_half_mib": self.first_half_mib,
                "second_half_mib": self.second_half_mib, "growth": self.growth,
                "slope_mib_per_min": self.slope_mib_per_min, "ok": self.ok}


@dataclass(frozen=True)
class MemoryCheck:
    ok: bool
    servers: tuple[ShardMemory, ...]
    workers_total_first_half_mib: float
    workers_total_second_half_mib: float

    def to_json(self) -> JSONObject:
        return {"ok": self.ok, "servers": [m.to_json() for m in self.servers],
                "workers_total_first_half_mib": self.workers_total_first_half_mib,
                "workers_total_second_half_mib": self.workers_total_second_half_mib}


@dataclass(frozen=True)
class CountersCheck:
    """The shards' counters reconcile with each other and with the workers' logs."""

    ok: bool
    problems: tuple[str, ...]
    pushes: tuple[int, ...]
    applied: tuple[int, ...]
    rejected: tuple[int, ...]
    versions: tuple[int, ...]
    worker_steps_logged: int

    def to_json(self) -> JSONObject:
        return {"ok": self.ok, "problems": list(self.problems), "pushes": list(self.pushes),
                "applied": list(self.applied), "rejected": list(self.rejected),
                "versions": list(self.versions),
                "worker_steps_logged": self.worker_steps_logged}


@dataclass(frozen=True)
class SoakChecks:
    progress: ProgressCheck
    memory: MemoryCheck
    counters: CountersCheck

    @property
    def ok(self) -> bool:
        return self.progress.ok and self.memory.ok and self.counters.ok

    def to_json(self) -> JSONObject:
        return {"progress": self.progress.to_json(), "memory": self.memory.to_json(),
                "counters": self.counters.to_json(), "ok": self.ok}


@dataclass(frozen=True)
class SoakResult:
    """``soak.json``: the configuration, the samples, the shards' last STATS (as they
    answered), the steps each worker logged and the checks."""

    config: SoakConfig
    samples: tuple[Sample, ...]
    final: list[ShardStats]  # the shards' last STATS
    worker_steps_logged: dict[int, int]
    checks: SoakChecks

    def to_json(self) -> JSONObject:
        return {"config": {k: v for k, v in dataclasses.asdict(self.config).items()},
                "samples": [s.to_json() for s in self.samples],
                "final": [st.to_dict() for st in self.final],
                "worker_steps_logged": {str(r): n for r, n in self.worker_steps_logged.items()},
                "checks": self.checks.to_json()}


def run_soak(cfg: SoakConfig, on_sample: Callable[[Sample], None] | None = None
             ) -> SoakResult:
    """Run the soak; returns the samples and the verdict of every check."""
    out = Path(cfg.out)
    spec = _spec(cfg)
    samples: list[Sample] = []
    with LocalCluster(spec, out) as cluster:
        addresses = cluster.start_servers()
        server_pids = [p.popen.pid for p in cluster.servers]
        cluster.start_workers()
        # the clock starts when every worker has made a step (imports take a while)
        deadline = time.monotonic() + spec.startup_timeout
        while len(cluster.progress().steps) < cfg.workers:
            _check_alive(cluster)
            if time.monotonic() > deadline:
                raise RequestTimeoutError("workers did not all start within the startup timeout")
            time.sleep(0.5)
        t0 = time.monotonic()
        while (now := time.monotonic()) - t0 < cfg.duration:
            _check_alive(cluster)
            stats = server_stats(addresses, timeout=30.0)
            progress = cluster.progress()
            sample = Sample(now - t0, tuple(rss_of(pid) for pid in server_pids),
                            tuple(rss_of(p.popen.pid) for p in cluster.workers),
                            tuple(s.version for s in stats),
                            {str(r): n for r, n in sorted(progress.steps.items())})
            samples.append(sample)
            if on_sample is not None:
                on_sample(sample)
            time.sleep(max(0.0, cfg.sample - (time.monotonic() - now)))  # sampling period
        # SIGINT: a worker stops where it is, and its event log is flushed at exit
        for proc in cluster.workers:
            proc.popen.send_signal(signal.SIGINT)
        for proc in cluster.workers:
            try:
                proc.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
        # STATS is answered after every message that arrived before it, on each connection
        # of its own; give pushes already in the sockets a moment to be handled
        final = _settled_stats(addresses)
    logged = {r: len(read_events(out / "events" / f"worker{r}.jsonl", "step"))
              for r in range(cfg.workers)}
    result = SoakResult(cfg, tuple(samples), final, logged,
                        _checks(cfg, samples, final, logged))
    (out / "soak.json").write_text(json.dumps(result.to_json(), indent=1))
    _plot(samples, out / "soak.png")
    return result


def _check_alive(cluster: LocalCluster) -> None:
    for proc in cluster.workers + cluster.servers:
        code = proc.popen.poll()
        if code is not None:
            raise RuntimeError(f"{proc.name} exited with code {code} during the soak; "
                               f"see {proc.log_path}")


def _settled_stats(addresses: list[str]) -> list[ShardStats]:
    """Server STATS once two readings a second apart agree (nothing left in flight)."""
    previous = server_stats(addresses, timeout=30.0)
    for _ in range(30):
        time.sleep(1.0)  # a reading interval, not a synchronisation
        current = server_stats(addresses, timeout=30.0)
        if [s.version for s in current] == [s.version for s in previous] and all(
                {w: v.pushes for w, v in c.workers.items()}
                == {w: v.pushes for w, v in p.workers.items()}
                for c, p in zip(current, previous, strict=True)):
            return current
        previous = current
    return previous


def _checks(cfg: SoakConfig, samples: list[Sample], final: list[ShardStats],
            logged: dict[int, int]) -> SoakChecks:
    # ---- progress: every shard advanced in every window; every worker in the second half
    per_window = [min(b - a for a, b in zip(samples[j].versions, samples[i].versions,
                                             strict=True))
                  for j, i in _windows(samples, cfg.window)]
    stalls = sum(1 for n in per_window if n <= 0)
    half = samples[len(samples) // 2]
    idle = tuple(r for r in map(str, range(cfg.workers))
                 if samples[-1].steps.get(r, 0) <= half.steps.get(r, 0))
    progress = ProgressCheck(
        bool(per_window) and not stalls and not idle, len(per_window), stalls, idle,
        min(per_window, default=0),
        (samples[-1].versions[0] - samples[0].versions[0])
        / max(1e-9, samples[-1].t - samples[0].t))
    # ---- memory
    body = [s for s in samples if s.t >= cfg.warmup * cfg.duration]
    mid = len(body) // 2
    memory = []
    for shard in range(cfg.servers):
        first = statistics.median(s.server_rss[shard] for s in body[:mid])
        second = statistics.median(s.server_rss[shard] for s in body[mid:])
        slope = _slope([s.t / 60 for s in body[mid:]],
                       [s.server_rss[shard] / MiB for s in body[mid:]])
        memory.append(ShardMemory(
            shard, first / MiB, second / MiB, second / first - 1, slope,
            second / first - 1 <= cfg.max_growth and slope <= cfg.max_slope))
    wfirst = statistics.median(sum(s.worker_rss) for s in body[:mid])
    wsecond = statistics.median(sum(s.worker_rss) for s in body[mid:])
    mem = MemoryCheck(all(m.ok for m in memory), tuple(memory), wfirst / MiB, wsecond / MiB)
    # ---- counters
    problems = []
    for shard, st in enumerate(final):
        applied = 0
        for w, ws in st.workers.items():
            rejected = sum(ws.rejected.values())
            applied += ws.applied
            if ws.pushes != ws.applied + rejected:
                problems.append(f"shard {shard} worker {w}: pushes {ws.pushes} != applied "
                                f"{ws.applied} + rejected {rejected}")
            # a worker is stopped between two steps or with one push in flight
            seen = ws.pushes - logged[int(w)]
            if not 0 <= seen <= 1:
                problems.append(f"shard {shard} worker {w}: server saw {ws.pushes} pushes, "
                                f"the worker logged {logged[int(w)]}")
        if cfg.mode == "async" and st.version != applied:
            problems.append(f"shard {shard}: version {st.version} != applied {applied}")
    counters = CountersCheck(
        not problems, tuple(problems),
        tuple(sum(w.pushes for w in st.workers.values()) for st in final),
        tuple(sum(w.applied for w in st.workers.values()) for st in final),
        tuple(sum(sum(w.rejected.values()) for w in st.workers.values()) for st in final),
        tuple(st.version for st in final), sum(logged.values()))
    return SoakChecks(progress, mem, counters)


def _windows(samples: list[Sample], window: float) -> list[tuple[int, int]]:
    """Index pairs (start, end) of consecutive non-overlapping windows."""
    out, start = [], 0
    for i, s in enumerate(samples):
        if s.t - samples[start].t >= window:
            out.append((start, i))
            start = i
    return out


def _plot(samples: list[Sample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t for s in samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for shard in range(len(samples[0].server_rss)):
        ax1.plot(t, [s.server_rss[shard] / MiB for s in samples], label=f"shard {shard}")
        ax2.plot(t, [s.versions[shard] for s in samples], label=f"shard {shard}")
    ax1.set_ylabel("server RSS (MiB)")
    ax2.set_ylabel("version (updates applied)")
    ax2.set_xlabel("seconds")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _report(result: SoakResult, console: Console) -> None:
    c = result.checks
    table = Table(title="soak")
    table.add_column("check")
    table.add_column("ok")
    table.add_column("figures")
    p = c.progress
    table.add_row("no deadlock", str(p.ok),
                  f"{p.updates_per_second:.0f} updates/s per shard; fewest updates in a "
                  f"{result.config.window:g}s window: {p.min_versions_per_window}; "
                  f"stalled windows: {p.stalled_windows}")
    for m in c.memory.servers:
        table.add_row(f"memory shard {m.shard}", str(m.ok),
                      f"{m.first_half_mib:.1f} -> {m.second_half_mib:.1f} MiB "
                      f"({m.growth * 100:+.2f}%), trend {m.slope_mib_per_min:+.2f} MiB/min")
    k = c.counters
    table.add_row("counters reconcile", str(k.ok),
                  f"pushes {list(k.pushes)} = applied {list(k.applied)} + rejected "
                  f"{list(k.rejected)}; versions {list(k.versions)}; worker steps logged "
                  f"{k.worker_steps_logged}")
    console.print(table)
    for problem in k.problems[:20]:
        console.print(f"[red]{problem}[/]", highlight=False)


@click.command()
@click.option("--workers", default=16, show_default=True)
@click.option("--num-servers", "-s", "servers", default=2, show_default=True,
              help="Shard server processes.")
@click.option("--duration", default=180.0, show_default=True, help="Seconds measured.")
@click.option("--mode", default="async", show_default=True,
              type=click.Choice(["async", "ssp", "sync"]))
@click.option("--task", default="digits-mlp", show_default=True)
@click.option("--sample", default=1.0, show_default=True, help="Seconds between samples.")
@click.option("--window", default=10.0, show_default=True,
              help="Every shard must advance within each window of this many seconds.")
@click.option("--max-growth", default=0.05, show_default=True,
              help="Allowed growth of the servers' median RSS, second half vs first.")
@click.option("--max-slope", default=2.0, show_default=True,
              help="Allowed RSS trend in the second half, MiB per minute.")
@click.option("--out", default="runs/soak", show_default=True)
def main(**options: Any) -> None:
    """Soak: many async workers for minutes; deadlock, memory growth and counter checks."""
    logging.basicConfig(level=logging.WARNING)
    cfg = SoakConfig(**options)
    console = Console()
    with console.status("soaking") as status:
        def show(sample: Sample) -> None:
            status.update(f"{sample.t:.0f}/{cfg.duration:g}s  versions {list(sample.versions)}"
                          f"  server RSS {[round(r / MiB, 1) for r in sample.server_rss]}"
                          " MiB")
        result = run_soak(cfg, show)
    _report(result, console)
    console.print(f"samples and verdicts: {Path(cfg.out) / 'soak.json'}, plot: "
                  f"{Path(cfg.out) / 'soak.png'}", highlight=False)
    sys.exit(0 if result.checks.ok else 1)


if __name__ == "__main__":
    main()
