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

import numpy as np
from mpi4py import MPI

from ... import arrays
from ...base.chunks import balanced_bounds, block_bounds, segments
from ...base.tags import Tag
from .base import Algorithm, MpiBuffers

__all__ = ["Direct", "owner_rounded_sum"]


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

    def allreduce_compressed(self, ctx, send, recv, reduction, compression, key):
        """Each chunk rounded once more, by its owner, after summing its contributions in their own precision
        (:func:`owner_rounded_sum`): with error feedback, nothing of any rounding is lost."""
        data = recv if send is None else send
        owner_rounded_sum(ctx, data, recv, compression, compression.residual(key, data))

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
    parts = _exchanged(ctx, buffers, source, bounds)
    result = buffers.scratch("result", parts[0].size, source.dtype)
    reduction.combine(parts[0], parts[1], out=result)
    for part in parts[2:]:
        reduction.combine(result, part, out=result)
    return result


def _exchanged(ctx, buffers: MpiBuffers, source, bounds) -> list:
    """Every rank's chunk ``ctx.rank`` of ``source``, in rank order (this rank's own: a view of ``source``)."""
    p, r, others = ctx.size, ctx.rank, ctx.others()
    mine = slice(bounds[r], bounds[r + 1])
    width = mine.stop - mine.start
    outgoing = buffers.readable("out", source)
    inbox = buffers.landing("inbox", p * width, source.dtype)
    received = [ctx.irecv(inbox[q * width:(q + 1) * width], q, Tag.DIRECT) for q in others]
    sent = [ctx.isend(outgoing[bounds[q]:bounds[q + 1]], q, Tag.DIRECT) for q in others]
    ctx.waitall(received + sent, others + others)
    contributions = buffers.beside(inbox, "contributions")
    return [source[mine] if q == r else contributions[q * width:(q + 1) * width] for q in range(p)]


# Elements of 16-bit words per piece of a compressed exchange: each piece goes out as soon as it is rounded,
# and is summed, rounded and sent back as soon as it has arrived, so the rounding and widening overlap the wire.
PIECE_ELEMENTS = 128 << 10


def owner_rounded_sum(ctx, data, recv, compression, residual) -> None:
    """``recv`` <- the sum over ``ctx``'s ranks of ``data`` (float32 or float64, host), moved as
    ``compression``'s 16-bit words and rounded twice only: each rank rounds its contribution, and the owner of
    each chunk sums the chunk's contributions in their own precision and rounds that sum once.  ``residual``
    (error feedback, or None) takes both: this rank's own rounding, and in the chunk it owns the sum's, so the
    ranks' residuals together carry every rounding of the call.  ``recv`` may be ``data``.

    The chunks travel in pieces (:data:`PIECE_ELEMENTS`), every receive posted first: a piece is sent as soon
    as it is rounded, summed at its owner as soon as every rank's has come, and sent back at once, so that
    the arithmetic of one piece overlaps the transfer of the others."""
    p, r, others = ctx.size, ctx.rank, ctx.others()
    bounds = balanced_bounds(data.size, p)
    pieces = [segments(bounds[q], bounds[q + 1], PIECE_ELEMENTS) for q in range(p)]
    words = ctx.scratch("direct.words", data.size, np.uint16)         # what this rank rounds and sends
    summed = ctx.scratch("direct.summed", data.size, np.uint16)       # the owners' rounded sums it receives
    width = bounds[r + 1] - bounds[r]
    inbox = ctx.scratch("direct.inbox", p * width, np.uint16)

    def landing(q, piece):          # where rank q's part of this rank's chunk lands
        return inbox[q * width + piece.start - bounds[r]: q * width + piece.stop - bounds[r]]

    parts = [[ctx.irecv(landing(q, piece), q, Tag.DIRECT) for piece in pieces[r]] if q != r else []
             for q in range(p)]
    results = [[ctx.irecv(summed[piece], q, Tag.DIRECT_GATHER) for piece in pieces[q]] if q != r else []
               for q in range(p)]
    sent, to = [], []
    for k in range(max(map(len, pieces))):                      # round piece k of every chunk, send it
        for q in range(r, r + p):
            q %= p
            if k < len(pieces[q]):
                piece = pieces[q][k]
                compression.narrow(data[piece], words[piece], None if residual is None else residual[piece])
                if q != r:
                    sent.append(ctx.isend(words[piece], q, Tag.DIRECT))
                    to.append(q)
    total, term = (ctx.scratch(f"direct.{name}", min(width, PIECE_ELEMENTS), data.dtype) for name in ("total", "term"))
    for k, piece in enumerate(pieces[r]):                       # sum each piece of this rank's chunk, round, send
        ctx.waitall([parts[q][k] for q in others], others)
        n = piece.stop - piece.start
        exact, carried = total[:n], None if residual is None else np.zeros(n, data.dtype)
        compression.decompress(words[piece], exact)
        for q in others:
            exact += compression.decompress(landing(q, piece), term[:n])
        compression.narrow(exact, summed[piece], carried)
        if residual is not None:
            residual[piece] += carried
        compression.decompress(summed[piece], recv[piece])
        sent += [ctx.isend(summed[piece], q, Tag.DIRECT_GATHER) for q in others]
        to += others
    for k in range(max(map(len, pieces))):                      # widen the others' chunks as they come
        for q in others:
            if k < len(pieces[q]):
                piece = pieces[q][k]
                ctx.wait(results[q][k], q)
                compression.decompress(summed[piece], recv[piece])
    ctx.waitall(sent, to)


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
