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
``mpi``                 the MPI library's own collective                            tiny messages, where the Python
                                                                                    layer's overhead dominates
``auto``                one of the above by collective, message size and rank       always the default
                        count (thresholds in :mod:`mpicoll.algorithms.auto`)
======================  ==========================================================  ===============================

``get(name)`` returns the shared instance; unknown names raise ValueError.
"""

from __future__ import annotations

from .base import Algorithm
from .mpi import Mpi
from .parallel import Parallel
from .recursive_doubling import RecursiveDoubling
from .ring import Ring

__all__ = ["Algorithm", "get", "names", "REGISTRY"]

REGISTRY: dict[str, Algorithm] = {a.name: a for a in (Ring(), Parallel(), RecursiveDoubling(), Mpi())}


def names() -> list[str]:
    """Every name ``get`` accepts, ``auto`` included."""
    return [*REGISTRY, "auto"]


def get(name: str) -> Algorithm:
    """The algorithm called ``name`` (``auto`` is resolved per call, by the communicator)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"Unrecognized algorithm: {name!r}; choose from {', '.join(names())}") from None
