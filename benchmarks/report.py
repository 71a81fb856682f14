"""Tables and goal checks for a benchmark result (rich tables, Markdown for the docs)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.table import Table

from .common import Stats, format_size
from .records import AsyncRow, BenchResult, ClusterResult, ClusterRow, Goal, SweepRow, find

__all__ = ["evaluate_goals", "four_shard_share", "markdown", "print_report"]

_MIB100 = 100 << 20


def _ms(stats: Stats) -> str:
    v, lo, hi = stats.median * 1e3, stats.lo * 1e3, stats.hi * 1e3
    digits = 3 if v < 1 else 2 if v < 10 else 1
    return f"{v:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def _ratio(stats: Stats | None) -> str:
    if not stats:
        return "1"
    return f"{stats.median:.2f} [{stats.lo:.2f}-{stats.hi:.2f}]"


def _paired(row: SweepRow | None) -> float | None:
    """The row's median ratio to its paired raw loop (None: no row, or the raw loop)."""
    return None if row is None or row.ratio_to_limit is None else row.ratio_to_limit.median


def four_shard_share(one: AsyncRow | None, four: AsyncRow | None, cpus: int | None
                     ) -> tuple[float | None, float | None]:
    """The 4-shard rate over the 1-shard one, and the most that ``cpus`` cores allow.

    With 1 shard a model update is one message, costing the shard ``C_s`` and the
    workers ``C_w`` of CPU, and the rate is at most ``1 / C_s`` (one shard thread).
    With 4 shards it is four messages: at most ``cpus / (4 (C_s + C_w))``. So the
    share is at most ``cpus C_s / (4 (C_s + C_w))``, measured from the 1-shard row
    (None where the row or the core count is missing)."""
    if one is None or four is None or not one.model_updates_per_s:
        return None, None
    share = four.model_updates_per_s / one.model_updates_per_s
    shard = one.shard_cpu_s_per_model_update
    if not cpus or not shard or one.cpu_s_per_model_update <= 0:
        return share, None
    return share, min(1.0, cpus * shard / (4 * one.cpu_s_per_model_update))


def evaluate_goals(result: BenchResult) -> list[Goal]:
    """The issue's goals, each with the measured value, the target and met / missed / n/a."""
    rows = result.sweep or ()
    goals: list[Goal] = []

    def add(name: str, measured: float | None, target: str, met: bool | None,
            detail: str = "") -> None:
        goals.append(Goal(name, measured, target,
                          "n/a" if met is None else "met" if met else "missed", detail))

    ps = find(rows, "ps", 1, _MIB100, shards=1)
    rpc = find(rows, "rpc", 1, _MIB100)
    ratio = _paired(ps)
    add("100 MiB, 1 worker, 1 shard: push+pull vs raw pyzmq", ratio, ">= 0.9x",
        None if ratio is None else ratio >= 0.9)
    vs_rpc = None
    rpc_ratio = _paired(rpc)
    if ratio is not None and rpc_ratio is not None:
        # each against the raw loop it was interleaved with: cancels load drift between phases
        vs_rpc = ratio / rpc_ratio
    add("100 MiB, 1 worker, 1 shard: push+pull vs torch RPC", vs_rpc, ">= 1.5x",
        None if vs_rpc is None else vs_rpc >= 1.5,
        "ratio of the two ratios to their paired raw loops")
    ray = find(rows, "ray", 1, _MIB100)
    vs_ray = None
    ray_ratio = _paired(ray)
    if ratio is not None and ray is not None and ray.shards is None and ray_ratio:
        # project time / Ray time, each paired with the raw loop of the same cell
        vs_ray = ray_ratio / ratio
    add("100 MiB, 1 worker, 1 shard: push+pull time vs Ray actor PS", vs_ray, "<= 0.8x",
        None if vs_ray is None else vs_ray <= 0.8,
        "project time / Ray time, through their paired raw ratios")
    ps22 = find(rows, "ps", 2, _MIB100, shards=2)
    gloo = find(rows, "gloo", 2, _MIB100)
    vs_gloo = None
    if ps22 and gloo:
        vs_gloo = gloo.round_s.median / ps22.round_s.median
    add("sync step 2 workers x 2 shards, 100 MiB vs gloo all_reduce + step", vs_gloo,
        ">= 1.0x (no slower)", None if vs_gloo is None else vs_gloo >= 1.0,
        "gloo step time / project step time, same cell")
    ps1k = find(rows, "ps", 1, 1024, shards=1)
    ps1k_ratio = _paired(ps1k)
    lat = 1.0 / ps1k_ratio if ps1k_ratio else None
    add("1 KiB round trip vs raw pyzmq", lat, "<= 1.5x", None if lat is None else lat <= 1.5,
        f"{ps1k.round_s.median * 1e6:.0f} us" if ps1k else "")
    async_rows = result.async_rows or ()
    asy = {a.shards: a for a in async_rows if a.system == "ps"}
    rate = asy[1].model_updates_per_s if 1 in asy else None
    raw_async = next((a for a in async_rows if a.system == "raw"), None)
    limit = ""
    if raw_async:
        raw_rate = raw_async.model_updates_per_s
        limit = f"raw pyzmq loop (the limit) {raw_rate:.0f}/s"
        if rate is not None:
            limit += f", this project {rate / raw_rate:.2f}x of it"
    add("async updates/s, 4 workers, 4 KiB model, 1 shard", rate, ">= 5000",
        None if rate is None else rate >= 5000, limit)
    rate4 = asy[4].model_updates_per_s if 4 in asy else None
    add("async updates/s, 4 workers, 4 KiB model, 4 shards", rate4, ">= 2500",
        None if rate4 is None else rate4 >= 2500)
    share, bound = four_shard_share(asy.get(1), asy.get(4),
                                    result.environment.cpus if result.environment else None)
    add("async, 4 shards vs 1 shard (4 workers, 4 KiB)", share, ">= 0.5x",
        None if share is None else share >= 0.5,
        "" if bound is None else f"at most {bound:.2f}x on this host's cores "
        "(docs/performance.md: four shards need a core each)")
    ray_async = next((a for a in async_rows if a.system == "ray"), None)
    vs_ray_async = (rate / ray_async.model_updates_per_s
                    if rate is not None and ray_async else None)
    add("async updates/s, 1 shard vs Ray actor PS", vs_ray_async, ">= 4x",
        None if vs_ray_async is None else vs_ray_async >= 4)
    for release in (None, False):  # the default, and never unmapping (informative)
        mem = [m for m in result.memory or () if m.shm_release is release]
        if release is not None and not mem:
            continue
        worst = max((m.peak_over_base / m.expected_bytes for m in mem), default=None)
        add("sync shard peak RSS vs weights + optimizer state + aggregation buffer"
            + (", --no-shm-release" if release is False else ""), worst,
            "<= 1.15x for every N",
            None if worst is None or release is False else worst <= 1.15,
            "peak RSS above the RSS at start, worst N")
    val = result.overlap.overlap_vs_bound if result.overlap else None
    add("overlap: step time vs max(compute, communication)", val, "<= 1.15x",
        None if val is None else val <= 1.15)
    hosts = result.hosts
    xh = find(hosts.rows, "ps", 1, _MIB100, shards=1) if hosts else None
    xratio = _paired(xh)
    # a figure that came through shared memory is no measure of the network path
    tcp = xh is not None and not xh.used_shm
    skipped = (hosts.skipped if hosts else None) or ""
    add("across hosts (two namespaces, veth): 100 MiB push+pull vs raw pyzmq", xratio,
        ">= 0.9x", None if xratio is None else xratio >= 0.9 and tcp,
        skipped if not xh else "over TCP" if tcp else "used shared memory")
    repl = result.replication
    cost = repl.row(_MIB100) if repl else None
    add("100 MiB push+pull with --replicas 1 vs without", cost.ratio.median if cost else None,
        "<= 1.3x", None if cost is None else cost.ratio.median <= 1.3,
        "paired repeats, 1 worker, 1 shard, async" if cost else "")
    fo = repl.failover if repl else None
    add("failover: primary SIGKILLed to the first step its backup acknowledged",
        fo.max if fo else None, "< 2 s (the maximum)", None if fo is None else fo.max < 2.0,
        f"median {fo.median:.2f} s over {len(fo.seconds)} kill(s), --failover-timeout "
        f"{fo.failover_timeout:g}" if fo else "")
    _cluster_goals(result.cluster, add)
    moves = result.reshard or ()
    big = max(moves, key=lambda r: r.bytes, default=None)
    add("live reshard 2 -> 3 shards vs checkpoint + reshard + restart",
        big.ratio if big else None, ">= 5x shorter", None if big is None else big.ratio >= 5.0,
        f"{big.bytes >> 20} MiB: pause {big.pause_s:.3f} s, worker stall {big.stall_s:.3f} s, "
        f"restart {big.restart_s:.2f} s" if big else "")
    return goals


def _cluster_goals(cluster: ClusterResult | None, add: Callable[..., None]) -> None:
    """Issue 45's: with 4 workers and 4 server hosts, the sync round at most 1.2x M/B and
    0.75x gloo's all_reduce; with the shards on the worker hosts, at most 1.1x gloo's
    (at the largest size measured with 4 workers)."""
    rows = cluster.rows if cluster else ()
    four = [r for r in rows if r.workers == 4]
    size = max((r.bytes for r in four), default=None)
    why = (cluster.skipped if cluster else None) or ("" if four else "no 4-worker row")

    def row(system: str) -> ClusterRow | None:
        return next((r for r in four if r.bytes == size and r.system == system), None)

    ps, colo = row("ps"), row("ps-colocated")
    where = f"{format_size(size)}, {cluster.rate}" if size and cluster else why
    add("cluster: 4 workers, 4 server hosts: sync round vs M/B",
        ps.vs_limit if ps else None, "<= 1.2x", None if ps is None else ps.vs_limit <= 1.2,
        where)
    vs = ps.vs_gloo.median if ps and ps.vs_gloo else None
    add("cluster: 4 workers, 4 server hosts: sync round vs gloo all_reduce", vs, "<= 0.75x",
        None if vs is None else vs <= 0.75, where)
    vs = colo.vs_gloo.median if colo and colo.vs_gloo else None
    add("cluster: shards on the 4 worker hosts: sync round vs gloo all_reduce", vs,
        "<= 1.1x", None if vs is None else vs <= 1.1, where)
    for system, goal in (("ps-int8", 0.35), ("ps-topk", 0.1),  # issue 46's (the push
                         ("ps-int8-2way", 0.35), ("ps-topk-2way", 0.1)):  # or both ways)
        comp = row(system)
        vs = comp.round_s.median / ps.round_s.median if comp and ps else None
        add(f"cluster: 4 workers, 4 server hosts: sync round with {system[3:]} vs "
            f"uncompressed", vs, f"<= {goal}x", None if vs is None else vs <= goal, where)
    arow = cluster.async_row if cluster else None
    why = (cluster.skipped or cluster.async_skipped if cluster else None) or "not measured"
    vs = arow.others_vs_fast.median if arow else None
    add("cluster: async, one worker host at a quarter of the rate: the others' updates/s "
        "vs every host fast", vs, ">= 0.9x", None if vs is None else vs >= 0.9,
        f"{arow.workers} workers, {format_size(arow.bytes)}, {arow.rate}" if arow else why)


def _cluster_table(result: ClusterResult) -> Table:
    t = Table(title=f"across a cluster: N worker hosts (+ N server hosts for raw and ps), "
                    f"every NIC {result.rate} both ways; a sync round (median [min-max])")
    for col in ("workers", "shards", "payload", "system", "round ms", "M/B ms", "x M/B",
                "ring limit ms", "x ring limit", "x gloo"):
        t.add_column(col, justify="left" if col == "system" else "right")
    for r in result.rows:
        t.add_row(str(r.workers), "-" if r.shards is None else str(r.shards),
                  format_size(r.bytes), r.system, _ms(r.round_s), f"{r.limit_s * 1e3:.0f}",
                  f"{r.vs_limit:.2f}", f"{r.ring_limit_s * 1e3:.0f}", f"{r.vs_ring_limit:.2f}",
                  "-" if r.vs_gloo is None else _ratio(r.vs_gloo))
    return t


def _cluster_markdown(result: ClusterResult) -> list[str]:
    lines = [f"Across a cluster (every NIC {result.rate} both ways; median round, ms):", "",
             "| workers | shards | payload | system | round ms | M/B ms | x M/B "
             "| ring limit ms | x ring limit | x gloo |", "|---" * 10 + "|"]
    for r in result.rows:
        lines.append(
            f"| {r.workers} | {'-' if r.shards is None else r.shards} | "
            f"{format_size(r.bytes)} | {r.system} | {r.round_s.median * 1e3:.0f} | "
            f"{r.limit_s * 1e3:.0f} | {r.vs_limit:.2f} | {r.ring_limit_s * 1e3:.0f} | "
            f"{r.vs_ring_limit:.2f} | "
            f"{'-' if r.vs_gloo is None else f'{r.vs_gloo.median:.2f}'} |")
    a = result.async_row
    if a is not None:
        def mean(rows: Sequence[Sequence[float]], lo: int, hi: int) -> float:
            return statistics.median(sum(r[lo:hi]) / (hi - lo) for r in rows)

        lines += ["", f"Async, {a.workers} workers, {format_size(a.bytes)} (pushes/s per worker, "
                  f"median window; worker host 0 at {a.slow_bits / 1e6:g} Mbit/s when slow):",
                  "", "| NICs | host 0 | the others (mean) | the others vs all fast |",
                  "|---|---|---|---|",
                  f"| all {a.rate} | {mean(a.fast_per_worker, 0, 1):.2f} | "
                  f"{mean(a.fast_per_worker, 1, a.workers):.2f} | 1 |",
                  f"| host 0 slow | {mean(a.slow_per_worker, 0, 1):.2f} | "
                  f"{mean(a.slow_per_worker, 1, a.workers):.2f} | "
                  f"{a.others_vs_fast.median:.2f} |"]
    return [*lines, ""]


def _sweep_table(rows: Sequence[SweepRow],
                 title: str = "push + pull round trips (median [min-max] over repeats)"
                 ) -> Table:
    t = Table(title=title)
    for col in ("workers", "shards", "payload", "system", "round trip ms", "GB/s",
                "x raw limit", "CPU ms/round"):
        t.add_column(col, justify="right" if col not in ("system",) else "left")
    for r in rows:
        t.add_row(str(r.workers), "-" if r.shards is None else str(r.shards),
                  format_size(r.bytes), r.system, _ms(r.round_s),
                  f"{r.gbps.median:.3f}", _ratio(r.ratio_to_limit),
                  f"{r.cpu_s.median * 1e3:.2f}" if r.cpu_s else "")
    return t


def print_report(result: BenchResult, console: Console | None = None) -> None:
    console = console or Console()
    if result.sweep:
        console.print(_sweep_table(result.sweep))
    hosts = result.hosts
    if hosts is not None and hosts.rows and hosts.link is not None:
        link = hosts.link
        console.print(_sweep_table(hosts.rows, f"across hosts: shards in {link.ns_a} "
                                   f"({link.ip_a}), workers in {link.ns_b} over veth, "
                                   f"{link.transport} (median [min-max] over repeats)"))
    if result.async_rows:
        t = Table(title="async: updates applied per second (model: bytes/tensors; CPU ms "
                        "per model update, all processes, and the shards' part; shard busy: "
                        "the share of a core each shard used)", collapse_padding=True)
        for col in ("system", "workers", "shards", "model", "model upd/s",
                    "shard upd/s", "CPU ms", "shards ms", "shard busy"):
            t.add_column(col, justify="right", min_width=len(col) if " " not in col else None)
        for a in result.async_rows:
            shard_cpu, busy = a.shard_cpu_s_per_model_update, a.shard_busy
            t.add_row(a.system, str(a.workers), "-" if a.shards is None else str(a.shards),
                      f"{format_size(a.bytes)}/{a.tensors}",
                      f"{a.model_updates_per_s:.0f}", f"{a.shard_updates_per_s:.0f}",
                      f"{a.cpu_s_per_model_update * 1e3:.2f}",
                      "-" if shard_cpu is None else f"{shard_cpu * 1e3:.2f}",
                      "-" if busy is None else f"{busy:.2f}")
        console.print(t)
    if result.cluster is not None and result.cluster.rows:
        console.print(_cluster_table(result.cluster))
    if result.memory:
        t = Table(title="sync shard memory (peak RSS above RSS at start)")
        for col in ("workers", "shard", "model", "weights+state+agg MiB",
                    "peak over start MiB", "ratio"):
            t.add_column(col, justify="right")
        for m in result.memory:
            release = ("" if m.shm_release is None
                       else ", --shm-release" if m.shm_release else ", --no-shm-release")
            how = "TCP" if not m.shm_peers else "shared memory" + release
            t.add_row(str(m.workers), how, format_size(m.bytes),
                      f"{m.expected_bytes / 2**20:.0f}", f"{m.peak_over_base / 2**20:.0f}",
                      f"{m.ratio:.2f}")
        console.print(t)
    runs = [r for r in (result.overlap, result.overlap_tcp) if r]
    if runs:
        first = runs[0]
        t = Table(title=f"overlap ({first.params} parameters, {first.buckets} buckets, "
                        f"{first.device})",
                  caption="vs bound: overlap / max(compute, comm); late: the overlapped "
                          "step without early weights; ahead: rounds stepped ahead")
        for col in ("via", "compute ms", "comm ms", "seq. ms", "overlap ms",
                    "vs bound", "gain", "late ms", "ahead"):
            t.add_column(col, justify="right")
        for ov in runs:
            late = ov.overlap_late
            t.add_row("TCP" if ov.tcp else "host",
                      *(f"{s.median * 1e3:.1f}" for s in
                        (ov.compute, ov.comm, ov.sequential, ov.overlap)),
                      f"{ov.overlap_vs_bound:.2f}", f"{ov.gain:.2f}x",
                      "-" if late is None else f"{late.median * 1e3:.1f}",
                      str(ov.rounds_ahead))
        console.print(t)
    if result.replication is not None and result.replication.costs:
        t = Table(title="replication: push + pull round trip, 1 worker, 1 shard, async "
                        "(median, range below; x: paired per repeat)")
        for col in ("payload", "without ms", "over TCP ms", "--replicas 1 ms", "x without",
                    "x TCP"):
            t.add_column(col, justify="right")
        for c in result.replication.costs:
            t.add_row(format_size(c.bytes), _ms(c.without), _ms(c.tcp), _ms(c.with_replica),
                      _ratio(c.ratio), _ratio(c.ratio_tcp))
        console.print(t)
    goals = result.goals or evaluate_goals(result)
    t = Table(title="goals")
    for col in ("goal", "measured", "target", "status"):
        t.add_column(col)
    for g in goals:
        v = g.measured
        t.add_row(g.goal, "-" if v is None else f"{v:.2f}", g.target, g.status)
    console.print(t)


def _markdown_rows(rows: Sequence[SweepRow]) -> list[str]:
    lines = ["| workers | shards | payload | system | round trip ms, median [min-max] | GB/s "
             "| x raw limit | CPU ms/round |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cpu = f"{r.cpu_s.median * 1e3:.2f}" if r.cpu_s else ""
        lines.append(
            f"| {r.workers} | {'-' if r.shards is None else r.shards} | "
            f"{format_size(r.bytes)} | {r.system} | {_ms(r.round_s)} | "
            f"{r.gbps.median:.3f} | {_ratio(r.ratio_to_limit)} | {cpu} |")
    return lines


def markdown(result: BenchResult) -> str:
    """The sweep (and the across-hosts rows) and the goals as Markdown tables (for
    docs/performance.md)."""
    sweep = result.sweep or ()
    hosts = result.hosts.rows if result.hosts else ()
    cluster = result.cluster.rows if result.cluster else ()
    lines = [*_markdown_rows(sweep), ""] if sweep or not (hosts or cluster) else []
    if hosts:
        lines += ["Across hosts (two network namespaces over veth):", "",
                  *_markdown_rows(hosts), ""]
    if result.cluster is not None and cluster:
        lines += _cluster_markdown(result.cluster)
    lines += ["| goal | measured | target | status |", "|---|---|---|---|"]
    for g in result.goals or evaluate_goals(result):
        v = g.measured
        lines.append(f"| {g.goal} | {'-' if v is None else f'{v:.2f}'} | {g.target} "
                     f"| {g.status} |")
    return "\n".join(lines) + "\n"
