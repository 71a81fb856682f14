"""Research staleness policies: DC-ASGD, Gap-Aware and the adaptive SSP bound.

They plug in like the built-ins (same registry, same ``--policy`` and
``--policy-arg`` options, same experiment grid) and use the two optional
hooks of :class:`~paramserver.policies.StalenessPolicy`:

* ``needs_read_weights`` + :meth:`rewrite_gradient`: the core snapshots, per
  worker, the shard's weights at the moment it answers that worker's pull
  (``w_read``), and hands them back with the current weights (``w_now``) when
  the worker pushes. Cost: **one copy of the shard's weights per worker**,
  i.e. the whole model once per worker summed over shards.
* :meth:`staleness_bound`: in ssp mode, the bound the gate enforces.

Everything is element-wise over each slice the shard owns, so a policy
instance lives on one shard and never sees the others. All arithmetic runs in
the parameter's dtype. See docs/research.md for the rules and their sources.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from typing import Any, TypedDict

import numpy as np
import torch

from paramserver.errors import ConfigError
from paramserver.policies.base import BoundStats, Decision, StalenessPolicy, UpdateInfo
from paramserver.policies.bounds import AdaptiveBound
from paramserver.util.dtypes import FLOAT_DTYPES

__all__ = [
    "AdaptiveBoundPolicy",
    "DCASGDAdaptivePolicy",
    "DCASGDPolicy",
    "EncodedTensor",
    "GapAwarePolicy",
    "decode_tensors",
    "encode_tensors",
]


_ACCEPT = Decision(True)


class EncodedTensor(TypedDict):
    """One tensor in a policy's JSON state: exact, no pickle."""

    dtype: str  # a FLOAT_DTYPES name
    shape: list[int]
    data: str  # base64 of the raw bytes


def encode_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, EncodedTensor]:
    """Tensors as JSON-able dicts (dtype, shape, base64 of the raw bytes): exact, no pickle."""
    out: dict[str, EncodedTensor] = {}
    names = {v: k for k, v in FLOAT_DTYPES.items()}
    for key, t in tensors.items():
        if t.dtype not in names:
            raise ConfigError(f"cannot encode tensor {key!r} of dtype {t.dtype}")
        raw = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        out[key] = EncodedTensor(dtype=names[t.dtype], shape=list(t.shape),
                                 data=base64.b64encode(raw).decode("ascii"))
    return out


def decode_tensors(data: Mapping[str, Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`encode_tensors`; a malformed entry raises :class:`ConfigError`."""
    out: dict[str, torch.Tensor] = {}
    for key, entry in data.items():
        try:
            dtype = FLOAT_DTYPES[entry["dtype"]]
            raw = bytearray(base64.b64decode(entry["data"], validate=True))
            flat = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8)).view(dtype)
            out[key] = flat.reshape(list(entry["shape"])).clone()
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise ConfigError(f"policy state for {key!r} is malformed: {exc}") from exc
    return out


def _gap(weights: Mapping[str, torch.Tensor], read: Mapping[str, torch.Tensor] | None,
         key: str) -> torch.Tensor | None:
    """w_now - w_read for one slice, or None when the worker's read is unknown."""
    if read is None or key not in read:
        return None
    return weights[key].detach() - read[key]


def _ema_square(store: dict[str, torch.Tensor], key: str, g: torch.Tensor,
                decay: float) -> torch.Tensor:
    """Update and return ``store[key] = decay * store[key] + (1 - decay) * g**2``
    (the first value: ``(1 - decay) * g**2``, no bias correction)."""
    square = g * g
    prev = store.get(key)
    ema = (1.0 - decay) * square if prev is None else decay * prev + (1.0 - decay) * square
    store[key] = ema
    return ema


class _DelayCompensated(StalenessPolicy):
    """``g <- g + lambda * g * g * (w_now - w_read)``; subclasses say what lambda is.

    The term is a cheap diagonal approximation of the Hessian term of the
    Taylor expansion of the gradient at the current weights (Zheng et al.,
    ICML 2017). Every update is applied at full weight.
    """

    needs_read_weights = True

    def decide(self, update: UpdateInfo) -> Decision:
        return _ACCEPT

    def _lambda(self, key: str, g: torch.Tensor) -> torch.Tensor | float:
        raise NotImplementedError

    def rewrite_gradient(
        self,
        update: UpdateInfo,
        grad: Mapping[str, torch.Tensor],
        weights: Mapping[str, torch.Tensor],
        read_weights: Mapping[str, torch.Tensor] | None,
        lr: float,
    ) -> Mapping[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for key, g in grad.items():
            lam = self._lambda(key, g)  # adaptive: updates its statistics with every g
            gap = _gap(weights, read_weights, key)
            out[key] = g if gap is None else g + lam * g * g * gap
        return out


class DCASGDPolicy(_DelayCompensated):
    """DC-ASGD with a constant lambda: ``g + lam * g * g * (w_now - w_read)``.

    ``lam = 0`` is plain ASGD, bit for bit.
    """

    name = "dc-asgd"

    def __init__(self, lam: float = 0.04) -> None:
        if not math.isfinite(lam) or lam < 0:
            raise ConfigError(f"dc-asgd: lam must be finite and >= 0, got {lam}")
        self.lam = float(lam)

    def _lambda(self, key: str, g: torch.Tensor) -> torch.Tensor | float:
        return self.lam


class DCASGDAdaptivePolicy(_DelayCompensated):
    """DC-ASGD-a (Zheng et al. 2017): ``lambda_t = lam0 / sqrt(MS_t)``, element-wise.

    ``MS_t = momentum * MS_{t-1} + (1 - momentum) * g_t**2`` over every applied
    gradient on this shard (no bias correction, as in the paper); ``eps``
    keeps the division finite where MS is 0.
    """

    name = "dc-asgd-adaptive"

    def __init__(self, lam0: float = 2.0, momentum: float = 0.95, eps: float = 1e-7) -> None:
        if not math.isfinite(lam0) or lam0 < 0:
            raise ConfigError(f"dc-asgd-adaptive: lam0 must be finite and >= 0, got {lam0}")
        if not 0.0 <= momentum < 1.0:
            raise ConfigError(f"dc-asgd-adaptive: momentum must be in [0, 1), got {momentum}")
        if not eps > 0:
            raise ConfigError(f"dc-asgd-adaptive: eps must be > 0, got {eps}")
        self.lam0, self.momentum, self.eps = float(lam0), float(momentum), float(eps)
        self._ms: dict[str, torch.Tensor] = {}

    def _lambda(self, key: str, g: torch.Tensor) -> torch.Tensor | float:
        return self.lam0 / (_ema_square(self._ms, key, g, self.momentum).sqrt() + self.eps)

    def state_dict(self) -> dict[str, Any]:
        return {"mean_square": encode_tensors(self._ms)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._ms = decode_tensors(state.get("mean_square", {}))


class GapAwarePolicy(StalenessPolicy):
    """Gap-Aware staleness mitigation (Barkai et al. 2019), element-wise.

    ``g <- g / (1 + |w_now - w_read| / C)`` with ``C = lr * sqrt(v)``, ``v`` an
    EMA of ``g**2`` (decay ``beta``, bias-corrected like Adam's second moment
    unless ``bias_correction`` is false). C is the size of a typical step, so
    the gap counts how many steps' worth a weight moved since the worker read
    it: the gradient is damped where, and only where, it went stale.
    """

    name = "gap-aware"
    needs_read_weights = True

    def __init__(self, beta: float = 0.999, eps: float = 1e-12,
                 bias_correction: bool = True) -> None:
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"gap-aware: beta must be in [0, 1), got {beta}")
        if not eps > 0:
            raise ConfigError(f"gap-aware: eps must be > 0, got {eps}")
        self.beta, self.eps, self.bias_correction = float(beta), float(eps), bool(bias_correction)
        self._v: dict[str, torch.Tensor] = {}
        self._steps: dict[str, int] = {}

    def decide(self, update: UpdateInfo) -> Decision:
        return _ACCEPT

    def rewrite_gradient(
        self,
        update: UpdateInfo,
        grad: Mapping[str, torch.Tensor],
        weights: Mapping[str, torch.Tensor],
        read_weights: Mapping[str, torch.Tensor] | None,
        lr: float,
    ) -> Mapping[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for key, g in grad.items():
            v = _ema_square(self._v, key, g, self.beta)
            steps = self._steps[key] = self._steps.get(key, 0) + 1
            gap = _gap(weights, read_weights, key)
            if gap is None:
                out[key] = g
                continue
            if self.bias_correction:
                v = v / (1.0 - self.beta ** steps)
            typical_step = lr * v.sqrt() + self.eps
            out[key] = g / (1.0 + gap.abs() / typical_step)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"ema_square": encode_tensors(self._v), "steps": dict(self._steps)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._v = decode_tensors(state.get("ema_square", {}))
        self._steps = {str(k): int(v) for k, v in state.get("steps", {}).items()}


class AdaptiveBoundPolicy(StalenessPolicy):
    """SSP whose bound moves within [s_min, s_max] from measured waiting and staleness.

    Use with ``--mode ssp``; the configured ``--staleness-bound`` is the
    starting point. Every update is applied at full weight; the rule is
    :class:`paramserver.policies.bounds.AdaptiveBound` (window in pushes, 0: four per
    live worker; wait_high / wait_low: shares of worker time spent held at the
    gate; stale_high: mean staleness over that of evenly paced async).
    """

    name = "ssp-adaptive"

    def __init__(self, s_min: int = 1, s_max: int = 8, window: int = 0,
                 wait_high: float = 0.10, wait_low: float = 0.02,
                 stale_high: float = 4.0) -> None:
        self._rule = AdaptiveBound(s_min, s_max, window, wait_high, wait_low, stale_high)
        self.s_min, self.s_max, self.window = s_min, s_max, window
        self.wait_high, self.wait_low, self.stale_high = wait_high, wait_low, stale_high

    @property
    def rule(self) -> AdaptiveBound:
        return self._rule

    def decide(self, update: UpdateInfo) -> Decision:
        return _ACCEPT

    def staleness_bound(self, stats: BoundStats) -> int:
        return self._rule.update(stats)

    def state_dict(self) -> dict[str, Any]:
        return self._rule.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._rule.load_state_dict(state)
