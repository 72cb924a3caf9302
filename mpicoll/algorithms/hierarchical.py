"""Hierarchical allreduce: inside nodes, between nodes, inside nodes again.

On n nodes of k ranks each, a flat ring sends 2(p-1)/p of the buffer from
every *rank*, so a node's link carries the sends of every ring edge that
leaves it.  Here the buffer is cut into k slices:

1. inside each node, a reduce-scatter: local rank j ends with slice j summed
   over its node (no link crossed; over shared memory the slice stays in
   local rank j's region, where steps 2 and 3 use it in place);
2. between nodes, local rank j of every node runs a ring allreduce of slice j:
   each node sends 2(n-1)/n of the buffer in all, the least any allreduce can,
   and its k ranks drive the link at once;
3. inside each node, an allgather of the k slices.

Every slice is reduced once and then copied, so every rank gets the same
bits.  Node sums come first and nodes are then combined in node order, which
is rank order when every node holds consecutive ranks; a non-commutative op on
another layout runs the flat ring.  On one node, or with one rank per node,
this is the ring; across nodes, messages under ``ACROSS_NODES_FROM`` go to
MPI's own allreduce, which wins there.
"""

from __future__ import annotations

from ..chunks import balanced_bounds
from ..errors import MpicollError
from ..nodes import node_layout
from .base import Algorithm
from .mpi import Mpi
from .ring import Ring, allgather_in_place, reduce_scatter
from .ring_shared import shared_reduce_scatter

__all__ = ["Hierarchical", "ACROSS_NODES_FROM"]

_RING, _MPI = Ring(), Mpi()

# bytes: below this, across several nodes of several ranks, MPI's own allreduce (its latency-bound
# algorithms win there).  Measured on 2 emulated nodes x 2 ranks at 1 Gbit/s (docs/multi-node.md):
# MPI ahead at 1 MiB (0.90x), even at 4 MiB (1.03x), 1.66x behind at 16 MiB.
ACROSS_NODES_FROM = 4 << 20


class Hierarchical(Algorithm):
    name = "hierarchical"

    def allreduce(self, ctx, send, recv, reduction):
        layout = node_layout(ctx) if ctx.size > 1 else None
        if (layout is None or not layout.layered or recv.size < layout.per_node
                or not (reduction.commutative or layout.contiguous)):
            _RING.allreduce(ctx, send, recv, reduction)
            return
        if recv.nbytes < ACROSS_NODES_FROM:
            ctx.compare_calls_now()         # MPI's blocking call cannot be interrupted by a disagreement
            _MPI.allreduce(ctx, send, recv, reduction)
            return
        local, cross = layout.local, layout.cross
        bounds = balanced_bounds(recv.size, layout.per_node)

        def between_nodes(chunk):
            _RING.allreduce(cross, None, chunk, reduction)

        try:
            if local.channel == "shared":      # the slice stays in shared memory; the others read it there
                shared_reduce_scatter(local, recv if send is None else send, bounds, reduction, gather_into=recv,
                                      then=between_nodes)
                return
            if send is not None:
                recv[...] = send
            local.waitall(*reduce_scatter(local, recv, recv, bounds, reduction))
            between_nodes(recv[bounds[local.rank]: bounds[local.rank + 1]])
            allgather_in_place(local, recv, bounds)
        except MpicollError as error:
            raise ctx.broken_by(error) if (local.broken or cross.broken) else error

    def reduce_scatter_block(self, ctx, send, recv, reduction):
        _RING.reduce_scatter_block(ctx, send, recv, reduction)

    def allgather(self, ctx, send, recv):
        _RING.allgather(ctx, send, recv)

    def bcast(self, ctx, buf, root):
        _RING.bcast(ctx, buf, root)
