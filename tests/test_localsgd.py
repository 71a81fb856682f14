"""Local SGD / DiLoCo (issue 33): real shard and worker processes on loopback, float64.

H = 1 with an inner SGD step at lr a and an outer SGD at lr 1 is plain sync SGD at lr a
(the pseudo-gradient of one inner step is a * g). With H > 1 the run equals a
single-process replay of the same algorithm: every worker takes H inner steps from the
weights it pulled (its inner optimizer's state kept across rounds), the servers average
the pseudo-gradients by samples and apply the outer optimizer."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from paramserver.errors import ConfigError
from paramserver.server.loop import ServerConfig
from paramserver.workers.launch.cluster import ClusterSpec, run_cluster
from paramserver.workers.localsgd import LocalSteps
from paramserver.workers.optimizer import WorkerResult
from paramserver.workers.worker import WorkerConfig
from tests import exact_tasks as T
from tests.test_exactness import _assert_equal, _reference

pytestmark = pytest.mark.integration

STEPS = 12  # local steps (gradients computed) per worker
WORKERS = 3


def _run(tmp_path, sync_every, local, local_args, outer_args, outer="sgd", wire_dtype=None):
    spec = ClusterSpec(
        num_servers=2, num_workers=WORKERS,
        server=ServerConfig(mode="sync", optimizer=outer, optimizer_args=outer_args),
        worker=WorkerConfig(
            servers=[], task="tests.exact_tasks:make_task",
            task_args={"steps": STEPS, "unequal": True}, steps=STEPS,
            local_optimizer=local, local_args=local_args, sync_every=sync_every,
            wire_dtype=wire_dtype),
    )
    result = run_cluster(spec, tmp_path)
    return result, load_file(str(tmp_path / "final_model.safetensors"))


def _diloco_reference(sync_every, inner_cls, inner_args, outer_args,
                      outer_cls=torch.optim.SGD, wire=None, pull=None):
    """One process: per round, each worker's H inner steps from the global weights, then
    the outer step on the sample-weighted mean of the pseudo-gradients (each rounded to
    the ``wire`` dtype first, as the push narrows it). With ``pull`` (a deterministic
    compressor: --pull-compression), each worker starts its rounds from its own
    reconstruction of the weights instead: dense at first, then moved on by the
    compressed change since (here a parameter is one slice: core/pullsqueeze.py)."""
    from paramserver.compress import formats, parse_compression

    model = T.make_model()
    outer = outer_cls(model.parameters(), **outer_args)
    replicas = [copy.deepcopy(model) for _ in range(WORKERS)]
    inners = [inner_cls(m.parameters(), **inner_args) for m in replicas]
    squeeze = None if pull is None else parse_compression(pull).compressor
    held = [{n: p.detach().clone() for n, p in model.named_parameters()}
            for _ in range(WORKERS)]
    for start in range(0, STEPS, sync_every):
        deltas, counts = [], []
        for r, (replica, inner) in enumerate(zip(replicas, inners, strict=True)):
            if start and squeeze is not None:
                for n, p in model.named_parameters():
                    h = held[r][n].view(-1)
                    h.add_(formats.decode(n, squeeze.compress(p.detach().reshape(-1) - h, 0),
                                          p.numel(), p.dtype))
            replica.load_state_dict(model.state_dict() if squeeze is None else held[r])
            anchor = [p.detach().clone() for p in replica.parameters()]
            n = T.batch_size(r, unequal=True)
            for k in range(start, start + sync_every):
                x, y = T.batch(r, k, n)
                inner.zero_grad()
                torch.nn.functional.mse_loss(replica(x), y).backward()
                inner.step()
            delta = [a - p.detach() for a, p in
                     zip(anchor, replica.parameters(), strict=True)]
            deltas.append([d.to(wire).to(d.dtype) if wire else d for d in delta])
            counts.append(n * sync_every)
        outer.zero_grad()
        for i, p in enumerate(model.parameters()):
            p.grad = sum(c * d[i] for c, d in zip(counts, deltas, strict=True)) / sum(counts)
        outer.step()
    return model.state_dict()


def test_h1_sgd_inner_lr1_outer_is_plain_sync_sgd(tmp_path):
    result, weights = _run(tmp_path, 1, "sgd", {"lr": 0.1}, {"lr": 1.0})
    assert list(result.updates_applied) == [STEPS, STEPS]
    _assert_equal(weights, _reference(WORKERS, torch.optim.SGD, {"lr": 0.1}, unequal=True))


def test_diloco_equals_single_process_replay(tmp_path):
    h = 4
    inner_args = {"lr": 0.01, "weight_decay": 0.1}
    outer_args = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    result, weights = _run(tmp_path, h, "adamw", inner_args, outer_args)
    assert list(result.updates_applied) == [STEPS // h, STEPS // h]  # one push per round
    pushes = [w.pushes for w in result.workers if isinstance(w, WorkerResult)]
    assert pushes == [STEPS // h] * WORKERS
    _assert_equal(weights, _diloco_reference(h, torch.optim.AdamW, inner_args, outer_args))


def test_bf16_pseudo_gradients_under_delayed_nesterov_equal_the_replay(tmp_path):
    """Pseudo-gradients travel in the wire dtype as gradients do: each is rounded to
    bfloat16 once, and the server's delayed-Nesterov outer step (momentum on every
    second round) lands where the replay of the same rounding and rule does."""
    from paramserver.core.outer import DelayedNesterov
    from paramserver.observe.events import read_events

    h = 3
    inner_args = {"lr": 0.01}
    outer_args = {"lr": 0.7, "momentum": 0.9, "delay": 2}
    result, weights = _run(tmp_path, h, "adamw", inner_args, outer_args,
                           outer="delayed-nesterov", wire_dtype="bfloat16")
    assert list(result.updates_applied) == [STEPS // h, STEPS // h]
    want = _diloco_reference(h, torch.optim.AdamW, inner_args, outer_args,
                             outer_cls=DelayedNesterov, wire=torch.bfloat16)
    _assert_equal(weights, want)
    exact = _diloco_reference(h, torch.optim.AdamW, inner_args, outer_args,
                              outer_cls=DelayedNesterov)
    assert any(not torch.allclose(exact[k], want[k], rtol=0, atol=1e-9) for k in want)
    # 2 bytes a parameter pushed, the float64 weights (8 bytes) pulled back, every round
    n = sum(t.numel() for t in weights.values())
    steps = read_events(tmp_path / "events" / "worker0.jsonl", "step")
    assert [s["bytes"] for s in steps] == [n * 2 + n * 8] * (STEPS // h)


def test_local_steps_state_round_trips():
    """The inner optimizer's state and the round's anchor survive state_dict()."""
    model = T.make_model()
    params = dict(model.named_parameters())
    steps = LocalSteps(torch.optim.AdamW(model.parameters(), lr=0.01), 3, params)
    x, y = T.batch(0, 0, 5)
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert not steps.step(5, 0.0, 0.0)
    state = steps.state_dict()
    again = LocalSteps(torch.optim.AdamW(model.parameters(), lr=0.01), 3, params)
    again.load_state_dict(state)
    assert again.taken == 1 and again.samples == 5
    moments = again.inner.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(moments, state["inner"]["state"][0]["exp_avg"])
    assert moments.abs().sum() > 0
    pseudo = again.pseudo_gradient()
    assert any(t.abs().sum() > 0 for t in pseudo.values())  # the step moved the weights


def test_local_optimizer_must_own_the_models_parameters():
    other = T.make_model()
    with pytest.raises(ConfigError, match="model's own parameters"):
        LocalSteps(torch.optim.SGD(other.parameters(), lr=0.1), 2,
                   dict(T.make_model().named_parameters()))
    with pytest.raises(ConfigError, match="sync_every needs local_optimizer"):
        WorkerConfig(servers=["127.0.0.1:1"], sync_every=4)


def test_the_simulator_runs_diloco_as_the_single_process_replay(tmp_path):
    """In virtual time each worker's H inner steps run with its own inner optimizer
    (its state kept across rounds): sync DiLoCo lands where the replay does."""
    from paramserver.observe.events import read_events
    from paramserver.workers.launch.virtual import SimSpec, run_simulation

    h = 4
    inner_args = {"lr": 0.01, "weight_decay": 0.1}
    outer_args = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    spec = ClusterSpec(
        num_servers=2, num_workers=WORKERS,
        server=ServerConfig(mode="sync", optimizer="sgd", optimizer_args=outer_args),
        worker=WorkerConfig(
            servers=[], task="tests.exact_tasks:make_task",
            task_args={"steps": STEPS, "unequal": True}, steps=STEPS,
            local_optimizer="adamw", local_args=inner_args, sync_every=h))
    result = run_simulation(spec, tmp_path, SimSpec(compute_time=0.01))
    assert list(result.updates_applied) == [STEPS // h, STEPS // h]
    _assert_equal(load_file(str(tmp_path / "final_model.safetensors")),
                  _diloco_reference(h, torch.optim.AdamW, inner_args, outer_args))
    steps = read_events(tmp_path / "events" / "worker1.jsonl", "step")
    assert [s["local_steps"] for s in steps] == [h] * (STEPS // h)
    assert [s["num_samples"] for s in steps] == [T.batch_size(1, True) * h] * (STEPS // h)
    assert steps[0]["t"] == pytest.approx(h * 0.01)  # a round takes its H steps' time


def test_own_loop_with_sync_every_per_worker(tmp_path):
    """Rank 0 pushes every 2 steps, rank 1 every 4 (async): one push per round, with the
    round's samples; the inner AdamW's state is the worker's, in its state_dict()."""
    import json
    import sys
    from pathlib import Path

    from paramserver.observe.events import read_events

    script = Path(__file__).resolve().parent / "localsgd_script.py"
    out = tmp_path / "run"
    spec = ClusterSpec(
        num_servers=2, num_workers=2,
        server=ServerConfig(mode="async", optimizer="delayed-nesterov",
                            optimizer_args={"lr": 1.0, "delay": 2}),
        worker=WorkerConfig(servers=[]),
        command=[sys.executable, str(script), str(tmp_path / "ranks"), "--steps", "8"])
    result = run_cluster(spec, out)
    assert list(result.updates_applied) == [4 + 2, 4 + 2]
    for rank, h in ((0, 2), (1, 4)):
        got = json.loads((tmp_path / "ranks" / f"rank{rank}.json").read_text())
        assert got["sync_every"] == h
        assert got["clocks"] == [(k + 1) // h for k in range(8)]  # a push ends each round
        assert got["taken"] == 0 and got["inner_steps"] == [8] * 4  # every local step
        steps = read_events(out / "events" / f"worker{rank}.jsonl", "step")
        assert [s["num_samples"] for s in steps] == [T.batch_size(rank, True) * h] * (8 // h)
        assert [s["local_steps"] for s in steps] == [h] * (8 // h)  # gradients per push
    # staleness counts outer steps: each pseudo-gradient is one version, so a push of
    # rank 0 is at most rank 1's 2 pushes stale (in local steps it would be 4 or 8)
    for shard in (0, 1):
        pushes = read_events(out / "events" / f"server{shard}.jsonl", "push")
        assert [p["version"] for p in pushes] == list(range(1, 7))
        for p in pushes:
            assert 0 <= p["staleness"] <= (2 if p["worker"] == 0 else 4)
