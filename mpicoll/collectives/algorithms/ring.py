"""Ring allreduce: reduce-scatter, then allgather, around a logical ring.

The buffer is cut into p chunks (sizes differ by at most one element, some may
be empty).  Rank r sends to its right neighbour r+1 and receives from its
left neighbour r-1::

      +-> 0 -> 1 -> 2 -> 3 --+
      +----------------------+

Reduce-scatter, p-1 steps.  At step k rank r sends chunk (r-k-1) and receives
chunk (r-k-2), which it reduces with its own contribution:

    step  rank 0      rank 1      rank 2      rank 3       (p = 4, "sends/receives")
    0     c3 / c2     c0 / c3     c1 / c0     c2 / c1
    1     c2 / c1     c3 / c2     c0 / c3     c1 / c0
    2     c1 / c0     c2 / c1     c3 / c2     c0 / c3      -> rank r owns chunk r

Allgather, p-1 steps: at step k rank r forwards chunk (r-k) and receives
chunk (r-k-1), already final, straight into the output.

Each rank sends and receives 2(p-1)/p of the buffer, which no allreduce can
beat, and reduces (p-1)/p of it.  Chunks are sent in segments
(``MPICOLL_SEGMENT``): a segment is forwarded as soon as it is reduced, so
the next transfer overlaps the rest of the reduction.  Receive buffers are
scratch memory that is allocated once and reused.

Reduction order: chunk j is reduced along the ring starting after its owner,
``x[j+1] op x[j+2] op ... op x[j]`` (indices mod p), each chunk exactly once;
all ranks then copy the same bits.  A non-commutative op must be reduced in
rank order, so the ring is cut between rank p-1 and rank 0: rank 0 starts
each partial afresh, and rank p-1 sends its partial ``x[j+1] op ... op
x[p-1]`` straight to the chunk's owner j, which finishes with
``(x[0] op ... op x[j]) op (x[j+1] op ... op x[p-1])``; the same bytes move.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...base.chunks import balanced_bounds, block_bounds, segment_elements, segments
from ...base.tags import Tag
from .base import Algorithm
from .ring_shared import shared_reduce_scatter

if TYPE_CHECKING:                    # annotations only
    from ...channel.context import Context
    from ..reduction import Reduction

__all__ = ["Ring"]

# Bytes of buffer from which the reduce-scatter writes its final chunks around the caches
# (mpicoll.compute.streaming).  Measured at 2 ranks: 4 MiB 10% slower, 16 and 64 MiB 11% faster.
STREAM_FROM = 16 << 20


class Ring(Algorithm):
    name = "ring"

    def allreduce(self, ctx, send, recv, reduction):
        if ctx.size == 1 or recv.size == 0:
            if send is not None:
                recv[...] = send
            return
        source = recv if send is None else send
        bounds = balanced_bounds(recv.size, ctx.size)
        if ctx.channel == "shared":
            shared_reduce_scatter(ctx, source, bounds, reduction, gather_into=recv)
            return
        ctx.waitall(*reduce_scatter(ctx, source, recv, bounds, reduction))
        allgather_in_place(ctx, recv, bounds)

    def reduce_scatter_block(self, ctx, send, recv, reduction):
        if ctx.size == 1:
            recv[...] = send[: recv.size]
            return
        bounds = block_bounds(recv.size, ctx.size)
        if ctx.channel == "shared":
            shared_reduce_scatter(ctx, send, bounds, reduction, keep_into=recv)
            return
        partial = ctx.scratch("ring.partial", send.size, send.dtype)
        ctx.waitall(*reduce_scatter(ctx, send, partial, bounds, reduction))
        recv[...] = partial[bounds[ctx.rank]: bounds[ctx.rank + 1]]

    def allgather(self, ctx, send, recv):
        bounds = block_bounds(recv.size // ctx.size, ctx.size)
        if send is not None:
            recv[bounds[ctx.rank]: bounds[ctx.rank + 1]] = send
        allgather_in_place(ctx, recv, bounds)

    def bcast(self, ctx, buf, root):
        chain_bcast(ctx, buf, root)


def reduce_scatter(ctx: Context, send: np.ndarray, partial: np.ndarray, bounds: list[int],
                   reduction: Reduction) -> tuple[list, list]:
    """Leave the fully reduced chunk ``ctx.rank`` in ``partial``.

    ``send`` may be ``partial`` itself (in place).  Returns the send requests
    still in flight and their peers: the caller waits on them before it
    writes ``partial`` again.
    """
    p, r = ctx.size, ctx.rank
    left, right = (r - 1) % p, (r + 1) % p
    cut = not reduction.commutative
    starts_partials = cut and r == 0          # rank 0 receives nothing when the ring is cut
    step = segment_elements(ctx.segment_bytes, partial.itemsize)

    def chunk_segments(c):
        return segments(bounds[c], bounds[c + 1], step)

    def destination(chunk):
        return chunk if cut and r == p - 1 else right

    tag = Tag.RING_HIGH if cut and r == p - 1 else Tag.RING
    # Step k reduces chunk (r-k-2); its result is sent at step k+1.  Incoming
    # segments land in a few cache-sized slots, reused in turn, so the data
    # crosses memory once on its way to the reduction.
    plan = [(k, s) for k in range(p - 1) for s in chunk_segments((r - k - 2) % p)]
    landing = LandingSlots(ctx, partial.dtype, step, [] if starts_partials else plan, left, Tag.RING)

    high = []
    if cut and r < p - 1:
        high_part = ctx.scratch("ring.high", bounds[r + 1] - bounds[r], partial.dtype)
        high = [ctx.irecv(high_part[s.start - bounds[r]: s.stop - bounds[r]], p - 1, Tag.RING_HIGH)
                for s in chunk_segments(r)]
    first = (r - 1) % p
    sends = [ctx.isend(send[s], destination(first), tag) for s in chunk_segments(first)]
    peers = [destination(first)] * len(sends)

    streams = partial.nbytes >= STREAM_FROM
    for k, s in plan:
        if starts_partials:
            partial[s] = send[s]
        else:
            # the last step's result is final: past the caches' size it is next read long after
            reduction.combine(landing.next(), send[s], out=partial[s], streaming=streams and k == p - 2)
            landing.release()
        if k < p - 2:
            chunk = (r - k - 2) % p
            sends.append(ctx.isend(partial[s], destination(chunk), tag))
            peers.append(destination(chunk))

    if high:
        ctx.waitall(high, p - 1)
        mine = partial[bounds[r]: bounds[r + 1]]
        reduction.combine(mine, high_part, out=mine)
    return sends, peers


class LandingSlots:
    """Receive a planned sequence of segments from one peer into a few reused slots.

    ``next()`` waits for the next segment and returns it; ``release()`` hands
    its slot to the segment ``len(slots)`` places later in the plan.
    """

    SLOTS = 4

    def __init__(self, ctx: Context, dtype, width: int, plan: list, source: int, tag: int):
        self.ctx, self.source, self.tag = ctx, source, tag
        self.sizes = [s.stop - s.start for _, s in plan]
        slots = min(self.SLOTS, len(plan))
        memory = ctx.scratch("ring.landing", slots * width, dtype)
        self.slots = [memory[i * width: (i + 1) * width] for i in range(slots)]
        self.requests = [self._post(i) for i in range(slots)]
        self.position = 0

    def _post(self, index: int):
        slot = self.slots[index % len(self.slots)]
        return self.ctx.irecv(slot[: self.sizes[index]], self.source, self.tag)

    def next(self) -> np.ndarray:
        i = self.position
        self.ctx.wait(self.requests[i % len(self.slots)], self.source)
        return self.slots[i % len(self.slots)][: self.sizes[i]]

    def release(self) -> None:
        i = self.position
        self.position += 1
        if i + len(self.slots) < len(self.sizes):
            self.requests[i % len(self.slots)] = self._post(i + len(self.slots))


def allgather_in_place(ctx: Context, buf: np.ndarray, bounds: list[int]) -> None:
    """Every rank holds chunk ``rank`` of ``buf``; afterwards all hold all chunks."""
    p, r = ctx.size, ctx.rank
    if p == 1:
        return
    left, right = (r - 1) % p, (r + 1) % p
    # Segments let a rank forward what it has while the rest still comes; at 2 ranks nothing is forwarded, and
    # each segment is a rendezvous of its own: one message a chunk (64 MiB float32, interleaved with segments
    # and an A/A control: 3-9% faster in 6 of 6 runs; 4-32 MiB within the runs' noise)
    step = segment_elements(ctx.segment_bytes, buf.itemsize) if p > 2 else max(1, len(buf))

    def chunk_segments(c):
        return segments(bounds[c], bounds[c + 1], step)

    received = [[ctx.irecv(buf[s], left, Tag.RING_GATHER) for s in chunk_segments((r - k - 1) % p)]
                for k in range(p - 1)]
    sends = [ctx.isend(buf[s], right, Tag.RING_GATHER) for s in chunk_segments(r)]
    for k in range(p - 1):
        # Invariant: step k receives chunk (r-k-1), which step k+1 forwards.
        for request, s in zip(received[k], chunk_segments((r - k - 1) % p)):
            ctx.wait(request, left)
            if k < p - 2:
                sends.append(ctx.isend(buf[s], right, Tag.RING_GATHER))
    ctx.waitall(sends, right)


def chain_bcast(ctx: Context, buf: np.ndarray, root: int) -> None:
    """Pipeline ``buf`` down the chain root, root+1, ..., root-1, one segment at a time."""
    p, r = ctx.size, ctx.rank
    if p == 1:
        return
    position = (r - root) % p
    parent, child = (r - 1) % p, (r + 1) % p
    pieces = segments(0, buf.size, segment_elements(ctx.segment_bytes, buf.itemsize))
    forward = position < p - 1
    if position == 0:
        ctx.waitall([ctx.isend(buf[s], child, Tag.RING_CHAIN) for s in pieces], child)
        return
    received = [ctx.irecv(buf[s], parent, Tag.RING_CHAIN) for s in pieces]
    sends = []
    for request, s in zip(received, pieces):
        ctx.wait(request, parent)
        if forward:
            sends.append(ctx.isend(buf[s], child, Tag.RING_CHAIN))
    ctx.waitall(sends, child)
