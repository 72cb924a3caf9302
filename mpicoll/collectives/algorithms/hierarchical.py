"""Hierarchical collectives: inside nodes, between nodes, inside nodes again.

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

Inside a node, steps 1 and 3 go through the node's shared memory in C
(:mod:`~mpicoll.collectives.algorithms.node`) where it carries the call:
local rank j's slice is then block j of n // k elements, the last also
taking the n % k left over (reduced by the node whole, broadcast from it
after the ring).  Elsewhere (MPI's fault tolerance, an op the node does not
reduce, no C extension) the ring's shared-memory reduce-scatter or its
messages do.

Every slice is reduced once and then copied, so every rank gets the same
bits.  Node sums come first and nodes are then combined in node order, which
is rank order when every node holds consecutive ranks; a non-commutative op on
another layout runs the flat ring.  On one node, or with one rank per node,
this is the ring; across nodes, messages under ``ACROSS_NODES_FROM`` go to
MPI's own collective, which wins there.

Reduce-scatter and allgather split the same way when every node holds
consecutive ranks (their blocks follow rank order): local rank j works on
the blocks of local rank j of every node, regrouped into one scratch
buffer, so the ring between nodes carries (n-1)/n of the buffer per node
where a flat ring's one boundary edge carries (p-1)/p of it.  A reduce-
scatter sums inside the node first, then reduce-scatters between nodes; an
allgather gathers between nodes first, then inside.  A broadcast stays the
ring's chain, which crosses each node boundary once already.
"""

from __future__ import annotations

import contextlib

from ...base.chunks import balanced_bounds, block_bounds
from ...base.collectives import ALLGATHER, ALLREDUCE, COLLECTIVES, REDUCE_SCATTER_BLOCK
from ...base.errors import MpicollError
from ...channel.nodes import node_layout
from .base import Algorithm
from . import node
from .direct import owner_rounded_sum
from .mpi import Mpi
from .ring import Ring, allgather_in_place, reduce_scatter
from .ring_shared import shared_reduce_scatter

__all__ = ["Hierarchical", "ACROSS_NODES_FROM"]

_RING, _MPI = Ring(), Mpi()

# bytes of the whole message: below these, across several nodes of several ranks, MPI's own collective
# (its latency-bound algorithms win there); the collective table's measured thresholds, auto's rule there too.
ACROSS_NODES_FROM = {c.name: c.across_nodes_from for c in COLLECTIVES.values() if c.across_nodes_from is not None}


class Hierarchical(Algorithm):
    name = "hierarchical"

    def allreduce(self, ctx, send, recv, reduction):
        layout = _layered(ctx, reduction.commutative)
        if layout is None or recv.size < layout.per_node:
            _RING.allreduce(ctx, send, recv, reduction)
            return
        if recv.nbytes < ACROSS_NODES_FROM[ALLREDUCE.name]:
            ctx.compare_calls_now()         # MPI's blocking call cannot be interrupted by a disagreement
            _MPI.allreduce(ctx, send, recv, reduction)
            return

        def between_nodes(chunk, bounds):
            _RING.allreduce(layout.cross, None, chunk, reduction)
        _by_node(ctx, layout, send, recv, reduction, between_nodes)

    def allreduce_compressed(self, ctx, send, recv, reduction, compression, key):
        """Inside each node the contributions are summed in their own precision (over shared memory, no link
        crossed); only the node sums cross the nodes, as 16-bit words: local rank j of each node rounds its
        slice of its node's sum, and the slice's parts are summed in full precision by their owners and rounded
        once more (:func:`~mpicoll.collectives.algorithms.direct.owner_rounded_sum`), then widened back before
        the node gathers the slices.  Two roundings, whatever the rank count (within the documented bound), and
        each rank rounds and widens a slice, not the whole buffer.  With error feedback the ranks that round
        keep what each rounding took off (a rank's residual is zero outside what it rounded): together the
        residuals carry every rounding of the call into the next.  On one node, or with one rank per node,
        the owners round as :class:`~mpicoll.collectives.algorithms.direct.Direct` does (measured: as fast as
        the ring's rounding at every hop, on one node at 2 and 4 ranks and 4-16 MiB, and across 2 nodes of one
        rank 70.8 against 76 ms at 16 MiB)."""
        layout = _layered(ctx, True)
        if layout is None and ctx.size > 1:          # one node, or one rank per node: the owners round
            data = recv if send is None else send
            owner_rounded_sum(ctx, data, recv, compression, compression.residual(key, data))
            return
        if layout is None or recv.size < layout.per_node or recv.nbytes // 2 < ACROSS_NODES_FROM[ALLREDUCE.name]:
            super().allreduce_compressed(ctx, send, recv, reduction, compression, key)
            return
        residual = compression.residual(key, recv)
        if residual is not None:                  # this call's contribution carries the last one's rounding
            reduction.combine(recv if send is None else send, residual, recv)
            residual[...] = 0
            send = None

        def between_nodes(chunk, bounds):
            mine = slice(bounds[layout.local.rank], bounds[layout.local.rank + 1])
            owner_rounded_sum(layout.cross, chunk, chunk, compression, None if residual is None else residual[mine])
        _by_node(ctx, layout, send, recv, reduction, between_nodes)

    def reduce_scatter_block(self, ctx, send, recv, reduction):
        """Local rank j's slice is the blocks of every node's local rank j: summed inside the node, then
        reduce-scattered around the ring of nodes, so every node sends (n-1)/n of the buffer."""
        layout = _layered(ctx, reduction.commutative, contiguous=True)
        if layout is None or recv.size == 0:
            _RING.reduce_scatter_block(ctx, send, recv, reduction)
            return
        if send.nbytes < ACROSS_NODES_FROM[REDUCE_SCATTER_BLOCK.name]:
            ctx.compare_calls_now()
            _MPI.reduce_scatter_block(ctx, send, recv, reduction)
            return
        local, cross, grouped, bounds = _grouped_by_local_rank(ctx, layout, recv.size, send.dtype)
        grouped.reshape(layout.per_node, layout.nodes, recv.size)[...] = \
            send.reshape(layout.nodes, layout.per_node, recv.size).transpose(1, 0, 2)
        found = _in_c(local, reduction)
        with _parts_break_the_whole(ctx, layout):
            if found is not None:
                part = ctx.scratch("hierarchical.part", bounds[1], send.dtype)
                node.node_of(local).reduce_scatter(grouped, part, *found)
            elif local.channel == "shared":
                part = ctx.scratch("hierarchical.part", bounds[1], send.dtype)
                shared_reduce_scatter(local, grouped, bounds, reduction, keep_into=part)
            else:
                local.waitall(*reduce_scatter(local, grouped, grouped, bounds, reduction))
                part = grouped[bounds[local.rank]: bounds[local.rank + 1]]
            _RING.reduce_scatter_block(cross, part, recv, reduction)

    def allgather(self, ctx, send, recv):
        """Local rank j of every node first gathers the blocks of every node's local rank j around the ring
        of nodes (each node receives (n-1)/n of the buffer, its k ranks at once), then the node
        gathers those slices over shared memory or its own links."""
        block = recv.size // ctx.size
        layout = _layered(ctx, True, contiguous=True)
        if layout is None or block == 0:
            _RING.allgather(ctx, send, recv)
            return
        if recv.nbytes < ACROSS_NODES_FROM[ALLGATHER.name]:
            ctx.compare_calls_now()
            _MPI.allgather(ctx, send, recv)
            return
        local, cross, grouped, bounds = _grouped_by_local_rank(ctx, layout, block, recv.dtype)
        part = grouped[bounds[local.rank]: bounds[local.rank + 1]]
        mine = cross.rank               # this rank's node
        part[mine * block: (mine + 1) * block] = recv[ctx.rank * block: (ctx.rank + 1) * block] if send is None \
            else send
        with _parts_break_the_whole(ctx, layout):
            _RING.allgather(cross, None, part)
            if _in_c(local) is not None:
                node.node_of(local).allgather(None, grouped)
            else:
                allgather_in_place(local, grouped, bounds)
        recv.reshape(layout.nodes, layout.per_node, block)[...] = \
            grouped.reshape(layout.per_node, layout.nodes, block).transpose(1, 0, 2)

    def bcast(self, ctx, buf, root):
        # The chain already crosses each node boundary once when nodes hold consecutive ranks: every link
        # carries the buffer once, the least a broadcast can; splitting it by node would only add steps.
        _RING.bcast(ctx, buf, root)


def _by_node(ctx, layout, send, recv, reduction, between_nodes) -> None:
    """An allreduce by node: a reduce-scatter inside each node (local rank j ends with slice j of the node's
    sum), ``between_nodes(slice j, the slices' bounds)`` (which leaves the sum over the nodes in it), then an
    allgather of the slices inside each node."""
    local = layout.local

    def across(chunk, bounds):
        layout.cross.shun_the_dead(layout.cross.others())     # a peer that died during the node phase: no crash
        between_nodes(chunk, bounds)

    found = _in_c(local, reduction)
    with _parts_break_the_whole(ctx, layout):
        if found is not None:
            _by_node_in_c(ctx, local, found, send, recv, across)
            return
        bounds = balanced_bounds(recv.size, layout.per_node)
        if local.channel == "shared":      # the slice stays in shared memory; the others read it there
            shared_reduce_scatter(local, recv if send is None else send, bounds, reduction, gather_into=recv,
                                  then=lambda chunk: across(chunk, bounds))
            return
        if send is not None:
            recv[...] = send
        local.waitall(*reduce_scatter(local, recv, recv, bounds, reduction))
        across(recv[bounds[local.rank]: bounds[local.rank + 1]], bounds)
        allgather_in_place(local, recv, bounds)


def _by_node_in_c(ctx, local, codes, send, recv, across) -> None:
    """:func:`_by_node` through the node's shared memory: local rank j reduces block j (n // k elements) of
    the node's contributions, the last local rank also the n % k left over (the node reduces them whole);
    after ``across`` the node gathers the blocks and the last rank broadcasts the rest."""
    on_node, k, last = node.node_of(local), local.size, local.rank == local.size - 1
    data = recv if send is None else send
    block = recv.size // k
    whole = k * block
    bounds = [q * block for q in range(k)] + [recv.size]
    chunk = ctx.scratch("hierarchical.node_chunk", block + (recv.size - whole if last else 0), recv.dtype)
    on_node.reduce_scatter(data[:whole], chunk[:block], *codes)
    if whole < recv.size:           # the rest: its node sum ends in the last rank's chunk (elsewhere, unused)
        if last:
            on_node.allreduce(data[whole:], chunk[block:], *codes)
        else:
            on_node.allreduce(None if send is None else send[whole:], recv[whole:], *codes)
    across(chunk, bounds)
    on_node.allgather(chunk[:block], recv[:whole])
    if whole < recv.size:
        if last:
            recv[whole:] = chunk[block:]
        on_node.bcast(recv[whole:], k - 1)


def _in_c(local, reduction=None) -> tuple | None:
    """The node's codes for ``reduction`` (``()`` for a call that reduces nothing) where the node's shared
    memory carries this node's stage (the C extension, the shared channel, no fault tolerance; a predefined op
    the node reduces), else None: the same answer on every rank of ``local``."""
    if local.channel != "shared" or not node.carries(local):
        return None
    return () if reduction is None else node.codes(reduction)


def _layered(ctx, commutative: bool, contiguous: bool = False):
    """``ctx``'s node layout where the intra/inter split applies, else None (one node, one rank per node,
    uneven nodes; a non-commutative op, or a collective whose blocks follow rank order, on nodes that do
    not hold consecutive ranks)."""
    layout = node_layout(ctx) if ctx.size > 1 else None
    return layout if layout is not None and layout.splits(in_rank_order=contiguous or not commutative) else None


def _grouped_by_local_rank(ctx, layout, block: int, dtype):
    """(local, cross, scratch of every rank's block ordered by local rank then node, each local rank's
    bounds in it).  With consecutive ranks per node, a rank's place in the cross ring is its node."""
    grouped = ctx.scratch("hierarchical.grouped", ctx.size * block, dtype)
    return layout.local, layout.cross, grouped, block_bounds(layout.nodes * block, layout.per_node)


@contextlib.contextmanager
def _parts_break_the_whole(ctx, layout):
    """A failure inside the node or between nodes leaves the whole communicator broken."""
    try:
        yield
    except MpicollError as error:
        raise ctx.broken_by(error) if (layout.local.broken or layout.cross.broken) else error
