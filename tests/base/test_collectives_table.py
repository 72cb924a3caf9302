"""mpicoll.base.collectives is the one place collectives are spelled: every spelling finds its row, and each
row's names are the methods the layers above call."""

from __future__ import annotations

import pytest
from mpi4py import MPI

import mpicoll
from mpicoll.base.collectives import COLLECTIVES, find
from mpicoll.collectives import algorithms
from mpicoll.collectives.algorithms import auto, hierarchical
from mpicoll.collectives.algorithms.base import Algorithm


@pytest.mark.parametrize("collective", list(COLLECTIVES.values()), ids=list(COLLECTIVES))
def test_every_row_names_methods_that_exist_everywhere_it_is_called(collective):
    for spelling in (collective.name, collective.method, collective.nonblocking, collective.option):
        assert find(spelling) is collective, spelling
    assert collective.nonblocking == "I" + collective.method[0].lower() + collective.method[1:]   # MPI's rule
    for method in (collective.method, collective.nonblocking):
        assert callable(getattr(MPI.Intracomm, method)) and method in vars(mpicoll.Communicator), method
    assert callable(getattr(Algorithm, collective.name))
    for name in algorithms.REGISTRY:
        assert callable(getattr(algorithms.get(name), collective.name)), name
    assert auto.rule(collective.name) and auto.rule(collective.name, across_nodes=True)


def test_thresholds_across_nodes_are_one_number_for_auto_and_hierarchical():
    for collective in COLLECTIVES.values():
        first, limit = auto.rule(collective.name, across_nodes=True)[0]
        if collective.across_nodes_from is None:
            assert first == "mpi" and limit == float("inf") and collective.name not in hierarchical.ACROSS_NODES_FROM
        else:
            assert (first, limit) == ("mpi", collective.across_nodes_from)
            assert hierarchical.ACROSS_NODES_FROM[collective.name] == collective.across_nodes_from


def test_bus_factors_are_nccl_tests_and_an_allreduce_is_a_reduce_scatter_then_an_allgather():
    for p in (1, 2, 3, 8, 1000):
        parts = find("reduce_scatter").bus_factor(p) + find("allgather").bus_factor(p)
        assert find("allreduce").bus_factor(p) == pytest.approx(parts) == pytest.approx(2 * (p - 1) / p)
        assert find("bcast").bus_factor(p) == 1.0


def test_an_unknown_collective_names_the_known_ones():
    with pytest.raises(KeyError, match="allreduce, reduce_scatter_block, allgather, bcast"):
        find("alltoall")
