"""The MPI world of this test run, and failing on every rank at once."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpicoll.channel.nodes import node_members

__all__ = ["WORLD", "P", "RANK", "everywhere", "shared_seed", "ranks_share_one_node", "require_one_node",
           "communicators_left"]

WORLD = MPI.COMM_WORLD
P = WORLD.Get_size()          # the ranks of this run
RANK = WORLD.Get_rank()


def everywhere(ok: bool, message: str = "", comm: MPI.Intracomm = MPI.COMM_WORLD) -> None:
    """Assert ``ok`` on every rank at once: all ranks fail if any does, naming the failing ranks."""
    failures = comm.allgather(None if ok else message)
    bad = {rank: text for rank, text in enumerate(failures) if text is not None}
    if bad:
        lines = "\n".join(f"  rank {rank}: {text}" for rank, text in bad.items())
        pytest.fail(f"failed on rank(s) {sorted(bad)}:\n{lines}", pytrace=False)


def shared_seed(comm: MPI.Intracomm = MPI.COMM_WORLD) -> int:
    """Fresh entropy, the same on every rank (so a failure can name one seed to replay)."""
    return comm.bcast(int(np.random.SeedSequence().entropy % (1 << 63)) if comm.Get_rank() == 0 else None)


def ranks_share_one_node(comm: MPI.Intracomm = MPI.COMM_WORLD) -> bool:
    """True when every rank of ``comm`` runs on this node (shared memory reaches them all)."""
    return len(node_members(comm)) == comm.Get_size()


def require_one_node(channel: str | None = "shared") -> None:
    """Skip a test that forces the shared-memory channel when the ranks span several nodes."""
    if channel == "shared" and not ranks_share_one_node():
        pytest.skip("the shared-memory channel needs every rank on one node")


def communicators_left(comm: MPI.Intracomm = MPI.COMM_WORLD, most: int = 4096) -> int:
    """How many more communicators this process can make (up to ``most``): duplicates of ``comm`` are made
    until MPI refuses, then freed.  MPICH has about 2,000 communicator ids a process, so a job that leaves
    one behind each run stops a long sweep; Open MPI's many more make the count reach ``most``.  Collective."""
    made = []
    try:
        while len(made) < most:
            made.append(comm.Dup())
    except MPI.Exception:
        pass
    for each in made:
        each.Free()
    return len(made)
