"""``mpicoll bench-gossip``: SGP's gossip against ring allreduce, per training iteration.

Run under mpiexec.  Every iteration "computes" for ``--compute-ms`` (a sleep,
so oversubscribed ranks do not steal each other's cores; ``--straggler``
makes one rank slower) and then communicates the parameter buffer: a ring
allreduce (the synchronous data-parallel baseline), or one push-sum round per
graph, mailbox and tau.  Each method runs in the same job, in turn, on the
same buffer.  Reported per method: iterations per second (of the slowest rank,
which sets the pace), its ratio to the allreduce, bytes each rank sends per
iteration, and the time per iteration spent communicating and, of that, blocked
waiting for peers.  A first section measures how many rounds each graph needs
to average to 1e-6 against what its spectrum predicts.  Across nodes, with the
link rate known (``--link-gbps``, set by ``mpicoll cluster run``), a last
section sets each method's iteration time against the least the links and the
computation allow: computation plus link time for the methods that cannot
overlap them (the allreduce, tau = 0), the larger of the two for those that
can (tau > 0); link time is the bytes a rank sends per iteration at the link
rate, counted as leaving its node (exact with one rank per node, an upper bound
otherwise).
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from .. import Communicator, compute
from ..gossip import GRAPHS, MAILBOXES, PushSum, UniformMixing, make, rounds_to_average
from ..base.straggler import Straggler, parse
from ..channel.nodes import node_count
from .common import link_option, simulated_training_options, format_bytes, parse_choices, parse_sizes, write_records

__all__ = ["run"]


def _averaging(comm, graph_name: str, mailbox: str, tolerance: float = 1e-6, limit: int = 400) -> dict:
    """Rounds for push-sum to average random vectors to ``tolerance``, measured and predicted."""
    rank, size = comm.Get_rank(), comm.Get_size()
    graph = make(graph_name, size)
    everyone = np.random.default_rng(7).standard_normal((size, 1000))
    mean = everyone.mean(axis=0)
    pushsum = PushSum(comm, everyone[rank], graph=graph, mailbox=mailbox)
    reached = None
    for round in range(1, limit + 1):
        z = pushsum.mix()
        error = comm.allreduce(float(np.linalg.norm(z - mean) / np.linalg.norm(mean)), op=MPI.MAX)
        if error < tolerance:
            reached = round
            break
    pushsum.close()
    return {"graph": graph_name, "mailbox": mailbox, "ranks": size, "tolerance": tolerance,
            "rounds": reached, "theory_rounds": rounds_to_average(graph, UniformMixing(), tolerance)}


def _iterations(comm, method: dict, count: int, dtype, iters: int, compute_s: float, straggle: str) -> dict:
    rank, size = comm.Get_rank(), comm.Get_size()
    slow = Straggler.for_rank(rank, straggle)
    x = np.random.default_rng(rank).standard_normal(count).astype(dtype)
    if method["method"] == "allreduce":
        channel = Communicator(comm, algorithm="ring")
        average = np.empty_like(x)

        def communicate():
            channel.Allreduce(x, average)
        sent = 2 * (size - 1) / size * x.nbytes
    else:
        gossip = PushSum(comm, x, graph=method["graph"], tau=method["tau"], mailbox=method["mailbox"])
        communicate = gossip.mix
        sent = 0.0
    compute.warm_up(x.dtype)            # the kernels' first-call cost is not a round's: with tau > 0 the
    communicate()                       # warm-up round folds nothing, so it would land in the timed loop
    if method["method"] != "allreduce":
        gossip.wait_s, gossip.bytes_sent = 0.0, 0
    comm.Barrier()
    communicating = 0.0
    start = time.perf_counter()
    for _ in range(iters):
        with slow:
            time.sleep(compute_s)
        before = time.perf_counter()
        communicate()
        communicating += time.perf_counter() - before
    wall = time.perf_counter() - start
    if method["method"] == "allreduce":
        waited = communicating          # a collective is all waiting, from the rank's side
        channel.close()
    else:
        waited, sent = gossip.wait_s, gossip.bytes_sent / iters      # before draining the last rounds
        gossip.drain()
        gossip.close()
    walls = comm.allgather(wall)
    return {**method, "params": count, "dtype": np.dtype(dtype).name, "ranks": size, "straggler": straggle,
            "iterations": iters, "iterations_per_s": iters / max(walls), "bytes_per_iteration": sent,
            "comm_ms": 1e3 * communicating / iters, "wait_ms": 1e3 * waited / iters, "rank": rank}


def methods(graphs: list[str], mailboxes: list[str], taus: list[int]) -> list[dict]:
    found = [{"method": "allreduce", "graph": "-", "mailbox": "-", "tau": 0}]   # the ring allreduce
    found += [{"method": "sgp", "graph": g, "mailbox": t, "tau": tau} for g in graphs for t in mailboxes
              for tau in taus]
    return found


def add_parser(commands) -> None:
    bench = commands.add_parser(
        "bench-gossip", help="SGP gossip rounds against ring allreduce, per training iteration",
        description="Run under mpiexec, e.g.: mpiexec -n 8 mpicoll bench-gossip --straggler 3=3")
    bench.add_argument("--graphs", default="time-varying-exponential,exponential",
                       help="comma-separated: time-varying-exponential, exponential, ring, complete")
    bench.add_argument("--mailboxes", default="p2p,onesided", help="comma-separated: p2p, onesided")
    bench.add_argument("--taus", default="0,1", help="comma-separated overlap bounds (default 0,1)")
    bench.add_argument("--iters", type=int, default=20, help="iterations per method (default 20)")
    link_option(bench, "report each method's iterations against what the links allow across nodes")
    simulated_training_options(bench, "write the averaging and iteration records")


def run(args) -> int:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    graphs = parse_choices("bench-gossip", "graph", args.graphs, GRAPHS)
    mailboxes = parse_choices("bench-gossip", "mailbox", args.mailboxes, MAILBOXES)
    taus = [int(t) for t in args.taus.split(",")]
    parse(args.straggler)
    dtype = np.dtype(args.dtype)
    sizes = [size // dtype.itemsize for size in parse_sizes(args.sizes)]
    records = []
    if rank == 0:
        print(f"# mpicoll bench-gossip: {comm.Get_size()} ranks, {dtype.name}, {args.iters} iterations, "
              f"{args.compute_ms:g} ms of computation each")
        print(f"{'graph':>25} {'mailbox':>9} {'rounds to 1e-6':>14} {'theory':>6}")
    for graph in graphs:
        record = _averaging(comm, graph, mailboxes[0])
        records.append({"kind": "averaging", **record})
        if rank == 0:
            print(f"{graph:>25} {mailboxes[0]:>9} {record['rounds'] or '>400':>14} {record['theory_rounds']:>6}",
                  flush=True)
    if rank == 0:
        print(f"\n{'method':>9} {'graph':>25} {'mailbox':>9} {'tau':>3} {'params':>9} {'straggler':>9} "
              f"{'it/s':>7} {'x allreduce':>11} {'sent/it':>9} {'comm ms':>8} {'wait ms':>8}")
    for count in sizes:
        for straggle in [""] + ([args.straggler] if args.straggler else []):
            baseline = None
            for method in methods(graphs, mailboxes, taus):
                found = comm.gather(_iterations(comm, method, count, dtype, args.iters, args.compute_ms / 1e3,
                                                straggle), root=0)
                if rank != 0:
                    continue
                first = found[0]
                summary = {**{k: v for k, v in first.items() if k != "rank"}, "kind": "iterations",
                           "comm_ms": max(r["comm_ms"] for r in found), "wait_ms": max(r["wait_ms"] for r in found),
                           "bytes_per_iteration": max(r["bytes_per_iteration"] for r in found)}
                baseline = baseline or summary["iterations_per_s"]
                summary["ratio_to_allreduce"] = summary["iterations_per_s"] / baseline
                records.append(summary)
                print(f"{method['method']:>9} {method['graph']:>25} {method['mailbox']:>9} {method['tau']:>3} "
                      f"{format_bytes(count * dtype.itemsize):>9} {straggle or '-':>9} "
                      f"{summary['iterations_per_s']:>7.1f} {summary['ratio_to_allreduce']:>11.2f} "
                      f"{format_bytes(summary['bytes_per_iteration']):>9} {summary['comm_ms']:>8.1f} "
                      f"{summary['wait_ms']:>8.1f}", flush=True)
    nodes = node_count(comm)
    if rank == 0 and args.link_gbps:
        for line in link_report([r for r in records if r["kind"] == "iterations"], nodes, comm.Get_size(),
                                args.link_gbps, args.compute_ms):
            print(line)
    if rank == 0 and args.output:
        write_records(args.output, records)
    return 0


def link_report(records: list[dict], nodes: int, ranks: int, gbps: float, compute_ms: float) -> list[str]:
    """Each iteration time against its floor (see the module's docstring); adds ``link_ms`` and ``of_link_bound``."""
    if nodes < 2:
        return [f"# link bound: all ranks on one node, no link crossed (--link-gbps {gbps:g} unused)"]
    per_node = ranks // nodes
    lines = [f"# link bound: {nodes} nodes at {gbps:g} Gbit/s, {per_node} rank(s) each; the floor of an iteration "
             "is computation + link time, or the larger of the two with tau > 0 (1.0 = at the floor):"]
    for r in records:
        r["link_ms"] = r["bytes_per_iteration"] * per_node * 8 / (gbps * 1e9) * 1e3
        floor_ms = max(compute_ms, r["link_ms"]) if r["tau"] > 0 else compute_ms + r["link_ms"]
        r["of_link_bound"] = floor_ms * r["iterations_per_s"] / 1e3
        lines.append(f"#   {r['method']:>9} {r['mailbox']:>9} tau {r['tau']} {format_bytes(r['params'] * np.dtype(r['dtype']).itemsize):>8}"
                     f" {r['straggler'] or '-':>5}: link {r['link_ms']:6.1f} ms, floor {floor_ms:6.1f} ms, "
                     f"iteration {1e3 / r['iterations_per_s']:6.1f} ms: {r['of_link_bound']:.2f}")
    return lines
