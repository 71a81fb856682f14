"""Experiments: a grid of local runs on one task, with identical seeds and data.

An :class:`ExperimentSpec` names a task and the axes of a grid: straggler
scenarios x modes x staleness policies x worker counts, each repeated for
every seed. :func:`run_experiment` runs every point of the grid with
:func:`paramserver.workers.launch.cluster.run_cluster` into ``out/runs/<config>/seed<k>/`` and
then writes the report (:mod:`paramserver.workers.experiments.report`)::

    spec = ExperimentSpec(modes=["sync", "async", "ssp:3"], scenarios=["transient"])
    result = run_experiment(spec, "runs/demo")

With ``command`` (``paramserver experiment ... -- python train.py``) every cell
runs the user's own script once per worker instead of the built-in loop, as
``launch -- COMMAND`` does; the keys of the built-in loop
(:data:`NOT_FOR_COMMANDS`) are refused then, and ``steps`` becomes a hint the
script finds as ``PARAMSERVER_STEPS``.

Fairness: every configuration of one seed trains the same model from the same
initial weights on the same data partition with the same straggler draws
(seeded by ``(seed, rank)``), and every worker runs the same number of steps,
or, with a budget, every mode gets the same wall time (``budget_seconds``, from
each worker's first step) or the same total of gradients computed
(``budget_gradients``, an equal share per worker).
Runs go seed by seed, so a slow phase of the machine hits every configuration
alike. The run directory holds the resolved spec (``spec.toml``, which
``--spec`` accepts back), ``environment.json`` (versions, git commit,
platform) and ``experiment.json`` (the index the report is built from).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import shlex
import tomllib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w
import torch

from paramserver.core.optim import build_optimizer
from paramserver.core.stepsize import LrRule
from paramserver.errors import ConfigError
from paramserver.server.loop import ServerConfig
from paramserver.util.jsontypes import JSONObject
from paramserver.workers.config import check_evaluator
from paramserver.workers.experiments.axes import (
    SCENARIOS,
    ModeChoice,
    PolicyChoice,
    Scenario,
    builtin_scenario,
    slug,
)
from paramserver.workers.experiments.index import (
    DEFAULT_NAME,
    ConfigEntry,
    StepSettings,
    check_name,
)
from paramserver.workers.launch.cluster import ClusterSpec
from paramserver.workers.launch.hostplan import HostPlan, normalize_link_of
from paramserver.workers.tasks import resolve_task, task_parameters
from paramserver.workers.worker import WorkerConfig

__all__ = [
    "MAX_RUNS",
    "NOT_FOR_COMMANDS",
    "PRESETS",
    "SCENARIOS",
    "Configuration",
    "ExperimentSpec",
    "ModeChoice",
    "PolicyChoice",
    "RunPlan",
    "Scenario",
    "builtin_scenario",
    "dump_spec",
    "load_spec",
    "preset",
    "split_compression",
]

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- the spec


@dataclass(frozen=True)
class Configuration:
    """One point of the grid (every seed of it shares this)."""

    scenario: str
    mode: ModeChoice
    policy: PolicyChoice
    workers: int
    label: str
    replicas: int = 0  # backups per shard (ServerConfig.replicas)
    #: the workers' --compression (paramserver/compress); ``PUSH/PULL``: the shards'
    #: --pull-compression too (core/pullsqueeze.py)
    compression: str = "none"

    def __post_init__(self) -> None:  # it names the cell's folder under runs/
        check_name(self.id, "configuration")

    @property
    def id(self) -> str:
        return (f"{self.scenario}-{self.mode.slug}-{self.policy.slug}-w{self.workers}"
                + (f"-r{self.replicas}" if self.replicas else "")
                + (f"-{slug(self.compression)}" if self.compression != "none" else ""))



@dataclass(frozen=True)
class RunPlan:
    """One run: a configuration and a seed, in its own directory."""

    config: Configuration
    seed: int
    path: str  # relative to the experiment directory

    @property
    def name(self) -> str:
        return f"{self.config.scenario} · {self.config.label} · seed {self.seed}"


_SPEC_KEYS = ("name", "task", "task_args", "steps", "batch_size", "seeds", "num_servers", "workers",
              "modes", "policies", "scenarios", "custom_scenarios", "optimizer",
              "optimizer_args", "target_loss", "eval_every", "min_step_time", "device",
              "run_timeout", "lr_scaling", "warmup_steps", "momentum_target",
              "budget_seconds", "budget_gradients", "command", "local_optimizer", "local_args",
              "outer_args", "evaluator", "replicas", "hosts", "link", "link_of", "compressions")

#: the most runs (configurations x seeds) a grid may hold: each is a cluster run of
#: seconds to minutes, so more is a mistake (seeds = 1000000), refused at once
MAX_RUNS = 10_000
_AXES = ("scenarios", "modes", "policies", "workers", "replicas", "compressions", "seeds")

_OWN_MODEL = "the script builds its own model and loads its own data"
_OWN_LOOP = "the script runs its own loop (steps is passed on as PARAMSERVER_STEPS, a hint)"
#: the keys of the built-in loop that a command cell cannot honour, and why (every other
#: key acts: the servers' optimizer and step-size rules, scenarios, the report's target)
NOT_FOR_COMMANDS: dict[str, str] = {
    "task": _OWN_MODEL, "task_args": _OWN_MODEL, "batch_size": _OWN_MODEL,
    "device": "the script places its own model on a device",
    "eval_every": "the script evaluates when it likes",
    "budget_seconds": _OWN_LOOP, "budget_gradients": _OWN_LOOP,
}


@dataclass
class ExperimentSpec:
    """The whole grid; validated (and strings parsed) on construction.

    The defaults are the demo: sync, async and ssp s=3 with 4 workers and 2
    servers on ``digits-mlp`` under transient stragglers, 3 seeds.
    """

    name: str = DEFAULT_NAME
    task: str = "digits-mlp"
    task_args: JSONObject = field(default_factory=dict)  # the task's own arguments
    steps: int = 250  # per worker, the same for every worker and configuration
    batch_size: int | None = None  # None: the task's default
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    servers: int = 2
    workers: list[int] = field(default_factory=lambda: [4])
    modes: list[ModeChoice] = field(
        default_factory=lambda: [ModeChoice("sync"), ModeChoice("async"), ModeChoice("ssp", 3)])
    policies: list[PolicyChoice] = field(default_factory=lambda: [PolicyChoice()])
    scenarios: list[str] = field(default_factory=lambda: ["transient"])
    custom_scenarios: dict[str, Scenario] = field(default_factory=dict)
    optimizer: str = "sgd"
    optimizer_args: JSONObject = field(default_factory=lambda: {"lr": 0.1})
    target_loss: float = 0.5  # held-out loss for "time to target"
    eval_every: int = 5  # the evaluator evaluates held-out data every N of its steps
    min_step_time: float = 0.015  # s; emulates a model heavier than the task's
    device: str = "cpu"
    run_timeout: float | None = 900.0  # s per run; 0 or None: no limit
    #: step-size rules for every mode (a mode's own lr=, warmup=, target= override them)
    lr_scaling: str = "none"
    warmup_steps: int = 0
    momentum_target: float | None = None
    #: budgets (0: none; at most one): every worker trains this many seconds from its first
    #: step (``steps`` is then ignored), or computes budget_gradients / workers gradients
    budget_seconds: float = 0.0
    budget_gradients: int = 0
    #: the user's own script, run once per worker of every cell instead of the built-in
    #: loop (``launch -- COMMAND``); a string is split as a shell would (shlex)
    command: list[str] | None = None
    #: local SGD, for the modes with h=H: each worker's inner optimizer, and the outer
    #: (servers') optimizer's arguments (the mode's outer=NAME, else sgd): DiLoCo's
    local_optimizer: str = "adamw"
    local_args: JSONObject = field(default_factory=lambda: {"lr": 0.001})
    outer_args: JSONObject = field(
        default_factory=lambda: {"lr": 0.7, "momentum": 0.9, "nesterov": True})
    #: the rank that evaluates held-out data in every cell (a command's script finds it as
    #: PARAMSERVER_EVALUATOR); None: the lowest rank the cell's scenario does not slow
    evaluator: int | None = None
    #: backups per shard (``launch --replicas``): one value, or a list to compare (an axis)
    replicas: list[int] = field(default_factory=lambda: [0])
    #: every run on emulated hosts (``launch --hosts``): "W+S", every NIC at ``link``,
    #: host K's at ``link_of[K]`` (a network straggler); None: on loopback
    hosts: str | None = None
    link: str | None = None
    link_of: dict[int, str] = field(default_factory=dict)
    #: the workers' push compression (``--compression``): one spec, or a list (an axis)
    compressions: list[str] = field(default_factory=lambda: ["none"])

    def __post_init__(self) -> None:
        self._check_command()
        self._check_size()
        self.modes = [ModeChoice.parse(m) for m in _as_list(self.modes, "modes")]
        self.policies = [PolicyChoice.parse(p) for p in _as_list(self.policies, "policies")]
        self.workers = [_int(w, "workers", 1) for w in _as_list(self.workers, "workers")]
        self.replicas = [_int(r, "replicas", 0) for r in _as_list(self.replicas, "replicas")]
        self.compressions = [_compression(c) for c in _as_list(self.compressions,
                                                                  "compressions")]
        self.scenarios = [check_name(s, "scenario")
                          for s in _as_list(self.scenarios, "scenarios")]
        if isinstance(self.seeds, int) and not isinstance(self.seeds, bool):
            self.seeds = list(range(_int(self.seeds, "seeds (a count)", 1)))
        self.seeds = [_int(s, "seeds", 0) for s in _as_list(self.seeds, "seeds")]
        for axis in _AXES:  # one pass each: a grid may list thousands of seeds
            counts = Counter(str(v) for v in getattr(self, axis))
            dupes = sorted(v for v, n in counts.items() if n > 1)
            if dupes:
                shown = ", ".join(dupes[:10]) + (f" (and {len(dupes) - 10} more)"
                                                 if len(dupes) > 10 else "")
                raise ConfigError(f"{axis} lists {shown} more than once")
        for mode in self.modes:
            if mode.backups >= min(self.workers):
                raise ConfigError(f"{mode}: backup workers must be fewer than the workers "
                                  f"({min(self.workers)})")
        _int(self.steps, "steps", 1)
        _int(self.servers, "num_servers", 1)
        _int(self.eval_every, "eval_every", 1)
        if self.batch_size is not None:
            _int(self.batch_size, "batch_size", 1)
        if not (isinstance(self.target_loss, int | float) and self.target_loss > 0):
            raise ConfigError(f"target_loss must be a number > 0, got {self.target_loss!r}")
        if not (isinstance(self.min_step_time, int | float) and self.min_step_time >= 0):
            raise ConfigError(f"min_step_time must be >= 0 seconds, got {self.min_step_time!r}")
        if self.run_timeout is not None and not self.run_timeout >= 0:
            raise ConfigError(f"run_timeout must be >= 0 seconds (0: none), "
                              f"got {self.run_timeout!r}")
        self.run_timeout = self.run_timeout or None  # TOML has no null: 0 means no limit
        self._check_budgets()
        if not isinstance(self.name, str) or not slug(self.name):
            raise ConfigError(f"name must be a non-empty string, got {self.name!r}")
        self.custom_scenarios = {
            k: v if isinstance(v, Scenario) else Scenario.from_table(k, v, self.min_step_time)
            for k, v in dict(self.custom_scenarios).items()
        }
        for name in self.scenarios:
            self.scenario(name)
        if self.evaluator is not None:
            _int(self.evaluator, "evaluator", 0)
            check_evaluator(self.evaluator, min(self.workers))
        LrRule(self.lr_scaling, self.warmup_steps)
        if self.momentum_target is not None and not 0 <= self.momentum_target < 1:
            raise ConfigError(f"momentum_target must be in [0, 1), got {self.momentum_target!r}")
        if self.command is None:
            self._check_task()
        build_optimizer(self.optimizer, [torch.zeros(1, requires_grad=True)],
                        dict(self.optimizer_args))
        self._check_local()
        self._check_replicas()
        self.link_of = normalize_link_of(self.link_of)
        self._check_features()

    def _check_size(self) -> None:
        """At most MAX_RUNS runs, counted before any axis is expanded or checked."""
        runs = 1
        for axis in _AXES:
            value = getattr(self, axis)
            count = value if axis == "seeds" and isinstance(value, int) \
                and not isinstance(value, bool) else len(_as_list(value, axis))
            runs *= max(count, 1)
        if runs > MAX_RUNS:
            raise ConfigError(f"the grid holds {runs:,} runs (configurations x seeds); at most "
                              f"{MAX_RUNS:,}: give fewer seeds or axis values")

    def _check_replicas(self) -> None:
        """Each replica count with each mode and policy is one the servers take (they
        refuse, in one line, what replication does not support)."""
        for replicas in (r for r in self.replicas if r):
            for mode in self.modes:
                for policy in self.policies:
                    try:
                        ServerConfig(mode=mode.mode, staleness_bound=mode.bound,
                                     backup_workers=mode.backups, policy=policy.name,
                                     policy_args=dict(policy.args), replicas=replicas,
                                     expected_workers=max(self.workers))
                    except ConfigError as exc:
                        raise ConfigError(f"replicas = {replicas} with mode {mode}, policy "
                                          f"{policy.label}: {exc}") from None

    def _check_features(self) -> None:
        """Every run of the grid turns on features that work together, as ``launch``
        would have them (paramserver/core/features.py): refused here, before any runs."""
        for config in self.configurations():
            try:
                self.cluster_spec(config, 0)
            except ConfigError as exc:
                raise ConfigError(f"the runs {config.label!r}: {exc}") from None

    def _check_local(self) -> None:
        """Modes with h=H: their optimizers build, and every worker's steps are whole
        rounds (a partial last round is dropped: the modes would compute unequal gradients)."""
        for mode in (m for m in self.modes if m.sync_every is not None):
            assert mode.sync_every is not None
            if self.command is not None:
                raise ConfigError(f"mode {mode}: local steps (h=) need the built-in loop")
            build_optimizer(self.local_optimizer, [torch.zeros(1, requires_grad=True)],
                            dict(self.local_args))
            build_optimizer(mode.outer or "sgd", [torch.zeros(1, requires_grad=True)],
                            self.outer_optimizer_args(mode))
            for n in self.workers:
                steps = self.worker_steps(n)
                if steps is not None and steps % mode.sync_every:
                    raise ConfigError(f"mode {mode}: {steps} steps per worker ({n} workers) "
                                      f"are not whole rounds of {mode.sync_every}")

    def outer_optimizer_args(self, mode: ModeChoice) -> dict[str, Any]:
        """The outer optimizer's arguments for a local-SGD mode (its momentum= wins)."""
        args = dict(self.outer_args)
        if mode.momentum is not None:
            args["momentum"] = mode.momentum
        return args

    def _check_budgets(self) -> None:
        if isinstance(self.budget_seconds, bool) \
                or not (isinstance(self.budget_seconds, int | float) and self.budget_seconds >= 0):
            raise ConfigError(f"budget_seconds must be >= 0 seconds (0: none), "
                              f"got {self.budget_seconds!r}")
        _int(self.budget_gradients, "budget_gradients", 0)
        if self.budget_seconds and self.budget_gradients:
            raise ConfigError("give budget_seconds or budget_gradients, not both")
        for n in self.workers:
            if self.budget_gradients % n:
                raise ConfigError(
                    f"budget_gradients {self.budget_gradients} is not a multiple of {n} "
                    f"workers: every worker computes an equal share (e.g. "
                    f"{self.budget_gradients // n * n or n})")

    @property
    def budget(self) -> str:
        """What every run of this spec trains for, in words."""
        if self.budget_seconds:
            return f"{self.budget_seconds:g} s of training per worker"
        if self.budget_gradients:
            return f"{self.budget_gradients} gradients in total"
        if self.command:
            return f"the script's own loop (PARAMSERVER_STEPS={self.steps}, a hint)"
        return f"{self.steps} steps per worker"

    def worker_steps(self, workers: int) -> int | None:
        """Steps each of ``workers`` workers runs; None under a time budget (no cap)."""
        if self.budget_seconds:
            return None
        if self.budget_gradients:
            return self.budget_gradients // workers
        return self.steps

    def _check_command(self) -> None:
        """A command is a non-empty list of strings; the built-in loop's keys stay at their
        defaults with it (one line says which is not and why)."""
        if self.command is None:
            return
        if isinstance(self.command, str):
            self.command = shlex.split(self.command)
        if not (isinstance(self.command, Sequence) and self.command
                and all(isinstance(a, str) for a in self.command)):
            raise ConfigError(f"command must be a non-empty list of strings, e.g. "
                              f'["python", "train.py"]; got {self.command!r}')
        self.command = list(self.command)
        defaults = {f.name: f for f in dataclasses.fields(self)}
        for key, why in NOT_FOR_COMMANDS.items():
            f = defaults[key]
            default = f.default_factory() if callable(f.default_factory) else f.default
            if getattr(self, key) != default:
                raise ConfigError(f"{key} does not apply with a command: {why}")

    @property
    def workload(self) -> str:
        """What every cell trains: the task's name, or the command as a shell line."""
        return shlex.join(self.command) if self.command else self.task

    def _check_task(self) -> None:
        accepted = task_parameters(resolve_task(self.task))
        unknown = set(self.task_args) - set(accepted)
        if unknown and accepted:
            raise ConfigError(f"task {self.task!r} has no argument(s) {sorted(unknown)}; "
                              f"accepted: {', '.join(accepted)}")

    def scenario(self, name: str) -> Scenario:
        if name in self.custom_scenarios:
            return self.custom_scenarios[name]
        return builtin_scenario(name, self.min_step_time)

    def configurations(self) -> list[Configuration]:
        """Every grid point, scenario-major; labels name only the axes that vary."""
        out = []
        for scenario in self.scenarios:
            for mode in self.modes:
                for policy in self.policies:
                    for workers in self.workers:
                        for replicas, compression in itertools.product(
                                self.replicas, self.compressions):
                            label = mode.label
                            if len(self.policies) > 1 or policy.name != "none":
                                label += f" + {policy.label}"
                            if len(self.workers) > 1:
                                label += f", {workers} workers"
                            if len(self.replicas) > 1 or replicas:
                                label += f", {replicas} replica{'s' if replicas != 1 else ''}"
                            if len(self.compressions) > 1 or compression != "none":
                                label += f", {compression}"
                            out.append(Configuration(scenario, mode, policy, workers, label,
                                                     replicas, compression))
        return out

    def runs(self) -> list[RunPlan]:
        """Seed-major order: a drift of the machine's speed hits every configuration alike."""
        return [RunPlan(c, seed, f"runs/{c.id}/seed{seed}")
                for seed in self.seeds for c in self.configurations()]

    def evaluator_of(self, config: Configuration) -> int:
        """The rank that evaluates in ``config``: the spec's, else the lowest rank that the
        scenario does not slow more than the others (all slowed: 0)."""
        if self.evaluator is not None:
            return self.evaluator
        scenario = self.scenario(config.scenario)
        slowed = {r for r, s in scenario.stragglers(config.workers).items() if s != scenario.all}
        return min(set(range(config.workers)) - slowed, default=0)

    def cluster_spec(self, config: Configuration, seed: int) -> ClusterSpec:
        scenario = self.scenario(config.scenario)
        step = self.step_settings(config.mode)
        optimizer_args = dict(self.optimizer_args)
        if config.mode.momentum is not None:
            optimizer_args["momentum"] = config.mode.momentum
        local = config.mode.sync_every is not None
        if local:  # the servers' optimizer is the outer one
            optimizer_args = self.outer_optimizer_args(config.mode)
        server = ServerConfig(
            mode=config.mode.mode, staleness_bound=config.mode.bound,
            backup_workers=config.mode.backups, expected_workers=config.workers,
            policy=config.policy.name, policy_args=dict(config.policy.args),
            optimizer=(config.mode.outer or "sgd") if local else self.optimizer,
            optimizer_args=optimizer_args,
            lr_scaling=step.lr_scaling, warmup_steps=step.warmup_steps,
            momentum_target=step.momentum_target, replicas=config.replicas,
            pull_compression=split_compression(config.compression)[1],
        )
        worker = WorkerConfig(
            servers=[], task=self.task, task_args=dict(self.task_args),
            device=self.device, steps=self.worker_steps(config.workers),
            budget_seconds=float(self.budget_seconds), batch_size=self.batch_size, seed=seed,
            eval_every=self.eval_every, straggler=scenario.all,
            local_optimizer=self.local_optimizer if local else None,
            local_args=dict(self.local_args) if local else {},
            sync_every=config.mode.sync_every or 1,
            evaluator=self.evaluator_of(config),
            compression=split_compression(config.compression)[0],
        )
        return ClusterSpec(num_servers=self.servers, num_workers=config.workers, server=server,
                           worker=worker, stragglers=scenario.stragglers(config.workers),
                           run_timeout=self.run_timeout, command=self.command,
                           cell=f"{config.id}/seed{seed}" if self.command else None,
                           hosts=self.hosts, link=self.link, link_of=dict(self.link_of))

    def host_plan(self) -> HostPlan | None:
        """The emulated hosts every run runs on (None: loopback)."""
        return None if self.hosts is None else HostPlan.parse(self.hosts, self.link,
                                                              self.link_of)

    def step_settings(self, mode: ModeChoice) -> StepSettings:
        """The step-size rules ``mode`` runs with: its own, else the spec's."""
        given = (self.outer_args if mode.sync_every is not None else self.optimizer_args
                 ).get("momentum", 0.0)  # a number: build_optimizer checked
        momentum = mode.momentum if mode.momentum is not None \
            else float(given) if isinstance(given, int | float) else 0.0
        return StepSettings(
            lr_scaling=mode.lr_scaling or self.lr_scaling,
            warmup_steps=mode.warmup if mode.warmup is not None else self.warmup_steps,
            momentum_target=mode.momentum_target if mode.momentum_target is not None
            else self.momentum_target,
            momentum=momentum)

    def entry(self, config: Configuration) -> ConfigEntry:
        """``config``'s entry in experiment.json, with the step-size rules it runs with."""
        mode, step = config.mode, self.step_settings(config.mode)
        return ConfigEntry(
            id=config.id, scenario=config.scenario, label=config.label, mode=mode.mode,
            bound=mode.bound, mode_spec=str(mode), backups=mode.backups,
            policy=config.policy.name, policy_args=dict(config.policy.args),
            workers=config.workers, lr_scaling=step.lr_scaling,
            warmup_steps=step.warmup_steps, momentum_target=step.momentum_target,
            momentum=step.momentum, sync_every=mode.sync_every,
            outer=(mode.outer or "sgd") if mode.sync_every is not None else None,
            replicas=config.replicas, compression=config.compression)

    def to_toml_dict(self) -> JSONObject:
        """The spec as the TOML document dump_spec writes (None values left out there)."""
        used = {k: v for k, v in self.custom_scenarios.items() if k in self.scenarios}
        data: JSONObject = {
            "name": self.name, "task": self.task, "steps": self.steps,
            "batch_size": self.batch_size, "seeds": list(self.seeds), "num_servers": self.servers,
            "workers": list(self.workers), "modes": [str(m) for m in self.modes],
            "policies": [p.to_toml() for p in self.policies], "scenarios": list(self.scenarios),
            "optimizer": self.optimizer, "target_loss": self.target_loss,
            "eval_every": self.eval_every, "min_step_time": self.min_step_time,
            "device": self.device, "run_timeout": self.run_timeout or 0,
            "task_args": dict(self.task_args), "optimizer_args": dict(self.optimizer_args),
            "custom_scenarios": {k: _scenario_table(v) for k, v in used.items()},
            "lr_scaling": self.lr_scaling, "warmup_steps": self.warmup_steps,
            "momentum_target": self.momentum_target,
            "budget_seconds": self.budget_seconds, "budget_gradients": self.budget_gradients,
            "local_optimizer": self.local_optimizer, "local_args": dict(self.local_args),
            "outer_args": dict(self.outer_args),
            "evaluator": self.evaluator, "replicas": list(self.replicas),
            "compressions": list(self.compressions),
            "hosts": self.hosts, "link": self.link,
            "link_of": {str(k): v for k, v in sorted(self.link_of.items())},
        }
        if self.command:  # the built-in loop's keys are not part of a command's grid
            for key in NOT_FOR_COMMANDS:
                data.pop(key, None)
            data["command"] = list(self.command)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExperimentSpec:
        data = _renamed_keys(data)
        unknown = set(data) - set(_SPEC_KEYS)
        if unknown:
            raise ConfigError(f"unknown experiment key(s) {sorted(unknown)}; "
                              f"allowed: {', '.join(_SPEC_KEYS)}")
        values = dict(data)
        if "num_servers" in values:  # the field keeps its old name in the Python API
            values["servers"] = values.pop("num_servers")
        try:
            return cls(**values)
        except TypeError as exc:
            raise ConfigError(f"invalid experiment spec: {exc}") from exc


#: spec keys renamed (old -> new); the old name is read, with a warning, for one release
RENAMED_KEYS = {"servers": "num_servers"}


def _renamed_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    """``servers = 2`` -> ``num_servers = 2``, warning once per key; both is an error."""
    out = dict(data)
    for old, new in RENAMED_KEYS.items():
        if old not in out:
            continue
        if new in out:
            raise ConfigError(f"give the spec key {new!r}, not both {new!r} and {old!r} "
                              f"(its old name)")
        log.warning("spec key %r is deprecated (it is read for one more release); "
                    "call it %r", old, new)
        out[new] = out.pop(old)
    return out


def _scenario_table(s: Scenario) -> JSONObject:
    base: JSONObject = dataclasses.asdict(s.all)
    return {"description": s.description, "all": base,
            "ranks": {str(r): {k: v for k, v in dataclasses.asdict(o).items() if base[k] != v}
                      for r, o in s.ranks}}


def _as_list(value: Any, what: str) -> list[Any]:
    items = [value] if isinstance(value, str | int | Mapping) else value
    if not isinstance(items, Sequence) or isinstance(items, str) or not items:
        raise ConfigError(f"{what} must be a non-empty list, got {value!r}")
    return list(items)


def _int(value: Any, what: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{what} must be an int >= {low}, got {value!r}")
    return value


#: named specs, as the partial TOML documents from_dict reads; ``demo`` is ``make demo``,
#: ``literature`` checks the published claims
PRESETS: dict[str, JSONObject] = {
    "demo": {"name": "demo"},
    # lr 0.05: the claim on updates to target is about small lr x staleness (see the docs)
    "literature": {"name": "literature", "modes": ["sync", "ssp:1", "ssp:3", "async"],
                   "scenarios": ["none", "transient"], "steps": 420, "eval_every": 2,
                   "optimizer_args": {"lr": 0.05}},
    "scenarios": {"name": "scenarios", "scenarios": list(SCENARIOS)},
    # Goyal et al. 2017: sync is one step on an N-times larger batch; at the one-worker
    # lr it falls behind, with linear scaling and warmup it keeps up (gradients to target)
    "large-batch": {"name": "large-batch", "scenarios": ["persistent"], "steps": 150,
                    "num_servers": 1, "modes": ["sync", "sync:lr=linear,warmup=10", "ssp:3",
                                            "async"]},
    # Mitliagkas et al. 2016: asynchrony begets momentum; at 32 async workers plain momentum
    # 0.9 diverges, momentum compensated for the observed staleness does not
    "momentum": {"name": "momentum", "scenarios": ["jitter"], "steps": 60, "num_servers": 1,
                 "workers": [1, 8, 32], "seeds": [0, 1], "eval_every": 5,
                 "optimizer_args": {"lr": 0.05},
                 "modes": ["async:momentum=0.9", "async:momentum=0.9,target=0.9",
                           "async:momentum=0"],
                 "custom_scenarios": {"jitter": {
                     "description": "every step gets an exponential extra delay of mean 5 ms, "
                                    "so workers drift apart as real ones do",
                     "all": {"delay": "exp:0.005"}}}},
    # local SGD at equal gradients computed (steps): sync SGD (a push a step) against
    # DiLoCo (Douillard et al. 2023: AdamW inner, Nesterov outer) at H = 8, 32, 128, and
    # asynchronous local SGD, plain and with delayed Nesterov (Liu et al. 2024)
    "local-sgd": {"name": "local-sgd", "scenarios": ["none", "persistent"], "steps": 256,
                  "seeds": [0], "num_servers": 1, "eval_every": 2, "min_step_time": 0.005,
                  "modes": ["sync", "sync:h=8", "sync:h=32", "sync:h=128", "async:h=32",
                            "async:h=32,outer=delayed-nesterov"]},
    # compressed pushes (paramserver/compress), each biased one with and without error
    # feedback, sync and async: held-out loss against bytes pushed and pulled
    "compression": {"name": "compression", "scenarios": ["none"], "steps": 300, "seeds": [0],
                    "workers": [2], "num_servers": 1, "eval_every": 10,
                    "optimizer_args": {"lr": 0.2}, "modes": ["sync", "async"],
                    "compressions": ["none", "bf16", "int8", "int8:ef=0", "topk:ratio=0.01",
                                     "topk:ratio=0.01,ef=0", "sign", "sign:ef=0"]},
    # embedding tables on the shards (ShardedEmbedding): sync, SSP and async on the recsys
    # task's Zipfian interactions; sizes up to 10M rows with --task-arg users=... items=...
    "recsys": {"name": "recsys", "task": "recsys", "steps": 60, "seeds": [0], "workers": [3],
               "scenarios": ["none"], "optimizer": "adagrad", "optimizer_args": {"lr": 0.1},
               "modes": ["sync", "ssp:2", "async"], "eval_every": 5, "target_loss": 0.55},
}


def preset(name: str, **overrides: Any) -> ExperimentSpec:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return ExperimentSpec.from_dict({**PRESETS[name], **overrides})


# --------------------------------------------------------------------------- TOML


def load_spec(path: str | os.PathLike[str], **overrides: Any) -> ExperimentSpec:
    """Read a TOML spec (see docs/experiments.md); ``overrides`` replace its keys."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read spec {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"spec {path} is not valid TOML: {exc}") from exc
    return ExperimentSpec.from_dict({**data, **overrides})


def _without_none(value: Any) -> Any:
    """TOML has no null: a None value leaves its key out (and its table entry)."""
    if isinstance(value, Mapping):
        return {str(k): _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_without_none(v) for v in value]
    return value


def dump_spec(spec: ExperimentSpec) -> str:
    """The resolved spec as TOML that :func:`load_spec` reads back to an equal spec."""
    try:
        body = tomli_w.dumps(_without_none(spec.to_toml_dict()))
    except TypeError as exc:
        raise ConfigError(f"cannot write the spec to TOML: {exc}") from exc
    return "# resolved experiment spec: paramserver experiment --spec THIS_FILE reruns it\n" + body


def _compression(value: Any) -> str:
    """A grid's compression spec, checked (paramserver/compress: a name, its arguments;
    ``PUSH/PULL`` compresses the pulls too)."""
    if not isinstance(value, str):
        raise ConfigError(f"compressions lists NAME[:key=value,...] strings, got {value!r}")
    from paramserver.compress import parse_compression
    from paramserver.server.config import pull_compression

    push, pull = split_compression(value)
    if push is not None:
        parse_compression(push)
    pull_compression(pull)
    return value.strip()


def split_compression(value: str) -> tuple[str | None, str | None]:
    """A grid's ``PUSH[/PULL]`` compression as (the workers' ``--compression``, the
    shards' ``--pull-compression``), None where it is ``none`` or not given."""
    push, _, pull = (p.strip() for p in value.partition("/"))
    return (None if push in ("", "none") else push), (None if pull in ("", "none") else pull)
