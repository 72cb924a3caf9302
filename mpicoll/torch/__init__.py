"""PyTorch tensors through mpicoll's collectives, the way Horovod and torch.distributed take them.

    import mpicoll.torch as mt
    mt.broadcast_parameters(model.state_dict(), root=0)     # every replica starts alike
    optimizer = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ...
    loss.backward()                                         # buckets of gradients start their allreduce here
    optimizer.step()                                        # waits for them, averages, steps

Needs ``pip install mpicoll[torch]``.  CPU tensors are read and written where
they are (numpy shares their memory); CUDA tensors go to the array layer as
device arrays (``__cuda_array_interface__``) and are reduced on their GPU.
Results are tensors of the input's kind; ``out=`` may be the input itself.
``comm`` is any mpi4py communicator (default ``MPI.COMM_WORLD``), wrapped once
in a :class:`~mpicoll.Communicator` of ``algorithm``; every rank must make the
same calls in the same order.  bfloat16 CPU tensors travel as numpy arrays of
``ml_dtypes.bfloat16`` (sums added in float32, :mod:`mpicoll.collectives.api`).
Compression (``compression=`` of :func:`allreduce`, :class:`DistributedOptimizer`
and :class:`HookState`): "fp16", "bf16", :class:`mpicoll.Compression` with error
feedback, or :class:`mpicoll.PowerSGD`.

Importing this module gives torch this rank's share of the node's cores (:mod:`mpicoll.torch.threads`: under
a launcher torch would take one) and registers torch.distributed's ``"mpicoll"`` backend
(:mod:`mpicoll.torch.backend`): ``dist.init_process_group("mpicoll")`` under
mpiexec, with nothing else set, and DDP or any ``dist`` collective runs over
mpicoll.
"""

from __future__ import annotations

from ..models.modules import point_at
from . import backend
from .collectives import OPS, allgather, allreduce, allreduce_async, broadcast
from .diloco import DiLoCo, local_sgd
from .functions import FlatParameters, broadcast_optimizer_state, broadcast_parameters, init_process_group
from .hooks import HookState, allreduce_hook
from .optimizer import DistributedOptimizer
from .threads import share_the_node

__all__ = ["allreduce", "allreduce_async", "allgather", "broadcast", "broadcast_parameters",
           "broadcast_optimizer_state", "DistributedOptimizer", "DiLoCo", "local_sgd", "allreduce_hook", "HookState", "init_process_group",
           "FlatParameters", "point_at", "OPS", "ProcessGroupMpicoll"]

share_the_node()         # before the program's own torch.set_num_threads, which wins
backend.register()       # dist.init_process_group("mpicoll"), and env:// from MPI without MASTER_ADDR
ProcessGroupMpicoll = backend.ProcessGroupMpicoll
