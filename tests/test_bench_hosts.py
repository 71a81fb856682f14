"""The across-hosts part of the bench: shards in one network namespace, workers in another.

Needs root and iproute2 (skipped otherwise), except the test of the skip itself.
The agents are real processes started with ``ip netns exec``; the traffic
crosses a veth pair.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from paramserver.benchmarks.hosts import run_hosts
from paramserver.benchmarks.netns import existing, netns_problem, two_namespaces
from paramserver.benchmarks.records import BenchResult, HostsResult
from paramserver.benchmarks.report import markdown
from paramserver.cli.bench import bench
from paramserver.shm.link import enabled as shm_enabled
from tests.procs import reap

needs_netns = pytest.mark.skipif(netns_problem() is not None, reason=str(netns_problem()))


@needs_netns
def test_namespaces_are_deleted_when_the_block_breaks_off() -> None:
    with pytest.raises(KeyboardInterrupt), two_namespaces() as link:
        assert {link.ns_a, link.ns_b} <= existing()
        raise KeyboardInterrupt
    assert not {link.ns_a, link.ns_b} & existing()


@pytest.mark.integration
@needs_netns
def test_hosts_part_measures_raw_and_ps_over_tcp_between_namespaces(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    res = CliRunner().invoke(bench, ["--out", str(out), "--part", "hosts", "--size", "64KiB",
                                     "--repeats", "2", "--quick"])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "result.json").read_text())
    hosts = data["hosts"]
    rows = {r["system"]: r for r in hosts["rows"]}
    assert set(rows) == {"raw", "ps"}
    ps = rows["ps"]
    assert ps["bytes"] == 64 << 10 and ps["workers"] == 1 and ps["shards"] == 1
    assert ps["round_s"]["n"] == 2 and ps["ratio_to_limit"]["median"] > 0
    # the peer address is not the shard's host: no shared memory, whatever was offered
    assert ps["shm_peers"] == 0 and ps["shm_used"] == 0 and hosts["problems"] == []
    assert ps["shm_offered"] == (1 if shm_enabled() else 0)
    assert hosts["link"]["transport"] == "tcp"
    assert hosts["link"]["ip_a"].startswith("10.")
    assert not {hosts["link"]["ns_a"], hosts["link"]["ns_b"]} & existing()
    assert "across hosts" in res.output
    text = markdown(BenchResult.from_json(data))
    assert "| 1 | 1 | 64KiB | ps |" in text.split("Across hosts")[1]


def test_hosts_part_is_skipped_without_root(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert run_hosts([4096]) == HostsResult(skipped="creating network namespaces needs root")
    res = CliRunner().invoke(bench, ["--out", str(tmp_path), "--part", "hosts", "--quick"])
    assert res.exit_code == 0, res.output
    assert "across hosts: skipped: creating network namespaces needs root" in res.output
    data = json.loads((tmp_path / "result.json").read_text())
    goal = next(g for g in data["goals"] if g["goal"].startswith("across hosts"))
    assert goal["status"] == "n/a" and "root" in goal["detail"]


@needs_netns
def test_sigterm_still_deletes_the_namespaces(tmp_path: Path) -> None:
    names = tmp_path / "names"
    code = ("import sys, time\n"
            "from paramserver.benchmarks.netns import two_namespaces\n"
            "with two_namespaces() as link:\n"
            f"    open({str(names)!r}, 'w').write(link.ns_a + ' ' + link.ns_b)\n"
            "    print('ready', flush=True)\n"
            "    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        made = set(names.read_text().split())
        assert made <= existing()
        proc.terminate()
        assert proc.wait(30) == 128 + signal.SIGTERM
    finally:
        reap(proc)
    assert not made & existing()
