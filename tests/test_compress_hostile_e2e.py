"""A hostile peer's compressed pushes against a real shard process: each hostile index
list, count, scale or length is refused with its error code, nothing of it is applied,
and the shard serves on (the rule is paramserver/wire/compressed.py's; its unit tests
are in tests/test_compress.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_hostile_e2e import _cluster, _f32, _two_peers, _weights

pytestmark = pytest.mark.integration


def _u8(values: list[int], dtype: torch.dtype) -> bytes:
    return torch.tensor(values, dtype=torch.int32).to(dtype).numpy().tobytes()


def _frames(key: str, **parts: tuple[str, list[int], bytes]) -> list[Any]:
    return [(f"{key}#{p}", dtype, shape, data) for p, (dtype, shape, data) in parts.items()]


def _sparse(offsets: list[int], counts: list[int]) -> list[Any]:
    k = len(offsets)
    return _frames("w", v=("float32", [k], _f32(k)),
                   o=("uint8", [2 * k], _u8(offsets, torch.int16)),
                   c=("int32", [len(counts)], _u8(counts, torch.int32)))


def _int8(key: str, n: int, scale: float) -> list[Any]:
    return _frames(key, q=("uint8", [n], bytes(n)),
                   s=("float32", [1], torch.tensor([scale]).numpy().tobytes()))


def test_hostile_compressed_pushes_are_refused_and_the_shard_serves_on(tmp_path: Path
                                                                       ) -> None:
    with _cluster(tmp_path) as cluster:
        (address,) = cluster.start_servers()
        with _two_peers(address) as (legit, bad):
            assert bad.hello(1) == "ok"
            legit.seed()
            assert legit.step().accepted
            before, version = _weights(address)
            push = {"worker": 1, "push_id": 0, "clock": 0, "read_version": version,
                    "num_samples": 4, "compressed": True}
            b = _int8("b", 16, 0.1)
            hostile = [
                (_sparse([9, 3], [2]) + b, "sorted, distinct"),
                (_sparse([3, 3], [2]) + b, "sorted, distinct"),
                (_sparse([128], [1]) + b, r"in [0, 128)"),  # past the slice's end
                (_sparse([1, 2], [5]) + b, "sum to the 2 values"),
                (_int8("w", 128, math.nan) + b, "scale must be finite"),
                (_int8("w", 128, math.inf) + b, "scale must be finite"),
                (_int8("w", 1 << 20, 0.1) + b, "'q' must hold 128 elements"),
                (_frames("w", q=("uint8", [128], bytes(128))) + b, "no format's"),
                (_int8("x", 128, 0.1) + b, "no part of a slice"),
            ]
            for i, (tensors, why) in enumerate(hostile):
                head = bad.ask("push", {**push, "push_id": i + 1}, tensors)
                assert head["op"] == "error" and why in head["f"]["reason"], (why, head)
                assert head["f"]["code"] == ("unknown_key" if i == 8 else "bad_tensor")
            after, again = _weights(address)
            assert again == version and all(torch.equal(before[k], after[k]) for k in before)
            # a well-formed one from the same peer is taken
            ok = _sparse([1, 5], [2]) + b
            head = bad.ask("push", {**push, "push_id": 99}, ok)
            assert head["op"] != "error", head
            assert legit.step().accepted
