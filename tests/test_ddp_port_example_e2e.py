"""examples/ddp_port/ (issue 31): the PyTorch DDP tutorial's trainer, ported. In sync mode
every step's loss of every rank equals the same script under real DDP (torchrun, gloo on
loopback) to the last digit.

Why exactly and not nearly: with equal batches DDP averages the ranks' gradients as
g0/2 + g1/2 and a sync shard as (n g0 + n g1) / 2n, and scaling by a power of two is
exact in floating point, so both give the same float; both then take the same SGD step
from the same initial weights (DDP broadcasts rank 0's, paramserver is seeded by them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from paramserver import ClusterSpec, ServerConfig, WorkerConfig, run_cluster
from paramserver.observe.events import read_events
from paramserver.workers.experiments.spec import load_spec
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ddp_port"
EPOCHS, STEPS_PER_EPOCH = 2, 8  # 256 samples, 2 ranks, batches of 16


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PARAMSERVER_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example under DDP (2 processes with torchrun's environment, as torchrun would
    start them) and, meanwhile, under paramserver's launcher (sync; run here, in-process)."""
    tmp = tmp_path_factory.mktemp("ddp-port")
    script = [sys.executable, str(EXAMPLE / "train.py"), "--epochs", str(EPOCHS)]
    port = str(free_port())
    ddp = [subprocess.Popen(
        [*script, "--ddp", "--lr", "0.05", "--losses", str(tmp / "ddp")], cwd=ROOT,
        env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        spec = ClusterSpec(
            num_servers=1, num_workers=2,
            server=ServerConfig(mode="sync", optimizer="sgd", optimizer_args={"lr": 0.05}),
            worker=WorkerConfig(servers=[]),
            command=[*script, "--losses", str(tmp / "ps"),
                     "--snapshot", str(tmp / "snapshot.safetensors")])
        with mock.patch.dict(os.environ, _env(), clear=True):  # the workers' environment
            run_cluster(spec, tmp / "run")
    finally:
        for proc in ddp:
            output, _ = proc.communicate(timeout=240)
            assert proc.returncode == 0, output[-3000:]
    return tmp


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_sync_equals_ddp_to_the_last_digit(runs):
    for rank in (0, 1):
        ddp = json.loads((runs / "ddp" / f"rank{rank}.json").read_text())
        ps = json.loads((runs / "ps" / f"rank{rank}.json").read_text())
        assert len(ddp) == EPOCHS * STEPS_PER_EPOCH
        assert ps == ddp  # every step, every digit
        assert sum(ddp[-STEPS_PER_EPOCH:]) < sum(ddp[:STEPS_PER_EPOCH])  # it trained
    assert json.loads((runs / "ps" / "rank0.json").read_text()) != \
        json.loads((runs / "ps" / "rank1.json").read_text())  # each rank its own share


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_port_reports_through_opt_log_and_keeps_a_snapshot(runs):
    events = runs / "run" / "events"
    for rank in (0, 1):  # opt.log(loss=...) joined each step's record
        logged = [s["loss"] for s in read_events(events / f"worker{rank}.jsonl", "step")]
        assert logged == json.loads((runs / "ps" / f"rank{rank}.json").read_text())
    # worker 0 evaluates (launch's default): once an epoch, and result.json has the last
    evals = read_events(events / "worker0.jsonl", "eval")
    assert [e["clock"] for e in evals] == [STEPS_PER_EPOCH * (k + 1) for k in range(EPOCHS)]
    assert read_events(events / "worker1.jsonl", "eval") == []
    result = json.loads((runs / "run" / "result.json").read_text())
    assert result["eval"] == {"loss": evals[-1]["loss"], "accuracy": evals[-1]["accuracy"]}
    assert evals[-1]["accuracy"] > 0.5  # 4 classes: well above chance
    assert json.loads((runs / "snapshot.safetensors.json").read_text()) == {"EPOCHS_RUN": EPOCHS}


def test_the_grid_compares_the_modes_under_a_straggler_that_does_not_evaluate():
    spec = load_spec(EXAMPLE / "grid.toml")
    assert spec.command is not None and spec.command[1] == "examples/ddp_port/train.py"
    assert [str(m) for m in spec.modes] == ["sync", "async", "ssp:2"]
    for config in spec.configurations():  # 'persistent' slows worker 0: worker 1 evaluates
        assert spec.evaluator_of(config) == 1
