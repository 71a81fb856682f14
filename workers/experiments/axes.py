"""The axes of an experiment's grid: consistency modes (:class:`ModeChoice`),
staleness policies (:class:`PolicyChoice`) and straggler scenarios
(:class:`Scenario`, the built-in ones in :data:`SCENARIOS`). Each validates what
it is given on construction; :mod:`paramserver.workers.experiments.spec` combines
them into a grid.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from paramserver.core.stepsize import LrRule
from paramserver.errors import ConfigError
from paramserver.policies import create_policy, parse_policy_args
from paramserver.workers.experiments.index import ScenarioEntry, check_name
from paramserver.workers.stragglers import StragglerSpec

__all__ = ["SCENARIOS", "ModeChoice", "PolicyChoice", "Scenario", "builtin_scenario", "slug"]

#: built-in straggler scenarios; each also applies the spec's ``min_step_time`` to every worker
SCENARIOS: dict[str, str] = {
    "none": "no stragglers: every step takes the emulated compute time",
    "persistent": "worker 0 is persistently 4x slower than the others",
    "transient": "every step of every worker is 5x slower with probability 10%",
    "heavy-tail": "every step gets an extra Pareto(alpha=1.5) delay: usually small, sometimes huge",
}
_STRAGGLER_FIELDS = {f.name for f in dataclasses.fields(StragglerSpec)}


# --------------------------------------------------------------------------- grid axes


@dataclass(frozen=True)
class ModeChoice:
    """A consistency mode: ``sync``, ``sync:b=B`` (B backup workers), ``async`` or ``ssp:S``
    (S = staleness bound), optionally with step-size settings of its own that override
    the spec's: ``lr=none|linear|sqrt`` (learning-rate scaling), ``warmup=N``,
    ``momentum=MU`` (the optimizer's momentum) and ``target=MU`` (asynchrony-aware
    momentum), e.g. ``sync:lr=linear,warmup=20`` or ``async:momentum=0.9,target=0.9``.

    ``h=H`` makes it local SGD: every worker takes H steps of the spec's
    ``local_optimizer`` and pushes the weights' change, which the servers apply with
    the outer optimizer ``outer=NAME`` (default ``sgd``) and the spec's
    ``outer_args``: ``sync:h=32`` is DiLoCo, ``async:h=32,outer=delayed-nesterov``
    asynchronous local SGD with Liu et al.'s delayed Nesterov."""

    mode: str
    bound: int = 0
    backups: int = 0  # sync: a round closes without the slowest `backups` workers
    lr_scaling: str | None = None  # None: the spec's
    warmup: int | None = None
    momentum: float | None = None
    momentum_target: float | None = None
    sync_every: int | None = None  # local SGD: H inner steps per push; None: a push a step
    outer: str | None = None  # local SGD's outer (server) optimizer; None: sgd

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "async", "ssp"):
            raise ConfigError(f"mode must be sync, async or ssp:S; got {self.mode!r}")
        if isinstance(self.bound, bool) or not isinstance(self.bound, int) or self.bound < 0:
            raise ConfigError(f"the ssp staleness bound must be an int >= 0, got {self.bound!r}")
        if self.mode != "ssp" and self.bound:
            raise ConfigError(f"only ssp takes a staleness bound; got {self.mode}:{self.bound}")
        if isinstance(self.backups, bool) or not isinstance(self.backups, int) \
                or self.backups < 0 or (self.backups and self.mode != "sync"):
            raise ConfigError(f"backup workers (sync:b=B) need sync and an int B >= 0; "
                              f"got {self.mode} with {self.backups!r}")
        LrRule(self.lr_scaling or "none", self.warmup or 0)  # says what is wrong
        if self.sync_every is not None and (isinstance(self.sync_every, bool) or not isinstance(
                self.sync_every, int) or self.sync_every < 1):
            raise ConfigError(f"mode {self.mode}: h (local steps per push) must be an int "
                              f">= 1, got {self.sync_every!r}")
        if self.outer is not None and self.sync_every is None:
            raise ConfigError(f"mode {self.mode}: outer={self.outer} is local SGD's outer "
                              "optimizer: give h=H too")
        for what, mu in (("momentum", self.momentum), ("target", self.momentum_target)):
            if mu is not None and not 0.0 <= mu < 1.0:
                raise ConfigError(f"mode {self.mode}: {what} must be in [0, 1), got {mu}")

    @classmethod
    def parse(cls, text: str | ModeChoice) -> ModeChoice:
        """``"sync"``, ``"sync:b=1"``, ``"async"``, ``"ssp:3"`` or ``"ssp:s=3"``, each
        optionally with ``lr=``, ``warmup=``, ``momentum=``, ``target=`` (comma-separated)."""
        if isinstance(text, ModeChoice):
            return text
        if not isinstance(text, str):
            raise ConfigError(f"a mode must be a string like sync, async or ssp:3; got {text!r}")
        name, sep, arg = text.strip().lower().partition(":")
        if sep and not arg.strip():
            raise ConfigError(f"mode {text!r}: nothing after ':'")
        kwargs: dict[str, Any] = {}
        for i, item in enumerate(a.strip() for a in arg.split(",") if sep):
            key, eq, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not eq and i == 0 and name == "ssp":
                key, value = "s", key
            try:
                if key == "s" and name == "ssp" and value.isdigit():
                    kwargs["bound"] = int(value)
                elif key == "b" and name == "sync" and value.isdigit():
                    kwargs["backups"] = int(value)
                elif key == "lr":
                    kwargs["lr_scaling"] = value
                elif key == "warmup" and value.isdigit():
                    kwargs["warmup"] = int(value)
                elif key in ("momentum", "target"):
                    kwargs["momentum" if key == "momentum" else "momentum_target"] = float(value)
                elif key == "h" and value.isdigit():
                    kwargs["sync_every"] = int(value)
                elif key == "outer" and value:
                    kwargs["outer"] = value
                else:
                    raise ValueError(item)
            except ValueError:
                what = ("ssp's staleness bound and sync's backup workers must be a count"
                        if key in ("b", "s") and name in ("sync", "ssp")
                        else "only ssp:S and sync:b=B take a number")
                raise ConfigError(
                    f"mode {text!r}: cannot read {item!r}: {what} (ssp:3, sync:b=1); any "
                    "mode takes lr=none|linear|sqrt, warmup=N, momentum=MU, target=MU, "
                    "h=H, outer=NAME"
                ) from None
        if name == "ssp" and "bound" not in kwargs:
            raise ConfigError(f"mode {text!r}: ssp needs its staleness bound, e.g. ssp:3")
        return cls(name, **kwargs)

    def _extras(self) -> list[tuple[str, Any]]:
        return [(k, v) for k, v in (("h", self.sync_every), ("outer", self.outer),
                                    ("lr", self.lr_scaling), ("warmup", self.warmup),
                                    ("momentum", self.momentum),
                                    ("target", self.momentum_target)) if v is not None]

    def __str__(self) -> str:
        if self.backups:
            base = f"sync:b={self.backups}"
        else:
            base = f"ssp:{self.bound}" if self.mode == "ssp" else self.mode
        extras = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in self._extras())
        return base + ((":" if ":" not in base else ",") + extras if extras else "")

    @property
    def label(self) -> str:
        if self.backups:
            base = f"sync b={self.backups}"
        else:
            base = f"ssp s={self.bound}" if self.mode == "ssp" else self.mode
        words = {"h": "H={}", "outer": "outer {}", "lr": "lr {}", "warmup": "warmup {}",
                 "momentum": "momentum {:g}", "target": "target momentum {:g}"}
        extras = [words[k].format(v) for k, v in self._extras()]
        return base + (f" ({', '.join(extras)})" if extras else "")

    @property
    def slug(self) -> str:
        if self.backups:
            base = f"sync-b{self.backups}"
        else:
            base = f"ssp{self.bound}" if self.mode == "ssp" else self.mode
        return slug(base + "".join(f"-{k}{v:g}" if isinstance(v, float) else f"-{k}{v}"
                                    for k, v in self._extras()))

    @property
    def rank(self) -> float:
        """Order by how much staleness is allowed: sync < ssp:0 < ssp:1 < ... < async."""
        return {"sync": -1.0, "async": math.inf}.get(self.mode, float(self.bound))


@dataclass(frozen=True)
class PolicyChoice:
    """A staleness policy with its arguments; validated by building it once."""

    name: str = "none"
    args: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"a policy needs a name, got {self.name!r}")
        create_policy(self.name, dict(self.args))  # unknown name or bad args: say so now

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | PolicyChoice) -> PolicyChoice:
        """``"none"``, ``"reject:max_staleness=4"``, ``"mypkg.policies:MyPolicy:factor=0.5"``
        or a table ``{name = "...", args = {...}}``."""
        if isinstance(value, PolicyChoice):
            return value
        if isinstance(value, Mapping):
            extra = set(value) - {"name", "args"}
            if extra or "name" not in value:
                raise ConfigError(f"a policy table has keys name and args; got {dict(value)}")
            args = value.get("args", {})
            if not isinstance(args, Mapping):
                raise ConfigError(f"policy args must be a table, got {args!r}")
            return cls(str(value["name"]), tuple(sorted(args.items())))
        if not isinstance(value, str):
            raise ConfigError(f"a policy must be NAME[:key=value,...]; got {value!r}")
        head, sep, tail = value.strip().rpartition(":")
        if sep and "=" in tail:  # the last ':'-part holds the arguments
            args = parse_policy_args([a for a in tail.split(",") if a.strip()])
            return cls(head, tuple(sorted(args.items())))
        return cls(value.strip())

    def __str__(self) -> str:
        if not self.args:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in self.args)

    @property
    def label(self) -> str:
        short = self.name.rpartition(":")[2] if ":" in self.name else self.name
        if not self.args:
            return short
        return f"{short}({', '.join(f'{k}={v}' for k, v in self.args)})"

    @property
    def slug(self) -> str:
        return slug(self.label)

    def to_toml(self) -> dict[str, Any]:
        return {"name": self.name, "args": dict(self.args)}


def slug(text: str) -> str:
    """``text`` as a folder-name part: lower case, runs of other characters as one -."""
    keep = "".join(c if c.isalnum() or c in "._" else "-" for c in text.lower())
    return "-".join(part for part in keep.split("-") if part)


@dataclass(frozen=True)
class Scenario:
    """Stragglers for every worker (``all``) with per-rank overrides (``ranks``)."""

    name: str
    description: str = ""
    all: StragglerSpec = field(default_factory=StragglerSpec)
    ranks: tuple[tuple[int, StragglerSpec], ...] = ()

    def __post_init__(self) -> None:  # it names folders and image files
        check_name(self.name, "scenario")

    def stragglers(self, num_workers: int) -> dict[int, StragglerSpec]:
        return {r: spec for r, spec in self.ranks if r < num_workers}

    def entry(self) -> ScenarioEntry:
        """This scenario's entry in experiment.json."""
        return ScenarioEntry(self.description, self.all, {str(r): s for r, s in self.ranks})

    @classmethod
    def from_table(cls, name: str, table: Mapping[str, Any], min_step_time: float) -> Scenario:
        """A ``[custom_scenarios.NAME]`` table: ``description``, ``all`` and ``ranks``."""
        extra = set(table) - {"description", "all", "ranks"}
        if extra:
            raise ConfigError(f"scenario {name!r}: unknown key(s) {sorted(extra)}; "
                              "allowed: description, all, ranks")
        base = {"min_step_time": min_step_time, **_straggler_fields(name, table.get("all", {}))}
        ranks = []
        for key, override in dict(table.get("ranks", {})).items():
            if not str(key).isdigit():
                raise ConfigError(f"scenario {name!r}: ranks keys are worker ranks, got {key!r}")
            ranks.append((int(key), StragglerSpec(**{**base,
                                                     **_straggler_fields(name, override)})))
        return cls(name, str(table.get("description", "")), StragglerSpec(**base),
                   tuple(sorted(ranks)))


def _straggler_fields(scenario: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"scenario {scenario!r}: straggler settings must be a table")
    unknown = set(value) - _STRAGGLER_FIELDS
    if unknown:
        raise ConfigError(f"scenario {scenario!r}: unknown straggler field(s) {sorted(unknown)};"
                          f" allowed: {', '.join(sorted(_STRAGGLER_FIELDS))}")
    return dict(value)


def builtin_scenario(name: str, min_step_time: float) -> Scenario:
    """One of :data:`SCENARIOS`, with every step taking at least ``min_step_time`` seconds."""
    m = min_step_time
    base = StragglerSpec(min_step_time=m)
    if name == "none":
        return Scenario(name, SCENARIOS[name], base)
    if name == "persistent":
        return Scenario(name, SCENARIOS[name], base,
                        ((0, StragglerSpec(min_step_time=m, slowdown=4.0)),))
    if name == "transient":
        return Scenario(name, SCENARIOS[name],
                        StragglerSpec(min_step_time=m, slow_prob=0.1, slow_factor=5.0))
    if name == "heavy-tail":
        # type I Pareto, alpha 1.5 (infinite variance), scale m/4: mean 0.75 m, p99 ~5 m
        scale = max(m, 0.004) / 4
        return Scenario(name, SCENARIOS[name],
                        StragglerSpec(min_step_time=m, delay=f"pareto:1.5,{scale:.6g}"))
    raise ConfigError(f"unknown scenario {name!r}; built-in: {', '.join(SCENARIOS)} "
                      "(or define it under [custom_scenarios.NAME] in the spec)")
