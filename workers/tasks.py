"""The task contract, the task registry and the built-in tasks.

A task is what one worker trains: a model, this worker's mini-batches, a loss
and, optionally, held-out batches. Tasks are built by a *factory* called as
``factory(rank=r, world_size=n, **task_args)``; it may return a :class:`Task`
or any object with ``model``, ``batches`` and ``loss_fn`` attributes (see
:func:`as_task`). Factories are found by registered name (``digits-mlp``) or
as ``module:function``.

Every worker of a run builds the same task with its own rank, so a factory
must give every rank the same initial weights (they are compared through the
shard plan hash, and sync training assumes them) and should give each rank
its own slice of the data. The built-ins do both deterministically from
``seed``: data is shuffled once with the seed and rank ``r`` keeps every
``world_size``-th example, so ranks see disjoint data that together cover the
training split.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paramserver.errors import ConfigError, RegistryError
from paramserver.util.coerce import coerce, parse_task_args
from paramserver.util.dtypes import TASK_DTYPES
from paramserver.util.plugins import Registry

__all__ = [
    "ENTRY_POINT_GROUP",
    "EpochBatches",
    "Task",
    "TaskFactory",
    "as_task",
    "available_tasks",
    "check_task_args",
    "create_task",
    "evaluate",
    "parse_task_args",
    "register_task",
    "resolve_task",
    "task_description",
    "task_parameters",
]

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]
#: called as ``factory(rank=r, world_size=n, **task_args)``; returns a Task or a duck-typed object
TaskFactory = Callable[..., Any]


@dataclass
class Task:
    """What one worker trains.

    ``batches`` must be re-iterable: each full iteration is one epoch (a list,
    a DataLoader or :class:`EpochBatches`; not a generator). ``loss_fn``
    returns the mean over the batch, so the server can weight pushes by their
    sample counts. ``eval_batches`` is held-out data, the same on every rank.
    """

    model: nn.Module
    batches: Iterable[Batch]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    eval_batches: Iterable[Batch] | None = None
    classification: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise ConfigError(
                f"task model must be a torch.nn.Module, got {type(self.model).__name__}"
            )
        if not callable(self.loss_fn):
            raise ConfigError(f"task loss_fn must be callable, got {type(self.loss_fn).__name__}")
        _check_reiterable("batches", self.batches)
        if self.eval_batches is not None:
            _check_reiterable("eval_batches", self.eval_batches)
        self.classification = bool(self.classification)
        self.description = str(self.description or "")


def _check_reiterable(field: str, value: object) -> None:
    if not isinstance(value, Iterable):
        raise ConfigError(f"task {field} must be iterable, got {type(value).__name__}")
    # A one-shot iterator would silently yield nothing from the second epoch on.
    # (Checked by type, not by calling iter(): that could start DataLoader workers.)
    if isinstance(value, Iterator):
        raise ConfigError(
            f"task {field} is a one-shot iterator ({type(value).__name__}); give a re-iterable "
            "object instead (a list, a DataLoader, or a class whose __iter__ starts a new epoch)"
        )


_REQUIRED = ("model", "batches", "loss_fn")
_MISSING: Any = object()


def as_task(obj: object) -> Task:
    """Return ``obj`` as a :class:`Task`.

    ``obj`` may be a Task, a mapping, or any object with attributes ``model``,
    ``batches`` and ``loss_fn`` (and optionally ``eval_batches``,
    ``classification``, ``description``). Raises :class:`ConfigError` naming a
    missing attribute, or when ``model`` is not a ``torch.nn.Module``.
    """
    if isinstance(obj, Task):
        return obj

    def get(key: str, default: Any = None) -> Any:
        if isinstance(obj, Mapping):
            return obj.get(key, default)
        return getattr(obj, key, default)

    missing = [key for key in _REQUIRED if get(key, _MISSING) is _MISSING]
    if missing:
        raise ConfigError(
            f"task object {type(obj).__name__} lacks {', '.join(missing)}; a task factory must "
            "return a Task or an object with model, batches and loss_fn"
        )
    return Task(
        model=get("model"),
        batches=get("batches"),
        loss_fn=get("loss_fn"),
        eval_batches=get("eval_batches"),
        classification=bool(get("classification", False)),
        description=str(get("description", "") or ""),
    )


# --------------------------------------------------------------------------- registry

_REGISTRY: dict[str, TaskFactory] = {}
_DESCRIPTIONS: dict[str, str] = {}
_CONTEXT_ARGS = ("rank", "world_size")


def _callable_task(obj: Any, name: str) -> TaskFactory:
    if not callable(obj):
        raise RegistryError(f"task factory {name!r} is not callable" if ":" in name
                            else f"task {name!r}: {obj!r} is not callable")
    return cast(TaskFactory, obj)


#: installed packages register tasks as entry points in this group (name = factory)
ENTRY_POINT_GROUP = "paramserver.tasks"
#: the tasks by name (built-ins, installed entry points, register_task)
TASKS: Registry[TaskFactory] = Registry(
    "task", group=ENTRY_POINT_GROUP, check=_callable_task,
    hint="or give module:function for your own factory", store=lambda: _REGISTRY)


def register_task(name: str, *, description: str = "") -> Callable[[TaskFactory], TaskFactory]:
    """Decorator registering a task factory under ``name``; refuses duplicate names."""
    TASKS.check_name(name)

    def decorator(factory: TaskFactory) -> TaskFactory:
        TASKS.register(name, factory)
        _DESCRIPTIONS[name] = description or _first_doc_line(factory)
        return factory

    return decorator


def _qualname(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _first_doc_line(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def available_tasks() -> dict[str, TaskFactory]:
    """Built-in and installed (entry point) task factories by name, sorted by name."""
    return TASKS.available()


def task_description(name: str) -> str:
    """One line describing a registered task (or a ``module:function`` factory's docstring)."""
    if name in _DESCRIPTIONS:
        return _DESCRIPTIONS[name]
    return _first_doc_line(resolve_task(name))


def resolve_task(name: str) -> TaskFactory:
    """Find a task factory by registered name or ``module:function``."""
    return TASKS.resolve(name)


def _signature(factory: TaskFactory) -> inspect.Signature:
    try:
        # eval_str turns `from __future__ import annotations` strings back into types
        return inspect.signature(factory, eval_str=True)
    except (NameError, TypeError, SyntaxError):
        try:
            return inspect.signature(factory)
        except (TypeError, ValueError) as exc:
            raise RegistryError(f"cannot inspect task factory {_qualname(factory)}: {exc}") from exc
    except ValueError as exc:
        raise RegistryError(f"cannot inspect task factory {_qualname(factory)}: {exc}") from exc


def task_parameters(factory: TaskFactory) -> dict[str, Any]:
    """The factory's keyword parameters besides rank and world_size, with their defaults.

    A parameter without a default maps to ``inspect.Parameter.empty``.
    """
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {
        key: p.default
        for key, p in _signature(factory).parameters.items()
        if p.kind in kinds and key not in _CONTEXT_ARGS
    }


def _convert(value: Any, param: inspect.Parameter | None, task: str, key: str) -> Any:
    """Convert a command-line string to the type the factory declares (its annotation, else
    its default's type); an undeclared one stays a string, as do non-string values."""
    if param is None:
        return value
    return coerce(value, param.annotation, param.default, untyped=str,
                  what=f"task {task!r}: argument {key}")


def check_task_args(name: str, args: Mapping[str, Any] | None) -> dict[str, Any]:
    """``args`` converted for task ``name``'s factory, without building the task.

    Raises :class:`ConfigError` for an argument the factory does not take (naming the
    ones it does) or a value its annotation refuses, and :class:`RegistryError` for an
    unknown task: what a worker would hit, found before any process starts.
    """
    factory = resolve_task(name)
    params = _signature(factory).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    accepted = task_parameters(factory)
    kwargs: dict[str, Any] = {}
    for key, value in (args or {}).items():
        if key in _CONTEXT_ARGS:
            raise ConfigError(f"task {name!r}: pass {key} separately, not as a task argument")
        if key not in accepted and not var_kw:
            listed = ", ".join(accepted) or "none"
            raise ConfigError(f"task {name!r} has no argument {key!r}; accepted: {listed}")
        kwargs[key] = _convert(value, params.get(key), name, key)
    return kwargs


def create_task(
    name: str, rank: int, world_size: int, args: Mapping[str, Any] | None = None
) -> Task:
    """Build task ``name`` for ``rank`` of ``world_size`` workers.

    String values in ``args`` are converted using the factory's annotations or
    defaults (int, float, bool, str). Raises :class:`ConfigError` for a bad
    rank, an argument the factory does not accept (listing the accepted ones),
    or a factory that fails on its arguments; :class:`RegistryError` for an
    unknown name.
    """
    for label, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{label} must be an int, got {value!r}")
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, {world_size}), got {rank}")
    factory = resolve_task(name)
    params = _signature(factory).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = check_task_args(name, args)
    # Factories that ignore their rank (e.g. a fixed toy problem) need not declare it.
    for key, value in (("rank", rank), ("world_size", world_size)):
        if key in params or var_kw:
            kwargs[key] = value
    try:
        obj = factory(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"task {name!r} could not be built with {kwargs}: {exc}") from exc
    return as_task(obj)


# --------------------------------------------------------------------------- evaluation


def evaluate(task: Task, model: nn.Module | None = None) -> dict[str, float]:
    """Loss (and accuracy for classification) of ``model`` on the task's held-out batches.

    The loss is the sample-weighted mean over all batches, so a short last
    batch counts for what it holds. Runs in eval mode without autograd and
    restores the model's training mode. Returns ``{}`` without held-out data.
    """
    model = task.model if model is None else model
    if task.eval_batches is None:
        return {}
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    was_training = model.training
    total_loss, correct, count = 0.0, 0, 0
    model.eval()
    try:
        with torch.no_grad():
            for inputs, targets in task.eval_batches:
                inputs, targets = inputs.to(device), targets.to(device)
                outputs = model(inputs)
                n = int(targets.shape[0])
                total_loss += float(task.loss_fn(outputs, targets)) * n
                if task.classification:
                    correct += int((outputs.argmax(dim=-1) == targets).sum())
                count += n
    finally:
        model.train(was_training)
    if count == 0:
        return {}
    result = {"loss": total_loss / count}
    if task.classification:
        result["accuracy"] = correct / count
    return result


# --------------------------------------------------------------------------- data helpers

# Independent random streams derived from the one user seed, so that e.g. the
# model init does not change when the data size does.
_MODEL_STREAM, _DATA_STREAM, _PARTITION_STREAM, _EPOCH_STREAM, _SPLIT_STREAM = range(5)
_EVAL_BATCH_SIZE = 1024
_DTYPES = TASK_DTYPES


def _derive_seed(*keys: int) -> int:
    state = np.random.SeedSequence(list(keys)).generate_state(1, dtype=np.uint64)[0]
    return int(state >> np.uint64(1))  # 63 bits: fits any torch seed API


def _generator(*keys: int) -> torch.Generator:
    return torch.Generator().manual_seed(_derive_seed(*keys))


class EpochBatches:
    """One rank's training examples as mini-batches; each iteration is a new epoch.

    Epoch ``e`` is ordered by a shuffle seeded from (seed, rank, e), so a run is
    reproducible yet every epoch differs. The last partial batch is kept.
    """

    def __init__(
        self, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int, seed: int, rank: int
    ) -> None:
        if inputs.shape[0] != targets.shape[0]:
            raise ConfigError(f"{inputs.shape[0]} inputs but {targets.shape[0]} targets")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.inputs, self.targets = inputs, targets
        self.batch_size, self.seed, self.rank = batch_size, seed, rank
        self._epoch = 0

    @property
    def num_samples(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def epoch(self) -> int:
        """The epoch the next iteration will produce (epochs started so far)."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration produce epoch ``epoch`` (e.g. when resuming)."""
        if epoch < 0:
            raise ConfigError(f"epoch must be >= 0, got {epoch}")
        self._epoch = epoch

    def __len__(self) -> int:
        return math.ceil(self.num_samples / self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        # Not a generator function: the epoch advances when iteration starts, not at
        # the first next(), so two iter() calls are always two epochs.
        gen = _generator(self.seed, _EPOCH_STREAM, self.rank, self._epoch)
        order = torch.randperm(self.num_samples, generator=gen)
        self._epoch += 1
        return self._batches(order)

    def _batches(self, order: torch.Tensor) -> Iterator[Batch]:
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            yield self.inputs[idx], self.targets[idx]


def _check_common(seed: int, batch_size: int, dtype: str) -> torch.dtype:
    if seed < 0:
        raise ConfigError(f"seed must be >= 0, got {seed}")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _positive(**values: float) -> None:
    for key, value in values.items():
        if not value > 0:
            raise ConfigError(f"{key} must be > 0, got {value}")


def _init_model(build: Callable[[], nn.Module], seed: int, dtype: torch.dtype) -> nn.Module:
    # fork_rng keeps the caller's global RNG untouched while making init depend on seed only.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_derive_seed(seed, _MODEL_STREAM))
        model = build()
    return model.to(dtype)


def _eval_batches(inputs: torch.Tensor, targets: torch.Tensor) -> list[Batch]:
    return [
        (inputs[i : i + _EVAL_BATCH_SIZE], targets[i : i + _EVAL_BATCH_SIZE])
        for i in range(0, int(inputs.shape[0]), _EVAL_BATCH_SIZE)
    ]


def _assemble(
    name: str,
    model: nn.Module,
    train: Batch,
    held_out: Batch,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    classification: bool,
    *,
    rank: int,
    world_size: int,
    seed: int,
    batch_size: int,
) -> Task:
    """Partition the training split for this rank and wrap everything as a Task."""
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, {world_size}), got {rank}")
    inputs, targets = train
    n = int(inputs.shape[0])
    if n < world_size:
        raise ConfigError(f"{name}: {n} training examples cannot feed {world_size} workers")
    order = torch.randperm(n, generator=_generator(seed, _PARTITION_STREAM))
    mine = order[rank::world_size]
    batches = EpochBatches(inputs[mine], targets[mine], batch_size, seed, rank)
    params = sum(p.numel() for p in model.parameters())
    return Task(
        model=model,
        batches=batches,
        loss_fn=loss_fn,
        eval_batches=_eval_batches(*held_out),
        classification=classification,
        description=(
            f"{name}: {params} parameters, rank {rank}/{world_size} holds "
            f"{len(mine)} of {n} training examples, {int(held_out[0].shape[0])} held out"
        ),
    )


def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(fan_in, fan_out))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


# --------------------------------------------------------------------------- built-in tasks


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    # Read the CSV that ships inside scikit-learn without importing scikit-learn:
    # the import costs ~2 s of CPU in every worker process, which dominates the
    # start-up of short experiment runs. The file is what load_digits() reads.
    import gzip
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "datasets/data/digits.csv.gz"
        if path.is_file():
            with gzip.open(path, "rt") as fh:
                data = np.loadtxt(fh, delimiter=",")
            return np.ascontiguousarray(data[:, :-1]), data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits  # a layout we do not know: the public API

    bunch = load_digits()
    return np.asarray(bunch.data, dtype=np.float64), np.asarray(bunch.target, dtype=np.int64)


@register_task("digits-mlp", description="MLP on scikit-learn's 8x8 digits (10 classes)")
def digits_mlp(
    *,
    rank: int,
    world_size: int,
    seed: int = 0,
    batch_size: int = 32,
    dtype: str = "float32",
    hidden: int = 64,
) -> Task:
    """MLP 64 -> hidden -> 10 on scikit-learn's digits, features scaled to [0, 1].

    The 80/20 train/held-out split is fixed (seeded by a constant, not by
    ``seed``), so runs with different seeds are scored on the same examples.
    """
    torch_dtype = _check_common(seed, batch_size, dtype)
    _positive(hidden=hidden)
    x_np, y_np = _digits()
    x = torch.from_numpy(x_np / 16.0).to(torch_dtype)
    y = torch.from_numpy(y_np)
    order = torch.randperm(len(y), generator=_generator(0, _SPLIT_STREAM))
    n_train = round(0.8 * len(y))
    train, held = order[:n_train], order[n_train:]
    model = _init_model(lambda: _mlp([64, hidden, 10]), seed, torch_dtype)
    return _assemble(
        "digits-mlp", model, (x[train], y[train]), (x[held], y[held]), F.cross_entropy, True,
        rank=rank, world_size=world_size, seed=seed, batch_size=batch_size,
    )


@register_task("synthetic-logreg", description="logistic regression on generated linear data")
def synthetic_logreg(
    *,
    rank: int,
    world_size: int,
    seed: int = 0,
    batch_size: int = 32,
    dtype: str = "float32",
    features: int = 20,
    samples: int = 2048,
    eval_samples: int = 512,
    noise: float = 0.1,
) -> Task:
    """Two-class linear model; labels are sign(x . w / sqrt(features) + noise * N(0, 1)).

    The ground-truth ``w`` and all examples come from ``seed``.
    """
    torch_dtype = _check_common(seed, batch_size, dtype)
    _positive(features=features, samples=samples, eval_samples=eval_samples)
    if noise < 0:
        raise ConfigError(f"noise must be >= 0, got {noise}")
    # Generate in float64 and cast, so float32 and float64 runs see the same data.
    gen = _generator(seed, _DATA_STREAM)
    weight = torch.randn(features, generator=gen, dtype=torch.float64)
    x = torch.randn(samples + eval_samples, features, generator=gen, dtype=torch.float64)
    eps = torch.randn(samples + eval_samples, generator=gen, dtype=torch.float64)
    y = ((x @ weight) / math.sqrt(features) + noise * eps > 0).long()
    x = x.to(torch_dtype)
    model = _init_model(lambda: nn.Linear(features, 2), seed, torch_dtype)
    return _assemble(
        "synthetic-logreg", model, (x[:samples], y[:samples]), (x[samples:], y[samples:]),
        F.cross_entropy, True,
        rank=rank, world_size=world_size, seed=seed, batch_size=batch_size,
    )


def _width_for(params_mb: float, depth: int, input_dim: int, itemsize: int) -> int:
    """Hidden width giving about ``params_mb`` MiB of parameters (output size 1)."""
    # params(w) = (depth-1) w^2 + (input_dim + depth + 1) w + 1: solve for w.
    target = params_mb * 2**20 / itemsize - 1
    a, b = depth - 1, input_dim + depth + 1
    w = target / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * target)) / (2 * a)
    return max(1, round(w))


@register_task(
    "synthetic-mlp", description="MLP regression on generated data, sized for benchmarks"
)
def synthetic_mlp(
    *,
    rank: int,
    world_size: int,
    seed: int = 0,
    batch_size: int = 32,
    dtype: str = "float32",
    width: int = 256,
    depth: int = 2,
    input_dim: int = 64,
    samples: int = 1024,
    eval_samples: int = 256,
    params_mb: float = 0.0,
) -> Task:
    """MLP input_dim -> width (x depth hidden layers) -> 1 with MSE on a random teacher's outputs.

    With ``params_mb > 0`` the width is chosen so that the parameters take
    about that many MiB in ``dtype`` (``width`` is then ignored).
    """
    torch_dtype = _check_common(seed, batch_size, dtype)
    _positive(depth=depth, input_dim=input_dim, samples=samples, eval_samples=eval_samples)
    if params_mb < 0:
        raise ConfigError(f"params_mb must be >= 0, got {params_mb}")
    if params_mb > 0:
        width = _width_for(params_mb, depth, input_dim, torch.finfo(torch_dtype).bits // 8)
    _positive(width=width)
    gen = _generator(seed, _DATA_STREAM)
    teacher_hidden = 32
    w1 = torch.randn(input_dim, teacher_hidden, generator=gen, dtype=torch.float64)
    w2 = torch.randn(teacher_hidden, 1, generator=gen, dtype=torch.float64)
    x = torch.randn(samples + eval_samples, input_dim, generator=gen, dtype=torch.float64)
    eps = torch.randn(samples + eval_samples, 1, generator=gen, dtype=torch.float64)
    y = torch.tanh(x @ w1 / math.sqrt(input_dim)) @ w2 / math.sqrt(teacher_hidden) + 0.01 * eps
    x, y = x.to(torch_dtype), y.to(torch_dtype)
    model = _init_model(lambda: _mlp([input_dim] + [width] * depth + [1]), seed, torch_dtype)
    return _assemble(
        "synthetic-mlp", model, (x[:samples], y[:samples]), (x[samples:], y[samples:]),
        F.mse_loss, False,
        rank=rank, world_size=world_size, seed=seed, batch_size=batch_size,
    )


# the built-in task on sparse tables lives in its own module (it needs ShardedEmbedding);
# importing it registers "recsys"
from paramserver.workers import recsys as _recsys  # noqa: E402, F401
