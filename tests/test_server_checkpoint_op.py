"""The CHECKPOINT op cannot make a server write outside its checkpoint directory."""

from __future__ import annotations

import pytest

from paramserver.errors import ErrorCode, ProtocolError
from paramserver.server.loop import ServerConfig, ShardServer
from paramserver.wire.protocol import Message, Op


@pytest.mark.parametrize("path", ["../elsewhere", "/etc", "sub/../../x"])
def test_checkpoint_path_outside_the_directory_is_refused(tmp_path, path):
    server = ShardServer(ServerConfig(checkpoint_dir=str(tmp_path / "ckpt")))
    try:
        with pytest.raises(ProtocolError) as err:
            server._on_checkpoint(Message(Op.CHECKPOINT, 1, {"path": path}), b"peer")
        assert err.value.code == ErrorCode.BAD_FIELD
        assert not (tmp_path / "elsewhere").exists()
    finally:
        server.close()


def test_checkpoint_needs_a_directory():
    server = ShardServer(ServerConfig())
    try:
        with pytest.raises(ProtocolError, match="no checkpoint directory"):
            server._on_checkpoint(Message(Op.CHECKPOINT, 1, {}), b"peer")
    finally:
        server.close()
