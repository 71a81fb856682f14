"""`launch --hosts W+S --link RATE --link-of K=RATE` (issue 45): every shard and worker
on an emulated host, a network namespace with a shaped NIC.

The placement and the refusals are pure (HostPlan, the CLI's checks) and need no
root. The runs on hosts need root and iproute2 and skip without them, with the
reason, as the ``emulated_hosts`` fixture does: one sync run whose final weights
equal the same run on loopback (sync is bit-reproducible), and one stopped by
SIGTERM; neither leaves a namespace or interface behind. The first compresses its
pushes and pulls (--compression, --pull-compression), as across hosts one would.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from paramserver.cli.main import main
from paramserver.errors import ConfigError
from paramserver.server.config import ServerConfig
from paramserver.workers.config import WorkerConfig
from paramserver.workers.launch.cluster import ClusterSpec, run_cluster
from paramserver.workers.launch.hostplan import HostPlan
from paramserver.workers.launch.netcluster import (
    existing_links,
    existing_namespaces,
    netns_problem,
)
from tests.procs import reap
from tests.test_cli_e2e import PARAMSERVER, ROOT, env

needs_netns = pytest.mark.skipif(netns_problem() is not None,
                                 reason=netns_problem() or "")


# ------------------------------------------------------------------ placement, refusals


def test_workers_go_round_the_worker_hosts_and_shards_round_the_server_hosts() -> None:
    plan = HostPlan.parse("3+2", "400mbit", {4: "100mbit"})
    assert [plan.worker_host(r) for r in range(5)] == [0, 1, 2, 0, 1]
    assert [plan.server_host(s) for s in range(3)] == [3, 4, 3]
    assert plan.server_host(0, replica=1) == 4  # a shard's backup on another host
    assert [plan.rate(h) for h in range(5)] == ["400mbit"] * 4 + ["100mbit"]
    colocated = HostPlan.parse("2+0")
    assert [colocated.server_host(s) for s in range(3)] == [0, 1, 0]
    assert colocated.link == "1gbit"


@pytest.mark.parametrize(("hosts", "link", "link_of", "says"), [
    ("4", None, {}, "must look like W+S"),
    ("0+2", None, {}, "at least one worker host"),
    ("2+1", "400mbps", {}, "give a number and a unit"),
    ("2+1", None, {3: "100mbit"}, "hosts are 0 .. 2"),
    ("2+1", None, {1: "fast"}, "give a number and a unit"),
])
def test_bad_hosts_and_rates_are_refused(hosts: str, link: str | None,
                                         link_of: dict[int, str], says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        HostPlan.parse(hosts, link, link_of)


def test_a_host_that_would_run_nothing_is_refused() -> None:
    def spec(**hosts: Any) -> ClusterSpec:
        return ClusterSpec(num_servers=1, num_workers=2, server=ServerConfig(),
                           worker=WorkerConfig(steps=1), **hosts)

    with pytest.raises(ConfigError, match="3 worker hosts for 2 worker"):
        spec(hosts="3+1")
    with pytest.raises(ConfigError, match="2 server hosts for 1 shard"):
        spec(hosts="2+2")
    with pytest.raises(ConfigError, match="give --hosts W\\+S too"):
        spec(link_of={0: "1mbit"})


def _launch(*args: str) -> tuple[int, str]:
    done = CliRunner().invoke(main, ["launch", "--steps", "1", *args])
    return done.exit_code, done.output


@pytest.mark.parametrize(("args", "says"), [
    (["--hosts", "2+1", "--link", "fast"], "rate 'fast'"),
    (["--hosts", "2+1", "--link-of", "x=1gbit"], "must look like HOST=RATE"),
    (["--hosts", "2+1", "--link-of", "5=1gbit"], "hosts are 0 .. 2"),
    (["--hosts", "3+1"], "3 worker hosts for 2 worker(s)"),
    (["--link", "1gbit"], "give --hosts W+S too"),
])
def test_launch_refuses_bad_hosts_in_one_line(args: list[str], says: str) -> None:
    code, output = _launch("-s", "1", "-n", "2", *args)
    assert code == 2, output
    assert says in output


def test_launch_refuses_hosts_without_root(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    code, output = _launch("-s", "1", "-n", "2", "--hosts", "2+1", "--out",
                           str(tmp_path / "run"))
    assert code == 2, output
    (line,) = [x for x in output.splitlines() if x.startswith("Error:")]
    assert "--hosts: creating network namespaces needs root" in line
    assert not (tmp_path / "run").exists()  # refused before anything ran


# ------------------------------------------------------------------ runs on hosts


def _left(result: dict[str, Any]) -> list[str]:
    """The run's namespaces and interfaces that still exist."""
    namespaces = [h["namespace"] for h in result["hosts"]]
    tag = namespaces[0].split("-")[0].removeprefix("pscl")
    return sorted(n for n in existing_namespaces() | existing_links()
                  if n in namespaces or tag in n)


@needs_netns
def test_sync_on_hosts_ends_with_the_weights_of_sync_on_loopback(tmp_path: Path) -> None:
    # compressed both ways (int8 over the shaped NICs): each worker's residuals and copy
    # as on loopback
    args = ["-s", "1", "-n", "2", "--mode", "sync", "--steps", "4", "--no-eval", "--quiet",
            "--compression", "int8", "--pull-compression", "int8"]
    done = subprocess.run(
        [*PARAMSERVER, "launch", *args, "--hosts", "2+1", "--link", "1gbit",
         "--link-of", "1=200mbit", "--out", str(tmp_path / "hosts")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env())
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "hosts" / "result.json").read_text())
    hosts = {h["name"]: h for h in result["hosts"]}
    assert [hosts[n]["processes"] for n in ("w0", "w1", "s0")] == [
        ["worker0"], ["worker1"], ["server0"]]
    assert hosts["w1"]["rate"] == "200mbit" and hosts["s0"]["rate_bits"] == 10**9
    assert result["addresses"] == [a for a in result["addresses"]
                                   if a.startswith(f"tcp://{hosts['s0']['address']}:")]
    assert "on 2+1 hosts at 1gbit (w1 at 200mbit)" in done.stdout
    assert result["servers"][0]["counters"]["pulls_compressed"] > 0
    assert not _left(result)

    spec = ClusterSpec(num_servers=1, num_workers=2, evaluate=False,
                       server=ServerConfig(mode="sync", expected_workers=2,
                                           pull_compression="int8"),
                       worker=WorkerConfig(steps=4, compression="int8"))
    run_cluster(spec, tmp_path / "loopback")
    on_hosts = load_file(str(tmp_path / "hosts" / "final_model.safetensors"))
    on_loopback = load_file(str(tmp_path / "loopback" / "final_model.safetensors"))
    assert on_hosts.keys() == on_loopback.keys()
    for name, weight in on_hosts.items():
        assert torch.equal(weight, on_loopback[name]), name


@needs_netns
def test_sigterm_to_the_launcher_deletes_its_hosts(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [*PARAMSERVER, "launch", "-s", "1", "-n", "2", "--mode", "async", "--steps", "100000",
         "--hosts", "2+0", "--out", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env())
    try:
        assert proc.stdout is not None
        started = 0
        for line in proc.stdout:  # the launcher says each process as it starts
            started += "started worker" in line
            if started == 2:
                break
        hosts = json.loads((out / "hosts.json").read_text())  # written once they exist
        assert [h["processes"] for h in hosts] == [["worker0", "server0"], ["worker1"]]
        assert {h["namespace"] for h in hosts} <= existing_namespaces()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 128 + signal.SIGTERM
    finally:
        reap(proc)
    assert not _left({"hosts": hosts})
