"""Bad calls fail on every rank together, with the ranks and values named; lost peers time out."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from conftest import P, RANK, WORLD, everywhere

pytestmark = pytest.mark.mpi


def raised(call) -> BaseException | None:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the test inspects whatever came out
        return error
    return None


@pytest.fixture
def debug(monkeypatch):
    monkeypatch.setenv("MPICOLL_DEBUG", "1")


@pytest.mark.parametrize("algorithm", ["ring", "auto"])
@pytest.mark.mpi(min_size=2)
def test_mismatched_counts_raise_on_every_rank(debug, algorithm):
    with mpicoll.Communicator(WORLD, algorithm=algorithm) as comm:
        count = 10 + (RANK == P - 1)
        error = raised(lambda: comm.Allreduce(np.ones(count), np.empty(count)))
        everywhere(isinstance(error, mpicoll.MismatchError), f"got {error!r}")
        text = str(error)
        everywhere(f"ranks {P - 1}: Allreduce(count=11" in text and "count=10" in text, text)
        # still usable afterwards
        out = np.empty(4)
        comm.Allreduce(np.ones(4), out)
        everywhere(np.array_equal(out, np.full(4, P)), str(out))


@pytest.mark.mpi(min_size=2)
def test_mismatched_dtype_op_and_root_are_named(debug):
    with mpicoll.Communicator(WORLD, algorithm="ring") as comm:
        dtype = np.float32 if RANK == 0 else np.float64
        error = raised(lambda: comm.Allreduce(np.ones(6, dtype), np.empty(6, dtype)))
        everywhere(isinstance(error, mpicoll.MismatchError) and "float32" in str(error)
                   and "float64" in str(error), repr(error))
        op = MPI.MAX if RANK == 0 else MPI.SUM
        error = raised(lambda: comm.Allreduce(np.ones(6), np.empty(6), op))
        everywhere(isinstance(error, mpicoll.MismatchError) and "op=MAX" in str(error), repr(error))
        root = 0 if RANK == 0 else 1
        error = raised(lambda: comm.Bcast(np.ones(6), root=root))
        everywhere(isinstance(error, mpicoll.MismatchError) and "root=1" in str(error), repr(error))


@pytest.mark.mpi(min_size=2)
def test_first_call_is_checked_without_debug(monkeypatch):
    monkeypatch.delenv("MPICOLL_DEBUG", raising=False)
    with mpicoll.Communicator(WORLD) as comm:
        count = 3 if RANK == 0 else 5
        error = raised(lambda: comm.Allreduce(np.ones(count), np.empty(count)))
        everywhere(isinstance(error, mpicoll.MismatchError), repr(error))


@pytest.mark.mpi(min_size=2)
def test_nan_contribution_is_named_in_debug_mode(debug):
    with mpicoll.Communicator(WORLD, algorithm="ring") as comm:
        data = np.ones(8)
        if RANK == 1:
            data[3] = np.nan
        error = raised(lambda: comm.Allreduce(data, np.empty(8)))
        everywhere(isinstance(error, mpicoll.NonFiniteError) and "rank(s) 1 " in str(error), repr(error))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", ["count", "op", "dtype", "root", "algorithm"])
def test_mismatches_after_the_first_call_are_caught_on_every_rank(monkeypatch, case):
    """Without debug mode, a call mpicoll's algorithms carry (>= 1 MiB) still compares a fingerprint:
    ranks that disagree all get MismatchError, never a wrong answer that differs per rank."""
    monkeypatch.delenv("MPICOLL_DEBUG", raising=False)
    n = (2 << 20) // 4 + 5              # float64 and float32 alike above the fingerprint's 2 MiB
    algorithm = "parallel" if case == "algorithm" and RANK == 1 else "ring"
    with mpicoll.Communicator(WORLD, algorithm=algorithm) as comm:
        first = raised(lambda: comm.Allreduce(np.ones(4), np.empty(4)))     # the first call's full check
        if case == "algorithm":           # caught there already: the algorithm is part of the call's signature
            everywhere(isinstance(first, mpicoll.MismatchError) and "algorithm=parallel" in str(first), repr(first))
            return
        count = n + (RANK if case == "count" else 0)
        dtype = np.float32 if case == "dtype" and RANK == 1 else np.float64
        op = MPI.MAX if case == "op" and RANK == 1 else MPI.SUM
        data = np.ones(count, dtype)
        if case == "root":
            call = lambda: comm.Bcast(data, root=RANK % 2)  # noqa: E731
        else:
            call = lambda: comm.Allreduce(MPI.IN_PLACE, data, op)  # noqa: E731
        error = raised(call)
    everywhere(isinstance(error, mpicoll.MismatchError), repr(error))


@pytest.mark.mpi
def test_an_inf_in_the_first_call_passes_through_without_debug_mode(monkeypatch):
    """Finiteness is the debug mode's check: a first gradient with Inf must not stop a job."""
    monkeypatch.delenv("MPICOLL_DEBUG", raising=False)
    with mpicoll.Communicator(WORLD, algorithm="ring") as comm:
        data, out = np.ones(8), np.empty(8)
        data[2] = np.inf
        error = raised(lambda: comm.Allreduce(data, out))
        everywhere(error is None and np.isinf(out[2]), repr(error))


def test_local_errors_say_what_to_do():
    with mpicoll.Communicator(WORLD, algorithm="ring") as comm:
        cases = [
            (lambda: comm.Allreduce(np.ones(4), np.empty(5)), ValueError, "must match"),
            (lambda: comm.Allreduce(np.ones(4, np.float32), np.empty(4)), ValueError, "one datatype"),
            (lambda: comm.Allreduce(np.ones(8)[::2], np.empty(4)), BufferError, "not contiguous"),
            (lambda: comm.Allreduce(np.ones(4, complex), np.empty(4, complex), MPI.MAX), mpicoll.ReductionError,
             "not defined for complex128"),
            (lambda: comm.Allreduce(np.ones(4), np.empty(4), MPI.BAND), mpicoll.ReductionError, "float64"),
            (lambda: comm.Reduce_scatter_block(np.ones(3 * P + 1), np.empty(3)), ValueError, "Reduce_scatter_block: "),
            (lambda: comm.Allgather(np.ones(2), np.empty(2 * P + 1)), ValueError, "Allgather: "),
            (lambda: comm.Bcast(np.ones(2), root=P), ValueError, "not a rank"),
            (lambda: mpicoll.Communicator(WORLD, algorithm="rung"), ValueError, "Unrecognized algorithm"),
        ]
        problems = []
        for i, (call, kind, words) in enumerate(cases):
            error = raised(call)
            if not isinstance(error, kind) or words not in str(error):
                problems.append(f"case {i}: expected {kind.__name__} with {words!r}, got {error!r}")
        read_only = np.ones(4)
        read_only.setflags(write=False)
        error = raised(lambda: comm.Allreduce(np.ones(4), read_only))
        if not isinstance(error, BufferError) or "read-only" not in str(error):
            problems.append(f"read-only recvbuf: got {error!r}")
        everywhere(not problems, "; ".join(problems))


@pytest.mark.mpi(min_size=2)
def test_absent_peer_times_out_naming_it(monkeypatch):
    """The last rank never joins: every other rank raises CollectiveTimeout naming it."""
    monkeypatch.setenv("MPICOLL_TIMEOUT", "1.5")
    comm = mpicoll.Communicator(WORLD, algorithm="ring")
    comm.Allreduce(np.ones(4), np.empty(4))        # sets up the channel on every rank
    error = None
    if RANK != P - 1:
        error = raised(lambda: comm.Allreduce(np.ones(1000), np.empty(1000)))
    WORLD.Barrier()
    if RANK != P - 1:
        ok = isinstance(error, mpicoll.CollectiveTimeout) and f"rank(s) {P - 1}" in str(error)
        ok = ok or (P > 2 and isinstance(error, mpicoll.CollectiveTimeout))  # others may wait on a waiting peer
    else:
        ok = True
    everywhere(ok, repr(error))
    if RANK != P - 1:
        again = raised(lambda: comm.Allreduce(np.ones(4), np.empty(4)))
        everywhere(isinstance(again, RuntimeError) and "unusable" in str(again), repr(again))
    else:
        everywhere(True)
