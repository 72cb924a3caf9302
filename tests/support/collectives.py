"""Random data suited to an op, how close a result must be, and the cases one collective test judges."""

from __future__ import annotations

import hashlib

import numpy as np

from mpi4py import MPI

from .mpi import P, RANK, everywhere, shared_seed

__all__ = ["make", "close", "digest", "Cases"]


def make(rng, dtype, count, op="SUM"):
    """Random data suited to the op: no overflow, products near 1, small integers."""
    dtype = np.dtype(dtype)
    if dtype == bool:
        return rng.integers(0, 2, count).astype(bool)
    if dtype.kind in "iu":
        high = 3 if op == "PROD" else min(100, np.iinfo(dtype).max // max(P, 1))
        return rng.integers(0, high + 1, count).astype(dtype)
    if op == "PROD":
        values = rng.uniform(0.5, 1.5, count)
    else:
        values = rng.standard_normal(count)
    if dtype.kind == "c":
        values = values + 1j * (rng.uniform(0.5, 1.5, count) if op == "PROD" else rng.standard_normal(count))
    return values.astype(dtype)


def close(result, reference, dtype) -> bool:
    dtype = np.dtype(dtype)
    if dtype.kind in "fc":
        tolerance = {2: 2e-2, 4: 1e-5, 8: 1e-5, 16: 1e-12, 32: 1e-12}[dtype.itemsize] * P
        return bool(np.allclose(result, reference, rtol=tolerance, atol=tolerance))
    return bool(np.array_equal(result, reference))


def digest(array) -> str:
    """A hash of the value bits (long double's padding bytes carry no value and are skipped)."""
    array = np.ascontiguousarray(array)
    if array.dtype.kind in "fc" and array.dtype.itemsize > 8 * (2 if array.dtype.kind == "c" else 1):
        bits = np.finfo(array.dtype).nexp + np.finfo(array.dtype).nmant + 1
        array = array.view(np.uint8).reshape(-1, array.dtype.itemsize // (2 if array.dtype.kind == "c" else 1))
        array = array[:, : (bits + 7) // 8]
    return hashlib.sha1(array.tobytes()).hexdigest()


class Cases:
    """Fresh random data for one test; collects failures and result digests, judged on every rank together.
    ``comm``: the ranks whose results must hold the same bits (those of the communicator under test)."""

    def __init__(self, comm: MPI.Intracomm = MPI.COMM_WORLD):
        self.comm = comm
        self.seed = shared_seed()
        self.rng = np.random.default_rng([self.seed, RANK])
        self.failures, self.digests, self.names = [], [], []

    def check(self, name, ok, result=None):
        if not ok:
            self.failures.append(name)
        if result is not None:
            self.names.append(name)
            self.digests.append(digest(result))

    def judge(self):
        everyone = self.comm.allgather(self.digests)
        drift = [self.names[i] for i in range(len(self.names)) if len({d[i] for d in everyone}) > 1]
        everywhere(not self.failures, f"seed {self.seed}: wrong result in {self.failures[:8]}")
        everywhere(not drift, f"seed {self.seed}: ranks hold different bits in {drift[:8]}")
