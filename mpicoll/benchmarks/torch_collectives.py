"""``mpicoll bench-torch``: ``dist.all_reduce`` over mpicoll against gloo and MPI's own, in one run.

Run under mpiexec.  Every rank joins a gloo process group (``torch.distributed``,
rendezvous on rank 0's host through a TCP port chosen by rank 0) next to MPI,
and a group of the same ranks over the "mpicoll" backend.
For each size, one float32 tensor is reduced in place, sum, by each peer:
gloo's ``all_reduce``, MPI's own ``Allreduce`` on the tensor's memory
(mpi4py, ``MPI.IN_PLACE``), ``dist.all_reduce`` over the "mpicoll" group
(``dist``), the same call over a group of a backend that does nothing
(``floor``: torch's dispatch to any process group written in Python, the
cost no such backend can go under), DeepSpeed's shared-memory kernel where deepspeed is installed and every
rank is on one node (``deepspeed``: :mod:`.deepspeed_peer`), and ``mpicoll.torch.allreduce(t, "sum", out=t)``
for each ``--algorithms``; ``--peers`` leaves some of the first five out (each
peer's calls leave the caches and cores as they leave them, and gloo's threads
spin on: the price of a small call beside MPI and the floor alone is
``--peers mpi,floor,dist --algorithms ''``).  Every peer's result is first
checked against the exact sum.  The peers then take turns in an order drawn afresh each round, a barrier before
each call; a call's time is the slowest rank's, and the median over
``--iters`` rounds is reported, with each column's speed against gloo's and
MPI's (and DeepSpeed's); on one node, from 1 MiB, each peer's share of the copy bound measured beside it
(:func:`.collectives.copy_seconds`: every rank copying the buffer at once).  Multi-node runs need gloo's
rendezvous host reachable (``--master`` to name it).  ``--training`` times
whole training steps instead (:mod:`.torch_training`).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..base.config import parse_bytes
from ..channel.nodes import node_count
from . import deepspeed_peer, torch_training
from .collectives import COPY_BOUND_FROM, copy_seconds
from .common import format_bytes, interleaved_times, parse_sizes, write_records

__all__ = ["run", "PEERS"]

# torch's gloo, MPI's own call, torch's floor, the backend, DeepSpeed's shared-memory kernel
PEERS = ("gloo", "mpi", "floor", "dist", "deepspeed")


def add_parser(commands) -> None:
    bench = commands.add_parser(
        "bench-torch", help="dist.all_reduce over mpicoll and mpicoll.torch.allreduce against torch's gloo and "
                            "MPI's own, in place",
        description="Run under mpiexec, e.g.: mpiexec -n 4 mpicoll bench-torch --sizes 1M,16M")
    bench.add_argument("--sizes", default="64K,1M,16M", help="bytes: '1M,16M' or LOW:HIGH[:FACTOR]")
    bench.add_argument("--algorithms", default="auto", help="mpicoll algorithms to time (default auto; '' none)")
    bench.add_argument("--peers", help=f"which of {', '.join(PEERS)} to time beside them (default all; "
                                        "deepspeed where it is installed and every rank is on one node)")
    bench.add_argument("--iters", type=int, default=10, help="timed calls per size and peer (default 10)")
    bench.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                       help="the tensors' type (default float32; bfloat16 leaves out MPI's own call, MPI has no "
                            "such type)")
    bench.add_argument("--master", help="host for gloo's rendezvous (default: rank 0's; 127.0.0.1 on one node)")
    bench.add_argument("--timeout", type=float, default=60, help="seconds for gloo's set-up and calls")
    bench.add_argument("--output", metavar="FILE.json", help="write one record per size")
    bench.add_argument("--threads", type=int,
                       help="torch threads per rank (default: this rank's share of the node's cores, as "
                            "mpicoll.torch gives it)")
    training = bench.add_argument_group(
        "training", "--training times whole training steps instead: DistributedOptimizer against DDP on gloo")
    training.add_argument("--training", action="store_true", help="time training steps of an MLP")
    training.add_argument("--hidden", default="1024,1024,1024", help="hidden widths (default 1024,1024,1024)")
    training.add_argument("--batch", type=int, default=64, help="samples per rank and step (default 64)")
    training.add_argument("--steps", type=int, default=5, help="steps per contender and round (default 5)")
    training.add_argument("--bucket-bytes", type=parse_bytes, help="DistributedOptimizer's bucket_bytes "
                          "(default: its own)")


_SIDE = (("gloo", "gloo"), ("mpi", "MPI"), ("floor", "floor"), ("deepspeed", "DS"))   # peers timed beside


def _floor_backend(dist) -> str:
    """The name of a backend whose groups do nothing, registered once: what torch's own dispatch to a process
    group written in Python costs a call (the floor under any such backend, mpicoll's included)."""
    name = "mpicoll-floor"
    if name.upper() not in dist.Backend._plugins:
        class Done(dist._Work):
            def wait(self, timeout=None):
                return True

        class DoNothing(dist.ProcessGroup):
            def allreduce(self, tensors, opts=None):
                return Done()

            def getBackendName(self):
                return name

        dist.Backend.register_backend(name, lambda store, rank, size, timeout: DoNothing(rank, size),
                                      devices=["cpu"])
    return name


def run(args) -> int:
    try:
        import torch
        import torch.distributed as dist
        import mpicoll.torch as mt
    except ImportError as error:
        raise SystemExit(f"mpicoll bench-torch needs PyTorch (pip install -e '.[torch]'): {error}") from None
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    one_node = node_count(comm) == 1
    peers = [name.strip() for name in (args.peers or ",".join(PEERS)).split(",") if name.strip()]
    if not peers or set(peers) - set(PEERS):
        raise SystemExit(f"mpicoll bench-torch: --peers takes some of {', '.join(PEERS)}, got {args.peers!r}")
    if "deepspeed" in peers and not (deepspeed_peer.available() and one_node):
        if args.peers is None:          # the default: DeepSpeed where it can run
            peers.remove("deepspeed")
        else:
            raise SystemExit("mpicoll bench-torch: --peers deepspeed needs deepspeed installed (pip install "
                             "deepspeed, after torch) and every rank on one node (its kernel's segments are "
                             "one node's shared memory)")
    if args.dtype == "bfloat16" and "mpi" in peers:
        if args.peers is not None:
            raise SystemExit("mpicoll bench-torch: --dtype bfloat16 has no MPI peer (MPI has no bfloat16 type); "
                             "leave mpi out of --peers")
        peers.remove("mpi")
    dtype, itemsize = getattr(torch, args.dtype), 4 if args.dtype == "float32" else 2
    algorithms = [name for name in PEERS if name in peers and name == "dist"] + \
        [name.strip() for name in args.algorithms.split(",") if name.strip()]
    mt.init_process_group("gloo", comm=comm, master=args.master, timeout=args.timeout)
    group = dist.new_group(backend="mpicoll")          # every rank, over the "mpicoll" backend
    floor = dist.new_group(backend=_floor_backend(dist))   # torch's dispatch to a Python group doing nothing
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.training:
        try:
            return torch_training.run(args, torch, mt, dist, group)
        finally:
            dist.destroy_process_group()
    records = []
    deepspeed = deepspeed_peer.DeepSpeedAllreduce(comm) if "deepspeed" in peers else None
    gloo, mpi, ratio = "gloo" in peers, "mpi" in peers, {"dist", "mpi", "floor"} <= set(peers)
    if rank == 0:
        print(f"# mpicoll bench-torch: {size} ranks, {args.dtype}, in place, sum; median of {args.iters} calls, "
              f"slowest rank; torch {torch.__version__}, {torch.get_num_threads()} torch thread(s) a rank"
              + (f", DeepSpeed {deepspeed.threads} OpenMP thread(s) a rank" if deepspeed else ""))
        print(f"{'size':>10}" + "".join(f" {label + ' ms':>9}" for name, label in _SIDE if name in peers)
              + "".join(f" {name + ' ms':>12}" + (f" {'x gloo':>7}" if gloo else "") + (f" {'x MPI':>6}" if mpi else "")
                        + (f" {'x DS':>6}" if deepspeed else "") for name in algorithms)
              + (f" {'dist x (MPI+floor)':>18}" if ratio else ""))
    for nbytes in parse_sizes(args.sizes):
        tensor = torch.empty(max(1, nbytes // itemsize), dtype=dtype)
        memory = tensor.numpy() if args.dtype == "float32" else None
        calls = {"gloo": lambda: dist.all_reduce(tensor), "mpi": lambda: comm.Allreduce(MPI.IN_PLACE, memory),
                 "floor": lambda: dist.all_reduce(tensor, group=floor),
                 "dist": lambda: dist.all_reduce(tensor, group=group),
                 "deepspeed": lambda: deepspeed.call(tensor)}
        calls = {**{name: calls[name] for name in PEERS if name in peers},
                 **{name: lambda name=name: mt.allreduce(tensor, "sum", algorithm=name, out=tensor)
                    for name in algorithms if name != "dist"}}
        for peer, call in calls.items():            # right first (and warm), then timed on zeros: no overflow
            tensor.fill_(rank + 1)
            call()
            if peer != "floor" and not bool((tensor == size * (size + 1) / 2).all()):
                raise SystemExit(f"mpicoll bench-torch: {peer} gave a wrong sum at {nbytes} bytes on rank {rank}")
        tensor.zero_()
        seconds = np.median(interleaved_times(comm, list(calls.values()), args.iters), axis=1)
        times = dict(zip(calls, seconds))
        record = {"bytes": tensor.numel() * itemsize, "ranks": size, "dtype": args.dtype, **{f"{k}_s": v for k, v in times.items()}}
        records.append(record)
        bound = one_node and record["bytes"] >= COPY_BOUND_FROM
        if bound:
            record["copy_s"] = copy_seconds(comm, record["bytes"])
        if rank == 0:
            print(f"{format_bytes(record['bytes']):>10}"
                  + "".join(f" {times[name] * 1e3:>9.4f}" for name, _ in _SIDE if name in peers)
                  + "".join(f" {times[name] * 1e3:>12.4f}" + (f" {times['gloo'] / times[name]:>7.2f}" if gloo else "")
                            + (f" {times['mpi'] / times[name]:>6.2f}" if mpi else "")
                            + (f" {times['deepspeed'] / times[name]:>6.2f}" if deepspeed else "") for name in algorithms)
                  + (f" {times['dist'] / (times['mpi'] + times['floor']):>18.2f}" if ratio else ""), flush=True)
            if bound:
                print(f"#   copy bound {record['copy_s'] * 1e3:.4f} ms; share of it: " + ", ".join(
                    f"{name} {record['copy_s'] / seconds:.2f}" for name, seconds in times.items() if name != "floor"),
                    flush=True)
    if deepspeed is not None:
        deepspeed.close()
    dist.destroy_process_group()
    if rank == 0 and args.output:
        write_records(args.output, records)
    return 0
