"""Every kernel of every backend against a float64 reference, on fresh random data.

CPU backends (numpy, Numba) at sizes 0, 1, 31 and 10**6 + 3; Numba's CUDA kernels under
its CUDA simulator (NUMBA_ENABLE_CUDASIM=1, set by conftest where no GPU exists) at
sizes the simulator can afford; CuPy where a GPU exists; the .cu sources through nvcc.
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from tests.support.gpus import cupy_or_skip, numba_cuda_or_skip
from mpicoll import compute
from mpicoll.base import launcher
from mpicoll.compute import sources

CPU_SIZES = (0, 1, 31, 10**6 + 3)
SIMULATOR_SIZES = (0, 1, 31, 10**4 + 3)   # the simulator runs each element in Python
TOLERANCE = {np.dtype(np.float16): 2e-2, np.dtype(np.float32): 2e-5, np.dtype(np.float64): 1e-12}


def tolerance(dtype) -> float:
    dtype = np.dtype(dtype)
    return TOLERANCE.get(dtype, TOLERANCE.get(np.dtype(dtype.char.lower()), 0.0)) if dtype.kind in "fc" else 0.0


def data(rng, n, dtype, positive=False):
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        return rng.integers(-1000, 1000, n).astype(dtype)
    values = rng.uniform(0.5, 1.5, n) if positive else rng.standard_normal(n)
    if dtype.kind == "c":
        values = values + 1j * (rng.uniform(0.5, 1.5, n) if positive else rng.standard_normal(n))
    return values.astype(dtype)


def wide(x):
    """The float64 (or complex128) copy a reference formula computes with."""
    return np.asarray(x).astype(np.complex128 if np.asarray(x).dtype.kind == "c" else np.float64)


def agree(result, reference, dtype) -> bool:
    t = tolerance(dtype)
    return bool(np.allclose(wide(result), reference, rtol=t, atol=t, equal_nan=True))


# -- the reference formulas, in float64 ---------------------------------------------------

def reference_dcasgd(w, g, b, lr, lam):
    return w - lr * (g + lam * g * g * (w - b))


def reference_dcasgd_adaptive(w, g, b, m, lr, lam0, beta, eps):
    m = beta * m + (1 - beta) * g * g
    return reference_dcasgd(w, g, b, lr, lam0 / np.sqrt(m + eps)), m


# -- the checks, run against any backend given how to move arrays there and back ----------

def check_all(rng, sizes, dtypes, to_device, to_host):
    """Run every kernel; return the list of failures (empty when all agree)."""
    failures = []

    def fail(name, n, dtype):
        failures.append(f"{name} n={n} {np.dtype(dtype).name}")

    for dtype in dtypes:
        for n in sizes:
            w, g, b = data(rng, n, dtype), data(rng, n, dtype), data(rng, n, dtype)
            m, h = data(rng, n, dtype, positive=True), data(rng, n, dtype, positive=True)
            lr, lam = 0.1, 0.7

            dw, dg, db = to_device(w), to_device(g), to_device(b)
            compute.dcasgd(dw, dg, db, lr, lam)
            if not agree(to_host(dw), reference_dcasgd(wide(w), wide(g), wide(b), lr, lam), dtype):
                fail("dcasgd", n, dtype)
            if not np.array_equal(to_host(db), b):
                fail("dcasgd wrote w_bak without refresh", n, dtype)

            dw, db = to_device(w), to_device(b)
            compute.dcasgd(dw, dg, db, lr, lam, refresh_backup=True)
            if not (agree(to_host(dw), reference_dcasgd(wide(w), wide(g), wide(b), lr, lam), dtype)
                    and np.array_equal(to_host(db), to_host(dw))):
                fail("dcasgd refresh", n, dtype)

            dw, db, dm = to_device(w), to_device(b), to_device(m)
            compute.dcasgd_adaptive(dw, dg, db, dm, lr, lam, beta=0.9, eps=1e-6, refresh_backup=True)
            want_w, want_m = reference_dcasgd_adaptive(wide(w), wide(g), wide(b), wide(m), lr, lam, 0.9, 1e-6)
            if not (agree(to_host(dw), want_w, dtype) and agree(to_host(dm), want_m, dtype)
                    and np.array_equal(to_host(db), to_host(dw))):
                fail("dcasgd_adaptive", n, dtype)

            dw = to_device(w)
            compute.sgd(dw, dg, lr, tau=3)
            if not agree(to_host(dw), wide(w) - lr / 3 * wide(g), dtype):
                fail("sgd", n, dtype)

            dw, dh = to_device(w), to_device(h)
            compute.adagrad(dw, dg, dh, lr, eps=1e-8)
            want_h = wide(h) + wide(g) ** 2
            if not (agree(to_host(dh), want_h, dtype)
                    and agree(to_host(dw), wide(w) - lr * wide(g) / (np.sqrt(want_h) + 1e-8), dtype)):
                fail("adagrad", n, dtype)

            dw = to_device(w)
            compute.scaled_accumulate(dw, dg, 0.25, 0.75)
            if not agree(to_host(dw), 0.25 * wide(w) + 0.75 * wide(g), dtype):
                fail("scaled_accumulate", n, dtype)
    return failures


def check_reductions(rng, sizes, dtypes, to_device, to_host):
    failures = []
    for dtype in dtypes:
        ops = ("sum", "prod") if np.dtype(dtype).kind == "c" else ("sum", "prod", "min", "max")
        for op in ops:
            for n in sizes:
                a, b = data(rng, n, dtype, positive=op == "prod"), data(rng, n, dtype, positive=op == "prod")
                if np.dtype(dtype).kind == "f" and n > 2 and op in ("min", "max"):
                    a[1] = np.nan                                  # NaN propagates
                want = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op](wide(a), wide(b))
                da, db = to_device(a), to_device(b)
                out = to_device(np.zeros_like(a))
                compute.reduce(da, db, out=out, op=op)
                in_place = to_device(a)
                compute.reduce(in_place, db, op=op)
                for got in (out, in_place):
                    if not agree(to_host(got), want, dtype):
                        failures.append(f"reduce {op} n={n} {np.dtype(dtype).name}")
    return failures


DTYPES = (np.float16, np.float32, np.float64)
REDUCIBLE = (np.float16, np.float32, np.float64, np.int32, np.int64, np.complex64, np.complex128)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_cpu_backends_match_the_float64_reference(backend, monkeypatch):
    if backend == "numba":
        pytest.importorskip("numba", reason="the numba extra is not installed")
    monkeypatch.setenv("MPICOLL_KERNELS", backend)         # numba even for the small sizes tested here
    probe = np.zeros(4, np.float32)
    assert compute.backend_for(probe) == backend
    rng = np.random.default_rng()
    failures = check_all(rng, CPU_SIZES, DTYPES, np.copy, np.asarray)
    failures += check_reductions(rng, CPU_SIZES, REDUCIBLE, np.copy, np.asarray)
    assert not failures, failures


def test_numba_cuda_kernels_match_the_reference():
    """On a GPU if there is one, else in Numba's CUDA simulator."""
    cuda = numba_cuda_or_skip()
    rng = np.random.default_rng()
    to_device, to_host = cuda.to_device, lambda array: array.copy_to_host()
    probe = to_device(np.zeros(4, np.float32))
    assert compute.backend_for(probe) == "numba-cuda"
    failures = check_all(rng, SIMULATOR_SIZES, DTYPES, to_device, to_host)
    failures += check_reductions(rng, SIMULATOR_SIZES, REDUCIBLE, to_device, to_host)
    assert not failures, failures


def test_cupy_kernels_match_the_reference():
    cupy = cupy_or_skip()
    rng = np.random.default_rng()
    failures = check_all(rng, CPU_SIZES, DTYPES, cupy.asarray, cupy.asnumpy)
    failures += check_reductions(rng, CPU_SIZES, REDUCIBLE, cupy.asarray, cupy.asnumpy)
    assert not failures, failures


@pytest.mark.parametrize("source", sources.SOURCES)
def test_cuda_sources_compile(source, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on the PATH")
    result = subprocess.run([nvcc, "-std=c++17", "-c", str(sources.directory() / source), "-o",
                             str(tmp_path / "out.o")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_non_contiguous_arrays_are_updated_in_place():
    rng = np.random.default_rng()
    w = rng.standard_normal((40, 6))[:, ::2]
    g = rng.standard_normal((40, 3))
    want = wide(w) - 0.5 * wide(g)
    assert compute.backend_for(w) == "numpy"
    compute.sgd(w, g, 0.5)
    assert np.allclose(w, want)


@pytest.mark.parametrize("call, error, words", [
    (lambda: compute.sgd(np.zeros(3), np.zeros(4), 0.1), ValueError, "shape"),
    (lambda: compute.sgd(np.zeros(3), np.zeros(3, np.float32), 0.1), ValueError, "dtype"),
    (lambda: compute.sgd(np.zeros(3, np.int64), np.zeros(3, np.int64), 0.1), TypeError, "float"),
    (lambda: compute.sgd(np.zeros(3), np.zeros(3), 0.1, tau=0), ValueError, "tau"),
    (lambda: compute.reduce(np.zeros(3), np.zeros(3), op="avg"), ValueError, "Unrecognized op"),
    (lambda: compute.reduce(np.zeros(3, complex), np.zeros(3, complex), op="max"), TypeError, "complex"),
    (lambda: compute.dcasgd_adaptive(*[np.zeros(2)] * 4, 0.1, 0.1, beta=1.0), ValueError, "beta"),
])
def test_bad_arguments_are_explained(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_read_only_targets_are_refused():
    w = np.zeros(3)
    w.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        compute.sgd(w, np.zeros(3), 0.1)


def test_backend_report_names_every_backend():
    report = compute.backends()
    assert set(report) == {"numpy", "numba", "cupy", "numba-cuda"} and report["numpy"] == "available"


@pytest.mark.parametrize("variable, value, ranks", [("MPI_LOCALNRANKS", "3", 3),
                                                    ("OMPI_COMM_WORLD_LOCAL_SIZE", "4", 4),
                                                    ("SLURM_NTASKS_PER_NODE", "2(x3)", 2)])
def test_ranks_per_node_come_from_the_launcher(monkeypatch, variable, value, ranks):
    for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    assert launcher.ranks_started_here() == 1
    monkeypatch.setenv(variable, value)
    assert launcher.ranks_started_here() == ranks


def test_sources_carry_their_header_inline():
    """CuPy caches compiled kernels by source text: the header must be in that text, not behind an #include."""
    for name in sources.SOURCES:
        text = sources.source(name)
        assert '#include "common.cuh"' not in text and "MPICOLL_FOR_EACH" in text


def test_warm_up_loads_the_backend_the_updates_will_use(monkeypatch):
    """Training calls warm_up during set-up so no method's first timed step pays for loading Numba."""
    monkeypatch.setenv("MPICOLL_KERNELS", "numpy")
    monkeypatch.setattr(compute, "_loaded", {})
    compute.warm_up(np.float32)
    assert "numba" not in compute._loaded                  # forced numpy: nothing to load
    monkeypatch.delenv("MPICOLL_KERNELS")
    compute.warm_up(np.float16)                            # float16 runs on numpy on the host
    assert "numba" not in compute._loaded
    if compute._backend("numba") is None:
        pytest.skip(f"Numba is not available: {compute._missing.get('numba')}")
    monkeypatch.setattr(compute, "_loaded", {})
    compute.warm_up(np.float64)
    assert "numba" in compute._loaded


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_float16_by_its_bits_is_numpys_float16_bit_for_bit(backend, monkeypatch):
    """Every float16 widened, float32 values of every magnitude (subnormal, ties, 65504 to inf, NaN) rounded,
    sums of float16 and error feedback's residual: the same bits as numpy's float16, on either backend."""
    if backend == "numba":
        pytest.importorskip("numba")
    monkeypatch.setenv("MPICOLL_KERNELS", backend)
    every = np.arange(1 << 16, dtype=np.uint16)
    widened = compute.widen(every, np.empty(every.size, np.float32))
    expected = every.view(np.float16).astype(np.float32)
    assert np.array_equal(widened.view(np.uint32)[~np.isnan(expected)], expected.view(np.uint32)[~np.isnan(expected)])
    assert np.isnan(widened[np.isnan(expected)]).all()
    rng = np.random.default_rng(5)
    finite = expected[np.isfinite(expected)]
    x = np.concatenate([rng.standard_normal(1 << 18) * 10.0 ** rng.uniform(-9, 5, 1 << 18), finite,
                        (finite.astype(np.float64) + 2.0 ** -40), (finite[:-1] + np.diff(finite) / 2),   # ties
                        [0.0, -0.0, np.inf, -np.inf, 65504, 65519.99, 65520, 1e6, 2.0 ** -25, 3 * 2.0 ** -26]]
                       ).astype(np.float32)
    with np.errstate(over="ignore"):
        rounded = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(compute.narrow(x, np.empty(x.size, np.uint16)), rounded)
    nan = compute.narrow(np.array([np.nan], np.float32), np.empty(1, np.uint16))[0]
    assert nan & 0x7C00 == 0x7C00 and nan & 0x3FF
    a, b = rounded[: 1 << 17].copy(), rounded[1 << 17: 1 << 18].copy()
    with np.errstate(over="ignore"):
        added = (a.view(np.float16) + b.view(np.float16)).view(np.uint16)
    assert np.array_equal(compute.add_narrow(a, b), added)
    residual = rng.standard_normal(x.size).astype(np.float32) * 1e-3
    before, words = residual.copy(), np.empty(x.size, np.uint16)
    compute.narrow(x, words, np.float16, residual)
    with np.errstate(over="ignore", invalid="ignore"):
        carried = x + before
        sent = carried.astype(np.float16)
        assert np.array_equal(words, sent.view(np.uint16))
        finite_ones = np.isfinite(sent)
        assert np.array_equal(residual[finite_ones], (carried - sent.astype(np.float32))[finite_ones])


KEEPS_TORCHS_THREADS = """
import torch
torch.get_num_threads()           # asked once before Numba's pool starts (a DataLoader or a library does)
torch.set_num_threads(1)
import numpy as np
from mpicoll import compute
a = np.ones(1 << 20, np.float32)
compute.reduce(a, a.copy(), op="sum")    # above NUMBA_FROM: Numba's pool starts here, with every core
print(torch.get_num_threads())
"""


def test_starting_numbas_threads_leaves_torchs_thread_count_as_it_was():
    """Numba's OpenMP layer starts its pool with every core as the starting thread's OpenMP count, which torch
    shares where both load one libgomp: without the reset in compute, torch went from 1 thread to 2 here."""
    import os
    import sys
    pytest.importorskip("torch")
    pytest.importorskip("numba")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: Numba's pool and torch's count are both 1")
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "MPI_LOCALNRANKS",
                                                           "OMPI_COMM_WORLD_LOCAL_SIZE", "MPICOLL_KERNELS")}
    result = subprocess.run([sys.executable, "-c", KEEPS_TORCHS_THREADS], capture_output=True, text=True, timeout=120,
                            env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["1"], result.stdout + result.stderr[-2000:]
