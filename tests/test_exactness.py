"""Sync and async training over real shard processes equal single-process torch."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from paramserver.server.loop import ServerConfig
from paramserver.workers.launch.cluster import ClusterSpec, run_cluster
from paramserver.workers.worker import WorkerConfig
from tests import exact_tasks as T

pytestmark = pytest.mark.integration

STEPS = 12


def _run(tmp_path, mode, workers, optimizer, optimizer_args, unequal=False, servers=2,
         **worker):
    spec = ClusterSpec(
        num_servers=servers,
        num_workers=workers,
        server=ServerConfig(mode=mode, optimizer=optimizer, optimizer_args=optimizer_args),
        worker=WorkerConfig(
            servers=[], task="tests.exact_tasks:make_task",
            task_args={"steps": STEPS, "unequal": unequal}, steps=STEPS, **worker,
        ),
    )
    result = run_cluster(spec, tmp_path)
    return result, load_file(str(tmp_path / "final_model.safetensors"))


def _reference(workers, optimizer_cls, optimizer_args, unequal=False):
    """Single-process torch on the union of every worker's k-th batch at step k."""
    model = T.make_model()
    opt = optimizer_cls(model.parameters(), **optimizer_args)
    for k in range(STEPS):
        parts = [T.batch(r, k, T.batch_size(r, unequal)) for r in range(workers)]
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


def _assert_equal(got, want):
    assert set(got) == set(want)
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=0, atol=1e-9), key
    # and training did move the weights, so the comparison means something
    init = T.make_model().state_dict()
    assert any(not torch.allclose(init[k], want[k]) for k in want)


@pytest.mark.parametrize(
    ("optimizer", "cls", "args", "unequal"),
    [
        ("sgd", torch.optim.SGD, {"lr": 0.1}, False),
        ("sgd", torch.optim.SGD, {"lr": 0.1}, True),
        ("adam", torch.optim.Adam, {"lr": 0.01}, False),
    ],
    ids=["sgd-equal", "sgd-unequal-batches", "adam"],
)
def test_sync_equals_single_process(tmp_path, optimizer, cls, args, unequal):
    result, weights = _run(tmp_path, "sync", 3, optimizer, args, unequal)
    assert list(result.updates_applied) == [STEPS, STEPS]
    _assert_equal(weights, _reference(3, cls, args, unequal))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_pushes_in_parts_equal_single_process(tmp_path, mode):
    """Every slice its own part and 1-byte chunks: a sync shard adds the parts as they
    arrive, an async one joins them first; both are the same training."""
    args = {"lr": 0.05, "momentum": 0.9}
    workers = 3 if mode == "sync" else 1
    result, weights = _run(tmp_path, mode, workers, "sgd", args, unequal=mode == "sync",
                           part_bytes=1, chunk_bytes=256)
    assert list(result.updates_applied) == [STEPS, STEPS]
    _assert_equal(weights, _reference(workers, torch.optim.SGD, args, unequal=mode == "sync"))
    # the shards did get parts, and took them as their mode does
    kind = "push_parts_streamed" if mode == "sync" else "push_parts_joined"
    assert all(s["counters"].get(kind, 0) >= 2 * STEPS * workers for s in result.servers)


def test_async_one_worker_equals_single_process(tmp_path):
    args = {"lr": 0.05, "momentum": 0.9}
    result, weights = _run(tmp_path, "async", 1, "sgd", args)
    assert list(result.updates_applied) == [STEPS, STEPS]
    _assert_equal(weights, _reference(1, torch.optim.SGD, args))
