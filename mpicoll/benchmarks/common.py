"""What every ``mpicoll bench*`` command shares: option parsing, byte formatting, timing, JSON output."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from ..base.config import parse_bytes

__all__ = ["parse_choices", "parse_sizes", "format_bytes", "write_records", "median_seconds", "interleaved_times"]


def parse_choices(command: str, what: str, text: str, allowed) -> list[str]:
    """A comma-separated option's values, each checked against ``allowed`` (exits naming the bad one)."""
    values = [value.strip() for value in text.split(",") if value.strip()]
    for value in values:
        if value not in allowed:
            raise SystemExit(f"{command}: unknown {what} {value!r}; choose from {', '.join(allowed)}")
    return values


def parse_sizes(text: str) -> list[int]:
    """'8,1K,64M', or a range 'LOW:HIGH' (x4 steps) or 'LOW:HIGH:FACTOR'."""
    if ":" in text:
        low, high, *factor = text.split(":")
        low, high, factor = parse_bytes(low), parse_bytes(high), float(factor[0]) if factor else 4.0
        if low <= 0 or factor <= 1:
            raise ValueError(f"--sizes {text!r}: need LOW > 0 and FACTOR > 1")
        sizes = []
        while low <= high:
            sizes.append(int(low))
            low *= factor
        return sizes
    return [parse_bytes(part) for part in text.split(",")]


def check_counts(args, sizes: list[int], dtype: np.dtype) -> None:
    """Raise a ValueError naming the first bad one of a benchmark's counts: ``--iters`` and ``--min-iters``
    at least 1, ``--warmup`` at least 0, every size at least one element of ``dtype``."""
    for option in ("iters", "min_iters", "warmup"):
        value, least = getattr(args, option, None), 0 if option == "warmup" else 1
        if value is not None and value < least:
            raise ValueError(f"--{option.replace('_', '-')} must be at least {least}, got {value}")
    small = [size for size in sizes if size < dtype.itemsize]
    if small:
        raise ValueError(f"--sizes: {small[0]} B is less than one {dtype.name} element ({dtype.itemsize} B)")


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def write_records(path: str, records: list, out=None) -> None:
    """A benchmark's records as one JSON file (every ``mpicoll bench*`` command's ``--output``)."""
    with open(path, "w") as handle:
        json.dump(records, handle, indent=1)
    print(f"# wrote {path}", file=out or sys.stdout)


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


def interleaved_times(comm, calls: list, n: int, seed: int = 0) -> np.ndarray:
    """Seconds of ``n`` rounds of every call, shape (len(calls), n), the slowest rank's.

    Each round runs the calls in an order of its own, a barrier before each: a
    drift of the machine favours none, and each call follows each other one
    about equally often, so what a call leaves behind for the next (caches
    filled or emptied, a peer still finishing) favours none either.  The orders
    are drawn from ``seed``, alike on every rank (the calls are collective).

    Until November 2026 each round was the last one rotated by one place, so a
    call followed the same one in all rounds but one in k: ``auto``, always after
    the heaviest Python contender, read 0.82-0.88x MPI's own at 8 B-8 KiB, 2
    ranks, and 1.04-1.15x listed first (then always right after MPI's own call).
    """
    from mpi4py import MPI
    orders = np.random.default_rng(seed)
    times = np.empty((len(calls), n))
    for i in range(n):
        for j in orders.permutation(len(calls)):
            comm.Barrier()
            start = time.perf_counter()
            calls[j]()
            times[j, i] = time.perf_counter() - start
    comm.Allreduce(MPI.IN_PLACE, times, MPI.MAX)
    return times


# -- command-line options more than one benchmark takes ------------------------------------------------

def float_or_none(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


def link_option(bench, what: str) -> None:
    bench.add_argument("--link-gbps", type=float, default=float_or_none(os.environ.get("MPICOLL_LINK_GBPS")),
                       help=f"the nodes' link rate in Gbit/s: {what} (default $MPICOLL_LINK_GBPS, which "
                            "mpicoll cluster run sets)")


def simulated_training_options(bench, output: str) -> None:
    """The options of the benchmarks that simulate training steps (bench-ps, bench-gossip)."""
    bench.add_argument("--sizes", default="4M,64M", help="parameter bytes: '4M,64M' or LOW:HIGH[:FACTOR]")
    bench.add_argument("--dtype", default="float32", help="float32 or float64 (default float32)")
    bench.add_argument("--compute-ms", type=float, default=20.0, help="simulated gradient time (default 20)")
    bench.add_argument("--straggler", help="RANK=FACTOR: also run with that rank slowed, e.g. 3=3")
    bench.add_argument("--output", metavar="FILE.json", help=output)
