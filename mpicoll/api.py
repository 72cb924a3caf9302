"""The array API: collectives that take an array and return one, like torch.distributed and Horovod.

Any numpy array works (any shape, any memory layout: a non-contiguous input
is packed once, a non-contiguous ``out`` is filled from a packed result);
``allreduce`` also takes contiguous device arrays (see :mod:`mpicoll.device`).
``comm`` defaults to ``MPI.COMM_WORLD``; a plain mpi4py communicator is
wrapped in a :class:`~mpicoll.Communicator` once and the wrapper reused, so
pass the same communicator object from every rank, in the same order.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from . import device
from .communicator import Communicator

__all__ = ["allreduce", "reduce_scatter", "allgather", "broadcast", "resolve_op"]

_OPS = {name.lower(): getattr(MPI, name) for name in
        ("SUM", "PROD", "MIN", "MAX", "LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR", "MAXLOC", "MINLOC")}
_WRAPPED: dict[tuple[int, str], Communicator] = {}


def resolve_op(op) -> MPI.Op:
    """An ``MPI.Op`` from itself or from a name such as "sum" or "max"."""
    if isinstance(op, MPI.Op):
        return op
    try:
        return _OPS[str(op).lower()]
    except KeyError:
        raise ValueError(f"Unrecognized op: {op!r}; use an MPI.Op or one of {', '.join(_OPS)}") from None


def _communicator(comm, algorithm: str) -> Communicator:
    comm = MPI.COMM_WORLD if comm is None else comm
    if isinstance(comm, Communicator) and comm.algorithm == algorithm:
        return comm
    key = (comm.handle, algorithm)
    wrapped = _WRAPPED.get(key)
    if wrapped is None:
        wrapped = _WRAPPED[key] = Communicator(comm, algorithm=algorithm)
    return wrapped


def _contiguous(x) -> np.ndarray:
    x = np.asarray(x)
    return x if x.flags.c_contiguous else np.ascontiguousarray(x)


def _output(out, shape, dtype) -> tuple[np.ndarray, np.ndarray | None]:
    """(array to write, user array to copy into afterwards or None)."""
    if out is None:
        return np.empty(shape, dtype), None
    if out.shape != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"out has shape {out.shape} and dtype {out.dtype}; expected {tuple(shape)} and {dtype}")
    if out.flags.c_contiguous and out.flags.writeable:
        return out, None
    return np.empty(shape, dtype), out


def _finish(result: np.ndarray, copy_into: np.ndarray | None) -> np.ndarray:
    if copy_into is None:
        return result
    copy_into[...] = result
    return copy_into


def _device_empty(x, shape=None):
    """An uninitialised device array of ``x``'s library and dtype."""
    library, x = device.as_device_array(x)
    shape = x.shape if shape is None else shape
    if library == "cupy":
        import cupy
        return cupy.empty(shape, x.dtype)
    from numba import cuda
    return cuda.device_array(shape, x.dtype)


def allreduce(x, op="sum", *, comm=None, algorithm: str = "auto", out=None):
    """The elementwise reduction of ``x`` over all ranks (same shape and dtype as ``x``).

    ``out`` may be ``x`` itself to reduce in place.  Device arrays (CuPy, Numba,
    any ``__cuda_array_interface__`` or DLPack CUDA array) give device arrays,
    reduced on the GPU.
    """
    if device.is_device_array(x):
        communicator = _communicator(comm, algorithm)
        if out is x:
            communicator.Allreduce(MPI.IN_PLACE, x, resolve_op(op))
            return x
        out = _device_empty(x) if out is None else out
        communicator.Allreduce(x, out, resolve_op(op))
        return out
    x = np.asarray(x)
    communicator = _communicator(comm, algorithm)
    op = resolve_op(op)
    if out is x and x.flags.c_contiguous and x.flags.writeable:
        communicator.Allreduce(MPI.IN_PLACE, x, op)
        return x
    source = _contiguous(x)
    result, copy_into = _output(None if out is x else out, x.shape, x.dtype)
    communicator.Allreduce(source, result, op)
    return _finish(result, copy_into if out is not x else x)


def reduce_scatter(x, op="sum", *, comm=None, algorithm: str = "auto", out=None) -> np.ndarray:
    """Reduce ``x`` over all ranks and keep this rank's share of axis 0.

    ``x.shape[0]`` must be a multiple of the rank count p; the result has
    shape ``(x.shape[0] // p, *x.shape[1:])``: rows ``rank * k`` to ``(rank+1) * k``.
    """
    x = _contiguous(x)
    communicator = _communicator(comm, algorithm)
    size = communicator.Get_size()
    if x.ndim == 0 or x.shape[0] % size:
        raise ValueError(f"reduce_scatter: x has shape {x.shape}; its first axis must be a multiple of {size} ranks")
    result, copy_into = _output(out, (x.shape[0] // size, *x.shape[1:]), x.dtype)
    communicator.Reduce_scatter_block(x, result, resolve_op(op))
    return _finish(result, copy_into)


def allgather(x, *, comm=None, algorithm: str = "auto", out=None) -> np.ndarray:
    """Every rank's ``x`` concatenated along axis 0, in rank order (a scalar gives shape (p,))."""
    x = _contiguous(x)
    communicator = _communicator(comm, algorithm)
    size = communicator.Get_size()
    shape = (size,) if x.ndim == 0 else (size * x.shape[0], *x.shape[1:])
    result, copy_into = _output(out, shape, x.dtype)
    communicator.Allgather(x, result)
    return _finish(result, copy_into)


def broadcast(x, root: int = 0, *, comm=None, algorithm: str = "auto", out=None) -> np.ndarray:
    """The root's ``x`` on every rank; other ranks pass an array of the same shape and dtype.

    Returns a new array unless ``out`` is given (``out=x`` overwrites ``x`` in place).
    """
    x = np.asarray(x)
    communicator = _communicator(comm, algorithm)
    result, copy_into = _output(out, x.shape, x.dtype)
    if communicator.Get_rank() == root and result is not x:
        result[...] = x
    communicator.Bcast(result, root)
    return _finish(result, copy_into)
