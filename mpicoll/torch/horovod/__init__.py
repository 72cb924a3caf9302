"""Horovod's PyTorch API over mpicoll: a Horovod program runs with one changed line,

    import mpicoll.torch.horovod as hvd          # was: import horovod.torch as hvd

with Horovod's signatures and behaviour: ``init``, ``rank``, ``size``, ``local_rank``, ``cross_rank``, ...;
``allreduce`` (``average=``, ``name=``, ``compression=``, ``op=``, ``prescale_factor=``, ``postscale_factor=``,
``process_set=``) and its in-place, async and grouped forms, ``allgather`` (first dimensions may differ),
``broadcast``, ``alltoall`` (with splits), ``reducescatter``, ``poll``, ``synchronize``, ``join``,
``barrier``, ``broadcast_object``, ``allgather_object``, ``broadcast_parameters``,
``broadcast_optimizer_state``, ``DistributedOptimizer``, ``Compression``, the ops ``Average``, ``Sum``, ``Min``, ``Max``,
``Product``, and process sets.  Ops are matched across ranks by name, in any order, as Horovod's are
(:mod:`.controller`), and checked: ranks that disagree get a ``HorovodInternalError`` (a RuntimeError)
on every rank, whatever the tensor's size.  The collectives are autograd functions.

``elastic`` is Horovod's elastic API (``run``, ``TorchState``, ``ElasticSampler``) on MPI's fault tolerance:
a program run under ``mpirun`` goes on without the ranks that die (:mod:`.elastic`).

Not supported, each with an error naming it (``mpicoll.Unsupported``): Adasum, Horovod's timeline file
(``MPICOLL_TIMELINE`` writes mpicoll's), ``SyncBatchNorm``; sparse tensors only through
``sparse_allreduce_async`` (Sum and Average) and ``DistributedOptimizer``.
"""

from __future__ import annotations

from ...base.errors import HorovodInternalError
from .basics import (ProcessSet, add_process_set, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                     gloo_built, gloo_enabled, global_process_set, is_homogeneous, local_rank, local_size,
                     mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, remove_process_set,
                     rocm_built, shutdown, size, start_timeline, stop_timeline)
from .basics import is_initialized
from . import elastic
from .compression import Compression
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .optimizer import DistributedOptimizer
from .ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allgather_async, allreduce, allreduce_,
                  allreduce_async, allreduce_async_, alltoall, alltoall_async, barrier, broadcast, broadcast_,
                  broadcast_async, broadcast_async_, grouped_allgather, grouped_allgather_async, grouped_allreduce,
                  grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
                  grouped_reducescatter_async, init, join, poll, reducescatter, reducescatter_async,
                  sparse_allreduce_async, synchronize)

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression", "HorovodInternalError",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "sparse_allreduce_async", "allgather",
    "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "poll", "synchronize", "join", "barrier",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "DistributedOptimizer", "elastic",
]
