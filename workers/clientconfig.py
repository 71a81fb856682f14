"""What a worker's client is configured with: one value, :class:`ClientConfig`.

``DistributedOptimizer(model, opt, config=ClientConfig(servers=[...], rank=0))``, or
nothing at all under ``paramserver launch -- COMMAND`` (and ``paramserver run``):
then :meth:`ClientConfig.from_env` reads what the launcher set, and
``ClientConfig.from_env(timeout=120)`` overrides some of it.

The options themselves are declared once, as :class:`WorkerConfig`'s fields (their
help, bounds and defaults, whence the flags of ``paramserver worker``, ``launch``
and ``run``). Each option the client acts on lands in the field of the same name
here, with the same default: :meth:`ClientConfig.of` takes them from a
WorkerConfig by name, :meth:`ClientConfig.from_env` from the launcher's options
file by name, and tests/test_clientconfig.py checks that the two records agree.
Light (no torch): the CLI and the launcher read it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

from paramserver.errors import ConfigError
from paramserver.server.config import check_bounds
from paramserver.workers.config import (
    EVALUATOR_ENV,
    GRAD_WIRE_DTYPE_NAMES,
    RUN_ENV,
    LaunchOptions,
    WorkerConfig,
    check_compression,
    check_evaluator,
    worker_default,
)
from paramserver.workers.stragglerspec import StragglerSpec

if TYPE_CHECKING:
    from paramserver.observe.events import EventLog

__all__ = ["EVENT_LOG_ENV", "PLAN_FILE_ENV", "RESULT_FILE_ENV", "SERVERS_ENV", "ClientConfig",
           "int_from_env", "servers_from_env"]

#: the environment variables a launcher sets for each worker process
SERVERS_ENV = "PARAMSERVER_SERVERS"
#: where a launched worker logs its steps, writes its result, and rank 0 the plan
EVENT_LOG_ENV, RESULT_FILE_ENV, PLAN_FILE_ENV = (
    "PARAMSERVER_EVENT_LOG", "PARAMSERVER_RESULT_FILE", "PARAMSERVER_PLAN_FILE")


def servers_from_env(servers: str | Iterable[str] | None) -> list[str]:
    """Server addresses from the argument, else from ``PARAMSERVER_SERVERS``."""
    if servers is None:
        servers = os.environ.get(SERVERS_ENV, "")
        if not servers:
            raise ConfigError(f"no servers: pass config=ClientConfig(servers=[...]) or set "
                              f"{SERVERS_ENV} (paramserver launch -- COMMAND sets it)")
    if isinstance(servers, str):
        servers = servers.split(",")
    out = [s.strip() for s in servers if s.strip()]
    if not out:
        raise ConfigError("servers is empty: give the shard servers' addresses in shard order")
    return out


def int_from_env(value: int | None, names: tuple[str, ...], default: int) -> int:
    if value is not None:
        return value
    for name in names:
        raw = os.environ.get(name)
        if raw is not None:
            try:
                return int(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not an integer") from None
    return default


@dataclass(frozen=True)
class ClientConfig:
    """Everything a worker's client and its DistributedOptimizer are configured with,
    apart from the few keywords a script passes the optimizer itself (the model, the
    wrapped optimizer, ``overlap``, ``local`` and ``sync_every``).

    The fields that are worker options (``paramserver worker --help`` says what each
    does) take WorkerConfig's defaults; the others are a script's or a launcher's:

    * ``offer_weights``: whether this worker offers its weights to seed the servers
      (the first offer wins) or waits for them; None: rank 0 offers, the others wait.
    * ``events``: an open event log to write each step to, whose start and end
      records are its owner's (the built-in loop's); None: the file ``event_log``
      names, with this worker's start and end records too.
    * ``plan_file``: where rank 0 records the plan, by which a launcher saves the
      final weights.
    """

    # the worker options the client acts on, WorkerConfig's defaults (declared there)
    #: in shard order; a str is comma-separated (kept as a tuple either way)
    servers: Sequence[str] = ()
    rank: int = worker_default("rank")
    world_size: int = worker_default("world_size")
    run_id: str | None = worker_default("run_id")
    evaluator: int = worker_default("evaluator")
    seed: int = worker_default("seed")
    straggler: StragglerSpec = field(default_factory=StragglerSpec)
    chunk_bytes: int = worker_default("chunk_bytes")
    part_bytes: int = worker_default("part_bytes")
    early_parts: bool = worker_default("early_parts")
    timeout: float = worker_default("timeout")
    request_timeout: float = worker_default("request_timeout")
    barrier_timeout: float = worker_default("barrier_timeout")
    heartbeat_interval: float = worker_default("heartbeat_interval")
    bucket_bytes: int = worker_default("bucket_bytes")
    wire_dtype: str | None = worker_default("wire_dtype")
    compression: str | None = worker_default("compression")
    curve_key: str | None = worker_default("curve_key")
    curve_server_key: str | None = worker_default("curve_server_key")
    event_log: str | None = worker_default("event_log")
    result_file: str | None = worker_default("result_file")
    # a script's or a launcher's, not worker options
    offer_weights: bool | None = None
    events: EventLog | None = field(default=None, compare=False, repr=False)
    plan_file: str | None = None

    #: the fields that are not worker options (set by a script or a launcher)
    NOT_OPTIONS: ClassVar[frozenset[str]] = frozenset({"offer_weights", "events", "plan_file"})

    def __post_init__(self) -> None:
        if isinstance(self.servers, str):  # "a,b" as PARAMSERVER_SERVERS gives them
            object.__setattr__(self, "servers", tuple(servers_from_env(self.servers)))
        elif not isinstance(self.servers, tuple):
            object.__setattr__(self, "servers", tuple(self.servers))
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        check_evaluator(self.evaluator, self.world_size)
        if bool(self.curve_key) != bool(self.curve_server_key):
            raise ConfigError("CURVE needs both curve_key (this client's .key_secret file) and "
                              "curve_server_key (the server's public .key file)")
        if self.wire_dtype not in (None, *GRAD_WIRE_DTYPE_NAMES):
            raise ConfigError(f"wire_dtype must be one of {', '.join(GRAD_WIRE_DTYPE_NAMES)} or "
                              f"None (gradients as they are); got {self.wire_dtype!r}")
        if self.compression is not None:
            check_compression(self.compression, self.wire_dtype)
        check_bounds(self, WorkerConfig)  # the bounds the options declare

    @classmethod
    def options(cls) -> list[str]:
        """The fields that are worker options, in order."""
        return [f.name for f in fields(cls) if f.name not in cls.NOT_OPTIONS]

    @classmethod
    def of(cls, worker: WorkerConfig, **given: Any) -> ClientConfig:
        """``worker``'s values of the options the client acts on (by name), and
        ``given``."""
        values = {name: getattr(worker, name) for name in cls.options()}
        return cls(**{**values, **given})

    @classmethod
    def from_env(cls, **given: Any) -> ClientConfig:
        """What ``paramserver launch -- COMMAND`` (or ``run``) set in this process's
        environment, with ``given`` winning: ``PARAMSERVER_SERVERS``, ``RANK``,
        ``WORLD_SIZE`` (0 and 1 unset), ``PARAMSERVER_EVALUATOR``, ``PARAMSERVER_RUN``,
        the event log, result and plan files, and the launcher's worker options (the
        file ``PARAMSERVER_WORKER_OPTIONS`` names: timeouts, wire options, this rank's
        straggler scenario), else the defaults."""
        launched = LaunchOptions.from_env()
        values: dict[str, Any] = {f.name: getattr(launched, f.name)
                                  for f in fields(LaunchOptions)}
        env = os.environ
        values.update(
            rank=int_from_env(None, ("RANK",), 0),
            world_size=int_from_env(None, ("WORLD_SIZE",), 1),
            evaluator=int_from_env(None, (EVALUATOR_ENV,), 0),
            run_id=env.get(RUN_ENV) or None, event_log=env.get(EVENT_LOG_ENV) or None,
            result_file=env.get(RESULT_FILE_ENV) or None,
            plan_file=env.get(PLAN_FILE_ENV) or None)
        if "servers" not in given:
            values["servers"] = tuple(servers_from_env(None))
        return cls(**{**values, **given})

    def replace(self, **changes: Any) -> ClientConfig:
        """This config with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)
