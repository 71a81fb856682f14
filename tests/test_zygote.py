"""The zygote that forks local runs' processes: a Popen look-alike, real forks."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap

import pytest

from paramserver.workers.launch.zygote import Zygote, fork_enabled

pytestmark = pytest.mark.skipif(not fork_enabled(), reason="the zygote needs Linux")


@pytest.fixture(scope="module")
def zygote():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    z = Zygote(env)
    yield z
    z.close()
    assert z.popen.returncode == 0


def spawn(zygote, tmp_path, *args, env=None):
    out = (tmp_path / "out.log").open("wb")
    err = (tmp_path / "err.log").open("wb")
    try:
        return zygote.spawn("tests.zygote_child", list(args),
                            env={**zygote.env, **(env or {})},
                            stdout=out.fileno(), stderr=err.fileno())
    finally:
        out.close()
        err.close()


def test_a_child_runs_its_module_as_main_with_its_argv_env_and_files(zygote, tmp_path):
    proc = spawn(zygote, tmp_path, "exit", "3", env={"ZYGOTE_TEST": "seen"})
    assert proc.wait(timeout=30) == 3 and proc.poll() == 3
    out = (tmp_path / "out.log").read_text()
    assert out == f"name=__main__ argv=['exit', '3'] cwd={os.getcwd()} env=seen\n"
    assert (tmp_path / "err.log").read_text() == "on stderr\n"


def test_a_module_in_the_working_directory_is_found_as_python_m_would(zygote, tmp_path,
                                                                        monkeypatch):
    (tmp_path / "late_module.py").write_text("print('found', __name__)\n")
    monkeypatch.chdir(tmp_path)  # after the zygote started, and the file is new
    out = (tmp_path / "out.log").open("wb")
    try:
        proc = zygote.spawn("late_module", [], env=zygote.env, stdout=out.fileno(),
                            stderr=out.fileno())
    finally:
        out.close()
    assert proc.wait(timeout=30) == 0, (tmp_path / "out.log").read_text()
    assert (tmp_path / "out.log").read_text() == "found __main__\n"


def test_children_do_not_share_numpy_global_random_state(zygote, tmp_path):
    draws = []
    for i in range(2):
        (tmp_path / str(i)).mkdir()
        proc = spawn(zygote, tmp_path / str(i), "random")
        assert proc.wait(timeout=30) == 0
        draws.append((tmp_path / str(i) / "out.log").read_text().splitlines()[-1])
    assert draws[0] != draws[1]


def test_an_exception_is_exit_code_1_with_its_traceback(zygote, tmp_path):
    proc = spawn(zygote, tmp_path, "raise")
    assert proc.wait(timeout=30) == 1
    assert "ValueError: boom" in (tmp_path / "err.log").read_text()


def test_signals_and_wait_timeouts_behave_as_popen(zygote, tmp_path):
    proc = spawn(zygote, tmp_path, "pause")
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc.kill()  # a second kill of a reaped child is a no-op, as for Popen


LAUNCHER = textwrap.dedent("""
    import os, sys
    from paramserver.workers.launch.zygote import zygote_for
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = zygote_for(env).spawn("tests.zygote_child", ["pause"], env=env,
                                 stdout=sys.stdout.fileno(), stderr=sys.stderr.fileno())
    print(proc.pid, flush=True)
    sys.stdin.read()  # until the test kills us
""")


def test_a_launcher_killed_with_sigkill_leaves_no_child_behind():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert launcher.stdout is not None
        line = launcher.stdout.readline()  # pid, or the first line the child printed
        while line.startswith(b"name="):
            line = launcher.stdout.readline()
        child = os.pidfd_open(int(line))  # readable once that process has ended
        try:
            assert select.select([child], [], [], 0)[0] == []
            launcher.kill()
            launcher.wait()
            assert select.select([child], [], [], 30)[0] == [child], (
                "the zygote's child outlived its launcher")
        finally:
            os.close(child)
    finally:
        launcher.kill()
        launcher.wait()


def run_tiny_cluster(tmp_path, mode="sync", workers=2, steps=5):
    """Run a small local cluster to the end; (the process handles' types, shard 0's STATS)."""
    from paramserver.server.loop import ServerConfig
    from paramserver.workers.admin import server_stats
    from paramserver.workers.launch.cluster import ClusterSpec, LocalCluster
    from paramserver.workers.worker import WorkerConfig

    spec = ClusterSpec(num_servers=1, num_workers=workers,
                       server=ServerConfig(mode=mode, expected_workers=workers),
                       worker=WorkerConfig(servers=[], task="synthetic-logreg",
                                           steps=steps))
    with LocalCluster(spec, tmp_path) as cluster:
        cluster.start_servers()
        cluster.start_workers()
        cluster.wait_workers()
        kinds = {type(p.popen) for p in cluster.servers + cluster.workers}
        return kinds, server_stats(cluster.addresses)[0]


@pytest.mark.parametrize("spawn_mode", ["fork", "exec"])
def test_a_local_run_is_the_same_forked_or_executed(tmp_path, monkeypatch, spawn_mode):
    from paramserver.workers.launch.zygote import ForkedProcess

    monkeypatch.setenv("PARAMSERVER_SPAWN", spawn_mode)
    kinds, stats = run_tiny_cluster(tmp_path)
    assert kinds == {ForkedProcess if spawn_mode == "fork" else subprocess.Popen}
    assert stats.version == 5


def test_a_run_falls_back_to_cold_starts_when_the_zygote_cannot_fork(tmp_path, monkeypatch,
                                                                      caplog):
    from paramserver.workers.launch.zygote import ZygoteError

    def refuse(self, module, *args, **kwargs):
        raise ZygoteError(f"the zygote could not start {module}: not single-threaded")

    monkeypatch.setattr(Zygote, "spawn", refuse)
    kinds, stats = run_tiny_cluster(tmp_path, mode="async", workers=1, steps=3)
    assert kinds == {subprocess.Popen} and stats.version == 3
    assert "starting processes without it" in caplog.text
