"""``paramserver plan``: what-if predictions from the simulator, calibrated on real runs.

:func:`make_plan` fits the simulator's model of time from the runs
(:mod:`.planfit`), then, for each requested mode, simulates the target
configuration (workers, NIC rates, stragglers) several times: draw 0 with the fit
itself, each further draw with a bootstrap replicate of the fit and another seed
(the data order, the stragglers' draws, the compute times' resampling). The
held-out loss comes from the real task on the real shard core, so the time to the
target loss is read off the simulator's virtual clock as the report reads it off a
real run's (:func:`~paramserver.workers.experiments.report.run_metrics`). A range
over the draws is the prediction; the same model predicts the fitted runs
themselves, against what they measured: the in-sample error.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import statistics
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paramserver.errors import ConfigError
from paramserver.server.config import ServerConfig
from paramserver.workers.config import WorkerConfig
from paramserver.workers.experiments.axes import ModeChoice
from paramserver.workers.experiments.planfit import (
    FAMILIES,
    Fit,
    RunRecord,
    family,
    fit_runs,
    mean_wire,
    read_run,
    run_family,
)
from paramserver.workers.experiments.report import load_run, run_metrics
from paramserver.workers.launch.clusterspec import ClusterSpec
from paramserver.workers.launch.hostplan import DEFAULT_LINK
from paramserver.workers.launch.netcluster import parse_rate
from paramserver.workers.stragglerspec import StragglerSpec

__all__ = ["ModePlan", "Overhead", "Plan", "Prediction", "Range", "Target", "calibrate",
           "configure_modes", "estimate_round", "make_plan", "parse_plan_mode", "spec_of_run"]

#: DiLoCo's settings, as the experiment grid's defaults (Douillard et al.): AdamW inside,
#: Nesterov momentum outside
DILOCO_LOCAL = ("adamw", {"lr": 0.001})
DILOCO_OUTER = ("sgd", {"lr": 0.7, "momentum": 0.9, "nesterov": True})
#: the range printed: these percentiles over the draws
LOW, HIGH = 0.1, 0.9
#: evaluations every this many of the evaluator's steps where the run had none
DEFAULT_EVAL_EVERY = 5
#: rounds timed by :func:`estimate_round` (after one to warm up)
ESTIMATE_ROUNDS = 20


def spec_family(spec: ClusterSpec) -> str:
    """The family of modes (planfit.family) ``spec`` runs."""
    return family(spec.server.mode, spec.worker.local_optimizer is not None)


def estimate_round(spec: ClusterSpec, rounds: int = ESTIMATE_ROUNDS) -> list[float]:
    """What one local-SGD push of ``spec`` costs a worker besides its H steps, timed
    here, in this process, on the task's own model: the copy of the weights the round
    starts from, H steps of the inner optimizer, the pseudo-gradient. Seconds: the
    median over ``rounds`` timed (the machine's stalls are in the fitted overhead
    already). (The outer step is the shard's: in its service time.)"""
    import time

    import torch

    from paramserver.core.optim import build_optimizer
    from paramserver.workers.worker import build_task

    w = spec.worker
    assert w.local_optimizer is not None
    model = build_task(w).model
    params = dict(model.named_parameters())
    inner = build_optimizer(w.local_optimizer, model.parameters(), w.local_args)
    gen = torch.Generator().manual_seed(w.seed)
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    times = []
    with torch.no_grad():
        for i in range(rounds + 1):
            start = time.perf_counter()
            anchor = {n: p.detach().clone() for n, p in params.items()}
            for _ in range(w.sync_every):
                inner.step()
            pseudo = {n: anchor[n] - p for n, p in params.items()}
            took = time.perf_counter() - start
            del pseudo
            if i:  # the first: allocation, the optimizer's state
                times.append(took)
    return [statistics.median(times)]


@dataclass(frozen=True)
class Overhead:
    """A local-SGD mode's cost per push besides its steps, and where it came from."""

    seconds: list[float]
    fitted: bool  # from fitted local-SGD runs' pushes; False: estimated in-process

    def to_json(self) -> dict[str, Any]:
        return {"mean_ms": statistics.fmean(self.seconds) * 1e3 if self.seconds else 0.0,
                "source": "fitted" if self.fitted else "estimated in-process"}


@dataclass(frozen=True)
class ModePlan:
    """A mode as the planner runs it: ``sync``, ``async``, ``ssp:S``, ``local:H``
    (synchronous local SGD: H plain steps, the change averaged) or ``diloco:H``."""

    text: str
    mode: str
    bound: int = 0
    sync_every: int | None = None
    local: tuple[str, dict[str, Any]] | None = None  # None: the run's optimizer
    outer: tuple[str, dict[str, Any]] | None = None  # None: plain averaging (sgd, lr 1)


def parse_plan_mode(text: str) -> ModePlan:
    """One ``--mode`` value; a one-line ConfigError for anything else."""
    name, _, arg = text.strip().lower().partition(":")
    if name in ("local", "diloco"):
        if not arg.isdigit() or int(arg) < 1:
            raise ConfigError(f"--mode {text!r}: {name} takes H, the local steps per push "
                              f"(e.g. {name}:4)")
        h = int(arg)
        if name == "local":
            return ModePlan(text, "sync", sync_every=h)
        return ModePlan(text, "sync", sync_every=h, local=DILOCO_LOCAL, outer=DILOCO_OUTER)
    choice = ModeChoice.parse(text)  # sync, async, ssp:S (and its own one-line errors)
    if choice.sync_every is not None or choice.backups or choice.lr_scaling or choice.warmup \
            or choice.momentum is not None or choice.momentum_target is not None:
        raise ConfigError(f"--mode {text!r}: the planner takes sync, async, ssp:S, local:H "
                          "and diloco:H")
    return ModePlan(text, choice.mode, bound=choice.bound)


def spec_of_run(run: RunRecord) -> ClusterSpec:
    """The ClusterSpec a run recorded in its result.json, rebuilt."""
    data = run.spec
    try:
        server = ServerConfig.from_dict(data["server"])
        worker = WorkerConfig.from_dict(data["worker"])
        stragglers = {int(r): StragglerSpec(**s) for r, s in (data.get("stragglers") or {}).items()}
        return ClusterSpec(num_servers=int(data["num_servers"]),
                           num_workers=int(data["num_workers"]), server=server, worker=worker,
                           stragglers=stragglers)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"--from {run.path}: its result.json spec cannot be read back "
                          f"({exc})") from exc


@dataclass(frozen=True)
class Target:
    """The configuration to predict: ``None`` keeps the fitted run's."""

    workers: int | None = None
    link: str | None = None  # every NIC's rate
    link_of: Mapping[int, str] = field(default_factory=dict)  # host -> its NIC's rate
    #: rank -> straggler fields (``slowdown``, ``delay``...) on top of the run's scenario
    stragglers: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    steps: int | None = None
    compression: str | None = None  # the pushes' compressor ("none": off)

    def per_byte(self) -> tuple[float | None, dict[int, float]]:
        every = 8.0 / parse_rate(self.link) if self.link else None
        return every, {h: 8.0 / parse_rate(r) for h, r in self.link_of.items()}


def configure(base: ClusterSpec, mode: ModePlan, target: Target) -> ClusterSpec:
    """``base`` changed to run ``mode`` on ``target``, with held-out evaluations."""
    n = target.workers or base.num_workers
    w = base.worker
    server = dataclasses.replace(base.server, mode=mode.mode, staleness_bound=mode.bound,
                                 expected_workers=n)
    local: tuple[str | None, dict[str, Any]] = (None, {})
    if mode.sync_every is not None:  # local SGD: the steps cap counts gradients
        local = mode.local or (base.server.optimizer, dict(base.server.optimizer_args))
        outer = mode.outer or ("sgd", {"lr": 1.0})
        server = dataclasses.replace(server, optimizer=outer[0], optimizer_args=dict(outer[1]))
    worker = dataclasses.replace(
        w, steps=target.steps or w.steps, eval_every=w.eval_every or DEFAULT_EVAL_EVERY,
        sync_every=mode.sync_every or 1, local_optimizer=local[0], local_args=dict(local[1]),
        compression=w.compression if target.compression is None
        else None if target.compression == "none" else target.compression)
    stragglers = dict(base.stragglers if target.workers is None else {})
    for rank, fields in target.stragglers.items():
        scenario = dataclasses.asdict(stragglers.get(rank, w.straggler))
        stragglers[rank] = StragglerSpec(**{**scenario, **fields})
    if any(r >= n for r in stragglers):
        raise ConfigError(f"a straggler names worker {max(stragglers)}, but there are {n} "
                          "workers (ranks 0 .. N-1)")
    return dataclasses.replace(base, num_workers=n, worker=worker, server=server,
                               stragglers=stragglers)


@dataclass(frozen=True)
class Range:
    """A prediction over the draws: the median and the LOW..HIGH percentiles."""

    low: float
    mid: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Range | None:
        if not values:
            return None
        s = sorted(values)

        def at(q: float) -> float:  # linear interpolation between order statistics
            x = q * (len(s) - 1)
            i = int(x)
            return s[i] if i + 1 >= len(s) else s[i] + (x - i) * (s[i + 1] - s[i])
        return cls(at(LOW), statistics.median(s), at(HIGH))

    def to_json(self) -> dict[str, float]:
        return {"low": self.low, "mid": self.mid, "high": self.high}


@dataclass(frozen=True)
class Prediction:
    """One configuration's draws: time to target (None: not reached) and bytes moved
    by every worker until then."""

    times: list[float | None]
    bytes: list[float | None]
    #: per draw, the mean time a pull was held at the barrier or SSP gate, per push
    waits: list[float] = field(default_factory=list)

    @property
    def reached(self) -> int:
        return sum(t is not None for t in self.times)

    @property
    def time(self) -> Range | None:
        return Range.of([t for t in self.times if t is not None])

    @property
    def traffic(self) -> Range | None:
        return Range.of([b for b in self.bytes if b is not None])

    def to_json(self) -> dict[str, Any]:
        time, traffic = self.time, self.traffic
        return {"draws": len(self.times), "reached": self.reached,
                "time_to_target_s": time.to_json() if time else None,
                "bytes_to_target": traffic.to_json() if traffic else None,
                "wait_ms_per_push": statistics.median(self.waits) * 1e3 if self.waits
                else None,
                "times": self.times}


@dataclass(frozen=True)
class Check:
    """A fitted run predicted by the fit: the in-sample error."""

    run: str
    mode: str
    workers: int
    measured: float | None  # None: the run never reached the target (or never evaluated)
    predicted: Prediction
    wait: float = 0.0  # the run's mean time held at a barrier or gate, per push

    @property
    def error(self) -> float | None:
        time = self.predicted.time
        if self.measured is None or time is None or self.measured <= 0:
            return None
        return (time.mid - self.measured) / self.measured

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "mode": self.mode, "workers": self.workers,
                "measured_s": self.measured, "error": self.error,
                "measured_wait_ms_per_push": self.wait * 1e3,
                **self.predicted.to_json()}


@dataclass(frozen=True)
class Plan:
    fit: Fit
    target_loss: float
    workers: int
    predictions: dict[str, Prediction]  # mode text -> its prediction
    checks: list[Check]
    #: local-SGD mode text -> its round's own cost (fitted or estimated)
    overheads: dict[str, Overhead] = field(default_factory=dict)

    def ranking(self) -> list[str]:
        """Modes fastest first by the median predicted time; those that never reach the
        target last."""
        def key(mode: str) -> tuple[int, float]:
            t = self.predictions[mode].time
            return (0, t.mid) if t is not None else (1, 0.0)
        return sorted(self.predictions, key=key)

    def ties(self) -> list[tuple[str, str]]:
        """Neighbours in the ranking whose predicted ranges overlap: too close to call."""
        ranked = [m for m in self.ranking() if self.predictions[m].time is not None]
        out = []
        for a, b in itertools.pairwise(ranked):
            ta, tb = self.predictions[a].time, self.predictions[b].time
            assert ta is not None and tb is not None
            if ta.high >= tb.low:
                out.append((a, b))
        return out

    def to_json(self) -> dict[str, Any]:
        return {"target_loss": self.target_loss, "workers": self.workers,
                "fit": self.fit.summary(),
                "modes": {m: p.to_json() for m, p in self.predictions.items()},
                "ranking": self.ranking(), "ties": [list(t) for t in self.ties()],
                "local_round": {m: o.to_json() for m, o in self.overheads.items()},
                "fitted_runs": [c.to_json() for c in self.checks]}


def _mean_wait(run: RunRecord) -> float:
    """Mean seconds a pull was held at the barrier or the SSP gate, per push."""
    waits = [r.wait_s for rows in run.steps.values() for r in rows[1:]]
    return statistics.fmean(waits) if waits else 0.0


def _time_and_bytes(out: Path, seed: int, target_loss: float) -> tuple[float | None, float | None]:
    logs = load_run(out)
    metrics = run_metrics(logs, seed, target_loss)
    if metrics.time_to_target is None:
        return None, None
    t0 = max(logs.starts.values()) if logs.starts else 0.0
    moved = sum(s.bytes for steps in logs.steps.values() for s in steps
                if s.t - t0 <= metrics.time_to_target)
    return metrics.time_to_target, float(moved)


def _as_run(run: RunRecord) -> tuple[ClusterSpec, Target]:
    """The configuration a fitted run ran, and its links, as the planner runs them."""
    spec = spec_of_run(run)
    local = spec.worker.local_optimizer
    own = ModePlan(spec.server.mode, spec.server.mode, bound=spec.server.staleness_bound,
                   sync_every=spec.worker.sync_every if local else None,
                   local=(local, dict(spec.worker.local_args)) if local else None,
                   outer=(spec.server.optimizer, dict(spec.server.optimizer_args)))
    hosts = run.spec.get("hosts")
    links = Target(link=(run.spec.get("link") or DEFAULT_LINK) if hosts else None,
                   link_of={int(h): r for h, r in (run.spec.get("link_of") or {}).items()})
    return configure(spec, own, links), links


def _simulated_wire(fit: Fit, spec: ClusterSpec, links: Target,
                    round_extra: Sequence[float] | None = None) -> float:
    """The simulator's mean time on the wire per step, as a worker measures it (push,
    pull, their replies; not the time held at a barrier), on ``spec``."""
    from paramserver.workers.launch.virtual import SimSpec, run_simulation

    every, of = links.per_byte()
    with tempfile.TemporaryDirectory(prefix="paramserver-plan-") as tmp:
        run_simulation(spec, tmp, SimSpec(threads=1, progress_every=10**9),
                       timing=fit.timing(every, of, spec_family(spec), round_extra))
        steps = read_run(tmp).steps
    wire = [r.push_s + r.pull_s - r.wait_s for rows in steps.values() for r in rows[1:]]
    return statistics.fmean(wire)


def calibrate(fit: Fit, runs: Sequence[RunRecord], rounds: int = 3,
              tolerance: float = 0.02) -> Fit:
    """``fit`` with its per-step cost, per family of modes, moved until the simulator,
    on the fitted runs of that family, spends as long on the wire per step as they did
    (within ``tolerance``): the model's own structure (four messages, queueing at the
    shard, the NICs' buckets) is then not counted twice."""
    for fam in FAMILIES:
        configs = [(*_as_run(run), mean_wire(run)) for run in runs if run_family(run) == fam]
        if not configs:
            continue
        measured = statistics.fmean(m for _, _, m in configs)
        fit = dataclasses.replace(fit, calibration={**fit.calibration, fam: 0.0})
        for _ in range(rounds):
            simulated = statistics.fmean(_simulated_wire(fit, spec, links)
                                         for spec, links, _ in configs)
            gap = measured - simulated
            if abs(gap) <= tolerance * measured:
                break
            moved = max(-fit.link.per_step, fit.calibration[fam] + gap)
            fit = dataclasses.replace(fit, calibration={**fit.calibration, fam: moved})
    return fit


def predict(fit: Fit, spec: ClusterSpec, target: Target, target_loss: float, draws: int,
            on_draw: Callable[[], None] | None = None,
            overhead: Overhead | None = None) -> Prediction:
    """``draws`` simulations of ``spec``: the fit itself, then bootstrap replicates;
    a local-SGD push costs ``overhead`` (None: the fit's) besides its steps."""
    from paramserver.workers.launch.virtual import SimSpec, run_simulation

    every, of = target.per_byte()
    times: list[float | None] = []
    moved: list[float | None] = []
    waits: list[float] = []
    for i in range(draws):
        draw = fit if i == 0 else fit.resample(random.Random(i))
        timing = draw.timing(every, of, spec_family(spec),
                             None if overhead is None or overhead.fitted else overhead.seconds)
        seed = spec.worker.seed + i
        run = dataclasses.replace(spec, worker=dataclasses.replace(spec.worker, seed=seed))
        with tempfile.TemporaryDirectory(prefix="paramserver-plan-") as tmp:
            run_simulation(run, tmp, SimSpec(threads=1, progress_every=10**9), timing=timing)
            t, b = _time_and_bytes(Path(tmp), seed, target_loss)
            waits.append(_mean_wait(read_run(tmp)))
        times.append(t)
        moved.append(b)
        if on_draw is not None:
            on_draw()
    return Prediction(times, moved, waits)


def configure_modes(runs: Sequence[RunRecord], modes: Sequence[ModePlan], target: Target
                    ) -> dict[str, ClusterSpec]:
    """Each mode's configuration on ``target``, from the first run's: what is wrong with
    the request is said here, before anything runs."""
    if not runs:
        raise ConfigError("give at least one run to fit (--from RUN)")
    base = spec_of_run(runs[0])
    _resolve_names(base)
    return {m.text: configure(base, m, target) for m in modes}


def _resolve_names(spec: ClusterSpec) -> None:
    """The task and policy a run names, found (or refused: unknown, or a plug-in not
    trusted) before the progress bar starts."""
    from paramserver.policies import resolve_policy
    from paramserver.workers.launch.virtual import check_simulable

    check_simulable(spec)  # (builds the task)
    if spec.server.policy not in ("", "none"):
        resolve_policy(spec.server.policy)


def make_plan(runs: Sequence[RunRecord], modes: Sequence[ModePlan], target: Target,
              target_loss: float, draws: int = 5,
              on_draw: Callable[[], None] | None = None) -> Plan:
    """Fit, check the fit on the runs it came from, predict every mode on ``target``."""
    if not target_loss > 0:
        raise ConfigError(f"--target-loss must be > 0, got {target_loss}")
    if draws < 1:
        raise ConfigError(f"--draws must be >= 1, got {draws}")
    base = spec_of_run(runs[0])
    specs = configure_modes(runs, modes, target)  # (bad input: before any run)
    fit = calibrate(fit_runs(runs), runs)
    checks = []
    for run in runs:
        spec, links = _as_run(run)
        measured = run_metrics(load_run(run.path), spec.worker.seed, target_loss).time_to_target
        predicted = predict(fit, spec, links, target_loss, draws, on_draw)
        mode = spec.server.mode + (f":{spec.server.staleness_bound}"
                                   if spec.server.mode == "ssp" else "")
        checks.append(Check(str(run.path), mode, spec.num_workers, measured, predicted,
                            _mean_wait(run)))
    overheads = {text: Overhead(fit.round_extra, True) if "local" in fit.families
                 else Overhead(estimate_round(spec), False)
                 for text, spec in specs.items() if spec_family(spec) == "local"}
    predictions = {text: predict(fit, spec, target, target_loss, draws, on_draw,
                                 overheads.get(text))
                   for text, spec in specs.items()}
    if not any(p.reached for p in predictions.values()):
        steps = target.steps or base.worker.steps
        raise ConfigError(f"no mode reaches the target loss {target_loss:g} within {steps} "
                          "steps per worker in any draw: raise --steps or the target loss")
    return Plan(fit, target_loss, target.workers or base.num_workers, predictions, checks,
                overheads)
