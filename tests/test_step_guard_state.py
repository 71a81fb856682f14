"""No worker can freeze a stateful server optimizer (issue 42, item 7).

Momentum, delayed Nesterov's pending sum and Adam's moments remember every input and
apply it again at later steps: on main three pushes near 1e38 left a state from which
every later momentum step overflowed, was undone, and was met again, so no push of
anyone applied after. The step guard now refuses an input past the dtype's input
limit before the step runs: the weights and the whole optimizer state (moments,
pending sum, step counters) are left exactly as they were, and the honest pushes that
follow apply as if the hostile ones had never come. Pure core: no sockets.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from paramserver.core.shard import CoreConfig, ModeSpec, ShardCore, SliceSpec
from paramserver.core.sharding import ParamSpec, ShardPlan

PLAN = ShardPlan([ParamSpec("w", (24,), "float32"), ParamSpec("b", (4,), "float32")], 1)
HOSTILE = (1e38, 4e37, 6e37)  # finite in float32, each step of them finite too
HONEST = 40

OPTIMIZERS = [
    ("delayed-nesterov", {"lr": 0.7, "momentum": 0.9, "delay": 2}),
    ("delayed-nesterov", {"lr": 0.7, "momentum": 0.9, "delay": 4}),
    ("sgd", {"lr": 0.7, "momentum": 0.9}),
    ("sgd", {"lr": 0.7, "momentum": 0.9, "nesterov": True}),
    ("adam", {"lr": 0.1}),
    ("rmsprop", {"lr": 0.01, "momentum": 0.9}),
]


def _core(optimizer: str, args: dict[str, Any]) -> ShardCore:
    slices = [SliceSpec(s.key, s.numel, s.dtype) for s in PLAN.shard_slices(0)]
    core = ShardCore(slices, CoreConfig(mode=ModeSpec("async"), optimizer=optimizer,
                                        optimizer_args=dict(args)))
    core.register(0, "hostile", 0.0)
    core.register(1, "honest", 0.0)
    core.initialize({s.key: torch.linspace(-1, 1, s.numel) for s in slices})
    return core


def _push(core: ShardCore, worker: int, grads: dict[str, torch.Tensor]) -> Any:
    state = core.workers[worker]
    return core.push(worker, state.last_push_id + 1, state.clock, core.version, 1,
                     {k: g.clone() for k, g in grads.items()}, 0.0)


def _honest(i: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(i)
    return {s.key: torch.randn(s.numel, generator=gen) * 0.01 for s in PLAN.shard_slices(0)}


def _state(core: ShardCore) -> dict[str, Any]:
    """The weights and the optimizer's whole state, step counters included, as values."""
    def plain(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.clone()
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list):
            return [plain(x) for x in v]
        return v
    return {"params": {k: p.detach().clone() for k, p in core.params.items()},
            "optimizer": plain(core.stepper.state_dict()["state"])}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k])
                                                                     for k in a)
    return bool(a == b)


@pytest.mark.parametrize(("optimizer", "args"), OPTIMIZERS,
                         ids=[f"{o}-{'-'.join(map(str, a.values()))}" for o, a in OPTIMIZERS])
def test_a_worker_cannot_freeze_a_stateful_optimizer(optimizer: str,
                                                     args: dict[str, Any]) -> None:
    clean, attacked = _core(optimizer, args), _core(optimizer, args)
    for i in range(3):  # some state first: the refusal must keep it, not reset it
        _push(clean, 1, _honest(i))
        _push(attacked, 1, _honest(i))
    before = _state(attacked)
    for value in HOSTILE:
        out = _push(attacked, 0, {k: torch.full_like(p, value)
                                  for k, p in attacked.params.items()})
        assert not out.accepted and out.reason == "nonfinite_step"
    # refused before it ran: momentum, pending sum, moments and step counters as they were
    assert _same(_state(attacked), before)
    assert attacked.version == clean.version == 3
    for i in range(3, 3 + HONEST):  # every honest push after applies, as if alone
        a, b = _push(clean, 1, _honest(i)), _push(attacked, 1, _honest(i))
        assert b.accepted and a.accepted
    assert attacked.version == clean.version == 3 + HONEST
    assert _same(_state(attacked), _state(clean))


def test_a_huge_input_between_honest_ones_is_refused_each_time() -> None:
    """The refusal is per input: hostile and honest pushes interleaved, every honest one
    applies and every hostile one is refused, however long it goes on."""
    core = _core("delayed-nesterov", {"lr": 0.7, "momentum": 0.9, "delay": 2})
    huge = {k: torch.full_like(p, 1e38) for k, p in core.params.items()}
    for i in range(20):
        assert not _push(core, 0, huge).accepted
        assert _push(core, 1, _honest(i)).accepted
    assert core.version == 20 and core.stepper.refused == 20


def test_ordinary_large_gradients_still_step() -> None:
    """The input limit is far above any gradient training makes (float32: 1.8e19)."""
    core = _core("sgd", {"lr": 1e-12, "momentum": 0.9})
    big = {k: torch.full_like(p, 1e15) for k, p in core.params.items()}
    assert all(_push(core, 1, big).accepted for _ in range(5))
    assert core.version == 5
