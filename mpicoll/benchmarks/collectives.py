"""``mpicoll bench``: every algorithm against MPI's own collective, side by side, in one run.

In the manner of nccl-tests and the OSU benchmarks: for each message size,
each algorithm runs ``warmup`` untimed calls, then timed calls interleaved
with the other algorithms, in an order drawn afresh for each round (so drift in
the machine, and whatever one algorithm leaves behind for the next, hits all
alike: :func:`~mpicoll.benchmarks.common.interleaved_times`).  A call's
time is the slowest rank's; the reported time is the median over calls.

    algbw = bytes / time
    busbw = algbw * factor       (allreduce 2(p-1)/p, reduce-scatter and
                                  allgather (p-1)/p, bcast 1, as nccl-tests:
                                  the bytes each rank must move, comparable
                                  across rank counts; "bytes" is the whole
                                  message: the allreduce buffer, the
                                  reduce-scatter input, the allgather output)

``mpi`` is MPI's own collective called straight through mpi4py, the peer every
ratio is taken against; the mpicoll algorithms (``auto`` included) run
through :class:`~mpicoll.Communicator`, so their times include the Python
layer.  The first timed call of every algorithm is checked against ``mpi``'s
result, so a fast wrong answer cannot hide in the table.
"""

from __future__ import annotations

import functools
import sys
import time

import numpy as np
from mpi4py import MPI

from ..base.collectives import ALLGATHER, ALLREDUCE, COLLECTIVES, REDUCE_SCATTER_BLOCK, Collective, find
from ..collectives import algorithms
from ..collectives.api import allreduce
from ..collectives.compression import KINDS, Compression
from ..channel.checks import Signature
from ..collectives.communicator import FINGERPRINT_FROM, Communicator
from ..channel.nodes import node_count
from .common import link_option, check_counts, format_bytes, interleaved_times, parse_sizes, write_records

__all__ = ["run", "default_sizes", "measure"]

PEER = "mpi"


def default_sizes() -> list[int]:
    """8 B, then 16 B to 64 MiB in steps of 4x."""
    return [8] + [16 << (2 * i) for i in range(12)]


def compressed(name: str) -> tuple[str, str | None]:
    """(the algorithm, the compression) a bench name stands for: "auto+fp16" is auto's allreduce moving fp16."""
    algorithm, _, kind = name.partition("+")
    return algorithm, kind or None


def _calls(comm: MPI.Intracomm, names: list[str], collective: Collective):
    """One function per algorithm: (send, recv) -> None (Bcast uses recv alone, from rank 0)."""
    calls = {}
    for name in names:
        algorithm, kind = compressed(name)
        if kind:
            wrapped = Communicator(comm, algorithm=algorithm)
            calls[name] = lambda s, r, c=wrapped, k=kind: allreduce(s, comm=c, out=r, compression=k)
        elif name == PEER:
            # spelled as user code spells it, as the others are: the method looked up on each call.  (Until
            # November 2026 the peer was MPI's unbound method bound ahead, which no program writes; measured at 2
            # ranks, 8 B-256 KiB, --algorithms auto: auto/mpi 0.97-0.99 then, 0.98-1.00 now.)
            calls[name] = _own_call(MPI.Intracomm(comm), collective)
        else:
            calls[name] = _own_call(Communicator(comm, algorithm=name), collective)
    return calls


def _own_call(wrapped: MPI.Intracomm, collective: Collective):
    """(send, recv) -> None on a communicator, mpicoll's or MPI's own.  The method is looked up per call, as
    user code does (``comm.Allreduce(...)``: auto installs a faster method after its first call)."""
    return {"Allreduce": lambda s, r: wrapped.Allreduce(s, r),
            "Reduce_scatter_block": lambda s, r: wrapped.Reduce_scatter_block(s, r),
            "Allgather": lambda s, r: wrapped.Allgather(s, r),
            "Bcast": lambda s, r: wrapped.Bcast(r, 0)}[collective.method]


def _buffers(collective: Collective, count: int, p: int, dtype, rng):
    """(send, recv shape) for ``count`` elements of the collective's full message, rounded to p."""
    count = max(p, count - count % p) if collective.blocks else max(1, count)
    send_count = count // p if collective is ALLGATHER else count
    recv_count = count // p if collective is REDUCE_SCATTER_BLOCK else count
    send = (rng.standard_normal(send_count) if dtype.kind in "fc" else rng.integers(0, 100, send_count)).astype(dtype)
    return count, send, recv_count


def _iterations(nbytes: int, iters: int, min_iters: int) -> int:
    return max(min_iters, min(iters, iters * (1 << 20) // max(nbytes, 1)))


def measure(comm, names, sizes, dtype, iters, min_iters, warmup, report=None, collective="allreduce") -> list[dict]:
    """Time every (algorithm, size) of ``collective`` (any spelling of :mod:`mpicoll.base.collectives`);
    returns one record per pair (on every rank)."""
    p, rank = comm.Get_size(), comm.Get_rank()
    dtype = np.dtype(dtype)
    collective = find(collective)
    calls = _calls(comm, list(dict.fromkeys([PEER, *names])), collective)   # MPI's own checks every result
    bus_factor = collective.bus_factor(p)
    records = []
    rng = np.random.default_rng(1234 + rank)
    for nbytes in sizes:
        count, send, recv_count = _buffers(collective, nbytes // dtype.itemsize, p, dtype, rng)
        outputs = {name: np.empty(recv_count, dtype) for name in names}
        if collective.rooted:
            for output in outputs.values():
                output[...] = send
        for name in names:
            for _ in range(1 + warmup):               # the first call's result is checked below
                calls[name](send, outputs[name])
        reference = np.empty(recv_count, dtype)
        if collective.rooted:
            reference[...] = send
        calls[PEER](send, reference)
        for name in names:
            kind = compressed(name)[1]
            if kind:                                   # within the documented bound of 16-bit compression
                bound = Compression(kind).bound(p, comm.allreduce(np.abs(send.astype(np.float64))))
                right = np.all(np.abs(outputs[name] - reference) <= bound + 1e-6)
            else:
                right = np.allclose(outputs[name], reference, rtol=1e-3, atol=1e-3 * p)
            if not right:
                raise AssertionError(f"bench: {name} gave a wrong {collective} at {nbytes} bytes")
        n = _iterations(count * dtype.itemsize, iters, min_iters)
        # the timed calls all write one buffer: where a buffer lies in memory changed MPI's own 256 KiB
        # allgather at 2 ranks from 23 to 35 us (two buffers, MPI's call on each, interleaved in one run)
        timed = outputs[names[0]]
        times = interleaved_times(comm, [lambda name=name: calls[name](send, timed) for name in names], n)
        row = []
        for j, name in enumerate(names):
            seconds = float(np.median(times[j]))
            algbw = count * dtype.itemsize / seconds / 1e9
            row.append({"algorithm": name, "collective": collective.option, "bytes": count * dtype.itemsize, "ranks": p,
                        "dtype": dtype.name, "time_s": seconds, "algbw_gbps": algbw,
                        "busbw_gbps": algbw * bus_factor, "iters": n,
                        "wire_bytes": count * (2 if compressed(name)[1] else dtype.itemsize)})
        peer = next((r for r in row if r["algorithm"] == PEER), None)
        for record in row:
            record["ratio_to_mpi"] = peer["time_s"] / record["time_s"] if peer else None
        records.extend(row)
        if report is not None and rank == 0:
            report(row)
    return records


def table_header(names: list[str]) -> str:
    cells = "".join(f"{name:>22}" for name in names)
    return f"{'size':>10}{cells}\n{'':>10}" + "".join(f"{'us  busbw  x' + PEER:>22}" for _ in names)


def table_row(row: list[dict]) -> str:
    cells = []
    for r in row:
        ratio = f"{r['ratio_to_mpi']:.2f}" if r["ratio_to_mpi"] is not None else "-"
        cells.append(f"{r['time_s'] * 1e6:>10.1f} {r['busbw_gbps']:>6.2f} {ratio:>5}")
    return f"{format_bytes(row[0]['bytes']):>10}" + "".join(f"{c:>22}" for c in cells)


def plot(records: list[dict], path: str) -> None:
    """Bus bandwidth, and speed relative to MPI, against message size: one line per algorithm."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (bandwidth, ratio) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in dict.fromkeys(r["algorithm"] for r in records):
        mine = [r for r in records if r["algorithm"] == name]
        style = dict(marker="o", markersize=3, label=name, linestyle="--" if name == PEER else "-")
        bandwidth.plot([r["bytes"] for r in mine], [r["busbw_gbps"] for r in mine], **style)
        ratio.plot([r["bytes"] for r in mine], [r["ratio_to_mpi"] or 0 for r in mine], **style)
    first = records[0]
    for axes in (bandwidth, ratio):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("message size (bytes)")
        axes.grid(True, which="both", alpha=0.3)
    bandwidth.set_ylabel("bus bandwidth (GB/s)")
    ratio.set_ylabel("speed relative to MPI's own (x)")
    ratio.set_yscale("log", base=2)
    bandwidth.legend()
    figure.suptitle(f"{first.get('collective', 'allreduce')}, {first['ranks']} ranks, {first['dtype']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def _block_seconds(comm: MPI.Intracomm, call, calls: int) -> float:
    """Seconds per ``call`` over one block of ``calls`` back to back, the slowest rank's."""
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed = np.array((time.perf_counter() - start) / calls)
    comm.Allreduce(MPI.IN_PLACE, elapsed, MPI.MAX)
    return float(elapsed)


def python_overhead(comm: MPI.Intracomm, calls: int = 2000, rounds: int = 5) -> tuple[float, float]:
    """Seconds per 8-byte allreduce, back to back: (MPI through mpi4py, mpicoll's auto).

    Timed in alternating blocks of ``calls`` with no barrier in between, the
    fastest block of each kept: the difference is what the Python layer adds
    to every call, without the scheduling noise a barrier per call brings.
    """
    wrapped, raw = Communicator(comm), MPI.Intracomm(comm)
    send, recv = np.ones(2, np.float32), np.empty(2, np.float32)
    wrapped.Allreduce(send, recv)
    best = {"mpi": float("inf"), "auto": float("inf")}
    for _ in range(rounds):                     # both spelled as user code spells them
        for name, call in (("mpi", lambda: raw.Allreduce(send, recv)), ("auto", lambda: wrapped.Allreduce(send, recv))):
            best[name] = min(best[name], _block_seconds(comm, call, calls))
    wrapped.close()
    return best["mpi"], best["auto"]


COPY_BOUND_FROM = 1 << 20      # bytes: from this message size the one-node report has a memory bound


def copy_seconds(comm: MPI.Intracomm, nbytes: int, rounds: int = 15) -> float:
    """Seconds for every rank at once to copy ``nbytes`` from one array to another (numpy, a STREAM-style
    copy: read once, write once), the slowest rank's, median of ``rounds`` (a barrier before each).

    No allreduce on one node can beat it: each rank must at least read its input and write its output,
    which is this copy's traffic, while the other ranks move theirs through the same memory."""
    source = np.ones(nbytes // 8 or 1, np.float64)
    target = np.empty_like(source)
    np.copyto(target, source)
    times = []
    for _ in range(rounds):
        comm.Barrier()
        start = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - start)
    mine = np.array(np.median(times))
    comm.Allreduce(MPI.IN_PLACE, mine, MPI.MAX)
    return float(mine)


def copy_bound_report(comm: MPI.Intracomm, records: list[dict]) -> list[str]:
    """Each time from ``COPY_BOUND_FROM`` bytes against the copy bound (:func:`copy_seconds`; adds ``copy_s``,
    ``busbw_bound_gbps`` and ``of_copy_bound`` to the records).  Collective: every rank measures."""
    sizes = [size for size in dict.fromkeys(r["bytes"] for r in records) if size >= COPY_BOUND_FROM]
    lines = []
    for size in sizes:
        seconds = copy_seconds(comm, size)
        row = [r for r in records if r["bytes"] == size]
        factor = row[0]["busbw_gbps"] / row[0]["algbw_gbps"]
        for r in row:
            r["copy_s"], r["busbw_bound_gbps"] = seconds, size / seconds / 1e9 * factor
            r["of_copy_bound"] = seconds / r["time_s"]
        lines.append(f"#   {format_bytes(size):>8}: copy {seconds * 1e3:8.3f} ms ({2 * size / seconds / 1e9:5.1f} GB/s "
                     f"read+write per rank), busbw bound {row[0]['busbw_bound_gbps']:5.2f} GB/s; "
                     + ", ".join(f"{r['algorithm']} {r['of_copy_bound']:.2f}" for r in row))
    if lines:
        lines.insert(0, f"# memory bound: all {comm.Get_size()} ranks copying a buffer of the message's size at once "
                        "(numpy, read + write; no allreduce can take less); each time as a share of it:")
    return lines


def link_bound_report(records: list[dict], nodes: int, gbps: float) -> list[str]:
    """Each time against the link bound (adds ``link_bound_s`` and ``of_link_bound`` to the records)."""
    if nodes < 2:
        return [f"# link bound: all ranks on one node, no link crossed (--link-gbps {gbps:g} unused)"]
    lines = [f"# link bound: {nodes} nodes at {gbps:g} Gbit/s; each time as a share of it (1.0 = at the bound):"]
    for size in dict.fromkeys(r["bytes"] for r in records):
        row = [r for r in records if r["bytes"] == size]
        # the least each node must send over its link: the bus-bandwidth factor with nodes for ranks (the
        # ranks of a node share its link)
        factor = find(row[0]["collective"]).bus_factor(nodes) * 8 / (gbps * 1e9)
        for r in row:         # the bound of the bytes each moves (a compressed one's 16-bit words)
            bound = r.get("wire_bytes", r["bytes"]) * factor
            r["link_bound_s"], r["of_link_bound"] = bound, bound / r["time_s"]
        lines.append(f"#   {format_bytes(size):>8}: {row[0]['link_bound_s'] * 1e3:9.2f} ms; "
                     + ", ".join(f"{r['algorithm']} {r['of_link_bound']:.2f}"
                                 + (f" (of {r['link_bound_s'] * 1e3:.2f} ms)" if r["link_bound_s"] !=
                                    row[0]["link_bound_s"] else "") for r in row))
    return lines


def fingerprint_costs(comm: MPI.Intracomm, names: list[str], sizes: list[int], dtype, collective: str,
                      seconds: float = 2.0, warmup: int = 3) -> list[dict]:
    """What the cross-rank fingerprint adds to each own algorithm's calls, timed in the same run.

    For every size from ``FINGERPRINT_FROM`` elements, three calls on one
    communicator take turns: with the fingerprint, without it, and without it
    again (an A/A control: this machine's noise floor), a barrier before
    each, for about ``seconds`` per size and algorithm (20 rounds at least,
    1000 at most).  One communicator, its threshold switched per call, so the
    calls share their scratch memory (separate communicators differed by up
    to 20% at 4 MiB through where their buffers lay).  The cost is the median
    of the rounds' differences with - without (slowest rank's), as a share of
    the median call without it; the control is the same for again - without.
    """
    own = [name for name in names if name not in (PEER, "auto") and not compressed(name)[1]]
    dtype = np.dtype(dtype)
    collective = find(collective)

    def variant(wrapped, threshold):
        call = _own_call(wrapped, collective)

        def switched(send, out):
            wrapped.fingerprint_from = threshold
            call(send, out)
        return switched

    rng = np.random.default_rng(99 + comm.Get_rank())
    costs = []
    for nbytes in sizes:
        count, send, recv_count = _buffers(collective, nbytes // dtype.itemsize, comm.Get_size(), dtype, rng)
        per_rank = count // comm.Get_size() if collective.blocks else count
        if per_rank < FINGERPRINT_FROM:       # what a call's signature counts: one rank's block for these
            continue
        out = np.empty(recv_count, dtype)
        if collective.rooted:
            out[...] = send
        for name in own:
            wrapped = Communicator(comm, algorithm=name)
            calls = [variant(wrapped, threshold) for threshold in (FINGERPRINT_FROM, float("inf"), float("inf"))]
            start = time.perf_counter()
            for call in calls * warmup:
                call(send, out)
            each = comm.allreduce(time.perf_counter() - start, MPI.MAX) / (3 * warmup)
            rounds = int(min(1000, max(20, seconds / (3 * each))))
            times = interleaved_times(comm, [functools.partial(call, send, out) for call in calls], rounds)
            without = float(np.median(times[1]))
            added, control = (float(np.median(times[j] - times[1])) for j in (0, 2))
            wrapped.close()
            costs.append({"algorithm": name, "bytes": count * dtype.itemsize, "without_s": without, "rounds": rounds,
                          "added_s": added, "cost": added / without, "control_s": control,
                          "control": control / without})
    return costs


def fingerprint_work(calls: int = 20000) -> float:
    """Seconds of Python one fingerprinted call spends on its fingerprint (stamping the call and settling
    it), timed alone on this rank's own communicator: the part of the cost that is not noise."""
    comm = Communicator(MPI.COMM_SELF, algorithm="ring")
    data = np.zeros(FINGERPRINT_FROM, np.float32)
    comm.Allreduce(MPI.IN_PLACE, data)                     # sets up the context and its fingerprint
    fingerprint = comm._context.fingerprint
    signature = Signature(ALLREDUCE.method, data.size, data.dtype, "MPI_SUM", algorithm="ring")
    start = time.perf_counter()
    for _ in range(calls):
        fingerprint.start(signature)
        fingerprint.settle()
    seconds = (time.perf_counter() - start) / calls
    comm.close()
    return seconds


def add_parser(commands) -> None:
    bench = commands.add_parser(
        "bench", help="a collective (default allreduce) of every algorithm against MPI's own, side by side",
        description="Run under mpiexec, e.g.: mpiexec -n 4 mpicoll bench --sizes 8:64M")
    bench.add_argument("--collective", default="allreduce", choices=[c.option for c in COLLECTIVES.values()],
                       help="which collective to time (default allreduce)")
    bench.add_argument("--sizes", help="'8,1K,64M', or a range LOW:HIGH[:FACTOR] (default factor 4); default 8 B to 64 MiB")
    bench.add_argument("--algorithms", help="comma-separated; default: all, and auto (mpi always runs)")
    bench.add_argument("--dtype", default="float32", help="numpy dtype of the elements (default float32)")
    bench.add_argument("--compression", help="allreduce: also time each algorithm moving 16-bit floats, e.g. "
                       "fp16,bf16 (shown as auto+fp16, ...; docs/compression.md)")
    bench.add_argument("--iters", type=int, default=200, help="timed calls per size up to 1 MiB, fewer above "
                       "(default 200: small calls are cheap, and a median of fewer flipped between the modes of "
                       "oversubscribed ranks' times)")
    bench.add_argument("--min-iters", type=int, default=15, help="timed calls at least, at any size (default 15)")
    bench.add_argument("--warmup", type=int, default=3, help="untimed calls per size and algorithm after the "
                       "first, whose result is checked against MPI's (default 3)")
    bench.add_argument("--fingerprint-seconds", type=float, default=2.0, metavar="S",
                       help="seconds per size and algorithm spent timing what the cross-rank fingerprint adds to "
                       "calls from 512 KiB of float32 (default 2, 20 rounds at least; 0 skips it)")
    bench.add_argument("--output", metavar="FILE.json", help="write one record per (algorithm, size)")
    bench.add_argument("--plot", metavar="FILE.png", help="draw bus bandwidth against size")
    link_option(bench, "report each time as a share of the link bound across nodes")


def run(args) -> int:
    comm = MPI.COMM_WORLD
    names = args.algorithms.split(",") if args.algorithms else [*algorithms.REGISTRY, "auto"]
    names = [PEER] + [n for n in dict.fromkeys(names) if n != PEER]
    for name in names[1:]:
        if name != "auto":
            algorithms.get(name)
    if args.compression:
        kinds = args.compression.split(",")
        if args.collective != "allreduce" or np.dtype(args.dtype) not in (np.float32, np.float64) or \
                any(kind not in KINDS for kind in kinds):
            if comm.Get_rank() == 0:
                print(f"mpicoll bench: --compression takes {', '.join(KINDS)} for allreduce of float32 or float64",
                      file=sys.stderr, flush=True)
            return 2
        names += [f"{name}+{kind}" for kind in kinds for name in names[1:] if name != PEER]
    try:
        sizes = parse_sizes(args.sizes) if args.sizes else default_sizes()
        check_counts(args, sizes, np.dtype(args.dtype))
        if not args.fingerprint_seconds >= 0:
            raise ValueError(f"--fingerprint-seconds must be 0 or more, got {args.fingerprint_seconds}")
    except (TypeError, ValueError) as error:        # the same on every rank: each stops, rank 0 says why
        if comm.Get_rank() == 0:
            print(f"mpicoll bench: {error}", file=sys.stderr, flush=True)
        return 2
    out = sys.stdout
    if comm.Get_rank() == 0:
        print(f"# mpicoll bench: {args.collective}, {comm.Get_size()} ranks, {args.dtype}, "
              f"{MPI.Get_library_version().splitlines()[0].strip()}", file=out)
        print(table_header(names), file=out, flush=True)
    records = measure(comm, names, sizes, args.dtype, args.iters, args.min_iters, args.warmup,
                      report=lambda row: print(table_row(row), file=out, flush=True), collective=args.collective)
    nodes = node_count(comm)
    memory = copy_bound_report(comm, records) if nodes == 1 else []
    raw, wrapped = python_overhead(comm)
    costs = fingerprint_costs(comm, names, sizes, args.dtype, args.collective, args.fingerprint_seconds) \
        if comm.Get_size() > 1 and args.fingerprint_seconds > 0 else []
    work = fingerprint_work() if costs else 0.0
    if comm.Get_rank() == 0:
        print(f"# per-call overhead of the Python layer at 8 B: {(wrapped - raw) * 1e6:+.2f} us "
              f"(auto {wrapped * 1e6:.2f} us vs mpi {raw * 1e6:.2f} us per call, back to back)", file=out)
        if costs:
            print(f"# cross-rank fingerprint (calls of {FINGERPRINT_FROM} elements and more): its own work "
                  f"{work * 1e6:.2f} us per call; time it adds, median of rounds' with - without, beside an A/A "
                  "control (again - without: the noise floor):", file=out)
            for c in costs:
                print(f"#   {format_bytes(c['bytes']):>8} {c['algorithm']:<20} {c['added_s'] * 1e6:+8.1f} us on "
                      f"{c['without_s'] * 1e6:9.1f} us = {100 * c['cost']:+.1f}%   (control "
                      f"{c['control_s'] * 1e6:+8.1f} us = {100 * c['control']:+.1f}%, {c['rounds']} rounds)", file=out)
        for line in memory:
            print(line, file=out)
        if args.link_gbps:
            for line in link_bound_report(records, nodes, args.link_gbps):
                print(line, file=out)
        if args.output:
            write_records(args.output, records, out)
        if args.plot:
            plot(records, args.plot)
            print(f"# wrote {args.plot}", file=out)
    return 0
