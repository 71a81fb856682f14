"""Compressed pushes and pulls over real shard and worker processes (paramserver/compress,
core/pullsqueeze.py): a sync run compressed both ways equals a single-process replay
that compresses the same way (the same residuals, the same draws, each worker's own
reconstruction of the weights), and a worker that loads its state_dict continues its
residuals."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from paramserver.compress import Encoder, formats, parse_compression
from paramserver.server.loop import ServerConfig
from paramserver.util import faults
from paramserver.workers.launch.cluster import ClusterSpec, run_cluster
from paramserver.workers.worker import WorkerConfig
from tests import exact_tasks as T
from tests.test_exactness import _assert_equal

pytestmark = pytest.mark.integration

STEPS, WORKERS, LR = 6, 2, 0.1
SCRIPT = Path(__file__).resolve().parent / "compress_script.py"


def _replay(spec: str, pull: str | None = None, workers: int = WORKERS
            ) -> dict[str, torch.Tensor]:
    """One process: each step, every worker's gradient at its weights goes through its
    own encoder (error feedback and draws as the worker's, seeded by its rank) and
    back, and SGD steps on their mean. With ``pull`` (a deterministic compressor),
    each worker holds its own reconstruction: dense at first, then moved on by the
    compressed change since, slice by slice (here a parameter is one slice)."""
    model = T.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    encoders = [Encoder(parse_compression(spec), seed=r) for r in range(workers)]
    squeeze = None if pull is None else parse_compression(pull).compressor
    held = [{n: p.detach().reshape(-1).clone() for n, p in model.named_parameters()}
            for _ in range(workers)]
    worker = T.make_model()  # a worker's model: its reconstruction loaded into it
    for k in range(STEPS):
        sent = []
        for r, enc in enumerate(encoders):
            at = worker if squeeze is not None else model
            if squeeze is not None:
                for n, p in worker.named_parameters():
                    p.data.copy_(held[r][n].view_as(p))
            at.zero_grad()
            x, y = T.batch(r, k, T.batch_size(r, unequal=False))
            torch.nn.functional.mse_loss(at(x), y).backward()
            sent.append({n: formats.decode(n, enc.encode_one(n, p.grad), p.numel(),
                                           p.dtype).view_as(p)
                         for n, p in at.named_parameters()})
        for n, p in model.named_parameters():
            p.grad = sum(s[n] for s in sent) / workers
        opt.step()
        for h in held if squeeze is not None else ():
            for n, p in model.named_parameters():
                parts = squeeze.compress(p.detach().reshape(-1) - h[n], 0)
                h[n].add_(formats.decode(n, parts, p.numel(), p.dtype))
    return model.state_dict()


def _cluster(tmp_path: Path, command: list[str] | None = None, workers: int = WORKERS,
             mode: str = "sync", **worker: object) -> ClusterSpec:
    return ClusterSpec(num_servers=2, num_workers=workers,
                       server=ServerConfig(mode=mode, optimizer="sgd",
                                           optimizer_args={"lr": LR}),
                       worker=WorkerConfig(servers=[], **worker),  # type: ignore[arg-type]
                       command=command)


def test_a_sync_run_compressed_both_ways_equals_the_replay(tmp_path: Path) -> None:
    """Random-k pushes with error feedback (8 of 24 elements, drawn per worker and push)
    and top-k pulls (--pull-compression: each worker is sent the largest quarter of the
    change since what it holds): the shards step on exactly what the replay's encoders
    send, at exactly the weights the replay's workers hold."""
    spec, pull = "randomk:ratio=0.3", "topk:ratio=0.25"
    cluster = _cluster(tmp_path, task="tests.exact_tasks:make_task",
                       task_args={"steps": STEPS}, steps=STEPS, compression=spec)
    cluster = dataclasses.replace(cluster, server=dataclasses.replace(
        cluster.server, pull_compression=pull))
    result = run_cluster(cluster, tmp_path)
    assert list(result.updates_applied) == [STEPS, STEPS]
    weights = load_file(str(tmp_path / "final_model.safetensors"))
    want = _replay(spec, pull)
    _assert_equal(weights, want)
    for other in (_replay(spec), _replay("none")):  # and both compressions changed it
        assert any(not torch.allclose(other[k], want[k], rtol=0, atol=1e-9) for k in want)


def test_a_lossy_network_changes_nothing_of_a_run_compressed_both_ways(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fifth of the messages lost: a push is resent as it was encoded, and a pull whose
    answer was lost is answered again with that same change (core/pullsqueeze.py), so
    the run still equals the replay."""
    monkeypatch.setenv(faults.DROP_RATE, "0.2")  # (the processes inherit it)
    spec, pull = "randomk:ratio=0.3", "topk:ratio=0.25"
    cluster = _cluster(tmp_path, task="tests.exact_tasks:make_task",
                       task_args={"steps": STEPS}, steps=STEPS, compression=spec,
                       request_timeout=0.25)
    cluster = dataclasses.replace(cluster, server=dataclasses.replace(
        cluster.server, pull_compression=pull))
    result = run_cluster(cluster, tmp_path)
    assert list(result.updates_applied) == [STEPS, STEPS]
    _assert_equal(load_file(str(tmp_path / "final_model.safetensors")), _replay(spec, pull))
    # (the channels' losses are drawn from seeded generators: the same every run)
    again = sum(s["counters"].get("pulls_answered_again", 0) for s in result.servers)
    assert again > 0, "no pull answer was lost: the test tested nothing"


def test_an_async_run_with_compressed_pulls_equals_the_replay(tmp_path: Path) -> None:
    """Async with one worker (its order of pushes and pulls fixed): int8 pulls, dense
    pushes; the worker computes each gradient at its reconstruction, as the replay's."""
    cluster = _cluster(tmp_path, workers=1, mode="async",
                       task="tests.exact_tasks:make_task", task_args={"steps": STEPS},
                       steps=STEPS)
    cluster = dataclasses.replace(cluster, server=dataclasses.replace(
        cluster.server, pull_compression="int8"))
    result = run_cluster(cluster, tmp_path)
    assert list(result.updates_applied) == [STEPS, STEPS]
    want = _replay("none", "int8", workers=1)
    _assert_equal(load_file(str(tmp_path / "final_model.safetensors")), want)
    plain = _replay("none", workers=1)
    assert any(not torch.allclose(plain[k], want[k], rtol=0, atol=1e-12) for k in want)


def test_a_restarted_worker_continues_its_residuals(tmp_path: Path) -> None:
    """DistributedOptimizer(config=ClientConfig.from_env(compression=...)) in a script;
    rank 1 restarts its encoder halfway (as a new process holds it: no residuals) and
    loads its state_dict: the run is the uninterrupted replay's, which it is not without
    the state (top-k keeps a quarter of each gradient: the residuals carry the rest)."""
    spec = "topk:ratio=0.25"
    result = run_cluster(_cluster(tmp_path, [sys.executable, str(SCRIPT), spec, "--steps",
                                             str(STEPS)]), tmp_path)
    assert list(result.updates_applied) == [STEPS, STEPS]
    _assert_equal(load_file(str(tmp_path / "final_model.safetensors")), _replay(spec))


H, INNER, OUTER = 3, {"lr": 0.01}, {"lr": 0.7, "momentum": 0.9}


def _diloco_replay(spec: str) -> dict[str, torch.Tensor]:
    """DiLoCo in one process (AdamW inner, H steps from the pulled weights, SGD with
    momentum outer on the mean), each worker's pseudo-gradient through its encoder."""
    import copy

    model = T.make_model()
    outer = torch.optim.SGD(model.parameters(), **OUTER)
    replicas = [copy.deepcopy(model) for _ in range(WORKERS)]
    inners = [torch.optim.AdamW(m.parameters(), **INNER) for m in replicas]
    encoders = [Encoder(parse_compression(spec), seed=r) for r in range(WORKERS)]
    for start in range(0, STEPS, H):
        sent = []
        for r, (replica, inner) in enumerate(zip(replicas, inners, strict=True)):
            replica.load_state_dict(model.state_dict())
            for k in range(start, start + H):
                x, y = T.batch(r, k, T.batch_size(r, unequal=False))
                inner.zero_grad()
                torch.nn.functional.mse_loss(replica(x), y).backward()
                inner.step()
            sent.append([formats.decode(n, encoders[r].encode_one(n, g.detach() - p.detach()),
                                        p.numel(), p.dtype).view_as(p)
                         for (n, g), p in zip(model.named_parameters(), replica.parameters(),
                                              strict=True)])
        outer.zero_grad()
        for i, p in enumerate(model.parameters()):
            p.grad = sum(s[i] for s in sent) / WORKERS
        outer.step()
    return model.state_dict()


def test_int8_pseudo_gradients_of_local_sgd_equal_the_replay(tmp_path: Path) -> None:
    """Local SGD (DiLoCo, H = 3) pushes its pseudo-gradients through the encoder as
    gradients go: int8 with error feedback, each worker's residuals its own, lands where
    the replay of the same rounds and the same encoding does."""
    result = run_cluster(ClusterSpec(
        num_servers=2, num_workers=WORKERS,
        server=ServerConfig(mode="sync", optimizer="sgd", optimizer_args=OUTER),
        worker=WorkerConfig(servers=[], task="tests.exact_tasks:make_task",
                            task_args={"steps": STEPS}, steps=STEPS, local_optimizer="adamw",
                            local_args=INNER, sync_every=H, compression="int8")), tmp_path)
    assert list(result.updates_applied) == [STEPS // H, STEPS // H]
    want = _diloco_replay("int8")
    _assert_equal(load_file(str(tmp_path / "final_model.safetensors")), want)
    plain = _diloco_replay("none")  # and int8 did round them
    assert any(not torch.allclose(plain[k], want[k], rtol=0, atol=1e-9) for k in want)
