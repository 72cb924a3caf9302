"""The algorithms behind every collective, by name.

======================  ==========================================================  ===============================
name                    how                                                         wins when
======================  ==========================================================  ===============================
``ring``                reduce-scatter then allgather around a ring, pipelined in   large messages: each rank moves
                        segments; chain broadcast                                   2(p-1)/p of the buffer, the least
                                                                                    possible
``parallel``            every rank sends its whole buffer to every other rank,      small p and small to medium
                        all at once; each folds the p contributions in rank order   messages: one round of messages
``recursive_doubling``  log2(p) pairwise exchanges (Bruck allgather, binomial       small messages at larger p:
                        broadcast)                                                  fewest rounds
``direct``              reduce-scatter by sending chunk q straight to rank q (all   device arrays: two rounds of
                        at once), fold in rank order, then a direct allgather       messages, the GPU reduces
``hierarchical``        allreduce: reduce-scatter inside each node, ring allreduce  several nodes of several ranks:
                        of each slice between nodes, allgather inside nodes; the    each node's link carries
                        ring for the other collectives and on one node              2(n-1)/n of the buffer
``shm``                 allreduce: every rank of one node copies its chunk into     one node, every size: one copy
                        its region of one shared-memory window and reduces the      in, the reduction, one copy out;
                        others' straight out of theirs, in C; reduce_scatter,       no message
                        allgather and bcast through the same slots
``mpi``                 the MPI library's own collective                            tiny messages, where the Python
                                                                                    layer's overhead dominates
``auto``                one of the above by collective, message size and rank       always the default
                        count (thresholds in :mod:`mpicoll.collectives.algorithms.auto`)
======================  ==========================================================  ===============================

``get(name)`` returns the shared instance; unknown names raise ValueError.
Device (GPU) arrays are served by ``direct`` and ``mpi`` (their ``device``
attribute says so); ``get(name, device=True)`` refuses the others with the
list of those that serve them, and ``auto`` picks only among those.
"""

from __future__ import annotations

from .base import Algorithm
from .direct import Direct
from .hierarchical import Hierarchical
from .mpi import Mpi
from .parallel import Parallel
from .recursive_doubling import RecursiveDoubling
from .ring import Ring
from .shm import Shm

__all__ = ["Algorithm", "get", "names", "REGISTRY"]

REGISTRY: dict[str, Algorithm] = {a.name: a for a in (Ring(), Parallel(), RecursiveDoubling(), Direct(), Hierarchical(),
                                                       Shm(), Mpi())}


def names(device: bool = False) -> list[str]:
    """Every name ``get`` accepts (for device arrays with ``device``), ``auto`` included."""
    return [name for name, algorithm in REGISTRY.items() if algorithm.device or not device] + ["auto"]


def get(name: str, device: bool = False) -> Algorithm:
    """The algorithm called ``name`` (``auto`` is resolved per call, by the communicator).

    With ``device``, one that serves device arrays, or a TypeError naming those that do.
    """
    try:
        algorithm = REGISTRY[name]
    except KeyError:
        raise ValueError(f"Unrecognized algorithm: {name!r}; choose from {', '.join(names())}") from None
    if device and not algorithm.device:
        raise TypeError(f"algorithm {name!r} does not serve device (GPU) arrays; use one of "
                        f"{', '.join(names(device=True))}, or pass host arrays")
    return algorithm
