"""Parallel allreduce: every rank sends its whole buffer to every other rank.

Each rank then holds all p contributions and folds them in rank order,
``((x[0] op x[1]) op x[2]) op ...``, the same order on every rank, so every
rank computes the same bits and non-commutative ops need nothing special.
All transfers are posted at once (nonblocking); the fold starts on the lower
ranks' data while the higher ranks' is still arriving.

Each rank sends and receives (p-1) times the buffer, against 2(p-1)/p for
the ring, and needs (p-1) buffers of scratch: a single round of messages
makes it attractive only when latency dominates or p is small.
"""

from __future__ import annotations

import numpy as np

from ...base.chunks import block_bounds
from ...base.tags import Tag
from .base import Algorithm

__all__ = ["Parallel"]



class Parallel(Algorithm):
    name = "parallel"

    def allreduce(self, ctx, send, recv, reduction):
        p, r = ctx.size, ctx.rank
        if send is None:  # in place: keep our contribution safe from the fold into recv
            send = ctx.scratch("parallel.own", recv.size, recv.dtype)
            send[...] = recv
        if p == 1:
            recv[...] = send
            return
        inbox = ctx.scratch("parallel.inbox", p * recv.size, recv.dtype).reshape(p, recv.size)
        contributions = [send if q == r else inbox[q] for q in range(p)]
        self._exchange(ctx, [send] * p, contributions, reduction, recv)

    def reduce_scatter_block(self, ctx, send, recv, reduction):
        p, r = ctx.size, ctx.rank
        bounds = block_bounds(recv.size, p)
        blocks = [send[bounds[q]: bounds[q + 1]] for q in range(p)]
        if p == 1:
            recv[...] = blocks[0]
            return
        inbox = ctx.scratch("parallel.inbox", p * recv.size, recv.dtype).reshape(p, recv.size)
        contributions = [blocks[r] if q == r else inbox[q] for q in range(p)]
        out = recv if not np.may_share_memory(recv, send) else ctx.scratch("parallel.out", recv.size, recv.dtype)
        self._exchange(ctx, blocks, contributions, reduction, out)
        if out is not recv:
            recv[...] = out

    @staticmethod
    def _exchange(ctx, outgoing, contributions, reduction, out):
        """Send outgoing[q] to each rank q, receive into contributions[q], fold them into ``out``."""
        p, r = ctx.size, ctx.rank
        received = {q: ctx.irecv(contributions[q], q, Tag.PARALLEL) for q in range(p) if q != r}
        sends = [ctx.isend(outgoing[q], q, Tag.PARALLEL) for q in range(p) if q != r]
        for q in (0, 1):
            if q in received:
                ctx.wait(received.pop(q), q)
        reduction.combine(contributions[0], contributions[1], out=out)
        for q in range(2, p):
            if q in received:
                ctx.wait(received.pop(q), q)
            reduction.combine(out, contributions[q], out=out)
        ctx.waitall(sends, [q for q in range(p) if q != r])

    def allgather(self, ctx, send, recv):
        p, r = ctx.size, ctx.rank
        bounds = block_bounds(recv.size // p, p)
        mine = recv[bounds[r]: bounds[r + 1]]
        if send is not None:
            mine[...] = send
        received = [ctx.irecv(recv[bounds[q]: bounds[q + 1]], q, Tag.PARALLEL) for q in range(p) if q != r]
        sends = [ctx.isend(mine, q, Tag.PARALLEL) for q in range(p) if q != r]
        others = [q for q in range(p) if q != r]
        ctx.waitall(received + sends, others + others)

    def bcast(self, ctx, buf, root):
        if ctx.rank == root:
            others = [q for q in range(ctx.size) if q != root]
            ctx.waitall([ctx.isend(buf, q, Tag.PARALLEL) for q in others], others)
        else:
            ctx.wait(ctx.irecv(buf, root, Tag.PARALLEL), root)

