"""The array API: collectives that take an array and return one, like torch.distributed and Horovod.

Any array of :mod:`mpicoll.arrays` works, on the host or a GPU, in any shape
and memory layout: a non-contiguous input is packed once, a non-contiguous
``out`` is filled from a packed result, and the result is of the input's kind
(numpy for host memory, CuPy or Numba for device memory).  ``comm`` defaults
to ``MPI.COMM_WORLD``; a plain mpi4py communicator is wrapped in a
:class:`~mpicoll.Communicator` once and the wrapper reused, so pass the same
communicator object from every rank, in the same order.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from . import arrays
from .communicator import Communicator
from .reduction import resolve_op

__all__ = ["allreduce", "reduce_scatter", "allgather", "broadcast", "resolve_op"]

_WRAPPED: dict[tuple[int, str], Communicator] = {}


def _communicator(comm, algorithm: str) -> Communicator:
    comm = MPI.COMM_WORLD if comm is None else comm
    if isinstance(comm, Communicator) and comm.algorithm == algorithm:
        return comm
    key = (comm.handle, algorithm)
    wrapped = _WRAPPED.get(key)
    if wrapped is None:
        wrapped = _WRAPPED[key] = Communicator(comm, algorithm=algorithm)
    return wrapped


def _as_array(x):
    """``x`` as a numpy array (host memory) or a CuPy/Numba array (device memory), without a copy."""
    return arrays.device_view(x)[1] if arrays.is_device(x) else np.asarray(x)


def _output(out, shape, like):
    """(contiguous array to write the result into, the caller's ``out`` to copy it into afterwards or None)."""
    shape = tuple(shape)
    if out is None:
        return arrays.empty_like(like, shape), None
    out = _as_array(out)
    if tuple(out.shape) != shape or np.dtype(out.dtype) != np.dtype(like.dtype):
        raise ValueError(f"out has shape {tuple(out.shape)} and dtype {out.dtype}; expected {shape} and {like.dtype}")
    if arrays.library(out) != arrays.library(like):
        raise TypeError("out must be in the same kind of memory as x (both host, or both one device library)")
    if arrays.is_c_contiguous(out) and (not isinstance(out, np.ndarray) or out.flags.writeable):
        return out, None
    return arrays.empty_like(like, shape), out


def _finish(result, copy_into):
    if copy_into is None:
        return result
    arrays.copy(result, copy_into)
    return copy_into


def allreduce(x, op="sum", *, comm=None, algorithm: str = "auto", out=None):
    """The elementwise reduction of ``x`` over all ranks (same shape and dtype as ``x``).

    ``out`` may be ``x`` itself to reduce in place.  Device arrays are reduced
    on their GPU and give device arrays.
    """
    communicator, op = _communicator(comm, algorithm), resolve_op(op)
    in_place = out is x
    x = _as_array(x)
    source = arrays.contiguous(x)
    if in_place and source is x and (not isinstance(x, np.ndarray) or x.flags.writeable):
        communicator.Allreduce(MPI.IN_PLACE, x, op)
        return x
    result, copy_into = _output(x if in_place else out, x.shape, x)
    communicator.Allreduce(source, result, op)
    return _finish(result, copy_into)


def reduce_scatter(x, op="sum", *, comm=None, algorithm: str = "auto", out=None):
    """Reduce ``x`` over all ranks and keep this rank's share of axis 0.

    ``x.shape[0]`` must be a multiple of the rank count p; the result has
    shape ``(x.shape[0] // p, *x.shape[1:])``: rows ``rank * k`` to ``(rank+1) * k``.
    """
    communicator = _communicator(comm, algorithm)
    x = arrays.contiguous(_as_array(x))
    size = communicator.Get_size()
    if x.ndim == 0 or x.shape[0] % size:
        raise ValueError(f"reduce_scatter: x has shape {x.shape}; its first axis must be a multiple of {size} ranks")
    result, copy_into = _output(out, (x.shape[0] // size, *x.shape[1:]), x)
    communicator.Reduce_scatter_block(x, result, resolve_op(op))
    return _finish(result, copy_into)


def allgather(x, *, comm=None, algorithm: str = "auto", out=None):
    """Every rank's ``x`` concatenated along axis 0, in rank order (a scalar gives shape (p,))."""
    communicator = _communicator(comm, algorithm)
    x = arrays.contiguous(_as_array(x))
    size = communicator.Get_size()
    shape = (size,) if x.ndim == 0 else (size * x.shape[0], *x.shape[1:])
    result, copy_into = _output(out, shape, x)
    communicator.Allgather(x, result)
    return _finish(result, copy_into)


def broadcast(x, root: int = 0, *, comm=None, algorithm: str = "auto", out=None):
    """The root's ``x`` on every rank; other ranks pass an array of the same shape and dtype.

    Returns a new array unless ``out`` is given (``out=x`` overwrites ``x`` in place).
    """
    communicator = _communicator(comm, algorithm)
    x = _as_array(x)
    result, copy_into = _output(out, x.shape, x)
    if communicator.Get_rank() == root and result is not x:
        arrays.copy(x, result)
    communicator.Bcast(result, root)
    return _finish(result, copy_into)
