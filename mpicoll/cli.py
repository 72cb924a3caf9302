"""The ``mpicoll`` command: a table of subcommands (:data:`COMMANDS`), each parser beside its command.

``train``, ``bench``, ``bench-ps``, ``bench-gossip``, ``bench-torch``, ``bench-overlap``, ``bench-sandblaster`` and
``info`` run under mpiexec; ``compare``, ``plot``, ``reproduce`` and ``bench-kernels`` in one process; ``cluster``
builds an emulated cluster."""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys

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


def add_info_parser(commands) -> None:
    commands.add_parser("info", help="versions, MPI library, auto rules, kernel backends, GPU and CUDA-awareness")


def info(args=None) -> int:
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


# Every subcommand, in the order --help lists them: the module that holds it, the function there that adds its
# parser, and the one that runs it (each module pulls in its own dependencies when its command runs).
COMMANDS = {
    "bench": (".benchmarks.collectives", "add_parser", "run"),
    "bench-kernels": (".benchmarks.kernels", "add_parser", "run"),
    "bench-ps": (".benchmarks.parameter_servers", "add_parser", "run"),
    "bench-gossip": (".benchmarks.gossip", "add_parser", "run"),
    "bench-torch": (".benchmarks.torch_collectives", "add_parser", "run"),
    "bench-overlap": (".benchmarks.overlap", "add_parser", "run"),
    "bench-sandblaster": (".benchmarks.sandblaster", "add_parser", "run"),
    "train": (".train", "add_parser", "main"),
    "compare": (".experiments", "add_compare_parser", "compare_main"),
    "plot": (".experiments", "add_plot_parser", "plot_main"),
    "reproduce": (".experiments", "add_reproduce_parser", "reproduce_main"),
    "info": (".cli", "add_info_parser", "info"),
    "cluster": (".cluster", "add_parser", "main"),
}


def _part(command: str, which: int):
    module, *functions = COMMANDS[command]
    return getattr(importlib.import_module(module, __package__), functions[which])


def make_parser() -> argparse.ArgumentParser:
    """The ``mpicoll`` command line: every command and its options."""
    parser = _Parser(prog="mpicoll", description="MPI collectives for distributed SGD.")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        _part(command, 0)(commands)
    parser.commands = commands.choices            # each command's own parser, by name
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args, passthrough = parser.parse_known_args(argv)
    if passthrough and args.command not in ("compare", "cluster"):
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(passthrough)}")
    args.train_args = passthrough                  # compare hands them to every training run
    run = _part(args.command, 1)
    if args.command not in _UNDER_MPIEXEC:
        return run(args)
    return _guarded(run, args)


# The commands whose ranks run one job together under mpiexec: a rank that stops on an error of its own ends
# the job at once, telling every other rank why (mpicoll.channel.watchdog), instead of leaving them to wait for it.
_UNDER_MPIEXEC = {"train", "bench", "bench-ps", "bench-gossip", "bench-torch", "bench-overlap", "bench-sandblaster"}


def _guarded(run, args) -> int:
    import faulthandler

    from mpi4py import MPI

    from .base import launcher
    from .channel import watchdog
    faulthandler.enable()       # a crash inside MPI (a segmentation fault) prints where each Python thread was
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
