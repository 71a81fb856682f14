"""Every option declared once: config dataclasses whose fields carry their own metadata.

A config field is declared with :func:`option`: its type (the annotation), its
default, its help text, its bounds or choices, its flag name where that differs
from the field name, and whether it is a flag at all. Everything else is
derived from that one declaration:

* the click options of ``paramserver server``, ``worker``, ``launch`` and
  ``run`` (``paramserver.cli.options`` builds them from :func:`options_of`),
* their environment variables (``PARAMSERVER_<FLAG>``), TOML keys (the flag
  without dashes) and ``--print-config`` output,
* the bounds :func:`check_bounds` enforces when a config is constructed,
* the tables in docs/cli.md (tests/test_cli.py checks them against these).

:class:`ServerConfig` lives here; ``WorkerConfig`` (``paramserver.workers.worker``),
``StragglerSpec`` and ``ClusterSpec`` declare their fields the same way.
"""

from __future__ import annotations

import dataclasses
import os
import reprlib
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

# only light modules: the CLI declares its options from these classes, and `--help`
# must not wait for torch (tests/test_cli_startup.py)
from paramserver.core import features
from paramserver.core.features import BUILTIN_POLICIES
from paramserver.core.limits import PlanLimits, estimate_copies
from paramserver.core.modes import MODES, CoreConfig, Mode, ModeSpec
from paramserver.core.stepsize import LR_SCALINGS
from paramserver.errors import ConfigError
from paramserver.observe.thresholds import (
    ACTIONS,
    DEFAULT_OBSERVE,
    WatchdogConfig,
    parse_observe,
)
from paramserver.util.coerce import MISSING, coerce, guess, parse_kwargs, parse_policy_args

if TYPE_CHECKING:
    from paramserver.compress import Compression
    from paramserver.core.shard import ShardCore
    from paramserver.core.sharding import ShardPlan
    from paramserver.policies.base import StalenessPolicy

__all__ = [
    "OPTION",
    "ConfigRecord",
    "Opt",
    "ServerConfig",
    "check_bounds",
    "option",
    "options_of",
    "parse_pairs",
    "parse_watchdog_args",
    "pull_compression",
]

#: the key of a field's metadata that holds its :class:`Opt`
OPTION = "paramserver.option"


@dataclass(frozen=True)
class Opt:
    """What one config field means to a person: help, bounds, flag.

    ``kind`` says what a text value names, for the CLI's checks: ``"dir"``,
    ``"file"``, ``"path"`` (either), ``"address"`` (``HOST:PORT`` list), ``"shards"``
    (the same, a replicated shard's replicas joined by ``|``), or
    ``"pairs"`` (``KEY=VALUE`` items, parsed by ``parse``). ``internal`` (a
    reason) marks a field with no flag of its own: set by the launcher, or from
    other flags. ``per_process`` marks a field only the one-process commands
    (``server``, ``worker``) take; ``launch`` and ``run`` set it per process.
    ``nested`` marks a field whose type is another config dataclass, whose
    fields are flags in its place.
    """

    help: str = ""
    flag: str | None = None  # the long flag without "--" (default: the field name, "-" for "_")
    aliases: tuple[str, ...] = ()  # more declarations, e.g. ("--workers", "-n")
    dest: str | None = None  # the click parameter name (default: the field name)
    metavar: str | None = None
    min: float | None = None
    max: float | None = None
    min_open: bool = False
    max_open: bool = False
    choices: tuple[str, ...] | None = None
    kind: str | None = None
    parse: Callable[[list[str]], Mapping[str, Any]] | None = None
    table: bool = True  # "pairs": a config file may give a TOML table
    negatable: bool = True  # bool: --x/--no-x (False: a plain --x switch)
    internal: str | None = None
    per_process: bool = False
    nested: bool = False
    required: bool = False  # the flag must be given (the field's default is a placeholder)
    cli_default: Any = MISSING  # the flag's default when it differs from the field's

    @property
    def bounded(self) -> bool:
        return self.min is not None or self.max is not None

    def describe_bounds(self) -> str:
        """``>= 1``, ``> 0``, ``in [0, 1)``, ``one of a, b`` or ``""``."""
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.min is not None and self.max is not None:
            return (f"in {'(' if self.min_open else '['}{self.min:g}, "
                    f"{self.max:g}{')' if self.max_open else ']'}")
        if self.min is not None:
            return f"{'>' if self.min_open else '>='} {self.min:g}"
        if self.max is not None:
            return f"{'<' if self.max_open else '<='} {self.max:g}"
        return ""


#: a replicated shard started by hand without a replication key (one line: CLI, loop)
NO_REPLICATION_KEY = (
    "--replicas needs --replication-key FILE, the same file for every replica of the run "
    "(make it once: paramserver keys replication FILE), or --curve-secret-key: without "
    "one, anyone who reaches a replica's port could replicate into it")


def option(default: Any = MISSING, *, default_factory: Any = MISSING, help: str = "",
           **meta: Any) -> Any:
    """A dataclass field with its option metadata (see :class:`Opt`)."""
    metadata = {OPTION: Opt(help=help, **meta)}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    if default is not MISSING:
        return field(default=default, metadata=metadata)
    return field(metadata=metadata)


def options_of(cls: type) -> list[tuple[dataclasses.Field[Any], Opt, Any]]:
    """Each field of a config dataclass with its :class:`Opt` and its resolved type."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        opt = f.metadata.get(OPTION)
        if opt is None:
            raise TypeError(f"{cls.__name__}.{f.name} is declared without option(): every "
                            "config field needs its help and bounds")
        out.append((f, opt, hints[f.name]))
    return out


def field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return MISSING


def check_bounds(obj: Any, declared: type | None = None) -> None:
    """Refuse a field outside the bounds or choices its :class:`Opt` declares; with
    ``declared``, the option of that config class's field of the same name (a record
    whose fields are options declared there: ClientConfig's are WorkerConfig's)."""
    options = None if declared is None else {
        f.name: f.metadata.get(OPTION) for f in dataclasses.fields(declared)}
    for f in dataclasses.fields(obj):
        opt = f.metadata.get(OPTION) if options is None else options.get(f.name)
        if opt is None or not (opt.bounded or opt.choices):
            continue
        value = getattr(obj, f.name)
        if value is None:
            continue
        if opt.choices:
            if value not in opt.choices:
                raise ConfigError(f"{f.name} must be {opt.describe_bounds()}; got {value!r}")
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{f.name} must be a number, got {value!r}")
        low_ok = opt.min is None or (value > opt.min if opt.min_open else value >= opt.min)
        high_ok = opt.max is None or (value < opt.max if opt.max_open else value <= opt.max)
        if not (low_ok and high_ok):
            raise ConfigError(f"{f.name} must be {opt.describe_bounds()}, got {value}")


def parse_pairs(items: Sequence[str], what: str = "argument") -> dict[str, str]:
    """``["key=value", ...]`` -> ``{key: "value"}``; the values stay text, for a later
    :func:`~paramserver.util.coerce.coerce` against the annotations of what takes them."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ConfigError(f"{what} {item!r} must look like key=value")
        out[key.strip()] = value.strip()
    return out


def parse_watchdog_args(items: list[str]) -> dict[str, Any]:
    """``key=value`` -> watchdog options typed by WatchdogConfig's annotations, checked."""
    hints = typing.get_type_hints(WatchdogConfig)
    fields = {f.name: f for f in dataclasses.fields(WatchdogConfig)}
    values: dict[str, Any] = {}
    for key, text in parse_pairs(items, "watchdog argument").items():
        if key == "disable":  # a comma list of rule names, kept as text
            values[key] = text
        elif key in fields:
            values[key] = coerce(text, hints[key], fields[key].default,
                                 what=f"watchdog argument {key}")
        else:
            values[key] = guess(text)  # WatchdogConfig names the options it knows
    WatchdogConfig.from_dict(values)
    return values


class ConfigRecord:
    """``to_dict`` / ``from_dict`` of a config dataclass (the JSON a launcher hands
    each process); ``from_dict`` refuses keys the class does not have."""

    #: what the config configures, for the error message ("server", "worker")
    WHAT: ClassVar[str] = "config"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[_C], data: Mapping[str, Any]) -> _C:
        """The record a mapping read from a file describes (a launcher's config file, a
        trace's header, a run's configs): every value checked against its field's type,
        then its bounds, so that a damaged or hostile file is refused in one line."""
        import msgspec

        if not isinstance(data, Mapping):
            raise ConfigError(f"a {cls.WHAT} config must be a table of options, got "
                              f"{type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown {cls.WHAT} option(s): "
                              f"{', '.join(sorted(map(str, unknown)))[:500]}")
        for f, _, hint in options_of(cls):
            if f.name in data:
                try:
                    msgspec.convert(data[f.name], type=hint, strict=True)
                except (msgspec.ValidationError, TypeError) as exc:
                    raise ConfigError(f"{cls.WHAT} option {f.name}: {exc}; got "
                                      f"{reprlib.repr(data[f.name])}") from exc
        try:
            return cls(**data)
        except ConfigError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ConfigError(f"bad {cls.WHAT} config: {exc}") from exc


_C = TypeVar("_C", bound=ConfigRecord)


@dataclass
class ServerConfig(ConfigRecord):
    """Everything one shard server needs; validated on construction."""

    WHAT: ClassVar[str] = "server"

    shard: int = option(0, min=0, per_process=True,
                        help="This server's shard id, 0 .. num-shards - 1.")
    num_shards: int = option(1, min=1, metavar="S", per_process=True,
                             help="How many shards hold the model (servers and workers must "
                                  "agree).")
    bind: str = option("tcp://127.0.0.1:0", per_process=True,
                       internal="set from --host and --port (launch and run pick it per shard)",
                       help="The address the shard binds, tcp://HOST:PORT.")
    mode: str = option("async", choices=MODES,
                       help="Consistency model. sync: one step per round, averaging every live "
                            "worker's gradient; async: every push is applied on arrival; ssp: "
                            "async, but no worker runs more than --staleness-bound clocks "
                            "ahead of the slowest.")
    staleness_bound: int = option(0, min=0, metavar="S",
                                  help="ssp: how many clocks the fastest worker may lead the "
                                       "slowest.")
    backup_workers: int = option(0, min=0, metavar="B",
                                 help="sync: close each round without the slowest B gradients "
                                      "(dropped, counted).")
    lr_scaling: str = option("none", choices=LR_SCALINGS,
                             help="Large-batch learning-rate rule: the optimizer's lr is for "
                                  "one worker's batch, and a step averaging k gradients (a "
                                  "sync round) runs at k x lr (linear, Goyal et al. 2017) or "
                                  "sqrt(k) x lr (sqrt), k counted live per round. An async or "
                                  "SSP step has k = 1.")
    warmup_steps: int = option(0, min=0, metavar="N",
                               help="With --lr-scaling: ramp the factor from 1 to its full "
                                    "value in equal steps over the first N optimizer steps.")
    momentum_target: float | None = option(
        None, min=0, max=1, max_open=True, metavar="MU",
        help="Asynchrony-aware momentum: set the optimizer's momentum every step so that it "
             "and the implicit momentum of the observed staleness, 1 - 1/(mean staleness + "
             "1) (Mitliagkas et al. 2016), total MU. Needs sgd/rmsprop momentum or adam "
             "betas (docs/research.md).")
    policy: str = option("none", metavar="NAME|module:Class",
                         help="Staleness policy: whether a late update is applied, "
                              "down-weighted or rejected. See `paramserver policies`.")
    policy_args: dict[str, Any] = option(
        default_factory=dict, flag="policy-arg", kind="pairs", parse=parse_policy_args,
        help="Policy parameter, e.g. max_staleness=4 (repeatable).")
    optimizer: str = option("sgd", metavar="NAME|module:Class",
                            help="torch.optim optimizer each shard runs: sgd, adam, adamw, ... "
                                 "or module:Class.")
    optimizer_args: dict[str, Any] = option(
        default_factory=lambda: {"lr": 0.1}, flag="optimizer-arg", kind="pairs",
        parse=parse_kwargs, cli_default={},
        help="Optimizer keyword argument, e.g. momentum=0.9 or betas=0.9,0.999 (repeatable).")
    #: the launch named no optimizer: a worker script's wrapped one is the shards'
    script_optimizer: bool = option(
        False, internal="set by server, launch and run when none of --optimizer, --lr, "
                        "--optimizer-arg is given",
        help="Run the optimizer the first worker's script wraps "
             "(DistributedOptimizer(model, torch.optim.SGD(...))) in place of --optimizer "
             "and --optimizer-arg; a later worker wrapping another is refused.")
    scheduler: str | None = option(None, metavar="NAME|module:Class",
                                   help="torch.optim.lr_scheduler stepped after every optimizer "
                                        "step: step, cosine, linear, ... (default: none).")
    scheduler_args: dict[str, Any] = option(
        default_factory=dict, flag="scheduler-arg", kind="pairs", parse=parse_kwargs,
        help="Scheduler keyword argument, e.g. step_size=100 (repeatable).")
    expected_workers: int = option(1, min=1, metavar="N", per_process=True,
                                   help="Training starts once N workers have said hello.")
    heartbeat_timeout: float = option(10.0, min=0, min_open=True, metavar="SECONDS",
                                      help="A worker silent this long leaves the live set: no "
                                           "sync round or SSP bound waits for it.")
    #: see CoreConfig.round_timeout and Membership.leave_out
    round_timeout: float | None = option(
        None, min=0, metavar="SECONDS",
        help="A live worker that pushes nothing for this long while an open sync round or a "
             "closed SSP gate waits on it is left out, as a straggler, until it pushes again "
             "(0: wait forever) [default: the larger of 3 heartbeat timeouts and 10 times "
             "the usual time between a worker's pushes].")
    check_finite: bool = option(True, help="Reject gradients that contain NaN or Inf.")
    # the pull's compressor (DoubleSqueeze: core/pullsqueeze.py); the push's is --compression
    pull_compression: str | None = option(
        None, metavar="NAME[:key=value,...]",
        help="Compress each worker's pull: send it the compressed change of the weights "
             "since what it holds, keeping what was left out for its next pull "
             "(DoubleSqueeze; error feedback always), e.g. int8 or topk:ratio=0.01 (names "
             "as --compression's; none: dense pulls). A worker without its copy (new, "
             "restarted, resumed) gets it whole first.")
    shm_release: bool | None = option(
        None, help="Unmap each used part of a same-host worker's shared-memory gradient "
                   "from the shard, so that its resident set stays near weights + "
                   "optimizer state + one aggregation buffer instead of growing by each "
                   "such worker's gradient (pages the worker owns); the price is mapping "
                   "them again on every push (about 6 ms per 100 MiB here). Default: "
                   "release unless the pages are the only copy the step reads (one "
                   "same-host worker and plain SGD, which steps straight from them).")
    threads: int = option(1, min=0, max=1024, metavar="N", per_process=True,
                          help="Intra-op threads of a shard process's torch (0: torch's "
                               "default, one per core). A shard's work is memory-bound "
                               "passes over its slices, and idle torch threads spin, so "
                               "beside same-host workers more threads slow it down.")
    event_log: str | None = option(None, kind="file", metavar="FILE", per_process=True,
                                   help="Append JSONL events to FILE.")
    trace: str | None = option(None, kind="file", metavar="FILE", per_process=True,
                               flag="trace-file", dest="trace_file",
                               help="Record this shard's arrivals, decisions and answered "
                                    "pulls in FILE (a trace: docs/research.md).")
    curve_secret_key: str | None = option(
        None, kind="file", metavar="FILE",
        help="Require CURVE encryption: the servers' secret key file "
             "(`paramserver keys generate`).")
    #: a directory of client public keys (*.key) or an allow-list file (keys, their
    #: ranks and roles; curve.parse_allow_list); with it, only those clients get in
    curve_clients_dir: str | None = option(
        None, kind="path", metavar="DIR|FILE",
        help="CURVE: admit only these clients: a directory of public .key files, or an "
             "allow-list file (lines KEY [rank=R,...] [role=admin]; docs/reliability.md).")
    #: CURVE public keys (key files or Z85 text) allowed SHUTDOWN, CHECKPOINT and
    #: BYE dead=true, admitted even when not in curve_clients_dir
    admin_keys: list[str] = option(
        default_factory=list, flag="admin-key", kind="file", metavar="FILE",
        help="CURVE: a public key file allowed SHUTDOWN, CHECKPOINT and reporting a worker "
             "dead (repeatable; `paramserver keys generate --admin`). `launch` also makes "
             "its own.")
    plan: dict[str, Any] | None = option(None, internal="sent by the first worker",
                                         help="The shard plan (None: adopt the first "
                                              "worker's).")
    checkpoint_dir: str | None = option(None, kind="dir", metavar="DIR",
                                        help="Directory for this run's shard checkpoints.")
    checkpoint_every: int = option(0, min=0, metavar="N",
                                   help="Checkpoint every N versions (0: off).")
    checkpoint_seconds: float = option(0.0, min=0, metavar="SECONDS",
                                       help="Checkpoint every so many seconds (0: off).")
    checkpoint_keep: int = option(2, min=1, metavar="K", help="Keep the newest K checkpoints.")
    resume: str | None = option(None, kind="dir", metavar="DIR",
                                help="Restore the shard(s) from the checkpoint directory DIR "
                                     "first.")
    #: a --checkpoint-dir holding an earlier run is refused unless resumed or this
    fresh: bool = option(False, negatable=False,
                         help="Start afresh even if --checkpoint-dir holds an earlier run's "
                              "checkpoints of this shard: they are moved aside to "
                              "shardN.before-TIME, not deleted.")
    metrics_port: int | None = option(None, min=0, max=65535, metavar="PORT", per_process=True,
                                      help="Serve Prometheus metrics on PORT (0: any free "
                                           "port, printed at start).")
    metrics_interval: float = option(10.0, min=0, min_open=True, metavar="SECONDS",
                                     help="Seconds between metric snapshots in the event log "
                                          "and TensorBoard.")
    tensorboard: str | None = option(None, kind="dir", metavar="DIR",
                                     help="Write TensorBoard scalars under DIR (needs "
                                          "paramserver[tensorboard]).")
    on_divergence: str = option("warn", choices=ACTIONS,
                                help="What a divergence-watchdog alarm does: warn; stop "
                                     "training; or save a checkpoint under "
                                     "CHECKPOINT_DIR/diverged first (docs/observability.md).")
    watchdog: dict[str, Any] = option(
        default_factory=dict, flag="watchdog-arg", dest="watchdog_args", kind="pairs",
        parse=parse_watchdog_args,
        help="Watchdog threshold, e.g. ratio_high=0.5, disable=worker_lag or enabled=false "
             "(repeatable; docs/observability.md lists them).")
    observe: str = option(DEFAULT_OBSERVE, metavar="every|budget:F",
                          help="How much of a shard's time measuring pushes (norms, cosines, "
                               "update ratios) may take: every (every push measured) or "
                               "budget:F, a share F of its wall time, past which each "
                               "worker's pushes are sampled; every alarm still fires within "
                               "its stated delay (docs/observability.md).")
    #: a plan from a peer declaring more bytes (all shards) is refused before anything
    #: is allocated from it
    max_model_bytes: int = option(PlanLimits.max_model_bytes, min=1, metavar="BYTES",
                                  help="Refuse a worker's shard plan that would cost the shards "
                                       "more bytes than this in all (weights, optimizer state, "
                                       "sparse rows with their ids and versions), before "
                                       "anything is allocated for it.")
    #: pinned: a HELLO bringing another plan is refused, even on a fresh shard
    plan_hash: str | None = option(None, metavar="HASH",
                                   help="Accept only the shard plan with this hash (a worker's "
                                        "`worker_start` event gives it): without it a fresh "
                                        "shard adopts the first valid plan a HELLO brings.")
    #: worker table size (None: max(64, 4 * expected_workers)); see ShardCore._evict
    max_workers: int | None = option(None, min=1, max=65536, metavar="N",
                                     help="Worker ids a shard keeps track of; a new one past N "
                                          "evicts one that only said HELLO, or died long "
                                          "ago, else is refused [default: max(64, 4 x "
                                          "--expected-workers)].")
    replicas: int = option(0, min=0, metavar="R",
                           help="Backup processes per shard, each applying every input its "
                                "primary accepts before the worker is answered; one takes over "
                                "when the primary stops answering (docs/reliability.md). "
                                "R <= 4. `server`: start each replica with --replica "
                                "(and --replica-peers), the backups first.")
    failover_timeout: float = option(1.0, min=0, min_open=True, metavar="SECONDS",
                                     help="With --replicas: a backup takes over after its "
                                          "primary was silent this long.")
    #: the run's replication key (paramserver/wire/replauth.py): what replicas seal their
    #: messages with; launch and run make one, by hand `paramserver keys replication`
    replication_key: str | None = option(
        None, kind="file", metavar="FILE",
        help="With --replicas: the file holding the run's replication key, the same for "
             "every replica (`paramserver keys replication FILE` makes one, readable by "
             "you only): a replica takes replication messages only from holders of it. "
             "Needed by hand unless --curve-secret-key (then derived from it); launch and "
             "run make one per run.")
    #: this process's index among its shard's replicas (0 starts as the primary); launch
    #: and run set it per replica
    replica: int = option(0, min=0, per_process=True, metavar="K",
                          help="With --replicas: this process's index among its shard's "
                               "replicas, 0 .. R. Replica 0 starts as the primary; the others "
                               "start as backups and wait for it.")
    #: replica 0: its backups, by address; another replica: the live replicas, whose
    #: primary it joins (a replacement for a dead replica)
    replica_peers: list[str] = option(
        default_factory=list, per_process=True, kind="address", metavar="HOST:PORT[,...]",
        help="With --replicas: replica 0 is given its backups' addresses (they must be "
             "listening); a replica started in place of a dead one is given the live "
             "replicas' addresses, and joins as a backup of their primary.")
    #: the run this shard belongs to (launch makes one per run): a worker whose HELLO
    #: names another run is refused (``wrong_run``), so a port reused by another job
    #: never mixes two runs. None: a worker of any run, or of none, is taken
    run_id: str | None = option(None, per_process=True, metavar="ID",
                                help="This shard's run: refuse a worker of another run "
                                     "(launch gives every process of a run one id; a "
                                     "worker without one is taken).")
    #: a process started in place of a dead replica: the checkpoint directory holds
    #: the running run, which its replicas write (it is not claimed as an earlier run's)
    replacement: bool = option(False, per_process=True,
                               internal="set by launch on a replica it starts again",
                               help="This process replaces a dead replica of its shard.")

    #: a shard started again alone while its run goes on: its workers are running, so
    #: it resumes its own latest checkpoint and awaits no one (a whole run's --resume
    #: takes the round every shard holds and waits for every worker to come back)
    restart: bool = option(False, per_process=True,
                           internal="set by launch on a shard it starts again",
                           help="This shard restarts alone; its run goes on.")

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ConfigError(f"num_shards must be >= 1, got {self.num_shards}")
        if not 0 <= self.shard < self.num_shards:
            raise ConfigError(f"shard must be in [0, {self.num_shards}), got {self.shard}")
        self.mode_spec()  # validates mode, bound, backups
        self.core_config()
        if self.checkpoint_every < 0 or self.checkpoint_seconds < 0:
            raise ConfigError("checkpoint_every and checkpoint_seconds must be >= 0")
        if (self.checkpoint_every or self.checkpoint_seconds) and not self.checkpoint_dir:
            raise ConfigError("periodic checkpoints need a checkpoint directory")
        if self.fresh and self.resume and self.checkpoint_dir and \
                os.path.realpath(self.resume) == os.path.realpath(self.checkpoint_dir):
            raise ConfigError("--fresh moves aside the run --resume would resume: give one")
        if self.curve_clients_dir and not self.curve_secret_key:
            raise ConfigError("curve_clients_dir needs curve_secret_key (the server's key pair)")
        if self.admin_keys and not self.curve_secret_key:
            raise ConfigError("admin_keys need curve_secret_key: without CURVE a server cannot "
                              "tell keys apart, and everyone who reaches it is trusted")
        if self.on_divergence not in ACTIONS:
            raise ConfigError(f"on_divergence must be one of {', '.join(ACTIONS)}; "
                              f"got {self.on_divergence!r}")
        if self.on_divergence == "checkpoint-and-stop" and not self.checkpoint_dir:
            raise ConfigError("--on-divergence checkpoint-and-stop needs a checkpoint directory")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be in 0..65535 (0: any free port), "
                              f"got {self.metrics_port}")
        self.plan_limits()
        if self.plan_hash is not None and not (
                len(self.plan_hash) == 64 and set(self.plan_hash) <= set("0123456789abcdef")):
            raise ConfigError(f"plan_hash must be a shard plan's sha256 (64 lowercase hex "
                              f"digits), got {self.plan_hash!r}")
        check_bounds(self)  # the rest of the bounds the fields declare
        if self.pull_compression is not None:  # (loads torch: only when one is given)
            pull_compression(self.pull_compression)
        self._check_replicas()
        features.check(self.features())  # the pairs of features that do not work together
        self.watchdog_config()

    def _check_replicas(self) -> None:
        """--replicas works for what paramserver/server/replication.py was built and
        tested for; anything else is refused in one line naming what works. (The
        built-in policies it refuses are in the feature table: features.check.)"""
        from paramserver.core.replica import MAX_REPLICAS, unreplicable

        if not self.replicas:
            if self.replica or self.replica_peers:
                raise ConfigError("--replica and --replica-peers need --replicas R (the "
                                  "backups each shard has)")
            return
        if self.replica > self.replicas:
            raise ConfigError(f"--replica {self.replica}: a shard with --replicas "
                              f"{self.replicas} has replicas 0 .. {self.replicas}")
        if len(self.replica_peers) > self.replicas:
            raise ConfigError(f"--replica-peers: {len(self.replica_peers)} addresses, but a "
                              f"shard with --replicas {self.replicas} has {self.replicas} "
                              f"other replica(s)")
        if self.replicas > MAX_REPLICAS:
            raise ConfigError(f"--replicas {self.replicas}: at most {MAX_REPLICAS} backups "
                              f"per shard (each one more is one more copy of every input "
                              f"and one more wait before a worker is answered)")
        if self.policy not in ("none", *BUILTIN_POLICIES):  # a plug-in policy: asked by
            from paramserver.policies import resolve_policy  # its hooks (loads torch)

            why = unreplicable(resolve_policy(self.policy))
            if why:
                raise ConfigError(f"--replicas does not work with --policy {self.policy}: "
                                  f"{why}; policies that decide from each push alone "
                                  f"(reject, inverse, exponential) do")

    def features(self) -> set[str]:
        """The features of paramserver/core/features.py this shard's options turn on."""
        return features.active(replicas=self.replicas, curve=bool(self.curve_secret_key),
                               resume=bool(self.resume), optimizer=self.optimizer,
                               policy=self.policy, backup_workers=self.backup_workers,
                               trace=bool(self.trace), pull_compression=self.pull_compression)

    def watchdog_config(self) -> WatchdogConfig:
        """The watchdog's thresholds, with ``observe`` as its ``observe_budget``; the older
        spelling ``--watchdog-arg observe_budget=F`` still works (0: every)."""
        budget = parse_observe(self.observe)
        if "observe_budget" in self.watchdog:
            given = self.watchdog["observe_budget"]
            if self.observe != DEFAULT_OBSERVE and given != budget:
                raise ConfigError(f"--observe {self.observe} and --watchdog-arg "
                                  f"observe_budget={given} disagree: give one")
            return WatchdogConfig.from_dict(self.watchdog)
        return WatchdogConfig.from_dict({**self.watchdog, "observe_budget": budget})

    def plan_limits(self) -> PlanLimits:
        dense, sparse = estimate_copies(self.optimizer, self.optimizer_args,
                                        sync=self.mode == "sync")
        return PlanLimits(max_model_bytes=self.max_model_bytes, dense_copies=dense,
                          sparse_copies=sparse)

    def mode_spec(self) -> ModeSpec:
        return ModeSpec(Mode(self.mode), self.staleness_bound, self.backup_workers)

    def core_config(self) -> CoreConfig:
        """The pure core's configuration: each of its fields is the option of the same
        name (a copy of a table), but for ``mode``, made of three options
        (:data:`CORE_DERIVED`), and the core's own settings (:data:`CORE_ONLY`)."""
        values: dict[str, Any] = {
            f.name: _copied(getattr(self, f.name)) for f in dataclasses.fields(CoreConfig)
            if f.name not in CORE_DERIVED and f.name not in CORE_ONLY}
        return CoreConfig(mode=self.mode_spec(), **values)

    def new_core(self, plan: ShardPlan, policy: StalenessPolicy | None = None) -> ShardCore:
        """This shard's core for ``plan``: its slices, :meth:`core_config` and its
        staleness policy (``policy``, else a new one of ``--policy``). The one way a
        core is made, by a shard server and by the virtual-time simulator alike."""
        from paramserver.core.shard import ShardCore, SliceSpec  # (torch: not for --help)
        from paramserver.policies.registry import create_policy

        slices = [SliceSpec(s.key, s.numel, s.dtype) for s in plan.shard_slices(self.shard)]
        if policy is None:
            policy = create_policy(self.policy, self.policy_args)
        core = ShardCore(slices, self.core_config(), policy)
        compression = pull_compression(self.pull_compression)
        if compression is not None:
            from paramserver.core.pullsqueeze import PullSqueeze

            core.squeeze = PullSqueeze(compression, core.specs, self.shard)
        return core


def pull_compression(spec: str | None) -> Compression | None:
    """``--pull-compression``'s compressor (None: dense pulls); one line for a name,
    parameter or value the registry refuses, or for ``ef=0`` (a compressed pull keeps
    what it leaves out by construction)."""
    if spec is None or spec.strip() == "none":
        return None
    from paramserver.compress import parse_compression  # (torch: only when one is given)

    compression = parse_compression(spec)
    if not compression.ef and type(compression.compressor).biased:
        raise ConfigError(f"pull_compression {spec!r}: ef=0 has no meaning for a pull (the "
                          "shard keeps what each pull leaves out, by construction)")
    return compression


#: CoreConfig's fields made of other options: field -> the options it is made of
CORE_DERIVED: dict[str, tuple[str, ...]] = {
    "mode": ("mode", "staleness_bound", "backup_workers"),
}
#: CoreConfig's fields that are no option: the core's own settings, at their defaults
CORE_ONLY = frozenset({"push_id_window"})


def _copied(value: Any) -> Any:
    """An option's value as the core keeps it: tables copied, so that the core's
    configuration never shares one with the record it came from."""
    return dict(value) if isinstance(value, Mapping) else value
