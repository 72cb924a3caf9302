"""``shm``: the collectives of a communicator whose ranks share one node, through the node's shared memory.

Where all ranks of a communicator share a node, a message is one copy too
many: each rank copies its chunk into its own region of one MPI
shared-memory window and reads every other rank's straight out of theirs
(:mod:`~mpicoll.collectives.algorithms.node`, whose steps are ``_shm.c``'s).
A chunk of up to :data:`~mpicoll.collectives.algorithms.node.SMALL_BYTES` is
reduced by every rank whole (one synchronisation a chunk: copy in, reduce,
done); a larger one is split, each rank reducing its slice of every rank's
chunk and then copying the other slices out of their owners' regions (a
reduce-scatter and an allgather, two synchronisations).  Buffers beyond a
slot go chunk by chunk through two slots per rank, so the data that moves
between ranks stays in the caches.

Its reduce_scatter, allgather and bcast take the same slots (``auto`` keeps
MPI's own calls for allgather and bcast, faster on one node: docs/benchmarks.md).

The communicator's fast path hands allreduces to the node straight from C
(:mod:`mpicoll.collectives._fastcall`); anything the node does not take (an
op or type it does not reduce, a communicator that spans nodes, MPI's fault
tolerance, whose shared windows are not made to outlive a death, a build
without a C compiler) runs ``hierarchical`` (the ring on one node) or MPI's
own call below :data:`FALLBACK_MPI_BELOW`, as ``auto`` did before.
"""

from __future__ import annotations

from . import node
from .base import Algorithm
from .hierarchical import Hierarchical
from .mpi import Mpi

__all__ = ["Shm", "FALLBACK_MPI_BELOW"]

FALLBACK_MPI_BELOW = 2 << 20   # without the node: MPI's own allreduce below this, the ring from it
_FALLBACK_SMALL, _FALLBACK_LARGE = Mpi(), Hierarchical()


def _node(ctx):
    """The context's node, for a call it carries: the node compares every rank's call itself, so the
    communicator's fingerprint stands aside (one way to meet a disagreement, the same on every rank)."""
    ctx.compared_by_the_algorithm()
    return node.node_of(ctx)


class Shm(Algorithm):
    """The allreduce, reduce_scatter, allgather and bcast through a node's shared memory (this module)."""

    name = "shm"

    def allreduce(self, ctx, send, recv, reduction):
        found = node.codes(reduction) if node.carries(ctx) else None
        if found is None:
            fallback = _FALLBACK_SMALL if recv.nbytes < FALLBACK_MPI_BELOW else _FALLBACK_LARGE
            if fallback is _FALLBACK_SMALL:
                ctx.compare_calls_now()     # MPI's blocking call cannot be interrupted by a disagreement
            fallback.allreduce(ctx, send, recv, reduction)
            return
        _node(ctx).allreduce(send, recv, *found)

    def reduce_scatter_block(self, ctx, send, recv, reduction):
        found = node.codes(reduction) if node.carries(ctx) and node.plain(send) and node.plain(recv) else None
        if found is None:
            _FALLBACK_LARGE.reduce_scatter_block(ctx, send, recv, reduction)
        else:
            _node(ctx).reduce_scatter(send, recv, *found)

    def allgather(self, ctx, send, recv):
        if node.carries(ctx) and node.plain(recv) and (send is None or node.plain(send)):
            _node(ctx).allgather(send, recv)
        else:
            _FALLBACK_LARGE.allgather(ctx, send, recv)

    def bcast(self, ctx, buf, root):
        if node.carries(ctx) and node.plain(buf):
            _node(ctx).bcast(buf, root)
        else:
            _FALLBACK_LARGE.bcast(ctx, buf, root)
