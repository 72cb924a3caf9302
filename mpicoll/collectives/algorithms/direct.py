"""Direct exchange: every rank sends chunk q of its buffer straight to rank q, then an allgather.

Allreduce as a direct reduce-scatter followed by a direct allgather: rank r
receives chunk r of every rank's buffer (p-1 messages posted at once, each
rank sending and receiving (p-1)/p of the buffer, as in the ring), folds the
p contributions in rank order, ``((x[0] op x[1]) op x[2]) op ...``, so every
rank gets the same bits and non-commutative ops need nothing special, and
sends its reduced chunk to every other rank.  Two rounds of messages instead
of the ring's 2(p-1) steps: made for buffers whose reduction runs on a GPU.

It serves host and device arrays alike.  Device buffers are reduced on the
GPU (:meth:`mpicoll.collectives.reduction.Reduction.combine`) and handed to MPI
directly when the MPI library is CUDA-aware (:func:`mpicoll.arrays.cuda_aware`),
otherwise through page-locked host buffers that are allocated once and reused.
"""

from __future__ import annotations

from mpi4py import MPI

from ... import arrays
from ...base.chunks import balanced_bounds, block_bounds
from ...base.tags import Tag
from .base import Algorithm, MpiBuffers

__all__ = ["Direct"]


class Direct(Algorithm):
    name = "direct"
    device = True

    def allreduce(self, ctx, send, recv, reduction):
        source = recv if send is None else send
        if ctx.size == 1:
            if send is not None:
                arrays.copy(send, recv)
            return
        bounds = balanced_bounds(recv.size, ctx.size)
        buffers = MpiBuffers(ctx, recv, "direct")
        chunk = _exchange_and_fold(ctx, buffers, source, bounds, reduction)
        _gather_into(ctx, buffers, chunk, recv, bounds)

    def reduce_scatter_block(self, ctx, send, recv, reduction):
        if ctx.size == 1:
            arrays.copy(send[:recv.size], recv)
            return
        buffers = MpiBuffers(ctx, recv, "direct")
        arrays.copy(_exchange_and_fold(ctx, buffers, send, block_bounds(recv.size, ctx.size), reduction), recv)

    def allgather(self, ctx, send, recv):
        bounds = block_bounds(recv.size // ctx.size, ctx.size)
        mine = recv[bounds[ctx.rank]:bounds[ctx.rank + 1]] if send is None else send
        _gather_into(ctx, MpiBuffers(ctx, recv, "direct"), mine, recv, bounds)

    def bcast(self, ctx, buf, root):
        buffers = MpiBuffers(ctx, buf, "direct")
        data = buffers.readable("bcast", buf) if ctx.rank == root else buffers.writable("bcast", buf)
        ctx.waitall([ctx.comm.Ibcast([data.view("u1"), MPI.BYTE], root)], ctx.others())
        if ctx.rank != root:
            buffers.deliver(data, buf)


def _exchange_and_fold(ctx, buffers: MpiBuffers, source, bounds, reduction):
    """Every rank's chunk ``ctx.rank`` of ``source`` folded in rank order; returns an array beside the data."""
    p, r, others = ctx.size, ctx.rank, ctx.others()
    mine = slice(bounds[r], bounds[r + 1])
    width = mine.stop - mine.start
    outgoing = buffers.readable("out", source)
    inbox = buffers.landing("inbox", p * width, source.dtype)
    received = [ctx.irecv(inbox[q * width:(q + 1) * width], q, Tag.DIRECT) for q in others]
    sent = [ctx.isend(outgoing[bounds[q]:bounds[q + 1]], q, Tag.DIRECT) for q in others]
    ctx.waitall(received + sent, others + others)
    contributions = buffers.beside(inbox, "contributions")
    parts = [source[mine] if q == r else contributions[q * width:(q + 1) * width] for q in range(p)]
    result = buffers.scratch("result", width, source.dtype)
    reduction.combine(parts[0], parts[1], out=result)
    for q in range(2, p):
        reduction.combine(result, parts[q], out=result)
    return result


def _gather_into(ctx, buffers: MpiBuffers, chunk, target, bounds) -> None:
    """Every rank's ``chunk`` into its place in ``target``."""
    r, others = ctx.rank, ctx.others()
    gathered = buffers.writable("gathered", target)
    mine = gathered[bounds[r]:bounds[r + 1]]
    if buffers.staged:
        arrays.to_host(chunk, mine)
    else:
        arrays.copy(chunk, mine)
        if buffers.library is not None:
            arrays.synchronize(buffers.library)
    received = [ctx.irecv(gathered[bounds[q]:bounds[q + 1]], q, Tag.DIRECT_GATHER) for q in others]
    sent = [ctx.isend(mine, q, Tag.DIRECT_GATHER) for q in others]
    ctx.waitall(received + sent, others + others)
    buffers.deliver(gathered, target)
