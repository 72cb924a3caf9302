"""``mpicoll bench-sandblaster``: Sandblaster L-BFGS's time per iteration against the number of workers,
without and with a straggler, without and with backup tasks.

Run under mpiexec (``-n 1+S+W``).  For every worker count w = 1..W the first
1+S+w ranks run Sandblaster on a quadratic of ``--params`` parameters (a
diagonal Hessian with a spread of curvatures, so L-BFGS has work to do), whose
gradient over a batch costs ``--compute-ms`` of one worker's time: each
portion sleeps its share of it (sleeping, so ranks that share cores do not
steal them from each other) and then computes the gradient for real.  Cases:
every worker at full speed; the last worker ``--straggler-factor`` times
slower, without backup tasks; the same with them.  Each record gives the
iteration time, the gradient evaluations' median time against the ideal
(``compute-ms / w``, or the straggler's share of speed added in), and the
coordinator's time outside evaluations (commands to the shards).
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from .. import sandblaster
from ..base.straggler import Straggler
from .common import write_records

__all__ = ["run"]

CASES = (("none", True), ("straggler", False), ("straggler", True))


def _quadratic(params: int, compute_s: float, rows: int):
    rng = np.random.default_rng(0)
    curvature, target = np.logspace(0, 3, params), rng.standard_normal(params)

    def loss_and_gradient(w, portion):
        time.sleep(compute_s * len(portion) / rows)
        delta = w - target
        return 0.5 * float(curvature @ (delta * delta)), curvature * delta

    return loss_and_gradient


def _one(comm, workers, case, backup, args) -> dict | None:
    rank, size = comm.Get_rank(), comm.Get_size()
    factor = args.straggler_factor if case == "straggler" and rank == size - 1 else 1.0
    start = time.perf_counter()
    result = sandblaster.run(comm, np.zeros(args.params), _quadratic(args.params, args.compute_ms / 1e3, args.rows),
                             samples=args.rows, servers=args.servers, iterations=args.iterations, tolerance=0.0,
                             portions=args.portions * workers, backup=backup, history=args.history,
                             slow=Straggler(factor))
    wall = time.perf_counter() - start
    if result.role != "coordinator":
        return None
    stats, steps = result.stats, len(result.iterations)
    speed = workers - 1 + 1 / args.straggler_factor if case == "straggler" else workers
    evaluation = float(np.median(stats.evaluation_s))
    ideal = args.compute_ms / 1e3 / speed
    return {"workers": workers, "servers": args.servers, "params": args.params, "straggler": case == "straggler",
            "straggler_factor": args.straggler_factor if case == "straggler" else 1.0, "backup": backup,
            "portions": args.portions * workers, "compute_ms": args.compute_ms, "iterations": steps,
            "evaluations": stats.evaluations, "iteration_s": wall / max(steps, 1), "evaluation_s": evaluation,
            "ideal_evaluation_s": ideal, "efficiency": ideal / evaluation,
            "coordinator_s_per_iteration": (wall - sum(stats.evaluation_s)) / max(steps, 1),
            "backups": stats.backups, "discarded": stats.discarded}


def add_parser(commands) -> None:
    bench = commands.add_parser(
        "bench-sandblaster", help="Sandblaster L-BFGS time per iteration against workers, straggler, backup tasks",
        description="Run under mpiexec, e.g.: mpiexec -n 6 mpicoll bench-sandblaster (1 coordinator, 1 shard, "
        "1 to 4 workers)")
    bench.add_argument("--servers", type=int, default=1, help="server shards (default 1)")
    bench.add_argument("--params", type=int, default=1 << 20, help="parameters (default 1M)")
    bench.add_argument("--rows", type=int, default=4096, help="rows per batch (default 4096)")
    bench.add_argument("--compute-ms", type=float, default=120.0,
                       help="one worker's time for a whole batch's gradient, simulated (default 120)")
    bench.add_argument("--portions", type=int, default=4, help="portions per worker (default 4)")
    bench.add_argument("--straggler-factor", type=float, default=3.0, help="the straggler's slowness (default 3)")
    bench.add_argument("--iterations", type=int, default=8, help="L-BFGS iterations per case (default 8)")
    bench.add_argument("--history", type=int, default=10, help="L-BFGS pairs (default 10)")
    bench.add_argument("--output", metavar="FILE.json", help="write one record per (workers, case)")


def run(args) -> int:
    world = MPI.COMM_WORLD
    rank, most = world.Get_rank(), world.Get_size() - 1 - args.servers
    if most < 1:
        if rank == 0:
            print(f"mpicoll bench-sandblaster: needs a coordinator, {args.servers} shard(s) and a worker: "
                  f"mpiexec -n {args.servers + 2} or more")
        return 2
    if rank == 0:
        print(f"# mpicoll bench-sandblaster: {args.params:,} parameters over {args.servers} shard(s), a batch worth "
              f"{args.compute_ms:g} ms of one worker, {args.portions} portions per worker, {args.iterations} "
              f"iterations per case; straggler: the last worker, {args.straggler_factor:g}x slower")
        print(f"{'workers':>7} {'straggler':>9} {'backup':>6} {'ms/iter':>8} {'ms/eval':>8} {'ideal':>6} "
              f"{'efficiency':>10} {'coord ms/iter':>13} {'backups':>7}")
    records = []
    for workers in range(1, most + 1):
        comm = world.Split(0 if rank < 1 + args.servers + workers else MPI.UNDEFINED, rank)
        for case, backup in CASES:
            if case == "straggler" and workers < 2:
                continue
            record = _one(comm, workers, case, backup, args) if comm != MPI.COMM_NULL else None
            waiting = world.Ibarrier()            # ranks left out nap here rather than spin in MPI
            while not waiting.Test():
                time.sleep(0.002)
            record = world.bcast(record, root=0)
            records.append(record)
            if rank == 0:
                print(f"{workers:>7} {'%gx' % record['straggler_factor'] if record['straggler'] else '-':>9} "
                      f"{'yes' if backup else 'no':>6} {1e3 * record['iteration_s']:>8.1f} "
                      f"{1e3 * record['evaluation_s']:>8.1f} {1e3 * record['ideal_evaluation_s']:>6.1f} "
                      f"{record['efficiency']:>10.2f} {1e3 * record['coordinator_s_per_iteration']:>13.1f} "
                      f"{record['backups']:>7}", flush=True)
        if comm != MPI.COMM_NULL:
            comm.Free()
    if rank == 0 and args.output:
        write_records(args.output, records)
    return 0
