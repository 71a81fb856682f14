"""A compressed push's tensors made dense, once, at the shard's door.

A PUSH with ``compressed`` carries each slice as the parts of one wire format
(paramserver/compress/formats.py: ``key#q``, ``key#v`` ...). :func:`expand` groups the
parts by slice and decodes each against the slice the shard owns, checking every
bound before anything of the slice's size is allocated, so a hostile index list,
scale, count or length is refused (``bad_tensor``, ``unknown_key``), never trusted.
What comes out is an ordinary push: the staleness policy, DC-ASGD and the step see
the decompressed gradient, and nothing after this knows it was compressed.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from paramserver.compress.formats import SEP, decode
from paramserver.core.records import SliceSpec
from paramserver.errors import ErrorCode, ProtocolError
from paramserver.util.dtypes import DTYPES

__all__ = ["expand"]


def _group(tensors: Mapping[str, torch.Tensor], specs: Mapping[str, SliceSpec]
           ) -> dict[str, dict[str, torch.Tensor]]:
    """The tensors by slice key: ``{key: {part: tensor}}`` ("" the dense part)."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name in specs:  # a slice sent whole (a key may hold the separator itself)
            key, part = name, ""
        else:
            key, sep, part = name.rpartition(SEP)
            if not sep or key not in specs:
                raise ProtocolError(ErrorCode.UNKNOWN_KEY,
                                    f"PUSH: {name!r} is no part of a slice of this shard")
        groups.setdefault(key, {})[part] = t
    return groups


def expand(tensors: Mapping[str, torch.Tensor],
           specs: Mapping[str, SliceSpec]) -> dict[str, torch.Tensor]:
    """Each slice of a compressed push, dense, in its slice's dtype; ProtocolError for
    a part of no slice of ``specs``, or parts no format reads within its bounds."""
    out: dict[str, torch.Tensor] = {}
    for key, parts in _group(tensors, specs).items():
        spec = specs[key]
        out[key] = decode(key, parts, spec.numel, DTYPES[spec.dtype])
    return out
