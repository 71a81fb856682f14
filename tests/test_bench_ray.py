"""Ray's actor parameter server as a benchmark peer.

The actor's class is plain Python and numpy, tested here without Ray. The
harness itself (a Ray head in one agent, workers as drivers in others) runs
only where Ray is installed (``pip install paramserver[bench]``); ``make test``
does not need it.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import numpy as np
import pytest

from paramserver.benchmarks.rayps import ParameterServer
from paramserver.benchmarks.run import BenchOptions, default_systems
from paramserver.errors import ConfigError


def test_actor_steps_on_every_push_with_one_worker() -> None:
    ps = ParameterServer(workers=1, lr=0.5)
    g = [np.full(3, 2.0, dtype=np.float32), np.ones(2, dtype=np.float32)]
    ps.push_pull(*g)
    out = ps.push_pull(*g)
    assert ps.steps() == 2
    np.testing.assert_allclose(out[0], -2.0)  # two steps of -0.5 * 2
    np.testing.assert_allclose(out[1], -1.0)
    # a payload of another shape starts from zeros
    assert ps.push_pull(np.ones(4, dtype=np.float32))[0].tolist() == [-0.5] * 4


def test_actor_waits_for_every_worker_then_steps_on_the_mean() -> None:
    ps = ParameterServer(workers=2, lr=1.0)
    replies: dict[int, list[np.ndarray]] = {}

    def push(rank: int) -> None:
        replies[rank] = [a.copy() for a in ps.push_pull(np.full(2, float(rank + 1),
                                                                dtype=np.float32))]

    first = threading.Thread(target=push, args=(0,))
    first.start()
    first.join(timeout=0.2)
    assert first.is_alive() and ps.steps() == 0  # the round waits for the second worker
    push(1)
    first.join(timeout=10)
    assert not first.is_alive() and ps.steps() == 1
    for rank in (0, 1):
        np.testing.assert_allclose(replies[rank][0], -1.5)  # -(1 + 2) / 2


def test_ray_system_needs_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import paramserver.benchmarks.run as run

    monkeypatch.setattr(run, "ray_available", lambda: False)
    assert "ray" not in default_systems()
    with pytest.raises(ConfigError, match=r"paramserver\[bench\]"):
        BenchOptions(systems=("raw", "ray"))


def _ray_processes() -> set[int]:
    """Processes of a benchmark's Ray cluster, wherever they were reparented to."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                args = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"/tmp/rayps" in args:
                found.add(int(entry.name))
    return found


@pytest.mark.integration
@pytest.mark.slow
def test_ray_peer_in_the_sweep_and_async() -> None:
    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed (pip install 'paramserver[bench]')")
    from paramserver.benchmarks.extras import run_async_ray
    from paramserver.benchmarks.suite import Cell, SweepConfig, run_sweep

    before = _ray_processes()
    rows = run_sweep(SweepConfig(cells=[Cell(2, 1, 4096)], systems=("raw", "ray"),
                                 repeats=2, repeat_seconds=0.02, max_iters=20))
    assert [r.system for r in rows] == ["raw", "ray"]
    ray = rows[1]
    assert ray.shards is None and ray.workers == 2
    assert ray.ratio_to_limit is not None and ray.ratio_to_limit.median > 0
    assert ray.cpu_s is not None and ray.cpu_s.median > 0
    asy = run_async_ray(workers=2, nbytes=1024, pieces=2, seconds=0.3)
    assert asy.system == "ray" and asy.model_updates_per_s > 0
    assert all(rate > 0 for rate in asy.worker_pushes_per_s)
    # the clusters' own processes (GCS, raylet, actor) are gone, not orphaned
    assert _ray_processes() - before == set()
