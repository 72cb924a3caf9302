"""Communication hooks for ``DistributedDataParallel``: DDP's gradient buckets averaged by mpicoll."""

from __future__ import annotations

import torch

from ..collectives.compression import resolve
from ..collectives.nonblocking import Request
from ..collectives.powersgd import PowerSGD
from .collectives import allreduce_async, as_array

__all__ = ["allreduce_hook", "HookState"]


class HookState:
    """What :func:`allreduce_hook` averages a model's buckets with: ``comm`` (None: ``MPI.COMM_WORLD``),
    ``algorithm``, and ``compression`` ("fp16", "bf16", a :class:`~mpicoll.Compression`, with error feedback
    per bucket, or a :class:`~mpicoll.PowerSGD`, its state per bucket).  One per model: it keeps the buckets'
    residuals and factors."""

    def __init__(self, comm=None, compression=None, algorithm: str = "auto"):
        self.comm, self.algorithm = comm, algorithm
        self.compression = compression if isinstance(compression, PowerSGD) else resolve(compression)


def allreduce_hook(state, bucket):
    """A communication hook for ``DistributedDataParallel``: DDP's buckets averaged by mpicoll.

        model = DistributedDataParallel(model)
        model.register_comm_hook(None, mpicoll.torch.allreduce_hook)
        model.register_comm_hook(mt.HookState(compression=mpicoll.PowerSGD(rank=4)), mt.allreduce_hook)

    ``state``: None for ``MPI.COMM_WORLD``, the mpi4py communicator to use, or a :class:`HookState` (a
    communicator and a compression).  DDP still needs ``torch.distributed`` initialised (it broadcasts the
    parameters and checks the model with it); the gradients go through mpicoll's nonblocking allreduce,
    started as DDP hands over each bucket.  Compression applies to float32 and float64 CPU buckets; DDP
    rebuilds its buckets after the first step, and a bucket of a new layout starts its own state.
    """
    if not isinstance(state, HookState):
        state = HookState(comm=state)
    tensor = bucket.buffer()
    future: torch.futures.Future = torch.futures.Future()

    def settle(request: Request) -> None:
        if request.error is not None:
            future.set_exception(request.error)
        else:
            request.wait()
            future.set_result(tensor)

    shapes = tuple(tuple(g.shape) for g in bucket.gradients())
    key = (bucket.index(), shapes)             # a rebuilt bucket is another buffer
    wide = tensor.dtype in (torch.float32, torch.float64)          # what 16-bit words can carry
    low_rank = isinstance(state.compression, PowerSGD)             # host arrays only
    if low_rank and wide and not tensor.is_cuda:
        flat, gradients, offset = as_array(tensor), [], 0
        for shape in shapes:
            size = int(torch.Size(shape).numel())
            gradients.append(flat[offset:offset + size].reshape(shape))
            offset += size
        request = state.compression.start(gradients, comm=state.comm, algorithm=state.algorithm, key=key)
    else:
        request = allreduce_async(tensor, "average", comm=state.comm, algorithm=state.algorithm, out=tensor,
                                  compression=state.compression if wide and not low_rank else None, key=key)
    request.add_done_callback(settle)
    return future


# DDP checks the hook's return annotation as an object (this module's annotations are strings)
allreduce_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]
