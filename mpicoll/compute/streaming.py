"""Host reductions that write their result around the caches (non-temporal stores).

A plain store to memory that is not in cache first reads the line it lands in
("write-allocate"), so ``out = a + b`` over buffers larger than the caches
moves four bytes through memory for every three it needs.  A non-temporal
store writes whole lines straight to memory.  That pays only where the result
is not read again soon: the last step of the ring's reduce-scatter on a large
buffer, whose chunks are next read by the allgather, after the whole buffer
has gone through the caches.  Measured (docs/benchmarks.md): 64 MiB float32
ring allreduce on 2 ranks, 10-12% faster; at 4 MiB, where the result is still
in cache when it is read, 10% slower, hence the callers' size threshold.

numpy has no non-temporal stores, so the loop is compiled with Numba, and the
store itself is LLVM IR with ``!nontemporal`` metadata, one 64-byte vector at
a time (AVX-512's width; LLVM splits it where vectors are narrower).  Sums and
products on float32/64 and int32/64 only (:data:`LOOPS`); the caller reduces
as before for anything else, or where Numba does not load
(:func:`mpicoll.compute.streaming_reducer`).  Copies of any bytes:
:func:`stream_copy` (:func:`mpicoll.compute.copy_around_caches`).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = ["LOOPS", "DTYPES"]

DTYPES = tuple(np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64))


def _stored_combined(combine, width: int):
    """The code of an intrinsic ``(*outs, a, b, i)``: every ``out[i:i+L] = combine(a[i:i+L], b[i:i+L])``, the
    L elements of ``width`` bytes computed once and stored in one non-temporal store per output, each
    ``out + i`` aligned to ``width`` (``a`` and ``b`` need not be)."""
    def codegen(context, builder, signature, args):
        dtype = signature.args[0].dtype
        size = dtype.bitwidth // 8
        vector = ir.VectorType(context.get_data_type(dtype), width // size)
        *targets, left, right = (
            builder.bitcast(builder.gep(context.make_array(kind)(context, builder, array).data, [args[-1]]),
                            vector.as_pointer())
            for kind, array in zip(signature.args[:-1], args[:-1]))
        value = combine(builder, isinstance(dtype, types.Float),
                        builder.load(left, align=size), builder.load(right, align=size))
        hint = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        for target in targets:
            builder.store(value, target, align=width).set_metadata("nontemporal", hint)
        return context.get_dummy_value()
    return codegen


def _vector_store(combine):
    """An intrinsic: out[i:i+L] = combine(a[i:i+L], b[i:i+L]) in one 64-byte non-temporal store.

    ``out + i`` must be 64-byte aligned; ``a`` and ``b`` need not be.
    """
    @intrinsic
    def store(typingctx, out, a, b, i):
        return types.void(out, a, b, i), _stored_combined(combine, 64)
    return store


def _vector_store_twice(combine):
    """An intrinsic: out[i:i+L] = out2[i:i+L] = combine(a[i:i+L], b[i:i+L]), in two 16-byte non-temporal
    stores.  ``out + i`` and ``out2 + i`` must be 16-byte aligned (16 bytes, not 64: two buffers seldom share
    their place in a cache line, numpy's large arrays begin 16 bytes into one)."""
    @intrinsic
    def store(typingctx, out, out2, a, b, i):
        return types.void(out, out2, a, b, i), _stored_combined(combine, 16)
    return store


@intrinsic
def _drain(typingctx):
    """A full fence: the streamed lines reach memory before anyone is told they are there."""
    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.void(), codegen


_add = _vector_store(lambda b, real, x, y: b.fadd(x, y) if real else b.add(x, y))
_multiply = _vector_store(lambda b, real, x, y: b.fmul(x, y) if real else b.mul(x, y))


# One loop per op, written out: Numba caches a compiled function by its name, so no factory.
@njit(nogil=True, cache=True)
def stream_sum(out, a, b):
    """out = a + b, stored around the caches; out may be a or b."""
    n, lanes, i = out.size, 64 // out.itemsize, 0
    while i < n and (out.ctypes.data + i * out.itemsize) % 64:
        out[i] = a[i] + b[i]
        i += 1
    while i + lanes <= n:
        _add(out, a, b, i)
        i += lanes
    while i < n:
        out[i] = a[i] + b[i]
        i += 1
    _drain()


@njit(nogil=True, cache=True)
def stream_prod(out, a, b):
    """out = a * b, stored around the caches; out may be a or b."""
    n, lanes, i = out.size, 64 // out.itemsize, 0
    while i < n and (out.ctypes.data + i * out.itemsize) % 64:
        out[i] = a[i] * b[i]
        i += 1
    while i + lanes <= n:
        _multiply(out, a, b, i)
        i += lanes
    while i < n:
        out[i] = a[i] * b[i]
        i += 1
    _drain()


_first = _vector_store(lambda b, real, x, y: x)


@njit(nogil=True, cache=True)
def stream_copy(out, a):
    """out[...] = a, stored around the caches (bytes: callers pass uint8 views)."""
    n, lanes, i = out.size, 64 // out.itemsize, 0
    while i < n and (out.ctypes.data + i * out.itemsize) % 64:
        out[i] = a[i]
        i += 1
    while i + lanes <= n:
        _first(out, a, a, i)
        i += lanes
    while i < n:
        out[i] = a[i]
        i += 1
    _drain()


_add_twice = _vector_store_twice(lambda b, real, x, y: b.fadd(x, y) if real else b.add(x, y))
_multiply_twice = _vector_store_twice(lambda b, real, x, y: b.fmul(x, y) if real else b.mul(x, y))


@njit(nogil=True, cache=True)
def stream_sum_twice(out, out2, a, b):
    """out = out2 = a + b, stored around the caches; out and out2 lie the same distance from 16-byte
    boundaries (the caller checks); either may be a or b."""
    n, lanes, i = out.size, 16 // out.itemsize, 0
    while i < n and (out.ctypes.data + i * out.itemsize) % 16:
        out2[i] = out[i] = a[i] + b[i]
        i += 1
    while i + lanes <= n:
        _add_twice(out, out2, a, b, i)
        i += lanes
    while i < n:
        out2[i] = out[i] = a[i] + b[i]
        i += 1
    _drain()


@njit(nogil=True, cache=True)
def stream_prod_twice(out, out2, a, b):
    """out = out2 = a * b, as :func:`stream_sum_twice`."""
    n, lanes, i = out.size, 16 // out.itemsize, 0
    while i < n and (out.ctypes.data + i * out.itemsize) % 16:
        out2[i] = out[i] = a[i] * b[i]
        i += 1
    while i + lanes <= n:
        _multiply_twice(out, out2, a, b, i)
        i += lanes
    while i < n:
        out2[i] = out[i] = a[i] * b[i]
        i += 1
    _drain()


LOOPS = {"sum": stream_sum, "prod": stream_prod}
TWICE = {"sum": stream_sum_twice, "prod": stream_prod_twice}
