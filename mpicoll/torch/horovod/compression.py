"""Horovod's gradient compression objects: ``Compression.none`` and ``Compression.fp16``."""

from __future__ import annotations

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


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

    @staticmethod
    def compress(tensor):
        dtype = tensor.dtype
        return (tensor.type(torch.float16) if dtype.is_floating_point else tensor), dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.type(ctx) if ctx is not None and ctx.is_floating_point else tensor


class Compression:
    """``Compression.none`` and ``Compression.fp16``, as Horovod names them."""

    none = NoneCompressor
    fp16 = FP16Compressor
