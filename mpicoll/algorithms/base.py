"""The interface every algorithm implements, and the chunk arithmetic they share."""

from __future__ import annotations

import numpy as np

from ..context import Context
from ..reduction import Reduction

__all__ = ["Algorithm", "balanced_bounds", "block_bounds", "segments", "segment_elements"]


class Algorithm:
    """One way of carrying out the four collectives.

    Arguments are flat numpy arrays already validated by the communicator:
    ``send`` is None for in-place calls (the data is in ``recv``), and a
    send array is never written.  Implementations must leave the same bits in
    ``recv`` on every rank.
    """

    name = "?"

    def allreduce(self, ctx: Context, send: np.ndarray | None, recv: np.ndarray, reduction: Reduction) -> None:
        raise NotImplementedError

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


def balanced_bounds(count: int, parts: int) -> list[int]:
    """Split ``count`` elements into ``parts`` runs whose sizes differ by at most one."""
    return [count * i // parts for i in range(parts + 1)]


def block_bounds(block: int, parts: int) -> list[int]:
    return [block * i for i in range(parts + 1)]


def segments(start: int, stop: int, step: int) -> list[slice]:
    """Slices of at most ``step`` elements covering [start, stop); none when empty."""
    return [slice(i, min(i + step, stop)) for i in range(start, stop, step)]


def segment_elements(ctx: Context, array: np.ndarray) -> int:
    return max(1, ctx.segment_bytes // max(1, array.itemsize))
