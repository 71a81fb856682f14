"""A shard of one run never takes a worker of another (issue 43): a real shard process
of run A, started by the launcher's own code, and workers of run B over loopback, as
when run B's worker outlives its shard and run A's shard took over the port."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from paramserver.core.sharding import ParamSpec, ShardPlan
from paramserver.errors import WrongRunError
from paramserver.server.config import ServerConfig
from paramserver.workers.client import PSClient
from paramserver.workers.launch.cluster import ClusterSpec, LocalCluster
from paramserver.workers.liveness import Heartbeat

B = "b" * 32
PLAN_A = ShardPlan([ParamSpec("w", (8,), "float32")], 1)
PLAN_B = ShardPlan([ParamSpec("v", (3,), "float32")], 1)  # its own model


@pytest.mark.integration
def test_a_shard_refuses_a_worker_of_another_run(tmp_path: Path) -> None:
    spec = ClusterSpec(num_servers=1, num_workers=1, evaluate=False,
                       server=ServerConfig(mode="async"))
    with LocalCluster(spec, tmp_path / "run") as cluster:
        (address,) = cluster.start_servers()
        run_a = cluster.spec.run_id
        assert run_a and len(run_a) == 32 and run_a != B  # the launcher made one

        # run B's worker 0 comes first, with its own model: refused, naming both runs,
        # and nothing of it is kept (the shard adopts no plan from it)
        stranger = PSClient([address], PLAN_B, worker=0, heartbeat_interval=0, timeout=20,
                            run_id=B)
        with pytest.raises(WrongRunError) as err:
            stranger.connect()
        stranger.close()
        assert run_a in str(err.value) and B in str(err.value)

        # run A's own worker 0, and one started by hand (no run id), are taken
        for run in (run_a, None):
            own = PSClient([address], PLAN_A, worker=0, heartbeat_interval=0, timeout=20,
                           run_id=run)
            try:
                own.connect()
                params = {"w": torch.ones(8)}
                own.initialize(params)
                assert own.pull(params, 0).versions == (0,)
            finally:
                own.close()

        # run B's heartbeats for worker 0 are refused too: its client learns that the
        # process at this address is another run's, and never that it holds its pull
        beats = Heartbeat([address], 0, 0.05, None, run_id=B)
        beats.start()
        try:
            deadline = time.monotonic() + 20
            while 0 not in beats.foreign and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            beats.stop()
            beats.join()
        assert isinstance(beats.foreign.get(0), WrongRunError)
        assert 0 not in beats.last_reply and beats.held.get(0) is None
