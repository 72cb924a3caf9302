"""A failure notice carries the sender's error kind and the ranks it says are lost as data, and a failure told
on is passed on as it was told (the notices themselves travel in the parameter-server and Sandblaster jobs
of tests/ps, tests/sandblaster and tests/train/test_elastic.py)."""

from __future__ import annotations

import pytest

from mpicoll.base.errors import (CollectiveTimeout, Diverged, PartFailed, PeerFailed, RanksLost, ServerFailed,
                                 ServerLost)
from mpicoll.channel.notices import what_failed


@pytest.mark.parametrize("error, kind, lost, died", [
    (ServerLost("rank 2 lost parameter server rank(s) 3, 0", [3, 0]), "ServerLost", [0, 3], True),
    (PeerFailed("allreduce", 1, [4, 2], "the process died"), "PeerFailed", [2, 4], True),
    (RanksLost("allreduce", 1, [5]), "RanksLost", [5], True),
    (CollectiveTimeout("bcast", 0, [1], 2.0), "CollectiveTimeout", [1], True),
    (Diverged("every gradient holds NaN"), "Diverged", [], False),
    (OSError(28, "No space left on device"), "OSError", [], False)])
def test_a_notice_names_the_errors_kind_and_lost_ranks_and_a_told_one_passes_them_on(error, kind, lost, died):
    assert what_failed(error) == (kind, lost)
    told = PartFailed(3, 2, f"{type(error).__name__}: {error}", *what_failed(error))
    again = ServerFailed(4, 3, f"PartFailed: {told}", *what_failed(told))       # a server stopped by it tells on
    assert what_failed(told) == what_failed(again) == (kind, lost)
    assert told.says_ranks_died() == again.says_ranks_died() == died
    assert str(again).startswith("worker rank 4: parameter server rank 3 failed: PartFailed: rank 3: rank 2 failed: ")
    assert (again.server, told.peer) == (3, 2)


@pytest.mark.mpi
def test_world_ranks_are_the_named_ranks_in_comm_world_after_the_context_is_freed_too():
    """A rank ending a job that lost ranks tells every other rank why, but those (failure.end_job): the lost ones
    are named in the context's communicator and must be found in COMM_WORLD, often after the context is freed (a
    parameter server is closed before its job ends)."""
    from mpicoll.channel.context import Context
    from tests.support.mpi import RANK, WORLD, everywhere
    backwards = WORLD.Split(0, -RANK)            # rank r here is world rank size - 1 - r
    ctx = Context(backwards)
    names = list(range(backwards.Get_size()))
    expected = [WORLD.Get_size() - 1 - name for name in names]
    before = ctx.world_ranks(names)
    ctx.free()
    after = ctx.world_ranks(names)
    backwards.Free()
    everywhere(before == after == expected and ctx.world_ranks([]) == [], f"{before} {after} {expected}")
