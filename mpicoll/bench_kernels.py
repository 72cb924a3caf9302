"""``mpicoll bench-kernels``: every kernel of every backend, against the device's own copy.

Effective bandwidth counts the bytes a kernel must move at least (DC-ASGD reads
g, w and w_bak and writes w: four arrays), divided by the median time.  The
copy bandwidth (read one array, write another) is measured in the same run on
the same device, and each kernel is reported as a fraction of it: 1.0 means the
kernel runs as fast as memory allows.
"""

from __future__ import annotations

import os
import time

import numpy as np

from . import compute
from .bench import write_records

__all__ = ["run", "ARRAYS_MOVED", "median_seconds"]

# arrays each kernel must read or write once (its bytes = arrays * elements * itemsize)
ARRAYS_MOVED = {"copy": 2, "reduce_sum": 3, "scaled_accumulate": 3, "sgd": 3, "adagrad": 5,
                "dcasgd": 4, "dcasgd_refresh": 5, "dcasgd_adaptive": 6}


class _Device:
    """How to make, copy and wait for arrays of one backend."""

    def __init__(self, asarray, empty, copy, sync=lambda: None):
        self.asarray, self.empty, self.copy, self.sync = asarray, empty, copy, sync


def _device(backend: str) -> tuple[_Device | None, str]:
    """The device helpers for ``backend``, or None and the reason it is not measured here."""
    reason = compute.backends().get(backend, "unknown backend")
    if reason != "available":
        return None, reason
    if backend in ("numpy", "numba"):
        return _Device(np.asarray, np.empty, np.copyto), ""
    if backend == "cupy":
        import cupy
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return None, "no CUDA device"
        return _Device(cupy.asarray, cupy.empty, cupy.copyto, cupy.cuda.Stream.null.synchronize), ""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return None, "Numba's CUDA simulator is on: its timings mean nothing"
    from numba import cuda
    if not cuda.is_available():
        return None, "no CUDA device"
    return _Device(cuda.to_device, cuda.device_array, lambda dst, src: dst.copy_to_device(src), cuda.synchronize), ""


def _kernels(device: _Device, n: int, dtype, rng) -> dict:
    """name -> zero-argument call, on fresh arrays of the device."""
    def array(positive=False):
        values = rng.uniform(0.5, 1.5, n) if positive else rng.standard_normal(n)
        return device.asarray(values.astype(dtype))

    w, g, b, m, h, y = array(), array(), array(), array(True), array(True), array()
    return {
        "reduce_sum": lambda: compute.reduce(w, y),
        "scaled_accumulate": lambda: compute.scaled_accumulate(w, y, 0.5, 0.5),
        "sgd": lambda: compute.sgd(w, g, 1e-3, 2.0),
        "adagrad": lambda: compute.adagrad(w, g, h, 1e-3),
        "dcasgd": lambda: compute.dcasgd(w, g, b, 1e-3, 0.04),
        "dcasgd_refresh": lambda: compute.dcasgd(w, g, b, 1e-3, 0.04, refresh_backup=True),
        "dcasgd_adaptive": lambda: compute.dcasgd_adaptive(w, g, b, m, 1e-3, 2.0),
    }


def median_seconds(call, iters: int, sync) -> float:
    """Median of ``iters`` timed calls after one untimed one (first touch, compilation)."""
    call()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def run(args) -> int:
    dtype = np.dtype(args.dtype)
    n = args.elements
    rng = np.random.default_rng(7)
    records = []
    threads_list = [int(t) for t in args.threads.split(",")] if args.threads else [None]
    print(f"# mpicoll bench-kernels: {n:,} {dtype.name} elements, median of {args.iters}")
    print(f"{'kernel':>18} {'backend':>10} {'threads':>7} {'ms':>9} {'GB/s':>8} {'x copy':>7}")
    for backend in args.backends.split(","):
        device, reason = _device(backend)
        if device is None:
            print(f"# {backend}: skipped ({reason})")
            continue
        # numpy arrays get the backend MPICOLL_KERNELS names, whatever their size
        previous = os.environ.pop("MPICOLL_KERNELS", None)
        if backend in ("numpy", "numba"):
            os.environ["MPICOLL_KERNELS"] = backend
        try:
            for threads in (threads_list if backend == "numba" else [None]):
                if threads is not None:
                    compute.set_threads(threads)
                records += _measure(backend, device, threads, n, dtype, rng, args.iters)
        finally:
            os.environ.pop("MPICOLL_KERNELS", None)
            if previous is not None:
                os.environ["MPICOLL_KERNELS"] = previous
    if args.output:
        write_records(args.output, records)
    return 0


def _measure(backend, device, threads, n, dtype, rng, iters) -> list[dict]:
    source, target = device.asarray(rng.standard_normal(n).astype(dtype)), device.empty(n, dtype)
    rows = [("copy", median_seconds(lambda: device.copy(target, source), iters, device.sync))]
    rows += [(name, median_seconds(call, iters, device.sync)) for name, call in _kernels(device, n, dtype, rng).items()
             if not (backend == "numba" and name == "reduce_sum")]   # host reductions are numpy's
    copy_gbps = ARRAYS_MOVED["copy"] * n * dtype.itemsize / rows[0][1] / 1e9
    records = []
    for name, seconds in rows:
        gbps = ARRAYS_MOVED[name] * n * dtype.itemsize / seconds / 1e9
        records.append({"kernel": name, "backend": backend, "elements": n, "dtype": dtype.name, "time_s": seconds,
                        "gbps": gbps, "fraction_of_copy": gbps / copy_gbps, "threads": threads})
        shown = "-" if threads is None else str(threads)
        print(f"{name:>18} {backend:>10} {shown:>7} {seconds * 1e3:>9.3f} {gbps:>8.1f} {gbps / copy_gbps:>7.2f}",
              flush=True)
    return records
