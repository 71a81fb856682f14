"""``paramserver bench``: side-by-side benchmarks (raw ZeroMQ, this project, torch RPC, gloo,
Ray's actor parameter server).

Only argument handling lives here; the work is done by :mod:`paramserver.benchmarks.run`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import click

from paramserver.errors import ConfigError, ParamServerError

__all__ = ["bench"]

log = logging.getLogger(__name__)


def _csv_ints(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError as exc:
        raise click.BadParameter(f"{text!r}: give integers separated by commas, e.g. 1,2,4"
                                 ) from exc
    if any(v < 1 for v in values):
        raise click.BadParameter(f"{text!r}: every value must be >= 1")
    return values


EPILOG = """\b
Examples:
  # a smoke run of every part but hosts (a minute or two)
  paramserver bench --quick --out runs/bench-quick
\b
  # only the push + pull sweep, this project against torch RPC, two payloads
  paramserver bench --part sweep --system ps --system rpc --size 1MiB --size 64MiB \\
      --workers 1,4 --shards 1,2
\b
  # the same with gradients sent as bfloat16
  paramserver bench --part sweep --system ps --wire-dtype bfloat16 --quick
\b
  # across hosts: shards in one network namespace, workers in another, over a
  # veth pair (run as root, with iproute2; skipped otherwise), about a minute
  paramserver bench --part hosts --size 1MiB --size 16MiB --size 100MiB
\b
  # across a cluster: 2 and 4 workers on hosts of their own, their shards on as many
  # server hosts (and on the worker hosts), every NIC at 400 Mbit/s both ways, against
  # gloo's all_reduce and raw pyzmq (root, iproute2 and tc; a few minutes)
  paramserver bench --part cluster --workers 2,4 --size 8MiB --size 32MiB --link 400mbit
\b
  # what a backup per shard costs (1 KiB and 100 MiB), and the failover time
  paramserver bench --part replication
  # a live reshard's pause against a checkpoint and restart (16 and 256 MiB)
  paramserver bench --part reshard
\b
See docs/performance.md for what each part measures and the goals it checks.
"""


@click.command("bench", epilog=EPILOG,
               short_help="Measure push + pull against raw pyzmq, torch rpc, gloo and Ray.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              default=Path("runs/bench"), show_default=True,
              help="Directory for result.json and the processes' logs.")
@click.option("--quick", is_flag=True, help="A smoke run: small payloads, few repeats "
              "(a minute or two).")
@click.option("--full", is_flag=True, help="Every payload on every workers x shards point.")
@click.option("--part", "parts", multiple=True,
              type=click.Choice(["sweep", "async", "memory", "overlap", "hosts",
                                 "replication", "cluster", "reshard"]),
              help="Run only these parts (repeatable; default: all but hosts, "
                   "replication, cluster and reshard). reshard: a live move 2 -> 3 "
                   "shards against checkpoint + reshard + restart. hosts: raw pyzmq and "
                   "this project across two network namespaces (root). replication: "
                   "push+pull with and without --replicas 1, and the failover time. "
                   "cluster: the sync round on N worker and N server hosts (network "
                   "namespaces on a bridge, NICs at --link; root) against gloo "
                   "all_reduce and raw pyzmq, beside the limits M/B and 2(N-1)/N·M/B.")
@click.option("--system", "systems", multiple=True,
              type=click.Choice(["raw", "ps", "rpc", "gloo", "ray"]),
              help="Systems in the sweep (repeatable; raw, the limit, is always in). ray "
                   "(also measured in the async part) needs the bench extra: "
                   "pip install 'paramserver[bench]'; by default it is in when installed.")
@click.option("--size", "sizes", multiple=True, metavar="SIZE",
              help="Payloads instead of the preset's, e.g. --size 1KiB --size 100MiB "
                   "(measured on every workers x shards point).")
@click.option("--workers", metavar="N,...", help="Worker counts, e.g. 1,2,4.")
@click.option("--shards", metavar="S,...", help="Shard counts, e.g. 1,2,4.")
@click.option("--repeats", type=click.IntRange(min=2),
              help="Repeats per cell (default 5; 9 in the hosts part).")
@click.option("--wire-dtype", type=click.Choice(["bfloat16", "float16", "none"]),
              default="none", show_default=True,
              help="Also measure the project with gradients sent in 16 bits.")
@click.option("--no-lean", is_flag=True,
              help="Do not add the row with the divergence watchdog turned off.")
@click.option("--link", default="400mbit", show_default=True, metavar="RATE",
              help="The cluster part's NIC rate, every host's, both ways, as tc writes it "
                   "(e.g. 400mbit, 1gbit).")
@click.option("--malloc", type=click.Choice(["tuned", "default"]), default="tuned",
              show_default=True, help="tuned: every process (of every system) keeps freed "
              "buffers for reuse; default: glibc's own behaviour, for comparison.")
def bench(out: Path, quick: bool, full: bool, parts: tuple[str, ...],
          systems: tuple[str, ...], sizes: tuple[str, ...], workers: str | None,
          shards: str | None, repeats: int | None, wire_dtype: str, no_lean: bool,
          malloc: str, link: str) -> None:
    """Measure push + pull against a raw pyzmq loop (the limit), torch.distributed.rpc used
    as a parameter server, gloo all_reduce and Ray's actor parameter server, in one run on
    the same payloads; then async
    throughput, shard memory and overlap of communication with backward; on request
    (--part hosts) push + pull against raw pyzmq across two network namespaces, and
    (--part cluster) the sync round across emulated hosts against gloo's all_reduce. Writes
    OUT/result.json and prints the tables and the goals."""
    from paramserver.benchmarks.common import parse_size
    from paramserver.benchmarks.run import (
        DEFAULT_PARTS,
        BenchOptions,
        default_systems,
        run_benchmarks,
    )
    from paramserver.cli.progress import cli_console

    if quick and full:
        raise click.UsageError("--quick and --full exclude each other")
    try:
        opts = BenchOptions(
            out=out, preset="quick" if quick else "full" if full else "default",
            parts=parts or DEFAULT_PARTS,
            systems=tuple(dict.fromkeys(("raw", *systems))) if systems else default_systems(),
            sizes=[parse_size(s) for s in sizes] or None,
            workers=_csv_ints(workers), shards=_csv_ints(shards), repeats=repeats,
            wire_dtype=None if wire_dtype == "none" else wire_dtype, lean=not no_lean,
            malloc=malloc, link=link,
        )
        run_benchmarks(opts, cli_console())
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    except ParamServerError as exc:
        raise click.ClickException(str(exc)) from exc
