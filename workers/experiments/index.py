"""``experiment.json``, the index an experiment's report is built from, as records.

:class:`ConfigEntry` is one point of the grid with the step-size rules it ran
with (:class:`StepSettings`), :class:`RunEntry` one run (configuration x seed)
and how it ended, :class:`ScenarioEntry` a straggler scenario, and
:class:`ExperimentIndex` the whole file. :class:`EnvironmentInfo` is
``environment.json``, what it takes to reproduce the experiment. The runner
writes them with ``to_json()``; the report reads them back (keys a file lacks
take their defaults: an experiment from before a key was recorded).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import msgspec

from paramserver.errors import ConfigError
from paramserver.util.jsontypes import JSON, JSONObject
from paramserver.workers.launch.virtual import SimSpec
from paramserver.workers.stragglers import StragglerSpec

__all__ = ["DEFAULT_NAME", "MAX_NAME", "ConfigEntry", "EnvironmentInfo", "ExperimentIndex",
           "PolicyArg", "RunEntry", "ScenarioEntry", "StepSettings", "check_name", "inside"]

_T = TypeVar("_T")

#: an experiment spec's name when it gives none
DEFAULT_NAME = "experiment"
_D = TypeVar("_D")

#: a policy argument's value (policies take scalars: max_staleness=4, lam=0.5)
PolicyArg = str | int | float | bool | None

#: the longest scenario, mode or cell name (it names folders and image files)
MAX_NAME = 200
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def check_name(name: object, what: str) -> str:
    """The one rule for the names an experiment turns into folders and files (scenarios,
    modes' slugs, cells): 1 to MAX_NAME letters, digits, ``.``, ``_`` or ``-``, the
    first a letter or a digit. So a name is one path part, never ``..`` nor a path."""
    if not (isinstance(name, str) and 0 < len(name) <= MAX_NAME and name[0].isascii()
            and name[0].isalnum() and _NAME_CHARS.issuperset(name)):
        raise ConfigError(f"{what} {name!r} is not a name: 1 to {MAX_NAME} letters, digits, "
                          "'.', '_' or '-', starting with a letter or a digit")
    return name


def inside(base: Path, relative: str | Path) -> Path:
    """``base / relative``, refused unless it resolves inside ``base`` (a run folder, an
    image): nothing an experiment writes may land outside its ``--out``."""
    path = base / relative
    root = base.resolve()
    if not Path(relative).parts or Path(relative).is_absolute() \
            or not path.resolve().is_relative_to(root) or path.resolve() == root:
        raise ConfigError(f"{relative!s} is not a path inside {base}")
    return path


@dataclass(frozen=True)
class StepSettings:
    """The step-size rules a mode runs with: its own, else the spec's."""

    lr_scaling: str
    warmup_steps: int
    momentum_target: float | None  # asynchrony-aware momentum's total (None: off)
    momentum: float


@dataclass(frozen=True)
class ConfigEntry:
    """One configuration of ``experiment.json``: its grid point and step-size rules."""

    id: str
    scenario: str
    label: str
    mode: str  # sync, async or ssp
    workers: int
    bound: int = 0  # ssp's staleness bound
    mode_spec: str = ""  # the mode as given: ssp:3, sync:b=1,lr=linear
    backups: int = 0  # sync's backup workers
    policy: str = "none"
    policy_args: dict[str, PolicyArg] = field(default_factory=dict)
    # None: an experiment from before the step settings were recorded
    lr_scaling: str | None = None
    warmup_steps: int | None = None
    momentum_target: float | None = None
    momentum: float | None = None
    #: local SGD (a mode's h=, outer=): inner steps per push and the servers' outer
    #: optimizer; None: a push every step with the spec's optimizer
    sync_every: int | None = None
    outer: str | None = None
    replicas: int = 0  # backups per shard
    compression: str = "none"  # the workers' --compression

    def to_json(self) -> JSONObject:
        return {"id": self.id, "scenario": self.scenario, "label": self.label,
                "sync_every": self.sync_every, "outer": self.outer,
                "mode": self.mode, "bound": self.bound, "mode_spec": self.mode_spec,
                "backups": self.backups, "policy": self.policy,
                "policy_args": {k: v for k, v in self.policy_args.items()},
                "workers": self.workers, "lr_scaling": self.lr_scaling,
                "warmup_steps": self.warmup_steps, "momentum_target": self.momentum_target,
                "momentum": self.momentum, "replicas": self.replicas,
                "compression": self.compression}

    @classmethod
    def from_json(cls, data: JSON) -> ConfigEntry:
        return msgspec.convert(data, type=cls)

    def __post_init__(self) -> None:  # read back too: the report names files after them
        check_name(self.id, "configuration")
        check_name(self.scenario, "scenario")


@dataclass(frozen=True)
class RunEntry:
    """One run of ``experiment.json``: which configuration and seed, and how it ended."""

    config: str  # its ConfigEntry's id
    seed: int
    path: str  # its directory, relative to the experiment's
    ok: bool
    seconds: float = 0.0
    error: str = ""  # the first line of why it failed
    load: float | None = None  # 1-minute load average when it ended (None: not known)
    budget: str | None = None  # the experiment's budget in words

    def to_json(self) -> JSONObject:
        return {"config": self.config, "seed": self.seed, "path": self.path,
                "budget": self.budget, "ok": self.ok, "seconds": self.seconds,
                "error": self.error, "load": self.load}

    @classmethod
    def from_json(cls, data: JSON) -> RunEntry:
        return msgspec.convert(data, type=cls)


@dataclass(frozen=True)
class ScenarioEntry:
    """A straggler scenario as run: every worker's settings and per-rank overrides."""

    description: str = ""
    all: StragglerSpec = field(default_factory=StragglerSpec)
    ranks: dict[str, StragglerSpec] = field(default_factory=dict)  # rank -> its settings

    def to_json(self) -> JSONObject:
        return {"description": self.description, "all": _straggler(self.all),
                "ranks": {r: _straggler(s) for r, s in self.ranks.items()}}


def _open(doc: JSONObject, key: str) -> JSONObject:
    """The user's own arguments: open JSON, which msgspec cannot check, so by hand."""
    value = doc.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise msgspec.ValidationError(f"experiment.json: `{key}` is not an object")
    return value


def _straggler(spec: StragglerSpec) -> JSONObject:
    data: JSONObject = dataclasses.asdict(spec)
    return data


@dataclass(frozen=True)
class ExperimentIndex:
    """``experiment.json``: what the experiment ran, and each run's outcome so far.

    ``task_args`` and ``optimizer_args`` are the user's own arguments (open JSON)."""

    name: str
    task: str
    servers: int
    seeds: tuple[int, ...]
    target_loss: float
    eval_every: int
    optimizer: str
    started: float
    steps: int | None = None
    task_args: JSONObject = field(default_factory=dict)
    optimizer_args: JSONObject = field(default_factory=dict)
    batch_size: int | None = None
    min_step_time: float = 0.0
    budget_seconds: float = 0.0
    budget_gradients: int = 0
    budget: str | None = None  # the budget in words
    scenarios: dict[str, ScenarioEntry] = field(default_factory=dict)
    configurations: tuple[ConfigEntry, ...] = ()
    runs: tuple[RunEntry, ...] = ()
    finished: float | None = None  # None: still running (or stopped)
    simulated: SimSpec | None = None  # in virtual time, with this time model
    #: every cell ran this script once per worker (``task`` is then its shell line)
    command: tuple[str, ...] | None = None
    #: every run on emulated hosts: W, S, the NIC rate and the slow hosts'
    #: (HostPlan.to_json); None: on loopback
    hosts: JSONObject | None = None

    def to_json(self) -> JSONObject:
        data: JSONObject = {
            "name": self.name, "task": self.task, "task_args": self.task_args,
            "steps": self.steps, "servers": self.servers, "seeds": [s for s in self.seeds],
            "target_loss": self.target_loss, "eval_every": self.eval_every,
            "min_step_time": self.min_step_time, "optimizer": self.optimizer,
            "optimizer_args": self.optimizer_args, "batch_size": self.batch_size,
            "budget_seconds": self.budget_seconds, "budget_gradients": self.budget_gradients,
            "budget": self.budget,
            "scenarios": {k: v.to_json() for k, v in self.scenarios.items()},
            "configurations": [c.to_json() for c in self.configurations],
            "runs": [r.to_json() for r in self.runs],
            "started": self.started, "finished": self.finished,
        }
        if self.command is not None:
            data["command"] = list(self.command)
        if self.hosts is not None:
            data["hosts"] = self.hosts
        if self.simulated is not None:
            sim: JSONObject = dataclasses.asdict(self.simulated)
            data["simulated"] = sim
        return data

    @classmethod
    def from_json(cls, data: JSON) -> ExperimentIndex:
        """``experiment.json`` read back; keys it lacks (older files) take their defaults."""
        if not isinstance(data, dict):
            raise msgspec.ValidationError("experiment.json: expected an object")
        doc = data

        def required(key: str, kind: type[_T]) -> _T:
            if key not in doc:
                raise msgspec.ValidationError(f"experiment.json: no `{key}`")
            try:
                return msgspec.convert(doc[key], type=kind)
            except msgspec.ValidationError as exc:
                raise msgspec.ValidationError(f"experiment.json: `{key}`: {exc}") from None

        def get(key: str, kind: type[_T], default: _D) -> _T | _D:
            return default if doc.get(key) is None else required(key, kind)

        scenarios = get("scenarios", dict[str, ScenarioEntry], {})
        for scenario in scenarios:  # they name image files
            try:
                check_name(scenario, "scenario")
            except ConfigError as exc:
                raise msgspec.ValidationError(f"experiment.json: `scenarios`: {exc}") from None
        return cls(
            name=required("name", str), task=required("task", str),
            servers=required("servers", int), seeds=required("seeds", tuple[int, ...]),
            target_loss=required("target_loss", float),
            eval_every=required("eval_every", int), optimizer=required("optimizer", str),
            started=required("started", float), steps=get("steps", int, None),
            task_args=_open(doc, "task_args"), optimizer_args=_open(doc, "optimizer_args"),
            batch_size=get("batch_size", int, None),
            min_step_time=get("min_step_time", float, 0.0),
            budget_seconds=get("budget_seconds", float, 0.0),
            budget_gradients=get("budget_gradients", int, 0),
            budget=get("budget", str, None),
            scenarios=scenarios,
            configurations=get("configurations", tuple[ConfigEntry, ...], ()),
            runs=get("runs", tuple[RunEntry, ...], ()),
            finished=get("finished", float, None),
            simulated=get("simulated", SimSpec, None),
            command=get("command", tuple[str, ...], None),
            hosts=_open(doc, "hosts") if doc.get("hosts") is not None else None,
        )

    @classmethod
    def read(cls, out_dir: str | Path) -> ExperimentIndex:
        path = Path(out_dir) / "experiment.json"
        if not path.exists():
            raise ConfigError(f"{out_dir} holds no experiment.json: not an experiment directory")
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (ValueError, msgspec.ValidationError) as exc:
            raise ConfigError(f"{path}: {exc}") from exc


@dataclass(frozen=True)
class EnvironmentInfo:
    """``environment.json``: versions, git commit, platform, command (None: not known)."""

    python: str | None = None
    implementation: str | None = None
    platform: str | None = None
    machine: str | None = None
    cpus: int | None = None
    packages: dict[str, str | None] = field(default_factory=dict)  # None: not installed
    git_commit: str | None = None
    git_dirty: bool | None = None
    argv: tuple[str, ...] = ()
    torch_threads: int | None = None
    cuda: bool | None = None

    def to_json(self) -> JSONObject:
        return {"python": self.python, "implementation": self.implementation,
                "platform": self.platform, "machine": self.machine, "cpus": self.cpus,
                "packages": {k: v for k, v in self.packages.items()},
                "git_commit": self.git_commit, "git_dirty": self.git_dirty,
                "argv": [a for a in self.argv], "torch_threads": self.torch_threads,
                "cuda": self.cuda}

    @classmethod
    def read(cls, out_dir: str | Path) -> EnvironmentInfo:
        """An experiment's ``environment.json`` (all unknown if there is none)."""
        path = Path(out_dir) / "environment.json"
        if not path.exists():
            return cls()
        try:
            return msgspec.convert(json.loads(path.read_text()), type=cls)
        except (ValueError, msgspec.ValidationError) as exc:
            raise ConfigError(f"{path}: {exc}") from exc
