"""Task contract, registry and built-in tasks (no sockets)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paramserver.errors import ConfigError, RegistryError
from paramserver.workers.tasks import (
    EpochBatches,
    Task,
    as_task,
    available_tasks,
    create_task,
    evaluate,
    register_task,
    resolve_task,
    task_description,
    task_parameters,
)

BUILTINS = ["digits-mlp", "synthetic-logreg", "synthetic-mlp"]
FIXTURE = "tasks_fixture"


@pytest.fixture
def one_thread() -> Iterator[None]:
    # Tiny models train ~20x faster on one thread than with threads fighting over busy cores.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _fixture_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _stack(task: Task) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*task.batches, strict=True)
    return torch.cat(xs), torch.cat(ys)


def test_builtins_registered_sorted() -> None:
    names = list(available_tasks())
    assert names == sorted(names)
    assert set(BUILTINS) <= set(names)
    for name in BUILTINS:
        assert task_description(name)
        params = task_parameters(resolve_task(name))
        assert {"seed", "batch_size", "dtype"} <= set(params)
        assert "rank" not in params and "world_size" not in params
        assert params["seed"] == 0 and params["batch_size"] == 32 and params["dtype"] == "float32"


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_ranks_agree_on_init_and_split_data(name: str) -> None:
    t0, t1 = create_task(name, 0, 2), create_task(name, 1, 2)
    s0, s1 = _state(t0.model), _state(t1.model)
    assert s0.keys() == s1.keys()
    for key in s0:
        assert torch.equal(s0[key], s1[key]), key
    # a different seed gives different initial weights
    other = _state(create_task(name, 0, 2, {"seed": 1}).model)
    assert any(not torch.equal(s0[k], other[k]) for k in s0)

    x0, y0 = _stack(t0)
    x1, y1 = _stack(t1)
    full_x, _ = _stack(create_task(name, 0, 1))
    # disjoint and covering: the union of the ranks' rows is the single-worker split
    rows0 = {tuple(r.tolist()) for r in x0}
    rows1 = {tuple(r.tolist()) for r in x1}
    full = {tuple(r.tolist()) for r in full_x}
    assert len(rows0) + len(rows1) == len(full) == full_x.shape[0]
    assert not rows0 & rows1
    assert rows0 | rows1 == full
    assert abs(x0.shape[0] - x1.shape[0]) <= 1
    assert y0.shape[0] == x0.shape[0] and y1.shape[0] == x1.shape[0]

    # held-out data is the same on every rank
    e0 = list(t0.eval_batches or [])
    e1 = list(t1.eval_batches or [])
    assert e0 and len(e0) == len(e1)
    for (a, b), (c, d) in zip(e0, e1, strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)
    held = {tuple(r.tolist()) for a, _ in e0 for r in a}
    assert not held & full


@pytest.mark.parametrize("name", BUILTINS)
def test_batches_reiterable_and_reshuffled_deterministically(name: str) -> None:
    task = create_task(name, 0, 2, {"batch_size": 50})
    assert isinstance(task.batches, EpochBatches)
    n = task.batches.num_samples
    epoch0 = list(task.batches)
    epoch1 = list(task.batches)
    assert len(epoch0) == len(task.batches) == math.ceil(n / 50)
    assert [b[0].shape[0] for b in epoch0[:-1]] == [50] * (len(epoch0) - 1)
    assert epoch0[-1][0].shape[0] == n - 50 * (len(epoch0) - 1)  # partial batch kept
    assert sum(b[0].shape[0] for b in epoch1) == n
    assert not torch.equal(epoch0[0][0], epoch1[0][0])  # reshuffled
    # same examples, other order
    assert torch.equal(
        torch.cat([b[0] for b in epoch0]).sort(dim=0).values,
        torch.cat([b[0] for b in epoch1]).sort(dim=0).values,
    )
    # a fresh build reproduces both epochs exactly
    again = create_task(name, 0, 2, {"batch_size": 50})
    for expected in (epoch0, epoch1):
        for (a, b), (c, d) in zip(expected, list(again.batches), strict=True):
            assert torch.equal(a, c) and torch.equal(b, d)
    # set_epoch replays an epoch
    task.batches.set_epoch(1)
    assert torch.equal(next(iter(task.batches))[0], epoch1[0][0])
    # another rank shuffles differently
    other = next(iter(create_task(name, 1, 2, {"batch_size": 50}).batches))[0]
    assert not torch.equal(other, epoch0[0][0])


@pytest.mark.parametrize("name", BUILTINS)
def test_dtype_float64_honoured(name: str) -> None:
    task = create_task(name, 0, 1, {"dtype": "float64"})
    assert all(p.dtype == torch.float64 for p in task.model.parameters())
    x, y = next(iter(task.batches))
    assert x.dtype == torch.float64
    ex, _ = next(iter(task.eval_batches or []))
    assert ex.dtype == torch.float64
    if task.classification:
        assert y.dtype == torch.int64
    else:
        assert y.dtype == torch.float64
    loss = task.loss_fn(task.model(x), y)
    assert loss.dtype == torch.float64 and loss.dim() == 0
    result = evaluate(task)
    assert math.isfinite(result["loss"])
    # float32 default
    task32 = create_task(name, 0, 1)
    assert all(p.dtype == torch.float32 for p in task32.model.parameters())
    assert next(iter(task32.batches))[0].dtype == torch.float32


def test_bad_dtype_and_knobs() -> None:
    with pytest.raises(ConfigError, match="dtype"):
        create_task("digits-mlp", 0, 1, {"dtype": "float16"})
    with pytest.raises(ConfigError, match="batch_size"):
        create_task("synthetic-logreg", 0, 1, {"batch_size": 0})
    with pytest.raises(ConfigError, match="cannot feed"):
        create_task("synthetic-logreg", 5, 8, {"samples": 4})


@pytest.mark.usefixtures("one_thread")
def test_digits_mlp_learns() -> None:
    task = create_task("digits-mlp", 0, 1)
    assert task.classification
    before = evaluate(task)
    assert before["accuracy"] < 0.5
    opt = torch.optim.SGD(task.model.parameters(), lr=0.1)
    accuracy = 0.0
    for _ in range(10):
        task.model.train()
        for x, y in task.batches:
            opt.zero_grad()
            task.loss_fn(task.model(x), y).backward()
            opt.step()
        accuracy = evaluate(task)["accuracy"]
        if accuracy > 0.9:
            break
    assert accuracy > 0.9
    assert evaluate(task)["loss"] < before["loss"]


@pytest.mark.usefixtures("one_thread")
def test_synthetic_logreg_is_learnable() -> None:
    task = create_task("synthetic-logreg", 0, 1, {"batch_size": 64})
    opt = torch.optim.SGD(task.model.parameters(), lr=0.5)
    for _ in range(5):
        for x, y in task.batches:
            opt.zero_grad()
            task.loss_fn(task.model(x), y).backward()
            opt.step()
    assert evaluate(task)["accuracy"] > 0.85


@pytest.mark.parametrize("mb", [0.5, 4.0])
@pytest.mark.parametrize("depth", [1, 3])
def test_synthetic_mlp_params_mb(mb: float, depth: int) -> None:
    task = create_task("synthetic-mlp", 0, 1, {"params_mb": mb, "depth": depth, "samples": 16})
    size = sum(p.numel() * p.element_size() for p in task.model.parameters()) / 2**20
    assert size == pytest.approx(mb, rel=0.02)
    linears = [m for m in task.model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == depth + 1


def test_synthetic_mlp_default_shape() -> None:
    task = create_task("synthetic-mlp", 0, 1, {"width": "16", "depth": "3", "input_dim": "5"})
    assert [m.out_features for m in task.model.modules() if isinstance(m, nn.Linear)] == [
        16, 16, 16, 1]
    assert not task.classification
    assert set(evaluate(task)) == {"loss"}


def test_evaluate_weights_by_samples_and_restores_mode() -> None:
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    # batch 1: 3 samples of error 1; batch 2: 1 sample of error 3 -> (3*1 + 1*9) / 4
    batches = [(torch.ones(3, 1), torch.ones(3, 1)), (torch.ones(1, 1), torch.full((1, 1), 3.0))]
    task = Task(model=model, batches=batches, loss_fn=F.mse_loss, eval_batches=batches)
    model.train()
    assert evaluate(task) == {"loss": pytest.approx(3.0)}
    assert model.training
    assert evaluate(Task(model=model, batches=batches, loss_fn=F.mse_loss)) == {}
    # another model can be scored on the task's data
    other = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        other.weight.fill_(1.0)
    assert evaluate(task, other)["loss"] == pytest.approx(1.0)


def test_evaluate_accuracy() -> None:
    model = nn.Identity()
    outputs = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    targets = torch.tensor([0, 1, 1, 1])
    task = Task(model=nn.Linear(1, 1), batches=[], loss_fn=F.cross_entropy,
                eval_batches=[(outputs[:1], targets[:1]), (outputs[1:], targets[1:])],
                classification=True)
    assert evaluate(task, model)["accuracy"] == pytest.approx(0.5)


def test_custom_module_function_task() -> None:
    task = create_task(f"{FIXTURE}:make_task", 1, 2, {"scale": "2.5", "flag": "true", "n": "6"})
    assert task.description == "fixture scale=2.5 flag=True n=6"
    x, y = next(iter(task.batches))
    assert x.flatten().tolist() == [1.0, 3.0, 5.0]
    assert torch.equal(y, 2.5 * x)
    params = task_parameters(resolve_task(f"{FIXTURE}:make_task"))
    assert params == {"scale": 1.0, "flag": False, "n": 8}
    assert task_description(f"{FIXTURE}:make_task").startswith("A linear regression")
    # non-string values pass through unchanged
    task = create_task(f"{FIXTURE}:make_task", 0, 1, {"n": 3, "flag": False})
    assert task.description == "fixture scale=1.0 flag=False n=3"


def test_duck_typed_task() -> None:
    task = create_task(f"{FIXTURE}:make_duck", 0, 1)
    assert isinstance(task, Task) and task.classification
    assert evaluate(task)["accuracy"] >= 0.0
    # a factory that does not declare rank/world_size is still callable
    assert isinstance(create_task(f"{FIXTURE}:no_context", 0, 3).model, nn.Linear)
    mapping = as_task({"model": nn.Linear(1, 1), "batches": [], "loss_fn": F.mse_loss})
    assert not mapping.classification and mapping.eval_batches is None


def test_as_task_errors() -> None:
    with pytest.raises(ConfigError, match="loss_fn"):
        create_task(f"{FIXTURE}:no_loss", 0, 1)
    with pytest.raises(ConfigError, match=r"torch\.nn\.Module"):
        create_task(f"{FIXTURE}:bad_model", 0, 1)
    with pytest.raises(ConfigError, match="batches"):
        as_task(SimpleNamespace(model=nn.Linear(1, 1), loss_fn=F.mse_loss))
    with pytest.raises(ConfigError, match="one-shot iterator"):
        as_task(SimpleNamespace(model=nn.Linear(1, 1), loss_fn=F.mse_loss,
                                batches=iter([(torch.zeros(1), torch.zeros(1))])))


def test_unknown_task_lists_known_names() -> None:
    with pytest.raises(RegistryError) as info:
        resolve_task("no-such-task")
    message = str(info.value)
    for name in BUILTINS:
        assert name in message
    assert "module:function" in message
    with pytest.raises(RegistryError, match="cannot import"):
        resolve_task("no_such_module_xyz:make")
    with pytest.raises(RegistryError, match="no attribute"):
        resolve_task(f"{FIXTURE}:nothing_here")


@pytest.mark.parametrize(("rank", "world_size"), [(-1, 2), (2, 2), (0, 0), (True, 2)])
def test_bad_rank(rank: int, world_size: int) -> None:
    with pytest.raises(ConfigError, match=r"rank|world_size"):
        create_task("synthetic-logreg", rank, world_size)


def test_unknown_and_bad_args() -> None:
    with pytest.raises(ConfigError) as info:
        create_task("digits-mlp", 0, 1, {"hiden": "32"})
    assert "hiden" in str(info.value) and "hidden" in str(info.value)
    assert "batch_size" in str(info.value)
    with pytest.raises(ConfigError, match="not a valid int"):
        create_task("digits-mlp", 0, 1, {"hidden": "lots"})
    with pytest.raises(ConfigError, match="not a bool"):
        create_task(f"{FIXTURE}:make_task", 0, 1, {"flag": "maybe"})
    with pytest.raises(ConfigError, match="separately"):
        create_task("digits-mlp", 0, 1, {"rank": "0"})
    with pytest.raises(ConfigError, match="accepted: none"):
        create_task(f"{FIXTURE}:make_duck", 0, 1, {"seed": 1})


def test_string_args_converted_for_builtins() -> None:
    task = create_task("digits-mlp", 0, 1,
                       {"hidden": "16", "batch_size": "100", "seed": "3", "dtype": "float64"})
    first = next(m for m in task.model.modules() if isinstance(m, nn.Linear))
    assert first.out_features == 16
    assert next(iter(task.batches))[0].shape == (100, 64)
    ref = create_task("digits-mlp", 0, 1, {"hidden": 16, "seed": 3, "dtype": "float64"})
    assert torch.equal(first.weight, next(iter(ref.model.parameters())))


def test_register_refuses_duplicates() -> None:
    with pytest.raises(RegistryError, match="already registered"):
        @register_task("digits-mlp")
        def clash(*, rank: int, world_size: int) -> Task:  # pragma: no cover - never called
            raise AssertionError

    with pytest.raises(RegistryError, match="not allowed"):
        register_task("mod:fn")


def test_register_custom_and_kwargs_factory() -> None:
    name = "test-kwargs-task"

    @register_task(name, description="accepts anything")
    def factory(**kwargs: object) -> SimpleNamespace:
        return SimpleNamespace(model=nn.Linear(1, 1), batches=[], loss_fn=F.mse_loss,
                               description=repr(sorted(kwargs.items())))

    try:
        assert name in available_tasks()
        assert task_description(name) == "accepts anything"
        assert task_parameters(factory) == {}
        task = create_task(name, 1, 2, {"anything": "x"})
        assert task.description == repr([("anything", "x"), ("rank", 1), ("world_size", 2)])
    finally:
        from paramserver.workers import tasks as tasks_module

        tasks_module._REGISTRY.pop(name, None)
        tasks_module._DESCRIPTIONS.pop(name, None)


def test_task_parameters_marks_required() -> None:
    def factory(*, rank: int, world_size: int, needed: int, opt: str = "a") -> None:
        raise AssertionError

    assert task_parameters(factory) == {"needed": inspect.Parameter.empty, "opt": "a"}


def test_global_rng_untouched() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    create_task("synthetic-mlp", 0, 1, {"samples": 8})
    assert torch.equal(torch.rand(3), expected)
