"""A worker's encoder: each push's slices compressed, with error feedback.

With error feedback (Seide et al. 2014; Karimireddy et al. 2019), what a push left
out of a slice is kept and added to the slice's next gradient, so nothing is lost
for good, only late: a biased compressor (top-k, sign, int8) then converges as the
uncompressed run does. The residuals are the worker's state: ``state_dict()``
holds them, and a restarted worker that loads it continues them.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from typing import Any

import torch

from paramserver.compress import formats
from paramserver.compress.registry import Compression

__all__ = ["Encoder"]

_MASK = (1 << 63) - 1


class Encoder:
    """Compresses slices by key for the wire (``key#part`` tensors), keeping each
    slice's residual where error feedback is on. ``seed`` fixes what a drawing
    compressor (random-k) draws: the same seed, slice and push give the same draw."""

    def __init__(self, compression: Compression, seed: int = 0) -> None:
        self.compression = compression
        self.compressor = compression.compressor
        self.ef = compression.ef
        self.seed = seed
        self.residuals: dict[str, torch.Tensor] = {}
        self.pushes: dict[str, int] = {}  # slice key -> pushes encoded (the draw's stream)

    def _seed(self, key: str, count: int) -> int:
        return ((self.seed * 1_000_003 + count) * 2_654_435_761 + zlib.crc32(key.encode())) \
            & _MASK

    def encode_one(self, key: str, grad: torch.Tensor) -> dict[str, torch.Tensor]:
        """One slice's parts (``part -> tensor``), its residual updated."""
        flat = grad.detach().reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        count = self.pushes.get(key, 0)
        self.pushes[key] = count + 1
        residual = self.residuals.get(key) if self.ef else None
        x = flat if residual is None else flat.to(residual.dtype) + residual
        parts = self.compressor.compress(x, self._seed(key, count))
        if self.ef:
            # x - decode(parts), in place of x where x is this call's own sum
            own = residual is not None and not any(_shares(t, x) for t in parts.values())
            left = formats.residual(key, parts, x, _wide(x.dtype), reuse=own)
            # a non-finite gradient goes (the shard refuses it), its residual does not stay
            self.residuals[key] = left if _finite(left) else torch.zeros_like(left)
        return parts

    def encode(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Slices by key as the wire's tensors: ``key`` (dense) or ``key#part``."""
        out: dict[str, torch.Tensor] = {}
        for key, grad in tensors.items():
            for part, t in self.encode_one(key, grad).items():
                out[f"{key}{formats.SEP}{part}" if part else key] = t
        return out

    def mark(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """Where the encoder stands, for :meth:`rewind` (cheap: an encoding replaces a
        residual, never writes it in place, so the tensors are shared, not copied)."""
        return dict(self.residuals), dict(self.pushes)

    def rewind(self, mark: tuple[dict[str, torch.Tensor], dict[str, int]]) -> None:
        """Back to :meth:`mark`: a push sent again (the plan moved before any shard
        took it) is encoded as it was the first time, its residuals kept once."""
        self.residuals, self.pushes = dict(mark[0]), dict(mark[1])

    def state_dict(self) -> dict[str, Any]:
        """The residuals and draw counts (tensors and ints: no pickle needed)."""
        return {"residuals": {k: v.clone() for k, v in self.residuals.items()},
                "pushes": dict(self.pushes)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.residuals = {str(k): torch.as_tensor(v).clone()
                          for k, v in state.get("residuals", {}).items()}
        self.pushes = {str(k): int(v) for k, v in state.get("pushes", {}).items()}


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _finite(t: torch.Tensor) -> bool:
    """Every element finite: the extremes are (a NaN makes both NaN), one pass, no
    mask of the slice's length."""
    if not t.numel():
        return True
    low, high = torch.aminmax(t)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def _wide(dtype: torch.dtype) -> torch.dtype:
    """Residuals are kept in float32 at least (a 16-bit one would lose them)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
