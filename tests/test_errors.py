"""One exception tree: codes map to classes, every error derives from ParamServerError."""

from __future__ import annotations

import builtins
import importlib
import inspect
import pickle
import pkgutil

import msgpack
import pytest

import paramserver
from paramserver import errors
from paramserver.errors import (
    REMOTE_ERRORS,
    BusyError,
    ErrorCode,
    ForbiddenError,
    IncompatiblePlanError,
    NotRegisteredError,
    ParamServerError,
    ProtocolError,
    RemoteError,
    RequestTimeoutError,
    TrainingStoppedError,
    TransportError,
)


def test_codes_are_their_wire_strings():
    assert ErrorCode.PLAN_MISMATCH == "plan_mismatch"
    assert f"{ErrorCode.BUSY}" == str(ErrorCode.BUSY) == "busy"
    assert msgpack.unpackb(msgpack.packb({"code": ErrorCode.FORBIDDEN})) == {"code": "forbidden"}
    assert {code.value for code in ErrorCode} == ErrorCode.ALL
    assert "too_many_workers" in ErrorCode.ALL


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_code_maps_to_a_remote_error_class(code):
    cls = REMOTE_ERRORS[code]
    assert issubclass(cls, RemoteError) and issubclass(cls, ParamServerError)
    assert cls is not RemoteError and code in cls.codes
    err = RemoteError.from_reply("shard 0 at tcp://h:1", code.value, "why")
    assert type(err) is cls
    assert err.code is code and err.peer == "shard 0 at tcp://h:1" and err.reason == "why"
    assert str(err) == f"shard 0 at tcp://h:1 refused the request: {code.value}: why"


def test_the_map_covers_each_code_once():
    listed = [code for cls in set(REMOTE_ERRORS.values()) for code in cls.codes]
    assert sorted(listed) == sorted(ErrorCode)


def test_from_reply_gives_the_specific_class():
    assert isinstance(RemoteError.from_reply("p", "plan_mismatch", "r"), IncompatiblePlanError)
    assert isinstance(RemoteError.from_reply("p", "not_registered", "r"), NotRegisteredError)
    assert isinstance(RemoteError.from_reply("p", "forbidden", "r"), ForbiddenError)
    assert isinstance(RemoteError.from_reply("p", "stopped", "r"), TrainingStoppedError)
    assert isinstance(RemoteError.from_reply("p", ErrorCode.BUSY, "r"), BusyError)
    with pytest.raises(IncompatiblePlanError):
        raise RemoteError.from_reply("p", "plan_mismatch", "r")


def test_an_unknown_code_from_a_newer_peer_is_a_plain_remote_error():
    err = RemoteError.from_reply("p", "some_future_code", "r")
    assert type(err) is RemoteError and err.code == "some_future_code"


def test_errors_survive_pickling():
    for err in (RemoteError.from_reply("p", "busy", "full"),
                ProtocolError(ErrorCode.BAD_FIELD, "x"), RequestTimeoutError("no reply")):
        again = pickle.loads(pickle.dumps(err))
        assert type(again) is type(err) and str(again) == str(err)


def test_a_request_timeout_is_a_transport_error_and_a_builtin_timeout():
    err = RequestTimeoutError("PULL: no reply within 5s from shard 0")
    assert isinstance(err, TransportError) and isinstance(err, ParamServerError)
    assert isinstance(err, builtins.TimeoutError)
    with pytest.raises(TimeoutError):
        raise err


def test_no_name_in_errors_shadows_a_builtin():
    shadowed = {n for n in vars(errors) if not n.startswith("__")} & set(dir(builtins))
    assert shadowed == set()


def _modules() -> list[str]:
    """Every module of the package, the linked workers/cli/benchmarks included."""
    names = ["paramserver"]
    for info in pkgutil.walk_packages(paramserver.__path__, "paramserver.",
                                      onerror=lambda name: None):
        if info.name.rsplit(".", 1)[-1] != "__main__":  # importing it would run the CLI
            names.append(info.name)
    return sorted(names)


def _defined_in(module_name: str) -> list[tuple[str, object]]:
    try:
        module = importlib.import_module(module_name)
    except ImportError:  # an optional dependency (an extra) that is not installed
        return []
    return [(name, obj) for name, obj in vars(module).items()
            if getattr(obj, "__module__", None) == module_name]


def test_the_walk_finds_the_linked_subpackages():
    names = _modules()
    for expected in ("paramserver.workers.launch.zygote", "paramserver.cli.main",
                     "paramserver.benchmarks.common", "paramserver.server.loop"):
        assert expected in names


def test_every_exception_class_in_the_package_derives_from_paramserver_error():
    # errors are Exceptions; a BaseException-only signal (paramserver.cli.launch's _Stop, a
    # KeyboardInterrupt) is control flow, and must stay out of ``except Exception``
    outside = []
    for module_name in _modules():
        for name, obj in _defined_in(module_name):
            if (inspect.isclass(obj) and issubclass(obj, Exception)
                    and not issubclass(obj, ParamServerError)):
                outside.append(f"{module_name}.{name}")
    assert outside == []


def test_no_class_or_function_of_the_package_is_named_like_a_builtin():
    shadowing = [f"{module_name}.{name}" for module_name in _modules()
                 for name, obj in _defined_in(module_name)
                 if (inspect.isclass(obj) or inspect.isfunction(obj))
                 and name in vars(builtins)]
    assert shadowing == []
