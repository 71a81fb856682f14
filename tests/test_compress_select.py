"""Top-k's sampled selection (paramserver/compress/select.py) selects what torch.topk
does, ties by its rule, whatever path it takes; the codecs' in-place arithmetic
(formats.add_into, formats.residual, int8, sign) gives the old formulas' bits."""

from __future__ import annotations

import pytest
import torch

from paramserver.compress import formats, parse_compression
from paramserver.compress import select as sel
from paramserver.compress.select import top_magnitudes

NAN, INF = float("nan"), float("inf")


def _rule(x: torch.Tensor, k: int) -> torch.Tensor:
    """The rule itself: a stable descending sort of the magnitudes (NaN first, ties in
    index order), its first k indices, ascending."""
    return torch.sort(x.abs(), descending=True, stable=True).indices[:k].sort().values


def _noise(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("n", [1, 5, 100, 20_000, 40_009])
def test_equal_to_torch_topk_on_noise(n: int) -> None:
    x = _noise(n, seed=n)
    order = torch.sort(x.abs(), descending=True, stable=True).indices
    for k in sorted({0, 1, 3, n // 100, n // 10, n // 3, n - 1, n}):
        got = top_magnitudes(x, k)
        assert got.dtype == torch.int64 and torch.equal(got, order[:k].sort().values), k
        if 0 < k < n and bool((x.abs() == x.abs()[got].min()).sum() == 1):  # no tie at t
            assert torch.equal(got, torch.topk(x.abs(), k).indices.sort().values), k


def test_the_sampled_path_is_taken_and_exact() -> None:
    x = _noise(1 << 19, seed=1)
    k = 5243
    got = sel._sampled(x.abs(), k)  # the ordinary case: no fall back to the whole slice
    assert got is not None and torch.equal(got, torch.topk(x.abs(), k).indices.sort().values)


@pytest.mark.parametrize("n", [1000, 50_000])
def test_ties_go_to_the_lowest_indices(n: int) -> None:
    x = torch.randint(-3, 4, (n,), generator=torch.Generator().manual_seed(2)).float()
    for k in (1, n // 100, n // 7, n // 2):
        got = top_magnitudes(x, k)
        assert torch.equal(got, _rule(x, k))
        # torch.topk's choice among the tied differs, its magnitudes do not
        want = torch.topk(x.abs(), k).values.sort().values
        assert torch.equal(x.abs()[got].sort().values, want)


@pytest.mark.parametrize("n", [7, 1 << 16])
def test_all_zero_and_all_equal_magnitudes_keep_the_first_k(n: int) -> None:
    k = max(1, n // 100)
    signs = torch.where(_noise(n) >= 0, 1.0, -1.0)
    for x in (torch.zeros(n), torch.full((n,), 1e-3), signs * 1e-3, -torch.zeros(n)):
        assert torch.equal(top_magnitudes(x, k), torch.arange(k))
    x = torch.full((n,), 1e-3)
    x[n - 1] = 2e-3  # one above the crowd, the rest of the first k tied
    assert torch.equal(top_magnitudes(x, k), torch.cat([torch.arange(k - 1),
                                                        torch.tensor([n - 1])]))


def test_few_values_and_mostly_zeros() -> None:
    n, k = 1 << 17, 1310
    x = torch.zeros(n)
    x[::257] = _noise(len(range(0, n, 257)), seed=3)  # 511 nonzeros < k: zeros fill
    got = top_magnitudes(x, k)
    assert torch.equal(got, _rule(x, k))
    assert set(range(0, n, 257)) <= set(got.tolist())
    # a slice of three levels, most of it at the k-th: split at it
    x = torch.full((n,), 2.0)
    x[:1000] = 3.0
    x[-50_000:] = 1.0
    assert torch.equal(top_magnitudes(x, k), torch.arange(k))
    assert sel._sampled(x.abs(), k) is not None
    # a crowd at the sampled threshold, k to 4 k above it: selected from those above
    x = torch.full((n,), 2.0)
    m = 12 * n // 1000  # (about 1.2 k)
    x[n - m:] = 3.0 + _noise(m, seed=10).abs()
    got = sel._sampled(x.abs(), k)
    assert got is not None and torch.equal(got, _rule(x, k))


def test_an_unlucky_sample_falls_back_to_the_whole_slice() -> None:
    n, k = 1 << 18, 1 << 15
    idx = torch.randint(n, (sel.SAMPLE,), generator=torch.Generator().manual_seed(sel._SEED))
    x = _noise(n, seed=4) * 1e-3
    x[idx] = 10 + _noise(sel.SAMPLE, seed=5).abs()  # every sampled one large, < k of them
    assert sel._sampled(x.abs(), k) is None
    assert torch.equal(top_magnitudes(x, k), _rule(x, k))
    x = 10 + _noise(n, seed=11).abs()  # every sampled one least: far too many above
    x[idx] = 0.0
    k = n // 100
    assert sel._sampled(x.abs(), k) is None
    assert torch.equal(top_magnitudes(x, k), _rule(x, k))


@pytest.mark.parametrize("n", [1000, 1 << 16])
def test_nan_counts_above_inf_above_numbers(n: int) -> None:
    x = _noise(n, seed=6)
    x[[3, n // 2]] = NAN
    x[[5, n - 1]] = -INF
    for k in (1, 2, 3, 4, max(5, n // 100)):
        got = top_magnitudes(x, k)
        assert torch.equal(got, _rule(x, k)), k
        assert torch.equal(got, torch.topk(x.abs(), k).indices.sort().values), k
    y = torch.full((n,), NAN)
    assert torch.equal(top_magnitudes(y, 3), torch.arange(3))


def test_topk_compressor_sends_the_selection() -> None:
    x = _noise(1 << 17, seed=7)
    parts = parse_compression("topk:ratio=0.01").compressor.compress(x, 0)
    out = formats.decode("k", parts, x.numel(), x.dtype)
    kept = out.nonzero().reshape(-1)
    assert torch.equal(kept, top_magnitudes(x, 1311)) and torch.equal(out[kept], x[kept])


# ------------------------------------------------------------------ the same bits

def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _slices() -> list[torch.Tensor]:
    x = _noise(40_001, seed=8)
    x[:40] = 0.0
    x[40:80] = -0.0  # a -0.0 the dense addition turns into +0.0
    x[100] = NAN
    return [x]


@pytest.mark.parametrize("spec", ["int8", "topk:ratio=0.01", "randomk:ratio=0.05", "sign",
                                  "none", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_add_into_and_residual_are_the_dense_formulas(spec: str, dtype: torch.dtype) -> None:
    (x,) = _slices()
    finite = torch.nan_to_num(x, nan=0.5)
    comp = parse_compression(spec).compressor
    parts = comp.compress(finite.to(dtype), 3)
    for out in (x.to(dtype), finite.to(dtype)):
        dense = out + formats.decode("k", parts, out.numel(), out.dtype)
        formats.add_into("k", parts, out)
        assert torch.equal(_bits(out), _bits(dense)), spec
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    for reuse in (False, True):
        xs = finite.to(dtype)
        want = xs.to(wide) - formats.decode("k", parts, xs.numel(), wide)
        was = xs.clone()
        left = formats.residual("k", parts, xs if not reuse else xs.to(wide, copy=True),
                                wide, reuse=reuse)
        assert torch.equal(_bits(left), _bits(want)) and torch.equal(_bits(xs), _bits(was))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_int8_and_sign_give_the_old_formulas_bits(dtype: torch.dtype) -> None:
    for x in (_noise(5001, seed=9, dtype=dtype), torch.zeros(64, dtype=dtype),
              -torch.zeros(64, dtype=dtype)):
        top = float(x.abs().max())
        scale = top / 127
        q = (x / scale).round().clamp(-127, 127) if scale else torch.zeros_like(x)
        parts = parse_compression("int8").compressor.compress(x, 0)
        assert torch.equal(parts["q"].view(torch.int8), q.to(torch.int8))
        assert torch.equal(_bits(parts["s"]), _bits(torch.tensor([scale])))
        want = parts["q"].view(torch.int8).to(dtype) * float(parts["s"][0])
        assert torch.equal(_bits(formats.decode("k", parts, x.numel(), dtype)), _bits(want))
        sign = parse_compression("sign").compressor.compress(x, 0)
        s = float(sign["s"][0])
        bits = ((sign["b"].unsqueeze(1) >> formats._SHIFTS) & 1).reshape(-1)[:x.numel()]
        want = (bits.to(dtype) * 2 - 1) * s
        assert torch.equal(_bits(formats.decode("k", sign, x.numel(), dtype)), _bits(want))
