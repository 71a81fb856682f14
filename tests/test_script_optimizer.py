"""A script's own optimizer as the servers' (issue 43, item 7): the pure rules
(core/hyper.py), their checks at the wire, the shard's adoption and lr changes
(server/scriptopt.py, core/stepper.py), the worker's side (workers/wrapped.py) and the
CLI's "the launch named no optimizer". No sockets: tests/test_wrapped_optimizer_e2e.py
runs it over real processes."""

from __future__ import annotations

import math

import click
import msgpack
import pytest
import torch
from click.testing import CliRunner

from paramserver.cli import options
from paramserver.core.hyper import OptimizerSpec, check_lr, conflict, group_lr
from paramserver.core.modes import CoreConfig
from paramserver.core.probe import Probe
from paramserver.core.stepper import Stepper
from paramserver.errors import ConfigError, ErrorCode, ProtocolError
from paramserver.observe.events import EventLog, read_events
from paramserver.server.config import ServerConfig
from paramserver.server.scriptopt import META_KEY, ScriptOptimizer
from paramserver.wire.protocol import PROTOCOL_VERSION, decode
from paramserver.workers.wrapped import Wrapped


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


# ---------------------------------------------------------------------- the spec


def test_a_wrapped_optimizer_is_its_class_and_every_hyper_parameter():
    model = _model()
    spec = OptimizerSpec.of(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9,
                                            nesterov=True))
    assert spec.name == "sgd" and spec.lr == 0.01
    assert spec.kwargs == {"lr": 0.01, "momentum": 0.9, "dampening": 0, "weight_decay": 0,
                           "nesterov": True, "maximize": False}
    assert spec.describe() == "SGD(lr=0.01, momentum=0.9, nesterov=True)"
    # through the wire's map (tuples as lists) and back: the same spec
    adam = OptimizerSpec.of(torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.8, 0.9)))
    wire = msgpack.unpackb(msgpack.packb(adam.to_wire()))
    assert OptimizerSpec.checked(wire["name"], wire["args"]) == adam
    # groups that agree are one optimizer
    two = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
    assert OptimizerSpec.of(two) == OptimizerSpec.checked("sgd", {"lr": 0.1})


def test_what_the_servers_cannot_run_is_refused_naming_what_works():
    model = _model()
    with pytest.raises(ConfigError, match=r"cannot run torch.optim.lbfgs.LBFGS.*wraps "
                                          r"torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW"):
        OptimizerSpec.of(torch.optim.LBFGS(model.parameters()))
    groups = torch.optim.SGD([{"params": [model.weight], "lr": 0.1},
                              {"params": [model.bias], "lr": 0.01}], momentum=0.9)
    with pytest.raises(ConfigError, match=r"param_groups\[1\] differs from param_groups\[0\] "
                                          r"in lr: the servers run one optimizer"):
        OptimizerSpec.of(groups)


@pytest.mark.parametrize(("name", "args", "match"), [
    ("sgd", {"lr": -0.1}, "finite number > 0"),
    ("sgd", {"lr": 0}, "finite number > 0"),
    ("sgd", {"lr": math.inf}, "not finite"),
    ("sgd", {"lr": math.nan}, "not finite"),
    ("sgd", {"lr": True}, "finite number > 0"),
    ("sgd", {"lr": "0.1"}, "not a number"),
    ("sgd", {"momentum": -1.0}, "Invalid momentum"),
    ("sgd", {"nesterov": True}, "Nesterov momentum requires"),
    ("adam", {"betas": [1.0, 0.9]}, "Invalid beta"),
    ("adam", {"betas": [0.9] * 5}, "tuple of up to 4"),
    ("sgd", {"foreach": True}, "has no hyper-parameter 'foreach'"),
    ("sgd", {f"k{i}": 1 for i in range(17)}, "at most 16"),
    ("lbfgs", {}, "not an optimizer the servers run"),
    ("os:system", {}, "not an optimizer the servers run"),
    ("delayed-nesterov", {}, "not an optimizer the servers run"),
    (3, {}, "not an optimizer the servers run"),
    ("sgd", [], "must be a map"),
])
def test_a_spec_from_a_peer_is_checked_against_the_class_and_its_bounds(name, args, match):
    with pytest.raises(ConfigError, match=match):
        OptimizerSpec.checked(name, args)


def test_a_conflict_is_one_line_and_defaults_are_no_conflict():
    script = OptimizerSpec.checked("sgd", {"lr": 0.05, "momentum": 0.9})
    assert conflict(OptimizerSpec.checked("sgd", {"lr": 0.05, "momentum": 0.9,
                                                  "dampening": 0.0}), script, "x") is None
    line = conflict(OptimizerSpec.checked("sgd", {"lr": 0.1}), script, "--lr")
    assert line == ("the script's optimizer SGD(lr=0.05, momentum=0.9) is not the servers' "
                    "SGD(lr=0.1, momentum=0) (--lr): leave those out to run the script's, "
                    "or make the two agree")
    assert "Adam(lr=0.05)" in conflict(script, OptimizerSpec.checked("adam", {"lr": 0.05}), "x")


def test_a_learning_rate_is_finite_and_positive_and_one_for_all_groups():
    assert check_lr(0.5) == 0.5 and check_lr(torch.tensor(0.25)) == 0.25
    for bad in (0, -1, math.nan, math.inf, None, "1", False):
        with pytest.raises(ConfigError, match="finite number > 0"):
            check_lr(bad)
    assert group_lr([{"lr": 0.1}, {"lr": 0.1}]) == 0.1
    with pytest.raises(ConfigError, match=r"learning rates \[0.01, 0.1\]: the servers keep one"):
        group_lr([{"lr": 0.1}, {"lr": 0.01}])


# ---------------------------------------------------------------------- the wire


def _frames(op: str, fields: dict) -> list[bytes]:
    return [msgpack.packb({"v": PROTOCOL_VERSION, "op": op, "seq": 1, "f": fields, "t": []})]


def _hello(**more) -> dict:
    return {"worker": 0, "role": "worker", "protocol": PROTOCOL_VERSION,
            "plan_hash": "0" * 64, "incarnation": "x", **more}


def test_the_wire_checks_the_optimizer_and_the_lr_once():
    spec = OptimizerSpec.checked("sgd", {"lr": 0.05, "momentum": 0.9})
    assert decode(_frames("hello", _hello(optimizer=spec.to_wire()))).body.optimizer == spec
    assert decode(_frames("hello", _hello())).body.optimizer is None
    for bad in ({"name": "sgd", "args": {"lr": -1}}, {"name": "pickle:loads", "args": {}},
                {"name": "sgd", "args": {"momentum": 1e400}}, {"args": {}}):
        with pytest.raises(ProtocolError) as info:
            decode(_frames("hello", _hello(optimizer=bad)))
        assert info.value.code == ErrorCode.BAD_FIELD
    push = {"worker": 0, "push_id": 0, "clock": 0, "read_version": 0, "num_samples": 1}
    assert decode(_frames("push", {**push, "lr": 0.25})).body.lr == 0.25
    assert decode(_frames("push", push)).body.lr is None
    assert decode(_frames("spush", {**push, "lr": 2})).body.lr == 2.0
    for bad_lr in (-0.1, 0, float("nan"), float("inf"), "0.1"):
        with pytest.raises(ProtocolError) as info:
            decode(_frames("push", {**push, "lr": bad_lr}))
        assert info.value.code == ErrorCode.BAD_FIELD


# ---------------------------------------------------------------------- the shard


def test_a_changed_lr_is_the_steps_and_the_state_dicts():
    w = torch.zeros(3)
    stepper = Stepper(CoreConfig(optimizer="sgd", optimizer_args={"lr": 0.1, "momentum": 0.9}),
                      [w])
    assert stepper.set_lr(0.1) is None
    assert stepper.set_lr(0.025) == 0.1 and stepper.lr == 0.025
    ref = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([ref], lr=0.025, momentum=0.9)
    for _ in range(2):
        grad = torch.ones(3)
        stepper.step({"w": w}, {"w": grad.clone()}, 1.0, contributors=1, version=0,
                     staleness=0, prior_staleness=0, probe=Probe({"w": w}), before_step=None)
        ref.grad = grad.clone()
        opt.step()
    assert torch.equal(w, ref.detach())
    assert stepper.state_dict()["param_groups"][0]["lr"] == 0.025  # what a checkpoint keeps


def test_the_shard_adopts_the_first_scripts_optimizer_only_when_the_launch_named_none(tmp_path):
    spec = OptimizerSpec.checked("adam", {"lr": 0.01})
    named = ScriptOptimizer(ServerConfig(optimizer="sgd", optimizer_args={"lr": 0.1}),
                            EventLog(None))
    named.adopt(spec)
    assert named.config.optimizer == "sgd" and named.meta() == {META_KEY: None}
    with pytest.raises(ProtocolError) as info:
        named.check(spec)
    assert info.value.code == ErrorCode.OPTIMIZER_MISMATCH
    assert "Adam(lr=0.01) is not the servers' SGD(lr=0.1) (--optimizer, --lr, " \
           "--optimizer-arg)" in info.value.reason
    named.check(OptimizerSpec.checked("sgd", {"lr": 0.1}))  # the same: no conflict
    custom = ScriptOptimizer(ServerConfig(optimizer="delayed-nesterov",
                                          optimizer_args={"lr": 0.7}), EventLog(None))
    with pytest.raises(ProtocolError, match="which a script cannot wrap"):
        custom.check(spec)

    free = ScriptOptimizer(ServerConfig(script_optimizer=True), EventLog(None))
    free.adopt(spec)
    assert (free.config.optimizer, free.config.optimizer_args["lr"]) == ("adam", 0.01)
    free.check(spec)
    with pytest.raises(ProtocolError, match="another worker's script wraps it"):
        free.check(OptimizerSpec.checked("adam", {"lr": 0.02}))
    # a checkpoint keeps it, and a resumed shard (the launch naming none) runs it again
    resumed = ScriptOptimizer(ServerConfig(script_optimizer=True), EventLog(None))
    resumed.restore(free.meta())
    assert resumed.adopted == spec and resumed.config.optimizer == "adam"
    with pytest.raises(ConfigError, match="not an optimizer the servers run"):
        resumed.restore({META_KEY: {"name": "os:system", "args": {}}})


def test_a_shards_lr_change_is_an_event(tmp_path):
    from paramserver.core.shard import ShardCore, SliceSpec

    core = ShardCore([SliceSpec("w", 4, "float32")],
                     CoreConfig(optimizer="sgd", optimizer_args={"lr": 0.1}))
    events = EventLog(tmp_path / "events.jsonl")
    script = ScriptOptimizer(ServerConfig(), events)
    script.set_lr(core, None, 0, 0.05)
    script.set_lr(core, None, 0, 0.05)  # (a retried push: no second record)
    events.close()
    assert [(e["worker"], e["lr"], e["previous"]) for e in
            read_events(tmp_path / "events.jsonl", "lr_changed")] == [(0, 0.05, 0.1)]
    assert core.stepper.lr == 0.05


# ---------------------------------------------------------------------- the worker


def test_the_wrapped_optimizer_shares_its_groups_and_sends_only_the_evaluators_changes(
        caplog):
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    wrapped = Wrapped(sgd, dict(model.named_parameters()))
    owner = torch.optim.SGD(model.parameters(), lr=1.0)  # stands in for DistributedOptimizer
    wrapped.share(owner, 0.025)  # a resumed run: the servers' lr wins
    assert owner.param_groups is sgd.param_groups and sgd.param_groups[0]["lr"] == 0.025
    assert wrapped.change(True, 0) is None
    owner.param_groups[0]["lr"] = 0.00625  # the plateau rule
    assert wrapped.change(True, 0) == 0.00625
    assert wrapped.change(False, 1) is None and "only the evaluating rank" in caplog.text
    # a torch scheduler on the DistributedOptimizer drives the same groups
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(owner, factor=0.5, patience=0)
    for _ in range(3):
        sched.step(1.0)
    assert wrapped.change(True, 0) == pytest.approx(0.00625 / 4)
    with pytest.raises(ConfigError, match="holds 1 tensors, the model 2 parameters"):
        Wrapped(torch.optim.SGD([model.weight], lr=0.1), dict(model.named_parameters()))
    with pytest.raises(ConfigError, match=r"must be a torch\.optim\.Optimizer"):
        Wrapped("sgd", dict(model.named_parameters()))  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the CLI


@pytest.mark.parametrize(("argv", "env", "adopts"), [
    ([], {}, True),
    (["--lr", "0.1"], {}, False),
    (["--optimizer", "adam"], {}, False),
    (["--optimizer-arg", "momentum=0.9"], {}, False),
    ([], {"PARAMSERVER_LR": "0.05"}, False),
])
def test_the_launch_named_no_optimizer_only_when_no_flag_says_one(argv, env, adopts):
    @click.command()
    @options.apply_groups("server")
    def probe(**opts):
        click.echo(f"adopts={options.server_config(opts).script_optimizer}")

    out = CliRunner().invoke(probe, argv, env=env)
    assert out.exit_code == 0, out.output
    assert f"adopts={adopts}" in out.output


def test_a_replica_that_joins_late_is_sent_the_scripts_optimizer():
    """A replica started in place of a dead one gets the primary's state from a snapshot,
    not from the HELLOs: the snapshot carries the optimizer the script brought, and the
    joining replica builds its core with it (ShardServer.adopt_state), checked as a HELLO's is."""
    from paramserver.wire import replication as wrepl

    spec = OptimizerSpec.checked("sgd", {"lr": 0.05, "momentum": 0.9})
    frames = wrepl.snapshot_frames(3, 7, 0.0, "tcp://127.0.0.1:1", b"", None, {},
                                   optimizer=spec.to_wire())
    record, _ = wrepl.decode(frames)
    assert isinstance(record, wrepl.Snapshot) and record.optimizer == spec.to_wire()
    joining = ScriptOptimizer(ServerConfig(script_optimizer=True), EventLog(None))
    joining.restore({META_KEY: record.optimizer})
    assert joining.adopted == spec and joining.config.optimizer_args["momentum"] == 0.9
    with pytest.raises(ConfigError):  # a forged one is checked, never trusted
        joining.restore({META_KEY: {"name": "sgd", "args": {"lr": -1.0}}})
