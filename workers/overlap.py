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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paramserver.errors import ConfigError
from paramserver.workers.client import PSClient, PullResult, PushResult, PushStream
from paramserver.workers.stragglers import Straggler
from paramserver.workers.tasks import Task

__all__ = ["BucketPusher", "OverlapStep", "make_buckets"]


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


class BucketPusher:
    """Sends a model's gradients bucket by bucket from inside backward."""

    def __init__(self, model: torch.nn.Module, bucket_bytes: int) -> None:
        self.params = dict(model.named_parameters())
        self.buckets = make_buckets(list(self.params.items()), bucket_bytes)
        self._bucket_of = {n: i for i, b in enumerate(self.buckets) for n in b}
        self._pending: list[set[str]] = []
        self._sent: list[bool] = []
        self._stream: PushStream | None = None
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook(name))
            for name, p in self.params.items() if p.requires_grad
        ]

    def _hook(self, name: str) -> Any:
        def on_grad(param: torch.Tensor) -> None:
            if self._stream is None:
                return  # not the last micro-batch of the step: keep accumulating
            b = self._bucket_of[name]
            pending = self._pending[b]
            pending.discard(name)
            if not pending and not self._sent[b]:
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

    def arm(self, stream: PushStream) -> None:
        """The next backward is the step's last: send buckets as they complete."""
        self._stream = stream
        self._pending = [set(b) for b in self.buckets]
        self._sent = [False] * len(self.buckets)

    def flush(self) -> PushStream:
        """After backward: send what no hook sent (frozen or unused parameters)."""
        stream = self._stream
        if stream is None:
            raise ConfigError("flush() without arm()")
        for b, sent in enumerate(self._sent):
            if not sent:
                self._send(b)
        self._stream = None
        return stream

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def step(self, client: PSClient, task: Task, model: torch.nn.Module,
             batches: Iterator[Any], device: torch.device, micro_batches: int,
             versions: Sequence[int], clock: int, straggler: Straggler) -> OverlapStep:
        """One training step with overlap: forward/backward over ``micro_batches``
        batches (the gradients of the last backward are sent as they appear),
        then wait for the shards' answers, which bring the next weights."""
        t0 = time.perf_counter()
        drawn = [next(batches) for _ in range(micro_batches)]
        sizes = [int(targets.shape[0]) for _, targets in drawn]
        total = sum(sizes)
        stream = client.push_stream(self.buckets, versions, total, clock, prefetch=True)
        loss_sum = 0.0
        for i, ((inputs, targets), n) in enumerate(zip(drawn, sizes, strict=True)):
            inputs, targets = inputs.to(device), targets.to(device)
            loss = task.loss_fn(model(inputs), targets)
            loss_sum += float(loss.detach()) * n
            if i == micro_batches - 1:
                stream.loss = loss_sum / total
                self.arm(stream)
            # scaled so that the accumulated gradient is the mean over all samples as it
            # is produced (there is no pass afterwards to divide it)
            (loss * (n / total)).backward()
        self.flush()
        compute = time.perf_counter() - t0
        slept = straggler.inject(compute)
        pushed, pulled = stream.finish(self.params)
        assert pulled is not None
        return OverlapStep(pushed, pulled, total, loss_sum / total, compute, slept)
