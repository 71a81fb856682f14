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
import errno
import ipaddress
import socket
import tomllib
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypedDict, TypeVar

import click
from click.core import ParameterSource

from paramserver.errors import ConfigError
from paramserver.server.config import Opt, ServerConfig, field_default, options_of
from paramserver.util.coerce import MISSING
from paramserver.workers.config import WorkerConfig
from paramserver.workers.launch.clusterspec import ClusterSpec
from paramserver.workers.stragglerspec import StragglerSpec

from .paramtypes import AddressList, KeyValue, ShardList, flatten_addresses
from .printconfig import maybe_print_config, render_config
from .workercount import file_worker_counts

__all__ = [
    "COMMAND_GROUPS",
    "ENV_PREFIX",
    "OVERWRITE",
    "SERVERS_COUNT",
    "AddressList",
    "KeyValue",
    "apply_groups",
    "bind_address",
    "check_port_free",
    "config_values",
    "deprecated_flag",
    "envvar",
    "field_specs",
    "flatten_addresses",
    "maybe_print_config",
    "option_names",
    "render_config",
    "server_config",
    "straggler_overrides",
    "take_deprecated",
    "user_errors",
    "worker_config",
]

ENV_PREFIX = "PARAMSERVER_"

F = TypeVar("F", bound=Callable[..., Any])


def envvar(flag: str) -> str:
    """``--staleness-bound`` -> ``PARAMSERVER_STALENESS_BOUND``."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def _field(cls: type, name: str) -> dataclasses.Field[Any]:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


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

    def __init__(self, *decls: str, field: tuple[type, str] | None = None,
                 **kwargs: Any) -> None:
        #: the config dataclass and field this option sets (None: the command's own)
        self.field = field
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


def _click_type(f: dataclasses.Field[Any], opt: Opt, hint: Any) -> Any:
    """The click type of a field: from its annotation, bounds, choices and kind."""
    if opt.kind == "pairs":
        assert opt.parse is not None, f"{f.name}: a 'pairs' option needs parse"
        return KeyValue(opt.parse, table=opt.table)
    if opt.kind == "address":
        return AddressList()
    if opt.kind == "shards":
        return ShardList()
    if opt.kind in _PATHS:
        file_okay, dir_okay = _PATHS[opt.kind]
        return click.Path(file_okay=file_okay, dir_okay=dir_okay)
    if opt.choices:
        return click.Choice(opt.choices)
    base = _scalar(hint)
    if base is int and (opt.min is not None or opt.max is not None):
        return click.IntRange(None if opt.min is None else int(opt.min),
                              None if opt.max is None else int(opt.max),
                              min_open=opt.min_open, max_open=opt.max_open)
    if base is float and (opt.min is not None or opt.max is not None):
        return click.FloatRange(opt.min, opt.max, min_open=opt.min_open, max_open=opt.max_open)
    return base


#: kind -> (file_okay, dir_okay)
_PATHS: dict[str, tuple[bool, bool]] = {
    "dir": (False, True), "file": (True, False), "path": (True, True),
}


def _scalar(hint: Any) -> Any:
    """``int | None`` -> int; ``list[str]`` -> str; ``str`` -> str."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin in (list, tuple) or (origin is not None and len(args) == 1):
        return _scalar(args[0]) if args else str
    return hint if hint in (int, float, str, bool) else str


class _FieldOption(TypedDict, total=False):
    """The click.option arguments a config field's flag sets (Spec adds the rest)."""

    help: str
    metavar: str
    is_flag: bool
    default: Any  # the field's own type
    type: click.ParamType | type
    multiple: bool
    required: bool


def field_specs(cls: type, *, per_process: bool | None = None) -> list[Spec]:
    """The flags of a config dataclass's fields, from their :class:`Opt` metadata.

    ``per_process``: only the fields a one-process command takes (True), only the
    others (False), or all (None). A ``nested`` field's own fields stand in its
    place; an ``internal`` one has no flag.
    """
    specs: list[Spec] = []
    for f, opt, hint in options_of(cls):
        if opt.internal or (per_process is not None and opt.per_process != per_process):
            continue
        if opt.nested:
            if isinstance(hint, type) and dataclasses.is_dataclass(hint) \
                    and hint not in (ServerConfig, WorkerConfig):
                specs.extend(field_specs(hint))
            continue
        flag = "--" + (opt.flag or f.name.replace("_", "-"))
        dest = opt.dest or f.name
        default = opt.cli_default if opt.cli_default is not MISSING else field_default(f)
        kwargs: _FieldOption = {"help": opt.help}
        if opt.metavar:
            kwargs["metavar"] = opt.metavar
        multiple = typing.get_origin(hint) in (list, dict) or opt.kind == "pairs"
        if hint is bool or hint == (bool | None):  # None: unset, the program decides
            decls: tuple[str, ...] = (f"{flag}/--no-{flag[2:]}" if opt.negatable else flag,)
            if not opt.negatable:
                kwargs["is_flag"] = True
            kwargs["default"] = default
        else:
            decls = (flag,)
            kwargs["type"] = _click_type(f, opt, hint)
            if multiple:
                kwargs["multiple"] = True
            else:
                kwargs["default"] = default
        if opt.required:
            kwargs["required"] = True
        specs.append(Spec(*decls, *opt.aliases, dest, field=(cls, f.name), **kwargs))
    return specs


def _insert_after(specs: list[Spec], name: str, *extra: Spec) -> list[Spec]:
    at = next(i for i, s in enumerate(specs) if s.name == name) + 1
    return [*specs[:at], *extra, *specs[at:]]


#: options that set how shards train: for ``server``, ``launch`` and ``run`` (ServerConfig's
#: fields, and --lr, the optimizer's learning rate)
SERVER = _insert_after(
    field_specs(ServerConfig, per_process=False), "optimizer",
    Spec("--lr", type=click.FloatRange(min=0), metavar="LR",
         default=field_default(_field(ServerConfig, "optimizer_args"))["lr"],
         help="Learning rate (an lr in --optimizer-arg wins)."),
)

#: ``server`` and ``worker``: no story or progress lines on stderr
QUIET = Spec("--quiet", "-q", is_flag=True, default=False, help="No lines on stderr about "
             "the run as it goes (joins, deaths, progress); warnings and errors still print.")

#: options of one shard process: ``server`` only (``launch`` and ``run`` set them per
#: process); --host and --port make ServerConfig.bind
SHARD = _insert_after(
    field_specs(ServerConfig, per_process=True), "num_shards",
    Spec("--host", default="127.0.0.1",
         help="Address to listen on. Give 0.0.0.0 (every interface) or this host's address "
              "to accept workers from other hosts."),
    Spec("--port", type=click.IntRange(0, 65535), default=0,
         help="Port to listen on; 0 picks a free one. The address is printed at start."),
    QUIET,
)

#: options that set how workers train: for ``worker``, ``launch`` and ``run`` (WorkerConfig's
#: fields, StragglerSpec's in place of ``straggler``)
WORKER = field_specs(WorkerConfig, per_process=False)

#: options of one worker process: ``worker`` only
WORKER_PROCESS = [*field_specs(WorkerConfig, per_process=True), QUIET]

#: ``launch`` only: ClusterSpec's fields, and what the command itself does
LAUNCH = [
    *field_specs(ClusterSpec),
    Spec("--out", type=click.Path(file_okay=False), default=None, metavar="DIR",
         help="Where logs, event logs and result.json go [default: runs/launch-<time>]."),
    Spec("--quiet", "-q", is_flag=True, default=False,
         help="No progress bar; print only the final summary."),
    Spec("--restart-workers", is_flag=True, default=False,
         help="Restart a worker that dies (the same as --on-worker-failure restart)."),
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
    Spec("--trace", is_flag=True, default=False,
         help="Record every push in DIR/trace (needs --out), for `paramserver simulate "
              "--replay` (docs/research.md)."),
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


def _deprecated_dest(old: str) -> str:
    return "deprecated_" + old.lstrip("-").replace("-", "_")


def deprecated_flag(old: str, new: str, **kwargs: Any) -> Callable[[F], F]:
    """A hidden flag ``old`` kept for one release in place of ``new``: it warns once, on
    stderr, naming ``new``; :func:`take_deprecated` moves its value onto ``new``. It has no
    environment variable and no config-file key (``servers`` there means addresses)."""

    def warn(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is not None:
            click.echo(f"paramserver {ctx.command.name}: {old} is deprecated for this count; "
                       f"use {new} (the same value). {old} works for this release only.",
                       err=True)
        return value

    return click.option(old, _deprecated_dest(old), hidden=True, default=None, callback=warn,
                        **kwargs)


def take_deprecated(ctx: click.Context, opts: dict[str, Any], old: str, new: str) -> None:
    """Give option ``new`` (its parameter name) the value of the deprecated flag ``old``
    where that was given; both flags given, with different values, is a usage error."""
    value = opts.pop(_deprecated_dest(old), None)
    ctx.params.pop(_deprecated_dest(old), None)
    if value is None:
        return
    flag = "--" + new.replace("_", "-")
    if ctx.get_parameter_source(new) is ParameterSource.COMMANDLINE and opts[new] != value:
        raise click.UsageError(f"{old} {value} and {flag} {opts[new]} disagree; give {flag} "
                               "only")
    opts[new] = ctx.params[new] = value
    ctx.set_parameter_source(new, ParameterSource.COMMANDLINE)  # for --print-config


#: ``launch``, ``experiment``, ``simulate``: the old name of --num-servers, for one release
SERVERS_COUNT = deprecated_flag("--servers", "--num-servers", type=click.IntRange(min=1))


def launch_flag(name: str) -> Callable[[F], F]:
    """``launch``'s option ``name`` (a ClusterSpec field) as another command's flag: the
    same declaration and help, without its environment variable."""
    spec = next(s for s in LAUNCH if s.name == name)
    kwargs = {**spec.kwargs, "envvar": None, "show_envvar": False}
    return click.option(*spec.decls, **kwargs)


#: ``experiment``: the emulated hosts, as ``launch`` declares them
HOST_FLAGS = [launch_flag("hosts"), launch_flag("link"), launch_flag("link_of")]

#: ``launch``, ``experiment``, ``simulate``: a flag only, with no environment variable and
#: no config-file key, so that deleting files is asked for each time (cli/outdir.py)
OVERWRITE = click.option(
    "--overwrite", is_flag=True, default=False,
    help="Delete what --out holds first (an earlier or failed run or experiment, or other "
         "files); without it a non-empty --out is refused.")


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
    file_worker_counts(ctx, data, source)  # any table's: they must agree (workercount.py)
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
            _no_fractions(param, value)
            out[name] = param.type_cast_value(ctx, value)
        except click.BadParameter as exc:
            raise click.BadParameter(f"{source}: {where} = {value!r}: {exc.message}", ctx=ctx,
                                     param_hint="--config") from exc
    return out


def _no_fractions(param: click.Parameter, value: Any) -> None:
    """A TOML float (or boolean) for an integer option is refused, as the flag and the
    environment variable refuse ``20.5``: click would truncate it to 20."""
    if not isinstance(param.type, click.types.IntParamType):
        return
    for item in value if isinstance(value, list | tuple) else [value]:
        if isinstance(item, bool | float):
            raise click.BadParameter(f"{item!r} is not a valid integer")


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


# --------------------------------------------------------------------------- precedence


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


def config_values(cls: type, opts: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of ``cls`` the command's options set (those it has), as the dataclass
    takes them: ``KEY=VALUE`` items as a dict, repeated options as a list."""
    values: dict[str, Any] = {}
    for f, opt, hint in options_of(cls):
        name = opt.dest or f.name
        if opt.internal or opt.nested or name not in opts:
            continue
        value = opts[name]
        if opt.kind == "pairs":
            value = dict(value or ())
        elif opt.kind in ("address", "shards"):
            value = flatten_addresses(value or ())
        elif typing.get_origin(hint) is list:
            value = list(value or ())
        values[f.name] = value
    return values


def server_config(opts: Mapping[str, Any], **fixed: Any) -> ServerConfig:
    """A validated ServerConfig from the SERVER group (and SHARD where given), plus ``fixed``."""
    # the optimizer and policy registries load torch: imported to check a config, not
    # to list the options (--help)
    import torch

    from paramserver.core.optim import build_optimizer, build_scheduler
    from paramserver.policies import create_policy

    values = config_values(ServerConfig, opts)
    values["optimizer_args"] = {"lr": opts["lr"], **values["optimizer_args"]}
    # no optimizer named (flag, environment, config file): a worker script's wrapped one
    ctx = click.get_current_context(silent=True)
    if ctx is not None and all(ctx.get_parameter_source(name) in (None, ParameterSource.DEFAULT)
                               for name in ("optimizer", "lr", "optimizer_args")):
        values["script_optimizer"] = True
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


def check_port_free(flag: str, port: int | None, host: str = "127.0.0.1") -> None:
    """Refuse a fixed port another process holds, in one line naming the flag, before
    anything starts (a port of 0 or None asks for none in particular)."""
    if not port:
        return
    host = "0.0.0.0" if host in ("*", "") else host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # as the HTTP server binds: a port in TIME_WAIT is free to it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            reason = "address in use" if exc.errno == errno.EADDRINUSE else \
                (exc.strerror or str(exc))
            raise click.UsageError(f"{flag} {port}: {reason}") from None


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def straggler_spec(opts: Mapping[str, Any], **override: Any) -> StragglerSpec:
    values = {**config_values(StragglerSpec, opts), **override}
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
    from paramserver.workers.tasks import check_task_args, resolve_task  # loads torch

    steps, epochs = _steps_or_epochs(ctx, opts)
    values = config_values(WorkerConfig, opts)
    values.update(steps=steps, epochs=epochs, straggler=straggler_spec(opts))
    values.update(fixed)
    with user_errors("--task"):
        resolve_task(values["task"])
    with user_errors("--task-arg"):
        check_task_args(values["task"], values["task_args"])
    with user_errors():
        return WorkerConfig(**values)


def option_names(command: str) -> Sequence[str]:
    """Every TOML key (long option without dashes) of a command."""
    return [spec.key for spec in _specs(command).values()]
