"""Running an experiment: every configuration x seed of an :class:`ExperimentSpec`,
real (:func:`~paramserver.workers.launch.cluster.run_cluster`, one local cluster per
run) or virtual (:func:`~paramserver.workers.launch.virtual.run_simulation`, given a
:class:`~paramserver.workers.launch.virtual.SimSpec`), then the report.

Both write the same layout: ``spec.toml`` (which ``--spec`` accepts back),
``environment.json`` (versions, git commit, platform), ``experiment.json`` (the
index the report is built from) and ``runs/<config>/seed<k>/``; a virtual
experiment adds ``simulation.json`` (the time model), and its times are virtual.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from paramserver.errors import ConfigError, ParamServerError
from paramserver.observe.events import read_events
from paramserver.workers.experiments.index import (
    EnvironmentInfo,
    ExperimentIndex,
    RunEntry,
    inside,
)
from paramserver.workers.experiments.report import ReportFiles, write_report
from paramserver.workers.experiments.spec import ExperimentSpec, RunPlan, dump_spec
from paramserver.workers.launch.cluster import Progress, run_cluster
from paramserver.workers.launch.virtual import SimSpec, check_simulable, run_simulation

__all__ = [
    "ExperimentObserver",
    "ExperimentResult",
    "RunOutcome",
    "environment_info",
    "merge_steps",
    "run_experiment",
    "simulate_experiment",
]

log = logging.getLogger(__name__)


def environment_info() -> EnvironmentInfo:
    """What it takes to reproduce a result: versions, git commit, platform, command."""
    packages: dict[str, str | None] = {}
    for dist in ("paramserver", "torch", "pyzmq", "numpy", "msgpack", "scikit-learn",
                 "matplotlib", "safetensors", "click", "rich"):
        try:
            packages[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            packages[dist] = None
    repo = Path(__file__).resolve().parents[2]
    commit, dirty = None, None
    try:
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True, timeout=10).stdout.strip()
        status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], check=True,
                                capture_output=True, text=True, timeout=10).stdout
        dirty = bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        pass  # not a git checkout (an installed wheel): versions must do
    return EnvironmentInfo(
        python=sys.version.split()[0], implementation=platform.python_implementation(),
        platform=platform.platform(), machine=platform.machine(), cpus=os.cpu_count(),
        packages=packages, git_commit=commit, git_dirty=dirty, argv=tuple(sys.argv),
        torch_threads=torch.get_num_threads(), cuda=torch.cuda.is_available())


@dataclass
class RunOutcome:
    plan: RunPlan
    ok: bool
    seconds: float
    error: str = ""
    load: float | None = None  # 1-minute load average when the run ended (CPU contention)


@dataclass
class ExperimentResult:
    out_dir: Path
    outcomes: list[RunOutcome]
    report: ReportFiles | None = None  # None when run with report=False

    @property
    def failed(self) -> list[RunOutcome]:
        return [o for o in self.outcomes if not o.ok]


class ExperimentObserver:
    """Hooks for a progress display; every method is optional (no-op here)."""

    def run_started(self, index: int, total: int, plan: RunPlan, steps: int) -> None:
        """Run ``index`` (0-based) of ``total`` starts; it will do ``steps`` worker steps."""

    def run_progress(self, plan: RunPlan, progress: Progress) -> None:
        """Called about twice a second while the run's workers train."""

    def run_finished(self, outcome: RunOutcome) -> None:
        """A run ended (``outcome.ok`` False: it failed, the grid goes on)."""


def prepare_dir(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        if not ((out / "experiment.json").exists() or (out / "spec.toml").exists()):
            raise ConfigError(f"{out} exists and does not hold an earlier experiment; "
                              "give an empty or new --out directory")
        log.info("replacing the earlier experiment in %s", out)
        for name in ("runs", "images"):
            shutil.rmtree(out / name, ignore_errors=True)
        for name in ("report.md", "report.html", "experiment.json", "spec.toml",
                     "environment.json"):
            (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not available on this platform
        return None


def merge_steps(run_dir: Path, workers: int) -> None:
    """``steps.jsonl``: every step and held-out evaluation of every worker, in time order."""
    records = []
    for rank in range(workers):
        path = run_dir / "events" / f"worker{rank}.jsonl"
        if path.exists():
            records += [r for r in read_events(path) if r.get("event") in ("step", "eval")]
    records.sort(key=lambda r: r["t"])
    with (run_dir / "steps.jsonl").open("w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec, separators=(",", ":")) + "\n")


def _index(spec: ExperimentSpec, outcomes: Sequence[RunOutcome], started: float,
           finished: bool, sim: SimSpec | None) -> ExperimentIndex:
    return ExperimentIndex(
        name=spec.name, task=spec.workload, task_args=spec.task_args, steps=spec.steps,
        servers=spec.servers, seeds=tuple(spec.seeds), target_loss=spec.target_loss,
        eval_every=spec.eval_every, min_step_time=spec.min_step_time,
        optimizer=spec.optimizer, optimizer_args=spec.optimizer_args,
        batch_size=spec.batch_size,
        budget_seconds=spec.budget_seconds, budget_gradients=spec.budget_gradients,
        budget=spec.budget,
        scenarios={n: spec.scenario(n).entry() for n in spec.scenarios},
        configurations=tuple(spec.entry(c) for c in spec.configurations()),
        runs=tuple(RunEntry(config=o.plan.config.id, seed=o.plan.seed, path=o.plan.path,
                            budget=spec.budget, ok=o.ok, seconds=round(o.seconds, 3),
                            error=o.error, load=o.load)
                   for o in outcomes),
        started=started, finished=time.time() if finished else None, simulated=sim,
        command=tuple(spec.command) if spec.command else None,
        hosts=plan.to_json() if (plan := spec.host_plan()) is not None else None,
    )


def run_experiment(spec: ExperimentSpec, out_dir: str | os.PathLike[str],
                   observer: ExperimentObserver | None = None,
                   report: bool = True, sim: SimSpec | None = None,
                   trace: bool = False) -> ExperimentResult:
    """Run every configuration x seed, then write the report. A failed run is recorded
    (``experiment.json``, the report) and the grid goes on; Ctrl-C stops everything.

    With ``sim`` every run is simulated in virtual time instead
    (:func:`~paramserver.workers.launch.virtual.run_simulation`): the same grid,
    layout and report, with ``simulation.json`` recording the time model.
    ``trace``: every run records its trace in its ``trace/`` (``--trace``).
    """
    if trace and sim is not None:
        raise ConfigError("a simulated run needs no trace: it is its own schedule")
    obs = observer or ExperimentObserver()
    out = Path(out_dir)
    prepare_dir(out)
    (out / "spec.toml").write_text(dump_spec(spec), encoding="utf-8")
    (out / "environment.json").write_text(json.dumps(environment_info().to_json(), indent=2))
    if sim is not None:
        (out / "simulation.json").write_text(json.dumps(dataclasses.asdict(sim), indent=2))
    plans = spec.runs()
    outcomes: list[RunOutcome] = []
    started = time.time()

    def index(finished: bool) -> None:
        data = _index(spec, outcomes, started, finished, sim).to_json()
        (out / "experiment.json").write_text(json.dumps(data, indent=2))

    index(False)
    for i, plan in enumerate(plans):
        # under a time budget the steps are unknown: spec.steps is the progress bar's guess
        per_worker = spec.worker_steps(plan.config.workers) or spec.steps
        obs.run_started(i, len(plans), plan, per_worker * plan.config.workers)
        run_dir = inside(out, plan.path)  # (the spec checked its names: this is the last word)
        t0 = time.monotonic()

        def progress(p: Progress, plan: RunPlan = plan) -> None:
            obs.run_progress(plan, p)

        cluster = spec.cluster_spec(plan.config, plan.seed)
        if trace:
            cluster = dataclasses.replace(cluster, trace=True)
        try:
            if sim is None:
                run_cluster(cluster, run_dir, on_progress=progress)
            else:
                run_simulation(cluster, run_dir, sim, progress)
            merge_steps(run_dir, plan.config.workers)
            outcome = RunOutcome(plan, True, time.monotonic() - t0)
        except ParamServerError as exc:
            log.error("run %s failed: %s", plan.name, exc)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "error.txt").write_text(str(exc))
            outcome = RunOutcome(plan, False, time.monotonic() - t0, str(exc).splitlines()[0])
        if sim is None:
            outcome.load = _load()
        outcomes.append(outcome)
        obs.run_finished(outcome)
        index(False)
    index(True)
    return ExperimentResult(out, outcomes, write_report(out) if report else None)


def simulate_experiment(spec: ExperimentSpec, out_dir: str | os.PathLike[str],
                        sim: SimSpec | None = None,
                        observer: ExperimentObserver | None = None,
                        report: bool = True) -> ExperimentResult:
    """:func:`run_experiment` in virtual time (every time in the report is virtual seconds)."""
    if spec.command:
        raise ConfigError("a command runs as real processes: use paramserver experiment "
                          "(simulate runs the built-in loop in virtual time)")
    if spec.hosts is not None:
        raise ConfigError("emulated hosts run real processes: use paramserver experiment "
                          "(simulate's network is its time model)")
    if any(spec.replicas):
        raise ConfigError("replicas are processes that take over from a dead one: use "
                          "paramserver experiment (simulate runs one core per shard)")
    plans = spec.runs()
    if plans:  # one task for the whole grid: refuse it before any folder is written
        check_simulable(spec.cluster_spec(plans[0].config, plans[0].seed))
    return run_experiment(spec, out_dir, observer, report, sim=sim or SimSpec())
