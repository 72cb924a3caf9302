"""How ``auto`` picks an algorithm: by collective, message size in bytes and rank count.

Each collective has a rule ``"name:limit,name:limit,...,name"``: the first
name whose limit is above the message size wins, the last has no limit.  The
defaults below come from ``mpicoll bench`` on one 2-core node with the MPICH
wheel (docs/benchmarks.md).  On one node the allreduce goes to ``shm``, the
node's shared memory in C, at every size: through the communicator it beat
MPI's own from 8 B (0.5 us against 3.7 at 2 ranks) and DeepSpeed's
shared-memory kernel at every size measured, at 2 and 4 ranks; the
reduce-scatter goes there from 1 MiB of input, MPI's below.  Without it
(no C compiler at install) the ring overtook MPI's allreduce between 1 and
2 MiB at both 2 and 4 ranks (``WITHOUT_NODE_RULES``); one rank always gets
MPI.  Large allreduces then go to ``hierarchical``,
which is the ring on one node (and with one rank per node).  The ring's
reduce-scatter is only reliably ahead from 16 MiB (2 ranks, 4 MiB: 0.88x),
and MPI's allgather and broadcast were never beaten by enough to matter,
except the parallel broadcast with more ranks than cores, which does not
scale with p (docs/benchmarks.md).

A communicator that spans nodes of several ranks each, every node holding
consecutive ranks, follows ``ACROSS_NODES_RULES`` instead, from its second
call on (the first call's check comes first; then the communicator learns
its node layout): there ``hierarchical`` splits each collective between
shared memory and the links (docs/multi-node.md).  With one rank per node
the flat ring already crosses each link evenly and the one-node rules stay.

Override a rule with the environment variable ``MPICOLL_AUTO_<COLLECTIVE>``
(on one node and across nodes alike), for example
``MPICOLL_AUTO_ALLREDUCE=mpi:1M,ring``.  Every rank must see the same rule.

Non-commutative ops go to ``mpi`` unless the rule was set by hand: MPI's
library reduces them in rank order without the ring's cut detour.

Under MPI's fault tolerance (ULFM) the default rules hand nothing to MPI: its share goes to
``recursive_doubling`` (``FAULT_TOLERANT_RULES``), because across a cut link MPI's own collectives
returned success with wrong data where point-to-point calls reported the failure (docs/elastic.md).

Device (GPU) arrays follow ``DEVICE_RULES`` (``MPICOLL_AUTO_DEVICE_<COLLECTIVE>``
to override), whose names must serve device arrays: ``direct`` reduces on the
GPU; ``mpi`` would reduce on the host (staged) or leave it to a CUDA-aware MPI.
Nobody has measured them on a GPU yet, so every device call goes to ``direct``.
"""

from __future__ import annotations

import functools
import os

from ...base import failure
from ...base.collectives import COLLECTIVES
from ...base.config import parse_bytes
from . import node

__all__ = ["choose", "rule", "straight_to_mpi_below", "DEFAULT_RULES", "ACROSS_NODES_RULES", "DEVICE_RULES", "FAULT_TOLERANT_RULES"]

# One node without the on-node allreduce (no C compiler at install; under MPI's fault tolerance)
WITHOUT_NODE_RULES = {
    "allreduce": "mpi:2M,hierarchical",
    "reduce_scatter_block": "mpi:16M,ring",
    "allgather": "mpi",
    "bcast": "mpi",
}
# One node: the allreduce through the node's shared memory (``shm``) at every size; the reduce-scatter from 1 MiB
# of input (1.3-1.4x MPI's at 2 ranks, 1.02-1.03x at 4; at 256 KiB 0.90x at 4 ranks; December 2)
DEFAULT_RULES = dict(WITHOUT_NODE_RULES, allreduce="shm", reduce_scatter_block="mpi:1M,shm") if node.available() \
    else WITHOUT_NODE_RULES
# Across nodes of several ranks each, every node holding consecutive ranks (where ``hierarchical``
# splits each collective between shared memory and the links): MPI's own below the size from which
# hierarchical splits it, measured on 2 emulated nodes x 2 ranks at 1 Gbit/s (the table's
# ``across_nodes_from``: allreduce 4M, reduce-scatter and allgather 128K; a broadcast stays MPI's).
def _bytes_text(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n >> 10}K"


ACROSS_NODES_RULES = {
    c.name: "mpi" if c.across_nodes_from is None else f"mpi:{_bytes_text(c.across_nodes_from)},hierarchical"
    for c in COLLECTIVES.values()
}
DEVICE_RULES = dict.fromkeys(DEFAULT_RULES, "direct")


def _point_to_point(rules: dict[str, str]) -> dict[str, str]:
    return {collective: ",".join("recursive_doubling" + part[3:] if part.split(":")[0] == "mpi" else part
                                 for part in text.split(",")) for collective, text in rules.items()}


# Under MPI's fault tolerance (ULFM: Open MPI's ``--with-ft ulfm``) the calls the rules above hand to MPI go to
# recursive doubling instead: across a cut link Open MPI 5.0's own collectives returned *success* with wrong data
# on the ranks that went on, where point-to-point calls, which mpicoll's algorithms are made of, reported the
# failure (docs/elastic.md).  One rank, non-commutative ops and a rule set by hand still go to MPI.
FAULT_TOLERANT_RULES = _point_to_point(WITHOUT_NODE_RULES)
FAULT_TOLERANT_ACROSS_NODES_RULES = _point_to_point(ACROSS_NODES_RULES)


def _variable(collective: str, device: bool) -> str:
    return f"MPICOLL_AUTO_{'DEVICE_' if device else ''}{collective.upper()}"


def rule(collective: str, device: bool = False, across_nodes: bool = False) -> list[tuple[str, float]]:
    """The rule in force for ``collective``: [(algorithm, exclusive byte limit), ...].  ``across_nodes``:
    the communicator spans nodes of several ranks each, consecutive ranks per node."""
    if device:
        rules = DEVICE_RULES
    elif failure.fault_tolerant():
        rules = FAULT_TOLERANT_ACROSS_NODES_RULES if across_nodes else FAULT_TOLERANT_RULES
    else:
        rules = ACROSS_NODES_RULES if across_nodes else DEFAULT_RULES
    default = rules[collective]
    return _parse(_variable(collective, device), os.environ.get(_variable(collective, device), default), device)


@functools.lru_cache(maxsize=64)
def _parse(variable: str, text: str, device: bool) -> list[tuple[str, float]]:
    from . import REGISTRY
    parsed = []
    for part in text.split(","):
        name, _, limit = part.strip().partition(":")
        if name not in REGISTRY or (device and not REGISTRY[name].device):
            raise ValueError(f"{variable}={text!r}: {name!r} is not an algorithm "
                             f"{'that serves device arrays' if device else 'of mpicoll'}")
        parsed.append((name, parse_bytes(limit) if limit else float("inf")))
    if parsed[-1][1] != float("inf"):
        raise ValueError(f"{variable}={text!r}: the last algorithm must have no limit")
    return parsed


def straight_to_mpi_below(collective: str, across_nodes: bool = False) -> float:
    """Bytes below which a caller that can reach only MPI's own call in C (the torch backend's short way,
    ``mpicoll/torch/_shortway.c``) takes it: where ``auto``'s rule starts with MPI's, that limit; on one node,
    where the allreduce goes to the node from the first byte, the limit of the rule without the node (what that
    short way took before the node came), else -1 (none)."""
    parsed = rule(collective, across_nodes=across_nodes)
    if parsed[0][0] == "shm" and _variable(collective, False) not in os.environ:
        parsed = _parse(_variable(collective, False), WITHOUT_NODE_RULES[collective], False)
    first, limit = parsed[0]
    return limit if first == "mpi" else -1


def check_settings() -> None:
    """Parse every ``MPICOLL_AUTO_*`` rule in force, raising the first bad one's ValueError (it names the
    variable)."""
    for collective in DEFAULT_RULES:
        rule(collective), rule(collective, across_nodes=True), rule(collective, device=True)


def choose(collective: str, nbytes: int, size: int, commutative: bool = True, device: bool = False,
           across_nodes: bool = False) -> str:
    """The algorithm ``auto`` runs for one call."""
    if not device:
        if size == 1:
            return "mpi"
        if not commutative and _variable(collective, device) not in os.environ:
            return "mpi"
    for name, limit in rule(collective, device, across_nodes):
        if nbytes < limit:
            return name
    raise AssertionError("unreachable: the last rule has no limit")
