"""A trace is a file anyone may have written: what ``simulate --replay`` reads from one is
checked before it acts. Damaged headers and configs are refused in one line, and a
plug-in the trace names (code to import) is not imported unless the user trusts the file
(--trust-plugins) or names it on the command line. No run: the traces are written here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from paramserver.cli.main import main
from paramserver.errors import ConfigError, RegistryError
from paramserver.observe import trace as tr
from paramserver.server.config import ServerConfig
from paramserver.workers.config import WorkerConfig
from paramserver.workers.launch.replay import Changes, replay_dir

PROBE = "tests.plugin_probe:make_task"  # importing it raises: it must not be imported


def _trace(directory: Path, *, server: dict[str, Any] | None = None,
           worker: dict[str, Any] | None = None, threads: int = 1,
           shard_index: int = 0) -> Path:
    s = {**ServerConfig(mode="async", expected_workers=1).to_dict(), **(server or {})}
    w = {**WorkerConfig(servers=["tcp://127.0.0.1:1"], task="digits-mlp").to_dict(),
         **(worker or {})}
    tr.TraceWriter(tr.shard_file(directory, shard_index),
                   tr.Header(tr.FORMAT, "shard", shard_index, s, threads, tr.DEFAULT_CAP)).close()
    tr.TraceWriter(tr.worker_file(directory, 0),
                   tr.Header(tr.FORMAT, "worker", 0, w, 1, tr.DEFAULT_CAP)).close()
    return directory


def test_a_plug_in_the_trace_names_is_imported_only_when_trusted(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "task", worker={"task": PROBE})
    with pytest.raises(RegistryError, match=f"names the task '{PROBE}', code to import and "
                                            r"run: not imported \(pass --trust-plugins"):
        replay_dir(trace)
    with pytest.raises(RegistryError, match=r"plugin_probe\.py was imported"):
        replay_dir(trace, trust_plugins=True)  # trusted: imported (and it raises)
    res = CliRunner().invoke(main, ["simulate", "--replay", str(trace)])
    assert res.exit_code == 1 and "not imported (pass --trust-plugins" in res.output, res.output
    assert "Traceback" not in res.output
    res = CliRunner().invoke(main, ["simulate", "--replay", str(trace), "--trust-plugins"])
    assert res.exit_code == 1 and "plugin_probe.py was imported" in res.output, res.output
    # a shard's policy alike; one the user names for a counterfactual is theirs to import
    trace = _trace(tmp_path / "policy", server={"policy": "tests.plugin_probe:Policy"})
    with pytest.raises(RegistryError, match="names the staleness policy"):
        replay_dir(trace)
    with pytest.raises(RegistryError, match=r"plugin_probe\.py was imported"):
        replay_dir(_trace(tmp_path / "mine"), Changes(policy="tests.plugin_probe:Policy"))
    res = CliRunner().invoke(main, ["simulate", "--trust-plugins", "--mode", "async"])
    assert res.exit_code == 2 and "--trust-plugins applies to --replay" in res.output


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"threads": 10**6}, "a damaged header .*threads 1000000"),  # torch would crash on it
    ({"shard_index": 3}, r"no trace of shard 0 .*\(shards \[3\]\)"),
    ({"server": {"mode": "bogus"}}, "bad server config: 'bogus' is not a valid Mode"),
    ({"server": {"num_shards": "two"}}, "server option num_shards: Expected `int`"),
    ({"server": {"optimizer_args": 5}}, "server option optimizer_args: Expected `object`"),
    ({"server": {"threads": 4096}}, r"threads must be in \[0, 1024\], got 4096"),
    ({"worker": {"seed": "x"}}, "worker option seed: Expected `int`, got `str`"),
])
def test_a_damaged_trace_is_refused_in_one_line(tmp_path: Path, kwargs: dict[str, Any],
                                                match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        replay_dir(_trace(tmp_path, **kwargs))


def test_two_files_of_one_shard_are_refused(tmp_path: Path) -> None:
    _trace(tmp_path)
    (tmp_path / "shard0.pstrace").rename(tmp_path / "shard7.pstrace")  # its header says 0
    _trace(tmp_path)
    with pytest.raises(ConfigError, match="a second file of shard 0"):
        tr.read_trace_dir(tmp_path)
