"""Every watchdog rule fires within its stated delay (watchdog.delay), whatever the
measuring budget (issue 34): each failure is driven through the shard's own path (the
core, its deferred probe flushed by the MeasureBudget, the ShardObserver feeding the
watchdog), with every push measured, at the default budget on a shard where measuring
never fits it, and with the sampling level forced to its maximum (the smallest budget).
No processes, no sockets; the default's clock is a fake one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from paramserver.core.probe import MeasureBudget
from paramserver.core.shard import CoreConfig, GradStats, ModeSpec, ShardCore, SliceSpec
from paramserver.errors import ErrorCode, ProtocolError
from paramserver.observe.events import EventLog
from paramserver.observe.recorder import ShardObserver
from paramserver.observe.thresholds import DEFAULT_BUDGET
from paramserver.observe.watchdog import SIGNALS, Scope, Watchdog, WatchdogConfig, delay
from paramserver.policies.base import RejectPolicy, StalenessPolicy

N = 200  # weights on the shard (ratio_min_elements is 100)
MAX = MeasureBudget.MAX_LEVEL
WARMUP = 600  # healthy pushes before a failure (the default's level climbs meanwhile)


class FakeClock:
    """Each reading is ``tick`` later: measuring takes a third of the shard's time."""

    def __init__(self, tick: float = 1e-3) -> None:
        self.t = 0.0
        self.tick = tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


@dataclass
class Run:
    """How much is measured: ``every`` push, the ``default`` budget, or the level at
    its ``max``; the bound each rule is held to then."""

    name: str

    @property
    def level(self) -> int:  # the level the bound assumes: any budget may reach MAX
        return 1 if self.name == "every" else MAX


RUNS = [Run("every"), Run("default"), Run("max")]


class Shard:
    """One shard's push path as the server runs it (ops.on_push, then
    ShardServer._run_after_reply), without a socket."""

    def __init__(self, run: Run, workers: int, *, lr: float = 0.01, check_finite: bool = True,
                 policy: StalenessPolicy | None = None,
                 config: WatchdogConfig | None = None) -> None:
        budget = 0.0 if run.name == "every" else DEFAULT_BUDGET
        self.config = config or WatchdogConfig(observe_budget=budget)
        self.core = ShardCore([SliceSpec("w", N, "float32")],
                              CoreConfig(mode=ModeSpec("async"), expected_workers=workers,
                                         optimizer_args={"lr": lr},
                                         check_finite=check_finite), policy)
        self.dog = Watchdog(0, self.config, bounded_lag=False)
        self.dog.elements = N
        self.observer = ShardObserver(0, EventLog(None), self.dog)
        self.core.observe(self.observer.on_core, cosine_decay=0.97, every=1)
        self.core.probe.defer = True
        self.budget = MeasureBudget(self.config.observe_budget)
        self.clock = FakeClock()
        if run.name == "max":
            self.budget = MeasureBudget(0.0)  # no budget to move it: held at the maximum
            self.core.probe.shed = MAX
        self.refused = 0
        self.core.on_refused = self._refused
        for w in range(workers):
            self.core.register(w, "x", 0.0)
        self.core.initialize({"w": torch.ones(N)})
        self.pushes = [0] * workers
        self.stale = [0] * workers  # how many versions old each worker's reads are

    def _refused(self, version: int) -> None:  # the server raises nonfinite_weights from it
        self.refused += 1

    def push(self, worker: int, grad: torch.Tensor, loss: float | None = None) -> list[str]:
        """One push; the signals of the alarms it raised."""
        core, n = self.core, self.pushes[worker]
        self.pushes[worker] += 1
        alarms, refused = len(self.dog.alarms), self.refused
        read = max(0, core.version - self.stale[worker])
        try:
            out = core.push(worker, n + 1, n, read, 1, {"w": grad}, float(n))
        except ProtocolError as exc:
            assert exc.code == ErrorCode.NONFINITE
            self.observer.nonfinite(worker, loss)
        else:
            assert out is not None
            if core.probe.pending:
                self.budget.flush(core.probe, self.clock)
            self.observer.push(core, worker, out, loss=loss, seconds=0.0,
                               nbytes=0)
        return ([a.signal for a in self.dog.alarms[alarms:]]
                + ["nonfinite_weights"] * (self.refused - refused))


def healthy(rng: torch.Generator, base: torch.Tensor) -> torch.Tensor:
    """A gradient along the shared direction plus noise (cosine to the mean ~0.4)."""
    return base + 1.5 * base.norm() / N ** 0.5 * torch.randn(N, generator=rng)


def drive(run: Run, signal: str, shard: Shard, workers: int,
          fault: Callable[[int, int], tuple[torch.Tensor | None, float | None]],
          *, warmup: bool = True, limit: int = 20_000,
          prelude: Callable[[], object] | None = None) -> None:
    """Healthy rounds, then ``fault(worker, i)`` for each push; assert ``signal`` fires
    within its delay, counted in the delay's scope from the failure's first push."""
    rng = torch.Generator().manual_seed(0)
    base = torch.full((N,), 1e-2)
    for _ in range(WARMUP // workers if warmup else 0):
        for w in range(workers):
            assert not shard.push(w, healthy(rng, base))
    if run.name == "default" and warmup:
        assert shard.core.probe.shed > 1  # the budget did sample the pushes
    if prelude is not None:
        prelude()
    d = delay(signal, shard.config, check_finite=shard.core.config.check_finite)
    bound = d.pushes(run.level)
    start = list(shard.pushes)
    for i in range(limit):
        for w in range(workers):
            grad, loss = fault(w, i)
            if grad is None:
                grad = healthy(rng, base)
            if signal in shard.push(w, grad, loss):
                done = [p - s for p, s in zip(shard.pushes, start, strict=True)]
                took = {Scope.WORKER: done[w], Scope.ONE: max(done),
                        Scope.SHARD: sum(done)}[d.scope]
                assert took <= bound, (signal, run.name, took, bound)
                return
    pytest.fail(f"{signal} did not fire ({run.name})")


# --------------------------------------------------------------------------- never sampled


def test_a_sampled_out_push_still_gets_the_finite_check_counts_and_staleness():
    """At the maximum level, a push not measured is still checked for NaN, counted,
    decided at its staleness, and observed by the watchdog with that staleness."""
    shard = Shard(Run("max"), 2)
    seen: list[GradStats] = []
    on_core = shard.observer.on_core
    shard.core.probe.observer = lambda s: (seen.append(s) if isinstance(s, GradStats)
                                           else None, on_core(s))[1]
    shard.stale[1] = 3
    for _ in range(10):
        shard.push(0, torch.ones(N))
        shard.push(1, torch.ones(N))
    assert [g.cosine for g in seen].count(None) == len(seen)  # no push measured in full
    state = shard.core.workers[1]
    assert (state.pushes, state.applied, state.clock) == (10, 10, 10)  # counted
    # decided at tau 3 (the first push read version 0, 1 old)
    assert state.staleness_sum == 1 + 3 * 9 and state.staleness_max == 3
    last = shard.observer.summary().workers["1"]
    assert last.staleness == 3 and last.grad_norm == pytest.approx(N ** 0.5)
    assert list(shard.dog._window(1).staleness)[-3:] == [3, 3, 3]
    bad = torch.ones(N)
    bad[7] = float("nan")
    assert shard.push(1, bad) == ["nonfinite_gradient"]
    assert shard.core.version == 20 and state.pushes == 10  # refused before it counted


# --------------------------------------------------------------------------- each rule


def nan() -> torch.Tensor:
    g = torch.ones(N)
    g[3] = float("nan")
    return g


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.name)
@pytest.mark.parametrize("signal", [
    "nonfinite_gradient", "nonfinite_loss", "update_ratio_high", "update_ratio_low",
    "zero_gradient", "gradient_disagrees", "rejection_rate", "worker_lag"])
def test_each_rule_fires_within_its_delay(run: Run, signal: str) -> None:
    workers = 4 if signal in ("gradient_disagrees", "zero_gradient", "worker_lag") else 1
    policy = RejectPolicy(4) if signal == "rejection_rate" else None
    shard = Shard(run, workers, policy=policy)
    base = torch.full((N,), 1e-2)
    last = workers - 1
    bad = torch.Generator().manual_seed(2)

    def fault(w: int, i: int) -> tuple[torch.Tensor | None, float | None]:
        if signal == "rejection_rate":
            shard.stale[w] = 10  # every read 10 versions old: the policy refuses all
        if signal == "worker_lag" and w == last:
            shard.stale[w] = 100  # its gradients suddenly on weights 100 versions old
        if w != last:
            return None, None
        return {"nonfinite_gradient": (nan(), None),
                "nonfinite_loss": (None, float("nan")),
                # a blow-up: lr x gradient = 2.2 x the weights, which grow 1.2x a step
                "update_ratio_high": (220 * shard.core.params["w"].clone(), None),
                "update_ratio_low": (base * 1e-9, None),  # one that vanishes
                "zero_gradient": (torch.zeros(N), None),
                "gradient_disagrees": (-healthy(bad, base), None),  # a sign error
                }.get(signal, (None, None))

    # gradient_disagrees from the start: the others' windows fill as the culprit's does
    drive(run, signal, shard, workers, fault, warmup=signal != "gradient_disagrees"
          or run.name == "default")


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.name)
def test_nonfinite_weights_fires_within_its_delay(run: Run) -> None:
    """A finite gradient that overflows the weights: the core undoes the step at once
    (check_finite); without the check, a NaN gradient is applied and the next measured
    step's norms say so."""
    def huge() -> torch.Tensor:  # finite; 2 x 3e38 overflows float32
        g = torch.zeros(N)
        g[0] = 3e38
        return g

    shard = Shard(run, 1, lr=2.0)
    drive(run, "nonfinite_weights", shard, 1, lambda w, i: (huge() if i == 0 else None, None))
    assert shard.refused == 1
    shard = Shard(run, 1, check_finite=False)
    drive(run, "nonfinite_weights", shard, 1, lambda w, i: (nan() if i == 0 else None, None))
    assert shard.refused == 0 and not torch.isfinite(shard.core.params["w"]).all()


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.name)
def test_loss_rules_fire_within_their_delay(run: Run) -> None:
    rng = torch.Generator().manual_seed(1)

    def noisy(level: float) -> float:
        return level * (1 + 0.02 * float(torch.randn(1, generator=rng)))

    shard = Shard(run, 2)
    drive(run, "loss_stalled", shard, 2, lambda w, i: (None, noisy(1.0)))
    shard = Shard(run, 2)

    def falling() -> None:  # two blocks: a best level
        for i in range(50):
            for w in range(2):
                shard.push(w, torch.full((N,), 1e-2), noisy(1.0 - 0.005 * i))

    drive(run, "loss_rising", shard, 2, lambda w, i: (None, noisy(3.0)), prelude=falling)


def test_every_rule_has_a_delay_and_sampling_only_delays_what_it_samples():
    for signal in SIGNALS:
        d = delay(signal)
        assert d.count >= 1 and d.pushes(MAX) >= d.pushes(1) == d.count
    assert delay("gradient_disagrees").pushes(MAX) == 20 * MAX
    assert delay("update_ratio_high").pushes(MAX, sync=True) == 3  # every round measured
    assert delay("zero_gradient").pushes(MAX) == 5  # the finite check's norm: every push
    with pytest.raises(KeyError):
        delay("no_such_rule")


def test_the_docs_list_each_rules_delay_as_the_code_states_it():
    from pathlib import Path

    from paramserver.observe.watchdog import Reads, delays

    def cell(d, level: int) -> str:
        sync = (f" (sync: {d.pushes(level, sync=True)})"
                if d.reads is Reads.STEP and level > 1 else "")
        return f"{d.pushes(level):,}{sync}"

    doc = (Path(__file__).resolve().parents[1] / "docs" / "observability.md").read_text()
    for d in delays():
        row = (f"| `{d.signal}` | {d.needs} | {d.scope.value} | {cell(d, 1)} | "
               f"{cell(d, MAX)} | {cell(d, MAX)} |")
        assert row in doc, row


def test_observe_option_sets_the_watchdogs_budget_and_keeps_the_old_spelling():
    from paramserver.errors import ConfigError
    from paramserver.server.config import ServerConfig

    assert ServerConfig().observe == "budget:0.05"
    assert ServerConfig().watchdog_config().observe_budget == DEFAULT_BUDGET
    assert ServerConfig(observe="every").watchdog_config().observe_budget == 0.0
    assert ServerConfig(observe="budget:0.1").watchdog_config().observe_budget == 0.1
    old = ServerConfig(watchdog={"observe_budget": 0.2})  # the spelling before --observe
    assert old.watchdog_config().observe_budget == 0.2
    for bad in ("sometimes", "budget:", "budget:0", "budget:1.5", "budget:x", "every:1"):
        with pytest.raises(ConfigError, match="--observe"):
            ServerConfig(observe=bad)
    with pytest.raises(ConfigError, match="disagree"):
        ServerConfig(observe="every", watchdog={"observe_budget": 0.2})
