"""The interface every algorithm implements, and where MPI may touch device arrays."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ... import arrays

if TYPE_CHECKING:                    # annotations only: algorithms stand beside the reduction, not on it
    from ...channel.context import Context
    from ..compression import Compression
    from ..reduction import Reduction

__all__ = ["Algorithm", "MpiBuffers"]


class Algorithm:
    """One way of carrying out the four collectives.

    Arguments are flat arrays already validated by the communicator: numpy
    arrays, or CuPy/Numba device arrays for algorithms whose ``device`` is
    True.  ``send`` is None for in-place calls (the data is in ``recv``), and
    a send array is never written.  Implementations must leave the same bits
    in ``recv`` on every rank.
    """

    name = "?"
    device = False    # whether it serves device (GPU) arrays too; the registry and auto go by this

    def allreduce(self, ctx: Context, send: np.ndarray | None, recv: np.ndarray, reduction: Reduction) -> None:
        raise NotImplementedError

    def allreduce_compressed(self, ctx: Context, send: np.ndarray | None, recv: np.ndarray, reduction: Reduction,
                             compression: Compression, key) -> None:
        """The sum of float32 or float64 host arrays moved as ``compression``'s 16-bit floats
        (:mod:`mpicoll.collectives.compression`).  Here each rank's contribution is rounded once (its residual
        carried, with error feedback), the words are summed by :meth:`allreduce` with float32 additions, and
        widened back into ``recv``.  ``reduction``: the arrays' own sum, for an algorithm that adds in their
        precision first (:class:`~mpicoll.collectives.algorithms.hierarchical.Hierarchical`)."""
        data = recv if send is None else send
        words = compression.narrow(data, ctx.scratch("compressed.words", data.size, np.uint16),
                                   compression.residual(key, data))
        self.allreduce(ctx, None, words, compression.reduction)
        compression.decompress(words, recv)

    def reduce_scatter_block(self, ctx: Context, send: np.ndarray, recv: np.ndarray, reduction: Reduction) -> None:
        """``send`` holds size * recv.size elements (it may be the caller's recvbuf when in place)."""
        raise NotImplementedError

    def allgather(self, ctx: Context, send: np.ndarray | None, recv: np.ndarray) -> None:
        """``send`` None means this rank's block is already in place in ``recv``."""
        raise NotImplementedError

    def bcast(self, ctx: Context, buf: np.ndarray, root: int) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<mpicoll algorithm {self.name!r}>"


class MpiBuffers:
    """Where MPI reads and writes during one call of an algorithm on ``array``'s kind of memory.

    Host arrays, and device arrays under a CUDA-aware MPI (after the GPU's
    queued work is synchronised), are handed to MPI as they are; otherwise
    (``staged``) MPI works on page-locked host copies kept on the context and
    reused call after call.  Scratch that never meets MPI stays beside the
    data: on the GPU for device arrays.
    """

    def __init__(self, ctx: Context, array, prefix: str):
        self.ctx, self.prefix = ctx, prefix
        self.library = arrays.library(array)
        self.staged = self.library is not None and not arrays.cuda_aware()[0]
        if self.library is not None and not self.staged:
            arrays.synchronize(self.library)       # MPI reads device memory the stream may still be writing

    def scratch(self, name: str, count: int, dtype):
        """Working memory beside the data (on the GPU for device arrays)."""
        return self.ctx.scratch(f"{self.prefix}.{name}", count, dtype, library=self.library)

    def landing(self, name: str, count: int, dtype):
        """Memory MPI may receive ``count`` elements into."""
        return self.ctx.scratch(f"{self.prefix}.{name}", count, dtype, library=self.library, pinned=self.staged)

    def readable(self, name: str, array):
        """``array`` as MPI may read it."""
        if not self.staged:
            return array
        host = self.landing(name, array.size, array.dtype)
        arrays.to_host(array, host)
        return host

    def writable(self, name: str, target):
        """Memory MPI may write ``target``'s new values into (``deliver`` them afterwards)."""
        return self.landing(name, target.size, target.dtype) if self.staged else target

    def deliver(self, written, target) -> None:
        """Values MPI wrote through ``writable`` into ``target``."""
        if self.staged:
            arrays.from_host(written, target)

    def beside(self, landed, name: str):
        """Received data as an array beside the data (copied to the GPU when staged)."""
        if not self.staged:
            return landed
        target = self.scratch(name, landed.size, landed.dtype)
        arrays.from_host(landed, target)
        return target
