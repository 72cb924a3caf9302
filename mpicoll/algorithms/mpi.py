"""The MPI library's own collectives, for comparison and as a candidate of ``auto``."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .base import Algorithm

__all__ = ["Mpi"]


class Mpi(Algorithm):
    """Hands the call to MPI unchanged; its reduction order is the library's."""

    name = "mpi"

    def allreduce(self, ctx, send, recv, reduction):
        datatype = reduction.datatype
        source = MPI.IN_PLACE if send is None else [send, send.size, datatype]
        ctx.comm.Allreduce(source, [recv, recv.size, datatype], reduction.op)

    def reduce_scatter_block(self, ctx, send, recv, reduction):
        datatype = reduction.datatype
        if np.may_share_memory(send, recv):
            ctx.comm.Reduce_scatter_block(MPI.IN_PLACE, [send, send.size, datatype], reduction.op)
        else:
            ctx.comm.Reduce_scatter_block([send, send.size, datatype], [recv, recv.size, datatype], reduction.op)

    def allgather(self, ctx, send, recv):
        source = MPI.IN_PLACE if send is None else [send.view(np.uint8), MPI.BYTE]
        ctx.comm.Allgather(source, [recv.view(np.uint8), MPI.BYTE])

    def bcast(self, ctx, buf, root):
        ctx.comm.Bcast([buf.view(np.uint8), MPI.BYTE], root)
