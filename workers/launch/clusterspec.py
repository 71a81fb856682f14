"""What a local run is: :class:`ClusterSpec` (every server's and worker's template,
the stragglers, the failure policy) and :class:`Progress`, what the launcher knows
while workers run. :mod:`~paramserver.workers.launch.cluster` runs it.

Apart from cluster.py (the launcher, which starts the server loop, ZeroMQ and torch)
so that the CLI declares ``launch``'s options without loading them; the CURVE helpers
(ZeroMQ) load only when a spec's keys are used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from paramserver.core import features
from paramserver.core.limits import MAX_PLAN_SERVERS
from paramserver.errors import ConfigError
from paramserver.server.config import ServerConfig, option
from paramserver.util.jsontypes import JSONObject
from paramserver.workers.config import (
    EVALUATOR_ENV,
    OPTIONS_ENV,
    RUN_ENV,
    LaunchOptions,
    WorkerConfig,
    check_evaluator,
)
from paramserver.workers.launch.hostplan import (
    DEFAULT_LINK,
    HostPlan,
    normalize_link_of,
    parse_link_items,
)
from paramserver.workers.stragglerspec import StragglerSpec, parse_straggler_items

if TYPE_CHECKING:
    from paramserver.wire.curve import CurveKeys

__all__ = ["FAILURE_POLICIES", "ClusterSpec", "Progress", "replica_name"]

FAILURE_POLICIES = ("fail", "tolerate", "restart")


def replica_name(shard: int, replica: int) -> str:
    """A shard replica's process name: ``server0`` for the first primary, ``server0r1``
    for its backup 1."""
    return f"server{shard}" + (f"r{replica}" if replica else "")


def parse_reshard_items(items: Sequence[str]) -> dict[str, int]:
    """``["ROUND:S"]`` (``--reshard-at 100:3``) -> ``{"100": 3}`` (keys as JSON's)."""
    out: dict[str, int] = {}
    for item in items:
        at, sep, to = str(item).partition(":")
        if not sep or not at.strip().isdigit() or not to.strip().isdigit() or int(to) < 1:
            raise ConfigError(f"--reshard-at {item!r} must look like ROUND:S, e.g. 100:3 "
                              "(move to 3 shards once 100 sync rounds closed)")
        if str(int(at)) in out:
            raise ConfigError(f"--reshard-at {item!r}: round {int(at)} is given twice (one "
                              "move per round)")
        out[str(int(at))] = int(to)
    return out


@dataclass
class ClusterSpec:
    """A local run: templates for every server and worker, plus per-worker stragglers."""

    num_servers: int = option(2, min=1, max=MAX_PLAN_SERVERS, aliases=("-s",), metavar="S",
                              help="Server (shard) processes.")
    num_workers: int = option(2, min=1, aliases=("--workers", "-n"), metavar="N",
                              help="Worker processes.")
    server: ServerConfig = option(default_factory=ServerConfig, nested=True,
                                  help="Every shard's template (the server options).")
    worker: WorkerConfig = option(default_factory=lambda: WorkerConfig(),
                                  nested=True,
                                  help="Every worker's template (the worker options).")
    #: rank -> spec
    stragglers: dict[int, StragglerSpec] = option(
        default_factory=dict, flag="straggler", kind="pairs", table=False,
        parse=parse_straggler_items,
        metavar="RANK:KEY=VALUE",
        help="Slow down one worker only, e.g. 1:slowdown=3 or 2:delay=exp:0.05 (repeatable; "
             "keys as the straggler options).")
    #: emulated hosts (paramserver/workers/launch/hostplan.py): "W+S", None: none
    hosts: str | None = option(
        None, metavar="W+S",
        help="Run on emulated hosts (Linux, root): W worker hosts and S server hosts, each "
             "a network namespace on one bridge with a NIC shaped to --link both ways. "
             "Worker r runs on worker host r % W, shard i on server host i % S (S = 0: on "
             "the worker hosts); they talk over TCP between the hosts' addresses, as "
             "across machines.")
    link: str | None = option(
        None, metavar="RATE",
        help=f"With --hosts: every host's NIC rate, both ways, in tc's units (400mbit, "
             f"1gbit, 2.5gbit) [default: {DEFAULT_LINK}].")
    #: host -> its NIC rate, in place of ``link``
    link_of: dict[int, str] = option(
        default_factory=dict, flag="link-of", kind="pairs", table=False,
        parse=parse_link_items, metavar="HOST=RATE",
        help="With --hosts: host HOST's NIC at RATE instead, e.g. 2=100mbit: a network "
             "straggler (repeatable). Hosts are numbered worker hosts first (0 .. W-1), "
             "then server hosts (W .. W+S-1).")
    #: live reshards (issue 47): sync round -> the shard count to move to then
    reshard_at: dict[int, int] = option(
        default_factory=dict, flag="reshard-at", kind="pairs", table=False,
        parse=parse_reshard_items, metavar="ROUND:S",
        help="Move the running job to S shards, live, once ROUND sync rounds closed "
             "(repeatable; paramserver reshard: shards it adds start empty, shards it "
             "removes hand off and stop; workers follow without restarting).")
    startup_timeout: float = option(120.0, min=0, min_open=True, metavar="SECONDS",
                                    help="How long a server may take to report its address.")
    run_timeout: float | None = option(None, min=0, min_open=True, metavar="SECONDS",
                                       help="Stop everything if training takes longer.")
    stall_warning: float = option(
        60.0, min=0, metavar="SECONDS",
        help="Warn, with the last lines of every worker's and shard's log, when no worker "
             "has logged a step for this long, or for 10 times the run's usual time per "
             "step if that is longer (0: never). Training goes on.")
    #: record a trace of every push in DIR/trace (paramserver/observe/trace.py), which
    #: `paramserver simulate --replay DIR` re-runs
    trace: bool = option(False, help="Record every push (arrival order, versions read, "
                                     "decisions, times, bytes) in DIR/trace, for "
                                     "`paramserver simulate --replay` (docs/research.md).")
    evaluate: bool = option(True, flag="eval", dest="eval",
                            help="Evaluate the final weights on held-out data (DIR/final_model."
                                 "safetensors is saved either way).")
    #: what a worker's failure does: "fail" the run, "tolerate" it (the others go
    #: on; the server drops it from the live set after the heartbeat timeout) or
    #: "restart" the worker (it registers again and resumes at the minimum clock)
    on_worker_failure: str = option("fail", choices=FAILURE_POLICIES,
                                    help="A worker that dies: fail the run, tolerate it (the "
                                         "others go on) or restart it.")
    #: restart a shard that dies, at the same address, from its latest checkpoint
    restart_servers: bool = option(False,
                                   help="Restart a shard that dies, at its address, from its "
                                        "latest checkpoint.")
    max_restarts: int = option(3, min=0, metavar="K", help="Restarts allowed per process.")
    #: the launcher's Prometheus port (0: any free port); shard i serves on port + 1 + i
    #: (any free port when 0). None: the launcher serves none, shards as the template says
    metrics_port: int | None = option(None, min=0, max=65535, metavar="PORT",
                                      help="Prometheus metrics: the launcher's on PORT, shard "
                                           "i's on PORT + 1 + i (0: any free ports).")
    #: TensorBoard log directory for the launcher and shards
    tensorboard: str | None = option(None, kind="dir",
                                     internal="the server option --tensorboard",
                                     help="TensorBoard log directory for the launcher and "
                                          "shards.")
    #: under CURVE, the launcher's admin secret key file (SHUTDOWN, BYE dead=true); the
    #: shards admit its public key as an admin. None: LocalCluster makes one in out_dir/keys
    admin_key: str | None = option(None, kind="file",
                                   internal="made by the launcher under CURVE",
                                   help="The launcher's admin secret key file.")
    #: run this command once per worker instead of the built-in loop (the user's own
    #: script on DistributedOptimizer), with PARAMSERVER_SERVERS, RANK, WORLD_SIZE,
    #: LOCAL_RANK set; its gradient steps, results and plan land in the run folder
    command: list[str] | None = option(
        None, internal="the arguments after `--` of launch",
        help="Run this command once per worker instead of the built-in loop.")
    #: a cell of `paramserver experiment` (its run folder under runs/): a command then
    #: also finds PARAMSERVER_CELL and PARAMSERVER_STEPS (the grid's steps, a hint)
    cell: str | None = option(None, internal="set by paramserver experiment for each run",
                              help="The experiment cell this run is.")
    #: this run's identity, given to every shard and worker: a shard refuses a worker
    #: of another run (wrong_run). None: LocalCluster makes one (128 random bits)
    run_id: str | None = option(None, internal="made by the launcher for each run",
                                help="This run's identity.")

    def __post_init__(self) -> None:
        if self.on_worker_failure not in FAILURE_POLICIES:
            raise ConfigError(f"on_worker_failure must be one of {', '.join(FAILURE_POLICIES)}; "
                              f"got {self.on_worker_failure!r}")
        if self.num_servers < 1 or self.num_workers < 1:
            raise ConfigError("a cluster needs at least one server and one worker")
        check_evaluator(self.worker.evaluator, self.num_workers)
        if self.metrics_port is not None and not (
                self.metrics_port >= 0 and self.metrics_port + self.num_servers <= 65535):
            raise ConfigError(f"metrics_port must be 0 (any free port) or leave room for "
                              f"{self.num_servers} shard ports above it; got {self.metrics_port}")
        if bool(self.server.curve_secret_key) != bool(self.worker.curve_key):
            raise ConfigError("CURVE is on for one side only: give the servers curve_secret_key "
                              "and the workers curve_key + curve_server_key, or neither")
        if self.admin_key and not self.server.curve_secret_key:
            raise ConfigError("admin_key needs CURVE (without it everyone is trusted)")
        if self.server.replicas and self.restart_servers:
            raise ConfigError("--replicas works without --restart-servers (the launcher "
                              "replaces a dead replica itself, from its live peer's state)")
        self.reshard_at = {int(k): int(v) for k, v in self.reshard_at.items()}
        if self.reshard_at:
            if self.server.mode != "sync":
                raise ConfigError("--reshard-at ROUND:S moves a sync run at a round; move "
                                  "an async or SSP run with paramserver reshard")
            if self.restart_servers:
                raise ConfigError("--reshard-at works without --restart-servers (a restart "
                                  "would bring a shard back on the old plan)")
            if min(self.reshard_at.values()) < 1 or min(self.reshard_at) < 0:
                raise ConfigError("--reshard-at ROUND:S needs ROUND >= 0 and S >= 1")
            if max(self.reshard_at.values()) > MAX_PLAN_SERVERS:
                raise ConfigError(f"--reshard-at ROUND:S: at most {MAX_PLAN_SERVERS} shards "
                                  f"(a plan's servers, as the wire bounds them), got "
                                  f"{max(self.reshard_at.values())}")
            steps = self.worker.steps
            late = [r for r in self.reshard_at if steps is not None and r > steps]
            if late:
                raise ConfigError(f"--reshard-at {min(late)}:{self.reshard_at[min(late)]}: "
                                  f"the run closes at most {steps} rounds (--steps {steps}), "
                                  "so the move would never happen")
        features.check(self.features())  # one table: paramserver/core/features.py
        self.link_of = normalize_link_of(self.link_of)  # (JSON and TOML keys are text)
        if self.hosts is None:
            if self.link is not None or self.link_of:
                raise ConfigError("--link and --link-of set the emulated hosts' NICs: give "
                                  "--hosts W+S too")
        else:
            HostPlan.parse(self.hosts, self.link, self.link_of).check(self.num_workers,
                                                                     self.num_servers)

    def host_plan(self) -> HostPlan | None:
        """The emulated hosts this run runs on (None: all on this machine's loopback)."""
        if self.hosts is None:
            return None
        return HostPlan.parse(self.hosts, self.link, self.link_of)

    def features(self) -> set[str]:
        """The features of paramserver/core/features.py this run turns on."""
        return features.of_run(self.server.features(), self.worker.features(),
                               bool(self.command), self.worker.task) | (
            {"trace"} if self.trace else set()) | ({"hosts"} if self.hosts else set()) | (
            {"live_reshard"} if self.reshard_at else set())

    def client_curve(self) -> CurveKeys | None:
        """The workers' CURVE keys, for the launcher's own connections (stats, eval, stop)."""
        from paramserver.wire.curve import CurveKeys  # zmq: when a cluster runs, not --help

        if not self.worker.curve_key:
            return None
        return CurveKeys.load(self.worker.curve_key, self.worker.curve_server_key)

    def admin_curve(self) -> CurveKeys | None:
        """The launcher's admin keys, for SHUTDOWN and death reports (None: no CURVE);
        without an admin key, the workers' (which a shard then refuses)."""
        from paramserver.wire.curve import CurveKeys

        if not self.admin_key:
            return self.client_curve()
        return CurveKeys.load(self.admin_key, self.worker.curve_server_key)

    def server_config(self, shard: int, out: Path) -> ServerConfig:
        from paramserver.wire.curve import public_key

        metrics_port = self.server.metrics_port
        if self.metrics_port is not None:  # 0: any free port, for the launcher and shards
            metrics_port = self.metrics_port + 1 + shard if self.metrics_port else 0
        admins = list(self.server.admin_keys)
        if self.admin_key:  # the public half, as text: no secret file goes to a shard
            admins.append(public_key(self.admin_key))
        return dataclasses.replace(
            self.server, shard=shard, num_shards=self.num_servers,
            expected_workers=self.num_workers,
            event_log=str(out / "events" / f"server{shard}.jsonl"), admin_keys=admins,
            trace=str(out / "trace" / f"shard{shard}.pstrace") if self.trace else None,
            run_id=self.run_id,
            metrics_port=metrics_port, tensorboard=self.tensorboard or self.server.tensorboard,
        )

    def replica_config(self, shard: int, replica: int, out: Path) -> ServerConfig:
        """Backup ``replica`` (1 .. R) of ``shard``: the shard's config (its checkpoint
        directory and schedule too: a backup writes the shard's checkpoints while it
        is one, paramserver/server/replicackpt.py), its own event log and no fixed
        metrics port."""
        cfg = self.server_config(shard, out)
        return dataclasses.replace(
            cfg, replica=replica, event_log=str(out / "events" / f"{replica_name(shard, replica)}"
                                                                  f".jsonl"),
            on_divergence="stop" if cfg.on_divergence == "checkpoint-and-stop"
            else cfg.on_divergence,
            metrics_port=None if cfg.metrics_port is None else 0, tensorboard=None)

    def command_env(self, rank: int, servers: list[str], out: Path) -> dict[str, str]:
        """What a worker's command finds in its environment (see DistributedOptimizer)."""
        env = {"PARAMSERVER_SERVERS": ",".join(servers), "RANK": str(rank),
               "WORLD_SIZE": str(self.num_workers), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(self.num_workers),
               "PARAMSERVER_EVENT_LOG": str(out / "events" / f"worker{rank}.jsonl"),
               "PARAMSERVER_RESULT_FILE": str(out / "results" / f"worker{rank}.json"),
               "PARAMSERVER_PLAN_FILE": str(out / "plan.json"),
               "PARAMSERVER_SEED": str(self.worker.seed),
               EVALUATOR_ENV: str(self.worker.evaluator),
               # the launcher's worker options, this rank's straggler among them
               OPTIONS_ENV: str(self.options_file(rank, out))}
        if self.run_id:
            env[RUN_ENV] = self.run_id
        if self.worker.curve_key:
            env["PARAMSERVER_CURVE_KEY"] = self.worker.curve_key
            env["PARAMSERVER_CURVE_SERVER_KEY"] = self.worker.curve_server_key or ""
        if self.cell is not None:  # the script owns its loop: the steps are a hint
            env["PARAMSERVER_CELL"] = self.cell
            if self.worker.steps is not None:
                env["PARAMSERVER_STEPS"] = str(self.worker.steps)
        return env

    @staticmethod
    def options_file(rank: int, out: Path) -> Path:
        """Where a command run's worker ``rank`` finds its :meth:`launch_options`."""
        return out / "configs" / f"worker{rank}.json"

    def launch_options(self, rank: int) -> LaunchOptions:
        """What acts on worker ``rank``'s DistributedOptimizer in a command run."""
        return LaunchOptions.of(self.worker, self.stragglers.get(rank, self.worker.straggler))

    def worker_config(self, rank: int, servers: list[str], out: Path) -> WorkerConfig:
        return dataclasses.replace(
            self.worker, rank=rank, world_size=self.num_workers, servers=servers,
            straggler=self.stragglers.get(rank, self.worker.straggler),
            event_log=str(out / "events" / f"worker{rank}.jsonl"),
            result_file=str(out / "results" / f"worker{rank}.json"), run_id=self.run_id,
            trace=str(out / "trace" / f"worker{rank}.pstrace") if self.trace else None,
        )

    def to_dict(self) -> JSONObject:
        """The spec as a JSON document (result.json's ``spec``, the launcher's start event)."""
        data: JSONObject = dataclasses.asdict(self)
        data["stragglers"] = {str(k): dataclasses.asdict(v) for k, v in self.stragglers.items()}
        data["link_of"] = {str(k): v for k, v in sorted(self.link_of.items())}
        return data


@dataclass
class Progress:
    """What the launcher knows while workers run (read from their event logs)."""

    steps: dict[int, int]
    total_steps: int
    last_loss: dict[int, float]
    applied: int
    elapsed: float

    @property
    def done_steps(self) -> int:
        return sum(self.steps.values())
