"""Optimizers and lr schedulers built from torch by name."""

from __future__ import annotations

import pytest
import torch
from torch.optim.lr_scheduler import LRScheduler, StepLR

from paramserver.core.optim import (
    OPTIMIZERS,
    REQUIRED,
    SCHEDULERS,
    build_optimizer,
    build_scheduler,
    optimizer_parameters,
    parse_kwargs,
    resolve_optimizer,
    resolve_scheduler,
    scheduler_parameters,
)
from paramserver.errors import ConfigError, RegistryError


def _leaf() -> torch.Tensor:
    return torch.zeros(4, requires_grad=True)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_short_name_builds_and_steps(name: str) -> None:
    w = _leaf()
    opt = build_optimizer(name, [w], {"lr": 0.1})
    assert type(opt).__name__ == OPTIMIZERS[name]
    w.grad = torch.ones(4)
    opt.step()
    assert not torch.equal(w.detach(), torch.zeros(4))


def test_sgd_momentum_nesterov_weight_decay_matches_torch() -> None:
    kwargs = {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}
    a, b = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    ours = build_optimizer("SGD", [a], kwargs)
    ref = torch.optim.SGD([b], **kwargs)  # type: ignore[arg-type]
    assert ours.defaults["momentum"] == 0.9 and ours.defaults["nesterov"] is True
    for g in (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([-1.0, 0.5, 0.0])):
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert torch.equal(a, b)


def test_bad_kwarg_names_accepted_parameters() -> None:
    with pytest.raises(ConfigError, match=r"SGD.*momentum_typo.*accepted:.*momentum"):
        build_optimizer("sgd", [_leaf()], {"momentum_typo": 0.9})


def test_bad_kwarg_value_is_config_error() -> None:
    with pytest.raises(ConfigError, match=r"SGD.*[Nn]esterov.*accepted:.*lr"):
        build_optimizer("sgd", [_leaf()], {"nesterov": True})  # needs momentum
    with pytest.raises(ConfigError, match="Adam"):
        build_optimizer("adam", [_leaf()], {"lr": -1.0})


def test_unknown_optimizer_lists_known_names() -> None:
    with pytest.raises(RegistryError, match=r"unknown optimizer 'adamz'.*adam"):
        resolve_optimizer("adamz")


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("torch.optim:SGD", torch.optim.SGD),
        ("SGD", torch.optim.SGD),
        ("ADAMW", torch.optim.AdamW),
        ("RMSprop", torch.optim.RMSprop),
        ("torch.optim.adam:Adam", torch.optim.Adam),
    ],
)
def test_resolve_optimizer_forms(name: str, cls: type) -> None:
    assert resolve_optimizer(name) is cls


def test_module_class_errors() -> None:
    with pytest.raises(RegistryError, match="cannot import"):
        resolve_optimizer("no_such_module_xyz:Opt")
    with pytest.raises(RegistryError, match="no attribute"):
        resolve_optimizer("torch.optim:Nope")
    with pytest.raises(RegistryError, match=r"not a torch.optim.Optimizer"):
        resolve_optimizer("torch.nn:Linear")


def test_closure_optimizer_is_refused() -> None:
    with pytest.raises(ConfigError, match="closure"):
        resolve_optimizer("lbfgs")


def test_string_values_are_typed() -> None:
    opt = build_optimizer("adam", [_leaf()], {"lr": "0.01", "betas": "0.8,0.9"})
    assert opt.defaults["lr"] == 0.01 and opt.defaults["betas"] == (0.8, 0.9)


def test_optimizer_parameters() -> None:
    params = optimizer_parameters("sgd")
    assert params["momentum"] == 0 and params["nesterov"] is False
    assert "params" not in params
    assert scheduler_parameters("step")["step_size"] is REQUIRED
    assert repr(REQUIRED) == "<required>"


# -- schedulers ----------------------------------------------------------------


def test_step_scheduler_changes_lr() -> None:
    w = _leaf()
    opt = build_optimizer("sgd", [w], {"lr": 0.1})
    sched = build_scheduler("step", opt, {"step_size": 2, "gamma": 0.5})
    assert isinstance(sched, StepLR)
    lrs = []
    for _ in range(4):
        w.grad = torch.ones(4)
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.1, 0.05, 0.05, 0.025])


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_scheduler_short_names_resolve(name: str) -> None:
    cls = resolve_scheduler(name)
    assert issubclass(cls, LRScheduler) and cls.__name__ == SCHEDULERS[name]


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("multi_step", {"milestones": (1, 3)}),
        ("exponential", {"gamma": 0.9}),
        ("cosine", {"T_max": 10}),
        ("linear", {}),
        ("constant", {}),
        ("one-cycle", {"max_lr": 1.0, "total_steps": 10}),
        ("StepLR", {"step_size": 1}),
        ("torch.optim.lr_scheduler:ExponentialLR", {"gamma": 0.5}),
    ],
)
def test_schedulers_build(name: str, kwargs: dict[str, object]) -> None:
    opt = build_optimizer("sgd", [_leaf()], {"lr": 0.1, "momentum": 0.9})
    assert isinstance(build_scheduler(name, opt, kwargs), LRScheduler)


def test_scheduler_errors() -> None:
    opt = build_optimizer("sgd", [_leaf()], {"lr": 0.1})
    assert build_scheduler(None, opt, None) is None
    assert build_scheduler("none", opt, {}) is None
    with pytest.raises(RegistryError, match=r"unknown lr scheduler.*cosine"):
        resolve_scheduler("sawtooth")
    with pytest.raises(ConfigError, match="StepLR needs step_size"):
        build_scheduler("step", opt, {})
    with pytest.raises(ConfigError, match=r"no parameter 'stepsize'.*step_size"):
        build_scheduler("step", opt, {"stepsize": 3})
    with pytest.raises(ConfigError, match="metric"):
        resolve_scheduler("ReduceLROnPlateau")
    with pytest.raises(ConfigError, match="without a scheduler"):
        build_scheduler(None, opt, {"gamma": 0.1})


# -- parse_kwargs --------------------------------------------------------------


def test_parse_kwargs_types() -> None:
    got = parse_kwargs(
        [
            "lr=0.1",
            "momentum=0.9",
            "nesterov=true",
            "betas=0.9,0.999",
            "step_size=3",
            "amsgrad=False",
            "milestones=10,20",
            "one=5,",
            "mode=triangular",
            "eps=1e-8",
            "foreach=none",
            "neg=-2",
            " spaced = 4 ",
        ]
    )
    assert got == {
        "lr": 0.1,
        "momentum": 0.9,
        "nesterov": True,
        "betas": (0.9, 0.999),
        "step_size": 3,
        "amsgrad": False,
        "milestones": (10, 20),
        "one": (5,),
        "mode": "triangular",
        "eps": 1e-8,
        "foreach": None,
        "neg": -2,
        "spaced": 4,
    }
    assert type(got["step_size"]) is int and type(got["lr"]) is float
    assert type(got["milestones"][0]) is int


@pytest.mark.parametrize("item", ["lr", "=0.1", "1x=2", "lr 0.1"])
def test_parse_kwargs_malformed(item: str) -> None:
    with pytest.raises(ConfigError, match="must look like key=value"):
        parse_kwargs([item])


def test_parse_kwargs_duplicate_and_plain_string() -> None:
    with pytest.raises(ConfigError, match="twice"):
        parse_kwargs(["lr=1", "lr=2"])
    with pytest.raises(ConfigError, match="list"):
        parse_kwargs("lr=1")
