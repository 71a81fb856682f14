"""The watchdog's rules, fed synthetic observations (no processes, no sockets)."""

from __future__ import annotations

import math
import random

import pytest

from paramserver.errors import ConfigError
from paramserver.observe.watchdog import (
    DIVERGENCE,
    SIGNALS,
    Alarm,
    PushObservation,
    StepObservation,
    Watchdog,
    WatchdogConfig,
)


def push(worker, version=0, accepted=True, **kw):
    return PushObservation(worker=worker, version=version, accepted=accepted, **kw)


def signals(alarms):
    return [(a.signal, a.worker) for a in alarms]


def healthy_round(dog, rng, version, workers=3, loss=1.0):
    """One push per worker: unit-ish gradients agreeing with the mean, a falling loss."""
    out = []
    for w in range(workers):
        version += 1
        out += dog.observe_push(push(w, version, staleness=rng.randrange(workers),
                                     grad_norm=1.0 + 0.1 * rng.random(),
                                     cosine=0.3 + 0.2 * rng.random(),
                                     loss=loss * (1 + 0.05 * rng.random())))
        out += dog.observe_step(StepObservation(version, 0.01, 5.0, 0.1))
        out += dog.observe_clocks({q: version // workers + rng.randrange(3)
                                   for q in range(workers)})
    return out, version


def test_a_healthy_stream_raises_nothing():
    dog, rng, version, alarms = Watchdog(0), random.Random(0), 0, []
    for i in range(400):
        got, version = healthy_round(dog, rng, version, loss=2.0 * 0.99 ** i)
        alarms += got
    assert alarms == []


def test_nonfinite_gradient_names_the_worker_at_once():
    dog = Watchdog(1)
    got = dog.observe_push(push(2, accepted=False, reason="nonfinite", grad_norm=math.nan))
    assert signals(got) == [("nonfinite_gradient", 2)]
    alarm = got[0]
    assert alarm.shard == 1 and "worker 2" in alarm.message and "shard 1" in alarm.message
    assert math.isnan(alarm.figures["grad_norm"])


def test_only_the_models_own_state_is_divergence():
    """--on-divergence acts on Alarm.divergence: a NaN push the shard refused is that
    peer's fault (one worker key must not stop a shard); the same NaN applied is not."""
    dog = Watchdog(0)
    refused = dog.observe_push(push(2, accepted=False, reason="nonfinite", grad_norm=math.nan,
                                    loss=math.nan))
    assert signals(refused) == [("nonfinite_gradient", 2), ("nonfinite_loss", 2)]
    assert not any(a.divergence for a in refused)
    assert "it was refused" in refused[0].message
    applied = dog.observe_push(push(3, accepted=True, grad_norm=math.inf))
    assert signals(applied) == [("nonfinite_gradient", 3)] and applied[0].divergence
    broken = dog.observe_step(StepObservation(2, math.nan, math.nan, 0.1))
    assert signals(broken) == [("nonfinite_weights", None)] and broken[0].divergence
    assert set(SIGNALS) >= DIVERGENCE
    assert not {"worker_lag", "zero_gradient", "gradient_disagrees", "rejection_rate",
                "nonfinite_loss", "nonfinite_gradient"} & DIVERGENCE


def test_nonfinite_loss_and_weights():
    dog = Watchdog(0)
    assert signals(dog.observe_push(push(1, loss=math.inf))) == [("nonfinite_loss", 1)]
    got = dog.observe_step(StepObservation(1, math.nan, math.inf, 10.0))
    assert signals(got) == [("nonfinite_weights", None)]
    assert got[0].figures["lr"] == 10.0


def test_update_ratio_high_fires_on_the_third_big_step():
    dog = Watchdog(0)
    ratios = [0.01, 0.01, 0.9, 1.0]
    got = [dog.observe_step(StepObservation(i + 1, r * 10, 10.0)) for i, r in enumerate(ratios)]
    assert [signals(g) for g in got] == [[], [], [], [("update_ratio_high", None)]]
    assert got[3][0].figures["ratio"] == pytest.approx(0.9)


def test_update_ratio_high_ignores_a_shard_of_a_few_elements():
    dog = Watchdog(0)
    dog.elements = 2  # a lone bias: its ratio swings with every step
    assert not any(dog.observe_step(StepObservation(i, 0.5, 1.0)) for i in range(1, 20))


def test_update_ratio_low_waits_for_warmup_and_a_full_window():
    cfg = WatchdogConfig()
    dog = Watchdog(0, cfg)
    fired_at = None
    for step in range(1, 40):
        got = dog.observe_step(StepObservation(step, 0.0, 3.0, 0.0))
        if got:
            fired_at = step
            assert signals(got) == [("update_ratio_low", None)]
            assert got[0].figures["ratio"] == 0.0
            break
    assert fired_at == max(cfg.ratio_window, cfg.warmup_steps + 1)


def test_update_ratio_in_band_is_quiet():
    dog = Watchdog(0)
    assert not any(dog.observe_step(StepObservation(i, 1e-4 * (1 + i % 3), 1.0))
                   for i in range(1, 200))


def feed_losses(dog, losses, worker=0):
    out = []
    for i, loss in enumerate(losses):
        out += dog.observe_push(push(worker, i + 1, loss=loss))
        out += dog.observe_step(StepObservation(i + 1, 0.01, 1.0))
    return out


def test_loss_stalled_fires_on_a_flat_noisy_loss():
    cfg = WatchdogConfig()
    rng = random.Random(1)
    got = feed_losses(Watchdog(0, cfg), [2.3 + 0.05 * rng.gauss(0, 1) for _ in range(600)])
    assert signals(got) == [("loss_stalled", None)]
    assert got[0].figures["blocks"] == cfg.loss_patience


def test_loss_rising_fires_and_a_falling_loss_does_not():
    rising = [1.0] * 100 + [1.0 + 0.02 * i for i in range(200)]
    got = feed_losses(Watchdog(0), rising)
    assert ("loss_rising", None) in signals(got)
    first = next(a for a in got if a.signal == "loss_rising")
    assert first.figures["loss"] > first.figures["best_loss"] * 1.25
    assert feed_losses(Watchdog(0), [3.0 * 0.995 ** i for i in range(1000)]) == []


def test_a_transient_loss_bump_is_not_divergence_but_a_doubling_is():
    rng = random.Random(5)
    noisy = [0.1 * (1 + 0.3 * rng.gauss(0, 1)) for _ in range(400)]
    bump = noisy[:200] + [x * 1.6 for x in noisy[200:300]] + [x * 0.5 for x in noisy[300:]]
    # (the flat first 200 pushes are a stall by construction: only the rise is at issue)
    assert "loss_rising" not in [a.signal for a in feed_losses(Watchdog(0), bump)]
    doubled = noisy[:200] + [x * 2.5 for x in noisy[200:]]
    got = [a for a in feed_losses(Watchdog(0), doubled) if a.signal != "loss_stalled"]
    assert signals(got)[0] == ("loss_rising", None)
    assert got[0].figures["rise"] > 1.0 and got[0].version == 250


def test_loss_rules_ignore_blocks_without_applied_updates():
    dog = Watchdog(0)
    got = []
    for i in range(600):  # every push rejected: no step is ever observed
        got += dog.observe_push(push(i % 3, 0, accepted=False, reason="stale", loss=2.3))
    assert [a.signal for a in got if a.signal.startswith("loss")] == []


def test_rejection_rate_shard_wide_and_per_worker():
    dog = Watchdog(0)
    got = []
    for i in range(100):  # 95% rejected
        got += dog.observe_push(push(i % 2, accepted=(i % 20 == 0), reason="too stale"))
    assert signals(got) == [("rejection_rate", None)]
    assert got[0].figures["rejected_fraction"] > 0.9
    dog = Watchdog(0)
    got = []
    for i in range(200):  # worker 1 always rejected, worker 0 never: 50% shard-wide
        got += dog.observe_push(push(i % 2, accepted=(i % 2 == 0), reason="too stale"))
    assert signals(got) == [("rejection_rate", 1)]


def test_zero_gradient_is_relative_to_the_other_workers():
    dog = Watchdog(0)
    got = []
    for _ in range(10):
        for w in range(3):
            got += dog.observe_push(push(w, grad_norm=0.0 if w == 1 else 2.0))
    assert signals(got) == [("zero_gradient", 1)]
    assert got[0].figures["others_median_norm"] == 2.0
    # a shard slice nobody's gradient touches (all zero) is not an alarm
    dog = Watchdog(0)
    assert not any(dog.observe_push(push(w % 3, grad_norm=0.0)) for w in range(60))


def test_gradient_disagrees_names_the_negated_worker_and_needs_three():
    rng = random.Random(3)
    dog = Watchdog(0)
    got = []
    for _ in range(40):
        for w in range(3):
            cos = rng.uniform(0.0, 0.4) * (-1 if w == 2 else 1)
            got += dog.observe_push(push(w, grad_norm=1.0, cosine=cos))
    assert signals(got) == [("gradient_disagrees", 2)]
    assert got[0].figures["cosine"] < 0 < got[0].figures["others_cosine"]
    dog = Watchdog(0)  # cosines on a 2-element slice are +-1 coin flips: no alarm
    assert not any(dog.observe_push(push(w % 3, grad_norm=1.0, cosine=rng.choice((-1.0, 1.0))))
                   for w in range(3000))
    dog = Watchdog(0)  # with two workers, who disagrees with whom is undecidable
    assert not any(dog.observe_push(push(w % 2, grad_norm=1.0, cosine=(-0.3, 0.3)[w % 2]))
                   for w in range(200))


def test_worker_lag_fires_for_a_growing_async_lag_only():
    def run(bounded):
        dog, got = Watchdog(0, bounded_lag=bounded), []
        for t in range(200):  # worker 0 at a tenth of the others' pace
            got += dog.observe_clocks({0: t // 10, 1: t, 2: t})
        return got
    got = run(False)
    assert signals(got) == [("worker_lag", 0)]
    assert got[0].figures["clock_lag"] > 50
    assert got[0].figures["median_clock"] < 60
    assert run(True) == []
    # with time: it must stay that far behind for lag_seconds (30 s), not a moment
    dog, got = Watchdog(0), []
    for t in range(200):  # one observation per second
        got += dog.observe_clocks({0: t // 10, 1: t, 2: t}, now=1000.0 + t)
    assert signals(got) == [("worker_lag", 0)]
    assert got[0].figures["seconds"] == 30.0 and got[0].figures["median_clock"] > 80
    dog = Watchdog(0)  # starved for 20 s, then it catches up
    assert not any(dog.observe_clocks({0: 5 if 60 <= t < 80 else t - 20 * (t >= 80), 1: t,
                                       2: t}, now=float(t)) for t in range(200))
    dog = Watchdog(0)  # a one-off stall is not "without bound", nor one worker racing ahead
    got = []
    for t in range(300):
        got += dog.observe_clocks({0: t if t < 100 or t > 140 else 100, 1: t, 2: 3 * t})
    assert got == []


def test_worker_lag_from_growing_staleness():
    dog, got = Watchdog(0), []
    for i in range(40):
        got += dog.observe_push(push(1, staleness=5 if i < 20 else 120))
        got += dog.observe_push(push(0, staleness=2))
    assert signals(got) == [("worker_lag", 1)]
    assert got[0].figures["staleness"] > 50 >= 2 * got[0].figures["staleness_before"]


def test_cooldown_and_forget():
    dog = Watchdog(0, WatchdogConfig(cooldown=10))
    nan = push(0, accepted=False, grad_norm=math.nan)
    assert len(dog.observe_push(nan)) == 1
    assert dog.observe_push(nan) == []
    for _ in range(10):
        dog.observe_push(push(1))
    assert len(dog.observe_push(nan)) == 1
    dog.forget(0)
    assert 0 not in dog._workers


def test_disabled_signals_and_disabled_watchdog():
    dog = Watchdog(0, WatchdogConfig.from_dict({"disable": "nonfinite_gradient"}))
    assert dog.observe_push(push(0, grad_norm=math.nan)) == []
    dog = Watchdog(0, WatchdogConfig.from_dict({"enabled": False}))
    assert dog.observe_step(StepObservation(1, math.nan, math.nan)) == []


def test_config_from_dict_checks_names_and_types():
    cfg = WatchdogConfig.from_dict({"ratio_high": 1, "loss_window": 20,
                                    "disable": ["worker_lag"]})
    assert cfg.ratio_high == 1.0 and cfg.loss_window == 20 and cfg.disable == ("worker_lag",)
    with pytest.raises(ConfigError, match=r"unknown watchdog option.*ratio_hi"):
        WatchdogConfig.from_dict({"ratio_hi": 1})
    with pytest.raises(ConfigError, match="must be an integer"):
        WatchdogConfig.from_dict({"loss_window": 2.5})
    with pytest.raises(ConfigError, match="unknown signal"):
        WatchdogConfig.from_dict({"disable": "nope"})
    with pytest.raises(ConfigError, match="ratio_low < ratio_high"):
        WatchdogConfig(ratio_low=1.0, ratio_high=0.5)


def test_alarm_as_dict_is_json_ready():
    import json

    alarm = Alarm("zero_gradient", 0, 3, {"grad_norm": 0.0}, "m", 7)
    assert json.loads(json.dumps(alarm.as_dict())) == {
        "signal": "zero_gradient", "shard": 0, "worker": 3, "version": 7,
        "figures": {"grad_norm": 0.0}, "message": "m"}
    assert set(SIGNALS) >= {"zero_gradient", "gradient_disagrees", "worker_lag"}


# --------------------------------------------------------------------------- the core's figures


@pytest.mark.parametrize("optimizer,args", [("sgd", {"lr": 0.5}),
                                            ("sgd", {"lr": 0.5, "momentum": 0.9}),
                                            ("adam", {"lr": 0.1})])
def test_core_reports_exact_gradient_and_update_figures(optimizer, args):
    import torch

    from paramserver.core.shard import CoreConfig, GradStats, ShardCore, SliceSpec, StepStats

    core = ShardCore([SliceSpec("a", 3, "float32"), SliceSpec("b", 2, "float32")],
                     CoreConfig(optimizer=optimizer, optimizer_args=args))
    seen: list = []
    core.observe(seen.append, cosine_decay=0.5)
    core.register(0, "x", 0.0)
    core.initialize({"a": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([4.0, 5.0])})
    g1 = {"a": torch.tensor([1.0, 0.0, 0.0]), "b": torch.tensor([0.0, 0.0])}
    g2 = {"a": torch.tensor([1.0, 1.0, 0.0]), "b": torch.tensor([0.0, 0.0])}
    g3 = {"a": torch.tensor([-1.0, -1.0, 0.0]), "b": torch.tensor([0.0, 0.0])}
    for i, g in enumerate((g1, g2, g3)):
        before = torch.cat([p.clone() for p in core.params.values()])
        core.push(0, i + 1, i, core.version, 1, g, 0.0)
        after = torch.cat([p.clone() for p in core.params.values()])
        grad, step = seen[-2], seen[-1]
        assert isinstance(grad, GradStats) and isinstance(step, StepStats)
        assert grad.norm == pytest.approx(float(torch.cat(list(g.values())).norm()))
        assert step.update_norm == pytest.approx(float((after - before).norm()), rel=1e-5)
        assert step.weight_norm == pytest.approx(float(after.norm()), rel=1e-6)
        assert step.version == i + 1
    # cosine to the running mean of earlier pushes: none for the first, then
    # mean after g1 = 0.5 g1 -> cos(g2, g1) = 1/sqrt(2); mean = 0.25 g1 + 0.5 g2 = (.75, .5)
    cosines = [s.cosine for s in seen if isinstance(s, GradStats)]
    assert cosines[0] is None
    assert cosines[1] == pytest.approx(1 / math.sqrt(2))
    assert cosines[2] == pytest.approx(-(0.75 + 0.5) / (math.sqrt(2) * math.sqrt(0.8125)))


def test_core_samples_one_push_in_n():
    import torch

    from paramserver.core.shard import CoreConfig, GradStats, ShardCore, SliceSpec

    core = ShardCore([SliceSpec("a", 4, "float32")], CoreConfig())
    seen: list = []
    core.observe(seen.append, every=3)
    core.register(0, "x", 0.0)
    core.initialize({"a": torch.zeros(4)})
    for i in range(9):
        core.push(0, i + 1, i, core.version, 1, {"a": torch.ones(4)}, 0.0)
    assert sum(isinstance(s, GradStats) for s in seen) == 3
    assert len(seen) == 6  # each sampled push and the step it caused


def test_core_measures_big_shards_one_push_in_n_by_default(monkeypatch):
    import torch

    import paramserver.core.probe as probe_module
    from paramserver.core.shard import CoreConfig, GradStats, ShardCore, SliceSpec

    monkeypatch.setattr(probe_module, "_OBSERVE_ELEMENTS", 2)  # "big" = more than 2 elements
    core = ShardCore([SliceSpec("a", 5, "float32")], CoreConfig())
    seen: list = []
    core.observe(seen.append, every=0)  # by size: ceil(5 / 2) = 3
    core.register(0, "x", 0.0)
    core.initialize({"a": torch.zeros(5)})
    for i in range(9):
        core.push(0, i + 1, i, core.version, 1, {"a": torch.ones(5)}, 0.0)
    assert sum(isinstance(s, GradStats) for s in seen) == 3


def test_a_shedding_core_measures_each_workers_pushes_in_turn():
    """Shed to one push in 2 per worker: workers pushing in turn (0, 1, 0, 1, ...) are
    both measured in full, each on its 2nd, 4th, ... push (a shard-wide count would
    measure one worker only); every push still reports its exact norm."""
    import torch

    from paramserver.core.shard import (
        CoreConfig,
        GradStats,
        ModeSpec,
        ShardCore,
        SliceSpec,
        StepStats,
    )

    core = ShardCore([SliceSpec("a", 4, "float32")],
                     CoreConfig(mode=ModeSpec("async"), expected_workers=2))
    seen: list = []
    core.observe(seen.append, cosine_decay=0.5)
    core.probe.shed = 2
    for w in (0, 1):
        core.register(w, "x", 0.0)
    core.initialize({"a": torch.zeros(4)})
    for i in range(4):
        for w in (0, 1):
            core.push(w, i + 1, i, core.version, 1, {"a": torch.full((4,), w + 1.0)}, 0.0)
    grads = [s for s in seen if isinstance(s, GradStats)]
    assert [g.worker for g in grads] == [0, 1] * 4
    assert [g.norm for g in grads] == [2.0, 4.0] * 4  # exact, measured or not
    full = [i for i, g in enumerate(grads) if g.cosine is not None]
    # each worker's 2nd and 4th push (2, 3, 6, 7); the first of them (2) has no mean yet
    assert full == [3, 6, 7]
    assert sum(isinstance(s, StepStats) for s in seen) == 4  # the full pushes' steps
    core.probe.shed = 1  # back to every push
    core.push(0, 9, 4, core.version, 1, {"a": torch.ones(4)}, 0.0)
    assert isinstance(seen[-1], StepStats) and seen[-2].cosine is not None


def test_the_measure_budget_sheds_past_its_share_and_comes_back():
    from paramserver.core.probe import MeasureBudget
    from paramserver.errors import ConfigError

    budget = MeasureBudget(0.1, window=1.0)
    now = 0.0
    for _ in range(10):  # measuring takes half the time: one in 2, 4, ... up to the cap
        now += 1.0
        budget.spent(0.5, now)
    assert budget.level == MeasureBudget.MAX_LEVEL
    now += 1.0
    assert budget.spent(0.05, now) == MeasureBudget.MAX_LEVEL  # within the share: kept
    for _ in range(10):  # then under a quarter of it: back to every push
        now += 1.0
        budget.spent(0.001, now)
    assert budget.level == 1
    idle = MeasureBudget(0.1, window=1.0)
    for i in range(1, 20):  # a shard idle between pushes stays at every push
        idle.spent(0.05, float(i))
    assert idle.level == 1
    assert MeasureBudget(0.0).spent(10.0, 1.0) == 1  # 0: no limit
    with pytest.raises(ConfigError):
        MeasureBudget(1.5)


@pytest.mark.parametrize(("cat_elements", "momentum", "mode"), [
    (1 << 16, 0.9, "async"),  # one flat copy of the sample
    (0, 0.9, "async"),  # per-slice views
    (0, 0.0, "async"),  # plain SGD: the update is lr x the push's exact norm
    (0, 0.0, "sync"),  # plain SGD on the round's mean: estimated from the sample
])
def test_big_shards_measure_cosine_and_updates_on_a_strided_sample(monkeypatch, cat_elements,
                                                                    momentum, mode):
    import torch

    import paramserver.core.probe as probe_module
    from paramserver.core.shard import (
        CoreConfig,
        GradStats,
        ModeSpec,
        ShardCore,
        SliceSpec,
        StepStats,
    )

    monkeypatch.setattr(probe_module, "_SAMPLE_ELEMENTS", 1000)
    monkeypatch.setattr(probe_module, "_CAT_ELEMENTS", cat_elements)
    assert probe_module.sample_stride(1000) == 1
    assert probe_module.sample_stride(64_000) == 67  # the first prime >= 64
    shapes = {"w": (400, 64), "b": (64,)}  # 25,664 elements: stride 29
    core = ShardCore([SliceSpec(k, math.prod(s), "float32") for k, s in shapes.items()],
                     CoreConfig(mode=ModeSpec(mode), optimizer="sgd",
                                optimizer_args={"lr": 0.1, "momentum": momentum}))
    seen: list = []
    core.observe(seen.append, cosine_decay=0.5)
    core.register(0, "x", 0.0)
    gen = torch.Generator().manual_seed(0)
    core.initialize({k: torch.randn(math.prod(s), generator=gen) for k, s in shapes.items()})
    base = {k: torch.randn(math.prod(s), generator=gen) for k, s in shapes.items()}
    for i in range(4):
        g = {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
        before = torch.cat([p.clone() for p in core.params.values()])
        core.push(0, i + 1, i, core.version, 1, g, 0.0)
        after = torch.cat([p.clone() for p in core.params.values()])
        grad, step = seen[-2], seen[-1]
        assert isinstance(grad, GradStats) and isinstance(step, StepStats)
        # the gradient norm stays exact; the update and weight norms are estimated
        assert grad.norm == pytest.approx(float(torch.cat(list(g.values())).norm()), rel=1e-5)
        assert step.weight_norm == pytest.approx(float(after.norm()), rel=0.05)
        assert step.update_norm == pytest.approx(float((after - before).norm()), rel=0.05)
        if i:  # pushes around one mean: cosines near 1
            assert grad.cosine is not None and grad.cosine > 0.95
    probe = core.probe
    held = probe._grad_ema.numel() + sum(t.numel() for t in probe._before.values())
    assert held <= 2 * (25_664 // 29 + 2)  # two samples, not two copies of the shard


def slow_healthy_descent(seed, pushes=9000):
    """A fast drop from 2.3, then the slow descent of a long healthy run (0.112 to 0.023,
    as issue 20's 3000-step sync run), with batch-to-batch noise of +-40%."""
    rng = random.Random(seed)
    out = []
    for i in range(pushes):
        level = 2.3 * math.exp(-i / 60) + 0.112 * (0.023 / 0.112) ** (i / pushes)
        out.append(level * max(0.05, 1 + 0.4 * rng.gauss(0, 1)))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_a_slow_noisy_healthy_descent_raises_no_alarm(seed):
    dog = Watchdog(0)
    assert feed_losses(dog, slow_healthy_descent(seed)) == []


def test_a_stall_is_one_episode_and_a_new_stall_after_progress_is_another():
    rng = random.Random(3)
    flat = [2.3 * (1 + 0.05 * rng.gauss(0, 1)) for _ in range(600)]
    # progress (15 %, too little to call it converged), then flat again
    resumed = [2.3 * (1 - 0.0015 * i) * (1 + 0.05 * rng.gauss(0, 1)) for i in range(100)]
    again = [2.3 * 0.85 * (1 + 0.05 * rng.gauss(0, 1)) for _ in range(600)]
    dog = Watchdog(0)
    got = feed_losses(dog, flat)
    assert signals(got) == [("loss_stalled", None)]  # once, not once per check
    assert got[0].version == 200 and got[0].figures["episode"] == 1
    got = feed_losses(dog, resumed + again)
    assert signals(got) == [("loss_stalled", None)]
    assert got[0].figures["episode"] == 2


def test_a_converged_loss_is_a_hint_not_an_alarm():
    rng = random.Random(4)
    losses = [2.3 * math.exp(-i / 50) + 0.02 for i in range(500)]
    losses += [0.02 * (1 + 0.3 * rng.gauss(0, 1)) for _ in range(3000)]
    dog = Watchdog(0)
    assert feed_losses(dog, losses) == []
    hints = dog.take_hints()
    assert [h.signal for h in hints] == ["loss_converged"]
    assert hints[0].figures["pushes"] >= WatchdogConfig().loss_converged_pushes
    assert "loss flat at 0.02" in hints[0].message and "converged?" in hints[0].message
    assert dog.take_hints() == []
