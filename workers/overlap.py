"""Overlap communication with backward: push gradients in buckets as they are produced.

``WorkerConfig(overlap=True)`` makes a worker register a post-accumulate-grad
hook on every parameter. Parameters are grouped into buckets of about
``bucket_bytes`` in reverse registration order (the order backward produces
them, as DDP does); once the last gradient of a bucket has been accumulated,
the bucket is sent to its shards at once (:class:`~paramserver.workers.client.PushStream`)
while backward goes on with earlier layers. The last part to each shard also
asks for the next weights, so the next pull needs no round trip of its own.
On CUDA, a bucket's gradients go to pinned host buffers first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paramserver.errors import ConfigError
from paramserver.workers.client import PSClient, PullResult, PushResult, PushStream
from paramserver.workers.stragglers import Straggler
from paramserver.workers.tasks import Task

__all__ = ["BucketHooks", "BucketPusher", "OverlapStep", "make_buckets"]


def make_buckets(named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
                 ) -> list[list[str]]:
    """Parameter names in reverse order, cut into buckets of about ``bucket_bytes``.

    A bucket closes once it holds at least ``bucket_bytes``; a parameter is
    never split between buckets.
    """
    if bucket_bytes < 1:
        raise ConfigError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, p in reversed(list(named)):
        current.append(name)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class OverlapStep:
    pushed: PushResult
    pulled: PullResult  # the weights for the next clock, already in the model
    num_samples: int
    loss: float  # mean training loss over the step's samples
    compute_s: float  # forward and backward (sends included: they overlap it)
    sleep_s: float  # injected straggler delay


class BucketHooks:
    """Post-accumulate-grad hooks that send a model's gradients bucket by bucket from
    inside a step's last backward pass.

    A parameter's gradient is final once it has been accumulated ``passes`` times
    (one per backward pass of the step); a bucket goes to the shards once all of
    its gradients are final, through the stream ``open_stream`` gives (called at
    the first final gradient; ``None``: not armed, keep accumulating).
    :meth:`flush` sends what no hook sent (unused or frozen parameters).
    """

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int,
                 open_stream: Callable[[], PushStream | None], passes: int = 1) -> None:
        self.params = dict(named)
        self.buckets = make_buckets(list(named), bucket_bytes)
        self.passes = passes
        self._bucket_of = {n: i for i, b in enumerate(self.buckets) for n in b}
        self._open = open_stream
        self._stream: PushStream | None = None
        self.reset()
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(n))
                         for n, p in named if p.requires_grad]

    def reset(self) -> None:
        """A new step: no gradient accumulated, no bucket sent."""
        self._stream = None
        self._seen: dict[str, int] = {}
        self._pending = [set(b) for b in self.buckets]
        self._sent = [False] * len(self.buckets)

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def on_grad(_: torch.Tensor) -> None:
            self._seen[name] = self._seen.get(name, 0) + 1
            if self._seen[name] < self.passes:
                return  # not the step's last backward: keep accumulating
            if self._stream is None:
                self._stream = self._open()
                if self._stream is None:
                    return
            b = self._bucket_of[name]
            self._pending[b].discard(name)
            if not self._pending[b] and not self._sent[b]:
                self._send(b)
        return on_grad

    def _send(self, b: int) -> None:
        assert self._stream is not None
        grads = {}
        for name in self.buckets[b]:
            p = self.params[name]
            if p.grad is None:  # unused in this step, or frozen: a zero gradient
                p.grad = torch.zeros_like(p)
            grads[name] = p.grad
        self._sent[b] = True
        self._stream.send(grads)

    def flush(self) -> PushStream:
        """After the step's backward: send the rest; returns the step's stream."""
        if self._stream is None:
            self._stream = self._open()
            if self._stream is None:
                raise ConfigError("flush() without arm(): no push stream to send into")
        for b, sent in enumerate(self._sent):
            if not sent:
                self._send(b)
        stream = self._stream
        self.reset()
        return stream

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class BucketPusher:
    """:class:`BucketHooks` driven by an explicit client and clock (the overlap
    benchmark's way in; training goes through DistributedOptimizer(overlap=True))."""

    def __init__(self, model: torch.nn.Module, bucket_bytes: int) -> None:
        self.params = dict(model.named_parameters())
        self._armed: PushStream | None = None
        self.hooks = BucketHooks(list(self.params.items()), bucket_bytes, lambda: self._armed)
        self.buckets = self.hooks.buckets

    def arm(self, stream: PushStream, passes: int = 1) -> None:
        """The next ``passes`` backward passes make the step: send buckets into ``stream``."""
        self.hooks.reset()
        self.hooks.passes = passes
        self._armed = stream

    def flush(self) -> PushStream:
        """After backward: send what no hook sent (frozen or unused parameters)."""
        stream = self.hooks.flush()
        self._armed = None
        return stream

    def close(self) -> None:
        self.hooks.remove()

    def step(self, client: PSClient, task: Task, model: torch.nn.Module,
             batches: Iterator[Any], device: torch.device, micro_batches: int,
             versions: Sequence[int], clock: int, straggler: Straggler,
             early: bool = True) -> OverlapStep:
        """One training step with overlap: forward/backward over ``micro_batches``
        batches (the gradients of the last backward are sent as they appear),
        then wait for the shards' answers, which bring the next weights
        (``early``: over TCP, those of a bucket may come back while later ones are
        still computed, see paramserver/workers/pushstream.py)."""
        t0 = time.perf_counter()
        drawn = [next(batches) for _ in range(micro_batches)]
        sizes = [int(targets.shape[0]) for _, targets in drawn]
        total = sum(sizes)
        stream = client.push_stream(self.buckets, versions, total, clock, prefetch=True,
                                    early=early)
        self.arm(stream, micro_batches)
        loss_sum = 0.0
        for i, ((inputs, targets), n) in enumerate(zip(drawn, sizes, strict=True)):
            inputs, targets = inputs.to(device), targets.to(device)
            loss = task.loss_fn(model(inputs), targets)
            loss_sum += float(loss.detach()) * n
            if i == micro_batches - 1:
                stream.loss = loss_sum / total
            # scaled so that the accumulated gradient is the mean over all samples as it
            # is produced (there is no pass afterwards to divide it)
            (loss * (n / total)).backward()
        self.flush()
        compute = time.perf_counter() - t0
        slept = straggler.inject(compute)
        pushed, pulled = stream.finish(self.params)
        assert pulled is not None
        return OverlapStep(pushed, pulled, total, loss_sum / total, compute, slept)
