"""``mpicoll train``: distributed SGD on real data with any of mpicoll's training methods.

    mpiexec -n 4 mpicoll train --method allreduce-ring
    mpiexec -n 4 mpicoll train --method dcasgd --straggler 3=3 --output run.jsonl

Pieces: :mod:`.data` (digits, MNIST-1D or an .npz file, sharded per worker), the models
(:mod:`mpicoll.models`: softmax regression, MLP, CNN, torch modules, or your own over a flat vector),
:mod:`.run` (the table of methods, the checks before a run), one module per family of methods
(:mod:`.allreduce`, :mod:`.parameter_servers`, :mod:`.sgp`, :mod:`.lbfgs`; what they share in
:mod:`.common`), :mod:`.report` (progress bar and JSON-lines log), :mod:`.schedule` (learning rates).
"""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
from mpi4py import MPI

from .. import gossip, ps
from ..base import checkpoint, config
from ..base.errors import MpicollError, SetupError
from ..channel.watchdog import bounded
from .data import Dataset, load
from ..models.dense import MLP, Model, SoftmaxRegression
from .report import interrupted
from .run import METHODS, Family, Options, train

__all__ = ["METHODS", "Family", "Options", "train", "load", "Dataset", "Model", "SoftmaxRegression", "MLP",
           "main"]


def _array_namespace(device: str):
    if device == "cpu":
        return np
    from .. import arrays
    count, why = arrays.gpu_count()
    if count == 0 or "CuPy" not in why:
        raise SystemExit(f"--device cuda needs CuPy and a GPU: {why}")
    import cupy
    return cupy


def _torch_model(args, data, hidden, xp):
    try:
        import torch
    except ImportError:
        raise SystemExit("mpicoll train: --framework torch needs PyTorch: pip install -e '.[torch]'") from None
    from .. import compute
    from ..models.modules import make
    compute.share_torch_threads(torch)      # as for BLAS: this rank's share of the node, unless the user chose
    return make(args.model, data.features, data.classes, hidden, data.shape, xp)


def main(args) -> int:
    """The ``mpicoll train`` command (run under mpiexec)."""
    from .. import compute
    from ..models.dense import make
    comm = MPI.COMM_WORLD
    compute.limit_blas_threads()          # ranks sharing a node must not each start a thread per core
    try:                                 # the same on every rank: each stops, rank 0 says why
        data = load(args.data, seed=args.seed)
        xp = _array_namespace(args.device)
        hidden = _hidden_sizes(args.hidden)
        if args.framework == "torch":
            model = _torch_model(args, data, hidden, xp)
        else:
            model = make(args.model, data.features, data.classes, hidden, xp)
    except ValueError as error:
        if comm.Get_rank() == 0:
            print(f"mpicoll train: {error}", file=sys.stderr)
        return 2
    options = Options.from_args(args)
    if args.resume and not args.checkpoint:
        raise SystemExit("mpicoll train: --resume needs --checkpoint PREFIX (the prefix the earlier run used)")
    options = _relaunched(comm, options)
    try:
        train(comm, options, model, data, xp)
    except KeyboardInterrupt:            # Ctrl-C reaches every rank: one line, from the rank that reports
        if comm.Get_rank() == METHODS[options.method].reporting_rank(options):
            print(interrupted(options), file=sys.stderr, flush=True)
        return 130
    except SetupError as error:          # raised on every rank alike: say it once, stop them all
        if comm.Get_rank() == 0:
            print(f"mpicoll train: {error}", file=sys.stderr)
        return 2
    except MpicollError as error:        # a lost peer, a mismatch: each rank says what it saw, in one line
        print(f"mpicoll train: rank {comm.Get_rank()}: {error}", file=sys.stderr, flush=True)
        return 1                         # a broken communicator ends the job at exit (mpicoll.base.failure)
    return 0


def _relaunched(comm, options: Options) -> Options:
    """The options of a job ``scripts/launch --restarts`` relaunched after it lost a rank (``MPICOLL_RESTART``):
    resume from --checkpoint's files where the lost launch wrote any, start over where it wrote none (its log
    is continued, or replaced, alike).  Rank 0 looks and says which, once."""
    attempt = config.restart()
    if not attempt:
        return options
    found = bool(checkpoint.existing(options.checkpoint)) if options.checkpoint and comm.Get_rank() == 0 else False
    with bounded(comm, "agreeing how to restart"):
        found = comm.bcast(found)
    if comm.Get_rank() == 0:
        how = ("resuming from --checkpoint " + options.checkpoint if found else
               "starting over: the launch before wrote no checkpoint" if options.checkpoint else
               "starting over: without --checkpoint PREFIX nothing was saved to resume from")
        print(f"mpicoll train: relaunch {attempt} on {comm.Get_size()} ranks, {how}", file=sys.stderr, flush=True)
    return replace(options, resume=options.resume or found, overwrite=not found)


def _hidden_sizes(text: str) -> list[int] | None:
    """``--hidden 128,64`` as [128, 64] (None when not given), or a ValueError saying what it takes."""
    if not text:
        return None
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--hidden {text}: give positive layer widths separated by commas, e.g. 128,64")
    return sizes


def _bytes(text: str) -> int:
    import argparse
    from ..base.config import parse_bytes
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_parser(commands) -> None:
    train_ = commands.add_parser(
        "train", help="distributed SGD on real data with any training method (run under mpiexec)",
        description="Run under mpiexec, e.g.: mpiexec -n 4 mpicoll train --method allreduce-ring")
    train_.add_argument("--method", "--algorithm", default="allreduce-ring", choices=METHODS, dest="method",
                        help="the training method (default allreduce-ring; sequential: plain SGD on one "
                        "process, the reference); --algorithm is its old name")
    train_.add_argument("--data", metavar="digits|mnist1d|FILE.npz",
                        help="scikit-learn's digits (default), MNIST-1D (generated, no download), or an .npz "
                        "file with arrays X, y (optional X_test, y_test); the first two: pip install -e '.[data]'")
    train_.add_argument("--model", default="softmax", choices=("softmax", "mlp", "cnn"),
                        help="softmax regression (default), an MLP, or a small 1-D CNN (numpy, or torch's "
                        "with --framework torch)")
    train_.add_argument("--framework", default="numpy", choices=("numpy", "torch"),
                        help="numpy's models (default) or torch modules (pip install -e '.[torch]'); every "
                        "method trains either")
    train_.add_argument("--hidden", default="", help="MLP hidden sizes, e.g. 64 or 128,64 (default 64)")
    train_.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the model computes: cpu (default, numpy or torch's CPU) or cuda (CuPy arrays, "
                        "or torch's CUDA tensors with --framework torch; one GPU per rank)")
    train_.add_argument("--epochs", type=int, default=10, help="passes over the training set (default 10)")
    train_.add_argument("--batch", type=int, default=32, help="samples per gradient per worker (default 32)")
    train_.add_argument("--lr", type=float, default=0.1, help="learning rate (default 0.1)")
    train_.add_argument("--lr-schedule", default="constant", metavar="constant|cosine|step:F1,F2",
                        help="the rate over the run's budget, the same curve for every method: constant (default), "
                        "cosine, or step:0.5,0.75 (/10 at half and three quarters)")
    train_.add_argument("--model-parallel", type=int, default=1, metavar="K",
                        help="allreduce methods: cut the model into K stages on K ranks (pipelined, "
                        "mpicoll.modelparallel); the ranks make N/K replicas (default 1: no cut)")
    train_.add_argument("--max-rank-memory", type=_bytes, default=0, metavar="BYTES",
                        help="allreduce methods: refuse to start if a rank would hold more training state than "
                        "this (parameters, gradient, allreduce result, a batch's activations), e.g. 16M; with "
                        "--model-parallel K a rank holds only its stage's (default: no limit)")
    train_.add_argument("--compression", choices=("fp16", "bf16", "powersgd", "int8"),
                        help="allreduce methods: move the gradients as 16-bit floats, half the bytes of float32, or "
                        "as PowerSGD's low-rank factors of each weight matrix (docs/compression.md); localsgd and "
                        "diloco: their pseudo-gradients as fp16, bf16 or int8 (one byte), with error feedback")
    train_.add_argument("--error-feedback", action="store_true",
                        help="with --compression fp16 or bf16: carry each step's rounding into the next step's "
                        "gradient (PowerSGD always does)")
    train_.add_argument("--powersgd-rank", type=int, default=2, metavar="R",
                        help="with --compression powersgd: the rank of each matrix's approximation (default 2)")
    train_.add_argument("--powersgd-start", type=int, default=10, metavar="STEPS",
                        help="with --compression powersgd: steps averaged exactly before compressing (default 10)")
    train_.add_argument("--distributed-optimizer", action="store_true",
                        help="with --framework torch and an allreduce method: average the gradients with "
                        "mpicoll.torch.DistributedOptimizer (buckets started during backward, compressed as "
                        "--compression says) and step with torch's SGD, as a torch program would")
    train_.add_argument("--seed", type=int, default=0,
                        help="seeds the initial weights, the data order and the data split (default 0): the "
                        "same seed gives every method the same start")
    train_.add_argument("--straggler", help="RANK=FACTOR: make that rank FACTOR times slower, e.g. 3=3")
    train_.add_argument("--delay", metavar="DIST", help="add to every step of every rank a sleep drawn from "
                        "DIST (ms, seeded): gamma:SHAPE,SCALE, exp:MEAN or fixed:MS, e.g. gamma:2,1.5")
    train_.add_argument("--output", metavar="RUN.jsonl", help="one JSON record per evaluation, then a summary; an existing file is refused unless "
                        "--overwrite (--resume appends to it)")
    train_.add_argument("--quiet", action="store_true", help="no progress bar")
    train_.add_argument("--checkpoint", metavar="PREFIX", help="save the state after every epoch under PREFIX")
    train_.add_argument("--resume", action="store_true", help="continue from --checkpoint's files")
    train_.add_argument("--elastic", action="store_true",
                        help="allreduce methods and sgp: go on without ranks that die (MPI's fault tolerance: Open MPI's "
                        "mpiexec --with-ft ulfm); the survivors agree on the last step all completed, divide the "
                        "rest of the data among them and go on (docs/elastic.md)")
    train_.add_argument("--min-ranks", type=int, default=1, metavar="N",
                        help="with --elastic: stop, naming the last checkpoint, once fewer than N ranks remain "
                        "(default 1)")
    train_.add_argument("--overwrite", action="store_true",
                        help="let a fresh run replace an earlier run's --checkpoint files and --output log "
                        "(refused otherwise)")
    group = train_.add_argument_group("parameter servers (ps-*, dcasgd, downpour, ringmaster, rescaled, "
                                      "sandblaster-lbfgs)")
    group.add_argument("--servers", type=int, default=1, help="server ranks (default 1); sandblaster-lbfgs: "
                       "server shards after the coordinator (rank 0)")
    group.add_argument("--softsync-k", type=float, default=0.5, help="ps-softsync: first K gradients per round, "
                       "a count or a fraction of the workers (default 0.5)")
    group.add_argument("--staleness", default="tau", choices=("none", "tau", "workers"),
                       help="ps-async: scale the rate by 1/tau, 1/W, or not (default tau)")
    group.add_argument("--lam", type=float, default=0.04, help="dcasgd: compensation strength (default 0.04)")
    group.add_argument("--adaptive", action="store_true", help="dcasgd: DC-ASGD-a")
    group.add_argument("--ringmaster-r", type=int, default=0, metavar="R",
                       help="ringmaster: drop a gradient computed R or more updates ago, before it moves (default "
                       "0: R = the number of workers)")
    group.add_argument("--n-fetch", type=int, default=1, help="downpour: fetch every N steps")
    group.add_argument("--n-push", type=int, default=1, help="downpour: push every N steps")
    group.add_argument("--warm-start", type=int, default=0, help="downpour: updates by one worker before the rest")
    group.add_argument("--transport", default="p2p", choices=ps.TRANSPORTS,
                       help="how ranks exchange parameters and gradients: p2p messages (default) or onesided "
                       "windows (MPI RMA); the parameter servers' pulls and pushes, and SGP's gossip")
    group = train_.add_argument_group("low communication (localsgd, diloco: replicas that meet every --sync-every "
                                      "steps; docs/low-communication.md)")
    group.add_argument("--sync-every", type=int, default=16, metavar="H",
                       help="inner steps between the replicas' meetings (default 16)")
    group.add_argument("--inner-optimizer", default="sgd", choices=("sgd", "adamw"),
                       help="each replica's own optimizer, at --lr (default sgd)")
    group.add_argument("--inner-momentum", type=float, default=0.0, help="the inner SGD's momentum (default 0)")
    group.add_argument("--weight-decay", type=float, default=0.0, help="the inner optimizer's (default 0)")
    group.add_argument("--outer-lr", type=float, default=0.7, help="diloco: the outer SGD's rate (default 0.7)")
    group.add_argument("--outer-momentum", type=float, default=0.9,
                       help="diloco: the outer SGD's momentum (default 0.9, Nesterov's)")
    group.add_argument("--no-nesterov", dest="nesterov", action="store_false",
                       help="diloco: plain momentum in the outer step")
    group.add_argument("--fragments", type=int, default=1, metavar="F",
                       help="streaming: cut the model into F fragments of whole layers, each meeting at its own "
                       "offset in the H steps (default 1)")
    group.add_argument("--overlap", type=int, default=0, metavar="TAU",
                       help="streaming: inner steps a fragment's sum travels, overlapped, before it is applied "
                       "(default 0)")
    group.add_argument("--mix", type=float, default=0.0,
                       help="streaming: a replica's own share of a fragment after its meeting (default 0: the "
                       "shared weights')")
    group = train_.add_argument_group("Sandblaster L-BFGS (sandblaster-lbfgs: rank 0 coordinates, --servers "
                                      "shards, the rest compute gradients)")
    group.add_argument("--history", type=int, default=10, help="L-BFGS pairs kept (default 10)")
    group.add_argument("--lbfgs-batch", type=int, default=0, metavar="ROWS",
                       help="rows per L-BFGS iteration, drawn afresh each iteration (default 0: the whole "
                       "training set, full-batch L-BFGS); --epochs counts passes of gradient evaluation")
    group.add_argument("--portions", type=int, default=0,
                       help="pieces each gradient evaluation is cut into and handed to workers as they become "
                       "free (default 0: 4 per worker)")
    group.add_argument("--no-backup", dest="backup", action="store_false",
                       help="no backup copies of the slowest portions (on by default)")
    group = train_.add_argument_group("stochastic gradient push (sgp)")
    group.add_argument("--mailbox", dest="transport", choices=gossip.MAILBOXES,
                       help="--transport's old name for sgp (how gossip arrives: p2p or onesided)")
    group.add_argument("--graph", default="time-varying-exponential",
                       choices=("time-varying-exponential", "exponential", "ring", "complete"),
                       help="whom each rank sends to: time-varying-exponential (default, SGP's: one peer per round, "
                       "i + 2^(k mod log2 p)), exponential (i + 1, i + 2, i + 4, ... every round), ring, complete")
    group.add_argument("--tau", type=int, default=0, help="rounds a gossip message may stay in flight (default 0)")
