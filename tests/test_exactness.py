"""Sync and async training over real shard processes equal single-process torch."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from paramserver.server import ServerConfig
from tests import exact_tasks as T
from workers.cluster import ClusterSpec, run_cluster
from workers.worker import WorkerConfig

pytestmark = pytest.mark.integration

STEPS = 12


def _run(tmp_path, mode, workers, optimizer, optimizer_args, unequal=False, servers=2):
    spec = ClusterSpec(
        num_servers=servers,
        num_workers=workers,
        server=ServerConfig(mode=mode, optimizer=optimizer, optimizer_args=optimizer_args),
        worker=WorkerConfig(
            servers=["unset"], task="tests.exact_tasks:make_task",
            task_args={"steps": STEPS, "unequal": unequal}, steps=STEPS,
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
    assert result["updates_applied"] == [STEPS, STEPS]
    _assert_equal(weights, _reference(3, cls, args, unequal))


def test_async_one_worker_equals_single_process(tmp_path):
    args = {"lr": 0.05, "momentum": 0.9}
    result, weights = _run(tmp_path, "async", 1, "sgd", args)
    assert result["updates_applied"] == [STEPS, STEPS]
    _assert_equal(weights, _reference(1, torch.optim.SGD, args))
