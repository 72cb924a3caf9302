"""Horovod's ops on tensors: every form (``x``, ``x_``, ``x_async``, ``x_async_``, grouped), as autograd
functions, through one private starter per kind.

An op is asked of the negotiation (:mod:`.controller`) with what must agree
across ranks; once every member of its process set has asked, the
negotiation thread checks that and runs the data movement below on the
process set's communicator: allreduce and broadcast (and an allgather of
equal blocks) through mpicoll's collectives, the rest (allgather of unequal
first dimensions, alltoall, reducescatter) MPI's own.  Averages are sums
divided by the set's size (integer tensors truncate, as Horovod's);
``prescale_factor`` multiplies before the sum, ``postscale_factor`` after.
"""

from __future__ import annotations

import collections
import itertools
import warnings

import numpy as np
import torch
from mpi4py import MPI

from ...base.errors import HorovodInternalError, Unsupported
from ...collectives import api
from ...collectives.powersgd import PowerSGD
from ..collectives import TensorBuffer, as_array, compressible
from . import basics
from .basics import ProcessSet, global_process_set
from .compression import Compression, Rounding, is_mpicolls
from .controller import Request, _by_rank

__all__ = ["init", "Average", "Sum", "Adasum", "Min", "Max", "Product", "allreduce", "allreduce_", "allreduce_async",
           "allreduce_async_", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
           "grouped_allreduce_async_", "allgather", "allgather_async", "grouped_allgather",
           "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall",
           "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
           "grouped_reducescatter_async", "poll", "synchronize", "join", "barrier", "sparse_allreduce_async",
           "compressed_allreduce_async_", "take_part_joined"]

# Horovod's reduction ops (its values)
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_MPI_OPS = {Average: MPI.SUM, Sum: MPI.SUM, Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD}
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}

# (kind, process set id) -> the next unnamed op's number: per set, so ranks of one set that run more unnamed ops
# than another set's (uneven sets) still agree on the names in every set
_counters: dict = collections.defaultdict(itertools.count)
_handles: dict[int, tuple[Request, object]] = {}     # handle -> (request, what turns its result into the answer)


def init(comm=None, process_sets=None) -> None:
    """Start Horovod: ``comm`` an mpi4py communicator or a list of ranks (default the world);
    ``process_sets`` registered at once.  Collective; a second call does nothing."""
    if not basics.is_initialized():              # a fresh start (after shutdown too): names count from 0 again
        _counters.clear()
        _handles.clear()
    basics.start(comm, process_sets, take_part_joined)


def _op(op, average, kind: str) -> int:
    """Horovod's op from ``op`` and the deprecated ``average`` (Average when neither is given)."""
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=4)
        if op is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        op = Average if average else Sum
    op = Average if op is None else op
    if op == Adasum:
        raise Unsupported(f"{kind}: Adasum is not supported by mpicoll's Horovod API; use op=hvd.Average or "
                          "hvd.Sum")
    if op not in _MPI_OPS:
        raise ValueError(f"{kind}: unknown op {op!r}")
    return op


def _name(kind: str, name, process_set: ProcessSet) -> str:
    """The op's name: the caller's, or ``KIND.noname.N`` (the Nth unnamed op of that kind in the set)."""
    if name is not None:
        return str(name)
    return f"{kind}.noname.{next(_counters[kind, process_set.process_set_id])}"


def _start(kind: str, name: str, process_set: ProcessSet, meta: dict, run, finish=None) -> int:
    """Ask the negotiation for an op; returns its handle (``finish(result)`` gives what synchronize returns)."""
    if process_set.process_set_id is None:
        raise ValueError(f"{kind}: the process set {process_set} is not registered (hvd.add_process_set)")
    if not process_set.included():
        raise ValueError(f"{kind}: rank {basics.rank()} is not in {process_set}")
    request = Request(kind, name, process_set, meta, run)
    handle = basics.controller().submit(request)
    _handles[handle] = (request, finish)
    return handle


def poll(handle: int) -> bool:
    """Whether the op of ``handle`` has completed (``synchronize`` then returns at once)."""
    if handle not in _handles:
        raise ValueError(f"Handle {handle} was not created or has been cleared.")
    return _handles[handle][0].done.is_set()


def synchronize(handle: int):
    """Wait for the op of ``handle``; return its result (raising its error, on every rank that took part)."""
    if callable(handle):                         # sparse_allreduce_async's
        return handle()
    if handle not in _handles:
        raise ValueError(f"Handle {handle} was not created or has been cleared.")
    request, finish = _handles[handle]
    request.done.wait()
    del _handles[handle]
    if request.error is not None:
        raise request.error
    return request.result if finish is None else finish(request.result)


def _agree(kind: str, name: str, metas: dict, *keys: str) -> None:
    """Every rank passed the same ``keys`` of ``meta``, or the op fails on every rank naming who passed what."""
    for key in keys:
        values = {rank: meta[key] for rank, meta in metas.items()}
        if len(set(values.values())) > 1:
            raise HorovodInternalError(f"Mismatched {kind} {key} for {name!r}: {_by_rank(values)}")


def _meta(tensor: torch.Tensor, **extra) -> dict:
    return {"dtype": str(tensor.dtype), "shape": tuple(tensor.shape), "device": tensor.device.type, **extra}


def _check_tensor(tensor, kind: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{kind}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise Unsupported(f"{kind}: sparse tensors are not supported by mpicoll's Horovod API; pass "
                          "tensor.to_dense() (or sparse_as_dense=True to DistributedOptimizer)")


# -- allreduce -----------------------------------------------------------------------------------------

def _reduce_in_place(process_set: ProcessSet, target: torch.Tensor, op: int, prescale: float, postscale: float,
                     source: torch.Tensor | None = None) -> None:
    """``target`` = op over the set of (``source`` or ``target``) * prescale, then averaged and postscaled."""
    buffer = TensorBuffer(target)
    with torch.no_grad():
        if source is not None and source.data_ptr() != target.data_ptr():
            buffer.tensor.copy_(source)
        _scale(buffer.tensor, prescale)
        process_set.communicator.Allreduce(MPI.IN_PLACE, buffer.array, _MPI_OPS[op])
        if op == Average:
            _divide(buffer.tensor, process_set.size())
        _scale(buffer.tensor, postscale)
    buffer.deliver()


def _scale(tensor: torch.Tensor, factor: float) -> None:
    """``tensor *= factor`` as Horovod scales: integers in float64, float16 in float32, then back."""
    if factor == 1.0:
        return
    if tensor.is_floating_point() and tensor.dtype != torch.float16:
        tensor.mul_(factor)
    else:
        wide = torch.float32 if tensor.dtype == torch.float16 else torch.float64
        tensor.copy_((tensor.to(wide) * factor).to(tensor.dtype))


def _divide(tensor: torch.Tensor, by: int) -> None:
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.div_(by)
    else:                                        # Horovod's integer average truncates
        tensor.copy_(torch.div(tensor, by, rounding_mode="trunc"))


def _allreduce_async(tensor, output, name, op, prescale_factor, postscale_factor, process_set) -> int:
    _check_tensor(tensor, "allreduce")
    meta = _meta(tensor, op=op, prescale=float(prescale_factor), postscale=float(postscale_factor))

    name = _name("allreduce", name, process_set)

    def run(metas, joined):
        _agree("allreduce", name, metas, "shape", "dtype", "op", "prescale", "postscale", "device")
        _reduce_in_place(process_set, output, op, prescale_factor, postscale_factor, source=tensor)
        return output

    return _start("allreduce", name, process_set, meta, run)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> int:
    """Start averaging or summing ``tensor`` over the ranks (it is not modified); ``synchronize`` the handle."""
    op = _op(op, average, "allreduce")
    return _allreduce_async(tensor, torch.empty_like(tensor), name, op, prescale_factor, postscale_factor,
                            process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> int:
    """:func:`allreduce_async`, in place."""
    op = _op(op, average, "allreduce")
    return _allreduce_async(tensor, tensor, name, op, prescale_factor, postscale_factor, process_set)


def compressed_allreduce_async_(tensors: list, name, op: int, prescale_factor: float, postscale_factor: float,
                                process_set: ProcessSet, compression, finish=None) -> int:
    """Start averaging or summing ``tensors`` (float32 or float64) in place as mpicoll compresses them:
    ``compression`` a :class:`mpicoll.Compression` (16-bit floats; with error feedback, each tensor's residual
    kept under the op's name) or a :class:`mpicoll.PowerSGD` (low-rank factors of the tensors together, its
    state kept under the op's name; host tensors).  The ranks' ``compression`` kinds must agree.  Not
    Horovod's (whose compressors only cast): what :class:`DistributedOptimizer` runs for mpicoll's compressions."""
    if op not in (Average, Sum):
        raise ValueError(f"compressed allreduce: op must be hvd.Average or hvd.Sum, got {_OP_NAMES.get(op, op)}")
    low_rank = isinstance(compression, PowerSGD)
    if not is_mpicolls(compression):
        raise TypeError(f"compression must be an mpicoll Compression or PowerSGD here, got {compression!r}")
    for tensor in tensors:
        _check_tensor(tensor, "allreduce")
        if not compressible(tensor, compression):
            raise TypeError(f"compressed allreduce: {tensor.dtype} {tensor.device.type} tensor; mpicoll compresses "
                            "float32 and float64 tensors (PowerSGD: on the host)")
    name = _name("allreduce", name, process_set)
    meta = {"tensors": tuple((str(t.dtype), tuple(t.shape)) for t in tensors), "device": tensors[0].device.type,
            "op": op, "prescale": float(prescale_factor), "postscale": float(postscale_factor),
            # what shapes the messages: the 16-bit kind, or PowerSGD's settings (error feedback changes no message)
            "compression": ("powersgd", compression.rank, compression.start_step, compression.min_compression_rate)
            if low_rank else (compression.kind,)}

    def run(metas, joined):
        _agree("allreduce", name, metas, "tensors", "device", "op", "prescale", "postscale", "compression")
        if joined and low_rank:                 # every asking rank sees the same joined ranks: none sends a thing
            raise HorovodInternalError(f"allreduce {name!r}: PowerSGD cannot run while rank(s) "
                                       f"{', '.join(map(str, joined))} have joined (hvd.join): their factors are "
                                       "not there to sum")
        _reduce_compressed(process_set, tensors, op, prescale_factor, postscale_factor, compression, name)
        return tensors

    return _start("compressed_allreduce", name, process_set, meta, run, finish)


def _reduce_compressed(process_set: ProcessSet, tensors: list, op: int, prescale: float, postscale: float,
                       compression, name: str) -> None:
    """``tensors`` = op over the set of each tensor * prescale, moved as ``compression`` says, then postscaled."""
    buffers = [TensorBuffer(t) for t in tensors]
    comm = process_set.communicator
    with torch.no_grad():
        for buffer in buffers:
            _scale(buffer.tensor, prescale)
        if isinstance(compression, PowerSGD):               # averages
            compression.allreduce([buffer.array for buffer in buffers], comm=comm, key=name)
            if op == Sum:
                for buffer in buffers:
                    buffer.tensor.mul_(process_set.size())
        else:
            for index, buffer in enumerate(buffers):
                api.allreduce(buffer.array, "average" if op == Average else "sum", comm=comm,
                              compression=compression, key=name if len(buffers) == 1 else (name, index),
                              out=buffer.array)
        for buffer in buffers:
            _scale(buffer.tensor, postscale)
    for buffer in buffers:
        buffer.deliver()


class _Allreduce(torch.autograd.Function):
    """The backward of an allreduce is an allreduce of the gradient with the same op and factors."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (average, op, prescale_factor, postscale_factor, process_set)
        return synchronize(allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                                           process_set))

    @staticmethod
    def backward(ctx, grad_output):
        average, op, prescale_factor, postscale_factor, process_set = ctx.args
        return (allreduce(grad_output, average=average, op=op, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, process_set=process_set),
                None, None, None, None, None, None)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set) -> torch.Tensor:
    """The average (default) or ``op`` of ``tensor`` over the ranks, as a new tensor; differentiable."""
    if is_mpicolls(compression):
        raise TypeError("hvd.allreduce: compression takes Horovod's compressors (hvd.Compression.fp16, ...); "
                        "mpicoll's Compression and PowerSGD keep a state per gradient: pass them to "
                        "hvd.DistributedOptimizer, or use mpicoll.torch.allreduce(tensor, compression=..., key=...)")
    compressed, context = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, average, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, context)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set) -> torch.Tensor:
    """:func:`allreduce`, in place (returns ``tensor``)."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def _grouped_allreduce_async(tensors, outputs, name, op, prescale_factor, postscale_factor, process_set) -> int:
    for tensor in tensors:
        _check_tensor(tensor, "grouped_allreduce")
    meta = {"tensors": tuple((str(t.dtype), tuple(t.shape)) for t in tensors), "op": op,
            "prescale": float(prescale_factor), "postscale": float(postscale_factor)}
    name = _name("grouped_allreduce", name, process_set)

    def run(metas, joined):
        _agree("grouped_allreduce", name, metas, "tensors", "op", "prescale", "postscale")
        for tensor, output in zip(tensors, outputs):
            _reduce_in_place(process_set, output, op, prescale_factor, postscale_factor, source=tensor)
        return outputs

    return _start("grouped_allreduce", name, process_set, meta, run)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set) -> int:
    op = _op(op, average, "grouped_allreduce")
    return _grouped_allreduce_async(tensors, [torch.empty_like(t) for t in tensors], name, op, prescale_factor,
                                    postscale_factor, process_set)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=global_process_set) -> int:
    op = _op(op, average, "grouped_allreduce")
    return _grouped_allreduce_async(tensors, list(tensors), name, op, prescale_factor, postscale_factor,
                                    process_set)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.args = (average, op, prescale_factor, postscale_factor, process_set)
        return tuple(synchronize(grouped_allreduce_async(list(tensors), average, name, op, prescale_factor,
                                                         postscale_factor, process_set)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        average, op, prescale_factor, postscale_factor, process_set = ctx.args
        grads = grouped_allreduce(list(grad_outputs), average=average, op=op, prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor, process_set=process_set)
        return (None, None, None, None, None, None, *grads)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set) -> list:
    """:func:`allreduce` of several tensors as one op (one name); differentiable."""
    compressed, contexts = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    reduced = _GroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor, process_set,
                                      *compressed)
    return [compression.decompress(t, c) for t, c in zip(reduced, contexts)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set) -> list:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Start reducing a sparse COO tensor: every rank's indices and values are gathered (two allgathers),
    and the sum (or average) is the sparse tensor of all of them (duplicates add up when it is coalesced).
    Returns a callable handle for :func:`synchronize`."""
    if not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async: the tensor is not sparse")
    op = _op(op, None, "sparse_allreduce")
    if op not in (Average, Sum):
        raise Unsupported(f"sparse_allreduce_async: op {_OP_NAMES[op]} is not supported for sparse tensors")
    indices = allgather_async(tensor._indices().transpose(0, 1).contiguous(), name=f"{name}.indices",
                              process_set=process_set)
    values = allgather_async(tensor._values(), name=f"{name}.values", process_set=process_set)

    def result():
        gathered_values, gathered_indices = synchronize(values), synchronize(indices)
        if op == Average:
            gathered_values = gathered_values / process_set.size()
        return torch.sparse_coo_tensor(gathered_indices.transpose(0, 1), gathered_values, tensor.size())
    return result


# -- allgather -----------------------------------------------------------------------------------------

def _gather_rows(process_set: ProcessSet, tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Every member's ``tensor`` concatenated along dimension 0 (``rows``: each member's first dimension)."""
    source = TensorBuffer(tensor.reshape(tensor.shape or (1,)), read_only=True)
    per_row = int(np.prod(tensor.shape[1:])) if tensor.dim() > 1 else 1
    output = torch.empty((sum(rows), *tensor.shape[1:]), dtype=source.tensor.dtype, device=tensor.device)
    target = as_array(output)
    if len(set(rows)) == 1:
        process_set.communicator.Allgather(source.array, target)
    else:
        counts = np.array(rows, np.int64) * per_row
        offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
        MPI.Intracomm.Allgatherv(process_set.comm, source.array, [target, (counts, offsets)])
    return output.to(tensor.dtype)


def _rows(tensor: torch.Tensor) -> int:
    return tensor.shape[0] if tensor.dim() else 1


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along dimension 0 (which may differ between ranks)."""
    _check_tensor(tensor, "allgather")
    meta = {"dtype": str(tensor.dtype), "shape": tuple(tensor.shape[1:]), "rows": _rows(tensor),
            "dims": tensor.dim()}
    name = _name("allgather", name, process_set)

    def run(metas, joined):
        _refuse_joined("allgather", name, joined)
        _agree("allgather", name, metas, "dtype", "shape", "dims")
        return _gather_rows(process_set, tensor, [metas[r]["rows"] for r in process_set.ranks])

    return _start("allgather", name, process_set, meta, run)


def _refuse_joined(kind: str, name: str, joined: list[int]) -> None:
    if joined:
        raise HorovodInternalError(f"{kind} {name!r} while rank(s) {', '.join(map(str, joined))} have joined: "
                                   "hvd.join covers allreduce only")


class _Allgather(torch.autograd.Function):
    """The backward of an allgather: the gradient averaged over the ranks, this rank's rows of it (Horovod's)."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = _rows(tensor), process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        reduced = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        rows = allgather(torch.tensor([ctx.rows], dtype=torch.int64), process_set=ctx.process_set)
        offset = int(rows[: ctx.process_set.rank()].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dimension 0 (which may differ between ranks); differentiable."""
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    for tensor in tensors:
        _check_tensor(tensor, "grouped_allgather")
    meta = {"tensors": tuple((str(t.dtype), tuple(t.shape[1:]), t.dim()) for t in tensors),
            "rows": tuple(_rows(t) for t in tensors)}
    name = _name("grouped_allgather", name, process_set)

    def run(metas, joined):
        _refuse_joined("grouped_allgather", name, joined)
        _agree("grouped_allgather", name, metas, "tensors")
        return [_gather_rows(process_set, t, [metas[r]["rows"][i] for r in process_set.ranks])
                for i, t in enumerate(tensors)]

    return _start("grouped_allgather", name, process_set, meta, run)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows, ctx.process_set = [_rows(t) for t in tensors], process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        reduced = grouped_allreduce(list(grad_outputs), op=Average, process_set=ctx.process_set)
        rows = allgather(torch.tensor([ctx.rows], dtype=torch.int64), process_set=ctx.process_set)
        offsets = rows[: ctx.process_set.rank()].sum(0).tolist() if ctx.process_set.rank() else [0] * len(reduced)
        return (None, None, *[g.narrow(0, int(o), n) for g, o, n in zip(reduced, offsets, ctx.rows)])


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> list:
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


# -- broadcast -----------------------------------------------------------------------------------------

def _broadcast_async(tensor, output, root_rank, name, process_set) -> int:
    _check_tensor(tensor, "broadcast")
    if root_rank not in process_set.ranks:
        raise ValueError(f"broadcast: root_rank {root_rank} is not in {process_set}")
    meta = _meta(tensor, root=int(root_rank))
    name = _name("broadcast", name, process_set)

    def run(metas, joined):
        _refuse_joined("broadcast", name, joined)
        _agree("broadcast", name, metas, "root", "shape", "dtype", "device")
        buffer = TensorBuffer(output)
        with torch.no_grad():
            if output.data_ptr() != tensor.data_ptr():
                buffer.tensor.copy_(tensor)
            process_set.communicator.Bcast(buffer.array, process_set.set_rank(root_rank))
        buffer.deliver()
        return output

    return _start("broadcast", name, process_set, meta, run)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start giving every rank the root's ``tensor`` (a new tensor; ``tensor`` is not modified)."""
    return _broadcast_async(tensor, torch.empty_like(tensor), root_rank, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """:func:`broadcast_async`, in place."""
    return _broadcast_async(tensor, tensor, root_rank, name, process_set)


class _Broadcast(torch.autograd.Function):
    """The backward of a broadcast: the gradient averaged over the ranks, kept on the root (zero elsewhere),
    as Horovod's."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        reduced = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        if basics.rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """The root's ``tensor`` on every rank, as a new tensor; differentiable.  ``root_rank`` is a global rank."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """:func:`broadcast`, in place (returns ``tensor``)."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# -- alltoall ------------------------------------------------------------------------------------------

def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start sending rows ``splits[r]`` of ``tensor`` (in order; equal parts without ``splits``) to each rank
    ``r`` of the set; ``synchronize`` gives (received tensor, received splits)."""
    _check_tensor(tensor, "alltoall")
    members = process_set.size()
    rows = _rows(tensor)
    if splits is None:
        if rows % members:
            raise ValueError(f"alltoall: the first dimension ({rows}) must divide evenly by the {members} ranks "
                             "when no splits are given")
        counts = [rows // members] * members
    else:
        if isinstance(splits, torch.Tensor):
            if splits.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"alltoall: splits must be an int32 or int64 tensor, got {splits.dtype}")
            splits = splits.tolist()
        counts = [int(s) for s in splits]
        if len(counts) != members or sum(counts) != rows or min(counts, default=0) < 0:
            raise ValueError(f"alltoall: splits {counts} must give one count per rank ({members}) adding up to "
                             f"the first dimension ({rows})")
    meta = {"dtype": str(tensor.dtype), "shape": tuple(tensor.shape[1:]), "splits": tuple(counts),
            "dims": tensor.dim()}
    name = _name("alltoall", name, process_set)

    def run(metas, joined):
        _refuse_joined("alltoall", name, joined)
        _agree("alltoall", name, metas, "dtype", "shape", "dims")
        me = process_set.rank()
        received = [metas[r]["splits"][me] for r in process_set.ranks]
        per_row = int(np.prod(tensor.shape[1:])) if tensor.dim() > 1 else 1
        source = TensorBuffer(tensor.reshape(tensor.shape or (1,)), read_only=True)
        output = torch.empty((sum(received), *tensor.shape[1:]), dtype=source.tensor.dtype)
        sends, receives = np.array(counts, np.int64) * per_row, np.array(received, np.int64) * per_row
        MPI.Intracomm.Alltoallv(process_set.comm, [source.array, (sends, _offsets(sends))],
                                [as_array(output), (receives, _offsets(receives))])
        return output.to(tensor.dtype), torch.tensor(received, dtype=torch.int32)

    return _start("alltoall", name, process_set, meta, run)


def _offsets(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


class _Alltoall(torch.autograd.Function):
    """The backward of an alltoall is an alltoall of the gradient with the received splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, *unused):
        grad, _ = alltoall(grad_output, splits=ctx.received, process_set=ctx.process_set)
        return grad, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rows ``splits[r]`` of ``tensor`` to each rank ``r``; returns the rows received (and, with ``splits``,
    how many came from each rank); differentiable."""
    return _Alltoall.apply(tensor, splits, name, process_set)


# -- reducescatter -------------------------------------------------------------------------------------

def _scatter_rows(rows: int, members: int) -> list[int]:
    """Horovod's split of the first dimension: equal parts, the first ``rows % members`` ranks one more."""
    return [rows // members + (1 if r < rows % members else 0) for r in range(members)]


def _reducescatter_one(process_set, tensor, op, prescale, postscale) -> torch.Tensor:
    members, me = process_set.size(), process_set.rank()
    counts = _scatter_rows(tensor.shape[0], members)
    per_row = int(np.prod(tensor.shape[1:])) if tensor.dim() > 1 else 1
    source = TensorBuffer(tensor, read_only=True)
    send = source.tensor
    if prescale != 1.0:
        send = send.clone()
        _scale(send, prescale)
    output = torch.empty((counts[me], *tensor.shape[1:]), dtype=source.tensor.dtype)
    MPI.Intracomm.Reduce_scatter(process_set.comm, as_array(send.contiguous()), as_array(output),
                                 [c * per_row for c in counts], _MPI_OPS[op])
    with torch.no_grad():
        if op == Average:
            _divide(output, members)
        _scale(output, postscale)
    return output.to(tensor.dtype)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0) -> int:
    """Start reducing ``tensor`` over the ranks and keeping this rank's part of the first dimension."""
    _check_tensor(tensor, "reducescatter")
    op = _op(op, None, "reducescatter")
    if tensor.dim() == 0:
        raise HorovodInternalError("reducescatter: a scalar has no first dimension to scatter")
    meta = _meta(tensor, op=op, prescale=float(prescale_factor), postscale=float(postscale_factor))
    name = _name("reducescatter", name, process_set)

    def run(metas, joined):
        _refuse_joined("reducescatter", name, joined)
        _agree("reducescatter", name, metas, "shape", "dtype", "op", "prescale", "postscale", "device")
        return _reducescatter_one(process_set, tensor, op, prescale_factor, postscale_factor)

    return _start("reducescatter", name, process_set, meta, run)


class _Reducescatter(torch.autograd.Function):
    """The backward of a reducescatter: the parts' gradients gathered, times the set's size for Sum and times
    the scale factors (Horovod's)."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.op, ctx.process_set = op, process_set
        ctx.scale = prescale_factor * postscale_factor
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.op == Sum:
            grad_output = grad_output * ctx.process_set.size()
        if ctx.scale != 1.0:
            grad_output = grad_output * ctx.scale
        return allgather(grad_output, process_set=ctx.process_set), None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0) -> torch.Tensor:
    """``tensor`` reduced over the ranks, this rank's part of its first dimension; differentiable."""
    compressed, context = compression.compress(tensor)
    reduced = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(reduced, context)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    op = _op(op, None, "grouped_reducescatter")
    for tensor in tensors:
        _check_tensor(tensor, "grouped_reducescatter")
        if tensor.dim() == 0:
            raise HorovodInternalError("grouped_reducescatter: a scalar has no first dimension to scatter")
    meta = {"tensors": tuple((str(t.dtype), tuple(t.shape)) for t in tensors), "op": op,
            "prescale": float(prescale_factor), "postscale": float(postscale_factor)}
    name = _name("grouped_reducescatter", name, process_set)

    def run(metas, joined):
        _refuse_joined("grouped_reducescatter", name, joined)
        _agree("grouped_reducescatter", name, metas, "tensors", "op", "prescale", "postscale")
        return [_reducescatter_one(process_set, t, op, prescale_factor, postscale_factor) for t in tensors]

    return _start("grouped_reducescatter", name, process_set, meta, run)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.op, ctx.process_set, ctx.scale = op, process_set, prescale_factor * postscale_factor
        return tuple(synchronize(grouped_reducescatter_async(list(tensors), name, op, process_set,
                                                             prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        factor = ctx.scale * (ctx.process_set.size() if ctx.op == Sum else 1)
        grads = [g * factor if factor != 1 else g for g in grad_outputs]
        return (None, None, None, None, None, *grouped_allgather(grads, process_set=ctx.process_set))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0) -> list:
    compressed, contexts = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    reduced = _GroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor, *compressed)
    return [compression.decompress(t, c) for t, c in zip(reduced, contexts)]


# -- join and barrier ----------------------------------------------------------------------------------

def join(device=-1) -> int:
    """This rank has run out of data: it takes part in the others' allreduces with zeros until every rank has
    joined.  Returns the rank that joined last (the same on every rank)."""
    request = Request("join", "join", global_process_set, {}, None)
    basics.controller().join(request)
    request.done.wait()
    if request.error is not None:
        raise request.error
    return request.result


def take_part_joined(kind: str, meta: dict, process_set: ProcessSet, asked: dict, joined: list) -> None:
    """A joined rank's part in an op the other ranks run: zeros in an allreduce; nothing else has one."""
    if kind == "allreduce":
        _reduce_in_place(process_set, _zeros(meta["dtype"], meta["shape"]), meta["op"], meta["prescale"],
                         meta["postscale"])
    elif kind == "grouped_allreduce":
        for dtype, shape in meta["tensors"]:
            _reduce_in_place(process_set, _zeros(dtype, shape), meta["op"], meta["prescale"], meta["postscale"])
    elif kind == "compressed_allreduce" and meta["compression"][0] != "powersgd":   # (PowerSGD refuses them)
        zeros = [_zeros(dtype, shape) for dtype, shape in meta["tensors"]]
        _reduce_compressed(process_set, zeros, meta["op"], meta["prescale"], meta["postscale"],
                           Rounding(meta["compression"][0]), "joined")


def _zeros(dtype: str, shape) -> torch.Tensor:
    """Zeros of a tensor an op's metadata describes (``str(tensor.dtype)``, its shape)."""
    return torch.zeros(shape, dtype=getattr(torch, dtype.split(".")[-1]))


def barrier(process_set=global_process_set) -> None:
    """Wait until every rank of the set has reached this barrier (and everything it asked before)."""
    synchronize(_start("barrier", _name("barrier", None, process_set), process_set, {}, lambda metas, joined: None))
