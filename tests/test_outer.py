"""Delayed Nesterov (Liu et al. 2024), the outer rule for asynchronous local SGD:
checked against a hand-written replay of the rule, against torch's SGD where the two
coincide, and through state_dict and the optimizer registry."""

from __future__ import annotations

import pytest
import torch

from paramserver.core.optim import build_optimizer, optimizer_parameters, resolve_optimizer
from paramserver.core.outer import DelayedNesterov

STEPS = 11  # not a multiple of the delays below: the run ends mid-cycle


def _grads(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(5, generator=gen, dtype=torch.float64) for _ in range(STEPS)]


def _reference(grads: list[torch.Tensor], lr: float, mu: float, delay: int,
               nesterov: bool) -> list[list[float]]:
    """The rule element by element in plain floats: momentum on the mean of the
    pseudo-gradients every ``delay``-th step, a plain SGD step on each one otherwise."""
    n = len(grads[0])
    p, m, acc = [1.0] * n, [0.0] * n, [0.0] * n
    out = []
    for t, g in enumerate(grads, start=1):
        gl = g.tolist()
        acc = [a + x for a, x in zip(acc, gl, strict=True)]
        if t % delay == 0:
            new_m = [mu * mi + a / delay for mi, a in zip(m, acc, strict=True)]
            look = new_m if nesterov else m
            p = [pi - lr * (x + mu * li) for pi, x, li in zip(p, gl, look, strict=True)]
            m, acc = new_m, [0.0] * n
        else:
            p = [pi - lr * x for pi, x in zip(p, gl, strict=True)]
        out.append(p)
    return out


def _run(opt_factory, grads: list[torch.Tensor]) -> list[list[float]]:
    w = torch.ones(5, dtype=torch.float64, requires_grad=True)
    opt = opt_factory([w])
    out = []
    for g in grads:
        w.grad = g.clone()
        opt.step()
        out.append(w.detach().tolist())
    return out


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("delay", [2, 4])
def test_matches_the_hand_written_rule(delay: int, nesterov: bool) -> None:
    grads = _grads()
    got = _run(lambda p: DelayedNesterov(p, lr=0.5, momentum=0.9, delay=delay,
                                         nesterov=nesterov), grads)
    want = _reference(grads, 0.5, 0.9, delay, nesterov)
    assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-12)
    # between momentum steps it is plain SGD: step 1 moves by exactly lr * g
    assert got[0] == pytest.approx([1.0 - 0.5 * x for x in grads[0].tolist()], abs=1e-15)


@pytest.mark.parametrize("nesterov", [True, False])
def test_delay_one_is_torch_sgd_with_momentum(nesterov: bool) -> None:
    grads = _grads(1)
    got = _run(lambda p: DelayedNesterov(p, lr=0.3, momentum=0.8, delay=1,
                                         nesterov=nesterov), grads)
    want = _run(lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.8, nesterov=nesterov), grads)
    assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-12)


def test_zero_momentum_is_plain_sgd() -> None:
    grads = _grads(2)
    got = _run(lambda p: DelayedNesterov(p, lr=0.3, momentum=0.0, delay=3), grads)
    want = _run(lambda p: torch.optim.SGD(p, lr=0.3), grads)
    assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-12)


def test_state_dict_resumes_mid_cycle() -> None:
    """A checkpoint taken between momentum steps keeps the pending sum and the count."""
    grads = _grads(3)
    whole = _run(lambda p: DelayedNesterov(p, lr=0.5, momentum=0.9, delay=4), grads)
    w = torch.ones(5, dtype=torch.float64, requires_grad=True)
    first = DelayedNesterov([w], lr=0.5, momentum=0.9, delay=4)
    for g in grads[:6]:  # 6 % 4 == 2: mid-cycle
        w.grad = g.clone()
        first.step()
    state = first.state_dict()
    assert state["state"][0]["step"] == 6 and state["state"][0]["pending"].abs().sum() > 0
    again = DelayedNesterov([w], lr=0.5, momentum=0.9, delay=4)
    again.load_state_dict(state)
    for g in grads[6:]:
        w.grad = g.clone()
        again.step()
    assert w.detach().tolist() == pytest.approx(whole[-1], abs=1e-12)


def test_registered_by_name_with_typed_arguments() -> None:
    assert resolve_optimizer("delayed-nesterov") is DelayedNesterov
    assert optimizer_parameters("delayed-nesterov") == {
        "lr": 0.7, "momentum": 0.9, "delay": 4, "nesterov": True}
    w = torch.zeros(2, requires_grad=True)
    opt = build_optimizer("Delayed-Nesterov", [w], {"lr": "0.5", "delay": "3"})
    assert isinstance(opt, DelayedNesterov) and opt.defaults["delay"] == 3
    with pytest.raises(ValueError, match="delay"):
        DelayedNesterov([w], delay=0)
