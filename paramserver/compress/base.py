"""The compressor interface: a flat gradient slice in, one wire format's parts out."""

from __future__ import annotations

from typing import ClassVar

import torch

__all__ = ["Compressor", "Parts"]

#: a slice's encoding: part name -> tensor, in one of paramserver.compress.formats' formats
Parts = dict[str, torch.Tensor]


class Compressor:
    """Turns a flat gradient slice into the parts of one wire format.

    Subclass it, set ``name``, and write :meth:`compress` with the helpers of
    :mod:`paramserver.compress.formats` (``dense``, ``int8``, ``sparse``, ``sign``):
    the shard decodes those formats itself, so a compressor runs on workers only.
    Keyword arguments of ``__init__`` are its ``--compression NAME:key=value``
    parameters (annotated: values are converted by the annotation). ``ef``, error
    feedback, is every compressor's: on by default where ``biased``.
    """

    #: the name ``--compression`` takes (an entry point's name wins over it)
    name: ClassVar[str] = ""
    #: its expected output differs from its input: error feedback is on by default
    biased: ClassVar[bool] = True
    #: a 16-bit dtype the gradients simply travel in (bf16, fp16): without error
    #: feedback, the push narrows them on their device, as ``--wire-dtype`` does
    wire_dtype: ClassVar[str | None] = None

    def compress(self, flat: torch.Tensor, seed: int) -> Parts:
        """``flat`` (1-D, a float dtype) as one format's parts. ``seed``: fixed by the
        worker's seed, the slice and the push, for compressors that draw."""
        raise NotImplementedError

    def describe(self) -> str:
        """The spec that makes this compressor again (``NAME[:key=value,...]``)."""
        return self.name
