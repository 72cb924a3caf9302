"""``mpicoll bench-overlap``: how much of a nonblocking allreduce hides behind the caller's work.

For each size and kind of work, three things are timed, interleaved in
rotating order (slowest rank, median of ``--iters`` rounds):

``comm``  the blocking ``Allreduce`` alone
``work``  the work alone
``both``  ``Iallreduce``, the work, ``Wait``

and ``hidden = (comm + work - both) / min(comm, work)``: 100% when the
shorter of the two disappears behind the longer, 0% when they add up.  The
kinds of work say where the caller's thread is while the worker thread
drives the reduction:

``matmul``  numpy BLAS (the GIL released, a core busy): like torch kernels
``sleep``   off the CPU altogether: like waiting on a GPU or on I/O
``python``  a pure-Python loop that holds the GIL, handing it over every 5 ms
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from ..collectives.communicator import Communicator
from .common import format_bytes, interleaved_times, parse_choices, parse_sizes, write_records

__all__ = ["run", "WORK"]


def _matmul(seconds: float):
    a = np.random.default_rng(0).standard_normal((256, 256))
    a @ a                                   # BLAS's first call sets up its threads and buffers
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    repeats = max(1, round(10 * seconds / max(time.perf_counter() - start, 1e-6)))

    def work():
        for _ in range(repeats):
            a @ a
    return work


def _sleep(seconds: float):
    return lambda: time.sleep(seconds)


def _python(seconds: float):
    def count(n):
        total = 0
        for i in range(n):
            total += i
        return total
    start = time.perf_counter()
    count(100_000)
    n = max(1, round(100_000 * seconds / (time.perf_counter() - start)))
    return lambda: count(n)


WORK = {"matmul": _matmul, "sleep": _sleep, "python": _python}


def add_parser(commands) -> None:
    bench = commands.add_parser(
        "bench-overlap", help="how much of a nonblocking allreduce hides behind numpy, sleeping or Python work",
        description="Run under mpiexec, e.g.: mpiexec -n 2 mpicoll bench-overlap --sizes 1M,16M")
    bench.add_argument("--sizes", default="1M,16M", help="bytes: '1M,16M' or LOW:HIGH[:FACTOR]")
    bench.add_argument("--work", default="matmul,sleep,python", help="kinds of work (default all three)")
    bench.add_argument("--work-ms", type=float, default=50, help="milliseconds of work (default 50)")
    bench.add_argument("--algorithm", default="auto", help="mpicoll algorithm (default auto)")
    bench.add_argument("--iters", type=int, default=10, help="rounds (default 10)")
    bench.add_argument("--output", metavar="FILE.json", help="write one record per size and work")


def run(args) -> int:
    world = MPI.COMM_WORLD
    comm = Communicator(world, algorithm=args.algorithm)
    rank, size = world.Get_rank(), world.Get_size()
    kinds = parse_choices("bench-overlap", "work", args.work, WORK)
    records = []
    if rank == 0:
        print(f"# mpicoll bench-overlap: {size} ranks, float32 allreduce ({args.algorithm}) against "
              f"~{args.work_ms:g} ms of work; median of {args.iters} rounds, slowest rank")
        print(f"{'size':>10} {'work':>7} {'comm ms':>8} {'work ms':>8} {'both ms':>8} {'hidden':>7}")
    for nbytes in parse_sizes(args.sizes):
        data = np.ones(max(1, nbytes // 4), np.float32)
        comm.Iallreduce(MPI.IN_PLACE, data).Wait()            # the worker set up, the call checked
        for kind in kinds:
            work = WORK[kind](args.work_ms / 1e3)

            def both():
                request = comm.Iallreduce(MPI.IN_PLACE, data)
                work()
                request.Wait()

            times = np.median(interleaved_times(world, [lambda: comm.Allreduce(MPI.IN_PLACE, data), work, both],
                                                args.iters), axis=1)
            alone, worked, together = times
            hidden = (alone + worked - together) / min(alone, worked)
            records.append({"bytes": data.nbytes, "ranks": size, "work": kind, "comm_s": alone, "work_s": worked,
                            "both_s": together, "hidden": hidden})
            if rank == 0:
                print(f"{format_bytes(data.nbytes):>10} {kind:>7} {alone * 1e3:>8.1f} {worked * 1e3:>8.1f} "
                      f"{together * 1e3:>8.1f} {hidden:>7.0%}", flush=True)
    comm.close()
    if rank == 0 and args.output:
        write_records(args.output, records)
    return 0
