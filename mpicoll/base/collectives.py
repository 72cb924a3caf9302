"""The collectives mpicoll carries, in one table: each one's names and what the layers above ask of it.

A row answers, for one collective, every question that code elsewhere used
to answer with its own spelling: mpi4py's blocking and nonblocking methods
(the communicator, the array API, MPI's own algorithm), the name of its rule
for ``auto`` and of the algorithms' method, the spelling ``mpicoll bench
--collective`` takes, the bytes each rank must send per byte of message
(nccl-tests' bus-bandwidth factor, used for the benchmarks' bounds), whether
every rank's result needs every rank's data (the call checks: a rank that
finishes such a call heard from all), and the size from which
``hierarchical`` splits it across nodes of several ranks each (the same
number is ``auto``'s rule there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["Collective", "ALLREDUCE", "REDUCE_SCATTER_BLOCK", "ALLGATHER", "BCAST", "COLLECTIVES", "find"]


@dataclass(frozen=True)
class Collective:
    name: str               # the algorithms' method, auto's rule and MPICOLL_AUTO_<NAME>: "allreduce"
    method: str             # mpi4py's blocking method: "Allreduce"
    nonblocking: str        # mpi4py's nonblocking method: "Iallreduce"
    option: str             # mpicoll bench --collective and its records: "allreduce"
    bus_factor: Callable[[int], float]   # bytes each of p ranks (or nodes) sends per byte of message
    hears_everyone: bool    # every rank's result needs every rank's data
    blocks: bool            # the whole message is p blocks, one per rank (its signature counts one block)
    rooted: bool            # one rank's data goes to all (takes a root)
    # bytes of the whole message from which hierarchical splits the collective across nodes of several
    # ranks each, below which MPI's own wins there (None: it never splits).  Measured on 2 emulated nodes x
    # 2 ranks at 1 Gbit/s (docs/multi-node.md): the allreduce behind MPI at 1 MiB (0.90x), even at 4 MiB
    # (1.03x), 1.66x ahead at 16 MiB; the reduce-scatter and allgather behind at 64 KiB (0.39x, 1.47x),
    # ahead from 128 KiB (2.39x, 1.73x) up to 64 MiB (1.77x, 1.36x).  A broadcast's chain already crosses
    # each link once.
    across_nodes_from: int | None


ALLREDUCE = Collective("allreduce", "Allreduce", "Iallreduce", "allreduce", lambda p: 2 * (p - 1) / p,
                       hears_everyone=True, blocks=False, rooted=False, across_nodes_from=4 << 20)
REDUCE_SCATTER_BLOCK = Collective("reduce_scatter_block", "Reduce_scatter_block", "Ireduce_scatter_block",
                                  "reduce_scatter", lambda p: (p - 1) / p,
                                  hears_everyone=True, blocks=True, rooted=False, across_nodes_from=128 << 10)
ALLGATHER = Collective("allgather", "Allgather", "Iallgather", "allgather", lambda p: (p - 1) / p,
                       hears_everyone=True, blocks=True, rooted=False, across_nodes_from=128 << 10)
BCAST = Collective("bcast", "Bcast", "Ibcast", "bcast", lambda p: 1.0,
                   hears_everyone=False, blocks=False, rooted=True, across_nodes_from=None)

COLLECTIVES = {c.name: c for c in (ALLREDUCE, REDUCE_SCATTER_BLOCK, ALLGATHER, BCAST)}
_SPELLINGS = {spelling: c for c in COLLECTIVES.values() for spelling in (c.name, c.method, c.nonblocking, c.option)}


def find(spelling: str) -> Collective:
    """The collective of any of its spellings ("allreduce", "Allreduce", "Iallreduce", "reduce_scatter", ...)."""
    try:
        return _SPELLINGS[spelling]
    except KeyError:
        raise KeyError(f"{spelling!r} is not one of mpicoll's collectives ({', '.join(COLLECTIVES)})") from None
