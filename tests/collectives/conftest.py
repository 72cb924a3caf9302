"""The one communicator fixture of the collective tests: every algorithm variant over every kind of
communicator (``comm``), and the plain mpi4py communicator it wraps (``mpi``), whose own collectives
are the reference."""

from __future__ import annotations

import pytest
from mpi4py import MPI

import mpicoll
from mpicoll.collectives.algorithms import hierarchical, node, ring, ring_shared
from tests.support.mpi import RANK, WORLD, require_one_node

# (id, algorithm, environment): the ring is run over both of its channels,
# with small segments so that small test buffers still take the pipelined path.
# Under the multi-node tier (scripts/run-tests: 2 emulated nodes x 2 ranks),
# ``hierarchical`` runs its intra-node and inter-node phases.
VARIANTS = {
    "ring-p2p": ("ring", {"MPICOLL_CHANNEL": "p2p", "MPICOLL_SEGMENT": "1K"}),
    "ring-shared": ("ring", {"MPICOLL_CHANNEL": "shared", "MPICOLL_SEGMENT": "1K"}),   # streamed (hierarchical: not)
    "ring-streaming": ("ring", {"MPICOLL_CHANNEL": "p2p", "MPICOLL_SEGMENT": "1K"}),  # final chunks past the caches
    "parallel": ("parallel", {}),
    "recursive_doubling": ("recursive_doubling", {}),
    "direct": ("direct", {}),
    "hierarchical": ("hierarchical", {"MPICOLL_SEGMENT": "1K"}),    # the ring on one node; across nodes its own
    "hierarchical-p2p": ("hierarchical", {"MPICOLL_CHANNEL": "p2p", "MPICOLL_SEGMENT": "1K"}),
    "hierarchical-no-node": ("hierarchical", {"MPICOLL_SEGMENT": "1K"}),   # the ring's shared memory inside nodes
    "mpi": ("mpi", {}),
    "auto": ("auto", {"MPICOLL_AUTO_ALLREDUCE": "mpi:64,ring", "MPICOLL_AUTO_REDUCE_SCATTER_BLOCK": "mpi:64,ring",
                      "MPICOLL_AUTO_ALLGATHER": "mpi:64,ring", "MPICOLL_AUTO_BCAST": "mpi:64,ring"}),
}


@pytest.fixture(params=["world", "self", "dup", "split"])
def mpi(request):
    """The MPI communicator under test, plain mpi4py (the reference calls go to it): as mpi4py's own tests bind
    each body to several communicators, the world, COMM_SELF, a duplicate of the world, and a split of it
    into two halves whose ranks run in the reverse order of the world's."""
    if request.param in ("world", "self"):
        yield WORLD if request.param == "world" else MPI.COMM_SELF
        return
    made = WORLD.Dup() if request.param == "dup" else WORLD.Split(RANK % 2, key=-RANK)
    yield made
    made.Free()


@pytest.fixture(params=list(VARIANTS))
def comm(request, monkeypatch, mpi):
    """An mpicoll Communicator over ``mpi`` running one algorithm variant (by default every one of
    ``VARIANTS``; a module takes fewer with ``@pytest.mark.parametrize("comm", [...], indirect=True)``)."""
    algorithm, environment = VARIANTS[request.param]
    require_one_node(environment.get("MPICOLL_CHANNEL"))
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    if request.param == "ring-streaming":  # at every test size, not only past the caches' size
        monkeypatch.setattr(ring, "STREAM_FROM", 0)
    if request.param == "ring-shared":     # stores around the caches at every test size; the hierarchical
        monkeypatch.setattr(ring_shared, "STREAM_FROM", 0)    # allreduce runs the same ring with cached stores
    if request.param == "hierarchical-no-node":    # as where the C extension is absent or under fault tolerance
        monkeypatch.setattr(node, "_shm", None)
    if algorithm == "hierarchical":          # its own phases at every test size, not MPI's for small ones
        monkeypatch.setattr(hierarchical, "ACROSS_NODES_FROM", dict.fromkeys(hierarchical.ACROSS_NODES_FROM, 0))
    communicator = mpicoll.Communicator(mpi, algorithm=algorithm)
    communicator.Barrier()
    with communicator:
        yield communicator


# Variants that differ from another only in the channel or a threshold, and tests of the data path alone
# (segments and pipelining of a large buffer), run over the world alone; the algorithms themselves run over
# every kind of communicator.
WORLD_ONLY = {"ring-shared", "ring-streaming", "hierarchical-p2p", "hierarchical-no-node"}
WORLD_ONLY_TESTS = {"test_allreduce_large_buffer"}


def _world_only(item) -> bool:
    params = item.callspec.params
    return (params.get("comm") in WORLD_ONLY or item.originalname in WORLD_ONLY_TESTS) and \
        params.get("mpi", "world") != "world"


def pytest_collection_modifyitems(config, items):
    """Deselect what runs over the world alone (``WORLD_ONLY``, ``WORLD_ONLY_TESTS``) over other communicators."""
    dropped = [item for item in items if getattr(item, "callspec", None) is not None and _world_only(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        dropped = set(dropped)
        items[:] = [item for item in items if item not in dropped]
