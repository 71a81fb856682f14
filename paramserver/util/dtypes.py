"""The one table of tensor dtypes the project knows, by name, and its views.

Every other module takes its dtypes from here: parameters in a shard plan
(:data:`PARAM_DTYPES`), what a shard trains (:data:`FLOAT_DTYPES`), what a
tensor frame may carry (:data:`WIRE_DTYPES`), how gradients may travel
(:data:`GRAD_WIRE_DTYPES`) and what a built-in task computes in
(:data:`TASK_DTYPES`). Names are torch's without the ``torch.`` prefix.
"""

from __future__ import annotations

import ctypes

import torch

from paramserver.errors import ConfigError

__all__ = [
    "DTYPES",
    "FLOAT_DTYPES",
    "GRAD_WIRE_DTYPES",
    "NARROW_DTYPES",
    "PARAM_DTYPES",
    "TASK_DTYPES",
    "WIRE_DTYPES",
    "copy_bytes",
    "copy_to_address",
    "dtype_name",
    "to_dtype",
]

#: every dtype the project names (a parameter of a shard plan may have any of them)
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def _view(*names: str) -> dict[str, torch.dtype]:
    return {name: DTYPES[name] for name in names}


#: dtypes a parameter in a shard plan may have
PARAM_DTYPES: dict[str, torch.dtype] = DTYPES
#: dtypes parameters and gradients a shard trains may have
FLOAT_DTYPES: dict[str, torch.dtype] = _view("float16", "bfloat16", "float32", "float64")
#: dtypes a tensor frame may carry on the wire
WIRE_DTYPES: dict[str, torch.dtype] = {**FLOAT_DTYPES, **_view("int32", "int64", "uint8")}
#: 16-bit dtypes a worker may send its gradients in (``wire_dtype``)
GRAD_WIRE_DTYPES: dict[str, torch.dtype] = _view("bfloat16", "float16")
#: the same, as the dtypes a shard widens a gradient from
NARROW_DTYPES: tuple[torch.dtype, ...] = tuple(GRAD_WIRE_DTYPES.values())
#: dtypes the built-in tasks compute in
TASK_DTYPES: dict[str, torch.dtype] = _view("float32", "float64")

_NAMES = {v: k for k, v in DTYPES.items()}


def to_dtype(name: str, allowed: dict[str, torch.dtype] = WIRE_DTYPES) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; a name outside ``allowed`` raises ConfigError."""
    try:
        return allowed[name]
    except (KeyError, TypeError):
        raise ConfigError(f"dtype {name!r} not allowed; allowed: {', '.join(allowed)}") from None


def dtype_name(dtype: torch.dtype, allowed: dict[str, torch.dtype] = DTYPES) -> str:
    """``torch.float32`` -> ``"float32"``; a dtype outside ``allowed`` raises ConfigError."""
    name = _NAMES.get(dtype)
    if name is None or name not in allowed:
        raise ConfigError(f"dtype {dtype} is not supported; allowed: {', '.join(allowed)}")
    return name


def copy_to_address(address: int, src: torch.Tensor) -> None:
    """The bytes of ``src`` (contiguous, on the CPU) to ``address``: one ``memmove``
    on the calling thread, which releases the GIL (see :func:`copy_bytes`)."""
    if src.numel():
        ctypes.memmove(address, src.data_ptr(), src.numel() * src.element_size())


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for the transport's copies, on the calling thread alone.

    Two contiguous CPU tensors of one dtype and size are copied with one
    ``memmove`` (which releases the GIL). torch would split a large copy over its
    intra-op threads, and on a host shared with a shard those threads then spin
    in the shard's time (measured: a 100 MiB push + pull beside a same-host shard
    took 405-450 ms with torch's 2 threads on 2 cores, 99 ms with one). Anything
    else (another device, a dtype to convert, a strided view) goes to ``copy_``.
    """
    if (dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype
            and dst.numel() == src.numel() and dst.is_contiguous() and src.is_contiguous()):
        copy_to_address(dst.data_ptr(), src)
        return
    dst.copy_(src.reshape(dst.shape) if src.shape != dst.shape and src.numel() == dst.numel()
              else src)
