"""``mpicoll bench-ps``: updates per second and bytes through the servers, by rule, size and straggler.

Run under mpiexec (``-n S+W``).  Workers send random gradients after a
simulated computation of ``--compute-ms`` (a sleep, so oversubscribed ranks do
not steal each other's cores), one of them ``--straggler``-times slower.  Each
server reports the updates it applied per second, the bytes it moved (gradients
in, weights out) per second, and the bandwidth of its update path alone (the
arrays a rule's update must read and write, over the time spent in it),
against a numpy copy measured on the same rank in the same run.  With ``--link-gbps`` (set by
``mpicoll cluster run``) each server's traffic to and from workers on other nodes is also given as a
share of its node's link.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from ..channel.nodes import node_members
from ..ps import TRANSPORTS, ParameterServer, make
from ..base.straggler import Straggler, parse
from .common import (format_bytes, link_option, median_seconds, parse_choices, parse_sizes, simulated_training_options,
                     write_records)

__all__ = ["run"]

_RULE_OPTIONS = {"sync": dict(lr=1e-6), "softsync": dict(lr=1e-6, k=2), "async": dict(lr=1e-6),
                 "dcasgd": dict(lr=1e-6, lam=0.04), "downpour": dict(lr=1e-6)}


def _copy_gbps(count: int, dtype) -> float:
    source, target = np.ones(count, dtype), np.empty(count, dtype)
    return 2 * source.nbytes / median_seconds(lambda: np.copyto(target, source), 5, lambda: None) / 1e9


def _one(comm, rule_name, count, dtype, seconds, compute_s, straggle, servers, transport):
    rule = make(rule_name, **_RULE_OPTIONS[rule_name])
    server = ParameterServer(comm, np.zeros(count, dtype), rule, servers=servers, transport=transport)
    mine = node_members(comm)                   # collective: before the ranks go their ways
    remote = sum(worker not in mine for worker in server.layout.workers)   # workers whose traffic crosses
    record = None
    if server.is_server:
        copy = _copy_gbps(server.weights.size, dtype)
        stats = server.serve()
        # gradients counts those that arrived: the refused never did, the other stale ones are not applied
        applied = sum(stats.gradients.values()) - (stats.dropped - stats.refused) - stats.nonfinite
        update_gbps = (rule.arrays_per_gradient * server.weights.nbytes * applied
                       / max(stats.update_s, 1e-12) / 1e9)
        record = {"rule": rule_name, "transport": transport, "params": count, "dtype": np.dtype(dtype).name, "servers": len(server.layout.servers),
                  "workers": len(server.layout.workers), "straggler": straggle, "updates": stats.updates,
                  "updates_per_s": stats.updates / stats.wall_s, "gradients_per_s": sum(stats.gradients.values())
                  / stats.wall_s, "gbps": (stats.bytes_in + stats.bytes_out) / stats.wall_s / 1e9,
                  "in_gbps": stats.bytes_in / stats.wall_s / 1e9, "out_gbps": stats.bytes_out / stats.wall_s / 1e9,
                  "remote_workers": remote,
                  "update_gbps": update_gbps, "copy_gbps": copy, "update_fraction_of_copy": update_gbps / copy,
                  "dropped": stats.dropped, "refused": stats.refused, "idle_fraction": stats.idle_s / stats.wall_s}
    else:
        slow = Straggler.for_rank(comm.Get_rank(), straggle)
        rng = np.random.default_rng(comm.Get_rank())
        gradient = rng.standard_normal(count).astype(dtype)
        server.client.pull()
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            with slow:
                time.sleep(compute_s)
            server.client.exchange(gradient)
        server.client.close()
    server.close()
    return comm.allgather(record)


def _link_report(records: list[dict], gbps: float) -> list[str]:
    """Each server's traffic against its node's link (adds ``of_link_bound``): the busier direction, in or
    out, over the link rate, counting only the share of the traffic that its remote workers send and get."""
    lines = [f"# link bound: {gbps:g} Gbit/s per node; each server's busier direction as a share of it "
             "(1.0 = its link is full), counting its remote workers' share of the traffic:"]
    for r in records:
        share = r["remote_workers"] / r["workers"]
        r["of_link_bound"] = share * max(r["in_gbps"], r["out_gbps"]) * 8 / gbps
        if r["remote_workers"]:
            lines.append(f"#   {r['rule']:>9} {r['transport']:>9} {r['params']:>10} params {r['straggler'] or '-':>5}: "
                         f"{r['of_link_bound']:.2f} ({r['remote_workers']} of {r['workers']} workers remote)")
        else:
            lines.append(f"#   {r['rule']:>9} {r['transport']:>9}: every worker on the server's node, no link crossed")
    return lines


def add_parser(commands) -> None:
    bench = commands.add_parser(
        "bench-ps", help="parameter-server updates/s and GB/s by rule, size and straggler",
        description="Run under mpiexec, e.g.: mpiexec -n 4 mpicoll bench-ps --straggler 3=3")
    from ..ps.rules import RULES
    bench.add_argument("--rules", default=",".join(RULES), help=f"comma-separated (default {','.join(RULES)})")
    bench.add_argument("--servers", type=int, default=1, help="server ranks (default 1)")
    bench.add_argument("--transports", default="p2p", help="comma-separated: p2p, onesided (default p2p)")
    bench.add_argument("--seconds", type=float, default=3.0, help="length of each run (default 3)")
    link_option(bench, "report each server's traffic as a share of its node's link")
    simulated_training_options(bench, "write one record per (rule, size, straggler, server)")


def run(args) -> int:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    rules = parse_choices("bench-ps", "rule", args.rules, _RULE_OPTIONS)
    transports = parse_choices("bench-ps", "transport", args.transports, TRANSPORTS)
    sizes = [size // np.dtype(args.dtype).itemsize for size in parse_sizes(args.sizes)]
    stragglers = [""] + ([args.straggler] if args.straggler else [])
    parse(args.straggler)
    if rank == 0:
        print(f"# mpicoll bench-ps: {comm.Get_size()} ranks, {args.servers} server(s), {args.dtype}, "
              f"{args.seconds:g} s per run, {args.compute_ms:g} ms per gradient")
        print(f"{'rule':>9} {'transport':>9} {'params':>10} {'straggler':>9} {'updates/s':>10} {'grads/s':>8} {'GB/s':>7} "
              f"{'update GB/s':>11} {'x copy':>7} {'dropped':>7} {'unsent':>6}")
    records = []
    # untimed: the first run also paid for connections and first-touched memory (measured across emulated
    # nodes at 4 MiB: async 13.9 updates/s first, 20.8 when run again)
    _one(comm, rules[0], sizes[0], args.dtype, min(0.5, args.seconds), args.compute_ms / 1e3, "", args.servers,
         transports[0])
    for count in sizes:
        for straggle in stragglers:
            for name, transport in ((n, t) for n in rules for t in transports):
                found = [r for r in _one(comm, name, count, args.dtype, args.seconds, args.compute_ms / 1e3,
                                         straggle, args.servers, transport) if r]
                records += found
                if rank == 0:
                    first = found[0]
                    ups = sum(r["updates_per_s"] for r in found) / len(found)
                    gps = sum(r["gradients_per_s"] for r in found) / len(found)
                    gbps = sum(r["gbps"] for r in found)
                    print(f"{name:>9} {transport:>9} {format_bytes(count * np.dtype(args.dtype).itemsize):>10} "
                          f"{straggle or '-':>9} {ups:>10.1f} {gps:>8.1f} {gbps:>7.2f} "
                          f"{first['update_gbps']:>11.1f} {first['update_fraction_of_copy']:>7.2f} "
                          f"{sum(r['dropped'] for r in found):>7} {sum(r['refused'] for r in found):>6}", flush=True)
    if rank == 0 and args.link_gbps:
        for line in _link_report(records, args.link_gbps):
            print(line)
    if rank == 0 and args.output:
        write_records(args.output, records)
    return 0
