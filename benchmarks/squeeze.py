"""``python -m paramserver.benchmarks.squeeze``: a compressor's CPU per call, in this process.

What the emulated cluster's compressed rows (``bench --part cluster``: ``ps-int8``,
``ps-topk``, their ``-2way`` rows) spend on the CPU per round, without sockets:

* ``push``: one worker's push of the whole model, its slices (one per shard, as
  benchmarks/ps.py plans it) compressed with error feedback by the worker's
  :class:`~paramserver.compress.Encoder`, in its steady state (residuals held);
* ``pull``: one shard's answer to one worker's compressed pull
  (:class:`~paramserver.core.pullsqueeze.PullSqueeze`: the change of its slice since the
  worker's copy, compressed, and the shard's reconstruction moved on), the weights
  moved by a step before each;
* ``land``: that answer landed in the worker's copy and model
  (:class:`~paramserver.workers.pullcopy.PullCopies`: bounded decode, the addition);
* ``select``: top-k's selection alone on one slice and on the whole model, beside
  ``torch.topk`` of the magnitudes and a sort of its indices (the selection before the
  sampled one), timed alike in the same run: the ``vs torch.topk`` column is their ratio.

Milliseconds per call, median [min-max] over the repeats, on ``--threads`` torch threads
(default 1: an emulated host's share of this 2-core machine). Gradients are normal
noise; weights move by a tenth of it per round. ``--quick`` is a smoke run
(tests/test_bench_squeeze.py).
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch

from paramserver.compress import Encoder, parse_compression
from paramserver.compress.select import top_magnitudes
from paramserver.core.pullsqueeze import PullAnswer, PullSqueeze
from paramserver.core.sharding import ParamSpec, ShardPlan
from paramserver.wire.protocol import Message, Op, decode, encode, weights_reply_fields
from paramserver.workers.pullcopy import PullCopies

from .common import Timing, parse_size

__all__ = ["DEFAULT_SPECS", "Row", "main", "measure"]

DEFAULT_SPECS: tuple[str, ...] = ("int8", "topk:ratio=0.01", "randomk:ratio=0.01", "sign")


@dataclass(frozen=True)
class Row:
    """One spec's (or the selection's) figures, in ms per call; ``base``: the peer of
    the same run where there is one (``select``: torch.topk)."""

    spec: str
    what: str
    timing: Timing
    base: Timing | None = None


def _time(fn: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _reply(ans: PullAnswer) -> Message:
    """The answer as the worker receives it: through the wire's encoding and decoding."""
    fields = weights_reply_fields(ans.version, 0, 0.0, msgspec.UNSET)
    fields.update(squeeze=ans.count, **({"delta": True} if ans.delta else {}))
    return decode([bytes(f) for f in encode(Message(Op.REPLY, 1, fields, ans.tensors))])


def _push(spec: str, plan: ShardPlan, repeats: int) -> Row:
    gen = torch.Generator().manual_seed(0)
    grads = [{f"s{i}": torch.randn(sl.numel, generator=gen)
              for i, sl in enumerate(s for shard in range(plan.num_shards)
                                     for s in plan.shard_slices(shard))} for _ in range(3)]
    enc = Encoder(parse_compression(spec), seed=0)
    for g in grads:  # the steady state: every slice's residual held
        enc.encode(g)
    cycle = itertools.cycle(grads)
    return Row(spec, "push", Timing.of_seconds(
        _time(lambda: enc.encode(next(cycle)), repeats)))


def _pull(spec: str, plan: ShardPlan, repeats: int) -> tuple[Row, Row]:
    gen = torch.Generator().manual_seed(1)
    copies = PullCopies(plan)
    copies.enable(0, True)
    squeeze = PullSqueeze(parse_compression(spec), copies.specs[0])
    weights = {sl.key: torch.randn(sl.numel, generator=gen) for sl in plan.shard_slices(0)}
    steps = [{k: torch.randn(t.shape, generator=gen) * 0.1 for k, t in weights.items()}
             for _ in range(3)]
    model = {p.name: torch.zeros(p.shape) for p in plan.params}
    version = itertools.count(1)
    answers: list[PullAnswer] = []
    replies: list[Message] = []

    def answer() -> None:
        squeeze.ask(0, copies.base(0))
        ans = squeeze.answer(0, weights, next(version))
        assert ans is not None
        answers.append(ans)

    def land() -> None:
        copies.land(model, 0, replies.pop(0))

    answer()
    copies.land(model, 0, _reply(answers.pop()))  # the first, dense
    pull_s, land_s = [], []
    for step in itertools.islice(itertools.cycle(steps), repeats + 2):
        for k, t in weights.items():
            t.add_(step[k])
        pull_s += _time(answer, 1)
        replies.append(_reply(answers.pop()))
        land_s += _time(land, 1)
    return (Row(spec, "pull", Timing.of_seconds(pull_s[2:])),
            Row(spec, "land", Timing.of_seconds(land_s[2:])))


def _select(ratio: float, numel: int, repeats: int) -> Row:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    k = max(1, round(numel * ratio))

    def old() -> torch.Tensor:
        return torch.topk(x.abs(), k, sorted=False).indices.sort().values

    assert torch.equal(top_magnitudes(x, k), old())  # the same set (no ties in noise)
    base_s, new_s = [], []
    for _ in range(repeats):  # interleaved: the machine's load hits both alike
        base_s += _time(old, 1)
        new_s += _time(lambda: top_magnitudes(x, k), 1)
    return Row(f"topk:ratio={ratio:g}", f"select {numel}", Timing.of_seconds(new_s),
               Timing.of_seconds(base_s))


def measure(specs: tuple[str, ...] = DEFAULT_SPECS, size: int = 8 << 20, shards: int = 4,
            repeats: int = 15) -> list[Row]:
    """Every spec's push, pull and land, then the selection's rows."""
    # (a chunk per shard: benchmarks/ps.py's plan of an 8 MiB model on 4 shards)
    plan = ShardPlan([ParamSpec("w", (size // 4,), "float32")], shards,
                     chunk_bytes=max(4, size // shards))
    rows: list[Row] = []
    for spec in specs:
        rows.append(_push(spec, plan, repeats))
        rows += _pull(spec, plan, repeats)
    for numel in sorted({plan.shard_slices(0)[0].numel, size // 4}):
        rows.append(_select(0.01, numel, repeats))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m paramserver.benchmarks.squeeze",
                                 description=__doc__.split("\n", 1)[0] if __doc__ else None)
    ap.add_argument("--size", default="8MiB", help="the float32 model's bytes (default 8MiB)")
    ap.add_argument("--shards", type=int, default=4, help="slices per push (default 4)")
    ap.add_argument("--spec", action="append", help="a --compression spec (repeatable; "
                    f"default {' '.join(DEFAULT_SPECS)})")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: a 256 KiB model, 3 repeats (the figures mean little)")
    args = ap.parse_args(argv)
    size, repeats = (256 << 10, 3) if args.quick else (parse_size(args.size), args.repeats)
    torch.set_num_threads(args.threads)
    rows = measure(tuple(args.spec or DEFAULT_SPECS), size, args.shards, repeats)
    print(f"{size >> 10} KiB float32 model in {args.shards} slices, {args.threads} thread(s); "
          f"ms per call, median [min-max] over {repeats} repeats")
    print("| spec | call | ms | vs torch.topk |")
    print("|---|---|---|---|")
    for r in rows:
        ms = Timing(r.timing.median_us / 1e3, r.timing.min_us / 1e3, r.timing.max_us / 1e3)
        ratio = f"{r.timing.median_us / r.base.median_us:.2f}x" if r.base else ""
        print(f"| {r.spec} | {r.what} | {ms.cell(3)} | {ratio} |")


if __name__ == "__main__":
    main()
