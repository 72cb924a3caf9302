"""Device (GPU) arrays in the collectives: MPI moves the bytes, the GPU does the reductions.

Accepted: CuPy arrays, Numba device arrays, and any other CUDA array through
``__cuda_array_interface__`` or DLPack (viewed as CuPy or Numba arrays, without
a copy).  Two ways to hand them to MPI:

- **CUDA-aware MPI**: device buffers go to MPI directly, after the stream that
  produced them is synchronised;
- **staged**: through page-locked (pinned) host buffers that are allocated once
  and reused, one copy each way.

Detection, in order: ``MPICOLL_CUDA_AWARE=1`` or ``0`` forces the mode; Open MPI's
``MPIX_Query_cuda_support()`` and MPICH's ``MPIX_GPU_query_support()`` (looked up in
the MPI library the process loaded; MPICH also needs ``MPIR_CVAR_ENABLE_GPU=1``);
otherwise staged.  ``mpicoll info`` prints the answer and why.

The reduction is the same everywhere: rank r receives chunk r of every rank's
buffer (a direct reduce-scatter, each rank sending and receiving (p-1)/p of the
buffer, as in the ring), folds the p contributions on the GPU in rank order
with :func:`mpicoll.compute.reduce` (so every rank gets the same bits and
non-commutative order is kept), and an allgather of the reduced chunks follows.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os

import numpy as np
from mpi4py import MPI

from . import compute
from .compute import as_device_array, is_device_array
from .algorithms.base import balanced_bounds, block_bounds
from .context import Context

__all__ = ["is_device_array", "as_device_array", "cuda_aware", "allreduce", "reduce_scatter_block",
           "allgather", "bcast"]

_TAG = 61
_DEVICE_OPS = {"SUM": "sum", "PROD": "prod", "MIN": "min", "MAX": "max"}


# -- is the MPI library CUDA-aware? -------------------------------------------------------

def _mpi_library() -> ctypes.CDLL | None:
    """The MPI shared library this process loaded (found in /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line and line.split()[-1].startswith("/")}
    except OSError:
        return None
    for path in sorted(paths, key=len):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def cuda_aware() -> tuple[bool, str]:
    """(whether device buffers can go to MPI directly, why we think so)."""
    forced = os.environ.get("MPICOLL_CUDA_AWARE", "").strip()
    if forced in ("0", "1"):
        return forced == "1", f"forced by MPICOLL_CUDA_AWARE={forced}"
    library = _mpi_library()
    if library is not None and hasattr(library, "MPIX_Query_cuda_support"):
        supported = bool(library.MPIX_Query_cuda_support())
        return supported, f"MPIX_Query_cuda_support() returned {int(supported)}"
    if library is not None and hasattr(library, "MPIX_GPU_query_support"):
        answer = ctypes.c_int(0)
        library.MPIX_GPU_query_support(0, ctypes.byref(answer))   # 0: MPIX_GPU_SUPPORT_CUDA
        enabled = os.environ.get("MPIR_CVAR_ENABLE_GPU", "0") not in ("0", "")
        supported = bool(answer.value) and enabled
        return supported, (f"MPIX_GPU_query_support(CUDA) returned {answer.value}; "
                           f"MPIR_CVAR_ENABLE_GPU={'1' if enabled else 'unset or 0'}")
    return False, "the MPI library offers no CUDA query: assuming not CUDA-aware"


# -- one library's arrays, uniformly ------------------------------------------------------

class _Arrays:
    """Allocation, host copies and synchronisation for CuPy or Numba device arrays."""

    def __init__(self, library: str):
        self.library = library        # a kernel backend name: "cupy" or "numba-cuda"
        if library == "cupy":
            self.cupy = importlib.import_module("cupy")
        else:
            from numba import cuda
            self.cuda = cuda

    def empty(self, count: int, dtype):
        return self.cupy.empty(count, dtype) if self.library == "cupy" else self.cuda.device_array(count, dtype)

    def pinned(self, count: int, dtype) -> np.ndarray:
        if self.library == "cupy":
            return importlib.import_module("cupyx").empty_pinned(count, dtype)
        return self.cuda.pinned_array(count, dtype)

    def to_host(self, device, host: np.ndarray) -> None:
        if device.size:
            device.get(out=host) if self.library == "cupy" else device.copy_to_host(host)

    def to_device(self, host: np.ndarray, device) -> None:
        if device.size:
            device.set(host) if self.library == "cupy" else device.copy_to_device(host)

    def copy(self, source, target) -> None:
        if target.size:
            if self.library == "cupy":
                target[...] = source
            else:
                target.copy_to_device(source)

    def synchronize(self) -> None:
        if self.library == "cupy":
            self.cupy.cuda.get_current_stream().synchronize()
        else:
            self.cuda.synchronize()


class _Buffers:
    """Grow-only pinned host buffers and device scratch, kept on the communicator's context."""

    def __init__(self, ctx: Context, arrays: _Arrays):
        self.arrays = arrays
        self.store = ctx.device_buffers

    def get(self, name: str, count: int, dtype, pinned: bool):
        dtype = np.dtype(dtype)
        key = (name, self.arrays.library, pinned)
        held = self.store.get(key)
        nbytes = max(count * dtype.itemsize, 1)
        if held is None or held.nbytes < nbytes:
            held = self.store[key] = (self.arrays.pinned if pinned else self.arrays.empty)(nbytes, np.uint8)
        return held[:count * dtype.itemsize].view(dtype)


# -- the collectives ----------------------------------------------------------------------

def _device_op(reduction) -> str:
    name = _DEVICE_OPS.get(reduction.name)
    if name is None:
        raise TypeError(f"device arrays are reduced on the GPU with SUM, PROD, MIN or MAX, not {reduction.name}; "
                        "pass host (numpy) arrays for other ops")
    return name


def _exchange_and_fold(ctx, arrays, buffers, source, bounds, op, staged) -> object:
    """Every rank's chunk ``rank`` of ``source`` folded in rank order; returns a device array."""
    p, r = ctx.size, ctx.rank
    mine = slice(bounds[r], bounds[r + 1])
    width = mine.stop - mine.start
    if staged:
        outgoing = buffers.get("out", source.size, source.dtype, pinned=True)
        arrays.to_host(source, outgoing)
        inbox = buffers.get("inbox", p * width, source.dtype, pinned=True)
    else:
        arrays.synchronize()            # MPI reads device memory the stream may still be writing
        outgoing = source
        inbox = buffers.get("inbox-device", p * width, source.dtype, pinned=False)
    others = [q for q in range(p) if q != r]
    received = [ctx.irecv(inbox[q * width:(q + 1) * width], q, _TAG) for q in others]
    sent = [ctx.isend(outgoing[bounds[q]:bounds[q + 1]], q, _TAG) for q in others]
    ctx.waitall(received + sent, others + others)
    if staged:
        contributions = buffers.get("contributions", p * width, source.dtype, pinned=False)
        arrays.to_device(inbox, contributions)
    else:
        contributions = inbox
    parts = [source[mine] if q == r else contributions[q * width:(q + 1) * width] for q in range(p)]
    result = buffers.get("result", width, source.dtype, pinned=False)
    compute.reduce(parts[0], parts[1], out=result, op=op)
    for q in range(2, p):
        compute.reduce(result, parts[q], out=result, op=op)
    return result


def _gather_into(ctx, arrays, buffers, chunk, target, bounds, staged) -> None:
    """Every rank's ``chunk`` into its place in ``target`` (a device array)."""
    p, r = ctx.size, ctx.rank
    others = [q for q in range(p) if q != r]
    if staged:
        host = buffers.get("gathered", target.size, target.dtype, pinned=True)
        arrays.to_host(chunk, host[bounds[r]:bounds[r + 1]])
    else:
        arrays.synchronize()
        arrays.copy(chunk, target[bounds[r]:bounds[r + 1]])
        arrays.synchronize()
        host = target
    received = [ctx.irecv(host[bounds[q]:bounds[q + 1]], q, _TAG + 1) for q in others]
    sent = [ctx.isend(host[bounds[r]:bounds[r + 1]], q, _TAG + 1) for q in others]
    ctx.waitall(received + sent, others + others)
    if staged:
        arrays.to_device(host, target)


def to_host(device_array, host: np.ndarray) -> None:
    """Copy any CUDA array (CuPy, Numba, or one they can view) into the host array ``host``."""
    library, array = as_device_array(device_array)
    _Arrays(library).to_host(array.reshape(-1), host.reshape(-1))


def from_host(host: np.ndarray, device_array) -> None:
    """Copy the host array ``host`` into any CUDA array of the same size."""
    library, array = as_device_array(device_array)
    _Arrays(library).to_device(np.ascontiguousarray(host).reshape(-1), array.reshape(-1))


def as_host(array) -> np.ndarray:
    """``array`` as a host array: numpy (or anything array-like) as it is, a CUDA array copied over."""
    if not is_device_array(array):
        return np.asarray(array)
    host = np.empty(array.shape, array.dtype)
    to_host(array, host)
    return host


class Staging:
    """Gradients as flat host arrays of one size and dtype: host ones as they are, CUDA ones
    copied into one reused buffer (nothing allocated per step).  ``refusal`` completes the
    error for a gradient that does not fit, e.g. "the servers hold {size} {dtype} parameters"."""

    def __init__(self, size: int, dtype, refusal: str):
        self.size, self.dtype, self.refusal = size, np.dtype(dtype), refusal
        self._buffer: np.ndarray | None = None

    def host(self, gradient) -> np.ndarray:
        if not is_device_array(gradient):
            gradient = np.asarray(gradient)
        if gradient.size != self.size or gradient.dtype != self.dtype:
            raise ValueError(f"gradient of {gradient.size} {gradient.dtype} values; "
                             + self.refusal.format(size=self.size, dtype=self.dtype))
        if not is_device_array(gradient):
            return np.ascontiguousarray(gradient).reshape(-1)
        if self._buffer is None:
            self._buffer = np.empty(self.size, self.dtype)
        to_host(gradient, self._buffer)
        return self._buffer


def copy_into(out, host: np.ndarray) -> None:
    """Copy host values into ``out``: a host array (any layout) or any CUDA array."""
    if is_device_array(out):
        from_host(host, out)
    else:
        np.copyto(np.asarray(out).reshape(-1), host)


def _setup(ctx, *device_arrays):
    libraries = {as_device_array(a)[0] for a in device_arrays if a is not None}
    if len(libraries) != 1:
        raise TypeError("pass device arrays of one library (all CuPy or all Numba)")
    arrays = _Arrays(libraries.pop())
    staged = not cuda_aware()[0]
    return arrays, _Buffers(ctx, arrays), staged


def allreduce(ctx: Context, send, recv, reduction) -> None:
    """``recv`` = the reduction of every rank's ``send`` (``send`` None: in place in ``recv``)."""
    op = _device_op(reduction)
    arrays, buffers, staged = _setup(ctx, send, recv)
    source = recv if send is None else send
    if ctx.size == 1:
        if send is not None:
            arrays.copy(send, recv)
        return
    bounds = balanced_bounds(recv.size, ctx.size)
    chunk = _exchange_and_fold(ctx, arrays, buffers, source, bounds, op, staged)
    _gather_into(ctx, arrays, buffers, chunk, recv, bounds, staged)


def reduce_scatter_block(ctx: Context, send, recv, reduction) -> None:
    op = _device_op(reduction)
    arrays, buffers, staged = _setup(ctx, send, recv)
    bounds = block_bounds(recv.size, ctx.size)
    if ctx.size == 1:
        arrays.copy(send[:recv.size], recv)
        return
    chunk = _exchange_and_fold(ctx, arrays, buffers, send, bounds, op, staged)
    arrays.copy(chunk, recv)


def allgather(ctx: Context, send, recv) -> None:
    arrays, buffers, staged = _setup(ctx, send, recv)
    block = recv.size // ctx.size
    bounds = block_bounds(block, ctx.size)
    mine = recv[bounds[ctx.rank]:bounds[ctx.rank + 1]] if send is None else send
    _gather_into(ctx, arrays, buffers, mine, recv, bounds, staged)


def bcast(ctx: Context, buf, root: int) -> None:
    arrays, buffers, staged = _setup(ctx, buf)
    if staged:
        host = buffers.get("bcast", buf.size, buf.dtype, pinned=True)
        if ctx.rank == root:
            arrays.to_host(buf, host)
    else:
        arrays.synchronize()
        host = buf
    ctx.waitall([ctx.comm.Ibcast([host.view(np.uint8), MPI.BYTE], root)], [q for q in range(ctx.size)
                                                                          if q != ctx.rank])
    if staged and ctx.rank != root:
        arrays.to_device(host, buf)
