"""CURVE: keys, refusals and a whole encrypted, authenticated run over real processes."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch
import zmq
from click.testing import CliRunner

from paramserver.cli.keys import keys as keys_cli
from paramserver.core.sharding import ShardPlan
from paramserver.errors import (
    ConfigError,
    ParamServerError,
    RequestTimeoutError,
    TransportError,
)
from paramserver.observe.events import read_events
from paramserver.server.loop import ServerConfig
from paramserver.wire.curve import CurveKeys, generate_curve_keys
from paramserver.wire.protocol import Message, Op, encode
from paramserver.wire.transport import RouterSocket
from paramserver.workers.client import PSClient
from paramserver.workers.launch.cluster import ClusterSpec, Progress, run_cluster
from paramserver.workers.stragglers import StragglerSpec
from paramserver.workers.worker import WorkerConfig, build_task

REFUSAL_WAIT = 1.0  # seconds a refused peer waits for anything at all


# ---------------------------------------------------------------------------- keys


def test_generate_writes_z85_pairs_private_secrets_and_an_authorised_dir(tmp_path):
    made = generate_curve_keys(tmp_path, ["alice", "bob"])
    assert sorted(made.clients) == ["alice", "bob"]
    server = CurveKeys.load(made.server_secret)
    assert len(server.public) == 40 and len(server.secret) == 40  # Z85 of 32 bytes
    alice = CurveKeys.load(made.clients["alice"][1], made.server_public)
    assert alice.server_public == server.public and alice.public != server.public
    for secret in [made.server_secret, *(s for _, s in made.clients.values())]:
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert b"secret-key" in secret.read_bytes()
    for public, _ in made.clients.values():
        assert b"secret-key" not in public.read_bytes()
    assert sorted(p.name for p in made.authorized_dir.iterdir()) == ["alice.key", "bob.key"]
    assert (made.authorized_dir / "bob.key").read_bytes() == made.clients["bob"][0].read_bytes()


def test_generate_refuses_to_overwrite_and_bad_names(tmp_path):
    first = generate_curve_keys(tmp_path)
    before = first.server_secret.read_bytes()
    with pytest.raises(TransportError, match="refusing to overwrite"):
        generate_curve_keys(tmp_path)
    assert first.server_secret.read_bytes() == before
    assert generate_curve_keys(tmp_path, force=True).server_secret.read_bytes() != before
    for bad in (["server"], ["a/b"], [""], ["x", "x"]):
        with pytest.raises(TransportError):
            generate_curve_keys(tmp_path / "other", bad)


def test_keys_cli(tmp_path):
    runner = CliRunner()
    out = runner.invoke(keys_cli, ["generate", str(tmp_path / "k"), "--client", "w0"])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "k" / "w0.key_secret").exists()
    assert (tmp_path / "k" / "authorized_clients" / "w0.key").exists()
    assert "server.key_secret" in out.output
    again = runner.invoke(keys_cli, ["generate", str(tmp_path / "k"), "--client", "w0"])
    assert again.exit_code != 0 and "refusing to overwrite" in again.output


def test_authorisation_needs_curve_and_some_keys(tmp_path):
    made = generate_curve_keys(tmp_path / "k")
    with pytest.raises(TransportError, match="needs CURVE"):
        RouterSocket("tcp://127.0.0.1:0", allowed_clients=made.authorized_dir)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TransportError, match="no client public keys"):
        RouterSocket("tcp://127.0.0.1:0", curve=CurveKeys.load(made.server_secret),
                     allowed_clients=tmp_path / "empty")
    with pytest.raises(ConfigError, match="curve_secret_key"):
        ServerConfig(curve_clients_dir=str(made.authorized_dir))
    with pytest.raises(ConfigError, match="curve_server_key"):
        WorkerConfig(servers=["tcp://127.0.0.1:1"], curve_key=str(made.clients["client"][1]))
    with pytest.raises(ConfigError, match="one side only"):
        ClusterSpec(server=ServerConfig(curve_secret_key=str(made.server_secret)))


# ---------------------------------------------------------------------------- processes


def _raw_pull_gets_nothing(address: str, curve: CurveKeys | None) -> bool:
    """A bare DEALER asks for the weights as an observer; True if nothing comes back."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        sock.curve_secretkey, sock.curve_publickey = curve.secret, curve.public
        assert curve.server_public is not None
        sock.curve_serverkey = curve.server_public
    try:
        sock.connect(address)
        sock.send_multipart(encode(Message(Op.PULL, 1, {"worker": 0, "clock": 0,
                                                        "observer": True})))
        return not sock.poll(int(REFUSAL_WAIT * 1000))
    finally:
        sock.close(0)


def _observer_pull(address: str, plan: ShardPlan, params: dict[str, torch.Tensor],
                   curve: CurveKeys | None) -> tuple[int, ...]:
    with PSClient([address], plan, worker=0, role="observer", heartbeat_interval=0,
                  timeout=REFUSAL_WAIT, request_timeout=REFUSAL_WAIT, curve=curve) as client:
        client.connect()
        return client.pull(params).versions


@pytest.mark.integration
def test_curve_run_admits_only_the_right_keys(tmp_path):
    made = generate_curve_keys(tmp_path / "keys")
    # a second, unrelated set: its server key is the "wrong server key" and its
    # client pair is a valid CURVE identity the server was never told about
    other = generate_curve_keys(tmp_path / "other")
    good = CurveKeys.load(made.clients["client"][1], made.server_public)
    wrong_server = CurveKeys.load(made.clients["client"][1], other.server_public)
    stranger = CurveKeys.load(other.clients["client"][1], made.server_public)

    spec = ClusterSpec(
        num_servers=1, num_workers=2,
        server=ServerConfig(mode="async", curve_secret_key=str(made.server_secret),
                            curve_clients_dir=str(made.authorized_dir)),
        worker=WorkerConfig(servers=[], task="digits-mlp", steps=40,
                            straggler=StragglerSpec(min_step_time=0.02),
                            curve_key=str(made.clients["client"][1]),
                            curve_server_key=str(made.server_public)),
    )
    out = tmp_path / "run"
    task = build_task(WorkerConfig(servers=[], task="digits-mlp"))
    plan = ShardPlan.from_module(task.model, 1)
    params = dict(task.model.named_parameters())
    seen: dict[str, object] = {}

    def probe(progress: Progress) -> None:
        """While the workers train, try the server with every kind of wrong key."""
        if seen or progress.done_steps == 0:  # the server has weights once a step is done
            return
        address = json.loads((out / "configs" / "worker0.json").read_text())["servers"][0]
        seen["address"] = address
        for name, curve in (("plaintext", None), ("wrong server key", wrong_server),
                            ("unauthorised client", stranger)):
            seen[f"raw {name}"] = _raw_pull_gets_nothing(address, curve)
            try:
                _observer_pull(address, plan, params, curve)
                seen[name] = "pulled weights"
            except RequestTimeoutError:
                seen[name] = "timed out"
            except ParamServerError as exc:
                seen[name] = f"answered: {exc}"
        seen["good"] = _observer_pull(address, plan, params, good)

    result = run_cluster(spec, out, on_progress=probe)

    for name in ("plaintext", "wrong server key", "unauthorised client"):
        assert seen[name] == "timed out", (name, seen)
        assert seen[f"raw {name}"] is True, (name, seen)
    assert isinstance(seen["good"], tuple)
    # training completed over CURVE, and the launcher's own connections (stats,
    # final evaluation, shutdown) used the keys too
    assert [w.steps for w in result.workers] == [40, 40]
    assert result.servers[0]["version"] == 80
    assert result.eval["accuracy"] > 0.5
    assert "shutdown requested" in (out / "logs" / "server0.log").read_text()
    stop = read_events(Path(out) / "events" / "server0.jsonl", "server_stop")
    assert stop and stop[0]["version"] == 80
    # nothing a refused peer sent reached the server's message loop
    counters = result.servers[0]["counters"]
    assert not [k for k in counters if k.startswith("error_")], counters
