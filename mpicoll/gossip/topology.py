"""Who sends to whom at round k: the communication graphs of push-sum gossip.

A graph gives each rank its out-peers at round k (and, derived from those,
its in-peers); it says nothing about weights (:mod:`mpicoll.gossip.mixing`).
Graphs repeat with a ``period``; every rank computes the same graph locally,
so no messages are spent agreeing on it.

===========================  ===================================================
``exponential``              static: i sends to i + 1, i + 2, i + 4, ... (< p)
``time-varying-exponential`` SGP's graph: one peer per round,
                             i + 2^(k mod ceil(log2 p))
``ring``                     i sends to i + 1
``complete``                 i sends to every other rank
``MatrixGraph(W)``           the nonzeros of a user's mixing matrix (or of a
                             list of them, one per round, cycling)
===========================  ===================================================
"""

from __future__ import annotations

import functools
import math

import numpy as np

__all__ = ["Graph", "Exponential", "TimeVaryingExponential", "Ring", "Complete", "MatrixGraph", "make", "GRAPHS"]


class Graph:
    """Out-peers of each rank at each round, for ``size`` ranks."""

    name = "?"
    period = 1

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"a graph needs at least one rank, got {size}")
        self.size = size

    def out_peers(self, rank: int, round: int) -> tuple[int, ...]:
        raise NotImplementedError

    @functools.lru_cache(maxsize=256)
    def in_peers(self, rank: int, round: int) -> tuple[int, ...]:
        """The ranks that send to ``rank`` at ``round``."""
        return tuple(q for q in range(self.size) if rank in self.out_peers(q, round))

    def __repr__(self) -> str:
        return f"<{self.name} graph over {self.size} ranks>"


def _distances(size: int) -> list[int]:
    """1, 2, 4, ... below ``size``: the hops of the exponential graphs."""
    return [1 << j for j in range(max(1, math.ceil(math.log2(size))))] if size > 1 else []


class Exponential(Graph):
    name = "exponential"

    def out_peers(self, rank, round):
        return tuple((rank + d) % self.size for d in _distances(self.size))


class TimeVaryingExponential(Graph):
    name = "time-varying-exponential"

    def __init__(self, size: int):
        super().__init__(size)
        self.period = max(1, len(_distances(size)))

    def out_peers(self, rank, round):
        hops = _distances(self.size)
        return ((rank + hops[round % len(hops)]) % self.size,) if hops else ()


class Ring(Graph):
    name = "ring"

    def out_peers(self, rank, round):
        return ((rank + 1) % self.size,) if self.size > 1 else ()


class Complete(Graph):
    name = "complete"

    def out_peers(self, rank, round):
        return tuple(q for q in range(self.size) if q != rank)


class MatrixGraph(Graph):
    """The graph of one mixing matrix ``W`` (``W[j, i]``: the share i sends to j), or of a
    list of them used in turn, one per round."""

    name = "matrix"

    def __init__(self, matrices):
        matrices = [np.asarray(m, float) for m in (matrices if isinstance(matrices, (list, tuple)) else [matrices])]
        size = matrices[0].shape[0] if matrices and matrices[0].ndim == 2 else 0
        for index, m in enumerate(matrices):
            if m.ndim != 2 or m.shape != (size, size):
                raise ValueError(f"mixing matrix {index} has shape {m.shape}; every one must be square and "
                                 f"the same size, one row and column per rank")
        super().__init__(size)
        self.matrices = matrices
        self.period = len(matrices)

    def matrix(self, round: int) -> np.ndarray:
        return self.matrices[round % self.period]

    def out_peers(self, rank, round):
        column = self.matrix(round)[:, rank]
        return tuple(int(q) for q in np.flatnonzero(column) if q != rank)


GRAPHS = {cls.name: cls for cls in (Exponential, TimeVaryingExponential, Ring, Complete)}


def make(graph, size: int) -> Graph:
    """A graph by name (see the table above), or a :class:`Graph` passed through."""
    if isinstance(graph, Graph):
        if graph.size != size:
            raise ValueError(f"the graph is over {graph.size} ranks; the communicator has {size}")
        return graph
    try:
        return GRAPHS[graph](size)
    except KeyError:
        raise ValueError(f"Unrecognized graph: {graph!r}; choose from {', '.join(GRAPHS)} "
                         "or pass mixing=MatrixMixing(W)") from None
