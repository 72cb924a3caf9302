"""Communication hooks for ``DistributedDataParallel``: DDP's gradient buckets averaged by mpicoll."""

from __future__ import annotations

import torch

from ..collectives.nonblocking import Request
from .collectives import allreduce_async

__all__ = ["allreduce_hook"]


def allreduce_hook(state, bucket):
    """A communication hook for ``DistributedDataParallel``: DDP's buckets averaged by mpicoll.

        model = DistributedDataParallel(model)
        model.register_comm_hook(None, mpicoll.torch.allreduce_hook)

    ``state``: None for ``MPI.COMM_WORLD``, or the mpi4py communicator to use.
    DDP still needs ``torch.distributed`` initialised (it broadcasts the
    parameters and checks the model with it); the gradients go through
    mpicoll's nonblocking allreduce, started as DDP hands over each bucket.
    """
    tensor = bucket.buffer()
    future: torch.futures.Future = torch.futures.Future()

    def settle(request: Request) -> None:
        if request.error is not None:
            future.set_exception(request.error)
        else:
            future.set_result(request.wait())

    allreduce_async(tensor, "average", comm=state, out=tensor).add_done_callback(settle)
    return future


# DDP checks the hook's return annotation as an object (this module's annotations are strings)
allreduce_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]
