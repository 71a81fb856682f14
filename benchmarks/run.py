"""One command for every benchmark: presets, the run, the JSON result and the tables.

``paramserver bench`` (cli/bench.py) calls
:func:`run_benchmarks`. Presets:

* default (about 8 minutes on 2 idle cores): payloads 1 KiB, 64 KiB, 1 MiB,
  16 MiB and 100 MiB with 1 worker and 1 shard; 16 MiB on the rest of the 3 x 3
  grid of 1, 2, 4 workers and shards; 100 MiB also at 2 workers x 2 shards;
  async throughput, shard memory, overlap. Ray's actor parameter server is
  in the sweep and the async part when Ray is installed (the bench extra).
* ``quick``: a smoke run (about a minute): two small cells, no extra variants,
  async with 2 workers on 2 shards, memory with 2 workers on 4 MiB, a tiny overlap.
* ``full``: every payload on every grid point.

The ``hosts`` part (:mod:`paramserver.benchmarks.hosts`) runs only when named:
raw pyzmq and this project with shards and workers in two network namespaces
joined by a veth pair (1, 16 and 100 MiB, 1 worker, 1 shard, 9 repeats: a
single 100 MiB round is one repeat, and a shared machine's noise needs more
than 5; ``--size``, ``--workers``, ``--shards`` and ``--repeats`` apply; under a
minute). It needs root and iproute2 and is skipped with one line without them.

The ``cluster`` part (:mod:`paramserver.benchmarks.cluster`) runs only when named:
the project's sync round on N worker and N server hosts emulated as network
namespaces on a bridge, every NIC shaped to ``--link`` (default 400mbit) both
ways, with the shards also on the worker hosts, against gloo's all_reduce and raw
pyzmq on the same links, beside the limits M/B and 2(N-1)/N · M/B (N = 2 and 4,
8 and 32 MiB, 5 repeats; ``quick``: N = 2, 1 MiB, 2 repeats; ``--size``,
``--workers`` and ``--repeats`` apply). It needs root, iproute2 and tc.

The ``reshard`` part (:mod:`paramserver.benchmarks.reshard`) runs only when named: a
live move of a sync job from 2 to 3 shards (its pause, and the worker's stall)
against a checkpoint, ``checkpoint reshard`` and restart (16 and 256 MiB; ``quick``:
1 and 4 MiB; ``--size`` applies).

The ``replication`` part (:mod:`paramserver.benchmarks.replication`) runs only when
named too (it SIGKILLs shard processes): push + pull with and without
``--replicas 1``, paired (1 KiB and 100 MiB, 5 repeats; ``quick``: 1 KiB and
64 KiB, 2 repeats; ``full``: 9 repeats), and the failover time over 5 kills
(quick: 1, full: 9) with the default ``--failover-timeout``. ``--size`` and
``--repeats`` apply.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from rich.console import Console

from paramserver.errors import ConfigError
from paramserver.shm.link import enabled as shm_enabled
from paramserver.workers.launch.netcluster import parse_rate

from .cluster import DEFAULT_RATE as CLUSTER_RATE
from .cluster import DEFAULT_SIZES as CLUSTER_SIZES
from .cluster import DEFAULT_WORKERS as CLUSTER_WORKERS
from .cluster import run_cluster
from .clusterasync import DEFAULT_SLOW_FACTOR as SLOW_FACTOR
from .clusterasync import run_cluster_async
from .common import format_size
from .extras import run_async, run_async_raw, run_async_ray, run_memory, run_overlap
from .hosts import DEFAULT_SIZES as HOSTS_SIZES
from .hosts import run_hosts
from .rayps import available as ray_available
from .records import BenchResult, ClusterResult, ClusterRow, Environment, HostsResult, SweepRow
from .replication import DEFAULT_SIZES as REPLICATION_SIZES
from .replication import QUICK_SIZES as REPLICATION_QUICK_SIZES
from .replication import CostRow, ReplicationResult, run_replication
from .report import evaluate_goals, print_report
from .reshard import DEFAULT_SIZES as RESHARD_SIZES
from .reshard import QUICK_SIZES as RESHARD_QUICK_SIZES
from .reshard import run_reshard
from .suite import SYSTEMS, Cell, PSVariant, SweepConfig, run_sweep

__all__ = ["DEFAULT_PARTS", "PARTS", "PRESETS", "BenchOptions", "cells_for",
           "default_systems", "run_benchmarks"]

log = logging.getLogger(__name__)

PARTS: tuple[str, ...] = ("sweep", "async", "memory", "overlap", "hosts", "replication",
                          "cluster", "reshard")
#: what runs when no part is named (hosts and cluster need root and change the network
#: setup; replication kills shard processes)
DEFAULT_PARTS: tuple[str, ...] = ("sweep", "async", "memory", "overlap")
PRESETS: tuple[str, ...] = ("quick", "default", "full")
_KIB, _MIB = 1 << 10, 1 << 20
# glibc keeps freed buffers of up to 32 MiB for reuse (see paramserver.wire.transport.
# tune_allocator); given to every system's processes alike, so none is handicapped
TUNED_MALLOC = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
                "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}


@dataclass
class BenchOptions:
    out: Path = Path("runs/bench")
    preset: str = "default"
    parts: tuple[str, ...] = DEFAULT_PARTS
    systems: tuple[str, ...] = field(default_factory=lambda: default_systems())
    sizes: list[int] | None = None  # overrides the preset's payloads (every grid point)
    workers: tuple[int, ...] | None = None
    shards: tuple[int, ...] | None = None
    repeats: int | None = None
    wire_dtype: str | None = None  # also measure gradients sent in 16 bits (bfloat16, ...)
    lean: bool = True  # also measure the project with its divergence watchdog off
    malloc: str = "tuned"  # tuned: every process keeps freed buffers; default: glibc's own
    link: str = CLUSTER_RATE  # the cluster part's NIC rate, every host's, both ways

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ConfigError(f"preset must be one of {', '.join(PRESETS)}; got {self.preset!r}")
        bad = set(self.parts) - set(PARTS)
        if bad:
            raise ConfigError(f"parts must be among {', '.join(PARTS)}; got {sorted(bad)}")
        bad = set(self.systems) - set(SYSTEMS)
        if bad or "raw" not in self.systems:
            raise ConfigError(f"systems must include raw, among {', '.join(SYSTEMS)}")
        if "ray" in self.systems and not ray_available():
            raise ConfigError("the ray system needs Ray: pip install 'paramserver[bench]' "
                              "(make bench installs it)")
        parse_rate(self.link)  # a ConfigError names what is wrong with it
        if self.malloc not in ("tuned", "default"):
            raise ConfigError(f"malloc must be tuned or default; got {self.malloc!r}")


@dataclass(frozen=True)
class OverlapSize:
    """The overlap part's model and timing (run_overlap's defaults unless quick)."""

    width: int = 1024
    depth: int = 6
    batch: int = 64
    steps: int = 2
    repeats: int = 5
    bucket_bytes: int = 4 << 20


def default_systems() -> tuple[str, ...]:
    """Every system, Ray only when it is installed (an optional extra)."""
    return tuple(s for s in SYSTEMS if s != "ray" or ray_available())


def cells_for(opts: BenchOptions) -> list[Cell]:
    """The (workers, shards, payload) cells of a preset, or of the given sizes / grid."""
    workers = opts.workers or ((1, 2) if opts.preset == "quick" else (1, 2, 4))
    shards = opts.shards or ((1, 2) if opts.preset == "quick" else (1, 2, 4))
    if opts.sizes:
        return [Cell(n, s, b) for n in workers for s in shards for b in opts.sizes]
    if opts.preset == "quick":
        return [Cell(1, 1, _KIB), Cell(2, 2, 64 * _KIB)]
    sweep = [_KIB, 64 * _KIB, _MIB, 16 * _MIB, 100 * _MIB]
    if opts.preset == "full":
        return [Cell(n, s, b) for n in workers for s in shards for b in sweep]
    cells = [Cell(1, 1, b) for b in sweep if 1 in workers and 1 in shards]
    cells += [Cell(n, s, 16 * _MIB) for n in workers for s in shards if (n, s) != (1, 1)]
    if 2 in workers and 2 in shards:
        cells.append(Cell(2, 2, 100 * _MIB))
    return cells


def _variants(opts: BenchOptions) -> list[PSVariant]:
    variants = [PSVariant("ps")]
    if opts.preset == "quick":
        return variants
    if opts.lean:
        variants.append(PSVariant("ps-lean", server={"watchdog": {"enabled": False}}))
    if shm_enabled():  # "ps" moves tensors through shared memory here: TCP beside it
        variants.append(PSVariant("ps-tcp", {"shm": False}))
        # the shard unmapping each used part of the worker's segment, also where by
        # default it keeps them (one worker, plain SGD): what that costs in time
        variants.append(PSVariant("ps-release", server={"shm_release": True}))
    if opts.wire_dtype:
        variants.append(PSVariant(f"ps-{opts.wire_dtype}", {"wire_dtype": opts.wire_dtype}))
    return variants


def _environment() -> Environment:
    import numpy
    import torch
    import zmq

    return Environment(platform.python_version(), torch.__version__, zmq.__version__,
                       zmq.zmq_version(), numpy.__version__, os.cpu_count(),
                       platform.machine(), os.getloadavg())


def _row_line(r: SweepRow) -> str:
    ratio = r.ratio_to_limit
    return (f"  {r.workers}w {r.shards or '-'}s {format_size(r.bytes):>7} "
            f"{r.system:<14} {r.round_s.median * 1e3:10.3f} ms "
            f"x{ratio.median if ratio else 1:.2f}")


def _run_hosts(opts: BenchOptions, console: Console, logs: Path) -> HostsResult:
    """The across-hosts part: two network namespaces, or one line saying why not."""
    quick = opts.preset == "quick"
    sizes = opts.sizes or ([64 * _KIB] if quick else list(HOSTS_SIZES))
    console.print(f"across hosts (two network namespaces over veth): "
                  f"{', '.join(format_size(b) for b in sizes)}")
    hosts = run_hosts(sizes, workers=opts.workers or (1,), shards=opts.shards or (1,),
                      repeats=opts.repeats or (2 if quick else 9),
                      repeat_seconds=0.05 if quick else 0.25, log_dir=logs / "hosts",
                      on_row=lambda r: console.print(_row_line(r)))
    if hosts.skipped is not None:
        console.print(f"across hosts: skipped: {hosts.skipped}")
    for problem in hosts.problems:
        console.print(f"[red]across hosts: {problem}[/red]")
    return hosts


def _cluster_line(r: ClusterRow) -> str:
    vs = f", x{r.vs_gloo.median:.2f} gloo" if r.vs_gloo else ""
    return (f"  {r.workers}w {format_size(r.bytes):>7} {r.system:<13} "
            f"{r.round_s.median * 1e3:9.1f} ms: x{r.vs_limit:.2f} M/B "
            f"({r.limit_s * 1e3:.0f} ms), x{r.vs_ring_limit:.2f} ring limit{vs}")


def _run_cluster(opts: BenchOptions, console: Console, logs: Path) -> ClusterResult:
    """The cluster part: N worker and N server hosts, or one line saying why not."""
    quick = opts.preset == "quick"
    sizes = opts.sizes or ([1 << 20] if quick else list(CLUSTER_SIZES))
    workers = opts.workers or ((2,) if quick else CLUSTER_WORKERS)
    console.print(f"across a cluster (N worker + N server hosts, {opts.link} NICs): "
                  f"N = {', '.join(map(str, workers))}; "
                  f"{', '.join(format_size(b) for b in sizes)}")
    result = run_cluster(sizes, workers, opts.link, repeats=opts.repeats or (2 if quick else 5),
                         repeat_seconds=0.05 if quick else 0.25, log_dir=logs / "cluster",
                         on_row=lambda r: console.print(_cluster_line(r)))
    if result.skipped is not None:
        console.print(f"across a cluster: skipped: {result.skipped}")
        return result
    n, size = max(workers), min(sizes)
    if n < 2:
        return result
    console.print(f"across a cluster, async: {n} workers, {format_size(size)}, worker host 0 "
                  f"at 1/{SLOW_FACTOR} of {opts.link} in every other window")
    arow = run_cluster_async(n, size, opts.link, repeats=1 if quick else 3,
                             seconds=1.0 if quick else 5.0, log_dir=logs / "cluster-async")
    if isinstance(arow, str):
        console.print(f"across a cluster, async: skipped: {arow}")
        return replace(result, async_skipped=arow)
    console.print(f"  the other workers' updates/s with host 0 slow: "
                  f"x{arow.others_vs_fast.median:.2f} of all fast "
                  f"(host 0's own: x{arow.slow_vs_fast.median:.2f})")
    return replace(result, async_row=arow)


def _cost_line(c: CostRow) -> str:
    return (f"  {format_size(c.bytes):>7} without {c.without.median * 1e3:9.3f} ms, "
            f"over TCP {c.tcp.median * 1e3:9.3f} ms, --replicas 1 "
            f"{c.with_replica.median * 1e3:9.3f} ms: x{c.ratio.median:.2f} "
            f"(x{c.ratio_tcp.median:.2f} of TCP)")


def _run_replication(opts: BenchOptions, console: Console, logs: Path) -> ReplicationResult:
    """The replication part: its preset's sizes, repeats and kills."""
    quick, full = opts.preset == "quick", opts.preset == "full"
    sizes = tuple(opts.sizes or (REPLICATION_QUICK_SIZES if quick else REPLICATION_SIZES))
    kills = 1 if quick else 9 if full else 5
    console.print(f"replication: push+pull with and without --replicas 1 "
                  f"({', '.join(format_size(b) for b in sizes)}), then {kills} failover(s)")
    result = run_replication(sizes, repeats=opts.repeats or (2 if quick else 9 if full else 5),
                             repeat_seconds=0.05 if quick else 0.25, kills=kills,
                             log_dir=logs / "replication",
                             on_row=lambda c: console.print(_cost_line(c)))
    if result.failover is not None:
        fo = result.failover
        console.print(f"  failover: median {fo.median:.2f} s, max {fo.max:.2f} s over "
                      f"{len(fo.seconds)} kill(s) (--failover-timeout {fo.failover_timeout:g})")
    return result


def run_benchmarks(opts: BenchOptions, console: Console | None = None) -> BenchResult:
    """Run the chosen parts, write ``out/result.json``, print the tables; return the result."""
    console = console or Console()
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    quick = opts.preset == "quick"
    logs = out / "logs"
    if opts.malloc == "tuned":
        os.environ.update(TUNED_MALLOC)  # inherited by every agent
    else:
        os.environ["PARAMSERVER_MALLOC_TUNING"] = "0"
        for key in TUNED_MALLOC:
            os.environ.pop(key, None)
    command = (" ".join(["paramserver bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"]
               else " ".join(sys.argv))
    started, environment = time.time(), _environment()
    t0 = time.perf_counter()
    sweep = hosts = async_rows = memory = overlap = overlap_tcp = replication = cluster = None
    if "sweep" in opts.parts:
        cells = cells_for(opts)
        cfg = SweepConfig(cells=cells, systems=opts.systems, variants=_variants(opts),
                          repeats=opts.repeats or (3 if quick else 5),
                          repeat_seconds=0.05 if quick else 0.25, log_dir=logs)
        console.print(f"sweep: {len(cells)} cells x {len(opts.systems)} systems "
                      f"({', '.join(opts.systems)}) + variants "
                      f"{', '.join(v.label for v in cfg.variants[1:]) or 'none'}")

        sweep = tuple(run_sweep(cfg, lambda r: console.print(_row_line(r))))
    if "hosts" in opts.parts:
        hosts = _run_hosts(opts, console, logs)
    if "async" in opts.parts:
        console.print("async throughput ...")
        seconds = 0.5 if quick else 3.0
        rows = run_async(workers=2 if quick else 4, shards=(2,) if quick else (1, 2, 4),
                         seconds=seconds, log_dir=logs)
        # the limit: the raw pyzmq loop, a step per push (always in, as in the sweep)
        rows.append(run_async_raw(workers=2 if quick else 4, seconds=seconds, log_dir=logs))
        if "ray" in opts.systems:
            rows.append(run_async_ray(workers=2 if quick else 4, seconds=seconds,
                                      log_dir=logs))
        async_rows = tuple(rows)
    if "memory" in opts.parts:
        console.print("shard memory ...")
        workers, nbytes = (2,) if quick else (1, 2, 4), (4 if quick else 64) * _MIB
        rounds = 2 if quick else 4
        mem = run_memory(workers, nbytes, rounds, log_dir=logs)
        if shm_enabled():  # the shard maps same-host workers' gradients: also never unmapping
            mem += run_memory(workers, nbytes, rounds, log_dir=logs,
                              server={"shm_release": False})
        memory = tuple(mem)
    if "overlap" in opts.parts:
        console.print("overlap ...")
        size = (OverlapSize(width=256, depth=3, batch=32, steps=2, repeats=3,
                            bucket_bytes=256 * _KIB) if quick else OverlapSize())
        overlap = run_overlap(log_dir=logs, **asdict(size))
        # weights over TCP, as from another host: with early weights and without
        overlap_tcp = run_overlap(log_dir=logs, tcp=True, **asdict(size))
    if "replication" in opts.parts:
        replication = _run_replication(opts, console, logs)
    if "cluster" in opts.parts:
        cluster = _run_cluster(opts, console, logs)
    reshard = None
    if "reshard" in opts.parts:
        sizes = tuple(opts.sizes or (RESHARD_QUICK_SIZES if quick else RESHARD_SIZES))
        console.print(f"reshard: a live move 2 -> 3 shards against checkpoint, reshard and "
                      f"restart ({', '.join(format_size(b) for b in sizes)})")
        reshard = run_reshard(sizes, logs / "reshard", lambda r: console.print(r.line()))
    result = BenchResult(
        sweep, hosts, async_rows, memory, overlap, overlap_tcp, replication=replication,
        cluster=cluster, reshard=reshard,
        command=command,
        preset=opts.preset, malloc=opts.malloc, started=started,
        seconds=time.perf_counter() - t0,
        environment=replace(environment, load_after=os.getloadavg()))
    result = replace(result, goals=tuple(evaluate_goals(result)))
    (out / "result.json").write_text(json.dumps(result.to_json(), indent=2))
    print_report(result, console)
    console.print(f"wrote {out / 'result.json'} ({result.seconds:.0f} s)")
    return result
