"""Compression both ways through a failover (feature pairs replicas + compression,
replicas + pull_compression): the primary forwards a compressed push's frames as they
came and each replica decodes them alike (paramserver/wire/compressed.py), and a worker
resends a push encoded once (its residuals moved on once); each replica closes the same
pulls at the same weights, so a backup holds every worker's reconstruction bit for bit,
and a pull whose answer died with the primary is answered again with the same change
(core/pullsqueeze.py). So a sync run with top-k pushes and int8 pulls whose primary is
SIGKILLed mid-run ends bit-identical to the run without replicas or failure."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from safetensors.torch import load_file

from paramserver.workers.launch.cluster import run_cluster
from tests.test_replication_e2e import _run_killing_primary
from tests.test_replication_e2e import _spec as _base_spec

pytestmark = pytest.mark.integration

STEPS = 40


def test_a_compressed_sync_run_survives_a_primary_sigkill_bit_identical(tmp_path: Path
                                                                         ) -> None:
    def spec(replicas: int, step_time: float):  # type: ignore[no-untyped-def]
        base = _base_spec("sync", 1, 2, STEPS, step_time, replicas)
        return dataclasses.replace(
            base, worker=dataclasses.replace(base.worker, compression="topk:ratio=0.05"),
            server=dataclasses.replace(base.server, pull_compression="int8"))

    run_cluster(spec(0, 0.0), tmp_path / "plain")  # unpaced: a round's sum in a fixed order
    result, killed = _run_killing_primary(spec(1, 0.03), tmp_path / "failover", 12)
    assert killed, "the run ended before the primary could be killed"
    assert result.restarts == () and result.updates_applied == (STEPS,)
    plain = load_file(tmp_path / "plain" / "final_model.safetensors")
    failed = load_file(tmp_path / "failover" / "final_model.safetensors")
    assert plain.keys() == failed.keys()
    for key in plain:
        assert plain[key].equal(failed[key]), key
