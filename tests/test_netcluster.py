"""The emulated cluster (paramserver/workers/launch/netcluster.py): hosts as network
namespaces on one bridge, each NIC shaped both ways, links cut and restored, and
everything deleted on any exit.

The tests with hosts need root and iproute2 and skip without them (the
``emulated_hosts`` fixture of tests/conftest.py); the traffic is real TCP between
real processes on different hosts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from paramserver.benchmarks.common import Agent, close_all, number, text
from paramserver.errors import ConfigError
from paramserver.workers.launch.netcluster import (
    EmulatedCluster,
    NetnsUnavailable,
    emulated_cluster,
    existing_links,
    existing_namespaces,
    netns_problem,
    parse_rate,
)
from tests.procs import reap

Hosts = Callable[..., EmulatedCluster]
PROBE = str(Path(__file__).with_name("net_probe.py"))
needs_netns = pytest.mark.skipif(netns_problem() is not None, reason=str(netns_problem()))


def _left(tag: str) -> set[str]:
    return {n for n in existing_namespaces() | existing_links() if tag in n}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead; its parent (the test's child) has exited, so it is reaped soon
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_rates_are_parsed_as_tc_writes_them() -> None:
    assert parse_rate("400mbit") == 400_000_000
    assert parse_rate("1Gbit") == 10**9
    assert parse_rate("2.5gbit") == 2_500_000_000
    assert parse_rate("64000") == 64_000
    for bad in ("fast", "400mb", "-1mbit", "1kbit", ""):
        with pytest.raises(ConfigError, match="rate"):
            parse_rate(bad)


def test_bad_layouts_are_refused_before_anything_is_made() -> None:
    with pytest.raises(ConfigError, match=r"host 4: hosts are 0\.\.3"), \
            emulated_cluster(2, 2, rates={4: "1mbit"}):
        pass
    with pytest.raises(ConfigError, match="1 to 200 hosts"), emulated_cluster(0, 0):
        pass
    with pytest.raises(ConfigError, match="rate 'slow'"), emulated_cluster(1, rate="slow"):
        pass


def test_without_root_it_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsUnavailable, match="needs root"), emulated_cluster(1, 1):
        pass


def _transfer(c: EmulatedCluster, src: int, dst: int, nbytes: int) -> float:
    """Send ``nbytes`` from host ``src`` to host ``dst``: the receiver's seconds from its
    first byte to the last."""
    recv = c.popen(dst, [sys.executable, PROBE, "recv", c.address(dst), "1"],
                   stdout=subprocess.PIPE, text=True)
    assert recv.stdout is not None
    port = recv.stdout.readline().strip()
    subprocess.run([*c.exec_prefix(src), sys.executable, PROBE, "send", c.address(dst), port,
                    str(nbytes), "30"], check=True, timeout=120)
    got, seconds = recv.stdout.readline().split()
    assert recv.wait(30) == 0 and int(got) == nbytes
    return float(seconds)


def test_each_nic_is_shaped_both_ways_at_its_own_rate(emulated_hosts: Hosts) -> None:
    # hosts: w0 and s0 at 1 Gbit/s; w1 sends slowly, s1 receives slowly
    c = emulated_hosts(workers=2, servers=2, rate="1gbit", rates={1: "40mbit", 3: "40mbit"})
    nbytes = 2 << 20
    slow = nbytes * 8 / 40e6  # 0.42 s
    out_of_slow = _transfer(c, 1, 2, nbytes)  # shaped on w1's own end
    into_slow = _transfer(c, 0, 3, nbytes)  # shaped on s1's bridge port
    fast = _transfer(c, 0, 2, nbytes)
    # a loaded machine makes transfers slower, never faster than the shaper allows
    assert 0.5 * slow < out_of_slow < 2 * slow, out_of_slow
    assert 0.5 * slow < into_slow < 2 * slow, into_slow
    assert fast < 0.5 * slow, fast
    c.set_rate(1, "80mbit")
    assert c.rate(1) == 80_000_000
    faster = _transfer(c, 1, 2, nbytes)
    assert 0.25 * slow < faster < slow, faster


def _syn_sent(c: EmulatedCluster, host: int) -> bool:
    out = subprocess.run([*c.exec_prefix(host), "ss", "-Htn", "state", "syn-sent"],
                         capture_output=True, text=True, timeout=30).stdout
    return bool(out.strip())


def test_a_cut_host_is_unreachable_until_restored(emulated_hosts: Hosts) -> None:
    c = emulated_hosts(workers=1, servers=1, rate="100mbit")
    recv = c.popen(1, [sys.executable, PROBE, "recv", c.address(1), "1"],
                   stdout=subprocess.PIPE, text=True)
    assert recv.stdout is not None
    port = recv.stdout.readline().strip()
    send = [*c.exec_prefix(0), sys.executable, PROBE, "send", c.address(1), port, "65536"]
    c.cut(1)
    assert c.is_cut(1)
    # no answer at all while cut: the connect times out (not refused)
    failed = subprocess.run([*send, "1"], capture_output=True, text=True, timeout=60)
    assert failed.returncode != 0 and "timed out" in failed.stderr, failed.stderr
    # a connection tried while cut stalls (SYN retransmitted), and goes through on restore
    sender = subprocess.Popen([*send, "60"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not _syn_sent(c, 0):
            assert time.monotonic() < deadline, "the sender never tried to connect"
        assert sender.poll() is None
        c.restore(1)
        assert not c.is_cut(1)
        assert sender.wait(60) == 0, sender.communicate()[1]
    finally:
        if sender.poll() is None:
            sender.kill()
        sender.communicate()
    assert recv.stdout.readline().split()[0] == "65536"
    assert recv.wait(30) == 0


def test_a_sync_round_across_hosts(emulated_hosts: Hosts, tmp_path: Path) -> None:
    """Two workers on two hosts, their shard on a third: the project's sync rounds go
    through the bridge over TCP (no shared memory across hosts) and agree."""
    c = emulated_hosts(workers=2, servers=1, rate="200mbit")
    server = Agent("shard", tmp_path, c.exec_prefix("s0"))
    workers = [Agent(f"worker{r}", tmp_path, c.exec_prefix(r)) for r in range(2)]
    try:
        server.send("ps_serve", config={
            "shard": 0, "num_shards": 1, "mode": "sync", "expected_workers": 2,
            "optimizer": "sgd", "optimizer_args": {"lr": 0.5}, "heartbeat_timeout": 60.0,
            "bind": f"tcp://{c.address('s0')}:0"})
        address = text(server.read(120), "address")
        assert address.startswith(f"tcp://{c.address('s0')}:")
        numel = 1 << 18  # 1 MiB
        for r, w in enumerate(workers):
            w.send("open", system="ps", addresses=[address], numel=numel, rank=r)
        for w in workers:
            w.read(120)
        for w in workers:
            w.send("measure", system="ps", numel=numel, iters=3)
        assert all(number(w.read(120), "round_s") > 0 for w in workers)
        for w in workers:
            w.send("close", system="ps")
        closed = [w.read(120) for w in workers]
        workers[0].call("ps_stop", 60.0, addresses=[address])
        served = server.read(120)
    finally:
        close_all([server, *workers])
    # three rounds of the mean gradient 1e-3 at lr 0.5 from zero, on the 16 first weights
    expected = 16 * -3 * 0.5 * 1e-3
    for r in closed:
        assert r["checksum"] == pytest.approx(expected, rel=1e-5)
        assert r["shm_used"] == 0
    assert served["version"] == 3


@needs_netns
def test_everything_is_deleted_when_the_block_raises() -> None:
    with pytest.raises(KeyboardInterrupt), emulated_cluster(1, 1) as c:
        sleeper = c.popen(0, [sys.executable, "-c", "import time; time.sleep(60)"])
        assert {h.ns for h in c.hosts} <= existing_namespaces()
        assert c.bridge in existing_links()
        raise KeyboardInterrupt
    assert sleeper.returncode is not None
    assert not _left(c.tag)


@needs_netns
def test_sigterm_still_deletes_everything(tmp_path: Path) -> None:
    code = ("import subprocess, sys, time\n"
            "from paramserver.workers.launch.netcluster import emulated_cluster\n"
            "with emulated_cluster(1, 1) as c:\n"
            "    sleep = [sys.executable, '-c', 'import time; time.sleep(60)']\n"
            "    tracked = c.popen(0, sleep)\n"
            "    stray = subprocess.Popen(c.exec_prefix(1) + sleep)\n"
            "    print(c.tag, tracked.pid, stray.pid, flush=True)\n"
            "    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        tag, *pids = proc.stdout.readline().split()
        assert len(_left(tag)) == 2 + 2 + 1  # namespaces, bridge ports, bridge
        proc.terminate()
        assert proc.wait(60) == 128 + signal.SIGTERM
    finally:
        reap(proc)
    assert not _left(tag)
    # the tracked one was stopped; the stray one killed with its namespace
    assert not any(_alive(int(p)) for p in pids)
