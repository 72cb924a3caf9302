"""The order in which the benchmarks interleave their contenders (benchmarks.common.interleaved_times)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from mpicoll.benchmarks.common import interleaved_times
from tests.support.mpi import WORLD, everywhere


@pytest.mark.mpi
@pytest.mark.parametrize("contenders", [1, 2, 7])
def test_every_call_runs_once_a_round_in_an_order_alike_on_every_rank_and_follows_each_other_one(contenders):
    """Each round runs every call once; every rank runs them in the same order (they are collective); and each
    call is preceded by each of the others about equally often, not by the same one round after round (as a
    rotation did: a call always after the heaviest contender read 0.82-0.88x MPI's own)."""
    rounds = 280
    ran: list[int] = []
    times = interleaved_times(WORLD, [lambda j=j: ran.append(j) for j in range(contenders)], rounds)
    everywhere(times.shape == (contenders, rounds) and np.all(times >= 0), f"times of shape {times.shape}")
    per_round = np.array(ran).reshape(rounds, contenders)
    everywhere(all(sorted(order) == list(range(contenders)) for order in per_round), "a call ran twice in a round")
    orders = WORLD.allgather(ran)
    everywhere(all(order == orders[0] for order in orders), "the ranks ran the calls in different orders")
    if contenders < 3:
        return
    before = collections.Counter(zip(ran, ran[1:]))          # (previous, next): how often
    expected = (len(ran) - 1) / (contenders * (contenders - 1))   # each ordered pair of different calls
    pairs = [before[(a, b)] for a in range(contenders) for b in range(contenders) if a != b]
    everywhere(min(pairs) > expected / 3 and max(pairs) < expected * 3,
               f"each call follows the others unevenly: {min(pairs)}-{max(pairs)} times, {expected:.0f} expected")
