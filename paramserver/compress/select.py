"""Top-k's selection, exact and cheap: the k largest magnitudes of a slice.

``torch.topk`` over a whole slice is what top-k cost (about 22 ms for 2M float32 on
one thread, done by every worker on every push and by every shard on every
compressed pull). As Deep Gradient Compression does (Lin et al. 2018), a sample of
the magnitudes gives a threshold a little below the k-th largest; one vectorized
compare keeps the candidates at or above it (about 1.3 k of them), and the exact
selection runs on those alone. Unlike DGC's, the result is exact: the k-th largest
magnitude of the candidates is the slice's whenever they are k or more, and when
they are fewer (an unlucky sample) the whole slice is selected from, as before.

What is selected is fixed, whatever path found it (tests/test_compress.py holds it
equal to ``torch.topk`` and to a stable sort):

* every element whose magnitude is larger than the k-th largest magnitude ``t``;
* of those equal to ``t``, the ones of the lowest indices (``torch.topk`` leaves
  which of the tied ones it returns unspecified: its quickselect's order);
* NaN counts as larger than any number, ``inf`` included (as ``torch.topk`` has it).

The sample is a fixed one (a generator of a constant seed), so a slice's selection
depends on its values alone: runs stay deterministic. Pure: tensors in, tensors out.
"""

from __future__ import annotations

import math

import torch

__all__ = ["top_magnitudes"]

#: slices smaller than this select from the whole (the sample would save nothing)
SAMPLED_FROM = 1 << 15
#: magnitudes sampled for the threshold (with replacement, a fixed draw)
SAMPLE = 1 << 14
_SEED = 0x5EED_70C


def top_magnitudes(x: torch.Tensor, k: int) -> torch.Tensor:
    """The indices (int64, ascending) of the ``k`` elements of 1-D ``x`` of the largest
    magnitude, ties to the lowest indices (see the module's text)."""
    n = x.numel()
    if k >= n:
        return torch.arange(n)
    if k <= 0:
        return torch.empty(0, dtype=torch.int64)
    a = x.abs()
    if n >= SAMPLED_FROM and 8 * k <= n:
        got = _sampled(a, k)
        if got is not None:
            return got
    return _largest(a, k)


def _sampled(a: torch.Tensor, k: int) -> torch.Tensor | None:
    """The selection from the candidates above a sampled threshold; None where the
    sample was unlucky (too few candidates, or too many to gain)."""
    n = a.numel()
    idx = torch.randint(n, (SAMPLE,), generator=torch.Generator().manual_seed(_SEED))
    sample = a[idx]
    # the sample's expected count above the k-th largest, plus four of its standard
    # deviations: the threshold falls below the k-th largest but for ~3e-5 of slices
    mean = k * SAMPLE / n
    rank = min(SAMPLE, math.ceil(mean + 4 * math.sqrt(mean) + 4))
    thr = torch.topk(sample, rank, sorted=False).values.min()
    if bool(thr.isnan()):
        return None
    most = 4 * k + 1024  # (about 1.3 k expected)
    ge = torch.logical_not(a < thr)  # (NaN is a candidate: it is larger than any number)
    many = int(torch.count_nonzero(ge))  # (a third of a bool sum's time)
    if many < k:
        return None
    if many <= most:
        return _among(a, ge, k)
    # most of them tie at the threshold (a slice of few values): split there
    gt = torch.logical_not(a <= thr)
    above = int(torch.count_nonzero(gt))
    if above < k:  # the k-th largest is the threshold itself
        return _with_ties(gt, ge.logical_xor_(gt), k - above)
    return _among(a, gt, k) if above <= most else None


def _among(a: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """The selection from ``mask``'s elements, known to hold the k largest."""
    cand = mask.nonzero().reshape(-1)  # (ascending: ties keep the lowest indices)
    return cand[_largest(a[cand], k)]


def _largest(a: torch.Tensor, k: int) -> torch.Tensor:
    """Positions (ascending) of the k largest of ``a`` (k < its length), by the rule."""
    top = torch.topk(a, k, sorted=False).values
    nan = top.isnan()
    if bool(nan.all()):  # the k-th largest is NaN: the first k NaN
        return _with_ties(torch.zeros(a.shape, dtype=torch.bool), a.isnan(), k)
    t = top[~nan].min() if bool(nan.any()) else top.min()
    gt = a > t
    if bool(nan.any()):
        gt |= a.isnan()
    return _with_ties(gt, a == t, k - int(torch.count_nonzero(gt)))


def _with_ties(gt: torch.Tensor, eq: torch.Tensor, need: int) -> torch.Tensor:
    """Positions of ``gt`` and of the first ``need`` of ``eq`` (it holds at least as
    many), ascending; ``gt`` is written over."""
    if need > 0:
        end = _past_nth(eq, need)
        gt[:end] |= eq[:end]
    return gt.nonzero().reshape(-1)


_BLOCK = 4096


def _past_nth(mask: torch.Tensor, m: int) -> int:
    """The index just past ``mask``'s m-th True (m >= 1; it holds at least m), found
    by counts per block, so that no index list of all its Trues is made."""
    n = mask.numel()
    whole = n - n % _BLOCK
    counts = torch.count_nonzero(mask[:whole].reshape(-1, _BLOCK), dim=1)
    if whole < n:
        counts = torch.cat([counts, torch.count_nonzero(mask[whole:]).reshape(1)])
    cum = counts.cumsum(0)
    block = int(torch.searchsorted(cum, m))
    before = int(cum[block - 1]) if block else 0
    start = block * _BLOCK
    at = mask[start:start + _BLOCK].nonzero().reshape(-1)[m - before - 1]
    return start + int(at) + 1
