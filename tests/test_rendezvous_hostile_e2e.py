"""A hostile client of the rendezvous store cannot stop a CURVE server rank (issue 29,
item 5): real `paramserver run` ranks (Slurm's variables, as srun sets them), the real
TCPStore that rank 0 hosts, and a third process that reaches that store.

The store is not authenticated: whoever reaches MASTER_PORT can set any key. Under
CURVE a server takes `paramserver/finished` only as a hint and stops once every worker
has said BYE to it over its own key (or died)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from paramserver.wire.curve import generate_curve_keys
from tests.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parent.parent
PARAMSERVER = [sys.executable, "-m", "paramserver.cli"]
LIMIT = 300.0  # seconds any one wait may take on a busy machine (a bound, not a measure)
IGNORED = "the rendezvous store says every worker is done, but worker(s) 0 did not say BYE"


def _env(rank: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PARAMSERVER_", "SLURM_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PARAMSERVER_LOG_LEVEL="INFO",
               SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
               SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost")
    return env


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:  # whatever a failed test left running
        if proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _until(done: Callable[[], bool], what: str) -> None:
    """Poll ``done`` (a condition on files and processes) until it holds."""
    deadline = time.monotonic() + LIMIT
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"still waiting after {LIMIT:g}s for {what}")
        time.sleep(0.1)  # polling a condition, not standing in for one


def test_a_hostile_finished_does_not_stop_a_curve_server(
        tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    keys = generate_curve_keys(tmp_path / "keys", clients=["worker"], admins=["admin"])
    port = free_port()
    common = ["run", "--num-servers", "1", "--store-port", str(port), "--device", "cpu",
              "--mode", "async", "--steps", "5", "--rendezvous-timeout", str(int(LIMIT)),
              "--curve-secret-key", str(keys.server_secret),
              "--curve-clients-dir", str(keys.authorized_dir),
              "--admin-key", str(keys.admins["admin"][0]),
              "--curve-key", str(keys.clients["worker"][1]),
              "--curve-server-key", str(keys.server_public)]
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]

    def start(rank: int) -> subprocess.Popen[bytes]:
        with logs[rank].open("wb") as fh:
            proc = subprocess.Popen([*PARAMSERVER, *common], cwd=ROOT, env=_env(rank, port),
                                    stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        procs.append(proc)
        return proc

    server = start(0)  # rank 0: shard 0, and the store's host
    # the hostile process: a plain client of the run's store, no key of the job's
    hostile = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=LIMIT))
    hostile.wait(["paramserver/server/0"], timedelta(seconds=LIMIT))  # the shard is up
    hostile.set("paramserver/finished", "1")
    hostile.add("paramserver/done", 5)

    _until(lambda: server.poll() is not None or IGNORED in logs[0].read_text(),
           "the server to stop or to say it ignores the store's `finished`")
    assert server.poll() is None, f"the hostile `finished` stopped the CURVE server:\n" \
                                  f"{logs[0].read_text()}"

    # the run goes on: a worker registers, trains and says BYE; then the server stops
    worker = start(1)
    assert worker.wait(LIMIT) == 0, logs[1].read_text()
    assert server.wait(LIMIT) == 0, logs[0].read_text()
    text = logs[0].read_text()
    assert "every worker is done; stopping" in text
    assert "shard 0 stopped" in text


def test_a_curve_run_still_stops_when_its_workers_are_done(
        tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """No hostile client: the store's `finished`, set after the last worker's BYE,
    stops the CURVE server as it stops a plain one."""
    keys = generate_curve_keys(tmp_path / "keys", clients=["worker"])
    port = free_port()
    common = ["run", "--num-servers", "1", "--store-port", str(port), "--device", "cpu",
              "--mode", "sync", "--steps", "3", "--out", str(tmp_path / "out"),
              "--curve-secret-key", str(keys.server_secret),
              "--curve-clients-dir", str(keys.authorized_dir),
              "--curve-key", str(keys.clients["worker"][1]),
              "--curve-server-key", str(keys.server_public)]
    for rank in range(2):
        with (tmp_path / f"rank{rank}.log").open("wb") as fh:
            procs.append(subprocess.Popen([*PARAMSERVER, *common], cwd=ROOT,
                                          env=_env(rank, port), stdout=fh,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    for rank, proc in enumerate(procs):
        assert proc.wait(LIMIT) == 0, (tmp_path / f"rank{rank}.log").read_text()
    assert (tmp_path / "out" / "final_model.safetensors").exists()
