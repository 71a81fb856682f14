"""ShardPlan: determinism, balance, coverage, split/assemble round trips, diff, validation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paramserver.core.sharding import ParamSpec, ShardPlan, Slice
from paramserver.errors import ConfigError, RegistryError

MiB = 1024 * 1024
ROOT = Path(__file__).resolve().parents[1]


def _specs(*shapes: tuple[int, ...], dtype: str = "float32") -> list[ParamSpec]:
    return [ParamSpec(f"p{i}", shape, dtype) for i, shape in enumerate(shapes)]


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )


MODELS: dict[str, list[ParamSpec]] = {
    "one-10MiB": _specs((10 * MiB // 4,)),
    "mixed": _specs((3 * MiB // 4,), (17,), (1000, 1000), (5, 7, 11), (2 * MiB,), (1,)),
    "many-small": _specs(*[(i + 1, 3) for i in range(50)]),
    "mlp": [ParamSpec(n, tuple(p.shape), "float32") for n, p in _mlp().named_parameters()],
    "bf16-f64": [
        ParamSpec("a", (3 * MiB,), "bfloat16"),
        ParamSpec("b", (1 * MiB,), "float64"),
        ParamSpec("c", (123,), "float64"),
    ],
}


# -- determinism ---------------------------------------------------------------


def test_hash_is_identical_in_another_process() -> None:
    plan = ShardPlan.from_module(_mlp(), num_shards=3, chunk_bytes=64 * 1024)
    code = (
        "import json, sys, torch\n"
        "from paramserver.core.sharding import ShardPlan\n"
        "torch.manual_seed(123)\n"  # weights differ; the plan must not depend on them
        "m = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),"
        " torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))\n"
        "p = ShardPlan.from_module(m, num_shards=3, chunk_bytes=64 * 1024)\n"
        "print(json.dumps({'hash': p.hash, 'slices': [list(map(str, (s.key, s.shard)))"
        " for s in p.slices]}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)},
    )
    remote = json.loads(result.stdout)
    assert remote["hash"] == plan.hash
    assert remote["slices"] == [[s.key, str(s.shard)] for s in plan.slices]
    assert len(plan.hash) == 64 and int(plan.hash, 16) >= 0


def test_same_inputs_same_plan() -> None:
    a = ShardPlan(MODELS["mixed"], 4, chunk_bytes=MiB)
    b = ShardPlan(list(MODELS["mixed"]), 4, chunk_bytes=MiB)
    assert a.hash == b.hash and a.slices == b.slices and a == b


@pytest.mark.parametrize(
    "change",
    [
        lambda s: ShardPlan(_specs((10, 5), (4,)), 2, 1024),  # shape
        lambda s: ShardPlan([s[1], s[0]], 2, 1024),  # registration order
        lambda s: ShardPlan(s, 3, 1024),  # num_shards
        lambda s: ShardPlan(s, 2, 2048),  # chunk size
        lambda s: ShardPlan(s, 2, 1024, split=False),  # split flag
        lambda s: ShardPlan(_specs((5, 10), (4,), dtype="float64"), 2, 1024),  # dtype
        lambda s: ShardPlan([ParamSpec("q0", (5, 10), "float32"), s[1]], 2, 1024),  # name
    ],
)
def test_hash_changes_with_inputs(change) -> None:  # type: ignore[no-untyped-def]
    specs = _specs((5, 10), (4,))
    assert change(specs).hash != ShardPlan(specs, 2, 1024).hash


# -- balance and coverage ------------------------------------------------------------


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("chunk_bytes", [4 * MiB, MiB, 4096])
def test_balance_within_one_chunk(model: str, num_shards: int, chunk_bytes: int) -> None:
    plan = ShardPlan(MODELS[model], num_shards, chunk_bytes)
    loads = [plan.shard_bytes(k) for k in range(num_shards)]
    largest = max(s.nbytes for s in plan.slices)
    assert max(loads) - min(loads) <= largest
    assert sum(loads) == sum(p.nbytes for p in plan.params)
    assert all(s.nbytes <= chunk_bytes for s in plan.slices)


def test_ten_mib_tensor_four_mib_chunks_three_shards() -> None:
    plan = ShardPlan([ParamSpec("w", (10 * MiB // 4,), "float32")], 3, 4 * MiB)
    assert len(plan.slices) == 3  # ceil(10 / 4)
    assert all(s.nbytes <= 4 * MiB for s in plan.slices)
    assert sorted(s.shard for s in plan.slices) == [0, 1, 2]
    loads = [plan.shard_bytes(k) for k in range(3)]
    assert max(loads) - min(loads) <= max(s.nbytes for s in plan.slices)
    assert [s.key for s in plan.slices_of("w")] == [
        f"w[{s.start}:{s.stop}]" for s in plan.slices_of("w")
    ]


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("num_shards", [1, 3, 8])
def test_every_element_covered_exactly_once(model: str, num_shards: int) -> None:
    plan = ShardPlan(MODELS[model], num_shards, chunk_bytes=256 * 1024)
    keys = [s.key for s in plan.slices]
    assert len(keys) == len(set(keys))
    for p in plan.params:
        counts = torch.zeros(p.numel, dtype=torch.int32)
        for s in plan.slices_of(p.name):
            counts[s.start : s.stop] += 1
        assert bool((counts == 1).all()), p.name
    union = [s for k in range(num_shards) for s in plan.shard_slices(k)]
    assert sorted(union, key=lambda s: s.key) == sorted(plan.slices, key=lambda s: s.key)


def test_shard_slices_ordered_by_registration_then_start() -> None:
    plan = ShardPlan(MODELS["mixed"], 2, chunk_bytes=MiB)
    index = {p.name: i for i, p in enumerate(plan.params)}
    for k in range(2):
        order = [(index[s.name], s.start) for s in plan.shard_slices(k)]
        assert order == sorted(order)
        assert all(s.shard == k for s in plan.shard_slices(k))


def test_largest_first_to_least_loaded() -> None:
    # 4 chunks: 400, 300, 200, 100 bytes on 2 shards -> {400, 100} and {300, 200}.
    plan = ShardPlan(_specs((25,), (50,), (100,), (75,)), 2, chunk_bytes=1000)
    shard = {s.name: s.shard for s in plan.slices}
    assert shard == {"p2": 0, "p3": 1, "p1": 1, "p0": 0}
    # Equal sizes: ties go by registration order, and to the lowest shard id.
    tied = ShardPlan(_specs((4,), (4,), (4,)), 2)
    assert [s.shard for s in tied.slices] == [0, 1, 0]


def test_fewer_chunks_than_shards_leaves_empty_shards() -> None:
    plan = ShardPlan(_specs((3,), (4,)), 5)
    assert [len(plan.shard_slices(k)) for k in range(5)] == [1, 1, 0, 0, 0]
    assert plan.shard_bytes(4) == 0
    assert plan.split_tensors({"p0": torch.zeros(3), "p1": torch.zeros(4)})[4] == {}


def test_no_split_keeps_tensors_whole() -> None:
    plan = ShardPlan(MODELS["mixed"], 3, chunk_bytes=1024, split=False)
    assert [s.key for s in plan.slices] == [p.name for p in plan.params]
    assert all(s.start == 0 and s.stop == plan.param(s.name).numel for s in plan.slices)


def test_chunk_smaller_than_item_still_works() -> None:
    plan = ShardPlan(_specs((3,), dtype="float64"), 2, chunk_bytes=1)
    assert [s.key for s in plan.slices] == ["p0[0:1]", "p0[1:2]", "p0[2:3]"]


def test_lookups() -> None:
    plan = ShardPlan(_specs((8,)), 2, chunk_bytes=16)
    s = plan.slice_for("p0[4:8]")
    assert s == Slice("p0[4:8]", "p0", 4, 8, s.shard, "float32") and s.nbytes == 16
    with pytest.raises(RegistryError, match="nope"):
        plan.slice_for("nope")
    with pytest.raises(RegistryError, match="nope"):
        plan.slices_of("nope")
    with pytest.raises(ConfigError, match="out of range"):
        plan.shard_slices(2)


# -- split / assemble ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("split", [True, False])
def test_split_then_assemble_is_bit_exact(dtype: torch.dtype, split: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 300), torch.nn.Linear(300, 7)).to(dtype)
    with torch.no_grad():  # full-precision values: init-then-cast would hide a float32 detour
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float64).to(dtype))
    plan = ShardPlan.from_module(model, num_shards=3, chunk_bytes=10_000, split=split)
    source = dict(model.named_parameters())
    assert any(s.key != s.name for s in plan.slices) == split
    parts = plan.split_tensors(source)
    assert set(parts) == {0, 1, 2}
    for k, part in parts.items():
        assert list(part) == [s.key for s in plan.shard_slices(k)]
        for key, t in part.items():
            assert t.dim() == 1 and t.numel() == plan.slice_for(key).numel
            assert not t.requires_grad

    # Simulate the wire: copy each shard's slices, then rebuild into fresh tensors.
    targets = {n: torch.full_like(p, float("nan")).requires_grad_() for n, p in source.items()}
    for part in parts.values():
        plan.assemble_into(targets, {k: v.clone() for k, v in part.items()})
    for n, p in source.items():
        a, b = targets[n].detach(), p.detach()
        assert torch.equal(
            a.view(-1).view(torch.int16 if dtype == torch.bfloat16 else dtype),
            b.view(-1).view(torch.int16 if dtype == torch.bfloat16 else dtype),
        )


def test_split_returns_views_without_copy() -> None:
    w = torch.arange(1000, dtype=torch.float32).reshape(10, 100)
    plan = ShardPlan([ParamSpec("w", (10, 100), "float32")], 2, chunk_bytes=1000)
    parts = plan.split_tensors({"w": w})
    for part in parts.values():
        for t in part.values():
            assert t.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
    w += 1  # a view sees the change
    s = plan.slices_of("w")[0]
    assert float(parts[s.shard][s.key][0]) == 1.0


def test_assemble_into_non_contiguous_target() -> None:
    src = torch.randn(6, 4)
    plan = ShardPlan([ParamSpec("w", (6, 4), "float32")], 2, chunk_bytes=32)
    target = torch.zeros(4, 6).t()  # non-contiguous (6, 4)
    for part in plan.split_tensors({"w": src}).values():
        plan.assemble_into({"w": target}, part)
    assert torch.equal(target, src)


def test_assemble_rejects_bad_input() -> None:
    plan = ShardPlan(_specs((8,)), 2, chunk_bytes=16)
    full = {"p0": torch.zeros(8)}
    with pytest.raises(RegistryError, match="unknown"):
        plan.assemble_into(full, {"unknown": torch.zeros(4)})
    with pytest.raises(ConfigError, match="elements"):
        plan.assemble_into(full, {"p0[0:4]": torch.zeros(3)})
    with pytest.raises(ConfigError, match="dtype"):
        plan.assemble_into(full, {"p0[0:4]": torch.zeros(4, dtype=torch.float64)})
    with pytest.raises(ConfigError, match="shape"):
        plan.assemble_into({"p0": torch.zeros(9)}, {"p0[0:4]": torch.zeros(4)})
    with pytest.raises(ConfigError, match="no tensor"):
        plan.split_tensors({})


def test_shape_check_compares_every_dimension() -> None:
    # _checked compares torch.Size to the spec's tuple directly: same numel, other
    # shape (a transpose, an extra unit dimension) must still be refused
    plan = ShardPlan(_specs((2, 4)), 1)
    value = {"p0": torch.zeros(8)}
    for wrong in ((4, 2), (2, 4, 1), (8,)):
        with pytest.raises(ConfigError, match="shape"):
            plan.assemble_into({"p0": torch.zeros(wrong)}, value)
        with pytest.raises(ConfigError, match="shape"):
            plan.split_tensors({"p0": torch.zeros(wrong)})
    target = {"p0": torch.zeros(2, 4)}
    plan.assemble_into(target, {"p0": torch.arange(8.0)})
    assert torch.equal(target["p0"], torch.arange(8.0).view(2, 4))


# -- describe / diff -----------------------------------------------------------


def test_from_description_round_trip() -> None:
    plan = ShardPlan(MODELS["bf16-f64"], 3, chunk_bytes=MiB, split=True)
    d = json.loads(json.dumps(plan.describe()))  # survives JSON
    again = ShardPlan.from_description(d)
    assert again == plan and again.hash == plan.hash and again.slices == plan.slices
    assert set(d) == {"params", "num_shards", "chunk_bytes", "split"}


def test_diff_identical_is_empty() -> None:
    plan = ShardPlan(MODELS["mixed"], 2)
    assert plan.diff(ShardPlan(MODELS["mixed"], 2).describe()) == ""


def test_diff_names_what_differs() -> None:
    ours = ShardPlan(_specs((10, 5), (4,), (3,)), 4)
    theirs = ShardPlan([ParamSpec("p0", (5, 10), "float32"), ParamSpec("p1", (4,), "float64")], 2)
    text = ours.diff(theirs.describe())
    assert "number of shards 4 vs 2" in text
    assert "p2" in text and "only in ours" in text
    assert "p0: (10, 5) vs (5, 10)" in text
    assert "p1: float32 vs float64" in text


def test_diff_chunk_split_order_and_malformed() -> None:
    ours = ShardPlan(_specs((10,), (4,)), 2)
    text = ours.diff(ShardPlan(list(reversed(ours.params)), 2, 1024, split=False).describe())
    assert "chunk size" in text and "split" in text and "order" in text
    assert "only in theirs: extra" in ours.diff(
        ShardPlan([*ours.params, ParamSpec("extra", (1,), "float32")], 2).describe()
    )
    assert "unusable" in ours.diff({"params": "garbage"})


# -- validation ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ShardPlan([], 2), "empty"),
        (lambda: ShardPlan(_specs((1,)), 0), "num_shards"),
        (lambda: ShardPlan(_specs((1,)), 2, chunk_bytes=0), "chunk_bytes"),
        (lambda: ShardPlan(_specs((1,)) + _specs((2,)), 2), "duplicate.*p0"),
        (lambda: ParamSpec("x", (2,), "float128"), "unknown dtype"),
        (lambda: ParamSpec("x", (2,), "torch.float32"), "unknown dtype"),
        (lambda: ParamSpec("x", (-1,), "float32"), "negative"),
        (lambda: ParamSpec("", (1,), "float32"), "name"),
        (lambda: ShardPlan.from_description({"params": []}), "malformed|empty"),
    ],
)
def test_validation_errors(make, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=match):
        make()


def test_paramspec_properties() -> None:
    p = ParamSpec("w", [3, 4], "bfloat16")  # type: ignore[arg-type]
    assert p.shape == (3, 4) and p.numel == 12 and p.itemsize == 2 and p.nbytes == 24
    assert ParamSpec("s", (), "float64").numel == 1


def test_copy_bytes_matches_copy_for_every_layout() -> None:
    from paramserver.util.dtypes import copy_bytes

    src = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for source in (src, src.t(), src.reshape(-1)):  # contiguous, strided, flat
        dst = torch.empty(24)
        copy_bytes(dst, source)
        assert torch.equal(dst, source.reshape(-1))
    wide = torch.empty(24, dtype=torch.float64)
    copy_bytes(wide, src.to(torch.bfloat16))  # converted, as copy_ would
    assert torch.equal(wide, src.reshape(-1).to(torch.float64))
    empty = torch.empty(0)
    copy_bytes(empty, torch.empty(0))
    assert empty.numel() == 0
