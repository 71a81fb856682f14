"""A shard core and its workers' gradients, built the same way by the pure tests that
replay inputs (order of a sync round's sum, export and restore)."""

from __future__ import annotations

import torch

from paramserver.core.modes import Mode
from paramserver.core.shard import CoreConfig, ModeSpec, ShardCore, SliceSpec


def core_config(mode: str, workers: int, adam: bool = False) -> CoreConfig:
    return CoreConfig(mode=ModeSpec(Mode(mode), 1 if mode == "ssp" else 0, 0),
                      optimizer="adam" if adam else "sgd",
                      optimizer_args={"lr": 0.01} if adam else {"lr": 0.1, "momentum": 0.9},
                      expected_workers=workers, heartbeat_timeout=10.0)


def make_core(slices: list[SliceSpec], workers: int, mode: str = "sync",
              adam: bool = False) -> ShardCore:
    """A core of ``slices`` with ``workers`` registered and seeded weights."""
    core = ShardCore(slices, core_config(mode, workers, adam), None)
    for w in range(workers):
        core.register(w, f"inc{w}", now=0.0)
    gen = torch.Generator().manual_seed(0)
    core.initialize({s.key: torch.randn(s.numel, generator=gen) for s in slices})
    return core


def gradient(slices: list[SliceSpec], worker: int, step: int) -> dict[str, torch.Tensor]:
    # magnitudes apart by worker, so that the order of a float32 sum shows
    gen = torch.Generator().manual_seed(1000 * worker + step)
    return {s.key: torch.randn(s.numel, generator=gen) * 10.0 ** (worker - 1)
            for s in slices}
