"""How much of its mass a rank keeps and how much it sends to each out-peer.

Push-sum needs the mixing matrix of every round to be column-stochastic: each
rank's shares (kept plus sent) sum to 1, so the total mass, and with it the
average, is conserved.  Rows need not sum to 1: that is what lets push-sum run
on directed, asymmetric graphs, and why the de-biasing weight is carried along.
"""

from __future__ import annotations

import math

import numpy as np

from .topology import Graph, MatrixGraph

__all__ = ["Mixing", "UniformMixing", "MatrixMixing", "mixing_matrix", "rounds_to_average"]


class Mixing:
    def shares(self, graph: Graph, rank: int, round: int) -> tuple[float, dict[int, float]]:
        """(the share ``rank`` keeps, {out-peer: the share it sends}) at ``round``."""
        raise NotImplementedError


class UniformMixing(Mixing):
    """Equal shares for the rank itself and each of its out-peers: 1 / (out-degree + 1)."""

    def shares(self, graph, rank, round):
        peers = graph.out_peers(rank, round)
        share = 1.0 / (len(peers) + 1)
        return share, {peer: share for peer in peers}


class MatrixMixing(Mixing):
    """A user's mixing matrix ``W`` (``W[j, i]``: the share rank i sends to rank j), or a list
    of them used in turn, one per round; each is checked to be column-stochastic."""

    def __init__(self, matrices, *, tolerance: float = 1e-12):
        self.graph = MatrixGraph(matrices)
        for index, m in enumerate(self.graph.matrices):
            if (m < 0).any():
                i, j = np.argwhere(m < 0)[0]
                raise ValueError(f"mixing matrix {index}: entry [{i}, {j}] = {m[i, j]:g} is negative; shares "
                                 "must be >= 0")
            sums = m.sum(axis=0)
            bad = np.flatnonzero(np.abs(sums - 1) > tolerance)
            if bad.size:
                raise ValueError(f"mixing matrix {index} is not column-stochastic: column {bad[0]} (what rank "
                                 f"{bad[0]} keeps and sends) sums to {sums[bad[0]]:.17g}, not 1; push-sum needs "
                                 "every column to sum to 1 (rows may sum to anything)")

    def shares(self, graph, rank, round):
        column = self.graph.matrix(round)[:, rank]
        return float(column[rank]), {peer: float(column[peer]) for peer in self.graph.out_peers(rank, round)}


def mixing_matrix(graph: Graph, mixing: Mixing, round: int) -> np.ndarray:
    """The full column-stochastic matrix of one round (for analysis and tests, not for mixing)."""
    matrix = np.zeros((graph.size, graph.size))
    for rank in range(graph.size):
        keep, sends = mixing.shares(graph, rank, round)
        matrix[rank, rank] = keep
        for peer, share in sends.items():
            matrix[peer, rank] = share
    return matrix


def rounds_to_average(graph: Graph, mixing: Mixing, tolerance: float) -> int:
    """Rounds the theory gives for push-sum's de-biased error to fall by ``tolerance``.

    One period's product of mixing matrices has eigenvalue 1 (the preserved
    mass) and contracts everything else by its second-largest eigenvalue
    modulus per period; a product that is exactly rank one (the time-varying
    exponential graph at a power-of-two size) averages exactly in one period.
    """
    product = np.eye(graph.size)
    for round in range(graph.period):
        product = mixing_matrix(graph, mixing, round) @ product
    second = sorted(np.abs(np.linalg.eigvals(product)))[-2] if graph.size > 1 else 0.0
    if second < 1e-12:
        return graph.period
    return graph.period * math.ceil(math.log(tolerance) / math.log(second))
