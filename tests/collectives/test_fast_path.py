"""``auto``'s fast path for small calls (compiled, and its Python fallback): every spelling mpi4py takes gives
MPI's own answer, the calls it cannot clear go the checked way, and a second thread is refused."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from mpicoll.collectives import communicator
from mpicoll.collectives.algorithms import auto
from mpicoll.collectives.reduction import op_name
from tests.support.mpi import P, RANK, WORLD, everywhere, shared_seed

pytestmark = pytest.mark.mpi


@pytest.fixture(params=["c", "python"])
def fast_path(request, monkeypatch):
    """Which fast path the communicators made in the test install (MPICOLL_FAST_PATH, the same on every rank)."""
    if request.param == "c" and communicator.FastCall is None:
        pytest.skip("the compiled fast path was not built here (no C compiler at install)")
    monkeypatch.setenv("MPICOLL_FAST_PATH", request.param)
    # small allreduces straight to MPI, as auto's rule has them where the on-node allreduce is absent (its own
    # fast path, from C to the node: tests/collectives/test_shm.py)
    monkeypatch.setattr(auto, "DEFAULT_RULES", auto.WITHOUT_NODE_RULES)
    return request.param


def installed(comm: mpicoll.Communicator, method: str) -> str:
    """What answers ``comm.<method>`` now: "c", "python" (a closure) or "checked" (the class's method)."""
    found = comm.__dict__.get(method)
    return "checked" if found is None else "c" if type(found).__name__ == "FastCall" else "python"


def test_every_spelling_gives_mpis_answer(fast_path):
    rng = np.random.default_rng([shared_seed(), RANK])
    comm = mpicoll.Communicator(WORLD)
    comm.Allreduce(np.ones(3), np.empty(3))                 # the first call, checked in full on every rank
    everywhere(all(installed(comm, m) == fast_path for m in ("Allreduce", "Allgather", "Bcast")),
               f"{[installed(comm, m) for m in ('Allreduce', 'Allgather', 'Bcast')]}")
    for count, dtype in [(0, np.float64), (1, np.int32), (P - 1, np.float32), (1003, np.float64), (5, np.complex128)]:
        x = (rng.standard_normal(count) * 100).astype(dtype)
        expected = np.empty_like(x)
        WORLD.Allreduce(x, expected)
        calls = {
            "positional": lambda out: comm.Allreduce(x, out),
            "op": lambda out: comm.Allreduce(x, out, MPI.SUM),
            "keywords": lambda out: comm.Allreduce(sendbuf=x, recvbuf=out, op=MPI.SUM),
            "in place": lambda out: (out.__setitem__(slice(None), x), comm.Allreduce(MPI.IN_PLACE, out)),
            "views apart": lambda out: comm.Allreduce(np.concatenate([x, x])[:count], out[:]),
        }
        for spelling, call in calls.items():
            out = np.full_like(x, 7)
            call(out)
            everywhere(np.array_equal(out, expected), f"Allreduce {spelling}, {count} x {np.dtype(dtype)}")
        if count and np.dtype(dtype).kind != "c":
            out, expected = np.empty_like(x), np.empty_like(x)
            comm.Allreduce(x, out, MPI.MAX)
            WORLD.Allreduce(x, expected, MPI.MAX)
            everywhere(np.array_equal(out, expected), "Allreduce MAX")
        gathered, expected = np.empty(P * count, dtype), np.empty(P * count, dtype)
        comm.Allgather(x, gathered)
        WORLD.Allgather(x, expected)
        everywhere(np.array_equal(gathered, expected), f"Allgather {count}")
        buf = x.copy() if RANK == 0 else np.zeros_like(x)
        comm.Bcast(buf)
        everywhere(np.array_equal(buf, WORLD.bcast(x if RANK == 0 else None, 0)), f"Bcast, root 0 by default {count}")
        root = P - 1
        buf = x.copy() if RANK == root else np.zeros_like(x)
        comm.Bcast(buf, root)
        everywhere(np.array_equal(buf, WORLD.bcast(x if RANK == root else None, root)), f"Bcast {count}")
        buf = x.copy() if RANK == root else np.zeros_like(x)
        comm.Bcast(buf, root=root)
        everywhere(np.array_equal(buf, WORLD.bcast(x if RANK == root else None, root)), f"Bcast root= {count}")
    comm.close()


def test_what_the_fast_path_cannot_clear_goes_the_checked_way(fast_path):
    """A spec list, a buffer over the size limit and overlapping buffers are the checked path's."""
    comm = mpicoll.Communicator(WORLD)
    comm.Allreduce(np.ones(3), np.empty(3))
    x = np.arange(6.0) + RANK
    out = np.empty(6)
    comm.Allreduce([x, MPI.DOUBLE], [out, MPI.DOUBLE])
    everywhere(np.array_equal(out, np.arange(6.0) * P + P * (P - 1) / 2), "a [buffer, datatype] spec")
    big = np.full(1 << 19, 1.0)                            # 4 MiB: over auto's MPI limit, the ring's
    comm.Allreduce(MPI.IN_PLACE, big)
    everywhere(np.array_equal(big, np.full(1 << 19, float(P))), "a large call")
    error = None
    try:
        comm.Allreduce(x[:4], x[2:])
    except ValueError as caught:
        error = caught
    everywhere(error is not None and "overlap" in str(error), repr(error))
    comm.close()


@pytest.mark.mpi(min_size=2)
def test_a_second_thread_is_refused_while_the_first_call_is_in_mpi(fast_path):
    """Rank 1 joins 0.5 s late; meanwhile rank 0's second thread calls on the same communicator: ConcurrentCall,
    and the turn comes back for the next call (the first call's result is right)."""
    comm = mpicoll.Communicator(WORLD)
    comm.Allreduce(np.ones(3), np.empty(3))
    refused = []

    def intruder():
        try:
            comm.Bcast(np.ones(2))
        except mpicoll.ConcurrentCall as error:
            refused.append(str(error))

    second = threading.Timer(0.1, intruder) if RANK == 0 else None
    if second:
        second.start()
    elif RANK == 1:
        time.sleep(0.5)
    out = np.empty(2)
    comm.Allreduce(np.full(2, RANK + 1.0), out)
    if second:
        second.join()
    comm.Allreduce(MPI.IN_PLACE, again := np.ones(2))       # the turn was given back
    everywhere(np.array_equal(out, np.full(2, P * (P + 1) / 2)) and np.array_equal(again, np.full(2, float(P)))
               and (RANK != 0 or len(refused) == 1 and "Bcast" in refused[0]), f"refused: {refused}")
    comm.close()


@pytest.mark.skipif(P < 2, reason="needs at least 2 ranks (runs in the tiers that have them)")
@pytest.mark.parametrize("algorithm, count, started", [("auto", 1000, False), ("auto", 1, False),
                                                       ("ring", 1003, False), ("auto", 1000, True)])
def test_two_threads_that_take_turns_in_other_orders_on_other_ranks_get_an_error_never_a_wrong_sum(
        fast_path, algorithm, count, started):
    """Two threads share a communicator and take turns (no call overlaps, so none is refused): on even ranks
    thread 0 makes its 3 calls first, on odd ranks thread 1.  Each call paired one thread's data with the
    other's (small calls, straight to MPI: wrong sums, no error; found by the red team): now every call is a
    MismatchError naming the threads, on every rank (started calls too, whichever thread runs them).  In the
    same order on every rank they are right, and so is the main thread's call after them."""
    comm = mpicoll.Communicator(WORLD, algorithm=algorithm)
    comm.Allreduce(np.ones(3), np.empty(3))                 # the first call: from the main thread
    want = {t: sum(100.0 * t + q for q in range(P)) for t in (0, 1)}

    def run(first: int) -> dict:
        outcomes, done = {0: [], 1: []}, threading.Event()

        def calls(t):
            if t != first:
                done.wait()
            for _ in range(3):
                x = np.full(count, 100.0 * t + RANK, np.float32)
                try:
                    if started:
                        comm.Iallreduce(MPI.IN_PLACE, x).Wait()
                    else:
                        comm.Allreduce(MPI.IN_PLACE, x)
                    outcomes[t].append("right" if np.all(x == want[t]) else f"wrong: {x[0]} for {want[t]}")
                except mpicoll.MismatchError as error:
                    outcomes[t].append("MismatchError" if f"from thread 'caller-{1 - t}'" in str(error)
                                       else str(error))
            done.set()

        threads = [threading.Thread(target=calls, args=(t,), name=f"caller-{t}") for t in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return outcomes

    crossed, same = run(first=RANK % 2), run(first=0)
    comm.Allreduce(MPI.IN_PLACE, last := np.full(count, 1.0, np.float32))
    everywhere(crossed == {0: ["MismatchError"] * 3, 1: ["MismatchError"] * 3} and
               same == {0: ["right"] * 3, 1: ["right"] * 3} and np.all(last == P), f"{crossed} {same}")
    comm.close()


@pytest.mark.parametrize("count", [2, 1003, (1 << 18) + 3])       # MPI's own (fast, then checked), mpicoll's
def test_min_and_max_keep_a_nan_whichever_rank_holds_it(fast_path, count):
    """Element k holds a NaN on rank k % p only: MIN and MAX give NaN there and numpy's answer elsewhere, at every
    size (MPI's own predefined MIN and MAX, which small calls use, dropped a NaN held by some ranks: 1.0 where
    rank 0 or 1 of 3 held it), through the fast path, the checked path, a started call and Reduce_scatter_block
    (float32 and float64)."""
    comm = mpicoll.Communicator(WORLD)
    comm.Allreduce(np.ones(3), np.empty(3))                 # the first call, checked in full on every rank
    rng = np.random.default_rng(shared_seed())
    failures = []
    for dtype in (np.float32, np.float64):
        everyone = rng.standard_normal((P, count * P)).astype(dtype)
        for k in range(P):
            everyone[k % P, k] = np.nan
        x = everyone[RANK].copy()
        for op, ufunc in ((MPI.MIN, np.minimum), (MPI.MAX, np.maximum)):
            want = ufunc.reduce(everyone, axis=0)
            out = np.empty_like(x)
            comm.Allreduce(x, out, op)
            started = np.empty_like(x)
            comm.Iallreduce(x, started, op).Wait()
            block = np.empty(count, dtype)
            comm.Reduce_scatter_block(x, block, op)
            for name, got, wanted in (("Allreduce", out, want), ("Iallreduce", started, want),
                                      ("Reduce_scatter_block", block, want[RANK * count:(RANK + 1) * count])):
                if not np.array_equal(got, wanted, equal_nan=True):
                    failures.append(f"{name} {op_name(op)} {np.dtype(dtype)}: {got[:P]} want {wanted[:P]}")
    comm.close()
    everywhere(not failures, f"{failures[:4]}")
