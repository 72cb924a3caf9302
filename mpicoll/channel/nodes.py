"""Which ranks share a node, and the channels a topology-aware algorithm needs.

MPI knows which ranks share memory (``Split_type(COMM_TYPE_SHARED)``): those
form a node.  A :class:`NodeLayout` holds, for one communicator, a context over
this rank's node (``local``) and one over the ranks that hold the same place on
every node (``cross``: local rank j of every node), so an algorithm can do one
phase inside nodes and one between them.  It is built once per context, on
first use (collective), and freed with it.
"""

from __future__ import annotations

from mpi4py import MPI

__all__ = ["NodeLayout", "node_layout", "node_members", "node_count"]


def node_members(comm: MPI.Intracomm) -> set[int]:
    """The ranks of ``comm`` on this rank's node; collective."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return set(local.allgather(comm.Get_rank()))
    finally:
        local.Free()


def node_count(comm: MPI.Intracomm) -> int:
    """How many nodes ``comm``'s ranks span (ranks that share memory make one node); collective."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    first = int(local.Get_rank() == 0)
    local.Free()
    return comm.allreduce(first)


class NodeLayout:
    """The node layout of ``ctx``'s communicator.

    ``nodes``: how many; ``per_node``: ranks on this rank's node (which ones: the
    context's ``on_this_node``); ``uniform``:
    every node has as many; ``contiguous``: every node holds consecutive ranks
    (so node-then-cross order is rank order, which non-commutative ops need).
    ``local`` and ``cross`` exist where the layout is :attr:`layered`.
    """

    def __init__(self, ctx):
        comm = ctx.comm
        ctx.rendezvous()                              # the splits below block until every rank is here
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=ctx.rank)
        self.local_rank, self.per_node = local.Get_rank(), local.Get_size()
        members = sorted(ctx.on_this_node)          # local's ranks, in local rank order (key=ctx.rank)
        mine = (self.local_rank == 0, self.per_node, members == list(range(members[0], members[0] + self.per_node)))
        everyone = comm.allgather(mine)
        self.nodes = sum(first for first, _, _ in everyone)
        self.uniform = len({count for _, count, _ in everyone}) == 1
        self.contiguous = all(run for _, _, run in everyone)
        self.local = self.cross = None
        if self.layered:               # where an algorithm will use them: same answer on every rank
            cross = comm.Split(self.local_rank, ctx.rank)
            self.local, self.cross = (ctx.part(part, _names(part, ctx)) for part in (local, cross))
            cross.Free()
        local.Free()

    @property
    def layered(self) -> bool:
        """Several nodes with several ranks each, all alike: where an intra/inter split pays."""
        return self.nodes > 1 and self.per_node > 1 and self.uniform

    def splits(self, in_rank_order: bool = False) -> bool:
        """Whether a topology-aware algorithm splits its work here: the layout is :attr:`layered` and, where
        the result must follow rank order (a non-commutative op, blocks laid out by rank), every node
        holds consecutive ranks."""
        return self.layered and (self.contiguous or not in_rank_order)


def _names(part: MPI.Intracomm, ctx) -> list[int]:
    """How errors name the ranks of ``part``: by their ranks in ``ctx``'s communicator."""
    mine, theirs = part.Get_group(), ctx.comm.Get_group()
    try:
        return [ctx.names[rank] for rank in MPI.Group.Translate_ranks(mine, list(range(part.Get_size())), theirs)]
    finally:
        mine.Free()
        theirs.Free()


def node_layout(ctx) -> NodeLayout:
    """``ctx``'s layout, built on first use (every rank must be in the same call)."""
    if ctx.node_layout is None:
        ctx.node_layout = NodeLayout(ctx)
    return ctx.node_layout
