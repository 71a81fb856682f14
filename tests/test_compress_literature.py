"""The literature's claims about compressed pushes, checked in virtual time (the
simulator runs the real shard core, and each push through the worker's encoder and the
shard's wire decode): on digits-mlp, sync SGD with 2 workers for 300 steps,

* sign and top-k 1 % without error feedback end measurably worse than uncompressed
  sync SGD, and with error feedback within 5 % of its final loss (Karimireddy et al.
  2019, EF-SignSGD; Stich et al. 2018, sparsified SGD with memory);
* int8 with error feedback ends within 1 % of it."""

from __future__ import annotations

import pytest

from paramserver.server.loop import ServerConfig
from paramserver.workers.launch.cluster import ClusterSpec
from paramserver.workers.launch.virtual import SimSpec, run_simulation
from paramserver.workers.worker import WorkerConfig

STEPS, WORKERS, LR = 300, 2, 0.2


def _final_loss(compression: str | None) -> float:
    spec = ClusterSpec(num_servers=1, num_workers=WORKERS,
                       server=ServerConfig(mode="sync", optimizer="sgd",
                                           optimizer_args={"lr": LR}),
                       worker=WorkerConfig(servers=[], task="digits-mlp", steps=STEPS,
                                           compression=compression))
    return float(run_simulation(spec, None, SimSpec(compute_time=0.01)).eval["loss"])


@pytest.fixture(scope="module")
def plain() -> float:
    return _final_loss(None)


@pytest.mark.parametrize("spec", ["sign", "topk:ratio=0.01"])
def test_biased_compressors_need_error_feedback(plain: float, spec: str) -> None:
    without = _final_loss(f"{spec}{',' if ':' in spec else ':'}ef=0")
    with_ef = _final_loss(spec)
    assert without > 1.5 * plain, (without, plain)
    assert with_ef <= 1.05 * plain, (with_ef, plain)


def test_int8_with_error_feedback_is_within_one_percent(plain: float) -> None:
    assert _final_loss("int8") <= 1.01 * plain
