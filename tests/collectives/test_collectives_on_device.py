"""Device arrays through the collectives, at any rank count.

Without a GPU the arrays are Numba's simulated device arrays (NUMBA_ENABLE_CUDASIM=1,
set by conftest), which exercises the staged path: pinned host buffers for MPI,
reductions through the kernel layer's CUDA backend.  CuPy runs where a GPU exists.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
import mpicoll.collectives.algorithms
from mpicoll import arrays
from tests.support.gpus import cupy_or_skip, numba_cuda_or_skip
from tests.support.mpi import P, RANK, WORLD, everywhere, shared_seed


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", mpicoll.collectives.algorithms.names(device=True))
def test_device_collectives_match_mpi_on_host_copies(algorithm):
    cuda = numba_cuda_or_skip()
    seed = shared_seed()
    rng = np.random.default_rng([seed, RANK])
    problems = []
    with mpicoll.Communicator(WORLD, algorithm=algorithm) as comm:
        for dtype in (np.float32, np.float64, np.int64):
            for op, name in ((MPI.SUM, "sum"), (MPI.MAX, "max"), (MPI.PROD, "prod")):
                for n in (0, 1, P + 1, 17, 200):
                    x = (rng.integers(-3, 4, n) if dtype == np.int64 else rng.uniform(0.5, 1.5, n)).astype(dtype)
                    want = np.empty_like(x)
                    WORLD.Allreduce(x, want, op)
                    out = cuda.device_array(n, dtype)
                    comm.Allreduce(cuda.to_device(x), out, op)
                    got = out.copy_to_host()
                    if not np.allclose(got, want, rtol=1e-5):
                        problems.append(f"Allreduce {name} {np.dtype(dtype).name} n={n}")
                    in_place = cuda.to_device(x)
                    comm.Allreduce(MPI.IN_PLACE, in_place, op)
                    if not np.array_equal(in_place.copy_to_host(), got):
                        problems.append(f"Allreduce in place {name} {np.dtype(dtype).name} n={n}")
                    digests = WORLD.allgather(got.tobytes())
                    if len(set(digests)) != 1:
                        problems.append(f"ranks differ: {name} {np.dtype(dtype).name} n={n}")
        for n in (0, 3, 50):
            x = rng.standard_normal(n * P).astype(np.float32)
            want = np.empty(n, np.float32)
            WORLD.Reduce_scatter_block(x, want)
            out = cuda.device_array(n, np.float32)
            comm.Reduce_scatter_block(cuda.to_device(x), out)
            if not np.allclose(out.copy_to_host(), want, rtol=1e-5, atol=1e-5):
                problems.append(f"Reduce_scatter_block n={n}")
            y = rng.standard_normal(n).astype(np.float32)
            gathered = cuda.device_array(n * P, np.float32)
            comm.Allgather(cuda.to_device(y), gathered)
            if not np.array_equal(gathered.copy_to_host(), np.concatenate(WORLD.allgather(y))):
                problems.append(f"Allgather n={n}")
            b = cuda.to_device(y)
            comm.Bcast(b, root=P - 1)
            if not np.array_equal(b.copy_to_host(), WORLD.bcast(y, root=P - 1)):
                problems.append(f"Bcast n={n}")
        total = mpicoll.allreduce(cuda.to_device(np.full(5, RANK + 1.0)), comm=comm)
        if not np.array_equal(total.copy_to_host(), np.full(5, P * (P + 1) / 2)):
            problems.append("mpicoll.allreduce of a device array")
    everywhere(not problems, f"seed {seed}: {problems}")


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_a_compressed_allreduce_of_a_device_array_gives_the_host_arrays_bits(kind):
    """Staged: the device array's values go through the host's compressed allreduce, and the result comes back
    to the device, the same bits as the host call (residuals too), whatever the output."""
    cuda = numba_cuda_or_skip()
    seed = shared_seed()
    rng = np.random.default_rng([seed, RANK])
    problems = []
    on_device, on_host = (mpicoll.Compression(kind, error_feedback=True) for _ in range(2))
    for step, (n, dtype, op) in enumerate([(0, np.float32, "sum"), (1, np.float32, "sum"), (P + 1, np.float64, "sum"),
                                           (1001, np.float32, "average"), (1001, np.float32, "average")]):
        x = (rng.standard_normal(n) * 3).astype(dtype)
        want = mpicoll.allreduce(x, op, compression=on_host, key=n)
        got = mpicoll.allreduce(cuda.to_device(x), op, compression=on_device, key=n)
        in_place = cuda.to_device(x)
        mpicoll.allreduce(in_place, op, out=in_place, compression=kind)
        into = cuda.device_array(n, dtype)
        returned = mpicoll.iallreduce(cuda.to_device(x), op, out=into, compression=kind).wait()
        plain = mpicoll.allreduce(x, op, compression=kind)
        if not (arrays.is_device(got) and np.array_equal(got.copy_to_host(), want)):
            problems.append(f"step {step}: a new device array")
        if not (np.array_equal(in_place.copy_to_host(), plain) and returned is into
                and np.array_equal(into.copy_to_host(), plain)):
            problems.append(f"step {step}: in place or into out")
        if not np.array_equal(on_device.residual(n, x), on_host.residual(n, x)):
            problems.append(f"step {step}: the residuals differ")
    everywhere(not problems, f"seed {seed}: {problems}")


@pytest.mark.mpi
def test_device_errors_are_explained():
    cuda = numba_cuda_or_skip()
    problems = []
    with mpicoll.Communicator(WORLD) as comm:
        for call, kind, words in [
            (lambda: comm.Allreduce(cuda.to_device(np.ones(4, np.int64)), cuda.device_array(4, np.int64), MPI.BAND),
             TypeError, "SUM, PROD, MIN or MAX"),
            (lambda: comm.Allreduce(cuda.to_device(np.ones(4)), cuda.device_array(5)), ValueError, "send count 4"),
            (lambda: comm.Allreduce(cuda.to_device(np.ones(4, np.float32)), cuda.device_array(4)), ValueError,
             "float32"),
            (lambda: comm.Allreduce(np.ones(4), cuda.device_array(4)), TypeError, "pass both on the host"),
            (lambda: mpicoll.Communicator(WORLD, algorithm="ring").Allreduce(MPI.IN_PLACE, cuda.device_array(4)),
             TypeError, "'ring' does not serve device"),
        ]:
            try:
                call()
                problems.append(f"no {kind.__name__} for {words}")
            except kind as error:
                if words not in str(error):
                    problems.append(f"{words!r} not in {error}")
    everywhere(not problems, str(problems))


def test_cuda_awareness_is_detected_and_can_be_forced(monkeypatch):
    arrays.cuda_aware.cache_clear()
    try:
        aware, reason = arrays.cuda_aware()
        assert reason                          # always says why
        if "MPICH" in MPI.Get_library_version() and "MPIR_CVAR_ENABLE_GPU" not in __import__("os").environ:
            assert aware is False              # the MPICH wheel has GPU support off unless asked
        monkeypatch.setenv("MPICOLL_CUDA_AWARE", "1")
        arrays.cuda_aware.cache_clear()
        assert arrays.cuda_aware() == (True, "forced by MPICOLL_CUDA_AWARE=1")
    finally:
        monkeypatch.delenv("MPICOLL_CUDA_AWARE", raising=False)
        arrays.cuda_aware.cache_clear()


def test_cupy_allreduce_where_a_gpu_exists():
    cupy = cupy_or_skip()
    x = cupy.arange(10, dtype=cupy.float32)
    assert cupy.array_equal(mpicoll.allreduce(x), x * WORLD.Get_size())
