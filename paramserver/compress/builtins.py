"""The built-in compressors: none, bf16, fp16, int8, topk, randomk, sign."""

from __future__ import annotations

import math

import torch

from paramserver.compress import formats
from paramserver.compress.base import Compressor, Parts
from paramserver.compress.select import top_magnitudes
from paramserver.errors import ConfigError

__all__ = ["BF16", "BUILTINS", "FP16", "Int8", "NoCompression", "RandomK", "Sign", "TopK"]


class NoCompression(Compressor):
    """Gradients as they are (today's push, to the byte)."""

    name = "none"
    biased = False

    def compress(self, flat: torch.Tensor, seed: int) -> Parts:
        return formats.dense(flat)


class BF16(Compressor):
    """Gradients in bfloat16: half the bytes (as --wire-dtype bfloat16)."""

    name = "bf16"
    biased = False
    wire_dtype = "bfloat16"

    def compress(self, flat: torch.Tensor, seed: int) -> Parts:
        return formats.dense(flat.to(torch.bfloat16))


class FP16(Compressor):
    """Gradients in float16: half the bytes (as --wire-dtype float16)."""

    name = "fp16"
    biased = False
    wire_dtype = "float16"

    def compress(self, flat: torch.Tensor, seed: int) -> Parts:
        return formats.dense(flat.to(torch.float16))


class Int8(Compressor):
    """int8 values with one float32 scale per slice: about a quarter of float32."""

    name = "int8"

    def compress(self, flat: torch.Tensor, seed: int) -> Parts:
        # the largest magnitude from the extremes: one pass, no |flat| (a NaN makes both NaN)
        low, high = (float(t) for t in torch.aminmax(flat)) if flat.numel() else (0.0, 0.0)
        if not (math.isfinite(low) and math.isfinite(high)):  # as it is: the shard
            return formats.dense(flat)  # refuses it as today's push
        scale = max(abs(low), abs(high)) / 127  # (abs: a -0.0 scale would be another)
        if not scale:
            return formats.int8(torch.zeros(flat.numel(), dtype=torch.int8), scale)
        q = (flat / scale).round_().clamp_(-127, 127)  # (in place: the same values)
        return formats.int8(q.to(torch.int8), scale)


def _ratio(ratio: float, name: str) -> float:
    if not 0 < ratio <= 1:
        raise ConfigError(f"compressor {name}: ratio must be in (0, 1], got {ratio}")
    return ratio


def _kept(n: int, ratio: float) -> int:
    return min(n, max(1, round(n * ratio))) if n else 0


class TopK(Compressor):
    """The largest-magnitude ratio of each slice, at 16-bit offsets (1 %: ~66x fewer bytes)."""

    name = "topk"

    def __init__(self, ratio: float = 0.01) -> None:
        self.ratio = _ratio(ratio, self.name)

    def compress(self, flat: torch.Tensor, seed: int) -> Parts:
        # (sampled, exact: ties at the k-th magnitude go to the lowest indices)
        idx = top_magnitudes(flat, _kept(flat.numel(), self.ratio))
        return formats.sparse(idx, flat[idx], flat.numel())

    def describe(self) -> str:
        return f"{self.name}:ratio={self.ratio:g}"


class RandomK(Compressor):
    """A random ratio of each slice (drawn from the push's seed), at 16-bit offsets."""

    name = "randomk"

    def __init__(self, ratio: float = 0.01) -> None:
        self.ratio = _ratio(ratio, self.name)

    def compress(self, flat: torch.Tensor, seed: int) -> Parts:
        n = flat.numel()
        gen = torch.Generator().manual_seed(seed)
        idx = torch.randperm(n, generator=gen)[:_kept(n, self.ratio)].sort().values
        return formats.sparse(idx, flat[idx], n)

    def describe(self) -> str:
        return f"{self.name}:ratio={self.ratio:g}"


class Sign(Compressor):
    """Signs, one bit each, scaled by the slice's mean magnitude (EF-SignSGD): 1/32."""

    name = "sign"

    def compress(self, flat: torch.Tensor, seed: int) -> Parts:
        scale = float(flat.abs().mean()) if flat.numel() else 0.0
        if not math.isfinite(scale):  # as it is: the shard refuses it as today's push
            return formats.dense(flat)
        return formats.sign(flat >= 0, scale)


BUILTINS: tuple[type[Compressor], ...] = (NoCompression, BF16, FP16, Int8, TopK, RandomK, Sign)
