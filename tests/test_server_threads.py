"""A shard process runs torch with ``--threads`` intra-op threads (1 by default)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys, torch
from paramserver.server.config import ServerConfig
from paramserver.server.loop import ShardServer
from paramserver.server.process import own_process
before = torch.get_num_threads()
config = ServerConfig.from_dict({"bind": "tcp://127.0.0.1:0", **eval(sys.argv[1])})
server = ShardServer(config)
server.start()
own_process(config, server.address, server.stop)
print(before, torch.get_num_threads())
server.serve_forever(lambda ready: server.stop())  # closes what it opened
"""


@pytest.mark.parametrize(("fields", "expected"), [("{}", "1"), ("{'threads': 3}", "3"),
                                                  ("{'threads': 0}", "before")])
def test_a_shard_process_sets_its_torch_threads(fields: str, expected: str) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") and not k.startswith("PARAMSERVER_")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", SCRIPT, fields], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    before, after = out.split()
    assert after == (before if expected == "before" else expected)
