"""The ``mpicoll`` command: ``train``, ``bench``, ``bench-ps``, ``bench-gossip``, ``bench-torch``, ``bench-overlap``,
``bench-sandblaster`` and ``info`` (under mpiexec), ``compare``, ``plot`` and ``bench-kernels`` (one process), ``cluster`` (an emulated
cluster)."""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys

from .base.config import parse_bytes
from .base.launcher import announced

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line, printed once per job: under a launcher only its first
    process prints (every process exits with status 2), naming the option meant where a misspelt one is close
    to a real one."""

    def error(self, message: str):
        launch = announced()
        if launch is None or launch[0] == 0:
            print(f"{self.prog}: error: {message}{self._did_you_mean(message)}; see {self.prog} --help",
                  file=sys.stderr, flush=True)
        sys.exit(2)

    def _did_you_mean(self, message: str) -> str:
        if not message.startswith("unrecognized arguments"):
            return ""
        known = [option for option in self._option_string_actions if option.startswith("--")]
        for word in message.split():
            if word.startswith("--") and word not in known:
                close = difflib.get_close_matches(word.split("=")[0], known, n=1)
                if close:
                    return f" (did you mean {close[0]}?)"
        return ""


def _float_or_none(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


def _bench_parser(commands) -> None:
    bench = commands.add_parser(
        "bench", help="a collective (default allreduce) of every algorithm against MPI's own, side by side",
        description="Run under mpiexec, e.g.: mpiexec -n 4 mpicoll bench --sizes 8:64M")
    bench.add_argument("--collective", default="allreduce", choices=["allreduce", "reduce_scatter", "allgather", "bcast"],
                       help="which collective to time (default allreduce)")
    bench.add_argument("--sizes", help="'8,1K,64M', or a range LOW:HIGH[:FACTOR] (default factor 4); default 8 B to 64 MiB")
    bench.add_argument("--algorithms", help="comma-separated; default: all, and auto (mpi always runs)")
    bench.add_argument("--dtype", default="float32", help="numpy dtype of the elements (default float32)")
    bench.add_argument("--iters", type=int, default=50, help="timed calls per size up to 1 MiB (default 50)")
    bench.add_argument("--min-iters", type=int, default=15, help="timed calls at least, at any size (default 15)")
    bench.add_argument("--warmup", type=int, default=3, help="untimed calls per size and algorithm after the "
                       "first, whose result is checked against MPI's (default 3)")
    bench.add_argument("--output", metavar="FILE.json", help="write one record per (algorithm, size)")
    bench.add_argument("--plot", metavar="FILE.png", help="draw bus bandwidth against size")
    _link_option(bench, "report each time as a share of the link bound across nodes")


def _link_option(bench, what: str) -> None:
    bench.add_argument("--link-gbps", type=float, default=_float_or_none(os.environ.get("MPICOLL_LINK_GBPS")),
                       help=f"the nodes' link rate in Gbit/s: {what} (default $MPICOLL_LINK_GBPS, which "
                            "mpicoll cluster run sets)")


def _bench_kernels_parser(commands) -> None:
    bench = commands.add_parser(
        "bench-kernels", help="every kernel and backend against the device's copy bandwidth",
        description="Single process: mpicoll bench-kernels --threads 1,2 --output kernels.json")
    bench.add_argument("--elements", type=int, default=16 * 2**20, help="array length (default 16M)")
    bench.add_argument("--dtype", default="float32", help="float16, float32 or float64 (default float32)")
    bench.add_argument("--backends", default="numpy,numba,cupy,numba-cuda",
                       help="comma-separated (default: all; those not available here are skipped with the reason)")
    bench.add_argument("--threads", help="Numba thread counts to run, e.g. 1,2 (default: Numba's own)")
    bench.add_argument("--iters", type=int, default=10, help="timed calls per kernel (default 10)")
    bench.add_argument("--output", metavar="FILE.json", help="write one record per (kernel, backend, threads)")


def _bench_ps_parser(commands) -> None:
    bench = commands.add_parser(
        "bench-ps", help="parameter-server updates/s and GB/s by rule, size and straggler",
        description="Run under mpiexec, e.g.: mpiexec -n 4 mpicoll bench-ps --straggler 3=3")
    from .ps.rules import RULES
    bench.add_argument("--rules", default=",".join(RULES), help=f"comma-separated (default {','.join(RULES)})")
    bench.add_argument("--servers", type=int, default=1, help="server ranks (default 1)")
    bench.add_argument("--transports", default="p2p", help="comma-separated: p2p, onesided (default p2p)")
    bench.add_argument("--seconds", type=float, default=3.0, help="length of each run (default 3)")
    _link_option(bench, "report each server's traffic as a share of its node's link")
    _simulated_training_options(bench, "write one record per (rule, size, straggler, server)")


def _simulated_training_options(bench, output: str) -> None:
    """The options of the benchmarks that simulate training steps (bench-ps, bench-gossip)."""
    bench.add_argument("--sizes", default="4M,64M", help="parameter bytes: '4M,64M' or LOW:HIGH[:FACTOR]")
    bench.add_argument("--dtype", default="float32", help="float32 or float64 (default float32)")
    bench.add_argument("--compute-ms", type=float, default=20.0, help="simulated gradient time (default 20)")
    bench.add_argument("--straggler", help="RANK=FACTOR: also run with that rank slowed, e.g. 3=3")
    bench.add_argument("--output", metavar="FILE.json", help=output)


def _bench_gossip_parser(commands) -> None:
    bench = commands.add_parser(
        "bench-gossip", help="SGP gossip rounds against ring allreduce, per training iteration",
        description="Run under mpiexec, e.g.: mpiexec -n 8 mpicoll bench-gossip --straggler 3=3")
    bench.add_argument("--graphs", default="time-varying-exponential,exponential",
                       help="comma-separated: time-varying-exponential, exponential, ring, complete")
    bench.add_argument("--mailboxes", default="p2p,onesided", help="comma-separated: p2p, onesided")
    bench.add_argument("--taus", default="0,1", help="comma-separated overlap bounds (default 0,1)")
    bench.add_argument("--iters", type=int, default=20, help="iterations per method (default 20)")
    _link_option(bench, "report each method's iterations against what the links allow across nodes")
    _simulated_training_options(bench, "write the averaging and iteration records")


def _bench_torch_parser(commands) -> None:
    bench = commands.add_parser(
        "bench-torch", help="mpicoll.torch.allreduce against torch's gloo and MPI's own, in place",
        description="Run under mpiexec, e.g.: mpiexec -n 4 mpicoll bench-torch --sizes 1M,16M")
    bench.add_argument("--sizes", default="64K,1M,16M", help="bytes: '1M,16M' or LOW:HIGH[:FACTOR]")
    bench.add_argument("--algorithms", default="auto", help="mpicoll algorithms to time (default auto)")
    bench.add_argument("--iters", type=int, default=10, help="timed calls per size and peer (default 10)")
    bench.add_argument("--master", help="host for gloo's rendezvous (default: rank 0's; 127.0.0.1 on one node)")
    bench.add_argument("--timeout", type=float, default=60, help="seconds for gloo's set-up and calls")
    bench.add_argument("--output", metavar="FILE.json", help="write one record per size")
    bench.add_argument("--threads", type=int, help="torch threads per rank (default: torch's)")
    training = bench.add_argument_group(
        "training", "--training times whole training steps instead: DistributedOptimizer against DDP on gloo")
    training.add_argument("--training", action="store_true", help="time training steps of an MLP")
    training.add_argument("--hidden", default="1024,1024,1024", help="hidden widths (default 1024,1024,1024)")
    training.add_argument("--batch", type=int, default=64, help="samples per rank and step (default 64)")
    training.add_argument("--steps", type=int, default=5, help="steps per contender and round (default 5)")
    training.add_argument("--bucket-bytes", type=parse_bytes, help="DistributedOptimizer's bucket_bytes "
                          "(default: its own)")


def _bench_overlap_parser(commands) -> None:
    bench = commands.add_parser(
        "bench-overlap", help="how much of a nonblocking allreduce hides behind numpy, sleeping or Python work",
        description="Run under mpiexec, e.g.: mpiexec -n 2 mpicoll bench-overlap --sizes 1M,16M")
    bench.add_argument("--sizes", default="1M,16M", help="bytes: '1M,16M' or LOW:HIGH[:FACTOR]")
    bench.add_argument("--work", default="matmul,sleep,python", help="kinds of work (default all three)")
    bench.add_argument("--work-ms", type=float, default=50, help="milliseconds of work (default 50)")
    bench.add_argument("--algorithm", default="auto", help="mpicoll algorithm (default auto)")
    bench.add_argument("--iters", type=int, default=10, help="rounds (default 10)")
    bench.add_argument("--output", metavar="FILE.json", help="write one record per size and work")


def _bench_sandblaster_parser(commands) -> None:
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


def _info_parser(commands) -> None:
    commands.add_parser("info", help="versions, MPI library, auto rules, kernel backends, GPU and CUDA-awareness")


def info() -> int:
    import mpi4py
    import numpy
    from mpi4py import MPI

    import mpicoll
    from . import arrays, compute
    from .collectives.algorithms import auto

    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"mpicoll    {mpicoll.__version__}")
        print(f"mpi4py     {mpi4py.__version__}")
        print(f"numpy      {numpy.__version__}")
        print(f"MPI        {MPI.Get_library_version().splitlines()[0].strip()} (standard {'.'.join(map(str, MPI.Get_version()))})")
        print(f"ranks      {MPI.COMM_WORLD.Get_size()}")
        for across_nodes, where in ((False, ""), (True, " (across nodes of several ranks)")):
            for collective in auto.DEFAULT_RULES:
                rule = ", ".join(f"{name} below {limit:.0f} B" if limit != float("inf") else name
                                 for name, limit in auto.rule(collective, across_nodes=across_nodes))
                print(f"auto       {collective}{where}: {rule}")
        for backend, state in compute.backends().items():
            print(f"kernels    {backend}: {state}")
        count, first = arrays.gpu_count()
        print(f"GPU        {f'{count} device(s), first: {first}' if count else f'none ({first})'}")
        aware, reason = arrays.cuda_aware()
        mode = "device buffers straight to MPI" if aware else "staged through pinned host buffers"
        print(f"CUDA-aware {'yes' if aware else 'no'} ({reason}); device arrays: {mode}; "
              "MPICOLL_CUDA_AWARE=0|1 forces")
    return 0


_RUNNERS = {"bench": (".benchmarks.collectives", "run"), "bench-kernels": (".benchmarks.kernels", "run"),
            "bench-ps": (".benchmarks.parameter_servers", "run"), "bench-gossip": (".benchmarks.gossip", "run"),
            "bench-torch": (".benchmarks.torch_collectives", "run"), "bench-overlap": (".benchmarks.overlap", "run"),
            "bench-sandblaster": (".benchmarks.sandblaster", "run"),
            "train": (".train", "main"),
            "compare": (".experiments", "compare_main"), "reproduce": (".experiments", "reproduce_main"),
            "plot": (".experiments", "plot_main"), "cluster": (".cluster", "main")}


def make_parser() -> argparse.ArgumentParser:
    """The ``mpicoll`` command line: every command and its options."""
    parser = _Parser(prog="mpicoll", description="MPI collectives for distributed SGD.")
    commands = parser.add_subparsers(dest="command", required=True)
    _bench_parser(commands)
    _bench_kernels_parser(commands)
    _bench_ps_parser(commands)
    _bench_gossip_parser(commands)
    _bench_torch_parser(commands)
    _bench_overlap_parser(commands)
    _bench_sandblaster_parser(commands)
    from .experiments import add_compare_parsers, add_reproduce_parser
    from .train import add_parser as add_train_parser
    add_train_parser(commands)
    add_compare_parsers(commands)
    add_reproduce_parser(commands)
    _info_parser(commands)
    from .cluster import add_parser as add_cluster_parser
    add_cluster_parser(commands)
    parser.commands = commands.choices            # each command's own parser, by name
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args, passthrough = parser.parse_known_args(argv)
    if passthrough and args.command not in ("compare", "cluster"):
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(passthrough)}")
    args.train_args = passthrough                  # compare hands them to every training run
    if args.command not in _RUNNERS:
        return info()
    module, function = _RUNNERS[args.command]
    run = getattr(importlib.import_module(module, __package__), function)     # each pulls in its dependencies
    if args.command not in _UNDER_MPIEXEC:
        return run(args)
    return _guarded(run, args)


# The commands whose ranks run one job together under mpiexec: a rank that stops on an error of its own ends
# the job at once, telling every other rank why (mpicoll.channel.watchdog), instead of leaving them to wait for it.
_UNDER_MPIEXEC = {"train", "bench", "bench-ps", "bench-gossip", "bench-torch", "bench-overlap", "bench-sandblaster"}


def _guarded(run, args) -> int:
    from mpi4py import MPI

    from .base import launcher
    from .channel import watchdog
    try:
        launcher.check_this_launch()
    except launcher.LaunchMismatch as error:    # every process is a job of its own: each says it, once
        print(f"mpicoll {args.command}: {error}", file=sys.stderr, flush=True)
        return 2
    watchdog.guard_job(MPI.COMM_WORLD)
    try:
        return run(args)
    except KeyboardInterrupt:                 # Ctrl-C reaches every rank: one line, not a traceback from each
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"mpicoll {args.command}: interrupted", file=sys.stderr, flush=True)
        return 130
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001 - whatever stops one rank must stop the job, saying why
        watchdog.job_failed(error)
        raise


if __name__ == "__main__":
    sys.exit(main())
