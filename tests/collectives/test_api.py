"""The array API and the communicator's drop-in behaviour, at any rank count."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from tests.support.mpi import P, RANK, WORLD, everywhere, shared_seed

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("algorithm", ["ring", "parallel", "recursive_doubling", "auto"])
def test_array_functions_match_numpy_over_gathered_inputs(algorithm):
    seed = shared_seed()
    rng = np.random.default_rng([seed, RANK])
    everyone = lambda x: np.array(WORLD.allgather(x))  # noqa: E731
    problems = []

    x = rng.standard_normal((5, 7)).astype(np.float32)[:, ::2]          # non-contiguous view
    total = mpicoll.allreduce(x, comm=WORLD, algorithm=algorithm)
    if total.shape != x.shape or not np.allclose(total, everyone(x).sum(0), rtol=1e-5, atol=1e-5):
        problems.append("allreduce sum of a strided view")
    biggest = mpicoll.allreduce(x, "max", comm=WORLD, algorithm=algorithm)
    if not np.array_equal(biggest, everyone(x).max(0)):
        problems.append("allreduce max")

    y = rng.integers(-50, 50, (P * 3, 2))
    share = mpicoll.reduce_scatter(y, comm=WORLD, algorithm=algorithm)
    if not np.array_equal(share, everyone(y).sum(0)[RANK * 3:(RANK + 1) * 3]):
        problems.append("reduce_scatter")

    z = rng.standard_normal(4)
    gathered = mpicoll.allgather(z, comm=WORLD, algorithm=algorithm)
    if not np.array_equal(gathered, np.concatenate(WORLD.allgather(z))):
        problems.append("allgather")
    scalars = mpicoll.allgather(np.float64(RANK), comm=WORLD, algorithm=algorithm)
    if not np.array_equal(scalars, np.arange(P, dtype=float)):
        problems.append("allgather of scalars")

    w = rng.standard_normal((2, 3))
    got = mpicoll.broadcast(w, root=P - 1, comm=WORLD, algorithm=algorithm)
    if not np.array_equal(got, WORLD.bcast(w, root=P - 1)):
        problems.append("broadcast")

    inplace = rng.standard_normal(9)
    expected = everyone(inplace).sum(0)
    returned = mpicoll.allreduce(inplace, out=inplace, comm=WORLD, algorithm=algorithm)
    if returned is not inplace or not np.allclose(inplace, expected):
        problems.append("allreduce out=x in place")
    strided_out = np.zeros((9, 2))[:, 0]
    mpicoll.allreduce(rng.standard_normal(9), out=strided_out, comm=WORLD, algorithm=algorithm)
    if not np.isfinite(strided_out).all() or not np.any(strided_out):
        problems.append("allreduce into a strided out")

    # Fortran-ordered arrays (transposed views) are contiguous, but their memory is not in element order
    fortran = rng.standard_normal((4, 6)).T
    expected = everyone(fortran).sum(0)
    mpicoll.allreduce(fortran, out=fortran, comm=WORLD, algorithm=algorithm)
    if not np.allclose(fortran, expected):
        problems.append("allreduce in place of a Fortran-ordered array")
    fortran_out = np.empty((4, 6)).T
    mpicoll.allreduce(np.ascontiguousarray(fortran), out=fortran_out, comm=WORLD, algorithm=algorithm)
    if not np.allclose(fortran_out, everyone(fortran).sum(0)):
        problems.append("allreduce into a Fortran-ordered out")
    tall = rng.standard_normal((2, 3)).T
    if not np.array_equal(mpicoll.allgather(tall, comm=WORLD, algorithm=algorithm), np.concatenate(WORLD.allgather(tall))):
        problems.append("allgather of a Fortran-ordered array")
    everywhere(not problems, f"seed {seed}: {problems}")


@pytest.mark.parametrize("algorithm", ["ring", "auto"])
def test_average_is_the_sum_over_the_rank_count(algorithm):
    rng = np.random.default_rng([shared_seed(), RANK])
    x = rng.standard_normal(1001).astype(np.float32)
    expected = np.array(WORLD.allgather(x), np.float64).mean(0)
    results = {"allreduce": mpicoll.allreduce(x, "average", comm=WORLD, algorithm=algorithm),
               "iallreduce": mpicoll.iallreduce(x, "avg", comm=WORLD, algorithm=algorithm).wait()}
    in_place = x.copy()
    mpicoll.allreduce(in_place, "mean", comm=WORLD, algorithm=algorithm, out=in_place)
    results["in place"] = in_place
    wrong = [name for name, got in results.items()
             if got.dtype != x.dtype or not np.allclose(got, expected, 1e-5, 1e-6)]
    rows = rng.standard_normal((2 * P, 3))
    share = mpicoll.reduce_scatter(rows, "average", comm=WORLD, algorithm=algorithm)
    if not np.allclose(share, np.array(WORLD.allgather(rows)).mean(0)[2 * RANK:2 * RANK + 2]):
        wrong.append("reduce_scatter")
    with pytest.raises(ValueError, match="needs floating-point or complex arrays, got int64"):
        mpicoll.allreduce(np.arange(3, dtype=np.int64), "average", comm=WORLD, algorithm=algorithm)
    everywhere(not wrong, f"average wrong in {wrong}")


@pytest.mark.parametrize("algorithm", ["ring", "auto"])
@pytest.mark.parametrize("count", [0, 1, 5, 1001])
def test_arrays_in_the_other_byte_order_are_read_as_their_values(algorithm, count):
    """A big-endian array (on this little-endian machine) is converted, not read as native floats (which summed
    1.0 + 1.0 to -0.0625 through the drop-in, before it was refused there); results are in the machine's order,
    and an ``out`` in the other order (in place too) gets the values."""
    rng = np.random.default_rng([shared_seed(), RANK])
    other = np.dtype(np.float64).newbyteorder("S")
    x = rng.standard_normal(count).astype(other)
    values = np.array(WORLD.allgather(x.astype(np.float64)))
    wrong = []
    total = mpicoll.allreduce(x, comm=WORLD, algorithm=algorithm)
    if total.dtype != np.float64 or not np.allclose(total, values.sum(0), rtol=1e-12, atol=1e-12):
        wrong.append("allreduce")
    in_place = x.copy()
    if mpicoll.allreduce(in_place, out=in_place, comm=WORLD, algorithm=algorithm) is not in_place or \
            in_place.dtype != other or not np.allclose(in_place, values.sum(0), rtol=1e-12, atol=1e-12):
        wrong.append("allreduce in place")
    if not np.array_equal(mpicoll.allgather(x, comm=WORLD, algorithm=algorithm), np.concatenate(values)):
        wrong.append("allgather")
    if not np.array_equal(mpicoll.broadcast(x, root=P - 1, comm=WORLD, algorithm=algorithm), values[P - 1]):
        wrong.append("broadcast")
    compressed = mpicoll.allreduce(x, compression="fp16", comm=WORLD, algorithm=algorithm)
    if compressed.dtype != np.float64 or np.any(np.abs(compressed - values.sum(0)) >
                                                mpicoll.Compression("fp16").bound(P, np.abs(values).sum(0))):
        wrong.append("allreduce compressed")
    rows = rng.integers(-9, 9, 2 * P).astype(np.dtype(np.int32).newbyteorder("S"))
    share = mpicoll.reduce_scatter(rows, comm=WORLD, algorithm=algorithm)
    if not np.array_equal(share, np.array(WORLD.allgather(rows.astype(np.int32))).sum(0)[2 * RANK:2 * RANK + 2]):
        wrong.append("reduce_scatter")
    everywhere(not wrong, f"wrong in {wrong}")


def test_array_api_errors():
    problems = []
    for algorithm in ("auto", "ring"):          # past each wrapper's first call, whose checks are the full ones
        mpicoll.allreduce(np.ones(3), algorithm=algorithm)
    for call, kind in [
        (lambda: mpicoll.allreduce(np.ones(3), "bogus"), ValueError),
        (lambda: mpicoll.allreduce(np.ones(3), out=np.empty(4)), ValueError),
        (lambda: mpicoll.reduce_scatter(np.ones(P * 2 + 1)) if P > 1 else mpicoll.reduce_scatter(np.float64(1)),
         ValueError),
        # an op MPI does not define for the kind: a ReductionError before any message on every path (auto's small
        # calls went to MPI's own, whose raw "Invalid MPI_Op" named neither)
        (lambda: mpicoll.allreduce(np.ones(3, bool), "sum"), mpicoll.ReductionError),
        (lambda: mpicoll.allreduce(np.ones(3, bool), "sum", algorithm="ring"), mpicoll.ReductionError),
        (lambda: mpicoll.allreduce(np.ones(3), "band"), mpicoll.ReductionError),
        (lambda: mpicoll.reduce_scatter(np.ones(P, complex), "max"), mpicoll.ReductionError),
    ]:
        try:
            call()
            problems.append(f"no {kind.__name__}")
        except kind:
            pass
    everywhere(not problems, str(problems))


def test_communicator_is_a_drop_in_intracomm():
    problems = []
    with mpicoll.Communicator(WORLD, algorithm="ring") as comm:
        if not isinstance(comm, MPI.Intracomm) or comm != WORLD:
            problems.append("not an Intracomm sharing the handle")
        if (comm.Get_rank(), comm.Get_size(), comm.rank, comm.size) != (RANK, P, RANK, P):
            problems.append("rank/size")
        if comm.allreduce(RANK) != P * (P - 1) // 2:
            problems.append("lowercase allreduce")
        if comm.bcast("hello" if RANK == 0 else None) != "hello":
            problems.append("lowercase bcast")
        comm.Barrier()
        twin = comm.Dup()
        try:
            if not isinstance(twin, mpicoll.Communicator) or twin.algorithm != "ring" or twin == WORLD:
                problems.append("Dup")
            out = np.empty(3)
            twin.Allreduce(np.ones(3), out)
            if not np.array_equal(out, np.full(3, P)):
                problems.append("Dup'ed communicator reduces wrongly")
        finally:
            twin.Free()
        if twin != MPI.COMM_NULL:
            problems.append("Free left a handle")
    everywhere(not problems, str(problems))


def test_wrapping_anything_but_an_intracomm_is_refused():
    try:
        mpicoll.Communicator("world")
        ok = False
    except TypeError as error:
        ok = "Intracomm" in str(error)
    everywhere(ok)


@pytest.mark.parametrize("algorithm", ["ring", "auto"])
def test_a_freed_communicators_successor_gets_its_own_group(algorithm):
    """MPI hands a freed communicator's handle to the next one: the array API must not reuse the freed
    one's wrapper (its private channel spans the old group), or an allreduce of ones over the world gives
    the old group's size and an allgather the old group's order."""
    seed = shared_seed()
    rng = np.random.default_rng([seed, RANK])
    n = 400_000 if algorithm == "auto" else 1_000          # auto: past MPI's threshold, on mpicoll's own path
    problems = []
    for _ in range(2):
        half = WORLD.Split(RANK % 2, RANK)
        mpicoll.allreduce(np.ones(n), comm=half, algorithm=algorithm)
        reversed_ = WORLD.Split(0, P - RANK)
        mpicoll.allgather(np.array([RANK]), comm=reversed_, algorithm=algorithm)
        half.Free()
        reversed_.Free()
        full = WORLD.Split(0, RANK)
        x = rng.standard_normal(n)
        total = mpicoll.allreduce(x, comm=full, algorithm=algorithm)
        if not np.allclose(total, np.sum(WORLD.allgather(x), axis=0)):
            problems.append("allreduce over the successor reduced over another group")
        order = mpicoll.allgather(np.array([RANK]), comm=full, algorithm=algorithm)
        if not np.array_equal(order, np.arange(P)):
            problems.append(f"allgather over the successor gave {order.tolist()}")
        full.Free()
    everywhere(not problems, f"seed {seed}: {problems}")
