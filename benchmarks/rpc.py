"""torch.distributed.rpc used as a parameter server, the way PyTorch's tutorial does it.

The "batch-updating parameter server" of PyTorch's RPC tutorials: one server
process holds the weights and a torch.optim.SGD; each worker calls
``update_and_fetch`` with its gradient through ``rpc_sync``; the server adds
the gradient into ``.grad`` under a lock and returns a future that completes,
with the updated weights, once every worker of the round has reported
(``@rpc.functions.async_execution``). As in the tutorial, the worker uses the
returned tensor as its weights. Transport: TensorPipe, with its defaults.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed.rpc as rpc

from paramserver.util.jsontypes import JSONObject

from .common import integer, number, numbers, strings

__all__ = ["BatchUpdateParameterServer", "RPCSession"]

_SERVERS: dict[int, BatchUpdateParameterServer] = {}


class BatchUpdateParameterServer:
    """One flat float32 "model" of ``numel`` elements, updated once per round."""

    def __init__(self, numel: int, workers: int, lr: float) -> None:
        self.param = torch.zeros(numel)
        self.param.grad = torch.zeros(numel)
        self.optimizer = torch.optim.SGD([self.param], lr=lr)
        self.workers = workers
        self.count = 0
        self.lock = threading.Lock()
        self.future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch(numel: int, grad: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        self = _SERVERS[numel]
        with self.lock:
            self.count += 1
            assert self.param.grad is not None
            self.param.grad += grad
            fut = self.future
            if self.count >= self.workers:
                self.param.grad /= self.workers
                self.count = 0
                with torch.no_grad():
                    self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                fut.set_result(self.param.detach())
                self.future = torch.futures.Future()
        return fut


class RPCSession:
    """One process of the RPC world: rank 0 serves, ranks 1..N are workers.

    ``args``: rank, world, port, sizes (numel of every payload to come), lr,
    optionally transports / channels (TensorPipe's, e.g. ``["uv"]`` / ``["basic"]``).
    Opening blocks until every rank has joined.
    """

    def __init__(self, args: JSONObject) -> None:
        self.rank, world = integer(args, "rank"), integer(args, "world")
        if self.rank == 0:
            for numel in numbers(args, "sizes"):
                _SERVERS[int(numel)] = BatchUpdateParameterServer(int(numel), world - 1,
                                                                  number(args, "lr"))
        # TensorPipe's own choices, where given (None: its defaults)
        transports = strings(args, "transports") if args.get("transports") else None
        channels = strings(args, "channels") if args.get("channels") else None
        options = rpc.TensorPipeRpcBackendOptions(
            init_method=f"tcp://127.0.0.1:{integer(args, 'port')}", rpc_timeout=300,
            num_worker_threads=max(4, world), _transports=transports, _channels=channels,
        )
        name = "ps" if self.rank == 0 else f"worker{self.rank}"
        rpc.init_rpc(name, rank=self.rank, world_size=world, rpc_backend_options=options)
        self.grads: dict[int, torch.Tensor] = {}
        self.weights = torch.zeros(0)

    def measure(self, numel: int, iters: int) -> float:
        grad = self.grads.get(numel)
        if grad is None:
            self.grads = {numel: torch.full((numel,), 1e-3)}  # one payload alive at a time
            grad = self.grads[numel]
        t0 = time.perf_counter()
        for _ in range(iters):
            self.weights = rpc.rpc_sync(
                "ps", BatchUpdateParameterServer.update_and_fetch, args=(numel, grad)
            )
        return (time.perf_counter() - t0) / iters

    def close(self) -> JSONObject:
        rpc.shutdown(graceful=True)
        return {}
