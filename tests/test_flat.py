"""One flat buffer per shard and dtype (paramserver/util/flat.py): views, flat steps
equal per-slice steps, checkpoints keep their per-slice format."""

from __future__ import annotations

import pytest
import torch

from paramserver.core import corestate as core_module
from paramserver.core.shard import CoreConfig, ModeSpec, ShardCore, SliceSpec

SLICES = [SliceSpec("w", 12, "float32"), SliceSpec("h", 3, "float64"),
          SliceSpec("b", 5, "float32")]


def _core(mode: str, optimizer: str, workers: int = 2) -> ShardCore:
    cfg = CoreConfig(mode=ModeSpec(mode), expected_workers=workers, optimizer=optimizer,
                     optimizer_args={"lr": 0.05, **({"momentum": 0.9}
                                                     if optimizer == "sgd" else {})})
    core = ShardCore(SLICES, cfg)
    for w in range(workers):
        core.register(w, f"i{w}", 0.0)
    core.initialize({"w": torch.linspace(-1, 1, 12), "h": torch.ones(3, dtype=torch.float64),
                     "b": torch.zeros(5)})
    return core


def _grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(12, generator=g), "h": torch.randn(3, generator=g).double(),
            "b": torch.randn(5, generator=g)}


def test_slices_are_views_of_one_buffer_per_dtype() -> None:
    core = _core("sync", "sgd")
    assert sorted(str(d) for d in core.flats) == ["torch.float32", "torch.float64"]
    flat32 = core.flats[torch.float32]
    assert flat32.numel() == 17
    assert core.params["w"].untyped_storage().data_ptr() == \
        core.params["b"].untyped_storage().data_ptr() == flat32.untyped_storage().data_ptr()
    assert core.stepper.flat is not None  # the optimizer steps the two flat tensors
    old, old_ptr = core.params["w"].clone(), flat32.data_ptr()
    core.copy_on_write()  # fresh storage, and still one buffer
    assert core.params["w"].untyped_storage().data_ptr() == \
        core.flats[torch.float32].untyped_storage().data_ptr() != old_ptr
    assert torch.equal(core.params["w"], old)


@pytest.mark.parametrize(("mode", "optimizer"), [("sync", "sgd"), ("sync", "adam"),
                                               ("async", "adam")])
def test_flat_steps_equal_per_slice_steps(monkeypatch: pytest.MonkeyPatch, mode: str,
                                         optimizer: str) -> None:
    core = _core(mode, optimizer)
    monkeypatch.setattr(core_module, "ELEMENTWISE", frozenset())  # the per-slice optimizer
    ref = _core(mode, optimizer)
    assert core.stepper.flat is not None and ref.stepper.flat is None
    for step in range(4):
        a, b = _grads(2 * step), _grads(2 * step + 1)
        for c in (core, ref):
            c.push(0, step + 1, step, c.version, 1, a, 0.0)
            c.push(1, step + 1, step, c.version, 3, b, 0.0)
    assert core.version == ref.version == (4 if mode == "sync" else 8)
    for k, p in ref.params.items():
        assert torch.equal(core.params[k], p), k


def test_checkpoint_of_a_flat_optimizer_is_per_slice_and_resumes() -> None:
    a = _core("async", "adam", workers=1)
    for i in range(3):
        a.push(0, i + 1, i, a.version, 1, _grads(i), 0.0)
    tensors, meta = a.state_dict()
    assert a.stepper.flat is not None
    # one entry per slice, as checkpoints always held
    assert {k for k in tensors if k.startswith("optim/") and k.endswith("/exp_avg")} == \
        {"optim/0/exp_avg", "optim/1/exp_avg", "optim/2/exp_avg"}
    assert tensors["optim/1/exp_avg"].shape == (3,)
    b = _core("async", "adam", workers=1)
    b.load_state_dict(tensors, meta, 0.0)
    for c in (a, b):
        c.push(0, 4, 3, c.version, 1, _grads(9), 0.0)
    for k in a.params:
        assert torch.equal(a.params[k], b.params[k]), k
