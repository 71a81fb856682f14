"""DC-ASGD, Gap-Aware and the adaptive SSP bound: each rule against hand-computed values,
their hooks in the pure core, and their state in checkpoints."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from paramserver.core.shard import CoreConfig, ModeSpec, ShardCore, SliceSpec
from paramserver.errors import ConfigError
from paramserver.policies import (
    BoundStats,
    Decision,
    StalenessPolicy,
    UpdateInfo,
    available_policies,
    create_policy,
)
from paramserver.policies.bounds import AdaptiveBound
from paramserver.policies.research import (
    AdaptiveBoundPolicy,
    DCASGDAdaptivePolicy,
    DCASGDPolicy,
    GapAwarePolicy,
    decode_tensors,
    encode_tensors,
)

INFO = UpdateInfo(worker=0, shard=0, staleness=3, read_version=1, version=4, clock=1,
                  min_clock=0, num_samples=8)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def rewrite(policy: StalenessPolicy, g, now, read, lr=0.1) -> torch.Tensor:
    out = policy.rewrite_gradient(INFO, {"w": g}, {"w": now}, {"w": read}, lr)
    return out["w"]


# ---------------------------------------------------------------- registry


def test_research_policies_are_registered_by_importing_staleness():
    names = available_policies()
    for name, cls in [("dc-asgd", DCASGDPolicy), ("dc-asgd-adaptive", DCASGDAdaptivePolicy),
                      ("gap-aware", GapAwarePolicy), ("ssp-adaptive", AdaptiveBoundPolicy)]:
        assert names[name] is cls
    policy = create_policy("dc-asgd", {"lam": "0.5"})  # command-line strings are converted
    assert isinstance(policy, DCASGDPolicy) and policy.lam == 0.5
    assert create_policy("gap-aware", {"bias_correction": "false"}).bias_correction is False
    assert create_policy("ssp-adaptive", {"s_max": "5"}).rule.s_max == 5


@pytest.mark.parametrize("name, args, message", [
    ("dc-asgd", {"lam": -1}, "lam must be"),
    ("dc-asgd", {"lambda": 1}, "accepted: lam"),
    ("dc-asgd-adaptive", {"momentum": 1.0}, "momentum must be in"),
    ("gap-aware", {"beta": 1.5}, "beta must be in"),
    ("ssp-adaptive", {"s_min": 4, "s_max": 2}, "s_min <= s_max"),
    ("ssp-adaptive", {"wait_low": 0.5, "wait_high": 0.1}, "wait_low <= wait_high"),
])
def test_bad_arguments_say_what_is_allowed(name, args, message):
    with pytest.raises(ConfigError, match=message):
        create_policy(name, args)


# ---------------------------------------------------------------- DC-ASGD


def test_dc_asgd_rule_by_hand():
    # g + lam * g*g * (w_now - w_read), lam = 0.5
    out = rewrite(DCASGDPolicy(lam=0.5), t(1, 2, -1), now=t(0.5, 0.5, 0.5), read=t(0, 1, 0.5))
    assert torch.equal(out, t(1 + 0.5 * 1 * 0.5, 2 + 0.5 * 4 * -0.5, -1.0))
    assert DCASGDPolicy().decide(INFO) == Decision(True, 1.0)


def test_dc_asgd_without_a_read_snapshot_leaves_the_gradient():
    policy = DCASGDPolicy(lam=1.0)
    g = t(1, 2)
    assert torch.equal(policy.rewrite_gradient(INFO, {"w": g}, {"w": t(5, 5)}, None, 0.1)["w"], g)


def test_dc_asgd_adaptive_rule_by_hand():
    policy = DCASGDAdaptivePolicy(lam0=1.0, momentum=0.5, eps=1e-30)
    # MS_1 = 0.5 * 2^2 = 2; lambda = 1/sqrt(2); g + lambda * g^2 * 0.25
    out = rewrite(policy, t(2.0), now=t(0.25), read=t(0.0))
    assert out.item() == pytest.approx(2 + 4 * 0.25 / math.sqrt(2), rel=1e-12)
    # MS_2 = 0.5 * 2 + 0.5 * 1^2 = 1.5
    out = rewrite(policy, t(1.0), now=t(0.0), read=t(0.5))
    assert out.item() == pytest.approx(1 + 1 * -0.5 / math.sqrt(1.5), rel=1e-12)


# ---------------------------------------------------------------- Gap-Aware


def test_gap_aware_rule_by_hand():
    policy = GapAwarePolicy(beta=0.5)
    # v = 0.5 * g^2 = (2, 0.5); bias-corrected (1 - 0.5): (4, 1); C = lr * sqrt = (0.2, 0.1)
    # gap = |w_now - w_read| / C = (2, 0); g / (1 + gap)
    out = rewrite(policy, t(2, 1), now=t(0.4, 1.0), read=t(0.0, 1.0), lr=0.1)
    assert torch.allclose(out, t(2 / 3, 1.0), rtol=1e-9, atol=0)
    # v = 0.5 * (2, 0.5) + 0.5 * (1, 1) = (1.5, 0.75); / (1 - 0.25) = (2, 1)
    # C = 0.1 * (sqrt 2, 1); gaps (0.1 sqrt 2, 0.3) / C = (1, 3)
    out = rewrite(policy, t(1, 1), now=t(0.1 * math.sqrt(2), 0.0), read=t(0.0, 0.3), lr=0.1)
    assert torch.allclose(out, t(0.5, 0.25), rtol=1e-9, atol=0)


def test_gap_aware_without_bias_correction_by_hand():
    policy = GapAwarePolicy(beta=0.75, bias_correction=False)
    # v = 0.25 * 4^2 = 4; C = 0.5 * 2 = 1; gap = 3 -> 4 / 4
    out = rewrite(policy, t(4.0), now=t(1.0), read=t(-2.0), lr=0.5)
    assert out.item() == pytest.approx(1.0, rel=1e-12)


def test_gap_aware_leaves_a_fresh_gradient_exactly_alone():
    policy = GapAwarePolicy()
    g = t(0.3, -0.7, 0.0)
    assert torch.equal(rewrite(policy, g, now=t(1, 2, 3), read=t(1, 2, 3)), g)


# ---------------------------------------------------------------- through the core

KEYS = [SliceSpec("w", 3, "float64")]


def make_core(policy, mode="async", workers=2, s=0, lr=1.0):
    cfg = CoreConfig(mode=ModeSpec(mode, s), optimizer="sgd", optimizer_args={"lr": lr},
                     expected_workers=workers)
    core = ShardCore(KEYS, cfg, policy)
    for w in range(workers):
        core.register(w, f"inc{w}", now=0.0)
    core.initialize({"w": torch.zeros(3, dtype=torch.float64)})
    return core


def pull(core, worker, clock=0, now=0.0):
    core.request_pull(worker, clock, f"t{worker}", now)
    return [r.worker for r in core.ready_pulls(now)]


def test_core_hands_dc_asgd_the_weights_the_worker_read():
    core = make_core(DCASGDPolicy(lam=1.0))
    assert pull(core, 0) == [0] and pull(core, 1) == [1]  # both read w = 0 at version 0
    core.push(1, 1, 0, 0, 1, {"w": t(1, 1, 1)}, 0.0)  # fresh: w = -1
    assert torch.equal(core.params["w"], t(-1, -1, -1))
    # worker 0 read w = 0, w_now = -1: g' = 2 + 1 * 4 * (-1) = -2, so w = -1 + 2 = 1
    out = core.push(0, 1, 0, 0, 1, {"w": t(2, 2, 2)}, 0.0)
    assert out.staleness == 1
    assert torch.equal(core.params["w"], t(1, 1, 1))


def _stale_run(policy):
    """Three workers pushing stale gradients in a fixed interleaving; the final weights."""
    torch.manual_seed(0)
    core = make_core(policy, workers=3, lr=0.1)
    ids = [0, 0, 0]
    for step in range(12):
        for w in (step % 3, (step + 1) % 3):
            pull(core, w, clock=ids[w])
        w = (step + 2) % 3
        ids[w] += 1
        core.push(w, ids[w], ids[w] - 1, max(0, core.version - 2), 4,
                  {"w": torch.randn(3, dtype=torch.float64)}, float(step))
    return core.params["w"].clone()


def test_dc_asgd_with_lambda_zero_is_plain_asgd_exactly():
    plain = _stale_run(create_policy("none"))
    assert torch.equal(_stale_run(DCASGDPolicy(lam=0.0)), plain)
    assert not torch.equal(_stale_run(DCASGDPolicy(lam=5.0)), plain)  # the test can fail


class _Scripted(StalenessPolicy):
    """Returns the bounds it is given, one per call; records what the core measured."""

    name = "scripted-bound"

    def __init__(self, bounds):
        self.bounds, self.seen = list(bounds), []

    def decide(self, update):
        return Decision(True)

    def staleness_bound(self, stats):
        self.seen.append(stats)
        return self.bounds.pop(0) if len(self.bounds) > 1 else self.bounds[0]


def test_core_asks_the_policy_for_the_ssp_bound():
    policy = _Scripted([2])
    core = make_core(policy, mode="ssp", s=0)
    core.push(0, 1, 0, 0, 1, {"w": t(0, 0, 0)}, 0.0)
    core.push(0, 2, 1, 1, 1, {"w": t(0, 0, 0)}, 0.5)  # worker 0 at clock 2, worker 1 at 0
    assert pull(core, 0, clock=2, now=1.0) == [0]  # gap 2 <= 2, though the configured s is 0
    assert core.stats().staleness_bound == 2
    stats = policy.seen[-1]
    assert (stats.configured, stats.pushes, stats.staleness_sum, stats.min_clock,
            stats.max_clock, stats.live_workers) == (0, 2, 0, 0, 2, 2)


def test_core_bound_none_keeps_the_configured_one_and_bad_values_are_refused():
    core = make_core(_Scripted([None]), mode="ssp", s=0)
    core.push(0, 1, 0, 0, 1, {"w": t(0, 0, 0)}, 0.0)
    assert pull(core, 0, clock=1) == []  # gap 1 > s = 0
    core = make_core(_Scripted([-1]), mode="ssp", s=0)
    core.request_pull(0, 0, "t", 0.0)
    with pytest.raises(ConfigError, match="SSP bound -1"):
        core.ready_pulls(0.0)


def test_bound_policy_outside_ssp_is_ignored_with_a_warning(caplog):
    policy = _Scripted([0])
    with caplog.at_level(logging.WARNING, logger="paramserver.core.shard"):
        core = make_core(policy, mode="async")
    assert "no effect" in caplog.text
    core.push(0, 1, 0, 0, 1, {"w": t(0, 0, 0)}, 0.0)
    assert pull(core, 0, clock=1) == [0] and policy.seen == []


def test_core_measures_waiting_for_the_bound_rule():
    policy = _Scripted([0])
    core = make_core(policy, mode="ssp", s=0)
    core.push(0, 1, 0, 0, 1, {"w": t(0, 0, 0)}, 0.0)
    core.request_pull(0, 1, "t0", 1.0)  # held: worker 1 is still at clock 0
    assert core.ready_pulls(1.0) == []
    assert policy.seen[-1].blocked_pulls == 1
    core.push(1, 1, 0, 0, 1, {"w": t(0, 0, 0)}, 3.0)
    assert [r.worker for r in core.ready_pulls(3.0)] == [0]
    core.ready_pulls(3.0)
    assert policy.seen[-1].wait_seconds == pytest.approx(2.0)
    assert policy.seen[-1].pulls == 1 and policy.seen[-1].staleness_sum == 1


# ---------------------------------------------------------------- the adaptive bound rule


def stats(now, pushes, tau_sum, wait, configured=2, live=4):
    return BoundStats(now=now, configured=configured, current=0, live_workers=live,
                      min_clock=0, max_clock=0, pushes=pushes, staleness_sum=tau_sum,
                      pulls=pushes, wait_seconds=wait, blocked_pulls=0)


def test_adaptive_bound_rule_by_hand():
    rule = AdaptiveBound(s_min=1, s_max=3, window=10, wait_high=0.1, wait_low=0.02,
                         stale_high=4.0)
    assert rule.update(stats(0, 0, 0, 0.0)) == 2  # starts at the configured bound
    assert rule.update(stats(1, 5, 15, 0.9)) == 2  # window of 10 pushes not full yet
    # 10 pushes in 2 s, 4 workers, 1 s held: wait share 1/8 > 0.1 -> loosen
    assert rule.update(stats(2, 10, 30, 1.0)) == 3
    assert rule.update(stats(4, 20, 60, 2.0)) == 3  # again, but s_max is 3
    assert rule.update(stats(6, 30, 90, 2.0)) == 2  # no waiting (< 0.02): tighten
    # mean tau 13 over (4 - 1) = 4.3 > 4: tighten, though the waiting says loosen
    assert rule.update(stats(8, 40, 220, 3.0)) == 1
    assert rule.update(stats(10, 50, 250, 3.0)) == 1  # s_min
    # wait share 0.05, inside [wait_low, wait_high]: hold
    assert rule.update(stats(12, 60, 280, 3.4)) == 1
    assert [(w.before, w.after) for w in rule.history] == [(2, 3), (3, 3), (3, 2), (2, 1),
                                                           (1, 1), (1, 1)]
    assert rule.history[0].wait_share == pytest.approx(0.125)
    assert rule.history[3].stale_ratio == pytest.approx(13 / 3)


def test_adaptive_bound_default_window_is_four_pushes_per_live_worker():
    rule = AdaptiveBound(s_min=0, s_max=9, window=0)
    rule.update(stats(0, 0, 0, 0.0, configured=20, live=5))
    assert rule.bound == 9  # the configured bound, clipped
    assert rule.update(stats(1, 19, 0, 0.0, live=5)) == 9
    assert rule.update(stats(2, 20, 0, 0.0, live=5)) == 8


# ---------------------------------------------------------------- checkpoints


def test_tensor_state_round_trips_exactly_through_json():
    tensors = {"a": torch.randn(3, 2, dtype=torch.float64), "b": torch.randn(5)}
    back = decode_tensors(json.loads(json.dumps(encode_tensors(tensors))))
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())
    with pytest.raises(ConfigError, match="malformed"):
        decode_tensors({"a": {"dtype": "float32", "shape": [2], "data": "!!"}})


@pytest.mark.parametrize("make", [lambda: GapAwarePolicy(beta=0.9),
                                  lambda: DCASGDAdaptivePolicy(momentum=0.9)])
def test_policy_state_survives_a_checkpoint(make):
    torch.manual_seed(1)
    pushes = [(torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64))
              for _ in range(4)]
    policy = make()
    for g, d in pushes[:2]:
        rewrite(policy, g, now=d, read=torch.zeros(4, dtype=torch.float64))
    restored = make()
    restored.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    for g, d in pushes[2:]:
        zero = torch.zeros(4, dtype=torch.float64)
        assert torch.equal(rewrite(restored, g, d, zero), rewrite(policy, g, d, zero))


def test_core_checkpoint_metadata_with_research_policies_is_json():
    core = make_core(GapAwarePolicy())
    pull(core, 0)
    core.push(0, 1, 0, 0, 1, {"w": t(1, 2, 3)}, 0.0)
    tensors, meta = core.state_dict()
    assert "read/0/w" in tensors  # the read snapshot is checkpointed with the weights
    again = make_core(GapAwarePolicy())
    again.load_state_dict(tensors, json.loads(json.dumps(meta)), now=1.0)
    assert again.policy.state_dict() == core.policy.state_dict()


def test_adaptive_bound_state_survives_a_checkpoint():
    policy = AdaptiveBoundPolicy(s_min=1, s_max=6, window=4)
    policy.staleness_bound(stats(0, 0, 0, 0.0, configured=3))
    policy.staleness_bound(stats(1, 4, 0, 2.0))  # wait share 0.5: 3 -> 4
    restored = AdaptiveBoundPolicy(s_min=1, s_max=6, window=4)
    restored.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    assert restored.staleness_bound(stats(5, 0, 0, 0.0, configured=3)) == 4
