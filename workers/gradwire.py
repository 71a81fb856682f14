"""A push's gradients on their way to the wire: host copies, split by shard, in parts.

:class:`~paramserver.workers.client.PSClient` sends gradient slices as zero-copy
views; these functions make those views. :func:`host_copies` brings gradients to
the CPU in the dtype the wire carries (CUDA ones through pinned buffers, narrowed
on the device first); :func:`split_by_shard` cuts them into each shard's slices by
the plan; :func:`groups` packs a shard's slices into parts of a bounded size. They
are apart from the client because they touch no socket and no shard: they only
shape tensors, so they read (and are tested) without the client's connections.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from paramserver.compress import Encoder, with_wire_dtype
from paramserver.core.sharding import ShardPlan
from paramserver.errors import ConfigError

__all__ = ["compression_encoder", "groups", "host_copies", "split_by_shard"]


def compression_encoder(compression: str | None, wire_dtype: str | None, worker: int
                        ) -> tuple[Encoder | None, str | None]:
    """(the push's encoder, the wire dtype) for ``compression`` beside ``wire_dtype``
    (paramserver.compress.with_wire_dtype); random-k's draws are seeded by the worker."""
    spec, wire_dtype = with_wire_dtype(compression, wire_dtype)
    return (None if spec is None else Encoder(spec, seed=worker)), wire_dtype


def host_copies(grads: Mapping[str, torch.Tensor], wire_dtype: torch.dtype | None,
                pinned: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gradients as CPU tensors in the wire dtype; no copy for CPU ones that need none.

    CUDA gradients go through pinned host buffers (``pinned``, by name, kept
    between calls), so the device-to-host copies are asynchronous DMA; with
    ``wire_dtype`` they are narrowed on the device first, halving that traffic.
    """
    out = {}
    cuda = False
    for name, g in grads.items():
        g = g.detach()
        want = wire_dtype if wire_dtype is not None and g.is_floating_point() else g.dtype
        if g.device.type == "cpu" and want == g.dtype:
            out[name] = g
            continue
        pin = g.device.type == "cuda"
        buf = pinned.get(name)
        if buf is None or buf.shape != g.shape or buf.dtype != want:
            buf = torch.empty(g.shape, dtype=want, pin_memory=pin)
            pinned[name] = buf
        if pin:
            cuda = True
            buf.copy_(g.to(want) if want != g.dtype else g, non_blocking=True)
        else:
            buf.copy_(g)
        out[name] = buf
    if cuda:
        torch.cuda.synchronize()
    return out


def split_by_shard(plan: ShardPlan, host: Mapping[str, torch.Tensor],
                   wire_dtype: torch.dtype | None) -> dict[int, dict[str, torch.Tensor]]:
    """shard -> {slice key -> view}; as ShardPlan.split_tensors, but the wire dtype
    may differ from the parameter's."""
    if wire_dtype is None:
        return plan.split_tensors(host)
    flat = {}
    for spec in plan.params:
        t = host.get(spec.name)
        if t is None or tuple(t.shape) != spec.shape:
            got = "nothing" if t is None else f"shape {tuple(t.shape)}"
            raise ConfigError(f"gradient {spec.name!r}: {got}, the plan says {spec.shape}")
        flat[spec.name] = t.reshape(-1)
    out: dict[int, dict[str, torch.Tensor]] = {k: {} for k in range(plan.num_shards)}
    for sl in plan.slices:
        out[sl.shard][sl.key] = flat[sl.name][sl.start:sl.stop]
    return out


def groups(tensors: Mapping[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """``tensors`` in consecutive groups of at most ``limit`` bytes (a tensor never
    split; at least one each; one group, possibly empty, when they fit or the limit
    is 0)."""
    out: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        if limit and out[-1] and size + n > limit:
            out.append({})
            size = 0
        out[-1][key] = t
        size += n
    return out
