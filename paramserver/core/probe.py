"""What a shard measures of its pushes and steps: the figures the watchdog reads.

A :class:`Probe` belongs to one :class:`~paramserver.core.shard.ShardCore`. It is off
until a driver calls :meth:`Probe.observe`; then it reports each (sampled)
push's :class:`GradStats` (norm, cosine to a running mean gradient) and each
optimizer step's :class:`StepStats` (update and weight norms, learning rate).
Large shards are measured on every k-th element (k prime), so what observing
holds stays ~2 x 256 KiB instead of two copies of the shard. The probe decides
nothing: the core's rules never read what it measures.

Also here: the norms the core uses to check that a gradient is finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from paramserver.errors import ConfigError
from paramserver.util.dtypes import NARROW_DTYPES

__all__ = ["GradStats", "MeasureBudget", "Probe", "PushMeasure", "StepStats", "all_finite", "l2",
           "norm_and_span", "sample", "sample_stride", "span", "total_norm"]

_OBSERVE_ELEMENTS = 1 << 22  # shards up to this size are measured on every push (observe)
#: above this many elements, the cosine and the update of a non-SGD step are measured on
#: every k-th element (k prime, so that it does not line up with a tensor's rows), which
#: keeps what observing holds to ~2 x 256 KiB instead of two copies of the shard
_SAMPLE_ELEMENTS = 1 << 16
_CAT_ELEMENTS = 1 << 16  # up to this many, a push's slices are measured as one flat copy


def sample_stride(numel: int) -> int:
    """1 up to _SAMPLE_ELEMENTS; above, the smallest prime >= numel / _SAMPLE_ELEMENTS."""
    k = -(-numel // _SAMPLE_ELEMENTS)
    if k <= 1:
        return 1
    while any(k % d == 0 for d in range(2, math.isqrt(k) + 1)):
        k += 1
    return k


def sample(t: torch.Tensor, stride: int) -> torch.Tensor:
    """Every ``stride``-th element of ``t`` (a view; a 1-D tensor is not reshaped:
    a gradient slice, a few us per push saved)."""
    flat = t.detach()
    if flat.dim() != 1:
        flat = flat.reshape(-1)
    return flat if stride == 1 else flat[::stride]


def _flat_sample(t: torch.Tensor, stride: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`sample` in ``dtype`` (no conversion call when it already is)."""
    flat = sample(t, stride)
    return flat if flat.dtype == dtype else flat.to(dtype)


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element is finite, in one reduction pass without temporaries.

    A NaN or Inf anywhere makes the sum NaN or Inf; only a non-finite sum
    (which a huge but finite gradient can also produce) needs the exact check,
    which costs several passes and a boolean tensor as large as the input.
    """
    total = t.sum(dtype=torch.float32) if t.dtype in NARROW_DTYPES else t.sum()
    if bool(torch.isfinite(total)):
        return True
    return bool(torch.isfinite(t).all())


def span(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``tensors`` as one flat view when they lie back to back, in this order, in one
    CPU buffer (a packed frame's tensors, a shard's slices of its flat weights);
    else None. One reduction over the span replaces one per tensor (a few us each,
    which is most of a small push's measuring)."""
    if len(tensors) < 2:
        return None
    first = tensors[0]
    if not first.is_cpu:
        return None
    dtype = first.dtype
    start = end = first.data_ptr()
    for t in tensors:
        nbytes = t.nbytes
        if (not nbytes or t.data_ptr() != end or t.dtype is not dtype or not t.is_cpu
                or not t.is_contiguous()):
            return None  # (an empty tensor's data_ptr() is 0: not measured as a span)
        end += nbytes
    total = (end - start) // first.element_size()
    try:  # torch refuses a view past the end of the first tensor's storage
        return first.detach().as_strided((total,), (1,))
    except RuntimeError:
        return None


def norm_and_span(tensors: Sequence[torch.Tensor]) -> tuple[float, torch.Tensor | None]:
    """:func:`total_norm` of ``tensors``, and their :func:`span` (None: not one span),
    for a caller that measures the same tensors again (the probe, after the finite
    check)."""
    flat = span(tensors)
    if flat is not None:
        norm = l2(flat)
        if math.isfinite(norm):
            return norm, flat
        # not finite: as below, where the squares are summed in double and a sum that
        # only overflows the dtype's range stays finite
    return _norm(tensors), flat


def total_norm(tensors: Iterable[torch.Tensor]) -> float:
    """L2 norm over all ``tensors``; 16-bit ones in float32. Tensors lying back to
    back in one buffer are measured as one span. Many tensors go through
    one foreach pass per dtype; a few are cheaper one call each (measured: 1 x 256
    floats 3 us vs 19 us, 8 x 128 21 vs 40 us, 64 x 128 260 vs 180 us)."""
    return norm_and_span(list(tensors))[0]


def _norm(tensors: Sequence[torch.Tensor]) -> float:
    """:func:`total_norm` slice by slice."""
    if len(tensors) <= 16:
        return math.sqrt(sum(l2(t) ** 2 for t in tensors))
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    total = 0.0
    for dtype, group in by_dtype.items():
        if dtype in NARROW_DTYPES:
            total += sum(l2(t) ** 2 for t in group)
        else:
            total += float(torch.nn.utils.get_total_norm(group)) ** 2
    return math.sqrt(total)


def l2(t: torch.Tensor) -> float:
    """L2 norm; 16-bit tensors are measured in float32, wider ones in their own dtype."""
    if t.dtype in NARROW_DTYPES:
        return float(torch.linalg.vector_norm(t, dtype=torch.float32))
    return float(torch.linalg.vector_norm(t))


class MeasureBudget:
    """Keeps measuring pushes within ``share`` of a shard's wall time.

    A shard that measures every push of a small, fast model spends about a
    third of its time on it (docs/performance.md). Past ``share`` of the wall
    time over a ``window``, one push in ``level`` per worker is measured, the
    level doubling up to ``MAX_LEVEL``; it halves again once measuring costs
    under a quarter of ``share`` (the gap stops it from flapping). A shard that
    is idle between pushes stays at level 1: every push measured. Pure: the
    caller passes the time spent and the clock.
    """

    MAX_LEVEL = 64

    def __init__(self, share: float, window: float = 0.25) -> None:
        if not 0.0 <= share <= 1.0:
            raise ConfigError(f"observe_budget must be in [0, 1] (0: no limit), got {share}")
        self.share = share
        self.window = window
        self.level = 1
        self._spent = 0.0
        self._since: float | None = None

    def spent(self, seconds: float, now: float) -> int:
        """Measuring took ``seconds`` up to ``now``; returns the level to measure at."""
        if not self.share:
            return 1
        if self._since is None:
            self._since = now - seconds
        self._spent += seconds
        elapsed = now - self._since
        if elapsed >= self.window:
            used = self._spent / elapsed
            if used > self.share:
                self.level = min(self.level * 2, self.MAX_LEVEL)
            elif used < self.share / 4 and self.level > 1:
                self.level //= 2
            self._spent, self._since = 0.0, now
        return self.level

    def flush(self, probe: Probe, clock: Callable[[], float]) -> None:
        """Run ``probe``'s deferred measurements and set its level from what they took
        (``clock``: seconds; no reading at all without a budget). The shard's path,
        and the watchdog tests' (tests/test_watchdog_delay.py)."""
        if not self.share:
            probe.flush()
            return
        t0 = clock()
        try:
            probe.flush()
        finally:
            t1 = clock()
            probe.shed = self.spent(t1 - t0, t1)


@dataclass(frozen=True)
class GradStats:
    """One push's gradient on this shard, for metrics and the watchdog."""

    worker: int
    norm: float  # L2 norm over the shard's slices (NaN/Inf if the gradient is not finite)
    cosine: float | None  # to the running mean of earlier pushes (None: no mean yet)


@dataclass(frozen=True)
class StepStats:
    """One optimizer step, for metrics and the watchdog."""

    version: int  # after the step
    update_norm: float  # L2 norm of the change to the weights
    weight_norm: float  # L2 norm of the weights after the step
    lr: float  # the learning rate applied (policy weight included)


@dataclass
class PushMeasure:
    """One push's gradient statistics, summed part by part (see :meth:`Probe.measure`)."""

    exact_sq: float = 0.0  # |g|^2 over every element
    sampled_sq: float = 0.0  # |g|^2 over the sampled elements
    dot: float = 0.0  # <sampled g, running mean before this push>
    # False: shed by the budget; only the norm (the finite check's, no extra pass) is
    # reported, and neither the running mean nor the step is measured
    full: bool = True


@dataclass
class _StepMeasure:
    """What :meth:`Probe.step_begins` took of a step, for :meth:`Probe.step_ended`."""

    plain_sgd: bool
    grad_sq: float
    push: PushMeasure | None = None  # the step's gradient is this measured push's


class Probe:
    """Measures one shard's pushes and steps for an observer; off until :meth:`observe`.

    Holds a running mean gradient and (optimizers other than plain SGD) the
    weights before a step, both sampled (every ``stride``-th element).
    """

    def __init__(self, params: Mapping[str, torch.Tensor], sync: bool = False) -> None:
        self.params = params  # the shard's weights (the same tensors, read only)
        self._sync = sync  # every sync round's step is measured
        self.observer: Callable[[GradStats | StepStats], None] | None = None
        self._every = 1
        # measure one push in ``shed`` per worker (set from a MeasureBudget; 1: all)
        self.shed = 1
        self._seen: dict[int, int] = {}  # worker -> pushes seen (every's and shed's counter)
        self._measure_step = False
        self._decay: float | None = None
        self._grad_ema: torch.Tensor | None = None  # the running mean, sampled and flat
        self._ema_sq = 0.0  # |running mean|^2, kept by recurrence (saves a pass per push)
        self._ema_at: dict[str, tuple[int, int]] = {}  # key -> (offset, size) in the mean
        self._ema_views: dict[str, torch.Tensor] = {}  # key -> its view of the mean
        self._key_cache: dict[tuple[str, ...], tuple[list[str], int, int, int, bool]] = {}
        # (gradients, their measure) of the push just measured, for the step it causes
        self._measured: tuple[Mapping[str, torch.Tensor], PushMeasure] | None = None
        # deferred (a server sets it): measurements are queued in order and run by
        # flush() once the reply is out, off the round trip's critical path; what
        # must be taken before the weights change (their copy) is still taken at once
        self.defer = False
        self._queue: list[Callable[[], None]] = []
        self._step_queued = False  # a step's measurement waits: the next step flushes first
        self._before: dict[str, torch.Tensor] = {}
        # the weights as one span, and their addresses when it was made (a step moves no
        # weight; copy-on-write does, and then the addresses differ)
        self._weights: tuple[list[int], torch.Tensor | None] | None = None
        self._numel = sum(p.numel() for p in params.values())
        self.stride = sample_stride(self._numel)
        self._sampled_numel = sum(sample(p, self.stride).numel() for p in params.values())

    def observe(self, observer: Callable[[GradStats | StepStats], None] | None, *,
                cosine_decay: float | None = 0.97, every: int = 1) -> None:
        """See :meth:`paramserver.core.shard.ShardCore.observe`."""
        if cosine_decay is not None and not 0.0 < cosine_decay < 1.0:
            raise ConfigError(f"cosine_decay must be in (0, 1), got {cosine_decay}")
        if every < 0:
            raise ConfigError(f"observe every must be >= 0 (0: by the shard's size), "
                              f"got {every}")
        if every == 0:
            numel = sum(p.numel() for p in self.params.values())
            every = max(1, math.ceil(numel / _OBSERVE_ELEMENTS))
        self.observer = observer
        self._every = every
        self._decay = cosine_decay
        self._grad_ema = None
        self._ema_sq = 0.0
        self._ema_at = {}
        self._before.clear()

    # ------------------------------------------------------------------ pushes

    def push_begins(self, worker: int) -> PushMeasure | None:
        """A new push from ``worker``: where to sum its statistics, or None when it is
        not measured (one in ``every`` of each worker's). Of those, one in ``shed`` is
        measured in full (counted per worker, so that workers pushing in turn are all
        measured); the others report their norm only."""
        if self.observer is None:
            return None
        # counted per worker, for ``every`` too: a shard-wide count in step with workers
        # pushing in turn would never observe some of them (no bound on an alarm's delay)
        seen = self._seen[worker] = self._seen.get(worker, 0) + 1
        every = self._every
        if seen % every:
            self._measure_step = False
            return None
        # full on a multiple of every x shed: the shed is a power of two up to MAX_LEVEL,
        # so each worker's every x MAX_LEVEL-th push is measured in full at any level
        # (thresholds.delay states the rules' delays from this)
        full = self.shed == 1 or (seen // every) % self.shed == 0
        self._measure_step = full
        return PushMeasure(full=full)

    @property
    def pending(self) -> bool:
        """Deferred measurements wait for :meth:`flush`."""
        return bool(self._queue)

    def flush(self) -> None:
        """Run the deferred measurements, in the order they were taken (reports to the
        observer included). Before the weights next change: a server calls it after
        each message it handled."""
        queue, self._queue = self._queue, []
        self._step_queued = False
        for fn in queue:
            fn()

    def measure(self, m: PushMeasure, grads: Mapping[str, torch.Tensor],
                norm: float | None, flat: torch.Tensor | bool | None = False) -> None:
        """Add one part of a push (or a whole push) to its statistics ``m`` (now, or
        at :meth:`flush` when deferred). ``norm``, ``flat``: the gradients' norm and
        :func:`span` if known (``flat`` False: not looked for yet)."""
        if not m.full and norm is not None:  # the norm only: no pass over the push
            m.exact_sq += norm * norm
        elif self.defer:
            self._queue.append(lambda: self._measure(m, grads, norm, flat))
        else:
            self._measure(m, grads, norm, flat)

    def _keys(self, grads: Mapping[str, torch.Tensor]
              ) -> tuple[list[str], int, int, int, bool]:
        """The keys of ``grads`` in the mean's order, where they lie in the mean (first
        offset, end, elements) and whether ``grads`` holds them in that order and
        nothing else; kept per set of keys (a push's keys repeat push after push)."""
        names = tuple(grads)
        got = self._key_cache.get(names)
        if got is None:
            keys = [k for k in self.params if k in grads]
            spans = [self._ema_at[k] for k in keys]
            lo, hi = (spans[0][0], spans[-1][0] + spans[-1][1]) if spans else (0, 0)
            got = (keys, lo, hi, sum(n for _, n in spans), list(names) == keys)
            if len(self._key_cache) >= 64:  # parts of many shapes: do not grow without bound
                self._key_cache.clear()
            self._key_cache[names] = got
        return got

    def _measure(self, m: PushMeasure, grads: Mapping[str, torch.Tensor],
                 norm: float | None, flat: torch.Tensor | bool | None = False) -> None:
        """Add one part of a push (or a whole push) to its statistics ``m``.

        The running mean is updated key by key as the part is measured: each
        key is in one part only, so the dot product summed over the parts is
        the one with the mean from before the push.
        """
        if norm is None:
            norm, flat = norm_and_span(list(grads.values()))
        m.exact_sq += norm * norm
        if self._decay is None or not math.isfinite(norm) or not m.full:
            return
        if self._grad_ema is None:
            sizes = [sample(p, self.stride).numel() for p in self.params.values()]
            wide = any(p.dtype == torch.float64 for p in self.params.values())
            self._grad_ema = torch.zeros(sum(sizes), dtype=torch.float64 if wide
                                         else torch.float32)
            # from zero, not from the first push: that would weigh it ~1/(1 - decay) more
            self._ema_sq = 0.0
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            self._ema_at = dict(zip(self.params, zip(offsets, sizes, strict=True),
                                    strict=True))
            # each key's view of the mean, made once (a slice costs a few us per push)
            ema = self._grad_ema
            self._ema_views = {k: ema if n == ema.numel() else ema[o:o + n]
                               for k, (o, n) in self._ema_at.items()}
            self._key_cache.clear()
        ema = self._grad_ema
        keys, lo, hi, total, in_order = self._keys(grads)  # keys in the mean's order
        if not keys:  # a shard that owns no dense slice (a plan of sparse tables)
            return
        if not (self.stride == 1 and hi - lo == total and in_order):
            flat = None
        elif flat is False:
            flat = span(list(grads.values()))
        if isinstance(flat, torch.Tensor) and flat.dtype == ema.dtype:
            # the slices lie back to back in the push, in the mean's order: no copy
            pairs = [(flat, ema if hi - lo == ema.numel() else ema[lo:hi])]
        else:
            samples = [_flat_sample(grads[k], self.stride, ema.dtype) for k in keys]
            if len(samples) > 1 and total <= _CAT_ELEMENTS and hi - lo == total:
                # many small slices, next to each other in the mean: one copy, one call each
                pairs = [(torch.cat(samples), ema[lo:hi])]
            else:
                views = self._ema_views
                pairs = [(t, views[k]) for t, k in zip(samples, keys, strict=True)]
        if self.stride > 1:
            m.sampled_sq += sum(l2(t) ** 2 for t, _ in pairs)
        else:
            m.sampled_sq += norm * norm
        m.dot += sum(float(torch.dot(t, mean)) for t, mean in pairs)
        for t, mean in pairs:
            mean.lerp_(t, 1.0 - self._decay)  # decay * mean + (1 - decay) * g

    def push_complete(self, worker: int, m: PushMeasure,
                      grads: Mapping[str, torch.Tensor] | None = None) -> None:
        """Report a measured push's :class:`GradStats`. ``grads``: the whole push, which
        the step it causes may take as its gradient (its norm is known then)."""
        assert self.observer is not None
        if grads is not None:
            self._measured = (grads, m)
        if self.defer:
            self._queue.append(lambda: self._report_push(worker, m))
        else:
            self._report_push(worker, m)

    def _report_push(self, worker: int, m: PushMeasure) -> None:
        assert self.observer is not None
        self.observer(self._grad_stats(worker, m))

    def push_done(self) -> None:
        """The push is answered: do not hold on to its frames."""
        self._measured = None

    def _grad_stats(self, worker: int, m: PushMeasure) -> GradStats:
        """One push's :class:`GradStats` from its summed statistics; moves |mean|^2 on."""
        exact = math.sqrt(m.exact_sq) if math.isfinite(m.exact_sq) else m.exact_sq
        decay = self._decay
        if decay is None or not math.isfinite(m.exact_sq) or not m.full:
            return GradStats(worker, exact, None)
        norm = math.sqrt(m.sampled_sq)
        mean_sq = self._ema_sq
        cosine = m.dot / (norm * math.sqrt(mean_sq)) if norm > 0 and mean_sq > 0 else None
        self._ema_sq = max(0.0, decay * decay * mean_sq + 2 * decay * (1 - decay) * m.dot
                           + (1 - decay) ** 2 * norm * norm)
        return GradStats(worker, exact, cosine)

    # ------------------------------------------------------------------ steps

    def step_begins(self, optimizer: torch.optim.Optimizer, grad_scale: float = 1.0,
                    grads: Mapping[str, torch.Tensor] | None = None) -> _StepMeasure | None:
        """Before ``optimizer`` steps (gradients set, learning rates weighted): what
        measuring the step needs from before it, or None when it is not measured.
        ``grad_scale``: the step's gradient is ``grad_scale`` times the ``.grad`` set
        (a sync round's sums, divided inside the step). ``grads``: the step's
        gradients by key, where they are not set as ``.grad`` (the fused step)."""
        if self._step_queued:  # an earlier step's weights are about to change: measure them
            self.flush()
        groups = optimizer.param_groups
        measure = self.observer is not None and (
            self._measure_step or self._sync or (self._every == 1 and self.shed == 1))
        # plain SGD moves the weights by exactly lr * |grad|: no copy needed to measure it
        plain_sgd = type(optimizer) is torch.optim.SGD and all(
            not g.get("momentum") and not g.get("weight_decay") for g in groups)
        # a big shard's step is measured on the sample (every k-th element), scaled to
        # the whole: an estimate within a few percent, and two passes over it saved
        stride = self.stride
        scale = self._numel / self._sampled_numel if stride > 1 else 1.0
        grad_sq = 0.0
        push: PushMeasure | None = None
        if measure and plain_sgd:
            measured = self._measured
            if grads is None:
                grads = {k: p.grad for k, p in self.params.items() if p.grad is not None}
            if measured is not None and (grads is measured[0] or all(
                    grads.get(k) is measured[0].get(k) for k in self.params)):
                push = measured[1]  # the pushed gradient itself, measured (or queued)
            else:
                grad_sq = scale * grad_scale * grad_scale * sum(
                    l2(sample(grads[k], stride)) ** 2 for k in self.params if k in grads)
        elif measure:
            for key, p in self.params.items():
                sampled = sample(p, self.stride)
                if key not in self._before:
                    self._before[key] = torch.empty_like(sampled)
                self._before[key].copy_(sampled)
        self._measured = None
        return _StepMeasure(plain_sgd, grad_sq, push) if measure else None

    def step_ended(self, m: _StepMeasure, version: int, applied_lr: float) -> None:
        """After the step :meth:`step_begins` saw: report its :class:`StepStats` (now,
        or at :meth:`flush` when deferred: the weights are those after this step until
        the next message)."""
        if self.defer:
            self._queue.append(lambda: self._step_ended(m, version, applied_lr))
            self._step_queued = True
        else:
            self._step_ended(m, version, applied_lr)

    def _weights_span(self) -> torch.Tensor | None:
        """:func:`span` of the weights, made again only when one of them moved."""
        values = list(self.params.values())
        ptrs = [p.data_ptr() for p in values]
        kept = self._weights
        if kept is None or kept[0] != ptrs:
            kept = self._weights = (ptrs, span(values))
        return kept[1]

    def _step_ended(self, m: _StepMeasure, version: int, applied_lr: float) -> None:
        assert self.observer is not None
        stride = self.stride
        scale = self._numel / self._sampled_numel if stride > 1 else 1.0
        grad_sq = m.grad_sq if m.push is None else math.sqrt(m.push.exact_sq) ** 2
        update, weights = applied_lr * applied_lr * grad_sq, 0.0
        # plain SGD on a shard's flat weights: their norm in one pass over the buffer
        flat = self._weights_span() if m.plain_sgd and stride == 1 else None
        if flat is not None:
            weights = l2(flat) ** 2
        if flat is None or not math.isfinite(weights):
            weights = 0.0
            for key, p in self.params.items():
                after = sample(p, stride)
                weights += l2(after) ** 2
                if not m.plain_sgd:
                    update += l2(self._before[key].sub_(after)) ** 2
        weights *= scale
        if not m.plain_sgd:
            update *= scale
        self.observer(StepStats(version, math.sqrt(update), math.sqrt(weights), applied_lr))
