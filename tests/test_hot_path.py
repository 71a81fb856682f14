"""The small-message fast paths give what the general paths give.

Each fast path (a small message packed in one pass, a packed frame's 1-D views
made with one split, slices back to back measured as one span, pulled slices
landed by memmove) is compared with the general path it stands in for, on the
cases it takes and the cases it must leave to that path.
"""

from __future__ import annotations

import math

import pytest
import torch

from paramserver.core.probe import Probe, PushMeasure, span, total_norm
from paramserver.core.sharding import ParamSpec, ShardPlan
from paramserver.wire import frames
from paramserver.wire.protocol import Message, Op, decode, encode


def _push(tensors: dict[str, torch.Tensor]) -> Message:
    return Message(Op.PUSH, 3, {"worker": 0, "push_id": 1, "clock": 0, "read_version": 0,
                                "num_samples": 1}, tensors)


def _bytes(frames: list) -> list[bytes]:
    return [bytes(f) for f in frames]


@pytest.mark.parametrize("tensors", [
    {f"g{i}": torch.full((5 + i,), float(i)) for i in range(6)},  # separate slices
    {"a": torch.ones(3, 4), "b": torch.arange(7.0)[::2], "c": torch.zeros(())},  # 2-D, strided
])
def test_a_small_message_packs_as_the_general_path_does(
        tensors: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> None:
    fast = _bytes(encode(_push(tensors)))
    assert len(fast) == 2  # one header, one packed frame
    monkeypatch.setattr(frames, "_pack_small", lambda tensors: None)
    assert fast == _bytes(encode(_push(tensors)))


def test_the_fast_packing_leaves_runs_mixed_dtypes_and_large_tensors_alone() -> None:
    buf = torch.arange(12.0)
    run = {"a": buf[:4], "b": buf[4:8], "c": torch.ones(3)}  # a and b back to back
    assert frames._pack_small(run) is None
    assert frames._pack_small({"a": torch.ones(3), "b": torch.ones(3, dtype=torch.float64)}) \
        is None
    big = frames.PACK_BYTES // 4
    assert frames._pack_small({"a": torch.ones(3), "b": torch.ones(big)}) is None
    assert frames._pack_small({"a": torch.ones(3), "b": torch.ones(0)}) is None
    # and what they become still decodes to the same values
    got = decode(encode(_push(run))).tensors
    assert all(torch.equal(got[k], v.reshape(-1)) for k, v in run.items())


def test_packed_one_dimensional_entries_decode_to_consecutive_views() -> None:
    tensors = {f"g{i}": torch.full((3 + i,), float(i)) for i in range(4)}
    got = decode(encode(_push(tensors))).tensors
    assert list(got) == list(tensors)
    for key, t in tensors.items():
        assert torch.equal(got[key], t)
    ptrs = [t.data_ptr() for t in got.values()]
    sizes = [t.nbytes for t in got.values()]
    assert all(ptrs[i] + sizes[i] == ptrs[i + 1] for i in range(len(ptrs) - 1))


def test_span_only_for_tensors_back_to_back_in_one_buffer() -> None:
    buf = torch.arange(10.0)
    parts = [buf[0:3], buf[3:7], buf[7:10]]
    whole = span(parts)
    assert whole is not None and torch.equal(whole, buf)
    assert span([buf[0:3], buf[4:7]]) is None  # a gap
    assert span([buf[3:7], buf[0:3]]) is None  # out of order
    assert span([buf[0:3], buf[3:3], buf[3:5]]) is None  # an empty one
    assert span([buf[0:3]]) is None  # one tensor: nothing to join
    assert span([torch.ones(3), torch.ones(3)]) is None  # separate buffers
    assert span([buf[0:3], buf.double()[3:5]]) is None  # another dtype


def test_total_norm_over_a_span_equals_the_sum_over_slices() -> None:
    buf = torch.randn(1000)
    parts = [buf[i:i + 100] for i in range(0, 1000, 100)]
    want = math.sqrt(sum(float(p.norm()) ** 2 for p in parts))
    assert total_norm(parts) == pytest.approx(want, rel=1e-6)
    buf[555] = float("nan")
    assert math.isnan(total_norm(parts))
    buf[555] = float("inf")
    assert total_norm(parts) == math.inf


def test_a_norm_past_the_dtype_range_is_still_summed_in_double() -> None:
    buf = torch.full((4,), 3e38)  # each slice's norm is finite, the span's is not
    got = total_norm([buf[:1], buf[1:2], buf[2:3], buf[3:]])
    assert math.isfinite(got) and got == pytest.approx(6e38, rel=1e-6)


def _measured(grads: dict[str, torch.Tensor]) -> tuple[PushMeasure, torch.Tensor]:
    flat = torch.zeros(12)
    params = {"a": flat[:4], "b": flat[4:9], "c": flat[9:]}
    probe = Probe(params)
    probe.observe(lambda stats: None)
    first = PushMeasure()
    probe._measure(first, {k: torch.ones_like(v) for k, v in params.items()}, None)
    m = PushMeasure()
    probe._measure(m, grads, None)
    assert probe._grad_ema is not None
    return m, probe._grad_ema.clone()


def test_the_probe_measures_a_span_as_it_measures_separate_slices() -> None:
    values = torch.randn(12)
    packed = {"a": values[:4], "b": values[4:9], "c": values[9:]}  # one buffer: a span
    apart = {k: v.clone() for k, v in packed.items()}  # separate tensors
    assert span(list(packed.values())) is not None and span(list(apart.values())) is None
    m1, ema1 = _measured(packed)
    m2, ema2 = _measured(apart)
    assert m1.exact_sq == pytest.approx(m2.exact_sq, rel=1e-6)
    assert m1.sampled_sq == pytest.approx(m2.sampled_sq, rel=1e-6)
    assert m1.dot == pytest.approx(m2.dot, rel=1e-6)
    assert torch.allclose(ema1, ema2)


def _plan() -> ShardPlan:
    return ShardPlan([ParamSpec("w", (3, 4), "float32"), ParamSpec("b", (5,), "float32")], 2,
                     chunk_bytes=16)


def test_pulled_slices_land_by_memmove_as_by_copy() -> None:
    plan = _plan()
    source = {"w": torch.randn(3, 4), "b": torch.randn(5)}
    slices = {k: v.clone() for part in plan.split_tensors(source).values()
              for k, v in part.items()}
    direct = {"w": torch.zeros(3, 4), "b": torch.zeros(5)}
    plan.assemble_into(direct, slices)
    # a non-contiguous target takes the general path
    strided = {"w": torch.zeros(4, 3).t(), "b": torch.zeros(5)}
    plan.assemble_into(strided, slices)
    for name, want in source.items():
        assert torch.equal(direct[name], want)
        assert torch.equal(strided[name], want)


def test_a_whole_parameter_slice_is_the_parameter_itself() -> None:
    plan = ShardPlan([ParamSpec("w", (6,), "float32")], 1)
    grad = torch.arange(6.0)
    (only,) = plan.split_tensors({"w": grad})[0].values()
    assert only.data_ptr() == grad.data_ptr() and torch.equal(only, grad)
