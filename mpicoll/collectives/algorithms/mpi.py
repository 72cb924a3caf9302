"""The MPI library's own collectives, for comparison and as a candidate of ``auto``.

MIN and MAX on host floating-point arrays keep a NaN, as numpy's and mpicoll's other algorithms do
(:func:`mpicoll.base.ops.as_numpy_has_it`; MPI's predefined ones drop it or not by which rank holds it).

Device arrays go to MPI as they are when it is CUDA-aware; otherwise through
pinned host copies (:class:`~mpicoll.collectives.algorithms.base.MpiBuffers`), and MPI
reduces on the host.
"""

from __future__ import annotations

from mpi4py import MPI

from ...base.collectives import ALLGATHER, ALLREDUCE, BCAST, REDUCE_SCATTER_BLOCK, Collective
from ...base.ops import as_numpy_has_it
from ...channel import watchdog
from .base import Algorithm, MpiBuffers

__all__ = ["Mpi"]


class Mpi(Algorithm):
    """Hands the call to MPI unchanged; its reduction order is the library's."""

    name = "mpi"
    device = True

    def allreduce(self, ctx, send, recv, reduction):
        buffers, datatype = MpiBuffers(ctx, recv, "mpi"), reduction.datatype
        if send is None:
            data = buffers.readable("recv", recv)
            _call(ctx, ALLREDUCE, MPI.IN_PLACE, [data, data.size, datatype], as_numpy_has_it(reduction.op, data))
        else:
            source, data = buffers.readable("send", send), buffers.writable("recv", recv)
            _call(ctx, ALLREDUCE, [source, source.size, datatype], [data, data.size, datatype],
                  as_numpy_has_it(reduction.op, data))
        buffers.deliver(data, recv)

    def reduce_scatter_block(self, ctx, send, recv, reduction):
        buffers, datatype = MpiBuffers(ctx, recv, "mpi"), reduction.datatype
        source, block = buffers.readable("send", send), recv.size    # mpi4py's explicit counts here are per rank
        if _same_memory(send, recv):
            _call(ctx, REDUCE_SCATTER_BLOCK, MPI.IN_PLACE, [source, block, datatype],
                  as_numpy_has_it(reduction.op, source))
            data = source[:block]
        else:
            data = buffers.writable("recv", recv)
            _call(ctx, REDUCE_SCATTER_BLOCK, [source, block, datatype], [data, block, datatype],
                  as_numpy_has_it(reduction.op, source))
        buffers.deliver(data, recv)

    def allgather(self, ctx, send, recv):
        buffers = MpiBuffers(ctx, recv, "mpi")
        data = buffers.readable("recv", recv) if send is None else buffers.writable("recv", recv)
        source = MPI.IN_PLACE if send is None else [buffers.readable("send", send).view("u1"), MPI.BYTE]
        _call(ctx, ALLGATHER, source, [data.view("u1"), MPI.BYTE])
        buffers.deliver(data, recv)

    def bcast(self, ctx, buf, root):
        buffers = MpiBuffers(ctx, buf, "mpi")
        data = buffers.readable("buf", buf) if ctx.rank == root else buffers.writable("buf", buf)
        _call(ctx, BCAST, [data.view("u1"), MPI.BYTE], root)
        if ctx.rank != root:
            buffers.deliver(data, buf)


def _call(ctx, collective: Collective, *args) -> None:
    """MPI's ``collective`` on the context's channel: blocking, under the watchdog's deadline, or, for a
    background context, its nonblocking form waited for by the context (naps instead of MPI's busy wait,
    and a deadline it raises at)."""
    if not ctx.background:
        with watchdog.watch_of(ctx, collective.method):      # past the deadline the watchdog ends the job
            getattr(ctx.comm, collective.method)(*args)
        return
    ctx.waitall([getattr(ctx.comm, collective.nonblocking)(*args)], ctx.others() or ctx.rank)


def _same_memory(a, b) -> bool:
    """True when ``b`` starts where ``a`` does (reduce-scatter in place), for host or device arrays."""
    def address(x):
        interface = getattr(x, "__array_interface__", None) or x.__cuda_array_interface__
        return interface["data"][0]
    return address(a) == address(b)
