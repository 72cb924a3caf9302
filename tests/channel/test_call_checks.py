"""Bad calls fail on every rank together, with the ranks and values named; lost peers time out."""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from tests.support.mpi import P, RANK, WORLD, everywhere, require_one_node, shared_seed

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


OWN_ALGORITHMS = [name for name in mpicoll.collectives.algorithms.REGISTRY if name != "mpi"]
CHANNELS = [("ring", "shared"), *[(name, "p2p") for name in OWN_ALGORITHMS]]


def _disagreeing_call(comm, case: str):
    """One call of at least FINGERPRINT_FROM elements on every rank, that the ranks disagree on by ``case``."""
    n = mpicoll.collectives.communicator.FINGERPRINT_FROM + (RANK if case.endswith("count") else 0)
    dtype = np.float32 if case == "dtype" and RANK == P - 1 else np.float64
    op = MPI.MAX if case == "op" and RANK == P - 1 else MPI.SUM
    data = np.ones(n, dtype)
    if case == "root":
        return lambda: comm.Bcast(data, root=RANK % 2)
    if case == "allgather count":
        return lambda: comm.Allgather(data, np.empty(n * P, dtype))
    if case == "reduce_scatter count":
        return lambda: comm.Reduce_scatter_block(np.ones(n * P, dtype), data)
    return lambda: comm.Allreduce(MPI.IN_PLACE, data, op)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", ["count", "op", "dtype", "root", "allgather count", "reduce_scatter count"])
@pytest.mark.parametrize("algorithm,channel", CHANNELS, ids=[f"{a}-{c}" for a, c in CHANNELS])
def test_mismatches_after_the_first_call_are_caught_on_every_rank(monkeypatch, algorithm, channel, case):
    """Without debug mode, calls mpicoll's algorithms carry from FINGERPRINT_FROM elements carry a
    fingerprint: ranks that disagree all get MismatchError naming what each passed, promptly (not a
    timeout), never a wrong answer that differs per rank; and the communicator works afterwards."""
    require_one_node(channel)
    monkeypatch.delenv("MPICOLL_DEBUG", raising=False)
    monkeypatch.setenv("MPICOLL_CHANNEL", channel)
    with mpicoll.Communicator(WORLD, algorithm=algorithm) as comm:
        comm.Allreduce(np.ones(4), np.empty(4))              # the first call's full check passes
        error = raised(_disagreeing_call(comm, case))
        everywhere(isinstance(error, mpicoll.MismatchError), repr(error))
        everywhere(len(error.per_rank) == P and len(set(error.per_rank.values())) > 1, str(error))
        data = np.random.default_rng(RANK).standard_normal(mpicoll.collectives.communicator.FINGERPRINT_FROM + 3)
        expected = np.empty_like(data)
        MPI.Intracomm.Allreduce(WORLD, data, expected)
        comm.Allreduce(MPI.IN_PLACE, data)                    # a fresh channel after the disagreement
        everywhere(np.allclose(data, expected), "wrong sum after a caught mismatch")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["ring", "direct", "parallel"])
def test_skewed_ranks_with_changing_calls_are_never_taken_for_a_mismatch(monkeypatch, algorithm):
    """The fingerprint's look at the queues must not mistake a faster peer's next call for a different
    call: ranks arrive up to 40 ms apart (so waits last past Fingerprint.LOOK_EVERY and peers run a
    call ahead) while the calls alternate in count and collective; every result against MPI's own."""
    monkeypatch.delenv("MPICOLL_DEBUG", raising=False)
    n = mpicoll.collectives.communicator.FINGERPRINT_FROM
    rng = np.random.default_rng(RANK)
    with mpicoll.Communicator(WORLD, algorithm=algorithm) as comm:
        comm.Allreduce(np.ones(4), np.empty(4))
        for step in range(24):
            time.sleep(rng.uniform(0, 0.04))
            count = n + (step % 3) * P
            data = rng.standard_normal(count).astype(np.float32)
            if step % 2:
                out, expected = np.empty(P * count, np.float32), np.empty(P * count, np.float32)
                error = raised(lambda: comm.Allgather(data, out))
                MPI.Intracomm.Allgather(WORLD, data, expected)
                everywhere(error is None and np.array_equal(out, expected), f"step {step}: {error!r}")
            else:
                out, expected = np.empty_like(data), np.empty_like(data)
                error = raised(lambda: comm.Allreduce(data, out))
                MPI.Intracomm.Allreduce(WORLD, data, expected)
                everywhere(error is None and np.allclose(out, expected, rtol=1e-4, atol=1e-4),
                           f"step {step}: {error!r}")


@pytest.mark.mpi(min_size=3)
def test_a_message_of_a_peers_next_call_is_not_taken_for_a_mismatch(monkeypatch):
    """Rank 0 holds back its allgather message to rank 1 for 3x Fingerprint.LOOK_EVERY, so rank 2
    finishes the allgather and sends rank 1 its part of the next, different call while rank 1 is
    still waiting: rank 1 looks at its queue, finds that message (the other parity) and must go on
    waiting, not raise.  Both results against MPI's own."""
    from mpicoll.channel.context import Context
    from mpicoll.base.tags import Tag
    monkeypatch.delenv("MPICOLL_DEBUG", raising=False)
    delay = 3 * mpicoll.channel.checks.Fingerprint.LOOK_EVERY
    if RANK == 0:
        isend, waitall, held = Context.isend, Context.waitall, []

        def holding_isend(self, array, dest, tag=0):
            if self.stamp and dest == 1 and tag == Tag.DIRECT_GATHER:
                held.append((self, array, dest, tag))
                return MPI.REQUEST_NULL
            return isend(self, array, dest, tag)

        def late_waitall(self, requests, peers, limit=None):
            if held:
                until = time.perf_counter() + delay
                while time.perf_counter() < until:       # the other transfers progress meanwhile
                    MPI.Request.Testall(requests)
                peers = [peers] * len(requests) if isinstance(peers, int) else list(peers)
                requests = [*requests, *(isend(*message) for message in held)]
                peers += [1] * len(held)
                held.clear()
            return waitall(self, requests, peers, limit)

        monkeypatch.setattr(Context, "isend", holding_isend)
        monkeypatch.setattr(Context, "waitall", late_waitall)
    n = mpicoll.collectives.communicator.FINGERPRINT_FROM
    rng = np.random.default_rng(RANK)
    with mpicoll.Communicator(WORLD, algorithm="direct") as comm:
        comm.Allreduce(np.ones(4), np.empty(4))
        data = rng.standard_normal(n)
        gathered, expected = np.empty(P * n), np.empty(P * n)
        first = raised(lambda: comm.Allgather(data, gathered))
        summed = np.empty(n + P)
        second = raised(lambda: comm.Allreduce(np.resize(data, n + P), summed))
    MPI.Intracomm.Allgather(WORLD, data, expected)
    everywhere(first is None and np.array_equal(gathered, expected), f"allgather: {first!r}")
    total = np.empty(n + P)
    MPI.Intracomm.Allreduce(WORLD, np.resize(data, n + P), total)
    everywhere(second is None and np.allclose(summed, total), f"allreduce: {second!r}")


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_algorithms_fail_on_the_first_call(monkeypatch):
    """The algorithm is part of every call's signature: caught by the first call's full check."""
    monkeypatch.delenv("MPICOLL_DEBUG", raising=False)
    with mpicoll.Communicator(WORLD, algorithm="parallel" if RANK == 1 else "ring") as comm:
        error = raised(lambda: comm.Allreduce(np.ones(4), np.empty(4)))
        everywhere(isinstance(error, mpicoll.MismatchError) and "algorithm=parallel" in str(error), repr(error))


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


@pytest.mark.parametrize("collective", ["Allreduce", "Allgather", "Reduce_scatter_block"])
def test_overlapping_buffers_are_refused_on_every_call_not_only_the_first(collective):
    """After a communicator's first call, ``auto`` hands small numpy calls straight to MPI; overlapping send
    and receive buffers must still be refused in one line (MPICH aborts the whole job on them), every
    time, and the communicator must work afterwards."""
    comm = mpicoll.Communicator(WORLD)
    x = np.arange(8.0 * P)
    first = {"Allreduce": (np.ones(4 * P), np.empty(4 * P)), "Allgather": (np.ones(4), np.empty(4 * P)),
             "Reduce_scatter_block": (np.ones(4 * P), np.empty(4))}[collective]
    getattr(comm, collective)(*first)                       # checked in full; later small calls go to MPI
    refusals = 0
    for _ in range(3):
        try:
            if collective == "Allreduce":
                comm.Allreduce(x[: 4 * P], x[2: 4 * P + 2])
            elif collective == "Allgather":
                comm.Allgather(x[:4], x[: 4 * P])
            else:
                comm.Reduce_scatter_block(x[: 4 * P], x[: 4])
        except ValueError as error:
            refusals += "overlap" in str(error)
    out = np.empty(4 * P)
    comm.Allreduce(np.ones(4 * P), out)
    everywhere(refusals == 3 and np.array_equal(out, np.full(4 * P, float(P))),
               f"{refusals} of 3 overlapping calls refused")
    comm.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("count, algorithm", [(4, "auto"), (300_000, "auto"), (1000, "ring")])
def test_a_second_thread_on_a_busy_communicator_is_refused_and_the_first_call_is_right(count, algorithm):
    """Rank 0's first thread is in an allreduce (rank 1 joins it 0.5 s late) when its second thread calls
    another on the same communicator: that one gets ConcurrentCall (MPI forbids two at once; their
    messages used to mix into a wrong result), and the first call's result is right."""
    import threading
    comm = mpicoll.Communicator(WORLD, algorithm=algorithm)
    comm.Allreduce(np.ones(count), np.empty(count))             # the full first-call check, on every rank
    rng = np.random.default_rng([shared_seed(), RANK])
    x = rng.standard_normal(count)
    expected = np.sum(WORLD.allgather(x), axis=0)
    result, refused = np.empty(count), []

    def intruder():
        try:
            comm.Allreduce(np.ones(count), np.empty(count))
        except mpicoll.ConcurrentCall as error:
            refused.append(str(error))

    second = threading.Timer(0.1, intruder) if RANK == 0 else None
    if second:
        second.start()
    else:
        time.sleep(0.5)
    comm.Allreduce(x, result)
    if second:
        second.join()
    everywhere(np.allclose(result, expected) and (RANK != 0 or len(refused) == 1),
               f"refused: {refused}; result right: {np.allclose(result, expected)}")
    comm.close()


def test_every_error_a_job_can_stop_on_is_an_mpicoll_error():
    """mpicoll train prints MpicollErrors in one line; WorkerLost used to be a bare RuntimeError (a
    traceback)."""
    from mpicoll import ps
    assert issubclass(ps.WorkerLost, mpicoll.MpicollError)
    assert issubclass(mpicoll.ConcurrentCall, mpicoll.MpicollError)
