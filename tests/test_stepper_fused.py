"""Plain SGD stepped as one fused in-place op: the same bits as torch.optim.SGD's step,
the same (empty) optimizer state, and torch.optim wherever anything more is asked."""

from __future__ import annotations

import pytest
import torch

from paramserver.core.probe import Probe
from paramserver.core.records import CoreConfig
from paramserver.core.stepper import Stepper, is_plain_sgd


def _step(stepper: Stepper, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
          weight: float) -> None:
    stepper.step(params, grads, weight, contributors=1, version=0, staleness=0,
                 prior_staleness=0, probe=Probe(params), before_step=None)


def _pair(**config: object) -> tuple[Stepper, Stepper, dict[str, torch.Tensor],
                                      dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    a = {f"w{i}": torch.randn(n) for i, n in enumerate((3, 17, 256))}
    b = {k: v.clone() for k, v in a.items()}
    cfg = CoreConfig(**config)  # type: ignore[arg-type]
    return Stepper(cfg, list(a.values())), Stepper(cfg, list(b.values())), a, b


def test_plain_sgd_is_fused_and_bitwise_equal_to_torch_optim() -> None:
    fused, reference, a, b = _pair(optimizer="sgd", optimizer_args={"lr": 0.037})
    assert fused.fused and is_plain_sgd(fused.optimizer)
    reference.fused = False  # the torch.optim path, for comparison
    calls = []
    handle = reference.optimizer.register_step_post_hook(lambda *_: calls.append(1))
    assert not is_plain_sgd(reference.optimizer)  # a hook wants step() to run
    for step in range(5):
        grads = {k: torch.randn_like(v) for k, v in a.items()}
        weight = 0.5 if step % 2 else 1.0  # a policy's weight scales the learning rate
        _step(fused, a, grads, weight)
        _step(reference, b, {k: g.clone() for k, g in grads.items()}, weight)
        for k in a:
            assert torch.equal(a[k], b[k])
    assert len(calls) == 5  # the reference really went through optimizer.step()
    handle.remove()
    assert fused.lr == pytest.approx(0.037)  # the weighted rate is restored
    assert all(p.grad is None for p in a.values())
    # no state either way: a checkpoint of the optimizer is the same
    assert fused.optimizer.state_dict() == reference.optimizer.state_dict()


@pytest.mark.parametrize("args", [{"lr": 0.1, "momentum": 0.9}, {"lr": 0.1, "weight_decay": 1e-4},
                                  {"lr": 0.1, "maximize": True}])
def test_anything_more_than_plain_sgd_goes_through_torch_optim(args: dict[str, float]) -> None:
    stepper, _, a, _ = _pair(optimizer="sgd", optimizer_args=args)
    assert not is_plain_sgd(stepper.optimizer)
    _step(stepper, a, {k: torch.ones_like(v) for k, v in a.items()}, 1.0)
    if args.get("momentum"):
        assert stepper.optimizer.state_dict()["state"]  # torch.optim kept its buffers


def test_a_scheduler_keeps_torch_optim() -> None:
    stepper, _, _, _ = _pair(optimizer="sgd", optimizer_args={"lr": 0.1}, scheduler="step",
                             scheduler_args={"step_size": 1})
    assert not stepper.fused


def test_a_sync_rounds_division_is_folded_into_the_fused_step() -> None:
    """A sync round hands its sums and sample count: the fused step scales its rate by
    1 / samples (no pass to divide), torch.optim divides the sums first (the same
    tensors the round holds, as before); both land on the mean's step."""
    fused, reference, a, b = _pair(optimizer="sgd", optimizer_args={"lr": 0.037})
    reference.fused = False
    reference.optimizer.register_step_post_hook(lambda *_: None)  # not plain SGD for it
    sums = {k: torch.randn_like(v) * 96 for k, v in a.items()}
    held = {k: g.clone() for k, g in sums.items()}
    original = {k: g.clone() for k, g in sums.items()}
    before = {k: v.clone() for k, v in a.items()}
    for stepper, params, grads in ((fused, a, sums), (reference, b, held)):
        stepper.step(params, grads, 1.0, contributors=2, version=0, staleness=0,
                     prior_staleness=0, probe=Probe(params), before_step=None, divisor=96.0)
    for k in a:
        want = before[k] - 0.037 * (sums[k] / 96.0)
        assert torch.allclose(a[k], want, rtol=1e-6, atol=1e-7)
        assert torch.allclose(b[k], want, rtol=1e-6, atol=1e-7)
    for k in sums:
        assert torch.equal(sums[k], original[k])  # the fused step left the sums alone
        assert torch.equal(held[k], original[k] / 96.0)  # torch.optim's were divided


def test_the_probe_measures_the_mean_not_the_sums() -> None:
    params = {"w": torch.zeros(1000)}
    probe = Probe(params, sync=True)
    seen = []
    probe.observe(seen.append, cosine_decay=None)
    stepper = Stepper(CoreConfig(optimizer="sgd", optimizer_args={"lr": 0.5}),
                      list(params.values()))
    sums = {"w": torch.full((1000,), 8.0)}
    stepper.step(params, sums, 1.0, contributors=2, version=0, staleness=0,
                 prior_staleness=0, probe=probe, before_step=None, divisor=4.0)
    probe.flush()
    step = seen[-1]
    # the mean gradient is 2.0 everywhere: a step of 0.5 * 2.0 on 1000 weights
    assert torch.equal(params["w"], torch.full((1000,), -1.0))
    assert step.update_norm == pytest.approx(0.5 * 2.0 * 1000 ** 0.5, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_guards_largest_magnitude_is_the_inf_norm_and_keeps_nan(dtype: torch.dtype) -> None:
    from paramserver.core.stepper import _largest

    torch.manual_seed(1)
    flat = torch.randn(300, dtype=dtype)
    parts = list(flat.split([100, 150, 50]))  # back to back: one span
    apart = [torch.randn(n, dtype=dtype) for n in (7, 0, 40)]  # separate tensors
    for tensors in (parts, apart):
        want = max(float(torch.linalg.vector_norm(t.double(), float("inf")))
                   for t in tensors if t.numel())
        assert _largest(tensors) == want
    lows = [torch.tensor([-9.0, 1.0], dtype=dtype), torch.tensor([3.0], dtype=dtype)]
    assert _largest(lows) == 9.0  # a negative end is the largest magnitude
    assert _largest([torch.tensor([1.0, float("-inf")], dtype=dtype)]) == float("inf")
    for at in (0, 150, 299):  # a NaN anywhere, in any part, is never lost
        bad = flat.clone()
        bad[at] = float("nan")
        assert _largest(list(bad.split([100, 150, 50]))) != _largest(parts)
        assert torch.tensor(_largest(list(bad.split([100, 150, 50])))).isnan()
        assert torch.tensor(_largest([torch.ones(3, dtype=dtype), bad[at:at + 1]])).isnan()
