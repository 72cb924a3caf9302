"""Tensors through mpicoll's collectives: allreduce (blocking and started), allgather, broadcast, on the
tensors' own memory (CPU tensors through numpy without a copy, CUDA tensors as device arrays)."""

from __future__ import annotations

import weakref

import numpy as np
import torch

from ..base import ops
from ..collectives import api
from ..collectives.compression import bfloat16, is_bfloat16
from ..collectives.nonblocking import Request
from ..collectives.powersgd import PowerSGD

__all__ = ["OPS", "allreduce", "allreduce_async", "allgather", "broadcast", "as_array", "TensorBuffer", "compressible"]


# torch/Horovod names -> the array API's (mpicoll.base.ops, the one op table); "average", a sum divided by the rank
# count, is the array API's too, which divides
OPS = {"average": "average", **{op.torch.lower(): op.name for op in ops.OPS if op.kernel}}


def compressible(tensor: torch.Tensor, compression) -> bool:
    """Whether ``compression`` (None, a :class:`~mpicoll.Compression` or a :class:`~mpicoll.PowerSGD`) moves
    ``tensor``: float32 and float64 tensors, which 16-bit words can carry; PowerSGD's on the host only.  The
    optimizers send other tensors as they are."""
    return (compression is not None and tensor.dtype in (torch.float32, torch.float64)
            and not (tensor.is_cuda and isinstance(compression, PowerSGD)))


def as_array(tensor: torch.Tensor):
    """The tensor's memory as a numpy (CPU) or device array, without a copy.  A CPU bfloat16 tensor is a numpy
    array of ``ml_dtypes.bfloat16`` (the array API reduces those: :mod:`mpicoll.collectives.api`)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        if tensor.is_cuda:
            raise TypeError("CUDA bfloat16 tensors are not supported (CuPy has no bfloat16): pass tensor.float() "
                            "and convert the result back")
        return tensor.view(torch.int16).numpy().view(bfloat16())
    return tensor if tensor.is_cuda else tensor.numpy()


_HOST_VIEWS: dict = {}      # id(tensor) -> (a weak reference to it, its memory, type, shape and strides, the view)


def host_view(tensor: torch.Tensor) -> np.ndarray:
    """:func:`as_array` of a CPU tensor, remembered per tensor while its memory, type, shape and strides stay: a
    training step reduces the same tensors every step, and making the view (``detach().numpy()``; for bfloat16
    ``view(torch.int16)`` too) cost 2.2-4.8 us of a small allreduce's 6-9 (measured, 2 ranks).  The entry goes
    with the tensor."""
    key = (tensor.data_ptr(), tensor.dtype, tensor.shape, tensor.stride())
    ident = id(tensor)
    known = _HOST_VIEWS.get(ident)
    if known is not None and known[0]() is tensor and known[1] == key:
        return known[2]
    array = as_array(tensor)
    _HOST_VIEWS[ident] = (weakref.ref(tensor, lambda _, ident=ident: _HOST_VIEWS.pop(ident, None)), key, array)
    return array


class TensorBuffer:
    """A tensor as the array a :class:`~mpicoll.Communicator` collective reads or writes: the tensor's own
    memory when it is contiguous and of a dtype MPI has, else a contiguous copy (bfloat16: in float32, which
    MPI has), which ``deliver()`` writes back into the tensor.  ``read_only``: the call only reads it (nothing
    to write back)."""

    def __init__(self, tensor: torch.Tensor, read_only: bool = False):
        if not read_only and _overlaps_itself(tensor):
            raise RuntimeError("unsupported operation: more than one element of the written-to tensor refers to "
                               "a single memory location (an expanded tensor); clone() it first, as torch asks "
                               "for any in-place operation")
        self.original = tensor
        if tensor.dtype == torch.bfloat16:
            self.tensor = tensor.detach().float()
        elif not tensor.is_contiguous():
            self.tensor = tensor.detach().contiguous()
        else:
            self.tensor = tensor.detach()
        self.copied = self.tensor.data_ptr() != tensor.data_ptr() and not read_only
        self.array = as_array(self.tensor)

    def deliver(self) -> None:
        if self.copied:
            with torch.no_grad():
                self.original.copy_(self.tensor)


def _overlaps_itself(tensor: torch.Tensor) -> bool:
    """Whether elements of ``tensor`` share memory (``expand``'s zero strides): writing the result into it is
    torch's "unsupported operation" (raised here, in the caller's thread, not on a worker after the call)."""
    check = getattr(torch, "_debug_has_internal_overlap", None)
    if check is not None:
        return check(tensor) == 1          # 0: no, 1: yes, 2: too hard to tell (a strided view)
    return any(stride == 0 and size > 1 for stride, size in zip(tensor.stride(), tensor.shape))


def _tensor(array, like: torch.Tensor) -> torch.Tensor:
    """An array the array API returned, as a tensor of ``like``'s kind (no copy)."""
    if not isinstance(array, np.ndarray):
        return torch.as_tensor(array, device=like.device)
    if is_bfloat16(array.dtype):
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def allreduce(tensor: torch.Tensor, op: str = "average", *, comm=None, algorithm: str = "auto",
              out: torch.Tensor | None = None, compression=None, key=None) -> torch.Tensor:
    """The elementwise ``op`` of ``tensor`` over all ranks: average (default), sum, min, max or product.

    ``out=tensor`` reduces in place.  Averaging needs a floating-point tensor.  ``compression`` ("fp16",
    "bf16", or a :class:`~mpicoll.Compression`, with error feedback per ``key``) moves a float32 or float64
    sum or average as 16-bit floats (:mod:`mpicoll.collectives.compression`); 16-bit tensors travel as they are.
    """
    if out is tensor and compression is None and op in OPS and not tensor.is_cuda \
            and (op != "average" or tensor.is_floating_point()) \
            and api.reduced_in_place(host_view(tensor), OPS[op], comm, algorithm) is not None:
        return tensor                   # (a contiguous CPU tensor in place: the array API's straight line)
    call, finish = _allreduce(tensor, op, comm, algorithm, out, compression, key)
    return finish(call.run())


def allreduce_async(tensor: torch.Tensor, op: str = "average", *, comm=None, algorithm: str = "auto",
                    out: torch.Tensor | None = None, compression=None, key=None) -> Request:
    """:func:`allreduce`, started: returns a :class:`~mpicoll.Request` whose ``wait()`` gives the result.

    The reduction runs while the caller goes on (:mod:`mpicoll.collectives.nonblocking`);
    leave ``tensor`` and ``out`` alone until it has completed.
    """
    call, finish = _allreduce(tensor, op, comm, algorithm, out, compression, key)
    return call.start().then(finish)


def _allreduce(tensor, op, comm, algorithm, out, compression=None, key=None):
    """(the prepared array call, what turns its result into the tensor to return)."""
    if op not in OPS:
        raise ValueError(f"Unrecognized op: {op!r}; use one of {', '.join(OPS)}")
    if op == "average" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"averaging needs a floating-point tensor, got {tensor.dtype}; use op='sum' and divide")
    source = as_array(tensor)
    target = None if out is None else source if out is tensor else as_array(out)

    def finish(array) -> torch.Tensor:
        return _tensor(array, tensor) if out is None else out

    if compression is not None and tensor.dtype in (torch.float32, torch.float64):
        return api._compressed_allreduce(source, OPS[op], comm, algorithm, target, compression, key), finish
    return api._allreduce(source, OPS[op], comm, algorithm, target), finish


def allgather(tensor: torch.Tensor, *, comm=None, algorithm: str = "auto",
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dimension 0, in rank order (a scalar gives shape (p,))."""
    source = as_array(tensor)
    if out is None:
        return _tensor(api.allgather(source, comm=comm, algorithm=algorithm), tensor)
    api.allgather(source, comm=comm, algorithm=algorithm, out=as_array(out))
    return out


def broadcast(tensor: torch.Tensor, root: int = 0, *, comm=None, algorithm: str = "auto",
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The root's ``tensor`` on every rank (the others pass one of the same shape and dtype).

    Returns a new tensor unless ``out`` is given; ``out=tensor`` overwrites it in place.
    """
    source = as_array(tensor)
    if out is None:
        return _tensor(api.broadcast(source, root, comm=comm, algorithm=algorithm), tensor)
    target = source if out is tensor else as_array(out)
    api.broadcast(source, root, comm=comm, algorithm=algorithm, out=target)
    return out
