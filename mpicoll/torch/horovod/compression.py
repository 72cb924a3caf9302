"""Horovod's gradient compression objects: ``Compression.none`` and ``Compression.fp16``, and ``Compression.bf16``
(mpicoll's: bfloat16 keeps float32's range, where float16 overflows past 65504).

The compressed tensor is reduced as it is: mpicoll adds 16-bit floats in float32 and rounds each partial sum
once (:mod:`mpicoll.collectives.compression`); float16 by its bits, bfloat16 as ml_dtypes' words."""

from __future__ import annotations

import torch

from ...collectives.compression import Compression as Rounding
from ...collectives.powersgd import PowerSGD

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression", "is_mpicolls"]


class Compressor:
    """Turns a tensor into what goes on the wire (``compress``: (tensor, context)) and back (``decompress``)."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """The tensor as it is."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 (half the bytes) and come back in their own dtype; other
    tensors as they are."""

    wire = torch.float16

    @classmethod
    def compress(cls, tensor):
        dtype = tensor.dtype
        return (tensor.type(cls.wire) if dtype.is_floating_point else tensor), dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.type(ctx) if ctx is not None and ctx.is_floating_point else tensor


class BF16Compressor(FP16Compressor):
    """Floating-point tensors travel as bfloat16 (half the bytes, float32's range) and come back in their own
    dtype; other tensors as they are."""

    wire = torch.bfloat16


class Compression:
    """``Compression.none`` and ``Compression.fp16``, as Horovod names them, and ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def is_mpicolls(compression) -> bool:
    """Whether ``compression`` is one of mpicoll's (a :class:`mpicoll.Compression` or :class:`mpicoll.PowerSGD`),
    which keep a state per gradient: Horovod's ``DistributedOptimizer`` takes them beside ``Compression.*``."""
    return isinstance(compression, (Rounding, PowerSGD))
