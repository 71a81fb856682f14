"""A preloaded parent that forks the processes of local runs instead of cold-starting them.

A shard server or worker started as ``python -m ...`` spends about 3 s of CPU
importing torch (and, at its first optimizer step, torch._dynamo) before it
does anything; a local run of 2 shards and 4 workers pays that six times, on
every run of an experiment grid. A zygote imports all of it once; each
process of a run is then forked from it and runs its module as ``__main__``
with its own argv, environment, working directory and output files, ready in
milliseconds.

The launcher talks to its zygote over a Unix socket pair: JSON requests, with
the child's stdout/stderr passed as file descriptors (SCM_RIGHTS); the zygote
answers each with the child's pid and later reports its exit status (Popen's
convention: ``-N`` for signal N). :class:`ForkedProcess` offers the part of
:class:`subprocess.Popen` that :class:`paramserver.workers.launch.cluster.LocalCluster` uses.

Safety: the zygote is single-threaded when it forks (one intra-op thread,
``OMP_NUM_THREADS=1``), has not initialized CUDA (both checked before each
fork: otherwise it refuses, and the launcher falls back to cold starts) and
creates no ZeroMQ context, so children start as clean as a fresh interpreter
and may use a GPU.
When the launcher goes away (even SIGKILLed) the socket closes and the zygote
stops its children (SIGTERM, then SIGKILL) and exits; children also die if
the zygote does (PR_SET_PDEATHSIG). ``PARAMSERVER_SPAWN=exec`` turns all of
this off (one ``python -m`` per process, as before).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import msgspec

from paramserver.errors import ParamServerError

__all__ = ["ForkedProcess", "Zygote", "ZygoteError", "fork_enabled", "zygote_for", "zygote_pids"]

log = logging.getLogger(__name__)

#: imported once by the zygote: what servers and workers spend their start-up on.
#: Not the entry modules themselves: runpy runs those as __main__, fresh.
PRELOAD = (
    "numpy", "torch", "torch.optim", "torch._dynamo", "zmq", "msgpack", "safetensors.torch",
    "paramserver.core.shard", "paramserver.wire.transport", "paramserver.observe.recorder",
    "paramserver.persist.checkpoint",
    "paramserver.workers.client", "paramserver.workers.tasks",
)
_PR_SET_PDEATHSIG = 1
_START_DIR = os.getcwd()  # what `python -m paramserver.workers.launch.zygote` put first on sys.path
_GRACE = 5.0  # seconds children get between SIGTERM and SIGKILL when the launcher is gone


def fork_enabled() -> bool:
    """Fork from a zygote unless PARAMSERVER_SPAWN=exec (or the platform cannot)."""
    return (os.environ.get("PARAMSERVER_SPAWN", "fork") != "exec"
            and sys.platform.startswith("linux") and hasattr(socket, "send_fds"))


# ---------------------------------------------------------------------- launcher side


class ZygoteError(ParamServerError, RuntimeError):
    """The zygote cannot fork this process (it died, or is not single-threaded)."""


@dataclass(frozen=True)
class SpawnRequest:
    """What the launcher asks the zygote to fork: ``python -m module *args``."""

    module: str
    args: tuple[str, ...]
    env: dict[str, str]
    cwd: str

    def encode(self) -> bytes:
        return msgspec.json.encode(self) + b"\n"


@dataclass(frozen=True)
class ZygoteNote:
    """What the zygote says: the pid of a child it started, a child's exit (pid and
    exit code), or why it could not start one."""

    pid: int | None = None
    exit: int | None = None
    error: str | None = None

    def encode(self) -> bytes:
        fields = {"pid": self.pid, "exit": self.exit, "error": self.error}
        return msgspec.json.encode({k: v for k, v in fields.items() if v is not None}) + b"\n"


def _request(line: bytes) -> SpawnRequest | None:
    try:
        return msgspec.json.decode(line, type=SpawnRequest)
    except msgspec.DecodeError:  # a launcher of another version, say
        return None


class ForkedProcess:
    """A child of the zygote, seen from the launcher like a :class:`subprocess.Popen`."""

    def __init__(self, pid: int, zygote: Zygote, stdout: BinaryIO | None) -> None:
        self.pid = pid
        self.stdout = stdout  # the read end of a pipe, when the child's stdout is one
        self.returncode: int | None = None
        self._zygote = zygote
        self._done = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """One preloaded zygote process and the children it forked for this launcher."""

    def __init__(self, env: Mapping[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.env = dict(env)
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "paramserver.workers.launch.zygote", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], env=self.env,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        self._sock = ours
        self._lock = threading.Lock()  # one request at a time: its answer is the next pid
        self._pids: dict[int, ForkedProcess] = {}
        self._early: dict[int, int] = {}  # exits reported before their pid was claimed
        self._answers: list[ZygoteNote] = []
        self._answered = threading.Condition()
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    @property
    def idle(self) -> bool:
        """No child of this zygote is running."""
        with self._answered:
            return not self._pids

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None and self._reader.is_alive()

    def spawn(self, module: str, args: Sequence[str], *, env: Mapping[str, str],
              stdout: int, stderr: int, stdout_pipe: BinaryIO | None = None,
              timeout: float = 120.0) -> ForkedProcess:
        """Fork ``python -m module *args`` with these stdout/stderr descriptors."""
        request = SpawnRequest(module, tuple(args), dict(env), os.getcwd())
        with self._lock:
            socket.send_fds(self._sock, [request.encode()], [stdout, stderr])
            answer = self._next_answer(timeout)
            if answer.error is not None or answer.pid is None:
                raise ZygoteError(f"the zygote could not start {module}: {answer.error}")
            proc = ForkedProcess(answer.pid, self, stdout_pipe)
            with self._answered:
                self._pids[proc.pid] = proc
                if proc.pid in self._early:
                    proc._exited(self._early.pop(proc.pid))
        return proc

    def _next_answer(self, timeout: float) -> ZygoteNote:
        deadline = time.monotonic() + timeout
        with self._answered:
            while not self._answers:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._reader.is_alive():
                    raise ZygoteError("the zygote did not answer (it died or is stuck); "
                                      "PARAMSERVER_SPAWN=exec starts processes without it")
                self._answered.wait(min(remaining, 0.5))
            return self._answers.pop(0)

    def _read(self) -> None:
        buf = b""
        try:
            while True:
                chunk = self._sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    self._dispatch(msgspec.json.decode(line, type=ZygoteNote))
        except OSError:
            pass
        finally:  # the zygote is gone, and its children with it (PDEATHSIG)
            with self._answered:
                for proc in self._pids.values():
                    if proc.returncode is None:
                        proc._exited(-signal.SIGKILL)
                self._answered.notify_all()

    def _dispatch(self, msg: ZygoteNote) -> None:
        with self._answered:
            if msg.exit is not None and msg.pid is not None:
                pid, code = msg.pid, msg.exit
                proc = self._pids.pop(pid, None)
                if proc is None:
                    self._early[pid] = code
                else:
                    proc._exited(code)
            else:
                self._answers.append(msg)
                self._answered.notify_all()

    def close(self, timeout: float = 10.0) -> None:
        """Close the socket: the zygote stops any children left, then exits."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


#: prefixes of the environment variables that can change what importing torch & co. does
_IMPORT_VARS = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "CUDA_", "TORCH", "LD_", "PATH")

_zygotes: dict[tuple[tuple[str, str], ...], Zygote] = {}
_zygotes_lock = threading.Lock()


def zygote_for(env: Mapping[str, str]) -> Zygote:
    """This process's zygote for children with environment ``env`` (started on first use).

    Keyed by the variables that shape what the zygote imported (PYTHONPATH,
    thread counts, CUDA and torch settings); each child still gets ``env``
    whole, so the rest (PYTEST_CURRENT_TEST, a run's own variables) may differ.
    """
    key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(_IMPORT_VARS)))
    with _zygotes_lock:
        zygote = _zygotes.get(key)
        if zygote is None or not zygote.alive:
            for other in [k for k, z in _zygotes.items() if k != key and z.idle]:
                _zygotes.pop(other).close()  # one idle zygote holds ~300 MB
            zygote = _zygotes[key] = Zygote(env)
        return zygote


def zygote_pids() -> set[int]:
    """The pids of this process's live zygotes (a test harness tells them from leftovers)."""
    with _zygotes_lock:
        return {z.popen.pid for z in _zygotes.values() if z.alive}


def _close_all() -> None:
    with _zygotes_lock:
        for zygote in _zygotes.values():
            zygote.close()
        _zygotes.clear()


import atexit  # noqa: E402  (registered here, next to what it closes)

atexit.register(_close_all)


# ---------------------------------------------------------------------- zygote side


def _cuda_initialized() -> bool:
    """Whether something the zygote imported initialized CUDA (forked children then
    cannot use it); never initializes it itself."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


def _set_pdeathsig(sig: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def _run_child(sock: socket.socket, wake: tuple[int, int], request: SpawnRequest,
               fds: list[int]) -> None:
    """In the forked child: become ``python -m module args`` and never return."""
    code = 1
    try:
        _set_pdeathsig(signal.SIGKILL)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sock.close()
        for fd in wake:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in {devnull, *fds}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request.env)
        os.chdir(request.cwd)
        # as `python -m` would: the working directory first on sys.path, files that
        # appeared since the zygote started visible
        if sys.path and sys.path[0] == _START_DIR:
            sys.path[0] = request.cwd
        importlib.invalidate_caches()
        # a fresh interpreter seeds numpy's global generator from the OS; a fork would
        # otherwise give every child the zygote's (Python's random reseeds by itself)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()
        module = request.module
        sys.argv = [module, *request.args]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            code = 128 + signal.SIGINT
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        with contextlib.suppress(Exception):
            _exit_as_python_would()
        os._exit(code)


def _exit_as_python_would() -> None:
    """What an interpreter's exit does that ``os._exit`` skips: atexit handlers,
    flushed output, and a terminated ZeroMQ context, which sends what closed
    sockets still queue within their linger (a server's last reply)."""
    import atexit as _atexit

    _atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    zmq = sys.modules.get("zmq")
    if zmq is not None:
        zmq.Context.instance().destroy(linger=1000)


def _serve(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    for name in PRELOAD:
        importlib.import_module(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the children and the launcher
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through wake_w
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    children: set[int] = set()
    buf, pending = b"", []
    open_ = True

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                return
            if pid == 0:
                return
            children.discard(pid)
            with contextlib.suppress(OSError):
                sock.sendall(ZygoteNote(pid=pid, exit=os.waitstatus_to_exitcode(status)).encode())

    def answer(msg: ZygoteNote) -> None:
        sock.sendall(msg.encode())

    while open_:
        for key, _ in sel.select(timeout=1.0):
            if key.fileobj == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                continue
            try:
                data, fds, _flags, _addr = socket.recv_fds(sock, 65536, 16)
            except OSError:
                data, fds = b"", []
            pending += fds
            if not data:
                open_ = False
                break
            buf += data
            while b"\n" in buf:
                line, _, buf = buf.partition(b"\n")
                fds, pending = pending[:2], pending[2:]
                if len(fds) != 2:
                    answer(ZygoteNote(error="expected stdout and stderr descriptors"))
                elif (request := _request(line)) is None:
                    answer(ZygoteNote(error=f"cannot read the request {line[:200]!r}"))
                elif len(os.listdir("/proc/self/task")) != 1:
                    answer(ZygoteNote(error="the zygote is not single-threaded; cannot fork "
                                            "safely"))
                elif _cuda_initialized():
                    answer(ZygoteNote(error="CUDA is initialized in the zygote; a forked "
                                            "child could not use it"))
                else:
                    pid = os.fork()
                    if pid == 0:
                        _run_child(sock, (wake_r, wake_w), request, fds)
                    children.add(pid)
                    answer(ZygoteNote(pid=pid))
                for fd in fds:
                    os.close(fd)
        reap()
    sel.unregister(sock)
    for fd in pending:
        os.close(fd)
    # the launcher is gone: stop what it left running
    for pid in list(children):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + _GRACE
    while children and time.monotonic() < deadline:
        sel.select(timeout=deadline - time.monotonic())  # SIGCHLD wakes it
        with contextlib.suppress(BlockingIOError):
            os.read(wake_r, 4096)
        reap()
    for pid in list(children):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    reap()


if __name__ == "__main__":
    from paramserver.util.proctitle import set_title

    # its children rename themselves at once; the zygote itself says what it is
    set_title(f"zygote (launcher pid {os.getppid()})")
    _serve(int(sys.argv[1]))
