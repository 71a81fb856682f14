"""Compressed pulls (DoubleSqueeze, Tang et al. 2019): each worker is sent the
compressed change of the weights since what it holds, with error feedback by
construction.

The shard keeps, per worker, that worker's reconstruction of its slices (``held``:
the sum of every change it was sent). A pull answers ``C(w - held)`` in one of the
wire formats of :mod:`paramserver.compress.formats` and adds its decoded value to
``held``; the worker adds the same decoded value to its own copy (the same float
additions in the same order: the two stay bit-identical). What the compressor
left out stays in ``w - held`` and goes with the next pull.

The worker names what it holds by a count (``base``): the answers it applied.
``base`` equal to the shard's count gets the compressed change (an empty one, and
the count stays, where its reconstruction moved at this version already: so how
often a worker pulls between two steps changes nothing); one less (the
last answer was lost: a failover, a dropped reply) gets that answer again, as a
retried push gets its first outcome; anything else (a restarted worker, a run
resumed from a checkpoint, a shard resumed from an older one) gets the
reconstruction itself, whole, once this pull's change moved it on (a worker
never seen: the weights). So a worker's copy and ``held`` never part, and a run
resumed from checkpoints taken between rounds gives each worker exactly the copy
it held in the run never stopped.

``held`` and the counts are the shard's state: saved in its checkpoint
(``pull/<worker>/<key>``, core/snapshot.py), sent to a joining replica with the
rest, and computed alike by a backup, which closes the same pulls at the same
weights as its primary. The last answers are kept in memory only (a replica that
joined late answers such a retry densely). Pure: tensors in, tensors out.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from paramserver.compress import formats
from paramserver.compress.registry import Compression
from paramserver.core.records import SliceSpec
from paramserver.util.dtypes import DTYPES

__all__ = ["PullAnswer", "PullSqueeze"]

_MASK = (1 << 63) - 1


@dataclass(frozen=True)
class PullAnswer:
    """What a worker's pull is answered with: ``tensors`` (the wire's: ``key`` or
    ``key#part``), the change since its ``count - 1``-th answer (``delta``) or the
    dense weights, and the count it holds once it applied them."""

    count: int
    delta: bool
    tensors: dict[str, torch.Tensor]
    version: int

    @property
    def nbytes(self) -> int:
        return formats.nbytes(self.tensors)


class PullSqueeze:
    """The per-worker state of compressed pulls on one shard (see the module's text)."""

    def __init__(self, compression: Compression, specs: Mapping[str, SliceSpec],
                 shard: int = 0) -> None:
        self.compression = compression
        self.compressor = compression.compressor
        self.specs = specs
        self.shard = shard
        self.held: dict[int, dict[str, torch.Tensor]] = {}
        self.counts: dict[int, int] = {}
        # worker -> the version its reconstruction last moved at (a checkpoint taken
        # after this version's answers holds it moved already: it does not move twice)
        self.moved: dict[int, int] = {}
        # worker -> its last answer (to send again when it was lost), in memory only
        self.last: dict[int, PullAnswer] = {}
        # worker -> the base its parked pull named (set when the pull comes)
        self.bases: dict[int, int] = {}
        self.again = 0  # answers sent again (their first was lost)

    def ask(self, worker: int, base: int | None) -> None:
        """Worker ``worker``'s pull (parked now, answered when its gate opens) holds
        ``base`` answers (-1: none; None: it takes plain weights)."""
        if base is None:
            self.bases.pop(worker, None)
        else:
            self.bases[worker] = base

    def _seed(self, worker: int, count: int, key: str) -> int:
        # (not the shard's index: a slice's draws stay its own when it changes shards)
        return ((worker * 1_000_003 + count) * 2_654_435_761 + zlib.crc32(key.encode())) \
            & _MASK

    def answer(self, worker: int, params: Mapping[str, torch.Tensor],
               version: int) -> PullAnswer | None:
        """The answer to ``worker``'s pull now, its state moved on (None: a plain pull,
        answered with the weights as they are)."""
        base = self.bases.pop(worker, None)
        if base is None:
            return None
        count = self.counts.get(worker)
        last = self.last.get(worker)
        if count is not None and base == count and worker in self.held:
            if self.moved.get(worker) == version:  # moved at these weights already:
                return PullAnswer(count, True, {}, version)  # nothing (once a version)
            out = self._delta(worker, count + 1, params, version)
        elif count is not None and base == count - 1 and last is not None \
                and last.count == count and last.delta:
            self.again += 1
            return last  # the last answer was lost: the same again
        elif count is not None and worker in self.held:
            # a worker without this copy (restarted, or a run resumed from a checkpoint):
            # the reconstruction as this pull's change moves it on (once a version), whole
            if self.moved.get(worker) != version:
                count = self._delta(worker, count + 1, params, version).count
            out = PullAnswer(count, False,
                             {k: t.clone() for k, t in self.held[worker].items()}, version)
        else:  # a worker never seen: the weights themselves start its reconstruction
            held = {k: p.detach().reshape(-1).clone() for k, p in params.items()}
            self.held[worker] = held
            out = PullAnswer((count or 0) + 1, False,
                             {k: t.clone() for k, t in held.items()}, version)
        self.counts[worker] = out.count
        self.moved[worker] = version
        self.last[worker] = out
        return out

    def _delta(self, worker: int, count: int, params: Mapping[str, torch.Tensor],
               version: int) -> PullAnswer:
        held = self.held[worker]
        tensors: dict[str, torch.Tensor] = {}
        for key, p in params.items():
            h = held[key]
            change = p.detach().reshape(-1) - h
            parts = self.compressor.compress(change, self._seed(worker, count, key))
            formats.add_into(key, parts, h)  # (what the worker's dense addition gives)
            for part, t in parts.items():
                tensors[f"{key}{formats.SEP}{part}" if part else key] = t
        return PullAnswer(count, True, tensors, version)

    def forget(self, known: Collection[int]) -> None:
        """Drop the state of workers not in ``known`` (evicted: one who comes back is a
        new process, and gets the dense weights first)."""
        for worker in [w for w in self.held if w not in known]:
            del self.held[worker]
        for table in (self.counts, self.moved, self.last, self.bases):
            for worker in [w for w in table if w not in known]:
                del table[worker]

    # ------------------------------------------------------------------ state

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
        """(``pull/<worker>/<key>`` tensors, ``{worker: [count, version moved at]}``)
        for a checkpoint."""
        tensors = {f"pull/{w}/{k}": t for w, held in self.held.items() for k, t in held.items()}
        return tensors, {str(w): [c, self.moved.get(w, 0)] for w, c in self.counts.items()}

    def load(self, tensors: Mapping[str, torch.Tensor],
             counts: Mapping[str, list[int]]) -> None:
        """:meth:`state`'s output back (checked by core/snapshot.py first); a worker
        without every slice or without a count is dropped (it gets dense weights)."""
        held: dict[int, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            if name.startswith("pull/"):
                _, worker, key = name.split("/", 2)
                spec = self.specs[key]
                held.setdefault(int(worker), {})[key] = \
                    t.detach().reshape(-1).to(DTYPES[spec.dtype]).clone()
        self.held = {w: h for w, h in held.items()
                     if len(h) == len(self.specs) and str(w) in counts}
        self.counts = {int(w): int(c[0]) for w, c in counts.items() if int(w) in self.held}
        self.moved = {int(w): int(c[1]) for w, c in counts.items() if int(w) in self.held}
        self.last.clear()
        self.bases.clear()


def check_counts(counts: object) -> dict[str, list[int]]:
    """A checkpoint's ``pull_counts``: worker id -> [a count >= 1, a version >= 0]
    (ValueError otherwise)."""
    if not isinstance(counts, dict):
        raise ValueError("field 'pull_counts' must be a map")
    for w, c in counts.items():
        if not str(w).isdigit() or not isinstance(c, list) or len(c) != 2 or any(
                isinstance(x, bool) or not isinstance(x, int) for x in c) \
                or c[0] < 1 or c[1] < 0:
            raise ValueError(f"field 'pull_counts' must map worker ids to [count >= 1, "
                             f"version >= 0], got {w!r}: {c!r}")
    return counts
