"""The tensor dtypes the project stores and sends, by wire name."""

from __future__ import annotations

import torch

__all__ = ["FLOAT_DTYPES", "NARROW_DTYPES", "WIRE_DTYPES", "dtype_name", "to_dtype"]

#: dtypes parameters and gradients may have
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
#: wire dtypes a float32 gradient may travel in
NARROW_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
#: dtypes a tensor frame may carry on the wire
WIRE_DTYPES: dict[str, torch.dtype] = {
    **FLOAT_DTYPES,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}
_NAMES = {v: k for k, v in WIRE_DTYPES.items()}


def to_dtype(name: str) -> torch.dtype:
    try:
        return WIRE_DTYPES[name]
    except KeyError:
        raise KeyError(f"dtype {name!r} not allowed; allowed: {', '.join(WIRE_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise KeyError(f"dtype {dtype} not allowed; allowed: {', '.join(WIRE_DTYPES)}") from None
