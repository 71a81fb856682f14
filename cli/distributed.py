"""``paramserver run``: one rank of a run started by torchrun or Slurm.

Start the same command on every rank; the launcher's environment says which
rank this is. The role mapping and the rendezvous live in
:mod:`paramserver.workers.launch.rendezvous`; this module only turns options into configs.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from paramserver.core import features
from paramserver.errors import ConfigError, ParamServerError, RemoteError, TransportError
from paramserver.workers.config import (
    EVALUATOR_ENV,
    OPTIONS_ENV,
    LaunchOptions,
    WorkerConfig,
    check_evaluator,
)
from paramserver.workers.launch.clusterspec import ClusterSpec

from . import options
from .launch import refuse_for_command
from .server import ready_printer
from .worker import fail, summary
from .workercount import check_job_workers

if TYPE_CHECKING:
    from paramserver.server.config import ServerConfig
    from paramserver.workers.launch.rendezvous import Rendezvous, Role

__all__ = ["run"]

EPILOG = """\b
Examples:
\b
torchrun, one node, 2 servers + 2 workers:
  torchrun --nnodes 1 --nproc-per-node 4 -m paramserver.cli run --num-servers 2 \\
      --mode sync --steps 150
(or, with the console script: torchrun ... --no-python paramserver run ...)

\b
torchrun, two nodes (run on each; node 0 is 10.0.0.5):
  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
      --rdzv-endpoint 10.0.0.5:29400 --rdzv-id job42 \\
      --no-python paramserver run --num-servers 2 --port 5600

\b
Slurm, 8 tasks on 2 nodes (2 servers, 6 workers):
  srun --nodes 2 --ntasks 8 --kill-on-bad-exit=1 \\
      paramserver run --num-servers 2 --mode ssp --staleness-bound 2

\b
your own script (on paramserver.DistributedOptimizer) as every worker rank:
  torchrun --nnodes 1 --nproc-per-node 4 --no-python \\
      paramserver run --num-servers 1 --out runs/mine -- python train.py

\b
Ranks 0..S-1 are servers (shard = rank), the others workers. Servers publish
their addresses in torch.distributed's TCPStore at MASTER_ADDR:MASTER_PORT
(Slurm: on the first node); workers wait for them (--rendezvous-timeout) and
say which server ranks are missing. When the last worker is done, every
server stops, so the launcher sees all ranks exit. See docs/multihost.md.
"""


def command_env(worker: WorkerConfig, out: Path) -> dict[str, str]:
    """What ``launch -- COMMAND`` also hands a rank's script, for ``run -- COMMAND``: the
    worker options that act on its DistributedOptimizer (LaunchOptions: the straggler
    options, the client's), in ``out/configs/worker<rank>.json``, its seed and evaluator."""
    import json

    path = ClusterSpec.options_file(worker.rank, out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(LaunchOptions.of(worker, worker.straggler).to_json()))
    return {OPTIONS_ENV: str(path), "PARAMSERVER_SEED": str(worker.seed),
            EVALUATOR_ENV: str(worker.evaluator)}


def _place(config: ServerConfig, rdzv: Rendezvous, role: Role, out: Path | None
           ) -> ServerConfig:
    """This server rank's shard and replica, placed with every other server rank's node
    in view (a shard's replicas on different nodes where there are several)."""
    import socket

    from paramserver.workers.launch.clusterspec import replica_name

    replacement = rdzv.replaces(role)
    placed = rdzv.place(role, socket.gethostname(), replacement)
    name = replica_name(placed.shard, placed.replica)
    what = "a backup" if placed.replica else "its first primary"
    if replacement:
        what = "started in place of a dead one: it rejoins its shard's primary"
    click.echo(f"paramserver run: server rank {role.index} is replica {placed.replica} of "
               f"shard {placed.shard} ({what})", err=True)
    config = dataclasses.replace(config, shard=placed.shard, replica=placed.replica,
                                 event_log=str(out / "events" / f"{name}.jsonl") if out else None)
    if not replacement:
        return config
    # the same steps as launch's replacement (workers/launch/replicas.py): the dead
    # replica's address, once the shard has a primary other than it
    from paramserver.workers.launch.replicas import rejoin_config

    config = rejoin_config(config, rdzv.shard_replicas(placed.shard), rdzv.timeout)
    click.echo(f"paramserver run: server rank {role.index} takes {config.bind} and joins "
               f"{config.replica_peers[0]}", err=True)
    return config


def _resharded_resume(config: ServerConfig) -> ServerConfig:
    """``--resume DIR`` on another shard count than DIR's, checkpointing into DIR: the
    shard reshards it as it loads it and checkpoints beside it (persist/reshard.py)."""
    from paramserver.persist.reshard import resume_elsewhere

    target = resume_elsewhere(config.resume, config.checkpoint_dir, config.num_shards)
    if target is None:
        return config
    click.echo(f"paramserver run: {config.resume} was checkpointed on another number of "
               f"shards; resharded to {config.num_shards} as it resumes, shard "
               f"{config.shard} checkpoints into {target}", err=True)
    return dataclasses.replace(config, checkpoint_dir=str(target))


def _replication_key(config: ServerConfig, out: Path | None) -> ServerConfig:
    """A replicated shard's key: --replication-key, or the one --curve-secret-key
    gives, or the run's own in OUT/keys/replication.key, made by the first server rank
    that gets there (OUT on a shared file system: every node's ranks find it)."""
    from paramserver.server.config import NO_REPLICATION_KEY
    from paramserver.wire.replauth import shared_key_file

    if config.replication_key or config.curve_secret_key:
        return config
    if out is None:
        raise ConfigError(f"{NO_REPLICATION_KEY}; or --out DIR, on a file system every "
                          f"server rank shares, where the run makes its own")
    key = shared_key_file(out / "keys" / "replication.key")
    return dataclasses.replace(config, replication_key=str(key))


def _nth_port(base: int, index: int) -> int:
    """Shard ``index``'s port from a base port (0 stays 0: any free port)."""
    return base + index if base else 0


@click.command("run", epilog=EPILOG,
               short_help="One rank of a torchrun or Slurm job.")
@options.apply_groups("run")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="[-- COMMAND [ARGS]...]")
@click.pass_context
def run(ctx: click.Context, **opts: Any) -> None:
    """Run this rank of a multi-host job as a server or a worker (torchrun or Slurm).

    After `--`, worker ranks run your own script instead of the built-in loop,
    with PARAMSERVER_SERVERS, RANK (among the workers), WORLD_SIZE (the number
    of workers), LOCAL_RANK, PARAMSERVER_SEED and PARAMSERVER_EVALUATOR set. As
    for `launch -- COMMAND`, the straggler and client options act on its
    DistributedOptimizer and the built-in loop's options (--task, --steps,
    ...) are refused. The last worker to finish saves the servers' final
    weights as OUT/final_model.safetensors.
    """
    # the rendezvous (torch.distributed's store), the server loop and the training loop
    # load only when a rank runs, not for --help
    from paramserver.workers.launch.rendezvous import (
        Rendezvous,
        RendezvousError,
        assign_role,
        default_host,
        launch_env,
        run_command_rank,
        run_server_rank,
        run_worker_rank,
    )

    command = list(opts.pop("command") or ())
    if command:  # the same refusals as launch -- COMMAND: one table decides
        refuse_for_command(ctx)
    out = Path(opts["out"]) if opts["out"] else None
    if opts["trace"] and out is None:
        raise click.UsageError("--trace writes DIR/trace: give --out DIR")
    if opts["trace"] and command:
        raise click.UsageError("--trace replays the built-in loop's gradients: not with a "
                               "command (after --)")
    trace = out / "trace" if opts["trace"] and out is not None else None
    # every option is checked before the launcher's environment is even read
    server_template = options.server_config(opts, bind="tcp://127.0.0.1:0")
    worker_template = options.worker_config(ctx, opts, servers=["rendezvous"])
    with options.user_errors():  # the pairs launch refuses too (one table)
        features.check(features.of_run(server_template.features(), worker_template.features(),
                                       bool(command), worker_template.task))
    options.maybe_print_config(ctx, opts)
    with options.user_errors():
        env = launch_env(launcher=opts["launcher"], store_host=opts["store_host"],
                         store_port=opts["store_port"])
        role = assign_role(env.rank, env.world_size, opts["num_servers"],
                           server_template.replicas)
    check_job_workers(ctx, role.num_workers,
                      f"{role.num_workers} worker ranks in this job ({env.world_size} ranks - "
                      f"--num-servers {opts['num_servers']})")
    with options.user_errors("--evaluator"):
        check_evaluator(worker_template.evaluator, role.num_workers)
    click.echo(f"paramserver run: rank {env.rank} of {env.world_size} ({env.launcher}) is "
               f"{role.describe()}; rendezvous at {env.store}", err=True)
    if role.kind == "server":
        with options.user_errors("--host"):
            host = opts["host"] or default_host(env)
        with options.user_errors():
            # with replicas, the shard and replica come from the rendezvous (_place)
            config = dataclasses.replace(
                server_template, shard=0 if role.replicas else role.index,
                num_shards=role.num_servers,
                bind=options.bind_address(host, _nth_port(opts["port"], role.index)),
                metrics_port=None if opts["metrics_port"] is None
                else _nth_port(opts["metrics_port"], role.index),
                expected_workers=role.num_workers,
                event_log=str(out / "events" / f"server{role.index}.jsonl") if out else None,
                trace=str(trace / f"shard{role.index}.pstrace") if trace else None,
            )
            if role.replicas:
                config = _replication_key(config, out)
            config = _resharded_resume(config)
    else:
        device = worker_template.device
        if device == "auto":  # one GPU per local rank, where there are GPUs
            import torch

            if torch.cuda.is_available():
                device = f"cuda:{env.local_rank % torch.cuda.device_count()}"
        with options.user_errors():
            wconfig = dataclasses.replace(
                worker_template, rank=role.index, world_size=role.num_workers, device=device,
                event_log=str(out / "events" / f"worker{role.index}.jsonl") if out else None,
                result_file=str(out / "results" / f"worker{role.index}.json") if out else None,
                trace=str(trace / f"worker{role.index}.pstrace") if trace else None,
            )
    try:
        rdzv = Rendezvous(env, opts["rendezvous_timeout"])
        if role.kind == "server":
            if role.replicas:
                config = _place(config, rdzv, role, out)
            code = run_server_rank(config, rdzv, ready_printer(config))
            click.echo(f"paramserver: shard {role.index} stopped", err=True)
            ctx.exit(code)
        elif command:
            with tempfile.TemporaryDirectory(prefix="paramserver-run-") as tmp:
                extra = command_env(wconfig, out or Path(tmp))
                code = run_command_rank(command, rdzv, role.num_servers, role.index,
                                        role.num_workers, env.local_rank, out,
                                        extra_env=extra)
            ctx.exit(code)
        else:
            result = run_worker_rank(wconfig, rdzv, role.num_servers, out=out)
            click.echo(summary(result))
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    except RendezvousError as exc:
        raise click.ClickException(f"rank {env.rank}: {exc}") from exc
    except (TransportError, RemoteError) as exc:
        if role.kind == "worker":
            raise fail(f"worker {role.index} (rank {env.rank})", exc) from exc
        raise click.ClickException(f"rank {env.rank}: {exc}") from exc
    except ParamServerError as exc:
        raise click.ClickException(f"rank {env.rank}: {exc}") from exc

