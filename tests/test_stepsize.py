"""Large-batch learning-rate rules and asynchrony-aware momentum, in the pure core (no sockets)."""

from __future__ import annotations

import math

import pytest
import torch

from paramserver.core.shard import CoreConfig, ModeSpec, ShardCore, SliceSpec
from paramserver.core.stepsize import LrRule, MomentumCompensation
from paramserver.errors import ConfigError
from paramserver.server.config import ServerConfig

KEYS = [SliceSpec("w", 3, "float64")]


def make_core(mode="sync", workers=4, b=0, lr=0.1, scaling="none", warmup=0,
              momentum_target=None, optimizer="sgd", optimizer_args=None):
    cfg = CoreConfig(mode=ModeSpec(mode, 0, b), optimizer=optimizer,
                     optimizer_args=optimizer_args or {"lr": lr},
                     expected_workers=workers, lr_scaling=scaling, warmup_steps=warmup,
                     momentum_target=momentum_target)
    core = ShardCore(KEYS, cfg)
    for w in range(workers):
        core.register(w, f"inc{w}", now=0.0)
    core.initialize({"w": torch.zeros(3, dtype=torch.float64)})
    return core


class Pusher:
    def __init__(self, core):
        self.core, self.ids = core, {}

    def __call__(self, worker, read_version, value=1.0, clock=0):
        self.ids[worker] = self.ids.get(worker, 0) + 1
        g = {"w": torch.full((3,), float(value), dtype=torch.float64)}
        return self.core.push(worker, self.ids[worker], clock, read_version, 1, g, 0.0)


def sync_round(core, push, workers, value=1.0):
    v = core.version
    for w in workers:
        push(w, v, value)
    assert core.version == v + 1


# ----------------------------------------------------------------- the rules, by hand


@pytest.mark.parametrize("scaling, k, expected", [
    ("none", 4, 1.0), ("linear", 4, 4.0), ("linear", 1, 1.0), ("sqrt", 4, 2.0),
    ("sqrt", 9, 3.0), ("linear", 0, 1.0),
])
def test_scale(scaling, k, expected):
    assert LrRule(scaling).scale(k) == pytest.approx(expected)


def test_warmup_ramps_from_one_to_the_full_factor_in_equal_steps():
    rule = LrRule("linear", warmup_steps=4)
    assert [rule.factor(5, s) for s in range(6)] == pytest.approx([2.0, 3.0, 4.0, 5.0, 5.0, 5.0])


def test_bad_rules_are_refused():
    with pytest.raises(ConfigError, match="lr scaling"):
        LrRule("cubic")
    with pytest.raises(ConfigError, match="warmup"):
        LrRule("linear", -1)
    with pytest.raises(ConfigError, match="lr_scaling"):
        ServerConfig(lr_scaling="cubic")


def test_momentum_compensation_by_hand():
    comp = MomentumCompensation(0.9)
    assert comp.explicit == pytest.approx(0.9)  # nothing observed: no implicit momentum
    for _ in range(200):
        comp.observe(1)  # mean staleness 1: implicit 1/2; (1 - 0.9) / (1 - 0.5) = 0.2
    assert comp.mean_staleness == pytest.approx(1.0)
    assert comp.implicit == pytest.approx(0.5)
    assert comp.explicit == pytest.approx(0.8)
    for _ in range(200):
        comp.observe(31)  # implicit 1 - 1/32 > 0.9: no explicit momentum at all
    assert comp.mean_staleness == pytest.approx(31.0, rel=1e-3)
    assert comp.explicit == 0.0


def test_momentum_estimate_starts_from_the_prior():
    comp = MomentumCompensation(0.9, decay=0.5)
    comp.observe(0, prior=7)
    assert comp.mean_staleness == pytest.approx(3.5)
    comp.observe(0, prior=100)  # only the first observation uses the prior
    assert comp.mean_staleness == pytest.approx(1.75)


def test_sync_rounds_keep_the_target_momentum():
    core = make_core("sync", workers=2, momentum_target=0.9,
                     optimizer_args={"lr": 0.1, "momentum": 0.5})
    push = Pusher(core)
    for _ in range(3):
        sync_round(core, push, range(2))
    assert core.stepper.optimizer.param_groups[0]["momentum"] == pytest.approx(0.9)


def test_momentum_estimate_is_bias_corrected():
    comp = MomentumCompensation(0.9, decay=0.95)
    comp.observe(7)  # one observation: the mean is 7, not 0.05 * 7
    assert comp.mean_staleness == pytest.approx(7.0)
    assert comp.implicit == pytest.approx(1 - 1 / 8)


# ----------------------------------------------------------------- in the core


def test_linear_scaling_makes_a_sync_round_of_k_the_step_of_k_times_the_lr():
    core = make_core("sync", workers=4, lr=0.1, scaling="linear")
    push = Pusher(core)
    sync_round(core, push, range(4), value=1.0)
    # mean gradient 1, lr 0.1 x 4 contributors
    assert torch.allclose(core.params["w"], torch.full((3,), -0.4, dtype=torch.float64))
    assert core.stepper.lr_factor == 4.0
    assert core.lr == pytest.approx(0.1)  # the configured lr is left as it was
    assert core.stats().lr_factor == 4.0 and core.stats().lr_scaling == "linear"


def test_without_scaling_a_sync_round_runs_at_the_configured_lr():
    core = make_core("sync", workers=4, lr=0.1)
    push = Pusher(core)
    sync_round(core, push, range(4))
    assert torch.allclose(core.params["w"], torch.full((3,), -0.1, dtype=torch.float64))


def test_factor_follows_the_live_contributors_when_a_worker_dies():
    core = make_core("sync", workers=4, lr=0.1, scaling="linear")
    push = Pusher(core)
    sync_round(core, push, range(4))
    core.declare_dead(3)
    sync_round(core, push, range(3))
    assert core.stepper.lr_factor == 3.0
    assert torch.allclose(core.params["w"], torch.full((3,), -0.7, dtype=torch.float64))


def test_backup_workers_scale_by_the_gradients_that_made_the_round():
    core = make_core("sync", workers=4, b=1, lr=0.1, scaling="sqrt")
    push = Pusher(core)
    sync_round(core, push, range(3))  # closes without the 4th
    assert core.stepper.lr_factor == pytest.approx(math.sqrt(3))
    late = push(3, 0)
    assert late.reason == "late"


def test_warmup_in_the_core_counts_optimizer_steps():
    core = make_core("sync", workers=2, lr=0.1, scaling="linear", warmup=2)
    push = Pusher(core)
    factors = []
    for _ in range(3):
        sync_round(core, push, range(2))
        factors.append(core.stepper.lr_factor)
    assert factors == pytest.approx([1.5, 2.0, 2.0])
    assert torch.allclose(core.params["w"], torch.full((3,), -0.1 * 5.5, dtype=torch.float64))


def test_async_step_has_factor_one_under_any_rule():
    core = make_core("async", workers=4, lr=0.1, scaling="linear", warmup=3)
    push = Pusher(core)
    for w in range(4):
        push(w, 0)
    assert core.version == 4 and core.stepper.lr_factor == 1.0
    assert torch.allclose(core.params["w"], torch.full((3,), -0.4, dtype=torch.float64))


def test_compensated_momentum_is_set_from_staleness_and_reported():
    core = make_core("async", workers=4, lr=0.1, momentum_target=0.9,
                     optimizer_args={"lr": 0.1, "momentum": 0.9})
    push = Pusher(core)
    push(0, 0)  # staleness 0, after a prior of 3 (4 live workers evenly paced)
    mean = 0.95 * 3 + 0.05 * 0
    assert core.stepper.optimizer.param_groups[0]["momentum"] == pytest.approx(1 - 0.1 * (mean + 1))
    for _ in range(100):
        push(1, max(0, core.version - 3))  # staleness 3 from the fourth on
    stats = core.stats()
    assert stats.mean_staleness_estimate == pytest.approx(3.0, rel=1e-2)
    assert stats.momentum_implicit == pytest.approx(0.75, rel=1e-2)
    # (1 - 0.9) / (1 - 0.75) = 0.4 -> explicit 0.6
    assert core.stepper.optimizer.param_groups[0]["momentum"] == pytest.approx(0.6, abs=0.01)
    assert stats.momentum_explicit == pytest.approx(0.6, abs=0.01)


def test_compensated_momentum_sets_adams_first_beta():
    core = make_core("async", workers=2, momentum_target=0.9, optimizer="adam",
                     optimizer_args={"lr": 0.01})
    push = Pusher(core)
    for _ in range(100):
        push(0, max(0, core.version - 1))
    assert core.stepper.optimizer.param_groups[0]["betas"][0] == pytest.approx(0.8, abs=0.01)
    assert core.stepper.optimizer.param_groups[0]["betas"][1] == pytest.approx(0.999)


def test_momentum_target_needs_an_optimizer_with_momentum():
    with pytest.raises(ConfigError, match="momentum"):
        make_core("async", momentum_target=0.9, optimizer="adagrad",
                  optimizer_args={"lr": 0.1})


def test_estimator_and_round_contributors_survive_a_checkpoint():
    core = make_core("async", workers=2, momentum_target=0.9,
                     optimizer_args={"lr": 0.1, "momentum": 0.9})
    push = Pusher(core)
    for _ in range(20):
        push(0, max(0, core.version - 2))
    tensors, meta = core.state_dict()
    fresh = make_core("async", workers=2, momentum_target=0.9,
                      optimizer_args={"lr": 0.1, "momentum": 0.9})
    fresh.load_state_dict(tensors, meta, now=0.0)
    assert fresh.stepper.momentum is not None and core.stepper.momentum is not None
    assert fresh.stepper.momentum.mean_staleness == pytest.approx(
        core.stepper.momentum.mean_staleness)

    sync = make_core("sync", workers=3, scaling="linear")
    spush = Pusher(sync)
    spush(0, 0)
    spush(1, 0)
    tensors, meta = sync.state_dict()
    restored = make_core("sync", workers=3, scaling="linear")
    restored.load_state_dict(tensors, meta, now=0.0)
    assert restored.round.accepted == 2
