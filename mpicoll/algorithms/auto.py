"""How ``auto`` picks an algorithm: by collective, message size in bytes and rank count.

Each collective has a rule ``"name:limit,name:limit,...,name"``: the first
name whose limit is above the message size wins, the last has no limit.  The
defaults below come from ``mpicoll bench`` on one 2-core node with the MPICH
wheel (docs/benchmarks.md): the ring overtook MPI's allreduce between 1 and
2 MiB at both 2 and 4 ranks, so one size threshold serves every rank count
measured; one rank always gets MPI.  The ring's reduce-scatter is only
reliably ahead from 16 MiB (2 ranks, 4 MiB: 0.88x), and MPI's allgather and
broadcast were never beaten by enough to matter, except the parallel broadcast
with more ranks than cores, which does not scale with p (docs/benchmarks.md).  Override a rule with the environment
variable ``MPICOLL_AUTO_<COLLECTIVE>``, for example
``MPICOLL_AUTO_ALLREDUCE=mpi:1M,ring``.  Every rank must see the same rule.

Non-commutative ops go to ``mpi`` unless the rule was set by hand: MPI's
library reduces them in rank order without the ring's cut detour.
"""

from __future__ import annotations

import functools
import os

from ..config import parse_bytes

__all__ = ["choose", "rule", "DEFAULT_RULES"]

DEFAULT_RULES = {
    "allreduce": "mpi:2M,ring",
    "reduce_scatter_block": "mpi:16M,ring",
    "allgather": "mpi",
    "bcast": "mpi",
}


def rule(collective: str) -> list[tuple[str, float]]:
    """The rule in force for ``collective``: [(algorithm, exclusive byte limit), ...]."""
    return _parse(collective, os.environ.get(f"MPICOLL_AUTO_{collective.upper()}", DEFAULT_RULES[collective]))


@functools.lru_cache(maxsize=64)
def _parse(collective: str, text: str) -> list[tuple[str, float]]:
    from . import REGISTRY
    parsed = []
    for part in text.split(","):
        name, _, limit = part.strip().partition(":")
        if name not in REGISTRY:
            raise ValueError(f"MPICOLL_AUTO_{collective.upper()}={text!r}: unknown algorithm {name!r}")
        parsed.append((name, parse_bytes(limit) if limit else float("inf")))
    if parsed[-1][1] != float("inf"):
        raise ValueError(f"MPICOLL_AUTO_{collective.upper()}={text!r}: the last algorithm must have no limit")
    return parsed


def choose(collective: str, nbytes: int, size: int, commutative: bool = True) -> str:
    """The algorithm ``auto`` runs for one call."""
    if size == 1:
        return "mpi"
    if not commutative and f"MPICOLL_AUTO_{collective.upper()}" not in os.environ:
        return "mpi"
    for name, limit in rule(collective):
        if nbytes < limit:
            return name
    raise AssertionError("unreachable: the last rule has no limit")
