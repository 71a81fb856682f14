"""Shared option groups, configuration precedence and value parsing for the CLI.

Every option of ``server``, ``worker``, ``launch`` and ``run`` can be given

1. in a TOML file (``--config run.toml``, or ``PARAMSERVER_CONFIG``),
2. in an environment variable ``PARAMSERVER_<OPTION>`` (``--staleness-bound``
   -> ``PARAMSERVER_STALENESS_BOUND``; repeated options take a
   whitespace-separated list), or
3. as a flag,

in rising precedence. That is click's own order (command line > environment >
``default_map`` > default): the TOML file is loaded into the context's
``default_map`` by the eager ``--config`` callback, so click does the merging
and ``ctx.get_parameter_source`` tells where each value came from (which
``--print-config`` shows).

A TOML key is the long flag without dashes in front (``staleness-bound = 2``;
``staleness_bound`` works too); repeated flags take a list, ``*-arg`` flags a
table (``optimizer-arg = { momentum = 0.9 }``). Keys at the top level apply to
every command that has that option; tables ``[server]``, ``[worker]``,
``[launch]`` and ``[run]`` apply to the commands that take those options
(``launch`` and ``run`` read ``[server]`` and ``[worker]`` too) and win over
the top level. Because one file serves several commands, the groups of all
four commands are declared here, so that an unknown key is refused with the
keys that exist, whichever command reads the file.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import json
import math
import re
import socket
import tomllib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from paramserver.core import MODES
from paramserver.errors import ConfigError
from paramserver.optim import build_optimizer, build_scheduler, parse_kwargs
from paramserver.server import ServerConfig
from paramserver.staleness import create_policy, parse_policy_args
from paramserver.watchdog import ACTIONS, WatchdogConfig
from paramserver.workers.launch.cluster import FAILURE_POLICIES, ClusterSpec
from paramserver.workers.stragglers import StragglerSpec
from paramserver.workers.tasks import resolve_task
from paramserver.workers.worker import WorkerConfig

__all__ = [
    "COMMAND_GROUPS",
    "ENV_PREFIX",
    "AddressList",
    "KeyValue",
    "apply_groups",
    "bind_address",
    "envvar",
    "flatten_addresses",
    "maybe_print_config",
    "option_names",
    "render_config",
    "server_config",
    "straggler_overrides",
    "user_errors",
    "worker_config",
]

ENV_PREFIX = "PARAMSERVER_"

F = TypeVar("F", bound=Callable[..., Any])


def envvar(flag: str) -> str:
    """``--staleness-bound`` -> ``PARAMSERVER_STALENESS_BOUND``."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def _default(cls: type, name: str) -> Any:
    """A dataclass field's default, so the CLI never restates the library's defaults."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    raise KeyError(name)


# --------------------------------------------------------------------------- value types


class KeyValue(click.ParamType):
    """``KEY=VALUE`` -> ``(key, value)``, the value typed by the library's parser.

    With ``table`` a config file may give a TOML table instead; its pairs pass
    through with their TOML types. Without, it gives a list of strings.
    """

    name = "KEY=VALUE"

    def __init__(self, parse: Callable[[list[str]], Mapping[str, Any]],
                 table: bool = True) -> None:
        self.parse = parse
        self.table = table

    def render(self, pairs: Iterable[tuple[str, Any]]) -> Any:
        """The TOML form of the option's value (what --print-config shows)."""
        if self.table:
            return dict(pairs)
        return [f"{k}={v}" for k, v in pairs]

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if isinstance(value, tuple) and len(value) == 2:
            return value
        if not isinstance(value, str):
            self.fail(f"{value!r} is not KEY=VALUE", param, ctx)
        try:
            parsed = self.parse([value])
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)
        if len(parsed) != 1:
            self.fail(f"{value!r} is not KEY=VALUE", param, ctx)
        return next(iter(parsed.items()))


def _parse_task_args(items: list[str]) -> dict[str, str]:
    """``key=value`` -> {key: "value"}; the task converts by its factory's annotations."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ConfigError(f"task argument {item!r} must look like key=value (e.g. hidden=128)")
        out[key.strip()] = value.strip()
    return out


def _parse_watchdog_args(items: list[str]) -> dict[str, Any]:
    """``key=value`` -> typed watchdog options, checked against WatchdogConfig."""
    values = parse_kwargs(items)
    if "disable" in values and isinstance(values["disable"], tuple):  # "a,b" -> "a,b"
        values["disable"] = ",".join(str(v) for v in values["disable"])
    WatchdogConfig.from_dict(values)
    return values


_ADDRESS = re.compile(r"^(?:tcp://)?(\[[0-9a-fA-F:]+\]|[^\s:/\[\]]+):(\d{1,5})$")


class Address(click.ParamType):
    """``HOST:PORT`` or ``tcp://HOST:PORT`` -> ``tcp://HOST:PORT``."""

    name = "HOST:PORT"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        text = str(value).strip()
        m = _ADDRESS.match(text)
        if m is None or not 1 <= int(m.group(2)) <= 65535:
            self.fail(f"{text!r} is not an address like HOST:PORT or tcp://HOST:PORT, e.g. "
                      "tcp://127.0.0.1:5600; ports are 1..65535", param, ctx)
        return f"tcp://{m.group(1)}:{int(m.group(2))}"


class AddressList(Address):
    """One or more comma-separated addresses -> a tuple of ``tcp://HOST:PORT``."""

    name = "HOST:PORT[,...]"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if isinstance(value, tuple):
            return value
        parts = [p for p in str(value).replace(",", " ").split() if p]
        if not parts:
            self.fail("give at least one server address", param, ctx)
        return tuple(super(AddressList, self).convert(p, param, ctx) for p in parts)


def flatten_addresses(value: Iterable[tuple[str, ...]]) -> list[str]:
    return [addr for group in value for addr in group]


# --------------------------------------------------------------------------- option groups


class _Option(click.Option):
    """Names its environment variable in an error only when the bad value came from it."""

    def get_error_hint(self, ctx: click.Context | None) -> str:
        if ctx is not None and self.name is not None \
                and ctx.get_parameter_source(self.name) is ParameterSource.ENVIRONMENT:
            return super().get_error_hint(ctx)
        return click.Parameter.get_error_hint(self, ctx)


class Spec:
    """One option: click.option's arguments, with the environment variable filled in."""

    def __init__(self, *decls: str, **kwargs: Any) -> None:
        self.flag = next(d for d in decls if d.startswith("--")).split("/")[0]
        kwargs.setdefault("cls", _Option)
        kwargs.setdefault("envvar", envvar(self.flag))
        kwargs.setdefault("show_envvar", True)
        kwargs.setdefault("show_default", True)
        self.decls, self.kwargs = decls, kwargs
        self.name = _Option(list(decls), **{k: v for k, v in kwargs.items() if k != "cls"}).name \
            or ""

    @property
    def key(self) -> str:
        """The TOML key: the long flag without its dashes."""
        return self.flag[2:]

    def decorator(self) -> Callable[[F], F]:
        return click.option(*self.decls, **self.kwargs)


_S, _W = ServerConfig, WorkerConfig
_POS = click.IntRange(min=0)

#: options that set how shards train: for ``server``, ``launch`` and ``run``
SERVER = [
    Spec("--mode", type=click.Choice(MODES), default=_default(_S, "mode"),
         help="Consistency model. sync: one step per round, averaging every live worker's "
              "gradient; async: every push is applied on arrival; ssp: async, but no worker "
              "runs more than --staleness-bound clocks ahead of the slowest."),
    Spec("--staleness-bound", type=_POS, default=_default(_S, "staleness_bound"),
         metavar="S", help="ssp: how many clocks the fastest worker may lead the slowest."),
    Spec("--backup-workers", type=_POS, default=_default(_S, "backup_workers"), metavar="B",
         help="sync: close each round without the slowest B gradients (dropped, counted)."),
    Spec("--policy", default=_default(_S, "policy"), metavar="NAME|module:Class",
         help="Staleness policy: whether a late update is applied, down-weighted or rejected. "
              "See `paramserver policies`."),
    Spec("--policy-arg", "policy_args", type=KeyValue(parse_policy_args), multiple=True,
         help="Policy parameter, e.g. max_staleness=4 (repeatable)."),
    Spec("--optimizer", default=_default(_S, "optimizer"), metavar="NAME|module:Class",
         help="torch.optim optimizer each shard runs: sgd, adam, adamw, ... or module:Class."),
    Spec("--lr", type=click.FloatRange(min=0), metavar="LR",
         default=_default(_S, "optimizer_args")["lr"],
         help="Learning rate (an lr in --optimizer-arg wins)."),
    Spec("--optimizer-arg", "optimizer_args", type=KeyValue(parse_kwargs), multiple=True,
         help="Optimizer keyword argument, e.g. momentum=0.9 or betas=0.9,0.999 (repeatable)."),
    Spec("--scheduler", default=None, metavar="NAME|module:Class",
         help="torch.optim.lr_scheduler stepped after every optimizer step: step, cosine, "
              "linear, ... (default: none)."),
    Spec("--scheduler-arg", "scheduler_args", type=KeyValue(parse_kwargs), multiple=True,
         help="Scheduler keyword argument, e.g. step_size=100 (repeatable)."),
    Spec("--heartbeat-timeout", type=click.FloatRange(min=0, min_open=True),
         default=_default(_S, "heartbeat_timeout"), metavar="SECONDS",
         help="A worker silent this long leaves the live set: no sync round or SSP bound "
              "waits for it."),
    Spec("--check-finite/--no-check-finite", default=_default(_S, "check_finite"),
         help="Reject gradients that contain NaN or Inf."),
    Spec("--checkpoint-dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
         help="Directory for this run's shard checkpoints."),
    Spec("--checkpoint-every", type=_POS, default=_default(_S, "checkpoint_every"),
         metavar="N", help="Checkpoint every N versions (0: off)."),
    Spec("--checkpoint-seconds", type=click.FloatRange(min=0),
         default=_default(_S, "checkpoint_seconds"), metavar="SECONDS",
         help="Checkpoint every so many seconds (0: off)."),
    Spec("--checkpoint-keep", type=click.IntRange(min=1),
         default=_default(_S, "checkpoint_keep"), metavar="K",
         help="Keep the newest K checkpoints."),
    Spec("--resume", type=click.Path(file_okay=False), default=None, metavar="DIR",
         help="Restore the shard(s) from the checkpoint directory DIR first."),
    Spec("--curve-secret-key", type=click.Path(dir_okay=False), default=None, metavar="FILE",
         help="Require CURVE encryption: the servers' secret key file "
              "(`paramserver keys generate`)."),
    Spec("--curve-clients-dir", type=click.Path(), default=None, metavar="DIR|FILE",
         help="CURVE: admit only these clients: a directory of public .key files, or an "
              "allow-list file (lines KEY [rank=R,...] [role=admin]; docs/reliability.md)."),
    Spec("--admin-key", "admin_keys", type=click.Path(dir_okay=False), multiple=True,
         metavar="FILE",
         help="CURVE: a public key file allowed SHUTDOWN, CHECKPOINT and reporting a worker "
              "dead (repeatable; `paramserver keys generate --admin`). `launch` also makes "
              "its own."),
    Spec("--max-model-bytes", type=click.IntRange(min=1),
         default=_default(_S, "max_model_bytes"), metavar="BYTES",
         help="Refuse a worker's shard plan declaring more bytes than this (whole model), "
              "before anything is allocated for it."),
    Spec("--max-workers", type=click.IntRange(min=1, max=65536), default=None, metavar="N",
         help="Worker ids a shard keeps track of; a new one past N evicts one that never "
              "pulled or pushed, or died long ago, else is refused "
              "[default: max(64, 4 x --expected-workers)]."),
    Spec("--on-divergence", type=click.Choice(ACTIONS), default=_default(_S, "on_divergence"),
         help="What a divergence-watchdog alarm does: warn; stop training; or save a "
              "checkpoint under CHECKPOINT_DIR/diverged first (docs/observability.md)."),
    Spec("--watchdog-arg", "watchdog_args", type=KeyValue(_parse_watchdog_args), multiple=True,
         help="Watchdog threshold, e.g. ratio_high=0.5, disable=worker_lag or enabled=false "
              "(repeatable; docs/observability.md lists them)."),
    Spec("--metrics-interval", type=click.FloatRange(min=0, min_open=True),
         default=_default(_S, "metrics_interval"), metavar="SECONDS",
         help="Seconds between metric snapshots in the event log and TensorBoard."),
    Spec("--tensorboard", type=click.Path(file_okay=False), default=None, metavar="DIR",
         help="Write TensorBoard scalars under DIR (needs paramserver[tensorboard])."),
]

#: options of one shard process: ``server`` only (``launch`` and ``run`` set them per process)
SHARD = [
    Spec("--shard", type=_POS, default=_default(_S, "shard"),
         help="This server's shard id, 0 .. num-shards - 1."),
    Spec("--num-shards", type=click.IntRange(min=1), default=_default(_S, "num_shards"),
         metavar="S", help="How many shards hold the model (servers and workers must agree)."),
    Spec("--host", default="127.0.0.1",
         help="Address to listen on. Give 0.0.0.0 (every interface) or this host's address "
              "to accept workers from other hosts."),
    Spec("--port", type=click.IntRange(0, 65535), default=0,
         help="Port to listen on; 0 picks a free one. The address is printed at start."),
    Spec("--expected-workers", type=click.IntRange(min=1),
         default=_default(_S, "expected_workers"), metavar="N",
         help="Training starts once N workers have said hello."),
    Spec("--event-log", type=click.Path(dir_okay=False), default=None, metavar="FILE",
         help="Append JSONL events to FILE."),
    Spec("--metrics-port", type=click.IntRange(0, 65535), default=None, metavar="PORT",
         help="Serve Prometheus metrics on PORT (0: any free port, printed at start)."),
]

#: options that set how workers train: for ``worker``, ``launch`` and ``run``
WORKER = [
    Spec("--task", default=_default(_W, "task"), metavar="NAME|module:function",
         help="What to train: a registered task (see `paramserver tasks`) or your factory."),
    Spec("--task-arg", "task_args", type=KeyValue(_parse_task_args), multiple=True,
         help="Task parameter, e.g. hidden=128 (repeatable)."),
    Spec("--device", default=_default(_W, "device"), metavar="auto|cpu|cuda[:N]",
         help="Where the model replica computes; auto takes CUDA when present."),
    Spec("--steps", type=click.IntRange(min=1), default=_default(_W, "steps"), metavar="N",
         help="Updates (pushes) per worker."),
    Spec("--epochs", type=click.FloatRange(min=0, min_open=True), default=None, metavar="E",
         help="Train for E passes over the worker's data instead of --steps."),
    Spec("--batch-size", type=click.IntRange(min=1), default=None, metavar="N",
         help="Mini-batch size (default: the task's)."),
    Spec("--seed", type=_POS, default=_default(_W, "seed"), metavar="N",
         help="Seed of the task's data order and of the straggler draws."),
    Spec("--push-every", type=click.IntRange(min=1), default=_default(_W, "push_every"),
         metavar="K", help="Accumulate K mini-batches per push."),
    Spec("--eval-every", type=_POS, default=_default(_W, "eval_every"), metavar="N",
         help="Worker 0 evaluates held-out data every N clocks (0: at the end only)."),
    Spec("--slowdown", type=click.FloatRange(min=1), default=_default(StragglerSpec, "slowdown"),
         metavar="F", help="Stragglers: every step takes F times its compute time."),
    Spec("--slow-prob", type=click.FloatRange(0, 1), default=_default(StragglerSpec, "slow_prob"),
         metavar="P", help="Stragglers: a step is transiently slow with probability P..."),
    Spec("--slow-factor", type=click.FloatRange(min=1),
         default=_default(StragglerSpec, "slow_factor"), metavar="F",
         help="...by the factor F."),
    Spec("--delay", default=_default(StragglerSpec, "delay"), metavar="KIND:ARGS",
         help="Stragglers: random extra seconds per step: const:S, uniform:LOW,HIGH, exp:MEAN, "
              "lognormal:MU,SIGMA or pareto:ALPHA,SCALE."),
    Spec("--min-step-time", type=click.FloatRange(min=0),
         default=_default(StragglerSpec, "min_step_time"), metavar="SECONDS",
         help="Stragglers: floor on a step's compute time (emulates a heavier model)."),
    Spec("--timeout", type=click.FloatRange(min=0, min_open=True),
         default=_default(_W, "timeout"), metavar="SECONDS",
         help="How long to wait for a server, first contact included (servers may start "
              "after workers), before giving up with the address waited for."),
    Spec("--request-timeout", type=click.FloatRange(min=0, min_open=True),
         default=_default(_W, "request_timeout"), metavar="SECONDS",
         help="A request unanswered this long is sent again (until --timeout)."),
    Spec("--heartbeat-interval", type=click.FloatRange(min=0),
         default=_default(_W, "heartbeat_interval"), metavar="SECONDS",
         help="Seconds between heartbeats to every shard (0: none)."),
    Spec("--chunk-bytes", type=click.IntRange(min=1), default=_default(_W, "chunk_bytes"),
         metavar="BYTES", help="Tensors larger than this are split across shards."),
    Spec("--part-bytes", type=click.IntRange(min=0), default=_default(_W, "part_bytes"),
         metavar="BYTES", help="A shard's share of a push larger than this is sent in parts "
         "of about this size (whole chunks), which a sync shard adds up as they arrive, "
         "so its memory does not grow with the number of workers (0: always whole)."),
    Spec("--drop-rate", type=click.FloatRange(0, 1, max_open=True),
         default=_default(_W, "drop_rate"), metavar="P",
         help="Chaos testing: lose this fraction of requests and replies."),
    Spec("--curve-key", type=click.Path(dir_okay=False), default=None, metavar="FILE",
         help="CURVE: this worker's secret key file."),
    Spec("--curve-server-key", type=click.Path(dir_okay=False), default=None, metavar="FILE",
         help="CURVE: the servers' public key file."),
]

_STRAGGLER_KEYS = ("slowdown", "slow_prob", "slow_factor", "delay", "min_step_time")

#: options of one worker process: ``worker`` only
WORKER_PROCESS = [
    Spec("--servers", type=AddressList(), multiple=True, required=True,
         help="Every shard's address, in shard order: comma-separated or repeated."),
    Spec("--rank", type=_POS, default=_default(_W, "rank"),
         help="This worker's rank, 0 .. world-size - 1 (selects its part of the data)."),
    Spec("--world-size", type=click.IntRange(min=1), default=_default(_W, "world_size"),
         metavar="N", help="How many workers share the data."),
    Spec("--event-log", type=click.Path(dir_okay=False), default=None, metavar="FILE",
         help="Append JSONL events (one per step) to FILE."),
    Spec("--result-file", type=click.Path(dir_okay=False), default=None, metavar="FILE",
         help="Write this worker's result (counts, loss, timings) as JSON to FILE."),
]


def _straggler_item(items: list[str]) -> dict[str, Any]:
    """``RANK:KEY=VALUE`` -> {(rank, key): value}."""
    (item,) = items
    rank, sep, rest = item.partition(":")
    key, sep2, value = rest.partition("=")
    key = key.strip().replace("-", "_")
    if not (sep and sep2 and rank.strip().isdigit()) or key not in _STRAGGLER_KEYS:
        raise ConfigError(
            f"straggler {item!r} must look like RANK:KEY=VALUE with KEY one of "
            f"{', '.join(_STRAGGLER_KEYS)}, e.g. 1:slowdown=3 or 2:delay=exp:0.05"
        )
    parsed: Any = value.strip() if key == "delay" else _number(value, item)
    return {f"{int(rank)}:{key}": parsed}


def _number(text: str, item: str) -> float:
    try:
        number = float(text)
    except ValueError as exc:
        raise ConfigError(f"straggler {item!r}: {text!r} is not a number") from exc
    if not math.isfinite(number):
        raise ConfigError(f"straggler {item!r}: {text!r} is not finite")
    return number


#: ``launch`` only
LAUNCH = [
    Spec("--num-servers", "--servers", "-s", type=click.IntRange(min=1),
         default=_default(ClusterSpec, "num_servers"),
         metavar="S", help="Server (shard) processes."),
    Spec("--num-workers", "--workers", "-n", type=click.IntRange(min=1),
         default=_default(ClusterSpec, "num_workers"), metavar="N", help="Worker processes."),
    Spec("--straggler", "stragglers", type=KeyValue(_straggler_item, table=False), multiple=True,
         metavar="RANK:KEY=VALUE",
         help="Slow down one worker only, e.g. 1:slowdown=3 or 2:delay=exp:0.05 (repeatable; "
              "keys as the straggler options)."),
    Spec("--out", type=click.Path(file_okay=False), default=None, metavar="DIR",
         help="Where logs, event logs and result.json go [default: runs/launch-<time>]."),
    Spec("--quiet", "-q", is_flag=True, default=False,
         help="No progress bar; print only the final summary."),
    Spec("--startup-timeout", type=click.FloatRange(min=0, min_open=True),
         default=_default(ClusterSpec, "startup_timeout"), metavar="SECONDS",
         help="How long a server may take to report its address."),
    Spec("--run-timeout", type=click.FloatRange(min=0, min_open=True), default=None,
         metavar="SECONDS", help="Stop everything if training takes longer."),
    Spec("--eval/--no-eval", default=_default(ClusterSpec, "evaluate"),
         help="Evaluate the final weights on held-out data."),
    Spec("--on-worker-failure", type=click.Choice(FAILURE_POLICIES),
         default=_default(ClusterSpec, "on_worker_failure"),
         help="A worker that dies: fail the run, tolerate it (the others go on) or restart it."),
    Spec("--restart-workers", is_flag=True, default=False,
         help="Restart a worker that dies (the same as --on-worker-failure restart)."),
    Spec("--restart-servers/--no-restart-servers",
         default=_default(ClusterSpec, "restart_servers"),
         help="Restart a shard that dies, at its address, from its latest checkpoint."),
    Spec("--max-restarts", type=_POS, default=_default(ClusterSpec, "max_restarts"), metavar="K",
         help="Restarts allowed per process."),
    Spec("--metrics-port", type=click.IntRange(0, 65535), default=None, metavar="PORT",
         help="Prometheus metrics: the launcher's on PORT, shard i's on PORT + 1 + i "
              "(0: any free ports)."),
]

#: ``run`` only (torchrun / Slurm)
RUN = [
    Spec("--num-servers", "-s", type=click.IntRange(min=1), default=1, metavar="S",
         help="The first S ranks are servers, the others workers."),
    Spec("--host", default=None,
         help="Address a server binds and publishes [default: 127.0.0.1 on one node, else "
              "this host's address on the route to the rendezvous host]."),
    Spec("--port", type=click.IntRange(0, 65535), default=0,
         help="Shard i listens on PORT + i (0: any free port)."),
    Spec("--launcher", type=click.Choice(["auto", "torchrun", "slurm"]), default="auto",
         help="Whose environment names the ranks (auto: torchrun's, else Slurm's)."),
    Spec("--store-host", default=None,
         help="Slurm: the rendezvous host [default: MASTER_ADDR, else the first node]."),
    Spec("--store-port", type=click.IntRange(1, 65535), default=None,
         help="Slurm: the rendezvous port [default: MASTER_PORT, else 29500 + job id % 1000]."),
    Spec("--metrics-port", type=click.IntRange(0, 65535), default=None, metavar="PORT",
         help="Shard i serves Prometheus metrics on PORT + i (0: any free port) "
              "[default: none]."),
    Spec("--rendezvous-timeout", type=click.FloatRange(min=0, min_open=True), default=300.0,
         metavar="SECONDS", help="How long to wait for the store and for every server."),
    Spec("--out", type=click.Path(file_okay=False), default=None, metavar="DIR",
         help="Write each rank's event log and result here (on its own host)."),
]

#: the option groups of every command that reads configuration files
COMMAND_GROUPS: dict[str, list[list[Spec]]] = {
    "server": [SHARD, SERVER],
    "worker": [WORKER_PROCESS, WORKER],
    "launch": [LAUNCH, SERVER, WORKER],
    "run": [RUN, SERVER, WORKER],
}
#: the TOML tables each command reads, after the top level, in rising precedence
SECTIONS: dict[str, tuple[str, ...]] = {
    "server": ("server",),
    "worker": ("worker",),
    "launch": ("server", "worker", "launch"),
    "run": ("server", "worker", "run"),
}


def _specs(command: str) -> dict[str, Spec]:
    return {s.name: s for group in COMMAND_GROUPS[command] for s in group}


def apply_groups(command: str) -> Callable[[F], F]:
    """Decorate a command function with its option groups, in declaration order."""

    def decorate(func: F) -> F:
        for spec in reversed(list(_specs(command).values())):
            func = spec.decorator()(func)
        return config_options(func)

    return decorate


# --------------------------------------------------------------------------- config files


def _config_key(key: str) -> str:
    return key.strip().lower().replace("-", "_")


def _aliases(command: str) -> dict[str, str]:
    """TOML key (flag or parameter name, ``-`` or ``_``) -> parameter name."""
    out = {}
    for spec in _specs(command).values():
        out[_config_key(spec.key)] = spec.name
        out[spec.name] = spec.name
    return out


def _toml_defaults(ctx: click.Context, command: str, data: Mapping[str, Any],
                   source: str) -> dict[str, Any]:
    """The file's values for ``command``, converted and checked, keyed by parameter name."""
    mine = _aliases(command)
    every = {k for cmd in COMMAND_GROUPS for k in _aliases(cmd)}
    merged: dict[str, tuple[str, Any]] = {}

    def take(table: Mapping[str, Any], where: str, allowed: set[str]) -> None:
        for raw, value in table.items():
            key = _config_key(raw)
            if key not in allowed:
                close = difflib.get_close_matches(key, sorted(allowed), n=3)
                hint = (f"; did you mean {', '.join(k.replace('_', '-') for k in close)}?"
                        if close else ".")
                raise click.BadParameter(
                    f"{source}: unknown key {raw!r} in {where}{hint} Keys are the long options "
                    f"of `paramserver {'/'.join(COMMAND_GROUPS)}` without the dashes.",
                    ctx=ctx, param_hint="--config",
                )
            if key in mine:
                merged[mine[key]] = (f"{where} {raw}" if where.startswith("[") else raw, value)

    take({k: v for k, v in data.items() if k not in COMMAND_GROUPS}, "the top level", every)
    for section in SECTIONS[command]:
        table = data.get(section, {})
        if not isinstance(table, Mapping):
            raise click.BadParameter(f"{source}: [{section}] must be a table", ctx=ctx,
                                     param_hint="--config")
        take(table, f"[{section}]", set(_aliases(section)))
    params = {p.name: p for p in ctx.command.params}
    out = {}
    for name, (where, value) in merged.items():
        param = params[name]
        if isinstance(value, Mapping) and isinstance(param.type, KeyValue) \
                and param.type.table:
            value = list(value.items())
        elif param.multiple and not isinstance(value, list | tuple):
            value = [value]
        elif not param.multiple and isinstance(value, list | tuple | Mapping):
            raise click.BadParameter(f"{source}: {where} takes one value, not {value!r}",
                                     ctx=ctx, param_hint="--config")
        try:
            out[name] = param.type_cast_value(ctx, value)
        except click.BadParameter as exc:
            raise click.BadParameter(f"{source}: {where} = {value!r}: {exc.message}", ctx=ctx,
                                     param_hint="--config") from exc
    return out


def _load_config(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if not value:
        return value
    path = Path(value)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise click.BadParameter(f"cannot read {path}: {exc.strerror}", ctx, param) from exc
    except tomllib.TOMLDecodeError as exc:
        raise click.BadParameter(f"{path} is not valid TOML: {exc}", ctx, param) from exc
    command = ctx.command.name or ""
    ctx.default_map = {**(ctx.default_map or {}),
                       **_toml_defaults(ctx, command, data, str(path))}
    return value


def config_options(func: F) -> F:
    func = click.option(
        "--print-config", is_flag=True, default=False,
        help="Print the resolved configuration as TOML (usable with --config) and exit.",
    )(func)
    return click.option(
        "--config", cls=_Option, type=click.Path(dir_okay=False), is_eager=True,
        expose_value=False,
        callback=_load_config, envvar=envvar("config"), show_envvar=True,
        help="TOML file of option values; environment variables PARAMSERVER_<OPTION> "
             "override it, flags override both.",
    )(func)


# --------------------------------------------------------------------------- --print-config


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{_toml_key(str(k))} = {_toml_value(v)}"
                                for k, v in value.items()) + " }" if value else "{}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


#: where a value came from, weakest first (ParameterSource is ordered only since click 8.3.3)
_PRECEDENCE = {
    ParameterSource.DEFAULT: 0,
    ParameterSource.DEFAULT_MAP: 1,
    ParameterSource.ENVIRONMENT: 2,
    ParameterSource.COMMANDLINE: 3,
}

def _precedence(ctx: click.Context, name: str) -> int:
    source = ctx.get_parameter_source(name)
    return 0 if source is None else _PRECEDENCE.get(source, 0)


_SOURCES = {
    ParameterSource.COMMANDLINE: "flag",
    ParameterSource.ENVIRONMENT: "env",
    ParameterSource.DEFAULT_MAP: "config file",
    ParameterSource.DEFAULT: "default",
}


def render_config(ctx: click.Context) -> str:
    """The command's resolved options as TOML, each with where its value came from."""
    lines = [f"# paramserver {ctx.command.name}: resolved configuration",
             "# precedence: flags > PARAMSERVER_<OPTION> > --config file > defaults"]
    for param in ctx.command.params:
        if not isinstance(param, click.Option) or param.name in ("print_config", "help") \
                or not param.expose_value or param.name is None:
            continue
        key = next(o for o in param.opts if o.startswith("--"))[2:]
        value = ctx.params.get(param.name)
        source = _SOURCES.get(ctx.get_parameter_source(param.name), "default")  # type: ignore[arg-type]
        if source == "env" and param.envvar:
            source = f"env {param.envvar}"
        if isinstance(param.type, KeyValue):
            value = param.type.render(value or ())
        elif isinstance(param.type, AddressList):
            value = flatten_addresses(value or ())
        elif param.multiple:
            value = list(value or ())
        if value is None:
            lines.append(f"# {key} = (not set)".ljust(40) + f"  # {source}")
        else:
            lines.append(f"{key} = {_toml_value(value)}".ljust(40) + f"  # {source}")
    return "\n".join(lines) + "\n"


def maybe_print_config(ctx: click.Context, opts: Mapping[str, Any]) -> None:
    """Handle ``--print-config``: print and exit."""
    if opts.get("print_config"):
        click.echo(render_config(ctx), nl=False)
        ctx.exit(0)


# --------------------------------------------------------------------------- building configs


@contextmanager
def user_errors(hint: str | None = None) -> Iterator[None]:
    """Turn the library's ConfigError into a click usage error (exit code 2)."""
    try:
        yield
    except ConfigError as exc:
        if hint:
            raise click.BadParameter(str(exc), param_hint=hint) from exc
        raise click.UsageError(str(exc)) from exc


def _steps_or_epochs(ctx: click.Context,
                     opts: Mapping[str, Any]) -> tuple[int | None, float | None]:
    """--epochs replaces --steps when it comes from a higher (or the only) source; both at
    the same level is an error. The loser is cleared in ctx.params for --print-config."""
    if opts["epochs"] is None:
        return opts["steps"], None
    steps_from = _precedence(ctx, "steps")
    epochs_from = _precedence(ctx, "epochs")
    if steps_from == epochs_from:
        raise click.UsageError("give --steps or --epochs, not both")
    if steps_from > epochs_from:
        ctx.params["epochs"] = None
        return opts["steps"], None
    ctx.params["steps"] = None
    return None, opts["epochs"]


def server_config(opts: Mapping[str, Any], **fixed: Any) -> ServerConfig:
    """A validated ServerConfig from the SERVER group (and SHARD where given), plus ``fixed``."""
    import torch

    values: dict[str, Any] = {
        "mode": opts["mode"],
        "staleness_bound": opts["staleness_bound"],
        "backup_workers": opts["backup_workers"],
        "policy": opts["policy"],
        "policy_args": dict(opts["policy_args"]),
        "optimizer": opts["optimizer"],
        "optimizer_args": {"lr": opts["lr"], **dict(opts["optimizer_args"])},
        "scheduler": opts["scheduler"],
        "scheduler_args": dict(opts["scheduler_args"]),
        "heartbeat_timeout": opts["heartbeat_timeout"],
        "check_finite": opts["check_finite"],
        "checkpoint_dir": opts["checkpoint_dir"],
        "checkpoint_every": opts["checkpoint_every"],
        "checkpoint_seconds": opts["checkpoint_seconds"],
        "checkpoint_keep": opts["checkpoint_keep"],
        "resume": opts["resume"],
        "curve_secret_key": opts["curve_secret_key"],
        "curve_clients_dir": opts["curve_clients_dir"],
        "admin_keys": list(opts["admin_keys"]),
        "on_divergence": opts["on_divergence"],
        "watchdog": dict(opts["watchdog_args"]),
        "metrics_interval": opts["metrics_interval"],
        "tensorboard": opts["tensorboard"],
        "max_model_bytes": opts["max_model_bytes"],
        "max_workers": opts["max_workers"],
    }
    for name in ("shard", "num_shards", "expected_workers", "event_log", "metrics_port"):
        if name in opts:
            values[name] = opts[name]
    if "host" in opts and "port" in opts and "bind" not in fixed:
        values["bind"] = bind_address(opts["host"], opts["port"])
    values.update(fixed)
    with user_errors("--policy / --policy-arg"):
        create_policy(values["policy"], values["policy_args"])
    with user_errors("--optimizer / --lr / --optimizer-arg"):
        optimizer = build_optimizer(values["optimizer"], [torch.zeros(1, requires_grad=True)],
                                    values["optimizer_args"])
    with user_errors("--scheduler / --scheduler-arg"):
        build_scheduler(values["scheduler"], optimizer, values["scheduler_args"])
    with user_errors():
        return ServerConfig(**values)


def bind_address(host: str, port: int) -> str:
    """``tcp://IP:PORT`` to bind: host names are resolved (zmq binds addresses only)."""
    host = host.strip().strip("[]")
    if host in ("*", "0.0.0.0", "::") or _is_ip(host):
        ip = host
    else:
        try:
            ip = socket.gethostbyname(host)
        except OSError as exc:
            raise click.BadParameter(f"cannot resolve {host!r}: {exc}", param_hint="--host") \
                from exc
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def straggler_spec(opts: Mapping[str, Any], **override: Any) -> StragglerSpec:
    values = {key: opts[key] for key in _STRAGGLER_KEYS}
    values.update(override)
    with user_errors("straggler options"):
        return StragglerSpec(**values)


def straggler_overrides(opts: Mapping[str, Any]) -> dict[int, StragglerSpec]:
    """``--straggler RANK:KEY=VALUE`` items -> per-rank specs on top of the common one."""
    per_rank: dict[int, dict[str, Any]] = {}
    for key, value in opts["stragglers"]:
        rank, _, name = key.partition(":")
        per_rank.setdefault(int(rank), {})[name] = value
    return {rank: straggler_spec(opts, **fields) for rank, fields in sorted(per_rank.items())}


def worker_config(ctx: click.Context, opts: Mapping[str, Any], **fixed: Any) -> WorkerConfig:
    """A validated WorkerConfig from the WORKER group (and WORKER_PROCESS where given)."""
    steps, epochs = _steps_or_epochs(ctx, opts)
    values: dict[str, Any] = {
        "task": opts["task"],
        "task_args": dict(opts["task_args"]),
        "device": opts["device"],
        "steps": steps,
        "epochs": epochs,
        "batch_size": opts["batch_size"],
        "seed": opts["seed"],
        "push_every": opts["push_every"],
        "eval_every": opts["eval_every"],
        "straggler": straggler_spec(opts),
        "chunk_bytes": opts["chunk_bytes"],
        "part_bytes": opts["part_bytes"],
        "timeout": opts["timeout"],
        "request_timeout": opts["request_timeout"],
        "heartbeat_interval": opts["heartbeat_interval"],
        "drop_rate": opts["drop_rate"],
        "curve_key": opts["curve_key"],
        "curve_server_key": opts["curve_server_key"],
    }
    if "servers" in opts:
        values["servers"] = flatten_addresses(opts["servers"])
    for name in ("rank", "world_size", "event_log", "result_file"):
        if name in opts:
            values[name] = opts[name]
    values.update(fixed)
    with user_errors("--task"):
        resolve_task(values["task"])
    with user_errors():
        return WorkerConfig(**values)


def option_names(command: str) -> Sequence[str]:
    """Every TOML key (long option without dashes) of a command."""
    return [spec.key for spec in _specs(command).values()]
