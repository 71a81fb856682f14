"""A real run's checkpoints, exported and loaded into the task's model, score what the run
reported."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from paramserver.cli.checkpoint import checkpoint as checkpoint_cli
from paramserver.persist.checkpoint import inspect_checkpoint, load_shard
from paramserver.server.loop import ServerConfig
from paramserver.workers.launch.cluster import ClusterSpec, run_cluster
from paramserver.workers.stragglers import StragglerSpec
from paramserver.workers.tasks import evaluate
from paramserver.workers.worker import WorkerConfig, build_task

pytestmark = pytest.mark.integration


def test_exported_checkpoint_scores_what_the_run_reported(tmp_path):
    ckpt = tmp_path / "ckpt"
    spec = ClusterSpec(
        num_servers=2, num_workers=2,
        server=ServerConfig(mode="async", checkpoint_dir=str(ckpt), checkpoint_every=25,
                            optimizer="adam", optimizer_args={"lr": 0.01}),
        worker=WorkerConfig(servers=[], task="digits-mlp", steps=30,
                            straggler=StragglerSpec(min_step_time=0.01)),
    )
    result = run_cluster(spec, tmp_path / "run")
    reported = result.eval
    assert reported["accuracy"] > 0.5

    # the shards saved at shutdown, at the versions the run ended with
    info = inspect_checkpoint(ckpt)
    assert info["complete"] and info["versions"] == list(result.updates_applied)
    for shard in range(2):
        _, meta = load_shard(ckpt, shard)
        assert meta["optimizer_name"] == "adam" and meta["optimizer"]["state"]
        assert {w: s["clock"] for w, s in meta["workers"].items()} == {"0": 30, "1": 30}

    out = tmp_path / "model.safetensors"
    cli = CliRunner().invoke(checkpoint_cli, ["export", str(ckpt), str(out)])
    assert cli.exit_code == 0, cli.output
    listing = CliRunner().invoke(checkpoint_cli, ["inspect", str(ckpt), "--json"])
    assert json.loads(listing.output)["versions"] == list(result.updates_applied)

    # a fresh model of the task, as the launcher's evaluation builds it
    cfg = dataclasses.replace(spec.worker, rank=0, world_size=spec.num_workers,
                              servers=list(result.addresses))
    task = build_task(cfg)
    before = evaluate(task)
    task.model.load_state_dict(load_file(str(out)))
    after = evaluate(task)
    assert after["accuracy"] == reported["accuracy"]
    assert after["loss"] == pytest.approx(reported["loss"], rel=1e-6)
    assert after["loss"] < before["loss"]
    # and it is the very model the launcher pulled at the end
    final = load_file(str(tmp_path / "run" / "final_model.safetensors"))
    for name, p in task.model.state_dict().items():
        assert torch.equal(p, final[name]), name
