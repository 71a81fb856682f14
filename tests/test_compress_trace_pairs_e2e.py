"""Compression (both ways) and ``--trace`` beside the other features, over real shard and
worker processes on loopback (core/features.py names these tests for those pairs).

The oracle is the replay of a run's trace (workers/launch/replay.py), which recomputes
every gradient at the weights the worker read (with ``--pull-compression``, its
reconstruction: core/pullsqueeze.py) and pushes it into the real core at the recorded
time: a run that equals its replay bit for bit decided, read and stepped as the replay
did. Runs that a trace does not cover (a command, local SGD) equal a single-process
replay instead. Each run turns on several features at once; the first run in a process
pays the launcher's start-up, the others well under a second each."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from paramserver.core.outer import DelayedNesterov
from paramserver.core.sharding import ShardPlan
from paramserver.server.loop import ServerConfig
from paramserver.shm import segment as shm
from paramserver.wire.curve import generate_curve_keys
from paramserver.workers.launch.cluster import ClusterSpec, run_cluster
from paramserver.workers.launch.replay import (
    Changes,
    ReplayResult,
    compare,
    final_weights,
    replay_dir,
)
from paramserver.workers.launch.results import ClusterResult
from paramserver.workers.stragglers import StragglerSpec
from paramserver.workers.worker import WorkerConfig
from tests import exact_tasks as T
from tests.test_compress_e2e import SCRIPT, _replay
from tests.test_exactness import _assert_equal
from tests.test_localsgd import STEPS as LOCAL_STEPS
from tests.test_localsgd import WORKERS, _diloco_reference

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean_env")]

STEPS = 6
EXACT = {"task": "tests.exact_tasks:make_task", "task_args": {"steps": STEPS}, "steps": STEPS}
#: policies' settings that make them act within a few stale pushes
POLICY_ARGS: dict[str, dict[str, object]] = {"reject": {"max_staleness": 1},
                                             "ssp-adaptive": {"s_min": 1, "s_max": 2}}


def _counter(result: ClusterResult, name: str) -> int:
    return sum(s["counters"].get(name, 0) for s in result.servers)


def _replays(out: Path, pushes: int) -> ReplayResult:
    """The traced run in ``out`` is its replay, bit for bit (its task is this
    directory's exact_tasks, a plug-in: trusted)."""
    own = replay_dir(out, trust_plugins=True)
    assert own.reproduced and own.pushes == pushes, own.to_json()
    assert compare(own.weights, final_weights(out)) == (True, 0.0)
    return own


@pytest.mark.parametrize("policy", ["reject", "inverse", "exponential", "dc-asgd",
                                    "dc-asgd-adaptive", "gap-aware", "ssp-adaptive"])
def test_a_traced_curve_run_compressed_both_ways_replays_under_each_policy(
        policy: str, tmp_path: Path) -> None:
    """Async (ssp-adaptive: SSP), 3 workers on 2 shards over CURVE, one 30 ms slower a
    step (its pushes stale); int8 pushes with each worker's residuals, int8 pulls (each
    worker computes at its own reconstruction, and dc-asgd and gap-aware compare against
    it: the weights it read). The replay is the run; without the policy, or without the
    push's compression, the same schedule lands elsewhere (each acted)."""
    keys = generate_curve_keys(tmp_path / "keys")
    mode = "ssp" if policy == "ssp-adaptive" else "async"
    server = ServerConfig(mode=mode, staleness_bound=1 if mode == "ssp" else 0,
                          optimizer="sgd", optimizer_args={"lr": 0.1}, policy=policy,
                          policy_args=POLICY_ARGS.get(policy, {}), pull_compression="int8",
                          curve_secret_key=str(keys.server_secret))
    worker = WorkerConfig(servers=[], compression="int8", curve_key=str(keys.clients["client"][1]),
                          curve_server_key=str(keys.server_public), **EXACT)  # type: ignore[arg-type]
    out = tmp_path / "run"
    result = run_cluster(ClusterSpec(num_servers=2, num_workers=3, server=server, worker=worker,
                                     stragglers={2: StragglerSpec(delay="const:0.03")},
                                     trace=True, evaluate=False), out)
    assert _counter(result, "pulls_compressed") > 0
    own = _replays(out, 3 * STEPS)
    real = final_weights(out)
    dense = replay_dir(out, Changes(compression="none"), trust_plugins=True)
    assert not compare(dense.weights, real)[0]
    if policy == "ssp-adaptive":  # it moved the bound (waits on the slow worker), which
        # the replay's recorded timing follows: the weights are those of any bound
        assert max(s["staleness_bound_max"] for s in result.servers) == 2
    else:
        plain = replay_dir(out, Changes(policy="none"), trust_plugins=True)
        assert not compare(plain.weights, real)[0], policy
    if policy == "reject":
        assert own.accepted < own.pushes


def test_dc_asgd_compares_a_compressed_pull_with_the_workers_reconstruction() -> None:
    """The core, no sockets: a worker whose pulls are int8 computed its gradient at its
    reconstruction, so DC-ASGD's ``w_now - w_read`` is taken from that, not from the
    weights the shard held when it answered (those differ by what int8 left out)."""
    model = T.make_model()
    plan = ShardPlan.from_module(model, 1)
    server = ServerConfig(mode="async", optimizer="sgd", optimizer_args={"lr": 0.1},
                          policy="dc-asgd", policy_args={"lam": 0.5}, pull_compression="int8")
    core = server.new_core(plan)
    init = plan.split_tensors({k: p.detach() for k, p in model.named_parameters()})[0]
    core.register(0, "w0", 0.0)
    core.register(1, "w1", 0.0)
    core.initialize({k: t.clone() for k, t in init.items()})
    assert core.squeeze is not None

    def pull(worker: int) -> dict[str, torch.Tensor]:
        assert core.squeeze is not None
        core.request_pull(worker, 0, worker, 0.0)
        core.squeeze.ask(worker, core.squeeze.counts.get(worker, -1))
        assert [r.worker for r in core.ready_pulls(0.0)] == [worker]
        core.answer_squeezed(worker, core.version)
        return {k: t.clone() for k, t in core.squeeze.held[worker].items()}

    gen = torch.Generator().manual_seed(0)
    grad = {k: torch.randn(t.shape, generator=gen, dtype=t.dtype) for k, t in init.items()}
    pull(0), pull(1)
    core.push(1, 0, 0, 0, 5, grad, 0.0)  # (worker 1's push moves the weights on)
    held = pull(0)  # an int8 change since the dense first answer
    assert any(not torch.equal(held[k], core.params[k]) for k in held)
    before = {k: p.detach().clone() for k, p in core.params.items()}
    core.push(0, 1, 1, core.version, 5, grad, 0.0)
    lam, lr = 0.5, 0.1
    for k, g in grad.items():
        want = before[k] - lr * (g + lam * g * g * (before[k] - held[k]))
        shard_read = before[k] - lr * g  # (the weights the shard held: no gap at all)
        assert torch.allclose(core.params[k], want, rtol=0, atol=1e-15), k
        assert not torch.allclose(core.params[k], shard_read, rtol=0, atol=1e-9), k


def _shm_spec(compression: str | None, pull: str | None, **worker: object) -> ClusterSpec:
    """Sync, 2 workers on 1 shard of digits-mlp with 512 hidden units (150 KiB: above
    shared memory's minimum), traced; parts of 16 KiB."""
    return ClusterSpec(
        num_servers=1, num_workers=2, trace=True, evaluate=False,
        server=ServerConfig(mode="sync", optimizer="sgd", optimizer_args={"lr": 0.1},
                            pull_compression=pull),
        worker=WorkerConfig(servers=[], task="digits-mlp", task_args={"hidden": 512}, steps=4,
                            seed=1, compression=compression, part_bytes=16384,
                            **worker))  # type: ignore[arg-type]


def test_a_traced_run_through_shared_memory_with_compressed_pulls_replays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dense pushes lent through the workers' segments (8 pushes of 150 KiB: a few KiB
    came over TCP), int8 pulls answered in frames (a worker's copy moves by the change
    it is sent; the weights' board is not read): the replay is the run."""
    monkeypatch.setenv(shm.ENV, "1")  # (the processes inherit it)
    out = tmp_path / "run"
    result = run_cluster(_shm_spec(None, "int8"), out)
    assert _counter(result, "shm_peers") == 2 and _counter(result, "bytes_in") < 64 * 1024
    assert _counter(result, "shm_pulls") == 0 and _counter(result, "pulls_compressed") > 0
    _replays(out, 2 * 4)


@pytest.mark.parametrize("pull", [None, "int8"])
def test_a_traced_run_with_early_parts_and_compressed_pushes_replays(
        pull: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 pushes in parts with shared memory on: a worker that encodes its pushes keeps
    to frames both ways, so its weights come over TCP, and each part's next weights come
    back early; with int8 pulls none are asked for (the round's answer is the change to
    the worker's copy, which early weights would not fit). The replay (whole pushes,
    summed by worker as the round sums parts) is the run."""
    monkeypatch.setenv(shm.ENV, "1")
    out = tmp_path / "run"
    result = run_cluster(_shm_spec("int8", pull, early_parts=True), out)
    assert _counter(result, "shm_peers") == 0
    if pull is None:  # parts answered with their next weights, rounds with the rest
        assert _counter(result, "early_parts") > 0 and _counter(result, "early_answers") > 0
    else:
        assert _counter(result, "early_parts") == 0 and _counter(result, "pulls_compressed")
    _replays(out, 2 * 4)


def test_a_script_wrapping_its_optimizer_with_overlap_compressed_both_ways_equals_the_replay(
        tmp_path: Path) -> None:
    """A command: DistributedOptimizer(model, torch.optim.SGD, overlap=True) with int8
    pushes from inside backward and top-k pulls (each rank's own reconstruction): the
    servers step the script's SGD on what the replay's encoders send, at the weights the
    replay's workers hold."""
    spec, pull = "int8", "topk:ratio=0.25"
    cluster = ClusterSpec(
        num_servers=2, num_workers=2,
        server=ServerConfig(mode="sync", script_optimizer=True, pull_compression=pull),
        worker=WorkerConfig(servers=[]),
        command=[sys.executable, str(SCRIPT), spec, "--steps", str(STEPS), "--restart-at",
                 "-1", "--wrap", "--overlap"])
    result = run_cluster(cluster, tmp_path)
    assert list(result.updates_applied) == [STEPS, STEPS]
    assert _counter(result, "pulls_compressed") > 0
    _assert_equal(load_file(str(tmp_path / "final_model.safetensors")), _replay(spec, pull))


def test_bf16_local_sgd_with_compressed_pulls_equals_the_replay(tmp_path: Path) -> None:
    """Local SGD (H = 3, AdamW inner) under delayed Nesterov, pseudo-gradients pushed in
    bfloat16, int8 pulls: each worker's rounds start from its reconstruction, and the
    replay of the same rounds lands where the run does."""
    h, inner, outer = 3, {"lr": 0.01}, {"lr": 0.7, "momentum": 0.9, "delay": 2}
    result = run_cluster(ClusterSpec(
        num_servers=2, num_workers=WORKERS,
        server=ServerConfig(mode="sync", optimizer="delayed-nesterov", optimizer_args=outer,
                            pull_compression="int8"),
        worker=WorkerConfig(servers=[], task="tests.exact_tasks:make_task",
                            task_args={"steps": LOCAL_STEPS, "unequal": True}, steps=LOCAL_STEPS,
                            local_optimizer="adamw", local_args=inner, sync_every=h,
                            wire_dtype="bfloat16")), tmp_path)
    assert list(result.updates_applied) == [LOCAL_STEPS // h] * 2
    assert _counter(result, "pulls_compressed") > 0
    want = _diloco_reference(h, torch.optim.AdamW, inner, outer, outer_cls=DelayedNesterov,
                             wire=torch.bfloat16, pull="int8")
    _assert_equal(load_file(str(tmp_path / "final_model.safetensors")), want)
    dense = _diloco_reference(h, torch.optim.AdamW, inner, outer, outer_cls=DelayedNesterov,
                              wire=torch.bfloat16)
    assert any(not torch.allclose(dense[k], want[k], rtol=0, atol=1e-12) for k in want)

