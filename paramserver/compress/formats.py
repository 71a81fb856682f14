"""The wire formats a compressed gradient slice travels in, written and read.

A compressor may write any of four formats; a shard reads only these, so what it
decodes is bounded here whatever compressor the worker ran. A slice ``key`` of
``n`` elements travels as one or more tensors named ``key#PART``:

===========  ======================================================  ==================
format       tensors                                                 bytes (n, k kept)
===========  ======================================================  ==================
dense        ``key`` (a float dtype; no suffix: today's push)        n x itemsize
int8         ``#q`` int8 values (as uint8 bytes), ``#s`` float32     n + 4
             scale: value = q * scale
sparse       ``#v`` k values, ``#o`` k uint16 offsets within their   k x (itemsize + 2)
             block of :data:`BLOCK` elements (as uint8 bytes),       + 4 ceil(n / BLOCK)
             ``#c`` int32 count per block; offsets strictly
             increasing in a block (sorted, no duplicates)
sign         ``#b`` n bits, packed 8 per byte (1: +), ``#s`` float32  ceil(n / 8) + 4
             scale: value = +-scale
===========  ======================================================  ==================

Sixteen-bit offsets with a count per block make top-k at 1 % of float32 values
about 66x smaller than the dense slice (6 bytes a kept value, 4 per 65,536
elements), where 32-bit indices would cap it at 50x. Integers travel as uint8 bytes
because the wire's frames carry only a few integer dtypes (paramserver/util/dtypes.py),
and in the machine's byte order, as every tensor frame does.

:func:`decode` trusts nothing: the set of parts names the format, each part's dtype
and length must be the one ``n`` implies, offsets must be in range, sorted and
distinct, counts non-negative and summing to the values, scales finite and >= 0.
A violation raises :class:`~paramserver.errors.ProtocolError` (``bad_tensor``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from paramserver.errors import ErrorCode, ProtocolError

__all__ = ["BLOCK", "FORMATS", "SEP", "add_into", "decode", "dense", "int8", "nbytes", "residual",
           "sign", "sparse"]

#: a key's parts are named ``key + SEP + part``
SEP = "#"
#: elements per block of the sparse format: an offset within one fits 16 bits
BLOCK = 1 << 16
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: format -> the parts its tensors are named by ("" is the key itself)
FORMATS: dict[str, frozenset[str]] = {
    "dense": frozenset({""}),
    "int8": frozenset({"q", "s"}),
    "sparse": frozenset({"v", "o", "c"}),
    "sign": frozenset({"b", "s"}),
}
_BY_PARTS = {parts: name for name, parts in FORMATS.items()}
Parts = dict[str, torch.Tensor]


# ---------------------------------------------------------------------- writing

def _scale(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32)


def dense(values: torch.Tensor) -> Parts:
    """The slice as it is (any float dtype: a 16-bit one narrows it)."""
    return {"": values.reshape(-1)}


def int8(q: torch.Tensor, scale: float) -> Parts:
    """Values ``q * scale``, ``q`` an int8 tensor of the slice's length."""
    if q.dtype != torch.int8:
        raise TypeError(f"int8 format: q must be int8, got {q.dtype}")
    return {"q": q.reshape(-1).contiguous().view(torch.uint8), "s": _scale(scale)}


def sparse(indices: torch.Tensor, values: torch.Tensor, n: int) -> Parts:
    """``values`` at ``indices`` (sorted, distinct, in [0, n)); zero elsewhere."""
    idx = indices.reshape(-1).to(torch.int64)
    blocks = max(1, math.ceil(n / BLOCK))
    counts = torch.bincount(idx // BLOCK, minlength=blocks).to(torch.int32)
    # (int64 -> int16 keeps the low 16 bits: offsets 32768 .. 65535 wrap, read back as uint16)
    offsets = (idx % BLOCK).to(torch.int16).contiguous().view(torch.uint8)
    return {"v": values.reshape(-1).contiguous(), "o": offsets, "c": counts}


def sign(positive: torch.Tensor, scale: float) -> Parts:
    """Values ``+scale`` where ``positive``, ``-scale`` elsewhere."""
    bits = positive.reshape(-1).to(torch.uint8)
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    rows = bits.reshape(-1, 8)
    packed = rows[:, 0].clone()
    for i in range(1, 8):  # (eight strided ORs: a third of a shift-and-sum's time)
        packed |= rows[:, i] << i
    return {"b": packed, "s": _scale(scale)}


_SHIFTS = torch.arange(8, dtype=torch.uint8)


def nbytes(parts: Mapping[str, torch.Tensor]) -> int:
    """The bytes ``parts`` take in frames (what a push of them sends)."""
    return sum(t.numel() * t.element_size() for t in parts.values())


# ---------------------------------------------------------------------- reading

def _bad(key: str, what: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_TENSOR, f"compressed slice {key!r}: {what}")


def _part(parts: Mapping[str, torch.Tensor], key: str, name: str, dtype: torch.dtype | None,
          numel: int) -> torch.Tensor:
    t = parts[name]
    if dtype is not None and t.dtype != dtype:
        raise _bad(key, f"part {name!r} must be {str(dtype)[6:]}, got {str(t.dtype)[6:]}")
    if t.dim() != 1 or t.numel() != numel:
        raise _bad(key, f"part {name!r} must hold {numel} elements, got shape "
                        f"{tuple(t.shape)}")
    return t


def _scale_of(parts: Mapping[str, torch.Tensor], key: str) -> float:
    scale = float(_part(parts, key, "s", torch.float32, 1)[0])
    if not math.isfinite(scale) or scale < 0:
        raise _bad(key, f"scale must be finite and >= 0, got {scale}")
    return scale


def format_of(key: str, parts: Mapping[str, torch.Tensor]) -> str:
    """The format ``parts`` are in; refused unless their names are exactly one format's."""
    found = _BY_PARTS.get(frozenset(parts))
    if found is None:
        got = ", ".join(sorted(f"{SEP}{p}" if p else "(none)" for p in parts))
        raise _bad(key, f"parts {got} are no format's (dense: the key alone; int8: #q #s; "
                        "sparse: #v #o #c; sign: #b #s)")
    return found


def decode(key: str, parts: Mapping[str, torch.Tensor], n: int,
           dtype: torch.dtype) -> torch.Tensor:
    """The dense slice of ``n`` elements in ``dtype`` that ``parts`` encode, every bound
    checked first (nothing of ``n`` is allocated for a message that fails them)."""
    fmt = format_of(key, parts)
    if fmt == "sparse":
        idx, values = _sparse(key, parts, n)
        out = torch.zeros(n, dtype=dtype)
        out[idx] = values.to(dtype)
        return out
    return _whole(key, fmt, parts, n, dtype)


def _whole(key: str, fmt: str, parts: Mapping[str, torch.Tensor], n: int,
           dtype: torch.dtype) -> torch.Tensor:
    """A dense, int8 or sign slice decoded (a new tensor but for a dense one in
    ``dtype``, which is its part itself)."""
    if fmt == "dense":
        t = parts[""]
        if t.dtype not in _FLOATS:
            raise _bad(key, f"a dense gradient must be a float dtype, got {str(t.dtype)[6:]}")
        _part(parts, key, "", None, n)
        return t.to(dtype)
    if fmt == "int8":
        scale = _scale_of(parts, key)
        q = _part(parts, key, "q", torch.uint8, n).view(torch.int8)
        return q.to(dtype).mul_(scale)  # (in place: the same product as q * scale)
    scale = _scale_of(parts, key)
    packed = _part(parts, key, "b", torch.uint8, math.ceil(n / 8))
    bits = ((packed.unsqueeze(1) >> _SHIFTS) & 1).reshape(-1)[:n]
    return bits.to(dtype).mul_(2).sub_(1).mul_(scale)  # (bit * 2 - 1) * scale, in place


def add_into(key: str, parts: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
    """``out += decode(key, parts, out.numel(), out.dtype)``, to the bit, bounds checked
    first (``out`` untouched for parts that fail them). A sparse slice is added at its
    indices alone: elsewhere the dense addition adds +0.0, which changes nothing but
    a -0.0 (to +0.0), and so does this."""
    fmt = format_of(key, parts)
    if fmt != "sparse":
        out.add_(_whole(key, fmt, parts, out.numel(), out.dtype))
        return
    idx, values = _sparse(key, parts, out.numel())
    at = out[idx].add_(values.to(out.dtype))
    out.add_(0.0)  # (-0.0 + 0.0 is +0.0, as the dense addition has it)
    out[idx] = at


def residual(key: str, parts: Mapping[str, torch.Tensor], x: torch.Tensor,
             dtype: torch.dtype, reuse: bool = False) -> torch.Tensor:
    """``x.to(dtype) - decode(key, parts, x.numel(), dtype)``, to the bit: what an
    encoding left out of ``x``. ``reuse``: ``x`` (of ``dtype``, no part a view of it)
    may be written over and returned. A sparse slice is subtracted at its indices
    alone (elsewhere ``x - 0.0`` is ``x``, a -0.0 included)."""
    fmt = format_of(key, parts)
    if fmt == "sparse":
        idx, values = _sparse(key, parts, x.numel())
        left = x if reuse and x.dtype == dtype else x.to(dtype, copy=True)
        left[idx] = left[idx].sub_(values.to(dtype))
        return left
    kept = _whole(key, fmt, parts, x.numel(), dtype)
    if fmt == "dense":  # (kept may be the part itself, or x)
        return x.to(dtype) - kept
    return torch.sub(x.to(dtype), kept, out=kept)


def _sparse(key: str, parts: Mapping[str, torch.Tensor],
            n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse slice's indices (int64, ascending) and values, every bound checked."""
    values = parts["v"]
    if values.dtype not in _FLOATS or values.dim() != 1:
        raise _bad(key, f"part 'v' must be a 1-D float tensor, got {str(values.dtype)[6:]} "
                        f"of shape {tuple(values.shape)}")
    k = values.numel()
    if k > n:
        raise _bad(key, f"{k} values for a slice of {n} elements")
    blocks = max(1, math.ceil(n / BLOCK))
    counts = _part(parts, key, "c", torch.int32, blocks).to(torch.int64)
    if bool((counts < 0).any()) or int(counts.sum()) != k:
        raise _bad(key, f"block counts must be >= 0 and sum to the {k} values")
    offsets = _part(parts, key, "o", torch.uint8, 2 * k).view(torch.int16).to(torch.int64)
    offsets &= 0xFFFF
    idx = torch.repeat_interleave(torch.arange(blocks, dtype=torch.int64) * BLOCK, counts)
    idx += offsets
    if k and (int(idx[-1]) >= n or bool((idx[1:] <= idx[:-1]).any())):
        raise _bad(key, f"indices must be sorted, distinct and in [0, {n})")
    return idx, values
