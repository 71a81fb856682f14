"""Gradient compression for the push: codecs by name, the wire formats they write,
and the worker's error feedback.

A compressor (:mod:`.base`) turns a flat gradient slice into one of the few wire
formats of :mod:`.formats` (dense, int8 with a scale, sparse values at 16-bit
offsets, packed signs with a scale). The shard decodes only those formats, with
every bound checked (paramserver/wire/compressed.py), so a compressor of one's own
(``module:Class`` or the entry point group ``paramserver.compressors``) runs on the
workers alone and no shard ever runs a peer's code. :mod:`.feedback` keeps what a
push left out and adds it to the next (error feedback). Everything here is pure:
tensors in, tensors out, no I/O.
"""

from paramserver.compress.base import Compressor
from paramserver.compress.feedback import Encoder
from paramserver.compress.registry import (
    COMPRESSORS,
    ENTRY_POINT_GROUP,
    Compression,
    available_compressors,
    compressor_parameters,
    parse_compression,
    register_compressor,
    resolve_compressor,
    with_wire_dtype,
)

__all__ = [
    "COMPRESSORS",
    "ENTRY_POINT_GROUP",
    "Compression",
    "Compressor",
    "Encoder",
    "available_compressors",
    "compressor_parameters",
    "parse_compression",
    "register_compressor",
    "resolve_compressor",
    "with_wire_dtype",
]
